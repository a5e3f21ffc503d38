"""Routing replay on the controller (R3): the engines' expert choices into the Batch, and what the trainer does with
them in each pass (algorithm.routing_replay).

Batch fields (megarl/data/batch.py conventions, aligned with input_ids):
- `routed_experts` [B, S, moe_layers, topk], compact dtype: the experts token t was routed to, for t in 0 .. N-2 of
  each sample's N tokens (the last token's routing changes no log-prob; megarl/rollout/routing.py);
- `routing_mask` [B, S] uint8: 1 where the row holds a routing to replay; 0 on the last token, on padding, and on
  every token of a sample whose routing was invalid and that falls back to live routing.

Passes: the old-log-prob pass always compares the actor's live routing with the engine's
(rollout/routing_agreement); `rollout` replays the engine's choice there and in every update; `old_logprob` records
the actor's own choice in that pass and replays it in the updates; `off` drops the routing before the updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarl.data.batch import Batch
from megarl.errors import UserError
from megarl.models.moe import RoutingLayout
from megarl.rollout.routing import routing_problem, stack_rows

ROUTING_FIELDS = ("routed_experts", "routing_mask")


@dataclass(frozen=True)
class RoutingPlan:
    layout: RoutingLayout | None
    """What the engines record (None: nothing, rollout.routed_experts=off)."""
    replay: str
    """algorithm.routing_replay: off, rollout or old_logprob."""
    on_invalid: str
    """algorithm.routing_invalid: error or live."""
    min_agreement: float = 0.0
    """algorithm.min_routing_agreement: below it the run stops."""

    @property
    def logprob_pass(self) -> str:
        """What the actor's old-log-prob pass does with the routers (workers/routing_replay.py)."""
        return {"rollout": "replay", "old_logprob": "record"}.get(self.replay, "observe")


def routing_plan(config) -> RoutingPlan | None:
    """The plan of a job (a JobConfig) whose model is MoE; None for a dense model."""
    from megarl.checkpoint.model_dir import hf_config_dir
    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import routing_layout

    model_layout = routing_layout(load_hf_config(hf_config_dir(config.model.path)))
    if model_layout is None:
        return None
    recorded = model_layout if config.rollout.routed_experts != "off" else None
    algorithm = config.algorithm
    return RoutingPlan(recorded, algorithm.routing_replay, algorithm.routing_invalid, algorithm.min_routing_agreement)


def add_rollout_routing(
    batch: Batch, routed: Sequence[torch.Tensor | None], plan: RoutingPlan, names: Sequence[str]
) -> tuple[Batch, dict[str, float]]:
    """The engines' routing of every sample into `batch` (`routed[i]` for row i; `names[i]` says which sample it
    is in an error). An invalid routing stops the run (routing_invalid=error) or leaves that sample to live routing,
    counted in rollout/routing_fallback_samples."""
    layout = plan.layout
    assert layout is not None, "add_rollout_routing needs a plan whose engines record routing"
    lengths = batch.lengths.tolist()
    rows, mask = [], torch.zeros(batch["input_ids"].shape, dtype=torch.uint8)
    num_fallback = 0
    for i, (routing, length) in enumerate(zip(routed, lengths)):
        problem = routing_problem(routing, length, layout)
        if problem is not None and plan.on_invalid == "error":
            raise UserError(
                f"routing replay: sample {names[i]} (row {i}): {problem}; set algorithm.routing_invalid=live to "
                "route such samples live instead"
            )
        if problem is not None:
            num_fallback += 1
            rows.append(torch.zeros(0, len(layout.moe_layers), layout.topk, dtype=layout.dtype))
        else:
            rows.append(routing)
            mask[i, : length - 1] = 1
    tensors = {"routed_experts": stack_rows(rows, batch["input_ids"].shape[1], layout), "routing_mask": mask}
    return batch.with_tensors(**tensors), {"rollout/routing_fallback_samples": float(num_fallback)}


def without_routing(batch: Batch) -> Batch:
    return Batch({n: t for n, t in batch.tensors.items() if n not in ROUTING_FIELDS}, dict(batch.meta))


def agreement_metrics(agree_BL: torch.Tensor, observed_BL: torch.Tensor) -> dict[str, float]:
    """rollout/routing_agreement (all (token, layer) pairs) and its minimum over MoE layers, from per-sample,
    per-layer counts of tokens whose live top-k set equals the engine's, and of tokens compared."""
    observed = observed_BL.sum(dim=0).double()
    if observed.sum() == 0:
        return {}
    agree = agree_BL.sum(dim=0).double()
    per_layer = agree[observed > 0] / observed[observed > 0]
    return {
        "rollout/routing_agreement": (agree.sum() / observed.sum()).item(),
        "rollout/routing_agreement_min_layer": per_layer.min().item(),
    }


def check_agreement(metrics: dict[str, float], plan: RoutingPlan) -> None:
    """Stop (UserError) when the step's routing agreement is below algorithm.min_routing_agreement."""
    agreement = metrics.get("rollout/routing_agreement")
    if agreement is not None and agreement < plan.min_agreement:
        raise UserError(
            f"rollout/routing_agreement={agreement:.4f} is below algorithm.min_routing_agreement="
            f"{plan.min_agreement}: the trainer routes {1 - agreement:.1%} of (token, layer) pairs to other experts "
            "than the rollout engine did (different weights after a sync, or misaligned routing records); "
            f"rollout/routing_agreement_min_layer={metrics.get('rollout/routing_agreement_min_layer', 0):.4f}"
        )
