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
from megarl.workers.role_model import RoleModel
from megarl.workers.schedule import (
    gpt_output,
    is_output_rank,
    run_schedule,
    scatter_rows,
    schedule_shape,
    split_micro_batches,
)
from megarl.workers.token_stats import prepare_logits, token_entropy, token_logprobs
from megarl.workers.train_step import MetricSums, train_step, weighted


class PolicyLossFn(Protocol):
    needs_entropy: bool

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, micro_batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@torch.no_grad()
def compute_logprobs(
    model: RoleModel, batch: Batch, temperature: float = 1.0, max_tokens: int = 16384, with_entropy: bool = False
) -> Batch | None:
    """`logprobs` [B, S] (and `entropy`) aligned with input_ids; a Batch on output ranks, None elsewhere."""
    micro_batches = split_micro_batches(batch, max_tokens, schedule_shape(model.chunks))

    def step(chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        output = gpt_output(chunk, tensors)

        def loss_fn(logits: torch.Tensor):
            logits = prepare_logits(logits, model.vocab, temperature)
            payload: dict[str, Any] = {"logprobs": token_logprobs(logits, tensors["input_ids"])}
            if with_entropy:
                payload["entropy"] = token_entropy(logits)
            return logits.new_zeros(()), torch.ones((), dtype=torch.int, device=logits.device), payload

        return output, loss_fn

    payloads = run_schedule(model.chunks, micro_batches, step, forward_only=True)
    if not is_output_rank():
        return None
    num_rows, width = batch["input_ids"].shape
    names = ["logprobs", "entropy"] if with_entropy else ["logprobs"]
    return Batch({name: scatter_rows(micro_batches, payloads, name, num_rows, width) for name in names})


def update_policy(
    model: RoleModel, batch: Batch, loss_fn: PolicyLossFn, temperature: float = 1.0, max_tokens: int = 8192
) -> dict[str, float]:
    """One optimizer step on this rank's share of a mini-batch (`loss_weights` must be in the batch)."""

    def objective(logits: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        logits = prepare_logits(logits, model.vocab, temperature)
        logprobs = token_logprobs(logits, tensors["input_ids"])
        entropy = token_entropy(logits) if loss_fn.needs_entropy else None
        per_token_loss, metrics = loss_fn(logprobs, entropy, tensors)
        return weighted(per_token_loss, metrics, tensors["loss_weights"])

    return train_step(model, batch, objective, max_tokens)
