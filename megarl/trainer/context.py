"""What every loop of a run shares: the config, the role groups, data, the reward runner, metrics, checkpoints and
the trainer state. The loops (rl_loop, sft_loop, rm_loop) read top to bottom; periodic actions (log, evaluate,
checkpoint) go through `end_step`, and weight sync through `sync_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.job import JobConfig
from megarl.data.batch import Batch
from megarl.data.prompts import PromptDataset
from megarl.errors import RunFailure
from megarl.rewards.runner import RewardRunner
from megarl.runtime import faults
from megarl.trainer.rl_steps import score_rollout
from megarl.trainer.roles import Roles
from megarl.trainer.rollout_step import generate_batch, rollout_metrics
from megarl.trainer.run_checkpoint import RunCheckpoints, TrainerState
from megarl.trainer.timing import PhaseTimer


class StopRun(Exception):
    """The run stops early (Ctrl-C after a checkpoint, or too many bad steps), with a reason for the user."""


@dataclass
class RunContext:
    config: JobConfig
    roles: Roles
    tokenizer: Any
    logger: Any
    progress: Any
    checkpoints: RunCheckpoints
    state: TrainerState
    rewards: RewardRunner
    run_dir: Path
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    eval_prompts: PromptDataset | None = None
    stop_requested: bool = False
    """Set by Ctrl-C: the loop finishes the step, saves a checkpoint and returns."""

    def phase(self, name: str):
        return self.timer.phase(name)

    @property
    def stage(self) -> str:
        return self.config.run.stages[self.state.stage_index]

    # -- weights -------------------------------------------------------------------------------------------------

    def sync_weights(self, new_version: bool = True) -> dict[str, float]:
        """Push the actor's weights into every rollout engine as the next weight version (or, for engines that
        restarted, as the version the weights already have)."""
        version = self.state.weight_version + int(new_version)
        rollout, actor = self.roles.rollout, self.roles.actor
        rollout.call("begin_weight_update", version)
        sent = actor.call(
            "sync_weights",
            rollout.workers,
            version,
            self.config.rollout.bucket_bytes,
            collect="all",
            dispatch="broadcast",
        )
        received = rollout.call("finish_weight_update", version)
        self.state.weight_version = version
        return {
            "sync/bytes": sum(s["bytes"] for s in sent),
            "sync/seconds": max(s["seconds"] for s in sent),
            "sync/engine_seconds": max(r.seconds for r in received),
            "sync/weight_version": float(version),
        }

    # -- evaluation ----------------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the eval prompts scored by the reward: eval/accuracy (the verifier's `acc` when it
        reports one, else the fraction of positive scores), eval/reward, eval/response_length."""
        if self.eval_prompts is None or len(self.eval_prompts) == 0:
            return {}
        samples = list(self.eval_prompts.samples)
        sampling = self.config.rollout.eval_sampling
        result = generate_batch(self.roles.rollout, samples, sampling, self.tokenizer, self.config.run.seed, -1)
        scores, _, extras = score_rollout(result.batch, self.rewards)
        accs = [e.get("acc", float(s > 0)) for e, s in zip(extras, scores.tolist())]
        lengths = rollout_metrics(result.batch)
        return {
            "eval/accuracy": sum(accs) / len(accs),
            "eval/reward": scores.mean().item(),
            "eval/response_length": lengths["response_length/mean"],
            "eval/num_prompts": float(len(samples)),
        }

    # -- the end of every step -----------------------------------------------------------------------------------

    def eval_due(self, eval_every: int, num_steps: int) -> bool:
        """Whether the step now running ends with an evaluation: every `eval_every` steps and after the last."""
        step = self.state.step + 1
        return self.eval_prompts is not None and (step >= num_steps or bool(eval_every and step % eval_every == 0))

    def end_step(
        self,
        metrics: dict[str, float],
        num_steps: int,
        samplers: dict[str, Any],
        batch: Batch | None = None,
        eval_every: int = 0,
        num_tokens: float = 0.0,
    ) -> None:
        """Count the step; evaluate (the engines must hold the step's weights), checkpoint and log as configured;
        stop cleanly if asked to."""
        evaluate = self.eval_due(eval_every, num_steps)
        self.state.step += 1
        self.state.global_step += 1
        last = self.state.step >= num_steps
        if evaluate:
            with self.phase("eval"):
                metrics.update(self.evaluate())
        every = self.config.checkpoint.every
        if ((every and self.state.step % every == 0) or self.stop_requested) and not last:
            with self.phase("checkpoint"):
                self.save_checkpoint(samplers)
        metrics.update(self.timer.step_metrics({"step": num_tokens} if num_tokens else None))
        self.logger.log(self.state.global_step, metrics)
        if batch is not None and self.config.rl.num_sample_logs:
            self._log_samples(batch)
        self.progress.update(self.state.global_step, metrics)
        faults.hit("step.logged")
        _check_finite(metrics, self)
        if self.stop_requested and not last:
            raise StopRun(f"interrupted: checkpoint saved at step {self.state.global_step}; rerun to resume")

    def _log_samples(self, batch: Batch) -> None:
        count = min(self.config.rl.num_sample_logs, len(batch))
        texts = [
            f"[{batch.meta['finish_reason'][i]}] {batch.meta['prompt'][i]}{batch.meta['response'][i]}"
            for i in range(count)
        ]
        self.logger.log_text(self.state.global_step, "samples", texts)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def save_checkpoint(self, samplers: dict[str, Any]) -> Path:
        """Every trained role's state plus the trainer state, as one atomic run checkpoint."""
        staging = self.checkpoints.begin(self.state.global_step)
        trained = {"actor": self.roles.actor}
        if self.roles.critic is not None:
            trained["critic"] = self.roles.critic
        if self.roles.reward_model is not None and "rm" in self.config.run.stages:
            trained["reward_model"] = self.roles.reward_model
        pending = [group.async_call("save_checkpoint", str(staging / name)) for name, group in trained.items()]
        for call in pending:
            call.result()
        faults.hit("checkpoint.roles_written")
        self.state.data = {name: sampler.state_dict() for name, sampler in samplers.items()}
        return self.checkpoints.commit(staging, self.state)


def _check_finite(metrics: dict[str, float], ctx: RunContext) -> None:
    """Non-finite loss or gradients skip a role's update (its optimizer refuses the step); non-finite rewards are
    replaced by the reward's default (counted in reward/num_failed). Stop after rl.max_consecutive_bad_steps
    skipped steps in a row, before any more time is spent."""
    skipped = [role for role in ("actor", "critic", "sft", "rm") if metrics.get(f"{role}/skipped", 0.0)]
    streak = ctx.state.extra.get("bad_steps", 0) + 1 if skipped else 0
    ctx.state.extra["bad_steps"] = streak
    if skipped:
        ctx.progress.message(
            f"megarl: step {ctx.state.global_step}: non-finite loss or gradients in {', '.join(skipped)}; "
            "that update was skipped (weights unchanged)"
        )
    limit = ctx.config.rl.max_consecutive_bad_steps
    if streak >= limit:
        raise RunFailure(
            f"{streak} steps in a row ending at step {ctx.state.global_step} had non-finite loss or gradients "
            f"({', '.join(skipped)}); stopping (rl.max_consecutive_bad_steps={limit}). No checkpoint holds "
            "non-finite weights: rerun to resume from the last one, e.g. with a lower learning rate"
        )
