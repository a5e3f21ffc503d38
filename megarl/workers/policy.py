"""Policy compute for the actor and the reference model: per-token log-probs (and entropy) of the tokens of a batch,
and the actor's update step with a loss function handed over by the controller.

Log-probs are computed vocab-parallel from each TP rank's slice of the logits (workers/token_stats.py): full-vocab
logits never exist on one rank. Logits are divided by the sampling temperature first, so the numbers are those of
the distribution the rollout engine sampled from.

The loss function comes from megarl/algorithms (e.g. `PolicyLoss`): `loss_fn(logprobs_BS, entropy_BS | None,
micro_batch) -> (per_token_loss_BS, per_token_metrics)`, with `loss_fn.needs_entropy`. The worker only weights
and sums: `sum(per_token_loss * loss_weights)`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megarl.data.batch import Batch
from megarl.workers.chunked_logprobs import PolicyHead
from megarl.workers.role_model import RoleModel
from megarl.workers.routing_replay import scored_tokens
from megarl.workers.schedule import (
    gpt_output,
    is_output_rank,
    packing_multiple,
    run_schedule,
    scatter_rows,
    schedule_shape,
    shares_prompts,
    split_micro_batches,
)
from megarl.workers.train_step import MetricSums, train_step, weighted


class PolicyLossFn(Protocol):
    needs_entropy: bool
    reports_entropy: bool

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, micro_batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@torch.no_grad()
def compute_logprobs(
    model: RoleModel,
    batch: Batch,
    temperature: float = 1.0,
    max_tokens: int = 16384,
    with_entropy: bool = False,
    routing: str = "off",
    packing: bool = False,
    with_sum_pi_squared: bool = False,
    chunk_tokens: int = 0,
) -> Batch | None:
    """`logprobs` [B, S] (and `entropy`, `sum_pi_squared`: sum over the vocabulary of p^2) aligned with input_ids;
    a Batch on output ranks, None elsewhere.

    MoE models, `routing` (workers/routing_replay.py): `observe` or `replay` the batch's routed_experts; `record`
    the live routing, returned as `routed_experts` and `routing_mask`; `off`: live routing, nothing added. Where
    the batch has routed_experts (the engine's), per-sample, per-layer `routing_agree` / `routing_observed` counts
    [B, L] say how often the live routing chose them. packing: packed micro-batches (not with a routing pass).
    chunk_tokens: compute the log-probs this many tokens at a time (workers/chunked_logprobs.py); 0 = off."""
    replay = model.routing_pass(routing, batch)
    packed = packing and replay is None
    shape = schedule_shape(model.chunks)
    multiple, share = packing_multiple(model.chunks), shares_prompts(model.chunks)
    micro_batches = split_micro_batches(batch, max_tokens, shape, 1, packed, multiple, share)

    def step(chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        if replay is not None:
            replay.prepare(chunk, tensors)
        output = gpt_output(chunk, tensors)

        def loss_fn(output: torch.Tensor):
            stats = head.token_stats(output, tensors, "metric" if with_entropy else "off", with_sum_pi_squared)
            payload: dict[str, Any] = {"logprobs": stats.logprobs}
            if with_entropy:
                payload["entropy"] = stats.entropy
            if with_sum_pi_squared:
                payload["sum_pi_squared"] = stats.sum_pi_squared
            return output.new_zeros(()), torch.ones((), dtype=torch.int, device=output.device), payload

        return output, loss_fn

    head = PolicyHead(model.loaded.chunks, model.vocab, temperature, chunk_tokens)
    try:
        with head.active():
            payloads = run_schedule(model.chunks, micro_batches, step, forward_only=True)
    finally:
        if replay is not None:
            replay.finish()
    num_rows, width = batch["input_ids"].shape
    compared = "routed_experts" in batch  # the engine's routing, to compare the live routing with
    routing_results = _routing_results(model, replay, micro_batches, num_rows, width, compared) if replay else {}
    if not is_output_rank():
        return None
    names = ["logprobs"] + ["entropy"] * with_entropy + ["sum_pi_squared"] * with_sum_pi_squared
    tensors = {name: scatter_rows(micro_batches, payloads, name, num_rows, width) for name in names}
    return Batch(tensors | routing_results)


def _routing_results(
    model: RoleModel, replay, micro_batches, num_rows: int, width: int, compared: bool
) -> dict[str, torch.Tensor]:
    """What a log-prob pass learned of the routing (collectives: every rank of the role calls this)."""
    layout = model.routing_layout
    results = {}
    if replay.mode == "record":
        routed = replay.recorded(micro_batches, num_rows, width, layout)
        results = {"routed_experts": routed, "routing_mask": _scored_positions(micro_batches, num_rows, width)}
    if compared:
        agree, observed = replay.agreement(micro_batches, num_rows, len(layout.moe_layers))
        results |= {"routing_agree": agree, "routing_observed": observed}
    return results


def _scored_positions(micro_batches, num_rows: int, width: int) -> torch.Tensor:
    """1 on every real token but each sample's last (whose routing changes no log-prob) [B, width] uint8."""
    mask = torch.zeros(num_rows, width, dtype=torch.uint8)
    for micro_batch in micro_batches:
        if micro_batch.rows:
            scored = scored_tokens(micro_batch.tensors["attention_mask"][: len(micro_batch.rows)].cpu())
            mask[micro_batch.rows, : scored.shape[1]] = scored.to(torch.uint8)
    return mask


def update_policy(
    model: RoleModel,
    batch: Batch,
    loss_fn: PolicyLossFn,
    temperature: float = 1.0,
    max_tokens: int = 8192,
    packing: bool = False,
    chunk_tokens: int = 0,
) -> dict[str, float]:
    """One optimizer step on this rank's share of a mini-batch (`loss_weights` must be in the batch). MoE models
    replay the batch's routed_experts when it has them (metric `routing_replayed`); packing: packed micro-batches
    (not while replaying); chunk_tokens: log-probs this many tokens at a time, recomputed in the backward."""
    replay = model.routing_pass("replay", batch)
    head = PolicyHead(model.loaded.chunks, model.vocab, temperature, chunk_tokens)
    # entropy with its gradient when the loss has an entropy term; a metric only (no gradient) when it reports one
    entropy = "grad" if loss_fn.needs_entropy else "metric" if loss_fn.reports_entropy else "off"

    def objective(output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        stats = head.token_stats(output, tensors, entropy)
        per_token_loss, metrics = loss_fn(stats.logprobs, stats.entropy, tensors)
        return weighted(per_token_loss, metrics, tensors["loss_weights"])

    try:
        with head.active():
            metrics = train_step(
                model,
                batch,
                objective,
                max_tokens,
                before_forward=replay and replay.prepare,
                packing=packing and not replay,
            )
    finally:
        if replay is not None:
            replay.finish()
    if model.replay_routers:
        metrics["routing_replayed"] = replay.replayed_fraction() if replay is not None else 0.0
    return metrics
