"""Mixture-of-experts families: how a HF checkpoint names its experts, which layers are sparse, how tokens route.

One `MoE` value per family (Mixtral, Qwen3-MoE, DeepSeek-V3) describes the differences; the Megatron settings and
the weight table are derived from it here, once. Routing must be *exactly* the HF model's: the same experts chosen
for every token, with the same weights. Each setting below says which HF behaviour it reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megarl.bridge.mappings import Direct, Mapping
from megarl.errors import UserError
from megarl.models.weight_table import HF_LAYER, MCORE_LAYER, stacked_expert_mappings, swiglu_mappings


def every_layer(hf_config) -> list[bool]:
    return [True] * hf_config.num_hidden_layers


def qwen_sparse_layers(hf_config) -> list[bool]:
    """Qwen-MoE: sparse unless listed in `mlp_only_layers`, and then every `decoder_sparse_step`-th layer."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]


def after_first_k_dense(hf_config) -> list[bool]:
    """DeepSeek: the first `first_k_dense_replace` layers have a dense MLP, the rest are sparse."""
    first_k = getattr(hf_config, "first_k_dense_replace", 0) or 0
    return [i >= first_k for i in range(hf_config.num_hidden_layers)]


@dataclass(frozen=True)
class RoutingLayout:
    """What one token's routing looks like in a model: the experts chosen in each MoE layer (R3 replays it)."""

    moe_layers: tuple[int, ...]
    """Global ids of the decoder layers that route (dense layers, e.g. DeepSeek's first k, are left out)."""
    num_experts: int
    topk: int
    num_layers: int
    """All decoder layers, MoE or dense (SGLang reports a row for each)."""
    hf_router: str = "mlp.gate"
    """The router module under a decoder layer of the transformers model (its output ends with the chosen ids
    [tokens, topk])."""

    @property
    def dtype(self) -> torch.dtype:
        """The compact dtype of expert ids: uint8 up to 256 experts, int16 beyond."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16


@dataclass(frozen=True)
class MoE:
    """A family's mixture-of-experts layout and routing, as its HF config and checkpoint express them."""

    num_experts_key: str
    """config.json key holding the number of routed experts."""
    expert_ffn_key: str = "moe_intermediate_size"
    """config.json key holding each expert's MLP width."""
    hf_block: str = "mlp"
    """HF module holding the router ('gate') and the experts: 'mlp', or 'block_sparse_moe' in Mixtral."""
    hf_router: str = "gate"
    """HF module of the router under `hf_block`: 'gate', or 'router' (gpt-oss)."""
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Per-expert gate, up and down projection names in the checkpoint (Mixtral: w1, w3, w2)."""
    stacked_experts: bool = False
    """The checkpoint stores each projection of all of a layer's experts as one tensor, with biases (gpt-oss:
    `experts.gate_up_proj` [experts, hidden, 2 x ffn] with gate and up interleaved, `experts.down_proj`
    [experts, ffn, hidden]) instead of one tensor per expert and projection."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """softmax over expert logits (Mixtral, Qwen) or independent sigmoids with a selection bias (DeepSeek-V3)."""
    sparse_layers: Callable[[Any], list[bool]] = every_layer
    """Which decoder layers are MoE layers (the others have a dense MLP)."""
    shared_experts_key: str | None = None
    """config.json key counting shared experts, which every token passes through (DeepSeek)."""
    shared_expert_ffn_key: str | None = None
    """config.json key holding the width of the one shared expert (Qwen3-Next: `shared_expert_intermediate_size`),
    instead of a count of expert-wide ones."""
    hf_shared_experts: str = "shared_experts"
    """HF module of the shared expert(s) under `hf_block`: 'shared_experts', or 'shared_expert' (Qwen3-Next)."""
    shared_expert_gate: bool = False
    """A sigmoid gate scales the shared expert's output per token (Qwen3-Next `mlp.shared_expert_gate`, a
    [1, hidden] linear): Megatron's moe_shared_expert_gate (`shared_experts.gate_weight`)."""

    def num_experts(self, hf_config) -> int:
        return int(getattr(hf_config, self.num_experts_key))

    def routing_layout(self, hf_config) -> RoutingLayout:
        sparse = self.sparse_layers(hf_config)
        return RoutingLayout(
            moe_layers=tuple(i for i, is_sparse in enumerate(sparse) if is_sparse),
            num_experts=self.num_experts(hf_config),
            topk=int(hf_config.num_experts_per_tok),
            num_layers=len(sparse),
            hf_router=f"mlp.{self.hf_router}",  # in memory transformers 5 calls every MoE block `mlp` (Mixtral too)
        )

    def check_supported(self, hf_config) -> None:
        experts, topk = self.num_experts(hf_config), hf_config.num_experts_per_tok
        if not 0 < topk <= experts:
            raise UserError(
                f"config.json num_experts_per_tok={topk} must be between 1 and {self.num_experts_key}={experts}"
            )
        if self.score == "sigmoid":
            self._check_grouped_sigmoid(hf_config, experts, topk)

    def _check_grouped_sigmoid(self, hf_config, experts: int, topk: int) -> None:
        groups, topk_group = getattr(hf_config, "n_group", 1) or 1, getattr(hf_config, "topk_group", 1) or 1
        if experts % groups:
            raise UserError(f"config.json n_group={groups} does not divide {self.num_experts_key}={experts}")
        if topk_group > groups:
            raise UserError(f"config.json topk_group={topk_group} exceeds n_group={groups}; valid: 1..{groups}")
        if groups > 1 and topk // topk_group != 2:
            # DeepSeek-V3 scores a group by its best two experts; Megatron-Core by its best topk/topk_group.
            raise UserError(
                f"config.json num_experts_per_tok={topk} with topk_group={topk_group}: Megatron-Core would score each "
                "expert group by a different number of experts than DeepSeek-V3 does (two); valid: "
                f"num_experts_per_tok = 2 x topk_group = {2 * topk_group}"
            )
        if not getattr(hf_config, "norm_topk_prob", True) or topk == 1:
            # Megatron-Core always renormalizes sigmoid routing weights over the chosen experts (when topk > 1).
            raise UserError(
                "config.json norm_topk_prob=false (or num_experts_per_tok=1) with sigmoid routing is not supported: "
                "Megatron-Core normalizes the chosen experts' weights"
            )

    def config_kwargs(self, hf_config) -> dict[str, Any]:
        """Megatron `TransformerConfig` fields for the experts and the router."""
        kwargs: dict[str, Any] = dict(
            num_moe_experts=self.num_experts(hf_config),
            moe_ffn_hidden_size=int(getattr(hf_config, self.expert_ffn_key)),
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_layer_freq=[int(sparse) for sparse in self.sparse_layers(hf_config)],
            # Routing picks experts by comparing scores: in bf16 near-ties flip, and the same token reaches
            # different experts here and in the rollout engine. HF computes routing in fp32 too.
            moe_router_dtype="fp32",
            # No auxiliary loss and no bias updates: fine-tuning keeps the pretrained routing as it is.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
        if self.shared_experts_key and getattr(hf_config, self.shared_experts_key, 0):
            shared = int(getattr(hf_config, self.shared_experts_key))
            kwargs["moe_shared_expert_intermediate_size"] = shared * kwargs["moe_ffn_hidden_size"]
        if self.shared_expert_ffn_key and getattr(hf_config, self.shared_expert_ffn_key, 0):
            kwargs["moe_shared_expert_intermediate_size"] = int(getattr(hf_config, self.shared_expert_ffn_key))
            kwargs["moe_shared_expert_gate"] = self.shared_expert_gate
        if self.score == "softmax":
            # HF: softmax over all experts, top-k, then (norm_topk_prob) renormalize over the k chosen, which is a
            # softmax over the top-k logits: Megatron's default. Without renormalization, softmax first.
            kwargs.update(
                moe_router_score_function="softmax",
                moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
            )
        else:
            groups = getattr(hf_config, "n_group", 1) or 1
            kwargs.update(
                # DeepSeek-V3: sigmoid scores; `e_score_correction_bias` is added for choosing experts only, the
                # weights are the chosen sigmoid scores, renormalized, times routed_scaling_factor.
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,
                moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
                # Group-limited selection: the best topk_group of n_group groups (one group means no limit).
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=getattr(hf_config, "topk_group", None) if groups > 1 else None,
            )
        return kwargs

    def mappings(self, bias: bool = False) -> list[Mapping]:
        """bias: the router and the experts have biases (Megatron's add_bias_linear)."""
        m, h = MCORE_LAYER + "mlp.", HF_LAYER + f"{self.hf_block}."
        router = h + f"{self.hf_router}."
        table: list[Mapping] = [Direct(m + "router.weight", (router + "weight",))]
        if bias:
            table.append(Direct(m + "router.bias", (router + "bias",)))
        if self.score == "sigmoid":
            table.append(Direct(m + "router.expert_bias", (router + "e_score_correction_bias",)))
        # Megatron keeps local experts either as modules (SequentialMLP, CPU) or as one grouped GEMM whose
        # weights are numbered (TEGroupedMLP, GPU): both bind to the same HF tensors.
        for mcore, suffix in ((m + "experts.local_experts.{expert}.", ""), (m + "experts.", "{expert}")):
            if self.stacked_experts:
                table += stacked_expert_mappings(mcore, h + "experts.", param_suffix=suffix)
            else:
                table += swiglu_mappings(mcore, h + "experts.{expert}.", self.hf_expert_names, bias, suffix)
        if self.shared_experts_key or self.shared_expert_ffn_key:
            table += swiglu_mappings(
                m + "shared_experts.", h + f"{self.hf_shared_experts}.", ("gate_proj", "up_proj", "down_proj"), bias
            )
        if self.shared_expert_gate:
            table.append(Direct(m + "shared_experts.gate_weight", (h + "shared_expert_gate.weight",)))
        return table
