"""Reward-model training on preference pairs (Bradley-Terry): -log sigmoid(r_chosen - r_rejected)."""

from __future__ import annotations

import torch

from megarl.cluster.worker_group import WorkerGroup
from megarl.data.pairs import PairDataset
from megarl.data.sampler import EpochSampler
from megarl.trainer.config import RMConfig
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.loops.steps import Steps


def run_rm(
    rm: RMConfig,
    reward_model: WorkerGroup,
    dataset: PairDataset,
    sampler: EpochSampler,
    steps: Steps,
    handover: Handover,
) -> None:
    while steps.state.step < rm.num_steps:
        batch = dataset.collate(next(sampler))  # rows: chosen, rejected, chosen, ... (pairs never split)
        pair_weights = batch["is_chosen"].float() / rm.batch_size
        with steps.phase("update"):
            handover.to_training()
            metrics = reward_model.call(
                "update_reward_model",
                batch.with_tensors(pair_weights=pair_weights),
                dispatch="dp_split",
                collect="rank0",
            )
        metrics = {f"rm/{name}": value for name, value in metrics.items()}
        steps.end(metrics, rm.num_steps, {"rm": sampler}, num_tokens=float(torch.sum(batch["attention_mask"])))
