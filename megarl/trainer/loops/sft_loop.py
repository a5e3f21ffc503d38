"""Supervised fine-tuning of the actor (e.g. the cold start of the R1 recipe): next-token loss on response tokens."""

from __future__ import annotations

from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.losses import NLLLoss
from megarl.cluster.worker_group import WorkerGroup
from megarl.data.sampler import EpochSampler
from megarl.data.sft import SFTDataset
from megarl.trainer.config import SFTConfig
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.loops.steps import Steps
from megarl.trainer.rollout_side.engine_sync import WeightSync


def run_sft(
    sft: SFTConfig,
    actor: WorkerGroup,
    dataset: SFTDataset,
    sampler: EpochSampler,
    steps: Steps,
    handover: Handover,
    sync: WeightSync,
) -> None:
    loss_fn = NLLLoss()
    while steps.state.step < sft.num_steps:
        batch = dataset.collate(next(sampler))
        weights = loss_weights("token-mean", batch["response_mask"])
        with steps.phase("update"):
            handover.to_training()
            metrics = actor.call(
                "update_policy", batch.with_tensors(loss_weights=weights), loss_fn, dispatch="dp_split", collect="rank0"
            )
        metrics = {f"sft/{name}": value for name, value in metrics.items()}
        if steps.eval_due(sft.eval_every, sft.num_steps):  # the engines evaluate: give them the new weights first
            with steps.phase("sync"):
                metrics.update(handover.to_rollout(sync))
        num_tokens = float(batch["response_mask"].sum())
        steps.end(metrics, sft.num_steps, {"sft": sampler}, eval_every=sft.eval_every, num_tokens=num_tokens)
