"""Reward-model training on preference pairs (Bradley-Terry): -log sigmoid(r_chosen - r_rejected)."""

from __future__ import annotations

import torch

from megarl.data.pairs import PairDataset
from megarl.data.sampler import EpochSampler
from megarl.trainer.context import RunContext


def run_rm(ctx: RunContext, dataset: PairDataset, sampler: EpochSampler) -> None:
    rm, group = ctx.config.rm, ctx.roles.reward_model
    while ctx.state.step < rm.num_steps:
        batch = dataset.collate(next(sampler))  # rows: chosen, rejected, chosen, ... (pairs never split)
        pair_weights = batch["is_chosen"].float() / rm.batch_size
        with ctx.phase("update"):
            metrics = group.call(
                "update_reward_model",
                batch.with_tensors(pair_weights=pair_weights),
                dispatch="dp_split",
                collect="rank0",
            )
        metrics = {f"rm/{name}": value for name, value in metrics.items()}
        ctx.end_step(metrics, rm.num_steps, {"rm": sampler}, num_tokens=float(torch.sum(batch["attention_mask"])))
