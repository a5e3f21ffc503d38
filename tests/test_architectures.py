"""The architecture registry: lookup, per-family flags, unsupported settings and parallel layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.errors import UserError
from megarl.models.hf_config import config_from_dict, rope_parameters
from megarl.models.layout import check_parallel_layout
from megarl.models.registry import get_architecture, supported_model_types
from megarl.models.rope import rope_inv_freq
from megarl.runtime.parallel import ParallelConfig
from megarl.testing.tiny_checkpoint import tiny_config


def hf_config(name: str, **overrides):
    return config_from_dict({**tiny_config(name), **overrides})


def test_unknown_model_type_lists_the_supported_ones():
    supported = (
        "deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2, qwen3, qwen3_5_moe, qwen3_5_moe_text, "
        "qwen3_moe, qwen3_next"
    )
    with pytest.raises(UserError, match=f"model_type='gpt2' is not supported; supported: {supported}"):
        get_architecture("gpt2")
    assert supported_model_types() == supported.split(", ")


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("tiny-llama", dict(qkv_bias=False, proj_bias=False, mlp_bias=False, qk_norm=False, tied_embeddings=False)),
        ("tiny-llama-bias", dict(qkv_bias=True, proj_bias=True, mlp_bias=True, qk_norm=False, tied_embeddings=True)),
        ("tiny-qwen2", dict(qkv_bias=True, proj_bias=False, mlp_bias=False, qk_norm=False, tied_embeddings=True)),
        ("tiny-qwen3", dict(qkv_bias=False, proj_bias=False, mlp_bias=False, qk_norm=True, tied_embeddings=False)),
        # GLM-4.5: attention_bias gives q/k/v biases only; use_qk_norm switches qk-norm
        ("tiny-glm4-moe", dict(qkv_bias=True, proj_bias=False, mlp_bias=False, qk_norm=True, tied_embeddings=False)),
        ("tiny-glm4-moe", dict(qk_norm=False, use_qk_norm=False)),
    ],
)
def test_family_flags(name, flags):
    config = hf_config(name, **{k: flags.pop(k) for k in list(flags) if k.startswith("use_")})
    features = get_architecture(config.model_type).features(config)
    assert {key: getattr(features, key) for key in flags} == flags


def test_transformer_config_fields():
    config = hf_config("tiny-qwen3")
    spec = get_architecture("qwen3").to_mcore(config)
    fields = spec.config_kwargs
    assert (fields["num_query_groups"], fields["kv_channels"], fields["qk_layernorm"]) == (2, 32, True)
    assert fields["layernorm_epsilon"] == 1e-6 and fields["add_qkv_bias"] is False
    assert spec.gpt_kwargs["rotary_base"] == 1e6 and spec.gpt_kwargs["share_embeddings_and_output_weights"] is False


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("tiny-llama", {"attention_bias": True}, "attention_bias=True with mlp_bias=False is not supported"),
        ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=True is not supported"),
        ("tiny-qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; valid: silu"),
        (
            "tiny-qwen3",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type='dynamic' is not supported",
        ),
        # GLM-4.5 routes as DeepSeek-V3 does: Megatron-Core renormalizes the chosen sigmoid scores
        ("tiny-glm4-moe", {"norm_topk_prob": False}, "norm_topk_prob=false"),
    ],
)
def test_unsupported_settings_are_refused(name, overrides, message):
    config = hf_config(name, **overrides)
    with pytest.raises(UserError, match=message):
        get_architecture(config.model_type).to_mcore(config)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            ParallelConfig(tp=3),
            r"tp=3 does not divide num_attention_heads=4, num_key_value_heads=2, intermediate_size=128; valid: 1, 2",
        ),
        (ParallelConfig(tp=4), r"tp=4 does not divide .* valid: 1, 2"),
        (
            ParallelConfig(pp=3),
            r"pp=3 x vpp=1 does not divide num_hidden_layers=4 into equal stages; valid pp with vpp=1: 1, 2, 4",
        ),
        (ParallelConfig(pp=4, vpp=2), r"valid pp with vpp=2: 1, 2, or give the first/last stage fewer layers"),
    ],
)
def test_impossible_layouts_name_the_valid_values(parallel, message):
    with pytest.raises(UserError, match=message):
        check_parallel_layout(get_architecture("llama"), hf_config("tiny-llama"), parallel)


def test_possible_layouts_pass():
    for parallel in [ParallelConfig(tp=2, pp=2), ParallelConfig(pp=2, vpp=2), ParallelConfig(pp=4)]:
        check_parallel_layout(get_architecture("llama"), hf_config("tiny-llama"), parallel)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("tiny-llama", {}),  # llama3 scaling with its own low/high frequency factors
        ("tiny-qwen3", {}),  # default, theta 1e6, explicit head_dim
        ("tiny-qwen2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}),
        ("tiny-glm4-moe", {}),  # partial: RoPE on the first half of each head
    ],
)
def test_rope_frequencies_match_transformers(name, overrides):
    config = hf_config(name, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = rope_parameters(config)
    ours = rope_inv_freq(int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope)
    assert torch.allclose(ours, model.model.rotary_emb.inv_freq, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("parallel", "key", "message"),
    [
        (ParallelConfig(tp=0), "parallel", "parallel.tp=0 must be >= 1"),
        (ParallelConfig(cp=0), "actor.model.parallel", "actor.model.parallel.cp=0 must be >= 1"),
        (ParallelConfig(etp=0), "parallel", "parallel.etp=0 must be >= 1 (or unset: the same as tp)"),
        (ParallelConfig(vpp=2), "parallel", "parallel.vpp=2 needs pipeline parallelism (parallel.pp > 1)"),
        (
            ParallelConfig(sequence_parallel=True),
            "critic.model.parallel",
            "critic.model.parallel.sequence_parallel=true needs critic.model.parallel.tp > 1",
        ),
        (ParallelConfig(pp=1, vpp=2), "--", "--vpp=2 needs pipeline parallelism (--pp > 1)"),  # the convert CLI
    ],
)
def test_parallel_config_rejects_bad_sizes(parallel, key, message):
    # Construction does not validate (the config loader builds first, then checks with the full key): check does.
    with pytest.raises(UserError) as error:
        parallel.check(key)
    assert message in str(error.value)


def test_parallel_config_accepts_good_sizes():
    for parallel in [ParallelConfig(), ParallelConfig(tp=2, pp=2, vpp=2, ep=4, etp=1, sequence_parallel=True)]:
        parallel.check("parallel")


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        (
            "tiny-mixtral",
            {},
            dict(moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_topk=2),
        ),
        ("tiny-qwen3-moe", {"norm_topk_prob": False}, dict(moe_router_pre_softmax=True, moe_layer_freq=[1, 0, 1, 1])),
        (
            "tiny-deepseek-v3",
            {},
            dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,
                moe_router_num_groups=4,
                moe_router_group_topk=2,
                moe_router_topk_scaling_factor=2.5,
                moe_shared_expert_intermediate_size=32,
                moe_layer_freq=[0, 1, 1, 1],
                moe_router_dtype="fp32",
            ),
        ),
        ("tiny-deepseek-v3-lite", {}, dict(moe_router_num_groups=None, q_lora_rank=None, rope_type="rope")),
        (
            "tiny-glm4-moe",
            {},
            dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_num_groups=None,
                moe_router_topk_scaling_factor=2.5,
                moe_shared_expert_intermediate_size=32,
                moe_layer_freq=[0, 1, 1, 1],
                add_qkv_bias=True,
                add_bias_linear=False,
                qk_layernorm=True,
                kv_channels=32,
            ),
        ),
        # Kimi K2: config.json says model_type kimi_k2 (and points at remote code megarl never runs)
        ("tiny-kimi-k2", {}, dict(moe_router_num_groups=None, moe_router_topk_scaling_factor=2.827, rope_type="yarn")),
    ],
)
def test_moe_routing_settings(name, overrides, expected):
    config = hf_config(name, **overrides)
    fields = get_architecture(config.model_type).to_mcore(config).config_kwargs
    assert {key: fields[key] for key in expected} == expected


def test_partial_rotary_embedding():
    spec = get_architecture("glm4_moe").to_mcore(hf_config("tiny-glm4-moe"))  # head_dim 32, partial_rotary_factor 0.5
    assert spec.gpt_kwargs["rotary_percent"] == 0.5 and spec.rope_inv_freq.shape == (8,)


def test_yarn_settings_for_mla():
    fields = get_architecture("deepseek_v3").to_mcore(hf_config("tiny-deepseek-v3")).config_kwargs
    assert fields["rope_type"] == "yarn" and fields["rotary_scaling_factor"] == 4.0
    assert (fields["original_max_position_embeddings"], fields["mscale"], fields["mscale_all_dim"]) == (64, 1.0, 1.0)
    assert (fields["qk_head_dim"], fields["qk_pos_emb_head_dim"], fields["v_head_dim"]) == (16, 8, 16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok=2 with topk_group=2: Megatron-Core would score each expert"),
        ({"topk_group": 5}, "topk_group=5 exceeds n_group=4; valid: 1..4"),
        ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"rope_interleave": False}, "rope_interleave=false is not supported"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and n_routed_experts=8"),
    ],
)
def test_deepseek_settings_megatron_cannot_reproduce(overrides, message):
    config = hf_config("tiny-deepseek-v3", **overrides)
    with pytest.raises(UserError, match=message):
        get_architecture("deepseek_v3").to_mcore(config)


@pytest.mark.parametrize(
    ("name", "parallel", "message"),
    [
        ("tiny-deepseek-v3", ParallelConfig(ep=3), r"ep=3 does not divide n_routed_experts=8; valid: 1, 2, 4, 8"),
        ("tiny-mixtral", ParallelConfig(etp=5), r"etp=5 does not divide intermediate_size=96"),
        ("tiny-qwen3", ParallelConfig(ep=2), r"ep=2 needs a mixture-of-experts model; qwen3 is dense"),
        (
            "tiny-deepseek-v3",
            ParallelConfig(tp=3),
            r"tp=3 does not divide num_attention_heads=4, intermediate_size=128",
        ),
    ],
)
def test_impossible_expert_layouts(name, parallel, message):
    config = hf_config(name)
    with pytest.raises(UserError, match=message):
        check_parallel_layout(get_architecture(config.model_type), config, parallel)
