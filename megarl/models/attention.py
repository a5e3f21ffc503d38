"""Attention variants of the registry's families: grouped-query attention (Llama, Qwen, Mixtral) and Multi-head
Latent Attention (DeepSeek-V2/V3). Each gives its Megatron config fields and its part of the weight table."""

from __future__ import annotations

from typing import Any

from megarl.bridge.mappings import QKV, TP_DIM_FROM_MODEL, Direct, Mapping
from megarl.errors import UserError
from megarl.models.hf_config import head_dim, num_kv_heads, rope_parameters
from megarl.models.weight_table import HF_LAYER, MCORE_LAYER


def gqa_config(hf_config, qkv_bias: bool, qk_norm: bool) -> dict[str, Any]:
    return dict(
        num_query_groups=num_kv_heads(hf_config),
        kv_channels=head_dim(hf_config),
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
    )


def gqa_mappings(hf_config, qkv_bias: bool, proj_bias: bool, qk_norm: bool, sinks: bool = False) -> list[Mapping]:
    m, h = MCORE_LAYER + "self_attention.", HF_LAYER + "self_attn."
    heads = dict(
        num_heads=hf_config.num_attention_heads, num_kv_heads=num_kv_heads(hf_config), head_dim=head_dim(hf_config)
    )
    table: list[Mapping] = [
        Direct(MCORE_LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        QKV(m + "linear_qkv.weight", tuple(h + f"{x}_proj.weight" for x in "qkv"), **heads),
        Direct(m + "linear_proj.weight", (h + "o_proj.weight",), tp_dim=1),
    ]
    if qkv_bias:
        table.append(QKV(m + "linear_qkv.bias", tuple(h + f"{x}_proj.bias" for x in "qkv"), **heads))
    if proj_bias:
        table.append(Direct(m + "linear_proj.bias", (h + "o_proj.bias",)))
    if sinks:  # one logit per query head: TP splits heads
        table.append(Direct(m + "core_attention.softmax_offset", (h + "sinks",), tp_dim=0))
    if qk_norm:
        table += [
            Direct(m + "q_layernorm.weight", (h + "q_norm.weight",)),
            Direct(m + "k_layernorm.weight", (h + "k_norm.weight",)),
        ]
    return table


def check_mla_supported(hf_config) -> None:
    """MLA settings Megatron-Core computes differently from the HF model are refused, with the reason."""
    if not getattr(hf_config, "rope_interleave", True):
        raise UserError(
            "config.json rope_interleave=false is not supported: Megatron-Core's MLA rotates interleaved pairs"
        )
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in ("default", "yarn"):
        raise UserError(f"config.json rope_type={rope['rope_type']!r} is not supported with MLA; valid: default, yarn")
    if rope["rope_type"] == "yarn":
        if not rope.get("truncate", True) or rope.get("attention_factor") is not None:
            raise UserError("config.json YaRN truncate=false or an explicit attention_factor is not supported with MLA")
        if rope.get("mscale", 1) not in (None, 1, 1.0) and not rope.get("mscale_all_dim"):
            raise UserError("config.json YaRN mscale without mscale_all_dim is not supported with MLA")


def mla_config(hf_config) -> dict[str, Any]:
    rope = rope_parameters(hf_config)
    kwargs: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,  # None: queries come straight from the hidden state (V2-Lite)
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        qk_layernorm=True,  # Megatron's switch for MLA's RMSNorms on the compressed q and kv
        rotary_base=rope["rope_theta"],
    )
    if rope["rope_type"] == "yarn":
        factor = rope.get("factor") or hf_config.max_position_embeddings / rope["original_max_position_embeddings"]
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=float(factor),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 1.0),
            # also scales the softmax, as HF's DeepSeek attention does: (0.1 mscale_all_dim ln(factor) + 1)^2
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )
    else:
        kwargs.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return kwargs


def mla_mappings(hf_config) -> list[Mapping]:
    m, h = MCORE_LAYER + "self_attention.", HF_LAYER + "self_attn."
    # Down projections are column-parallel in Megatron's local spec and replicated in the TE spec: take the split
    # from the model. Up projections split whole heads (rows are head-major on both sides).
    table: list[Mapping] = [Direct(MCORE_LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",))]
    if hf_config.q_lora_rank:
        table += [
            Direct(m + "linear_q_down_proj.weight", (h + "q_a_proj.weight",), tp_dim=TP_DIM_FROM_MODEL),
            Direct(m + "q_layernorm.weight", (h + "q_a_layernorm.weight",)),
            Direct(m + "linear_q_up_proj.weight", (h + "q_b_proj.weight",), tp_dim=0),
        ]
    else:
        table.append(Direct(m + "linear_q_proj.weight", (h + "q_proj.weight",), tp_dim=0))
    table += [
        Direct(m + "linear_kv_down_proj.weight", (h + "kv_a_proj_with_mqa.weight",), tp_dim=TP_DIM_FROM_MODEL),
        Direct(m + "kv_layernorm.weight", (h + "kv_a_layernorm.weight",)),
        Direct(m + "linear_kv_up_proj.weight", (h + "kv_b_proj.weight",), tp_dim=0),
        Direct(m + "linear_proj.weight", (h + "o_proj.weight",), tp_dim=1),
    ]
    return table
