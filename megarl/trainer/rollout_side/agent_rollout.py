"""Controller side of multi-turn rollouts: prompts -> agent episodes on the rollout engines -> a Batch.

Row i is prompt_i followed by its trajectory (model turns and observations, token ids as the engine saw them):
`response_mask` is the trajectory's loss mask (1 only on model-sampled tokens), so every loss, advantage and
metric of the trainer counts model tokens only (GAE runs over the model tokens, skipping observations);
`rollout_logprobs` are the engine's on model tokens. Per-sample extras: `env_rewards` [B, S] (the environment's
per-turn rewards, on the last token of each model turn), `token_versions` [B, S] (the weight version that sampled
each model token, -1 on observations: turns of one episode may come from different versions in async runs),
`score_override` [B] (the failure reward of an episode whose environment failed, NaN otherwise). The verifier reads
the episode's last model turn (meta `response`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megarl.agents.config import AgentConfig
from megarl.agents.environment import Environment, load_environment
from megarl.agents.episodes import Episode, episode_metrics, run_episodes
from megarl.data.collate import make_rl_batch
from megarl.data.render import pad_id_of
from megarl.rollout.config import SamplingParams
from megarl.trainer.rollout_side.rollout_step import RolloutResult, generate_batch, generate_on_engines, request_seed

_FINISH_REASONS = {"answer": "stop", "max_turns": "length", "truncated": "length", "failed": "abort"}

Generator = Callable[[list, int], RolloutResult]
"""(prompt samples, seed step) -> a collated rollout of them."""


def rollout_generator(config, rollout_group, tokenizer, sampling: SamplingParams, routing=None) -> Generator:
    """How a job (a JobConfig) generates with `sampling`: single-turn completions, or multi-turn episodes when
    agent.env is set (training and evaluation alike)."""
    seed = config.run.seed
    if not config.agent.enabled:
        return lambda samples, step: generate_batch(rollout_group, samples, sampling, tokenizer, seed, step, routing)
    agent, make_env = config.agent, load_environment(config.agent.env, config.agent.env_kwargs)
    return lambda samples, step: generate_agent_batch(
        rollout_group, samples, sampling, tokenizer, seed, step, agent, make_env
    )


def generate_agent_batch(
    rollout_group,
    samples: Sequence,
    sampling: SamplingParams,
    tokenizer,
    run_seed: int,
    step: int,
    config: AgentConfig,
    make_env: Callable[[], Environment],
) -> RolloutResult:
    """`sampling.n` episodes per prompt, played on the rollout engines, collated."""
    seeds = [request_seed(run_seed, step, i) for i in range(len(samples))]

    def generate(requests, turn_sampling):
        return generate_on_engines(rollout_group, requests, turn_sampling)

    episodes = run_episodes(generate, samples, seeds, make_env, config, sampling, tokenizer)
    return collate_episodes(samples, episodes, tokenizer, config)


def collate_episodes(samples: Sequence, episodes: list[list[Episode]], tokenizer, config: AgentConfig) -> RolloutResult:
    flat = [(sample, e) for sample, group in zip(samples, episodes) for e in group]
    trajectories = [e.trajectory for _, e in flat]
    meta = {
        "prompt": [s.text for s, _ in flat],
        "response": [tokenizer.decode(e.last_answer_ids, skip_special_tokens=True) for _, e in flat],
        "label": [s.label for s, _ in flat],
        "finish_reason": [_FINISH_REASONS[e.finish] for _, e in flat],
        "weight_version": [max((v for v in e.trajectory.versions if v >= 0), default=0) for _, e in flat],
    }
    batch = make_rl_batch(
        [t.prompt_ids for t in trajectories],
        [t.token_ids for t in trajectories],
        pad_id=pad_id_of(tokenizer),
        meta=meta,
        rollout_logprobs=[t.logprobs for t in trajectories],
        loss_mask=[torch.tensor(t.loss_mask, dtype=torch.long) for t in trajectories],
        env_rewards=[_turn_rewards(e) for _, e in flat],
        token_versions=[torch.tensor(t.versions, dtype=torch.long) for t in trajectories],
    )
    failed = torch.tensor([e.finish == "failed" for _, e in flat])
    batch = batch.with_tensors(
        response_mask=batch["loss_mask"],
        group_ids=torch.tensor([i for i, group in enumerate(episodes) for _ in group], dtype=torch.long),
        score_override=torch.where(failed, torch.tensor(config.failure_reward), torch.tensor(float("nan"))),
    )
    num_tokens = sum(t.num_tokens("model") for t in trajectories)
    return RolloutResult(batch, num_tokens, episode_metrics([e for _, e in flat], tokenizer))


def _turn_rewards(episode: Episode) -> torch.Tensor:
    """The environment's reward of each model turn, on that turn's last token (a row over the trajectory)."""
    rewards = torch.zeros(len(episode.trajectory.token_ids))
    model_turns = [t for t in episode.trajectory.turns if t.source == "model"]
    for turn, reward in zip(model_turns, episode.turn_rewards):
        if turn.end > turn.start:
            rewards[turn.end - 1] += reward
    return rewards
