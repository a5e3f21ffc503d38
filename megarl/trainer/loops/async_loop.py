"""The asynchronous RL loop (rl.mode=async, placement.mode=split): the rollout engines generate the next batches
while the actor trains on the current one, with staleness bounded by rl.max_staleness.

The producer thread (rollout_producer.py) generates and scores into a bounded buffer (rollout_buffer.py, which
holds the staleness rule); this loop, on the main thread, reads top to bottom like the synchronous one: take a batch
-> log-probs -> advantages -> update -> sync (the producer pauses for it) -> end of step. The batch's
`rollout_logprobs` reach the loss, so algorithm.off_policy corrects for the lag (tis / mis / decoupled).

Checkpoints are taken at step boundaries and save the data position of the last consumed batch: batches the
producer had drawn beyond it are drawn and generated again on resume.

Metrics (per step): async/staleness_<s> (fraction of the batch's samples s versions old, s = 0..max_staleness),
async/staleness_mean and _max, async/dropped (samples dropped as too stale), async/trainer_wait_s,
async/rollout_idle_s and async/rollout_busy_s, async/queued (batches left in the buffer), async/interrupted (samples
interrupted by weight syncs), async/generate_s and async/reward_s (of the consumed batch), async/is_weight_mean and
_var (the off-policy weights of the batch's response tokens, or the plain ratio pi_old / pi_rollout without a
correction). The loss reports actor/is_clipped (tis) and actor/is_masked (mis). Per-sample versions go to
samples.jsonl as `async/versions`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import torch

from megarl.agents.environment import load_environment
from megarl.algorithms.config import OffPolicyConfig
from megarl.algorithms.losses import PolicyLoss, ValueLoss
from megarl.algorithms.off_policy import off_policy_weights
from megarl.data.batch import Batch
from megarl.data.prompts import PromptSampler
from megarl.rewards.runner import RewardRunner
from megarl.trainer.lifecycle.roles import Roles
from megarl.trainer.loops import rl_steps
from megarl.trainer.loops.dynamic_sampling import DynamicSampling
from megarl.trainer.loops.steps import Steps
from megarl.trainer.rollout_side.engine_health import check_engines
from megarl.trainer.rollout_side.engine_sync import WeightSync
from megarl.trainer.rollout_side.rollout_buffer import OLDEST_VERSION, RolloutBuffer, TakenBatch
from megarl.trainer.rollout_side.rollout_producer import AgentEpisodes, EngineGroup, RolloutProducer
from megarl.trainer.rollout_side.routing import routing_plan

if TYPE_CHECKING:
    from megarl.job import JobConfig

log = logging.getLogger("megarl")

NEXT_BATCH = "async_next_batch"
"""TrainerState.extra key: the number of the batch after the last consumed one (request seeds derive from it)."""


class ConsumedPosition:
    """The prompt sampler's position after the last batch the trainer consumed: what a checkpoint saves."""

    def __init__(self, sampler: PromptSampler):
        self.state = sampler.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)


def run_async_rl(
    config: JobConfig, roles: Roles, tokenizer, sampler: PromptSampler, steps: Steps, sync: WeightSync
) -> None:
    """Split placement only (the engines keep their own GPUs: nothing is handed over)."""
    rl, algorithm, sampling = config.rl, config.algorithm, config.rollout.sampling
    temperature = sampling.temperature or 1.0  # greedy rollouts: log-probs of the unscaled distribution
    actor_loss = PolicyLoss(algorithm.policy_loss, algorithm.off_policy)
    critic_loss = ValueLoss(algorithm.value_loss) if roles.critic is not None else None
    position = ConsumedPosition(sampler)
    routing = routing_plan(config)  # MoE models: routing replay and its metrics
    samplers = {"prompts": position}
    try:
        with (
            RewardRunner(config.reward) as rewards,
            _producer(config, roles, tokenizer, steps, sampler, rewards) as producer,
        ):
            while steps.state.step < rl.num_steps:
                actor_version = steps.state.weight_version
                with steps.phase("wait"):
                    taken = producer.next_batch(actor_version)  # generated and scored by the producer thread
                batch, metrics = taken.item.batch, dict(taken.item.metrics)
                with steps.phase("logprobs"):
                    batch, logprob_metrics = rl_steps.add_logprobs(
                        batch,
                        roles,
                        temperature,
                        routing,
                        balance=rl.balance_dp,
                        sum_pi_squared=algorithm.needs_sum_pi_squared(),
                    )
                    batch, advantage_metrics = rl_steps.add_advantages(batch, algorithm, steps.state.extra)
                metrics.update(logprob_metrics | advantage_metrics | is_weight_metrics(batch, algorithm.off_policy))
                with steps.phase("update"):
                    train_actor = steps.state.step >= rl.critic_warmup_steps
                    metrics.update(
                        rl_steps.update(
                            config,
                            roles,
                            batch,
                            actor_loss,
                            critic_loss,
                            temperature,
                            train_actor,
                            steps.state.global_step,
                        )
                    )
                with steps.phase("sync"):  # generation paused only for the sync and the engines' health probe
                    metrics.update(producer.sync(lambda: sync() | check_engines(roles.rollout, steps)))
                metrics.update(staleness_metrics(taken, rl.max_staleness) | producer.take_times())
                position.state = taken.item.data_state
                steps.state.extra[NEXT_BATCH] = taken.item.number + 1
                _log_versions(steps, taken, actor_version)
                steps.end(metrics, rl.num_steps, samplers, batch, rl.eval_every, taken.item.num_tokens)
    finally:
        sampler.load_state_dict(position.state)  # the stage-end checkpoint saves the consumed position too


def _producer(
    config: JobConfig, roles: Roles, tokenizer, steps: Steps, sampler: PromptSampler, rewards: RewardRunner
) -> RolloutProducer:
    rl, algorithm, sampling, state = config.rl, config.algorithm, config.rollout.sampling, steps.state
    reward_model = roles.reward_model

    def score(batch: Batch) -> tuple[Batch, dict[str, float]]:
        rm_coef = config.reward_model.coef
        return rl_steps.reward_batch(batch, rewards, algorithm, sampling.max_new_tokens, reward_model, rm_coef)

    buffer = RolloutBuffer(rl.max_staleness, rl.stale_policy, min_groups=rl.mini_batches)
    first = state.global_step
    if state.step > 0:  # resuming within the stage: batches dropped before the checkpoint used numbers too
        first = max(first, int(state.extra.get(NEXT_BATCH, first)))
    dapo = algorithm.dapo
    return RolloutProducer(
        EngineGroup(roles.rollout, steps.deadlines.get("rollout")),
        sampler,
        score,
        tokenizer,
        sampling,
        buffer,
        run_seed=config.run.seed,
        first_number=first,
        max_batches=rl.num_steps - state.step if buffer.policy == "wait" else None,
        partial_rollout=rl.partial_rollout,
        dynamic_sampling=DynamicSampling(dapo.max_sampling_rounds, rl.prompts_per_step)
        if dapo.dynamic_sampling
        else None,
        routing=routing_plan(config),
        agent=AgentEpisodes(config.agent, load_environment(config.agent.env, config.agent.env_kwargs))
        if config.agent.enabled
        else None,
    )


def staleness_metrics(taken: TakenBatch, max_staleness: int) -> dict[str, float]:
    """Histogram (fractions) of the consumed samples' staleness, its mean and max, drops and the trainer's wait."""
    staleness = taken.staleness
    num = max(len(staleness), 1)
    metrics = {f"async/staleness_{s}": sum(x == s for x in staleness) / num for s in range(max_staleness + 1)}
    return metrics | {
        "async/staleness_mean": sum(staleness) / num,
        "async/staleness_max": float(max(staleness, default=0)),
        "async/dropped": float(len(taken.dropped)),
        "async/dropped_batches": float(taken.num_dropped_batches),
        "async/trainer_wait_s": taken.wait_s,
        "async/queued": float(taken.num_queued),
    }


def is_weight_metrics(batch: Batch, config: OffPolicyConfig) -> dict[str, float]:
    """Mean and variance over response tokens of the off-policy weights the loss will apply (computed here from
    old_logprobs and rollout_logprobs; without a correction, of the plain ratio pi_old / pi_rollout)."""
    mask_BS = batch["response_mask"].bool()
    old_BS, rollout_BS = batch["old_logprobs"], batch["rollout_logprobs"]
    weights_BS = None
    if config.mode != "none":
        weights_BS, _ = off_policy_weights(old_BS, rollout_BS, mask_BS, config)
    if weights_BS is None:
        weights_BS = torch.exp((old_BS - rollout_BS).clamp(max=20.0))
    weights = weights_BS[mask_BS].double()
    if weights.numel() == 0:
        return {}
    return {
        "async/is_weight_mean": weights.mean().item(),
        "async/is_weight_var": weights.var(unbiased=False).item(),
    }


def _log_versions(steps: Steps, taken: TakenBatch, actor_version: int) -> None:
    """Per-sample versions of the consumed batch, to samples.jsonl: what the staleness bound is checked on."""
    record = {
        "batch": taken.item.number,
        "actor_version": actor_version,
        "oldest_version": taken.item.batch.meta[OLDEST_VERSION],
        "staleness": taken.staleness,
        "dropped": taken.dropped,
    }
    steps.logger.log_text(steps.state.global_step + 1, "async/versions", json.dumps(record))
