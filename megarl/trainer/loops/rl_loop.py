"""The synchronous RL loop (stages grpo and ppo): generate -> reward -> log-probs -> advantages -> update -> sync.

Every blocking call is visible here; the arithmetic is in megarl/algorithms, the wiring in rl_steps.py. Each
step's rollout starts with the engine health probe (rollout_side/engine_health.py), and every phase waits for its
workers within its deadline (loops/deadlines.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megarl.algorithms.losses import PolicyLoss, ValueLoss
from megarl.data.batch import Batch
from megarl.data.prompts import PromptSampler
from megarl.rewards.runner import RewardRunner
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.lifecycle.roles import Roles
from megarl.trainer.loops import rl_steps
from megarl.trainer.loops.dynamic_sampling import KeptGroups
from megarl.trainer.loops.steps import Steps
from megarl.trainer.rollout_side.agent_rollout import Generator, rollout_generator
from megarl.trainer.rollout_side.engine_health import check_engines
from megarl.trainer.rollout_side.engine_sync import WeightSync
from megarl.trainer.rollout_side.rollout_step import RolloutResult, draw_key, rollout_metrics
from megarl.trainer.rollout_side.routing import routing_plan

if TYPE_CHECKING:
    from megarl.job import JobConfig


def run_rl(
    config: JobConfig,
    roles: Roles,
    tokenizer,
    rewards: RewardRunner,
    sampler: PromptSampler,
    steps: Steps,
    handover: Handover,
    sync: WeightSync,
) -> None:
    rl, algorithm, sampling = config.rl, config.algorithm, config.rollout.sampling
    temperature = sampling.temperature or 1.0  # greedy rollouts: log-probs of the unscaled distribution
    routing = routing_plan(config)  # MoE models: routing replay and its metrics
    actor_pass = not rl_steps.old_logprobs_redundant(config, routing)
    actor_loss = PolicyLoss(algorithm.policy_loss, algorithm.off_policy, old_from_current=not actor_pass)
    critic_loss = ValueLoss(algorithm.value_loss) if roles.critic is not None else None
    samplers = {"prompts": sampler}
    generate = rollout_generator(config, roles.rollout, tokenizer, sampling, routing)
    if algorithm.needs_reward_baselines():  # remax: one greedy response per prompt as the baseline
        greedy = rollout_generator(config, roles.rollout, tokenizer, replace(sampling, n=1, temperature=0.0), routing)
        generate = _with_greedy_baselines(generate, greedy)
    while steps.state.step < rl.num_steps:
        # generate + reward (+ DAPO refill); colocated: the engines hold the GPUs
        batch, metrics, num_tokens = _rollouts(config, roles, generate, rewards, sampler, steps, handover)
        with steps.phase("handover"):
            handover.to_training()  # colocated: the engines release the GPUs, the roles onload
        with steps.phase("logprobs"):
            batch, logprob_metrics = rl_steps.add_logprobs(
                batch, roles, temperature, routing, actor_pass, rl.balance_dp, algorithm.needs_sum_pi_squared()
            )
            batch, advantage_metrics = rl_steps.add_advantages(batch, algorithm, steps.state.extra)
        metrics.update(logprob_metrics | advantage_metrics)
        with steps.phase("update"):
            train_actor = steps.state.step >= rl.critic_warmup_steps
            # a hybrid engine's sync queued right behind the last update, when no handover comes in between
            then = None if handover.enabled else sync.start
            step = steps.state.global_step
            metrics.update(
                rl_steps.update(config, roles, batch, actor_loss, critic_loss, temperature, train_actor, step, then)
            )
        with steps.phase("sync"):
            metrics.update(handover.to_rollout(sync))  # colocated: the engines take the GPUs back
            metrics.update(sync.run_probe(handover))  # after a verified sync (rollout.verify_sync=every)
        steps.end(metrics, rl.num_steps, samplers, batch, rl.eval_every, num_tokens)


def _rollouts(
    config: JobConfig,
    roles: Roles,
    generate: Generator,
    rewards: RewardRunner,
    sampler: PromptSampler,
    steps: Steps,
    handover: Handover,
) -> tuple[Batch, dict[str, float], int]:
    """A scored rollout batch of rl.prompts_per_step prompt groups (with DAPO dynamic sampling: up to
    algorithm.dapo.max_sampling_rounds draws, see trainer/loops/dynamic_sampling.py)."""
    algorithm, sampling = config.algorithm, config.rollout.sampling
    dapo, rm_coef = algorithm.dapo, config.reward_model.coef
    kept = KeptGroups(config.rl.prompts_per_step) if dapo.dynamic_sampling else None
    metrics, num_tokens, health = {}, 0, {}
    for draw in range(dapo.max_sampling_rounds if kept else 1):
        with steps.phase("rollout"):
            handover.to_rollout()  # a no-op unless the roles took the GPUs back (e.g. for a checkpoint)
            if draw == 0:  # the engines hold their memory: each generates one token (rollout_side/engine_health.py)
                health = check_engines(roles.rollout, steps)
            seed_step = draw_key(steps.state.global_step, draw)  # every draw of every step gets its own seeds
            rollout = generate(next(sampler), seed_step)
        with steps.phase("reward"):
            batch, reward_metrics = rl_steps.reward_batch(
                rollout.batch, rewards, algorithm, sampling.max_new_tokens, roles.reward_model, rm_coef
            )
            if isinstance(rollout, _WithGreedy):
                batch, baseline_metrics = rl_steps.add_reward_baselines(
                    batch, rollout.greedy.batch, rewards, roles.reward_model, rm_coef
                )
                reward_metrics |= baseline_metrics
        num_tokens += rollout.num_tokens
        if draw == 0:
            metrics = rollout_metrics(batch) | reward_metrics | rollout.metrics | health
        if kept is None:
            return batch, metrics, num_tokens
        if kept.add(batch):
            break
    batch, dapo_metrics = kept.result()
    return batch, metrics | dapo_metrics, num_tokens


@dataclass
class _WithGreedy:
    """A rollout and the greedy responses to its prompts (remax's baseline), generated with the same weights."""

    batch: Batch
    num_tokens: int
    metrics: dict[str, float]
    greedy: RolloutResult


def _with_greedy_baselines(generate: Generator, greedy: Generator) -> Generator:
    def both(samples, seed_step: int) -> _WithGreedy:
        rollout, baseline = generate(samples, seed_step), greedy(samples, seed_step)
        return _WithGreedy(rollout.batch, rollout.num_tokens + baseline.num_tokens, rollout.metrics, baseline)

    return both
