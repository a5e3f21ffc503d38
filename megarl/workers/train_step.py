"""One optimizer step of a trained role over its share of a mini-batch, whatever the loss.

A role supplies `objective(output, micro_batch) -> (loss, metrics)`: `loss` is the micro-batch's contribution to
the global objective (already weighted by its share of the whole mini-batch, see algorithms/aggregation), and
`metrics` maps names to (weighted sum, weight) pairs. Gradients sum over micro-batches and data-parallel ranks;
metrics are summed the same way and divided once at the end (docs/architecture.md, habit 9: reduced in one
place). A metric whose name ends in `_max` is a largest value instead: (max, 1) pairs, reduced by max.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megarl.data.batch import Batch
from megarl.runtime import faults
from megarl.runtime.device import collective_device
from megarl.runtime.distributed import all_reduce
from megarl.workers.role_model import RoleModel
from megarl.workers.schedule import (
    gpt_output,
    packing_multiple,
    run_schedule,
    schedule_shape,
    shares_prompts,
    split_micro_batches,
)

MetricSums = dict[str, tuple[torch.Tensor, torch.Tensor]]
MAX_SUFFIX = "_max"
Objective = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, MetricSums]]


def weighted(
    per_token_loss: torch.Tensor, metrics: dict[str, torch.Tensor], loss_weights: torch.Tensor
) -> tuple[torch.Tensor, MetricSums]:
    """Per-token loss and metrics [b, s] -> the micro-batch's weighted loss and (weighted sum, weight) metrics
    (`*_max` metrics: the largest value where the weight is not 0)."""
    weights = loss_weights.to(per_token_loss.dtype)
    weight_sum = weights.sum()
    sums = {}
    for name, value in metrics.items():
        value = value.detach().to(weights.dtype)
        if name.endswith(MAX_SUFFIX):
            sums[name] = (torch.where(weights != 0, value, -torch.inf).max(), weight_sum.new_ones(()))
        else:
            sums[name] = ((value * weights).sum(), weight_sum)
    return (per_token_loss * weights).sum(), sums


def train_step(
    model: RoleModel,
    batch: Batch,
    objective: Objective,
    max_tokens: int,
    rows_per_unit: int = 1,
    before_forward: Callable[[torch.nn.Module, dict[str, torch.Tensor]], None] | None = None,
    packing: bool = False,
) -> dict[str, float]:
    """Zero grads, forward/backward every micro-batch, sum gradients over DP, clip and step. Returns metrics
    (identical on every rank of the role). rows_per_unit: rows kept in one micro-batch (pairs). before_forward:
    called with each chunk and micro-batch right before its forward (routing replay sets its targets). packing:
    packed micro-batches (megarl/data/packing.py)."""
    assert model.optimizer is not None, "train_step needs a trainable role"
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad()
    shape, multiple = schedule_shape(model.chunks), packing_multiple(model.chunks)
    share = shares_prompts(model.chunks)
    micro_batches = split_micro_batches(batch, max_tokens, shape, rows_per_unit, packing, multiple, share)

    def step(chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        if before_forward is not None:
            before_forward(chunk, tensors)
        output = gpt_output(chunk, tensors)

        def loss_fn(output_tensor: torch.Tensor):
            loss, sums = objective(output_tensor, tensors)
            payload = {name: torch.stack([s.detach().double(), w.detach().double()]) for name, (s, w) in sums.items()}
            payload["loss"] = torch.stack([loss.detach().double(), loss.new_ones((), dtype=torch.double)])
            return loss, loss.new_ones((), dtype=torch.int), payload

        return output, loss_fn

    payloads = run_schedule(model.chunks, micro_batches, step, forward_only=False)
    finalize_model_grads(model.chunks)  # DP all-reduce of the gradient buffers; tied-embedding sync across PP
    if faults.hit(f"{os.environ.get('MEGARL_ROLE', 'role')}.grads"):
        for chunk in model.chunks:
            for param in chunk.parameters():
                if getattr(param, "main_grad", None) is not None:
                    param.main_grad.fill_(float("nan"))
    result = model.optimizer.step()
    metrics = _reduce_metrics(payloads)
    metrics.update(grad_norm=result.grad_norm, lr=result.lr, skipped=float(not result.updated))
    return metrics


def _reduce_metrics(payloads: list[dict[str, Any]]) -> dict[str, float]:
    """Sum (value, weight) pairs over micro-batches and DP ranks on the last stage, broadcast to every rank of the
    role, then divide. `loss` stays a sum: the weights already make it the mini-batch's objective."""
    from megatron.core import parallel_state as ps

    names = sorted(payloads[0]) if payloads else []
    # Every rank must agree on the names before the collectives: the last stage has them, others do not.
    names = _broadcast_from_last_stage(names)
    is_max = torch.tensor([name.endswith(MAX_SUFFIX) for name in names], device=collective_device())[:, None]
    sums = torch.zeros(len(names), 2, dtype=torch.double, device=collective_device())
    sums = torch.where(is_max, -torch.inf, sums)
    for payload in payloads:
        values = torch.stack([payload[name] for name in names]).to(sums.device)
        sums = torch.where(is_max, torch.maximum(sums, values), sums + values)
    if payloads:
        maxima = sums.clone() if is_max.any() else None
        all_reduce(sums, group=ps.get_data_parallel_group())
        if maxima is not None:  # a second collective only for steps that report a maximum
            all_reduce(maxima, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            sums = torch.where(is_max, maxima, sums)
    sums = _broadcast_tensor_from_last_stage(sums)
    values = sums.tolist()  # one host sync per optimizer step, for logging
    return {name: _final(name, total, weight) for name, (total, weight) in zip(names, values)}


def _final(name: str, total: float, weight: float) -> float:
    if name.endswith(MAX_SUFFIX):
        return total if math.isfinite(total) else 0.0  # no weighted token anywhere: nothing to report
    return total if name == "loss" else (total / weight if weight else 0.0)


def _last_stage_global_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_last_rank()


def _broadcast_from_last_stage(obj: Any) -> Any:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_last_stage_global_rank(), group=ps.get_pipeline_model_parallel_group())
    return box[0]


def _broadcast_tensor_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=_last_stage_global_rank(), group=ps.get_pipeline_model_parallel_group())
    return tensor
