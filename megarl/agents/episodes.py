"""Run multi-turn episodes over the rollout engines: many at once, turn by turn, token in, token out.

`agent.schedule: rounds` (default): every episode waiting for the model goes into one generate call (the engines
batch them); then the environments of all of them step concurrently (each in its own thread or coroutine, each with
a deadline); then the next round. Reproducible, but the engines wait while the slowest tool runs. `continuous`: each
episode runs on its own and its next turn joins the next generate call as soon as its environment answered, so
generation and tools overlap; which turns share a call then depends on tool timing, and so do the numbers (a turn's
tokens do not depend on its neighbours in exact arithmetic, but floating-point batching does).

An episode ends when its environment says done (a final answer), at `agent.max_turns` model turns, at
`agent.max_total_tokens` tokens after the prompt (truncated: the overflowing turn is cut to the budget), or when its
environment fails (raised, hung, wrong return: `failure_reward`, counted). Nothing an environment does stops the run.

Seeds: episode j of prompt i has seed sample_seed(request seed, j); its turn t is sampled with sample_seed(that, t),
so an episode's tokens do not depend on the others in its round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.agents.config import AgentConfig
from megarl.agents.environment import Environment, EnvironmentFailure, StepResult, call_with_deadline
from megarl.agents.environment import check_step_result as _checked
from megarl.agents.trajectory import ObservationRenderer, Trajectory, retokenization_divergence
from megarl.rollout.config import SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest, sample_seed

Generate = Callable[[list[GenerateRequest], SamplingParams], list[list[Completion]]]


@dataclass
class Episode:
    sample: Any
    """The prompt sample (megarl.data.prompts.PromptSample)."""
    seed: int
    env: Environment
    trajectory: Trajectory
    finish: str = ""
    """answer (the environment said done), max_turns, truncated (token budget), failed."""
    failure: str | None = None
    turn_rewards: list[float] = field(default_factory=list)
    """Per-turn rewards from the environment, one per model turn that stepped it."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    last_answer_ids: list[int] = field(default_factory=list)
    """The last model turn: what the verifier reads."""

    @property
    def done(self) -> bool:
        return bool(self.finish)


def run_episodes(
    generate: Generate,
    samples: Sequence[Any],
    seeds: Sequence[int],
    make_env: Callable[[], Environment],
    config: AgentConfig,
    sampling: SamplingParams,
    tokenizer,
) -> list[list[Episode]]:
    """`sampling.n` episodes for each sample (its seed in `seeds`), played to the end; per sample, its episodes."""
    renderer = ObservationRenderer(tokenizer, config.observation_role, config.observation_template)
    episodes = [
        [Episode(s, sample_seed(seed, j), make_env(), Trajectory(list(s.prompt_ids))) for j in range(sampling.n)]
        for s, seed in zip(samples, seeds)
    ]
    flat = [e for group in episodes for e in group]
    play = _play_rounds if config.schedule == "rounds" else _play_continuous
    asyncio.run(play(generate, flat, config, replace(sampling, n=1), tokenizer, renderer))
    return episodes


async def _play_rounds(generate, episodes, config: AgentConfig, sampling, tokenizer, renderer) -> None:
    await asyncio.gather(*(_reset(e, config, renderer) for e in episodes))
    for turn in range(config.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            return
        requests = [GenerateRequest(e.trajectory.context_ids, seed=sample_seed(e.seed, turn)) for e in active]
        completions = await asyncio.to_thread(generate, requests, sampling)
        stepping = []
        for episode, (completion,) in zip(active, completions):
            if _add_model_turn(episode, completion, config):
                stepping.append(episode)
        await asyncio.gather(*(_step(e, config, tokenizer, renderer) for e in stepping))
    for episode in episodes:
        if not episode.done:
            episode.finish = "max_turns"


async def _play_continuous(generate, episodes, config: AgentConfig, sampling, tokenizer, renderer) -> None:
    """Each episode on its own: its next turn joins the next generate call as soon as its environment answered,
    while other episodes' tools still run (TurnBatcher)."""
    batcher = TurnBatcher(generate, sampling)

    async def play(episode: Episode) -> None:
        await _reset(episode, config, renderer)
        for turn in range(config.max_turns):
            if episode.done:
                return
            request = GenerateRequest(episode.trajectory.context_ids, seed=sample_seed(episode.seed, turn))
            if _add_model_turn(episode, await batcher.generate(request), config):
                await _step(episode, config, tokenizer, renderer)
        if not episode.done:
            episode.finish = "max_turns"

    await asyncio.gather(*(play(e) for e in episodes))


class TurnBatcher:
    """Model turns of many episodes into as few generate calls as keep the engines busy: turns asked for while a
    call runs go together into the next one."""

    def __init__(self, generate: Generate, sampling: SamplingParams):
        self._generate, self._sampling = generate, sampling
        self._waiting: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._running = False
        self._task: asyncio.Task | None = None  # held: the loop keeps only weak references to its tasks

    async def generate(self, request: GenerateRequest) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if not self._running:
            self._running = True
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await asyncio.sleep(0)  # turns asked for in the same instant share the call
                batch, self._waiting = self._waiting, []
                try:
                    outputs = await asyncio.to_thread(self._generate, [r for r, _ in batch], self._sampling)
                except BaseException as e:  # the engines failed: every waiting episode's turn fails with it
                    for _, future in batch:
                        future.set_exception(e)
                    continue
                for (_, future), (completion,) in zip(batch, outputs):
                    future.set_result(completion)
        finally:
            self._running = False


async def _reset(episode: Episode, config: AgentConfig, renderer) -> None:
    start = time.perf_counter()
    try:
        first = await call_with_deadline(episode.env.reset, episode.sample, timeout_s=config.step_timeout_s)
    except EnvironmentFailure as e:
        episode.finish, episode.failure = "failed", str(e)
        return
    finally:
        episode.env_seconds += time.perf_counter() - start
    if first is not None:
        _add_observation(episode, str(first), config, renderer)


def _add_model_turn(episode: Episode, completion: Completion, config: AgentConfig) -> bool:
    """Append the sampled turn (cut to the token budget); whether the environment steps on it."""
    room = config.max_total_tokens - len(episode.trajectory.token_ids)
    ids, logprobs, versions = completion.token_ids, completion.logprobs, completion.token_versions
    versions = versions or [completion.weight_version] * len(ids)
    truncated = len(ids) > room
    episode.trajectory.add_model_turn(ids[:room], logprobs[:room], versions[:room])
    episode.last_answer_ids = list(ids[:room])
    if truncated or len(episode.trajectory.token_ids) >= config.max_total_tokens:
        episode.finish = "truncated"
        return False
    return True


async def _step(episode: Episode, config: AgentConfig, tokenizer, renderer) -> None:
    action = tokenizer.decode(episode.last_answer_ids, skip_special_tokens=True)  # for the environment only
    start = time.perf_counter()
    try:
        result = await call_with_deadline(episode.env.step, action, timeout_s=config.step_timeout_s)
        result = _checked(result, episode.env.step)
    except EnvironmentFailure as e:
        episode.finish, episode.failure = "failed", str(e)
        return
    finally:
        episode.env_seconds += time.perf_counter() - start
    _take(episode, result, config, renderer)


def _take(episode: Episode, result: StepResult, config: AgentConfig, renderer) -> None:
    episode.turn_rewards.append(float(result.reward))
    episode.tool_calls += result.tool_calls
    episode.tool_errors += result.tool_errors
    if result.done:
        episode.finish = "answer"
    elif result.observation is not None:
        _add_observation(episode, result.observation, config, renderer)


def _add_observation(episode: Episode, text: str, config: AgentConfig, renderer) -> None:
    ids = renderer.token_ids(text)
    room = config.max_total_tokens - len(episode.trajectory.token_ids)
    if len(ids) >= room:  # no room left for the model to answer after it
        episode.trajectory.add_observation(ids[: max(room, 0)])
        episode.finish = "truncated"
        return
    episode.trajectory.add_observation(ids)


def episode_metrics(episodes: Sequence[Episode], tokenizer) -> dict[str, float]:
    """Per-step agent metrics (means over episodes, fractions of episodes)."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)

    def fraction(finish: str) -> float:
        return sum(e.finish == finish for e in episodes) / n

    return {
        "agent/turns_mean": sum(e.trajectory.num_model_turns for e in episodes) / n,
        "agent/tool_calls_mean": calls / n,
        "agent/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "agent/tool_use_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "agent/env_seconds_per_call": sum(e.env_seconds for e in episodes) / max(calls, 1),
        "agent/truncated": fraction("truncated") + fraction("max_turns"),
        "agent/failed": fraction("failed"),
        "agent/tokens_model_mean": sum(e.trajectory.num_tokens("model") for e in episodes) / n,
        "agent/tokens_observation_mean": sum(e.trajectory.num_tokens("observation") for e in episodes) / n,
        "agent/retokenization_divergence": float(
            sum(retokenization_divergence(tokenizer, e.trajectory) for e in episodes)
        ),
    }
