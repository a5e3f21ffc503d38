"""An architecture entry: how one HF model family becomes a Megatron-Core GPT model, and its weight table.

Families differ by flags on one `Architecture` class, never by copies of it: attention is grouped-query or latent
(MLA), the MLP dense or mixture-of-experts (an `MoE` value), plus a few checkpoint details. The contract
(docs/architecture.md): `to_mcore(hf_config) -> McoreModelSpec` and `mappings(hf_config) -> list[Mapping]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megarl.bridge.mappings import Direct, Mapping, VocabRows
from megarl.errors import UserError
from megarl.models.attention import check_mla_supported, gqa_config, gqa_mappings, mla_config, mla_mappings
from megarl.models.heads import Head, head_mappings
from megarl.models.hf_config import head_dim, rope_parameters
from megarl.models.linear_attention import (
    check_hybrid_supported,
    check_sglang_layer_kinds,
    hybrid_attention_mappings,
    hybrid_config,
)
from megarl.models.moe import MoE
from megarl.models.rope import attention_softmax_scale, rope_inv_freq
from megarl.models.weight_table import HF_LAYER, MCORE_LAYER, swiglu_mappings

ACTIVATIONS = {"silu": F.silu}
QUICK_GELU_ALPHA = 1.702
"""The sigmoid gain of Megatron-Core's quick_gelu."""
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Features:
    """What a particular checkpoint of a family uses: read from its config.json once."""

    qkv_bias: bool
    proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied_embeddings: bool


@dataclass(frozen=True)
class McoreModelSpec:
    """Everything needed to build the Megatron-Core model of a checkpoint (parallel layout excluded)."""

    config_kwargs: dict[str, Any]
    """`TransformerConfig` (or `MLATransformerConfig`) fields that describe the model itself."""
    gpt_kwargs: dict[str, Any]
    """`GPTModel` constructor arguments other than config, spec and pre/post-process."""
    rope_inv_freq: torch.Tensor | None
    """RoPE inverse frequencies computed as the HF model does (models/rope.py); None where Megatron's attention
    module owns its RoPE (MLA)."""

    @property
    def mla(self) -> bool:
        return bool(self.config_kwargs.get("multi_latent_attention"))

    @property
    def moe(self) -> bool:
        return bool(self.config_kwargs.get("num_moe_experts"))


@dataclass(frozen=True)
class Architecture:
    """A HF model family built as a Megatron-Core GPT model. Flags say how it differs from plain Llama."""

    name: str
    hf_model_types: tuple[str, ...]
    qk_norm: bool | str = False
    """RMSNorm on each query and key head before RoPE: True always (Qwen3), or the config.json key that switches it
    on (GLM-4.5: `use_qk_norm`)."""
    qkv_bias_always: bool = False
    """q/k/v projections carry a bias whatever config.json says (Qwen2); otherwise `attention_bias` decides."""
    output_bias_from_attention_bias: bool = True
    """`attention_bias` also gives the attention output projection a bias (Llama); GLM-4.5's covers q/k/v only."""
    mlp_bias_always: bool = False
    """The MLP (router and experts) carries biases whatever config.json says (gpt-oss)."""
    attention_sinks: bool = False
    """A learned logit per head joins each attention softmax's denominator and reads no value (gpt-oss
    `self_attn.sinks`): Megatron's softmax_type='learnable' (`core_attention.softmax_offset`)."""
    layer_types: bool = False
    """config.json `layer_types` gives each layer's attention: 'sliding_attention' (a query reads the last
    `sliding_window` positions, itself included) or 'full_attention' (gpt-oss): Megatron's window_size and
    window_attn_skip_freq."""
    clamped_swiglu: bool = False
    """gpt-oss's expert activation, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
    (config.json `swiglu_alpha`, `swiglu_limit`; `hidden_act` is not read): Megatron's gated quick_gelu (alpha
    1.702 built in) with glu_linear_offset=1 and activation_func_clamp_value=limit."""
    hf_attn_implementation: str | None = None
    """The transformers attention kernel the hf engine runs this family with, whatever rollout.hf.attn_implementation
    says (gpt-oss: 'eager', transformers' only CPU path for its sinks; it refuses 'sdpa'); None: the configured one."""
    hybrid_linear_attention: bool = False
    """Qwen3-Next: config.json `layer_types` interleaves Gated DeltaNet linear attention ('linear_attention',
    megarl/models/gated_delta_net.py) with full attention whose q_proj also gives a sigmoid output gate; every RMSNorm
    but the GDN's output norm is zero-centered (1 + w). megarl/models/linear_attention.py."""
    gdn_split_in_proj: bool = False
    """The Gated DeltaNet's input projection is stored as four tensors in Megatron's own order of kinds (Qwen3.5:
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), not grouped per key head (Qwen3-Next: `in_proj_qkvz`,
    `in_proj_ba`)."""
    mla: bool = False
    """Multi-head Latent Attention (DeepSeek-V2/V3) instead of grouped-query attention."""
    moe: MoE | None = None
    """Mixture-of-experts layout and routing; None for dense families."""
    mtp_layers_key: str | None = None
    """config.json key counting multi-token-prediction layers, stored after the decoder layers in the checkpoint.
    Megatron training does not use them yet: conversion carries them through unchanged."""
    unsupported: dict[str, Any] = field(default_factory=dict)
    """config.json keys whose truthy values this family's Megatron model cannot reproduce, with the reason."""
    sglang_unsupported: dict[str, Any] = field(default_factory=dict)
    """config.json keys whose truthy values SGLang (the pinned release) cannot serve, with the reason: refused at
    pre-flight for rollout.backend=sglang (found by tests/test_sglang_contract.py)."""
    load_groups: tuple[tuple[str, ...], ...] = ()
    """Tensors an inference engine fuses at load time, only when they arrive in the same load call: name suffixes
    under one common prefix. Weight sync keeps each group in one bucket (bridge/buckets.py)."""
    derived_hf_tensors: tuple[str, ...] = (r"\.rotary_emb\.inv_freq$",)
    """Regexes of tensors some checkpoints carry but that are recomputed from config.json (older transformers
    saved RoPE frequencies): skipped on import, and reported."""
    carried_hf_tensors: dict[str, str] = field(default_factory=dict)
    """Regexes of checkpoint tensors the Megatron model does not hold, with what they are (Qwen3.5: the vision
    tower, the multi-token-prediction block): carried through conversion and training checkpoints unchanged, as
    the layers past `mtp_layers_key` are."""

    def is_derived(self, hf_name: str) -> bool:
        return any(re.search(pattern, hf_name) for pattern in self.derived_hf_tensors)

    def carried_part(self, hf_name: str, hf_config) -> str | None:
        """What a tensor the Megatron model does not hold belongs to ('multi-token prediction', 'the vision
        tower'...); None for the model's own tensors."""
        for pattern, part in self.carried_hf_tensors.items():
            if re.search(pattern, hf_name):
                return part
        if self.mtp_layers_key:  # `model.layers.{i}.` with i past the decoder layers
            match = re.match(r"model\.layers\.(\d+)\.", hf_name)
            if match and int(match.group(1)) >= hf_config.num_hidden_layers:
                return "multi-token prediction"
        return None

    def is_carried(self, hf_name: str, hf_config) -> bool:
        return self.carried_part(hf_name, hf_config) is not None

    def check_sglang_supported(self, hf_config, key: str = "model.path") -> None:
        if self.hybrid_linear_attention:
            check_sglang_layer_kinds(hf_config, key)
        for name, reason in self.sglang_unsupported.items():
            if getattr(hf_config, name, None):
                raise UserError(
                    f"{key}: config.json {name}={getattr(hf_config, name)!r} cannot be served by SGLang "
                    f"(rollout.backend=sglang): {reason}; use rollout.backend=hf"
                )

    def features(self, hf_config) -> Features:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qk_norm = bool(getattr(hf_config, self.qk_norm, False)) if isinstance(self.qk_norm, str) else self.qk_norm
        return Features(
            qkv_bias=self.qkv_bias_always or attention_bias,
            proj_bias=attention_bias and self.output_bias_from_attention_bias,
            mlp_bias=self.mlp_bias_always or bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=qk_norm,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )

    def check_supported(self, hf_config) -> None:
        """Raise a UserError for config.json settings the Megatron model would silently get wrong."""
        for key, reason in self.unsupported.items():
            if getattr(hf_config, key, None):
                value = getattr(hf_config, key)
                raise UserError(f"config.json {key}={value!r} is not supported for {self.name}: {reason}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ACTIVATIONS and not self.clamped_swiglu:
            raise UserError(f"config.json hidden_act={act!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
        feats = self.features(hf_config)
        if feats.proj_bias != feats.mlp_bias and (feats.proj_bias or feats.mlp_bias):
            # Megatron-Core has one switch (add_bias_linear) for the output-projection and MLP biases.
            raise UserError(
                f"config.json attention_bias={feats.proj_bias} with mlp_bias={feats.mlp_bias} is not supported for "
                f"{self.name}: Megatron-Core adds the attention output bias and the MLP biases together"
            )
        if self.mla:
            check_mla_supported(hf_config)
        if self.hybrid_linear_attention:
            check_hybrid_supported(hf_config)
        self._check_variants(hf_config)
        if self.moe:
            self.moe.check_supported(hf_config)

    def ffn_hidden_size(self, hf_config) -> int:
        """The dense MLP's width (Megatron's ffn_hidden_size): config.json `intermediate_size`; a model whose every
        layer is sparse may have none (Qwen3.5), and then the experts' width stands in, unused."""
        width = getattr(hf_config, "intermediate_size", None)
        if width:
            return int(width)
        if self.moe is None or not all(self.moe.sparse_layers(hf_config)):
            raise UserError(f"config.json has no intermediate_size, which {self.name}'s dense MLP layers need")
        return int(getattr(hf_config, self.moe.expert_ffn_key))

    def _check_variants(self, hf_config) -> None:
        if self.clamped_swiglu:
            alpha, limit = getattr(hf_config, "swiglu_alpha", 1.702), getattr(hf_config, "swiglu_limit", 7.0)
            if alpha != QUICK_GELU_ALPHA:
                raise UserError(
                    f"config.json swiglu_alpha={alpha} is not supported for {self.name}: Megatron-Core's clamped "
                    f"SwiGLU (quick_gelu) has alpha {QUICK_GELU_ALPHA} built in"
                )
            if not isinstance(limit, int | float) or limit <= 0:
                raise UserError(f"config.json swiglu_limit={limit!r} must be a positive number")
        if self.layer_types:
            types, layers = list(hf_config.layer_types), hf_config.num_hidden_layers
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown or len(types) != layers:
                raise UserError(
                    f"config.json layer_types={types!r} must name each of the {layers} layers "
                    f"{' or '.join(map(repr, LAYER_TYPES))}"
                )
            window = getattr(hf_config, "sliding_window", None)
            if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
                raise UserError(f"config.json sliding_window={window!r} must be a positive number of positions")

    def _variant_kwargs(self, hf_config) -> dict[str, Any]:
        """Megatron fields of the attention sinks, sliding-window layers and clamped SwiGLU flags."""
        kwargs: dict[str, Any] = {}
        if self.attention_sinks:
            kwargs["softmax_type"] = "learnable"
        if self.layer_types and "sliding_attention" in hf_config.layer_types:
            # HF: the last sliding_window positions, the query's own included; Megatron and TE: (left, right)
            kwargs["window_size"] = (hf_config.sliding_window - 1, 0)
            kwargs["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in hf_config.layer_types]
        if self.clamped_swiglu:
            from megatron.core.activations import quick_gelu  # not at the top: the driver never imports Megatron

            kwargs.update(
                activation_func=quick_gelu,
                glu_linear_offset=1.0,
                activation_func_clamp_value=float(getattr(hf_config, "swiglu_limit", 7.0)),
            )
        return kwargs

    def to_mcore(self, hf_config) -> McoreModelSpec:
        self.check_supported(hf_config)
        feats = self.features(hf_config)
        rope = rope_parameters(hf_config)
        rotary_percent = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        config_kwargs = dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size(hf_config),
            num_attention_heads=hf_config.num_attention_heads,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=ACTIVATIONS[getattr(hf_config, "hidden_act", "silu")],
            add_bias_linear=feats.proj_bias or feats.mlp_bias,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
            init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
            attention_softmax_in_fp32=True,
            apply_query_key_layer_scaling=False,
            **(mla_config(hf_config) if self.mla else gqa_config(hf_config, feats.qkv_bias, feats.qk_norm)),
            **(self.moe.config_kwargs(hf_config) if self.moe else {}),
        )
        config_kwargs.update(self._variant_kwargs(hf_config))
        if self.hybrid_linear_attention:
            config_kwargs.update(hybrid_config(hf_config))
        gpt_kwargs = dict(
            max_sequence_length=hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_percent=rotary_percent,
            rotary_base=rope["rope_theta"],
            share_embeddings_and_output_weights=feats.tied_embeddings,
        )
        if self.mla:
            return McoreModelSpec(config_kwargs, gpt_kwargs, None)
        max_positions = hf_config.max_position_embeddings
        softmax_scale = attention_softmax_scale(rope, head_dim(hf_config), max_positions)
        if softmax_scale is not None:  # YaRN's factor on RoPE's cos and sin (models/rope.py)
            if rotary_percent != 1.0:  # the factor scales the rotated dimensions only: not one softmax scale
                raise UserError(
                    f"config.json rope_type={rope['rope_type']!r} with partial_rotary_factor={rotary_percent} is not "
                    f"supported for {self.name}: its attention factor scales the rotated dimensions only; valid: "
                    "partial_rotary_factor 1.0, or a rope_type without an attention factor (default, linear, llama3)"
                )
            config_kwargs["softmax_scale"] = softmax_scale
        inv_freq = rope_inv_freq(int(head_dim(hf_config) * rotary_percent), rope, max_positions)
        return McoreModelSpec(config_kwargs, gpt_kwargs, inv_freq)

    def mappings(self, hf_config, head: Head = "lm") -> list[Mapping]:
        """The weight table: embedding, each layer's tensors, final norm, output layer (or value head). Binding is
        driven by the model's parameters, so the dense-MLP rows bind only in dense layers and the expert rows in MoE
        layers."""
        feats = self.features(hf_config)
        if self.mla:
            attention = mla_mappings(hf_config)
        elif self.hybrid_linear_attention:
            attention = hybrid_attention_mappings(hf_config, self.gdn_split_in_proj)
        else:
            attention = gqa_mappings(hf_config, feats.qkv_bias, feats.proj_bias, feats.qk_norm, self.attention_sinks)
        return [
            VocabRows("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
            *attention,
            Direct(MCORE_LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
            *swiglu_mappings(MCORE_LAYER + "mlp.", HF_LAYER + "mlp.", bias=feats.mlp_bias),
            *(self.moe.mappings(bias=feats.mlp_bias) if self.moe else []),
            Direct("decoder.final_layernorm.weight", ("model.norm.weight",)),
            # A tied output layer exists as a parameter only on a last pipeline stage that lacks the embedding;
            # it reads the embedding and is never exported (the first stage exports the embedding).
            *head_mappings(
                VocabRows("output_layer.weight", ("model.embed_tokens.weight",), export=False)
                if feats.tied_embeddings
                else VocabRows("output_layer.weight", ("lm_head.weight",)),
                head,
            ),
        ]
