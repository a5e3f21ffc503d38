"""Megatron-Core layer specs: local (non-TE) modules on CPU, Transformer Engine modules where TE and CUDA exist.

Checkpoints must not depend on the spec. Transformer Engine fuses some RMSNorms into the following linear layer and
names their weights after it; local specs keep separate norm modules. Every local layer spec therefore carries a
keys map that writes those norms under TE's names, per layer kind (Megatron's own local spec maps the pre-MLP norm
even in MoE layers, where TE does not fuse it). The bridge reads the same table backwards to accept TE names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Literal

import torch

from megarl.models.sdpa_attention import SDPACoreAttention

SpecBackend = Literal["auto", "local", "te"]

# local parameter prefix -> the Transformer Engine parameter prefix that holds the same weight
FUSED_INTO_QKV = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
FUSED_INTO_MLA_UP = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
FUSED_INTO_DENSE_FC1 = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
TE_TO_LOCAL = {
    te: local for table in (FUSED_INTO_QKV, FUSED_INTO_MLA_UP, FUSED_INTO_DENSE_FC1) for local, te in table.items()
}


def transformer_engine_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def uses_transformer_engine(backend: SpecBackend) -> bool:
    return backend == "te" or (backend == "auto" and transformer_engine_available())


def decoder_block_spec(config, backend: SpecBackend, vp_stage: int | None):
    """The layer specs of the decoder layers this pipeline stage (and virtual stage) builds."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = uses_transformer_engine(backend)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not use_te:
        block.layer_specs = [_local_layer_spec(spec, config) for spec in block.layer_specs]
    if config.experimental_attention_variant == "gated_delta_net":  # Qwen3-Next's hybrid layers
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from megarl.models.linear_attention import hybrid_layer_specs

        block = hybrid_layer_specs(block, config, use_te, get_transformer_layer_offset(config, vp_stage=vp_stage))
    return block


def _local_layer_spec(spec, config):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    submodules = spec.submodules
    keys_map = dict(FUSED_INTO_MLA_UP if config.multi_latent_attention else FUSED_INTO_QKV)
    if submodules.mlp.module is not MoELayer:
        keys_map.update(FUSED_INTO_DENSE_FC1)
    attention = submodules.self_attention
    # Megatron's local core attention needs equal key and value head sizes (MLA's differ) and cannot run packed
    # sequences: SDPA does both.
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=SDPACoreAttention))
    return replace(spec, submodules=replace(submodules, self_attention=attention, sharded_state_dict_keys_map=keys_map))
