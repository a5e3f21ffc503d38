"""Evaluation: greedy completions of the eval prompts, scored by the run's reward."""

from __future__ import annotations

from typing import Any

from megarl.cluster.worker_group import WorkerGroup
from megarl.data.prompts import PromptDataset
from megarl.rewards.runner import RewardRunner
from megarl.rollout.config import SamplingParams
from megarl.trainer.handover import Handover
from megarl.trainer.rl_steps import score_rollout
from megarl.trainer.rollout_step import generate_batch, rollout_metrics


class Evaluator:
    def __init__(
        self,
        rollout: WorkerGroup,
        prompts: PromptDataset,
        sampling: SamplingParams,
        tokenizer: Any,
        rewards: RewardRunner,
        seed: int,
        handover: Handover,
    ):
        self.rollout, self.prompts, self.sampling = rollout, prompts, sampling
        self.tokenizer, self.rewards, self.seed, self.handover = tokenizer, rewards, seed, handover

    def evaluate(self) -> dict[str, float]:
        """eval/accuracy (the verifier's `acc` when it reports one, else the fraction of positive scores),
        eval/reward, eval/response_length, eval/num_prompts. The engines must hold the weights to evaluate."""
        self.handover.to_rollout()
        samples = list(self.prompts.samples)
        result = generate_batch(self.rollout, samples, self.sampling, self.tokenizer, self.seed, -1)
        scores, _, extras = score_rollout(result.batch, self.rewards)
        accs = [e.get("acc", float(s > 0)) for e, s in zip(extras, scores.tolist())]
        return {
            "eval/accuracy": sum(accs) / len(accs),
            "eval/reward": scores.mean().item(),
            "eval/response_length": rollout_metrics(result.batch)["response_length/mean"],
            "eval/num_prompts": float(len(samples)),
        }
