"""Evaluation: greedy completions of the eval prompts, scored by the run's reward."""

from __future__ import annotations

from megarl.data.prompts import PromptDataset
from megarl.rewards.runner import RewardRunner
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.loops.rl_steps import score_rollout
from megarl.trainer.rollout_side.agent_rollout import Generator
from megarl.trainer.rollout_side.rollout_step import rollout_metrics

AGENT_EVAL_METRICS = ("agent/tool_use_rate", "agent/turns_mean", "agent/tool_errors")
"""Agent episodes: what evaluation reports of them too (as eval/tool_use_rate, ...)."""


class Evaluator:
    def __init__(self, generate: Generator, prompts: PromptDataset, rewards: RewardRunner, handover: Handover):
        """`generate`: the run's rollouts with the eval sampling (agent_rollout.rollout_generator)."""
        self.generate, self.prompts, self.rewards, self.handover = generate, prompts, rewards, handover

    def evaluate(self) -> dict[str, float]:
        """eval/accuracy (the verifier's `acc` when it reports one, else the fraction of positive scores),
        eval/reward, eval/response_length, eval/num_prompts. The engines must hold the weights to evaluate."""
        self.handover.to_rollout()
        samples = list(self.prompts.samples)
        result = self.generate(samples, -1)
        scores, _, extras = score_rollout(result.batch, self.rewards)
        accs = [e.get("acc", float(s > 0)) for e, s in zip(extras, scores.tolist())]
        agent = {
            f"eval/{name.removeprefix('agent/')}": result.metrics[name]
            for name in AGENT_EVAL_METRICS
            if name in result.metrics
        }
        return {
            "eval/accuracy": sum(accs) / len(accs),
            "eval/reward": scores.mean().item(),
            "eval/response_length": rollout_metrics(result.batch)["response_length/mean"],
            "eval/num_prompts": float(len(samples)),
        } | agent
