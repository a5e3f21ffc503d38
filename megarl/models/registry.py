"""The architecture registry: one entry per HF model family, looked up by config.json `model_type`."""

from __future__ import annotations

from megarl.errors import UserError
from megarl.models.architecture import Architecture
from megarl.models.moe import MoE, RoutingLayout, after_first_k_dense, every_layer, qwen_sparse_layers

_SLIDING = "sliding-window attention is not implemented by Megatron-Core's local attention"

_MXFP4 = (
    "the published gpt-oss checkpoints store their experts in MXFP4, which megarl does not read; use a bf16 copy "
    "(transformers: from_pretrained with quantization_config=Mxfp4Config(dequantize=True), then save_pretrained)"
)

_GATED_BIAS = (
    "the published checkpoints have no attention biases and megarl's gated q_proj mapping carries weights only; "
    "valid: false"
)

DEEPSEEK_V3_MOE = MoE(
    num_experts_key="n_routed_experts",
    score="sigmoid",
    sparse_layers=after_first_k_dense,
    shared_experts_key="n_shared_experts",
)
"""DeepSeek-V3's routing (sigmoid scores, a selection bias, group-limited top-k, scaled weights), first k layers dense,
shared experts: also GLM-4.5's, whose HF router is the same code."""

QWEN3_NEXT_MOE = MoE(
    num_experts_key="num_experts",
    sparse_layers=qwen_sparse_layers,
    shared_expert_ffn_key="shared_expert_intermediate_size",
    hf_shared_experts="shared_expert",
    shared_expert_gate=True,
)
"""Qwen3-Next's experts: softmax top-k, one shared expert of its own width behind a sigmoid gate; also Qwen3.5's
(whose config has no mlp_only_layers, decoder_sparse_step or norm_topk_prob: every layer sparse, top-k always
renormalized, as the defaults read)."""

_MTP = {r"^mtp\.": "multi-token prediction"}
"""The published Qwen3-Next and Qwen3.5 checkpoints' MTP block (`mtp.*`), which transformers does not load either."""

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in [
        Architecture("llama", ("llama",)),
        Architecture("qwen2", ("qwen2",), qkv_bias_always=True, unsupported={"use_sliding_window": _SLIDING}),
        Architecture("qwen3", ("qwen3",), qk_norm=True, unsupported={"use_sliding_window": _SLIDING}),
        Architecture(
            "mixtral",
            ("mixtral",),
            moe=MoE(
                num_experts_key="num_local_experts",
                expert_ffn_key="intermediate_size",
                hf_block="block_sparse_moe",
                hf_expert_names=("w1", "w3", "w2"),
                sparse_layers=every_layer,
            ),
            unsupported={"sliding_window": _SLIDING},
        ),
        Architecture(
            "qwen3_moe",
            ("qwen3_moe",),
            qk_norm=True,
            moe=MoE(num_experts_key="num_experts", sparse_layers=qwen_sparse_layers),
            unsupported={"use_sliding_window": _SLIDING},
            sglang_unsupported={"mlp_only_layers": "SGLang 0.5.23 builds every Qwen3-MoE layer as a MoE layer"},
        ),
        Architecture(
            "deepseek_v3",
            ("deepseek_v3", "kimi_k2"),  # Kimi K2: DeepSeek-V3's architecture (hf_config.MODEL_TYPE_ALIASES)
            mla=True,
            moe=DEEPSEEK_V3_MOE,
            mtp_layers_key="num_nextn_predict_layers",
            # SGLang's DeepseekV2 loader fuses these into fused_qkv_a_proj_with_mqa (q_lora_rank set)
            load_groups=(("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),),
        ),
        Architecture(
            "glm4_moe",
            ("glm4_moe",),
            qk_norm="use_qk_norm",
            output_bias_from_attention_bias=False,  # attention_bias: q/k/v biases, no output projection bias
            moe=DEEPSEEK_V3_MOE,
            mtp_layers_key="num_nextn_predict_layers",
        ),
        Architecture(
            "gpt_oss",
            ("gpt_oss",),
            attention_sinks=True,
            layer_types=True,  # alternating sliding-window (128) and full attention
            mlp_bias_always=True,  # router and experts; attention_bias gives q/k/v/o theirs
            clamped_swiglu=True,
            hf_attn_implementation="eager",
            moe=MoE(
                num_experts_key="num_local_experts",
                expert_ffn_key="intermediate_size",
                hf_router="router",
                stacked_experts=True,
                sparse_layers=every_layer,
            ),
            unsupported={"quantization_config": _MXFP4},
        ),
        Architecture(
            "qwen3_next",
            ("qwen3_next",),
            qk_norm=True,
            hybrid_linear_attention=True,
            moe=QWEN3_NEXT_MOE,
            unsupported={"attention_bias": _GATED_BIAS},
            carried_hf_tensors=_MTP,
        ),
        Architecture(
            "qwen3_5_moe",
            # the published vision-language checkpoints (hf_config.VISION_LANGUAGE: their language model) and
            # text-only ones
            ("qwen3_5_moe", "qwen3_5_moe_text"),
            qk_norm=True,
            hybrid_linear_attention=True,
            gdn_split_in_proj=True,
            moe=QWEN3_NEXT_MOE,
            unsupported={"attention_bias": _GATED_BIAS},
            carried_hf_tensors={r"^model\.visual\.": "the vision tower", **_MTP},
        ),
    ]
}


def supported_model_types() -> list[str]:
    return sorted(t for arch in ARCHITECTURES.values() for t in arch.hf_model_types)


def get_architecture(model_type: str | None) -> Architecture:
    """The entry for a config.json `model_type`, or a UserError listing the supported ones."""
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    raise UserError(
        f"config.json model_type={model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )


def required_hf_attn_implementation(hf_config) -> str | None:
    """The transformers attention kernel a family must run with (Architecture.hf_attn_implementation); None for the
    others, model_types megarl does not train included."""
    for arch in ARCHITECTURES.values():
        if getattr(hf_config, "model_type", None) in arch.hf_model_types:
            return arch.hf_attn_implementation
    return None


def routing_layout(hf_config) -> RoutingLayout | None:
    """The routing a token takes through this model (MoE layers, experts, top-k); None for a dense model."""
    moe = get_architecture(getattr(hf_config, "model_type", None)).moe
    return moe.routing_layout(hf_config) if moe is not None else None
