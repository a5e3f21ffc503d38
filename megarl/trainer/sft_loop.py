"""Supervised fine-tuning of the actor (e.g. the cold start of the R1 recipe): next-token loss on response tokens."""

from __future__ import annotations

from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.losses import NLLLoss
from megarl.data.sampler import EpochSampler
from megarl.data.sft import SFTDataset
from megarl.trainer.context import RunContext


def run_sft(ctx: RunContext, dataset: SFTDataset, sampler: EpochSampler) -> None:
    sft, actor = ctx.config.sft, ctx.roles.actor
    loss_fn = NLLLoss()
    while ctx.state.step < sft.num_steps:
        batch = dataset.collate(next(sampler))
        weights = loss_weights("token-mean", batch["response_mask"])
        with ctx.phase("update"):
            metrics = actor.call(
                "update_policy", batch.with_tensors(loss_weights=weights), loss_fn, dispatch="dp_split", collect="rank0"
            )
        metrics = {f"sft/{name}": value for name, value in metrics.items()}
        if ctx.eval_due(sft.eval_every, sft.num_steps):  # the engines evaluate: give them the new weights first
            with ctx.phase("sync"):
                metrics.update(ctx.sync_weights())
        num_tokens = float(batch["response_mask"].sum())
        ctx.end_step(metrics, sft.num_steps, {"sft": sampler}, eval_every=sft.eval_every, num_tokens=num_tokens)
