"""Qwen3-Next's hybrid decoder: Gated DeltaNet linear attention interleaved with gated full attention.

config.json `layer_types` names each layer 'linear_attention' (megarl/models/gated_delta_net.py) or
'full_attention' (grouped-query attention whose `q_proj` also gives a per-head output gate, sigmoid(gate) times the
attention output: Megatron's attention_output_gate). Every RMSNorm of the model but the GDN's own output norm is
zero-centered (weight applied as 1 + w: Megatron's layernorm_zero_centered_gamma), q/k norms included. This module
gives the Megatron config fields, the checks, the weight table rows and the layer specs of that layout; the
registry entry switches it on (`Architecture.hybrid_linear_attention`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megarl.bridge.mappings import Direct, GatedDeltaNetInProj, GatedQKV, Mapping, Sections
from megarl.errors import UserError
from megarl.models.hf_config import head_dim, num_kv_heads
from megarl.models.weight_table import HF_LAYER, MCORE_LAYER

LINEAR, FULL = "linear_attention", "full_attention"


def check_hybrid_supported(hf_config) -> None:
    """Settings the Megatron model would compute differently, refused with the key and the reason."""
    types, layers = list(getattr(hf_config, "layer_types", None) or []), hf_config.num_hidden_layers
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise UserError(
            f"config.json layer_types={types!r} must name each of the {layers} layers {LINEAR!r} or {FULL!r}"
        )
    key_heads, value_heads = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if value_heads % key_heads:
        raise UserError(
            f"config.json linear_num_value_heads={value_heads} must be a multiple of linear_num_key_heads={key_heads}"
        )


def check_sglang_layer_kinds(hf_config, key: str) -> None:
    """SGLang 0.5.23 builds layer i as full attention when (i + 1) % config.json `full_attention_interval` == 0 and
    does not read `layer_types`: refuse a checkpoint it would build otherwise (rollout.backend=sglang). Without
    `layer_types` in config.json transformers derives them from full_attention_interval and drops the key: nothing
    to compare then (the published checkpoints)."""
    interval = getattr(hf_config, "full_attention_interval", None)
    if interval is None:
        return
    layers = hf_config.num_hidden_layers
    served = [
        FULL if isinstance(interval, int) and interval > 0 and (i + 1) % interval == 0 else LINEAR
        for i in range(layers)
    ]
    if list(hf_config.layer_types) != served:
        raise UserError(
            f"{key}: config.json full_attention_interval={interval!r} with layer_types={list(hf_config.layer_types)!r} "
            "cannot be served by SGLang (rollout.backend=sglang): SGLang 0.5.23 makes every "
            "full_attention_interval-th layer full attention and reads no layer_types; set full_attention_interval "
            "to match layer_types, or use rollout.backend=hf"
        )


def hybrid_config(hf_config) -> dict[str, Any]:
    """Megatron `TransformerConfig` fields of the hybrid layout (megatron/core/transformer/transformer_config.py)."""
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(t == LINEAR) for t in hf_config.layer_types],  # 1: GDN, 0: full attention
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
    )


def hybrid_attention_mappings(hf_config, split_in_proj: bool = False) -> list[Mapping]:
    """Both token mixers' rows: each binds only in the layers whose Megatron module has that parameter.

    split_in_proj: the GDN's input projection is stored as Qwen3.5 stores it (Architecture.gdn_split_in_proj)."""
    m, attn, gdn = MCORE_LAYER + "self_attention.", HF_LAYER + "self_attn.", HF_LAYER + "linear_attn."
    nk, dk = hf_config.linear_num_key_heads, hf_config.linear_key_head_dim
    nv, dv = hf_config.linear_num_value_heads, hf_config.linear_value_head_dim
    in_proj_sections = (nk * dk, nk * dk, nv * dv, nv * dv, nv, nv)
    if split_in_proj:  # [q, k, v], z, b, a: Megatron's kinds in its order, each tensor one or more whole kinds
        in_proj: Mapping = Sections(
            m + "in_proj.weight",
            tuple(gdn + f"in_proj_{kinds}.weight" for kinds in ("qkv", "z", "b", "a")),
            sections=in_proj_sections,
            sections_per_hf_tensor=(3, 1, 1, 1),
        )
    else:
        in_proj = GatedDeltaNetInProj(
            m + "in_proj.weight",
            (gdn + "in_proj_qkvz.weight", gdn + "in_proj_ba.weight"),
            sections=in_proj_sections,
            num_key_heads=nk,
            key_head_dim=dk,
            num_value_heads=nv,
            value_head_dim=dv,
        )
    return [
        Direct(MCORE_LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        GatedQKV(
            m + "linear_qkv.weight",
            tuple(attn + f"{x}_proj.weight" for x in "qkv"),
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads(hf_config),
            head_dim=head_dim(hf_config),
        ),
        Direct(m + "linear_proj.weight", (attn + "o_proj.weight",), tp_dim=1),
        Direct(m + "q_layernorm.weight", (attn + "q_norm.weight",)),
        Direct(m + "k_layernorm.weight", (attn + "k_norm.weight",)),
        in_proj,
        Sections(m + "conv1d.weight", (gdn + "conv1d.weight",), sections=in_proj_sections[:3]),
        Direct(m + "A_log", (gdn + "A_log",), tp_dim=0),
        Direct(m + "dt_bias", (gdn + "dt_bias",), tp_dim=0),
        Direct(m + "out_norm.weight", (gdn + "norm.weight",)),
        Direct(m + "out_proj.weight", (gdn + "out_proj.weight",), tp_dim=1),
    ]


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight w multiplies as 1 + w, in fp32 (HF `Qwen3NextRMSNorm`; Megatron's zero-centered gamma):
    the local layer spec's norm where Megatron's torch norm refuses zero-centered weights."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        from megarl.models.gated_delta_net import param_device

        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=param_device()))
        self.weight.sequence_parallel = config.sequence_parallel  # its gradient is summed over the TP group
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def hybrid_layer_specs(block, config, use_te: bool, layer_offset: int):
    """The decoder block of a hybrid model: GDN layers get megarl's GatedDeltaNet as token mixer, with a separate
    input norm (nothing fused into its in_proj, so checkpoints name it `input_layernorm` under every spec); full
    attention layers keep the GPT spec. Local specs swap every norm for the zero-centered one."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.models.gated_delta_net import gated_delta_net_spec

    norm = _norm(use_te)
    pattern = config.linear_attention_freq
    layers = []
    for index, spec in enumerate(block.layer_specs):
        sub = spec.submodules
        if pattern[layer_offset + index]:
            # nothing is fused into the GDN's in_proj: its input norm keeps its own name under every spec
            keys = {k: v for k, v in (sub.sharded_state_dict_keys_map or {}).items() if k != "input_layernorm."}
            sub = replace(
                sub, input_layernorm=norm, self_attention=gated_delta_net_spec(use_te), sharded_state_dict_keys_map=keys
            )
        if not use_te:
            attention = sub.self_attention
            if attention.module is not None and not pattern[layer_offset + index]:
                attention = replace(
                    attention, submodules=replace(attention.submodules, q_layernorm=norm, k_layernorm=norm)
                )
            sub = replace(sub, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention)
        layers.append(ModuleSpec(module=spec.module, params=spec.params, submodules=sub))
    block.layer_specs = layers
    if not use_te:
        block.layer_norm = norm
    return block


def _norm(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm  # zero-centered from the config
    return ZeroCenteredRMSNorm
