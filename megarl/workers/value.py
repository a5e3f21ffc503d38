"""Value compute for the critic and the reward model: one number per position from the value head.

Alignment follows the log-probs (CONVENTIONS: column t is about token t): `values[:, t]` is the critic's estimate
of the return *before* token t is generated, i.e. the head's output at position t - 1; column 0 holds 0. A reward
model scores a whole sequence with the head's output at its last real token.

Reward-model training pairs a chosen and a rejected answer as consecutive rows (chosen at even rows); a pair is
never split between micro-batches or data-parallel ranks (the controller gives each DP rank whole pairs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megarl.data.batch import Batch
from megarl.workers.role_model import RoleModel
from megarl.workers.schedule import (
    global_tokens,
    gpt_output,
    is_output_rank,
    packing_multiple,
    run_schedule,
    scatter_rows,
    schedule_shape,
    shares_prompts,
    split_micro_batches,
)
from megarl.workers.token_stats import align_to_tokens
from megarl.workers.train_step import MetricSums, train_step, weighted

ValueLossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _values(head_output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[b, s, 1] head output at each position of micro-batch `tensors` -> [b, s] aligned with the tokens (packed
    rows: by their `position_ids`; context parallelism: gathered over the CP ranks)."""
    return align_to_tokens(global_tokens(head_output.squeeze(-1).float(), tensors), tensors.get("position_ids"))


def _last_token_scores(head_output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The head at each sample's last real token [samples]; packed rows: at each sample's `sample_ends`."""
    values = global_tokens(head_output.squeeze(-1).float(), tensors)
    if "sample_ends" in tensors:
        return values[0, tensors["sample_ends"].to(values.device)]
    last = tensors["attention_mask"].sum(dim=1).long().clamp(min=1) - 1
    return values.gather(1, last[:, None].to(values.device)).squeeze(1)


@torch.no_grad()
def _forward_rows(
    model: RoleModel, batch: Batch, max_tokens: int, name: str, fn, packing: bool = False
) -> Batch | None:
    shape, multiple = schedule_shape(model.chunks), packing_multiple(model.chunks)
    micro_batches = split_micro_batches(batch, max_tokens, shape, 1, packing, multiple, shares_prompts(model.chunks))

    def step(chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        output = gpt_output(chunk, tensors)
        return output, lambda out: (out.new_zeros(()), out.new_ones((), dtype=torch.int), {name: fn(out, tensors)})

    payloads = run_schedule(model.chunks, micro_batches, step, forward_only=True)
    if not is_output_rank():
        return None
    num_rows, width = batch["input_ids"].shape
    if payloads[0][name].dim() == 1:  # one number per row
        out = payloads[0][name].new_zeros(num_rows)
        for micro_batch, payload in zip(micro_batches, payloads):
            if micro_batch.rows:
                out[micro_batch.rows] = payload[name][: len(micro_batch.rows)]
        return Batch({name: out})
    return Batch({name: scatter_rows(micro_batches, payloads, name, num_rows, width)})


def compute_values(model: RoleModel, batch: Batch, max_tokens: int = 16384, packing: bool = False) -> Batch | None:
    """`values` [B, S] on output ranks (None elsewhere); packing: packed micro-batches."""
    return _forward_rows(model, batch, max_tokens, "values", _values, packing)


def compute_scores(model: RoleModel, batch: Batch, max_tokens: int = 16384, packing: bool = False) -> Batch | None:
    """Reward-model `scores` [B]: the head at each sequence's last real token; packing: packed micro-batches."""
    return _forward_rows(model, batch, max_tokens, "scores", _last_token_scores, packing)


def update_critic(
    model: RoleModel, batch: Batch, loss_fn: ValueLossFn, max_tokens: int = 8192, packing: bool = False
) -> dict[str, float]:
    """One optimizer step of the critic; `loss_fn(values_BS, micro_batch) -> (per_token_loss, metrics)` (e.g.
    algorithms' ValueLoss), weighted by `loss_weights`."""

    def objective(head_output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        per_token_loss, metrics = loss_fn(_values(head_output, tensors), tensors)
        return weighted(per_token_loss, metrics, tensors["loss_weights"])

    return train_step(model, batch, objective, max_tokens, packing=packing)


def update_reward_model(
    model: RoleModel, batch: Batch, max_tokens: int = 8192, packing: bool = False
) -> dict[str, float]:
    """One Bradley-Terry step: loss = -log sigmoid(r_chosen - r_rejected), averaged over the mini-batch's pairs
    through `pair_weights` [B] (1 / total pairs on chosen rows, 0 on rejected rows)."""

    def objective(head_output: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        scores = _last_token_scores(head_output, tensors)
        chosen, rejected = scores[0::2], scores[1::2]
        weights = tensors["pair_weights"][0::2].to(scores.dtype)
        margin = chosen - rejected
        loss = (-F.logsigmoid(margin) * weights).sum()
        weight_sum = weights.sum()
        sums = {
            "accuracy": (((margin > 0).to(weights.dtype)) * weights).sum(),
            "margin": (margin.detach() * weights).sum(),
            "chosen_score": (chosen.detach() * weights).sum(),
            "rejected_score": (rejected.detach() * weights).sum(),
        }
        return loss, {name: (value, weight_sum) for name, value in sums.items()}

    return train_step(model, batch, objective, max_tokens, rows_per_unit=2, packing=packing)
