"""Parameter counts of a model, whole and per rank, from its config.json through megarl's architecture registry.

A model is described as the list of Megatron parameters it builds (`ParamSpec`), grouped by where they live: the
embedding (first pipeline stage), each decoder layer, the final norm and output layer (last stage). Each spec says
how the parameter splits across ranks, so the same list gives the whole count (TP=1, as a meta-device model built
by megarl/models/builder.py has it; tests check the two agree), one rank's share at any layout, and the bytes of
the HF tensors a weight sync sends.

Splits (`Split`):
- "tp": cut across tensor-parallel ranks (column- or row-parallel linear layers, their column-parallel biases).
- "replicated": every TP rank holds all of it (norms, row-parallel biases, the router, the value head).
- "expert": one routed expert's weights, `count` experts in the layer; expert-parallel ranks hold
  num_experts / ep experts each, each cut across etp ranks.
- "vocab": embedding / output-layer rows, the vocabulary padded to a multiple of vocab_multiple x tp, cut over tp.

Where the spec backend matters: Transformer Engine (GPU default) keeps MLA's down projections (q_a, kv_a) whole
on every TP rank; Megatron's local spec (CPU) makes them column-parallel.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megarl.errors import UserError
from megarl.runtime.stages import StageLayout

Split = Literal["tp", "replicated", "expert"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2, "float": 4, "half": 2}


def dtype_bytes(name: str | None, default: int = 4) -> int:
    """Bytes per element of a dtype name (config.json `torch_dtype`, a role's `model.dtype`)."""
    if not name:
        return default
    return _DTYPE_BYTES.get(str(name).removeprefix("torch."), default)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    numel: int
    """Elements of the whole tensor (of one expert, for split="expert")."""
    split: Split
    count: int = 1
    """How many such tensors the layer has (routed experts); 1 otherwise."""

    def total(self) -> int:
        return self.numel * self.count

    def per_rank(self, tp: int, ep: int, etp: int) -> int:
        if self.split == "tp":
            return self.numel // tp
        if self.split == "expert":
            return self.numel * (self.count // ep) // etp
        return self.numel


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a model: its parameters by place, and the sizes activations and the KV
    cache depend on."""

    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    layers: tuple[tuple[ParamSpec, ...], ...]
    """The parameters of each decoder layer, in order."""
    final_norm: int
    tied_embeddings: bool
    hf_dtype_bytes: int
    """Bytes per element of the HF checkpoint's weights (what a weight sync sends)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """GQA: the key/value head size. MLA: qk_nope + qk_rope head size."""
    v_head_dim: int
    mla: dict[str, int] | None
    """MLA sizes (q_lora_rank (0 = none), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim), None for GQA."""
    ffn_hidden_size: int
    moe: dict[str, int] | None
    """num_experts, topk, expert_ffn, shared_ffn (0 = none), shared_gate (0/1: a sigmoid gate on the shared expert,
    Qwen3-Next), expert_bias (0/1), stacked (0/1: the HF checkpoint stores a layer's experts as tensors stacked over
    experts, gpt-oss); None for dense models."""
    sparse_layers: tuple[bool, ...]
    qk_norm: bool
    hf_extra_numel: int = 0
    """Parameters in the HF checkpoint that the Megatron model does not hold (multi-token-prediction layers): carried
    by conversion, never trained nor synced."""
    kv_layers: int | None = None
    """Layers that keep a KV cache per token when served: all of them (None), or the full-attention ones of a
    hybrid model (Qwen3-Next: its Gated DeltaNet layers keep a fixed-size state per request instead)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def padded_vocab(self, vocab_multiple: int, tp: int) -> int:
        step = vocab_multiple * tp
        return -(-self.vocab_size // step) * step

    def layer_total(self, index: int) -> int:
        return sum(p.total() for p in self.layers[index])

    def expert_total(self) -> int:
        return sum(p.total() for layer in self.layers for p in layer if p.split == "expert")


# -- building the shape from config.json ----------------------------------------------------------------------------


def load_config_json(path: str | Path, key: str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{key}: {path} does not exist (a model's config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{key}: {path} is not readable JSON ({err})") from err
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UserError(f"{key}: {path} has no model_type; expected a Hugging Face config.json")
    return raw


def hf_config_from_dict(raw: dict[str, Any]):
    """The transformers config object the registry reads (defaults and key renames applied as when training)."""
    from megarl.models.hf_config import config_from_dict
    from megarl.models.registry import get_architecture

    get_architecture(raw.get("model_type"))  # a clear error for unsupported families first
    return config_from_dict(raw)


def model_shape(hf_config, spec_backend: str = "te") -> ModelShape:
    """The Megatron parameters of `hf_config`'s model, as its registry entry builds it.

    spec_backend: "te" (GPU, also "auto") or "local" (CPU); it only changes how MLA down projections split.
    """
    from megarl.models.hf_config import head_dim, num_kv_heads
    from megarl.models.registry import get_architecture

    arch = get_architecture(hf_config.model_type)
    arch.check_supported(hf_config)
    feats = arch.features(hf_config)
    h = hf_config.hidden_size
    bias_linear = feats.proj_bias or feats.mlp_bias  # Megatron's one switch (add_bias_linear)
    sparse = arch.moe.sparse_layers(hf_config) if arch.moe else [False] * hf_config.num_hidden_layers
    if arch.mla:
        mla = dict(
            q_lora_rank=int(hf_config.q_lora_rank or 0),
            kv_lora_rank=int(hf_config.kv_lora_rank),
            qk_nope_head_dim=int(hf_config.qk_nope_head_dim),
            qk_rope_head_dim=int(hf_config.qk_rope_head_dim),
        )
        attention = _mla_params(h, hf_config.num_attention_heads, mla, int(hf_config.v_head_dim), spec_backend)
        qk_dim, v_dim, kv_heads = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], int(hf_config.v_head_dim), 1
    else:
        mla = None
        qk_dim = v_dim = head_dim(hf_config)
        kv_heads = num_kv_heads(hf_config)
        attention = _gqa_params(h, hf_config.num_attention_heads, kv_heads, qk_dim, feats, bias_linear)
        if arch.hybrid_linear_attention:  # the gate rows of q_proj: one more set of query heads
            attention[1] = ParamSpec(
                "linear_qkv", (2 * hf_config.num_attention_heads + 2 * kv_heads) * qk_dim * h, "tp"
            )
        if arch.attention_sinks:  # one logit per head (gpt-oss)
            attention.append(ParamSpec("core_attention.softmax_offset", hf_config.num_attention_heads, "tp"))
    moe = None
    if arch.moe:
        expert_ffn = int(getattr(hf_config, arch.moe.expert_ffn_key))
        shared = int(getattr(hf_config, arch.moe.shared_experts_key, 0) or 0) if arch.moe.shared_experts_key else 0
        shared_ffn = shared * expert_ffn
        if arch.moe.shared_expert_ffn_key:  # one shared expert of its own width (Qwen3-Next)
            shared_ffn = int(getattr(hf_config, arch.moe.shared_expert_ffn_key, 0) or 0)
        moe = dict(
            num_experts=arch.moe.num_experts(hf_config),
            topk=int(hf_config.num_experts_per_tok),
            expert_ffn=expert_ffn,
            shared_ffn=shared_ffn,
            shared_gate=int(arch.moe.shared_expert_gate and shared_ffn > 0),
            # sigmoid routing keeps a per-expert selection bias: a Megatron buffer, a HF tensor
            expert_bias=int(arch.moe.score == "sigmoid"),
            stacked=int(arch.moe.stacked_experts),
        )
    linear = [t == "linear_attention" for t in hf_config.layer_types] if arch.hybrid_linear_attention else []
    layers = []
    for index, is_sparse in enumerate(sparse):
        mlp = (
            _moe_params(h, moe, bias_linear)
            if is_sparse
            else _mlp_params(h, arch.ffn_hidden_size(hf_config), bias_linear)
        )
        mixer = _gated_delta_net_params(hf_config) if linear and linear[index] else attention
        layers.append((*mixer, ParamSpec("pre_mlp_layernorm", h, "replicated"), *mlp))
    mtp = int(getattr(hf_config, arch.mtp_layers_key, 0) or 0) if arch.mtp_layers_key else 0
    notes = ()
    extra = 0
    if mtp:
        # An MTP layer (DeepSeek-V3) is a decoder layer like the last one, its own embedding and output head, a
        # projection of [embedding; hidden] (2h -> h) and three norms.
        vocab = int(hf_config.vocab_size)
        extra = mtp * (sum(p.total() for p in layers[-1]) + 2 * vocab * h + 2 * h * h + 3 * h)
        notes = (f"{mtp} multi-token-prediction layer(s) ({extra / 1e9:.1f} B parameters) are carried, not trained",)
    if linear:
        notes += (
            f"{sum(linear)} of {len(linear)} layers are Gated DeltaNet: no KV cache, a fixed state per request in "
            "the engine (not planned), and their activations are planned as attention layers' (an upper bound)",
        )
    if moe and moe["stacked"]:
        # gate_up_proj [experts, hidden, 2 x ffn]: built whole on the first expert rank at every weight sync
        stacked_gb = moe["num_experts"] * h * 2 * moe["expert_ffn"] * dtype_bytes(_dtype_name(hf_config)) / 2**30
        notes += (
            f"experts are stored stacked: each weight sync builds one whole {stacked_gb:.2f} GB tensor on the first "
            "expert-parallel rank of each stage (beyond the memory above)",
        )
    return ModelShape(
        architecture=arch.name,
        hidden_size=h,
        vocab_size=int(hf_config.vocab_size),
        num_layers=int(hf_config.num_hidden_layers),
        layers=tuple(layers),
        final_norm=h,
        tied_embeddings=feats.tied_embeddings,
        hf_dtype_bytes=dtype_bytes(_dtype_name(hf_config)),
        num_heads=int(hf_config.num_attention_heads),
        num_kv_heads=kv_heads,
        head_dim=qk_dim,
        v_head_dim=v_dim,
        mla=mla,
        ffn_hidden_size=arch.ffn_hidden_size(hf_config),
        moe=moe,
        sparse_layers=tuple(sparse),
        qk_norm=feats.qk_norm,
        hf_extra_numel=extra,
        notes=notes,
        kv_layers=len(linear) - sum(linear) if linear else None,
    )


def _dtype_name(hf_config) -> str | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if value is None else str(value)


def _gqa_params(h: int, heads: int, kv_heads: int, dim: int, feats, bias_linear: bool) -> list[ParamSpec]:
    qkv_rows = (heads + 2 * kv_heads) * dim
    specs = [
        ParamSpec("input_layernorm", h, "replicated"),
        ParamSpec("linear_qkv", qkv_rows * h, "tp"),
        ParamSpec("linear_proj", h * heads * dim, "tp"),
    ]
    if feats.qkv_bias:
        specs.append(ParamSpec("linear_qkv.bias", qkv_rows, "tp"))
    if bias_linear:
        specs.append(ParamSpec("linear_proj.bias", h, "replicated"))
    if feats.qk_norm:
        specs += [ParamSpec("q_layernorm", dim, "replicated"), ParamSpec("k_layernorm", dim, "replicated")]
    return specs


def _gated_delta_net_params(hf_config) -> list[ParamSpec]:
    """A Gated DeltaNet token mixer (Qwen3-Next's linear_attention layers, megarl/models/gated_delta_net.py)."""
    h, kernel = hf_config.hidden_size, hf_config.linear_conv_kernel_dim
    qk = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
    v_heads, v_dim = hf_config.linear_num_value_heads, hf_config.linear_value_head_dim
    return [
        ParamSpec("input_layernorm", h, "replicated"),
        ParamSpec("in_proj", (2 * qk + 2 * v_heads * v_dim + 2 * v_heads) * h, "tp"),  # q, k, v, z, b, a
        ParamSpec("conv1d", (2 * qk + v_heads * v_dim) * kernel, "tp"),
        ParamSpec("A_log", v_heads, "tp"),
        ParamSpec("dt_bias", v_heads, "tp"),
        ParamSpec("out_norm", v_dim, "replicated"),
        ParamSpec("out_proj", v_heads * v_dim * h, "tp"),
    ]


def _mla_params(h: int, heads: int, mla: dict[str, int], v_dim: int, spec_backend: str) -> list[ParamSpec]:
    down: Split = "tp" if spec_backend == "local" else "replicated"
    nope, rope, q_lora, kv_lora = (
        mla["qk_nope_head_dim"],
        mla["qk_rope_head_dim"],
        mla["q_lora_rank"],
        mla["kv_lora_rank"],
    )
    specs = [ParamSpec("input_layernorm", h, "replicated")]
    if q_lora:
        specs += [
            ParamSpec("linear_q_down_proj", q_lora * h, down),
            ParamSpec("q_layernorm", q_lora, "replicated"),
            ParamSpec("linear_q_up_proj", heads * (nope + rope) * q_lora, "tp"),
        ]
    else:
        specs.append(ParamSpec("linear_q_proj", heads * (nope + rope) * h, "tp"))
    specs += [
        ParamSpec("linear_kv_down_proj", (kv_lora + rope) * h, down),
        ParamSpec("kv_layernorm", kv_lora, "replicated"),
        ParamSpec("linear_kv_up_proj", heads * (nope + v_dim) * kv_lora, "tp"),
        ParamSpec("linear_proj", h * heads * v_dim, "tp"),
    ]
    return specs


def _mlp_params(h: int, ffn: int, bias: bool, prefix: str = "mlp") -> list[ParamSpec]:
    specs = [ParamSpec(f"{prefix}.linear_fc1", 2 * ffn * h, "tp"), ParamSpec(f"{prefix}.linear_fc2", h * ffn, "tp")]
    if bias:
        specs += [
            ParamSpec(f"{prefix}.linear_fc1.bias", 2 * ffn, "tp"),
            ParamSpec(f"{prefix}.linear_fc2.bias", h, "replicated"),
        ]
    return specs


def _moe_params(h: int, moe: dict[str, int], bias: bool) -> list[ParamSpec]:
    experts, ffn = moe["num_experts"], moe["expert_ffn"]
    specs = [ParamSpec("router", experts * h, "replicated")]
    if bias:
        specs.append(ParamSpec("router.bias", experts, "replicated"))
    per_expert = 3 * ffn * h + (2 * ffn + h if bias else 0)
    specs.append(ParamSpec("experts", per_expert, "expert", count=experts))
    if moe["shared_ffn"]:
        specs += _mlp_params(h, moe["shared_ffn"], bias, prefix="shared_experts")
    if moe.get("shared_gate"):
        specs.append(ParamSpec("shared_experts.gate_weight", h, "replicated"))
    return specs


# -- counting --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds."""

    dense: int
    """Non-expert parameters (data-parallel over dp x cp)."""
    expert: int
    """Routed-expert parameters (data-parallel over the expert-DP ranks)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    ep: int = 1,
    etp: int = 1,
    stage: int = 0,
    first: int | None = None,
    last: int | None = None,
    vocab_multiple: int = 128,
    head: str = "lm",
) -> StageParams:
    """Parameters one rank of pipeline stage `stage` holds at this layout (TP=PP=EP=1: the whole model); first/last:
    the layers of uneven first/last stages (ParallelConfig.pp_first_stage_layers/pp_last_stage_layers)."""
    dense = expert = 0
    for layer in StageLayout(pp, vpp, first, last).stage_layers(shape.num_layers, stage):
        for spec in shape.layers[layer]:
            count = spec.per_rank(tp, ep, etp)
            if spec.split == "expert":
                expert += count
            else:
                dense += count
    vocab_rows = shape.padded_vocab(vocab_multiple, tp) // tp
    if stage == 0:
        dense += vocab_rows * shape.hidden_size
    if stage == pp - 1:
        dense += shape.final_norm
        if head == "value":
            dense += shape.hidden_size  # one number per position, replicated
        elif not shape.tied_embeddings or pp > 1:
            # Tied and pp > 1: the last stage keeps its own copy of the embedding as the output layer.
            dense += vocab_rows * shape.hidden_size
    return StageParams(dense, expert)


def count_parameters(shape: ModelShape, vocab_multiple: int = 128, head: str = "lm") -> int:
    """Parameters of the whole Megatron model (TP=PP=1, padded vocabulary): a meta-device build's count."""
    return stage_params(shape, vocab_multiple=vocab_multiple, head=head).total


def hf_numel(shape: ModelShape, head: str = "lm", layers: Iterable[int] | None = None) -> tuple[int, int]:
    """(dense, expert) elements of the HF tensors an export writes: unpadded vocabulary, no tied output layer, no
    MTP layers. With `layers`, only those decoder layers (plus embedding/head when layers is None)."""
    dense = expert = 0
    chosen = range(shape.num_layers) if layers is None else layers
    for layer in chosen:
        for spec in shape.layers[layer]:
            if spec.split == "expert":
                expert += spec.total()
            else:
                dense += spec.total()
        if shape.moe and shape.sparse_layers[layer] and shape.moe["expert_bias"]:
            dense += shape.moe["num_experts"]  # the selection bias: a buffer in Megatron, a tensor in HF
    if layers is None:
        dense += shape.vocab_size * shape.hidden_size + shape.final_norm
        if head == "value":
            dense += shape.hidden_size
        elif not shape.tied_embeddings:
            dense += shape.vocab_size * shape.hidden_size
    return dense, expert
