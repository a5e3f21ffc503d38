"""An architecture entry: how one HF model family becomes a Megatron-Core GPT model, and its weight table.

Families differ by flags on one `Architecture` class, never by copies of it. The contract (DESIGN.md):
`to_mcore(hf_config, ...) -> McoreModelSpec` and `mappings(hf_config) -> list[Mapping]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megarl.bridge.mappings import QKV, Direct, GateUp, Mapping, VocabRows
from megarl.errors import UserError
from megarl.models.hf_config import head_dim, num_kv_heads, rope_parameters
from megarl.models.rope import rope_inv_freq

ACTIVATIONS = {"silu": F.silu}

MCORE_LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


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
    """`TransformerConfig` fields that describe the model itself."""
    gpt_kwargs: dict[str, Any]
    """`GPTModel` constructor arguments other than config, spec and pre/post-process."""
    qk_norm: bool
    rope_inv_freq: torch.Tensor
    """RoPE inverse frequencies, computed as the HF model does (see models/rope.py)."""


@dataclass(frozen=True)
class Architecture:
    """A HF model family built as a Megatron-Core GPT model. Flags say how it differs from plain Llama."""

    name: str
    hf_model_types: tuple[str, ...]
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    qkv_bias_always: bool = False
    """q/k/v projections carry a bias whatever config.json says (Qwen2); otherwise `attention_bias` decides."""
    unsupported: dict[str, Any] = field(default_factory=dict)
    """config.json keys whose truthy values this family's Megatron model cannot reproduce, with the reason."""
    derived_hf_tensors: tuple[str, ...] = (r"\.rotary_emb\.inv_freq$",)
    """Regexes of tensors some checkpoints carry but that are recomputed from config.json (older transformers
    saved RoPE frequencies): skipped on import, and reported."""

    def is_derived(self, hf_name: str) -> bool:
        return any(re.search(pattern, hf_name) for pattern in self.derived_hf_tensors)

    def features(self, hf_config) -> Features:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return Features(
            qkv_bias=self.qkv_bias_always or attention_bias,
            proj_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=self.qk_norm,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )

    def check_supported(self, hf_config) -> None:
        """Raise a UserError for config.json settings the Megatron model would silently get wrong."""
        for key, reason in self.unsupported.items():
            if getattr(hf_config, key, None):
                raise UserError(
                    f"config.json {key}={getattr(hf_config, key)!r} is not supported for {self.name}: {reason}"
                )
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UserError(f"config.json hidden_act={act!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
        feats = self.features(hf_config)
        if feats.proj_bias != feats.mlp_bias and (feats.proj_bias or feats.mlp_bias):
            # Megatron-Core has one switch (add_bias_linear) for the output-projection and MLP biases.
            raise UserError(
                f"config.json attention_bias={feats.proj_bias} with mlp_bias={feats.mlp_bias} is not supported for "
                f"{self.name}: Megatron-Core adds the attention output bias and the MLP biases together"
            )

    def to_mcore(self, hf_config) -> McoreModelSpec:
        self.check_supported(hf_config)
        feats = self.features(hf_config)
        rope = rope_parameters(hf_config)
        rotary_percent = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        config_kwargs = dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=num_kv_heads(hf_config),
            kv_channels=head_dim(hf_config),
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=ACTIVATIONS[getattr(hf_config, "hidden_act", "silu")],
            add_bias_linear=feats.proj_bias or feats.mlp_bias,
            add_qkv_bias=feats.qkv_bias,
            qk_layernorm=feats.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
            init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
            attention_softmax_in_fp32=True,
            apply_query_key_layer_scaling=False,
        )
        gpt_kwargs = dict(
            max_sequence_length=hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_percent=rotary_percent,
            rotary_base=rope["rope_theta"],
            share_embeddings_and_output_weights=feats.tied_embeddings,
        )
        rotary_dim = int(head_dim(hf_config) * rotary_percent)
        return McoreModelSpec(config_kwargs, gpt_kwargs, feats.qk_norm, rope_inv_freq(rotary_dim, rope))

    def mappings(self, hf_config) -> list[Mapping]:
        """The weight table, in HF checkpoint order: embedding, each layer's tensors, final norm, output layer."""
        feats = self.features(hf_config)
        return [
            VocabRows("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
            *self._attention_mappings(hf_config, feats),
            *self._mlp_mappings(feats),
            Direct("decoder.final_layernorm.weight", ("model.norm.weight",)),
            # A tied output layer exists as a parameter only on a last pipeline stage that lacks the embedding;
            # it reads the embedding and is never exported (the first stage exports the embedding).
            VocabRows("output_layer.weight", ("model.embed_tokens.weight",), export=False)
            if feats.tied_embeddings
            else VocabRows("output_layer.weight", ("lm_head.weight",)),
        ]

    def _attention_mappings(self, hf_config, feats: Features) -> list[Mapping]:
        m, h = MCORE_LAYER, HF_LAYER
        heads = dict(
            num_heads=hf_config.num_attention_heads, num_kv_heads=num_kv_heads(hf_config), head_dim=head_dim(hf_config)
        )
        table: list[Mapping] = [
            Direct(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
            QKV(
                m + "self_attention.linear_qkv.weight", tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), **heads
            ),
            Direct(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), tp_dim=1),
        ]
        if feats.qkv_bias:
            table.append(
                QKV(m + "self_attention.linear_qkv.bias", tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), **heads)
            )
        if feats.proj_bias:
            table.append(Direct(m + "self_attention.linear_proj.bias", (h + "self_attn.o_proj.bias",)))
        if feats.qk_norm:
            table += [
                Direct(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",)),
                Direct(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",)),
            ]
        return table

    def _mlp_mappings(self, feats: Features) -> list[Mapping]:
        m, h = MCORE_LAYER, HF_LAYER
        table: list[Mapping] = [
            Direct(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
            GateUp(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")),
            Direct(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), tp_dim=1),
        ]
        if feats.mlp_bias:
            table += [
                GateUp(m + "mlp.linear_fc1.bias", (h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias")),
                Direct(m + "mlp.linear_fc2.bias", (h + "mlp.down_proj.bias",)),
            ]
        return table
