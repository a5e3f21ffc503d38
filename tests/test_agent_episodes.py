"""Agent episodes over the real hf engine: multi-turn trajectories are token-exact (the engine's ids and log-probs,
the log-probs the HF model gives the finished trajectory), environments that raise, hang or return garbage cost
their episode only, and the collated batch trains on model tokens alone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from megarl.agents.config import AgentConfig
from megarl.agents.environment import ToolEnvironment, load_environment
from megarl.agents.episodes import episode_metrics, run_episodes
from megarl.data.prompts import PromptSample
from megarl.rollout.config import HFEngineConfig, SamplingParams
from megarl.rollout.hf_engine import HFEngine
from megarl.trainer.rollout_side.agent_rollout import collate_episodes

FIXTURES = Path(__file__).parent / "agent_fixtures"
sys.path.insert(0, str(FIXTURES))


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    return HFEngine(hf_checkpoint("tiny-llama"), HFEngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def _samples(n: int) -> list[PromptSample]:
    return [PromptSample(i, f"p{i}", [1, 10 + i, 20 + i], label="7") for i in range(n)]


def _recording(engine):
    calls = []

    def generate(requests, sampling):
        calls.append([list(r.prompt_ids) for r in requests])
        return engine.generate(requests, sampling)

    return generate, calls


def test_episodes_are_token_exact_and_the_hf_model_agrees_with_their_logprobs(engine, tokenizer):
    from envs import Scripted

    config = AgentConfig(env="envs.py:Scripted", max_turns=4, max_total_tokens=200, observation_template="[{content}]")
    generate, calls = _recording(engine)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True)
    episodes = run_episodes(generate, _samples(2), [5, 6], lambda: Scripted(turns=2), config, sampling, tokenizer)
    model = engine.model
    for group in episodes:
        for episode in group:
            t = episode.trajectory
            assert episode.finish == "answer" and t.num_model_turns == 3 and episode.turn_rewards == [0.25, 0.25, 0.0]
            assert [turn.source for turn in t.turns] == ["observation", "model", "observation", "model", "observation",
                                                         "model"]  # fmt: skip
            # observations: rendered once and appended; the engine read exactly the trajectory so far
            first = t.turns[0]
            assert tokenizer.decode(t.token_ids[first.start : first.end]) == f"[task {episode.sample.index}]"
            assert all(m == (turn.source == "model") for turn in t.turns for m in t.loss_mask[turn.start : turn.end])
            # the log-probs the trainer will use are the ones the HF model gives the whole trajectory
            ids = torch.tensor([t.context_ids])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            positions = torch.arange(len(t.prompt_ids), ids.shape[1])[torch.tensor(t.loss_mask).bool()]
            expected = logprobs[positions - 1].gather(1, ids[0, positions, None]).squeeze(1)
            got = torch.tensor(t.logprobs)[torch.tensor(t.loss_mask).bool()]
            assert (got - expected).abs().max() < 1e-4
    contexts = [c for call in calls for c in call]
    for group in episodes:
        for episode in group:
            t = episode.trajectory
            model_turns = [turn for turn in t.turns if turn.source == "model"]
            for turn in model_turns:  # each model turn was generated from exactly the ids before it
                assert [*t.prompt_ids, *t.token_ids[: turn.start]] in contexts
    assert len(calls) == 3  # one generate call per round, every episode in it


def test_environment_failures_cost_one_episode(engine, tokenizer):
    config = AgentConfig(env="envs.py:Misbehaving", max_turns=3, step_timeout_s=0.5, observation_template="[{content}]")
    make_env = load_environment(str(FIXTURES / "envs.py") + ":Misbehaving", {"turns": 1})
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    episodes = [g[0] for g in run_episodes(engine.generate, _samples(5), list(range(5)), make_env, config, sampling,
                                           tokenizer)]  # fmt: skip
    assert time.perf_counter() - start < 4  # the hung environment was abandoned at its deadline
    assert [e.finish for e in episodes] == ["failed", "failed", "failed", "answer", "answer"]
    assert "raised RuntimeError: tool server down" in episodes[0].failure
    assert "did not answer within 0.5 s" in episodes[1].failure
    assert "returned str, not a StepResult" in episodes[2].failure
    metrics = episode_metrics(episodes, tokenizer)
    assert metrics["agent/failed"] == 0.6 and metrics["agent/turns_mean"] == pytest.approx((1 + 1 + 1 + 2 + 2) / 5)


def test_budget_and_turn_limits_truncate(engine, tokenizer):
    from envs import AsyncScripted

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, ignore_eos=True)
    tight = AgentConfig(env="x", max_turns=5, max_total_tokens=20, observation_template="[{content}]")
    ((episode,),) = run_episodes(
        engine.generate, _samples(1), [1], lambda: AsyncScripted(9), tight, sampling, tokenizer
    )
    assert episode.finish == "truncated" and len(episode.trajectory.token_ids) == 20
    few = AgentConfig(env="x", max_turns=2, max_total_tokens=200, observation_template="[{content}]")
    ((episode,),) = run_episodes(engine.generate, _samples(1), [1], lambda: AsyncScripted(9), few, sampling, tokenizer)
    assert episode.finish == "max_turns" and episode.trajectory.num_model_turns == 2


def test_tool_environment_answers_calls_and_errors():
    env = ToolEnvironment(tool_format="tag")
    result = env.step("so <tool>calculator(123*45)</tool> then <tool>calc(1)</tool> <tool>calculator(1/0)</tool>")
    assert result.observation == "5535\nerror: no tool 'calc'; tools: calculator\nerror: division by zero"
    assert (result.tool_calls, result.tool_errors, result.done) == (3, 2, False)
    assert env.step("#### 5535").done


def test_collated_episodes_train_on_model_tokens_only(engine, tokenizer):
    from envs import Scripted

    config = AgentConfig(env="x", max_turns=4, max_total_tokens=200, observation_template="[{content}]",
                         failure_reward=-1.0)  # fmt: skip
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, ignore_eos=True)
    samples = _samples(2)
    episodes = run_episodes(engine.generate, samples, [3, 4], lambda: Scripted(1), config, sampling, tokenizer)
    episodes[1][1].finish = "failed"
    result = collate_episodes(samples, episodes, tokenizer, config)
    batch = result.batch
    for i, episode in enumerate(e for g in episodes for e in g):
        t = episode.trajectory
        start = len(t.prompt_ids)
        assert batch["response_mask"][i, start : start + len(t.loss_mask)].tolist() == t.loss_mask
        assert batch["response_mask"][i].sum() == sum(t.loss_mask)
        rewards = batch["env_rewards"][i, start : start + len(t.token_ids)]
        first_model = next(turn for turn in t.turns if turn.source == "model")
        assert rewards[first_model.end - 1] == 0.25 and rewards.sum() == 0.25
    assert batch["group_ids"].tolist() == [0, 0, 1, 1]
    assert batch["score_override"].isnan().tolist() == [True, True, True, False]
    assert batch["score_override"][3] == -1.0
    assert batch.meta["finish_reason"] == ["stop", "stop", "stop", "abort"]
    # "[task i]" and "[obs 1]", one token per character: 8 + 7 observation tokens in every episode
    assert result.metrics["agent/tokens_observation_mean"] == 15.0


def test_continuous_schedule_overlaps_tools_with_generation(engine, tokenizer):
    # one slow tool must not hold back the other episodes' turns: they go on generating while it runs
    from envs import Scripted

    class SlowForOne(Scripted):
        def step(self, action):
            if self.sample_index == 0:
                time.sleep(1.0)
            return super().step(action)

        def reset(self, sample):
            self.sample_index = sample.index
            return None

    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True)
    generate, calls = _recording(engine)
    config = AgentConfig(env="x", max_turns=3, schedule="continuous", observation_template="[{content}]")
    episodes = [g[0] for g in run_episodes(generate, _samples(4), [1, 2, 3, 4], lambda: SlowForOne(turns=2), config,
                                           sampling, tokenizer)]  # fmt: skip
    assert [(e.finish, e.trajectory.num_model_turns) for e in episodes] == [("answer", 3)] * 4
    # the three fast episodes played all their turns in calls without the slow one
    assert len(calls[0]) == 4 and any(len(call) == 3 for call in calls[1:]) and len(calls) >= 4
    rounds = AgentConfig(env="x", max_turns=3, observation_template="[{content}]")
    generate, calls = _recording(engine)
    run_episodes(generate, _samples(4), [1, 2, 3, 4], lambda: SlowForOne(turns=2), rounds, sampling, tokenizer)
    assert [len(call) for call in calls] == [4, 4, 4]


def test_gae_over_an_episode_skips_observation_tokens():
    # PPO on a trajectory: model tokens, an observation, model tokens. GAE must run as if the observation were not
    # there (the state after the observation is the "next" state of the last token before it).
    import torch

    from megarl.algorithms.advantages import AdvantageInputs, compute_advantages
    from megarl.algorithms.config import AdvantageConfig

    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]])  # prompt, 2 model tokens, 2 observation tokens, 2 model tokens
    rewards = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 0.2, 0.4, 9.0, 9.0, 0.6, 0.8]])  # values on observations must not matter
    config = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8, gae_whiten=False)
    advantages, _ = compute_advantages(AdvantageInputs(rewards, mask, values_BS=values), config)
    compact = compute_advantages(
        AdvantageInputs(rewards[:, [1, 2, 5, 6]], torch.ones(1, 4), values_BS=values[:, [1, 2, 5, 6]]), config
    )[0]
    assert torch.allclose(advantages[:, [1, 2, 5, 6]], compact) and (advantages[:, [0, 3, 4]] == 0).all()
