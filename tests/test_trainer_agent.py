"""`megarl train` with multi-turn episodes end to end on CPU (real Ray, a Megatron actor at TP=2, the hf engine):
the environment's turns reach the trainer, and environments that fail or hang cost their episodes, never the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_helpers import megarl_train, metrics, write_config

ENVS = Path(__file__).parent / "agent_fixtures" / "envs.py"


@pytest.mark.slow
def test_multi_turn_grpo_runs_every_episode_to_its_end(tmp_path):
    agent = f'agent: {{env: "{ENVS}:Scripted", env_kwargs: {{turns: 1}}, observation_template: "[{{content}}]"}}'
    megarl_train(write_config(tmp_path, "[grpo]", 3, agent))
    steps = metrics(tmp_path / "run")
    assert len(steps) == 3
    for step in steps:  # reset's observation, a model turn, "[obs 1]", the final model turn
        assert step["agent/turns_mean"] == 2.0 and step["agent/tool_calls_mean"] == 1.0
        assert step["agent/failed"] == 0.0 and step["agent/truncated"] == 0.0
        assert step["mismatch/abs_logprob_diff_max"] < 1e-4  # the actor scores the tokens the engine sampled


@pytest.mark.slow
def test_failing_and_hanging_environments_score_their_failure_reward(tmp_path):
    agent = (
        f'agent: {{env: "{ENVS}:AlwaysFails", step_timeout_s: 1.0, failure_reward: -1.0, '
        'observation_template: "[{content}]"}'
    )
    megarl_train(write_config(tmp_path, "[grpo]", 2, agent))
    steps = metrics(tmp_path / "run")
    assert [(s["agent/failed"], s["reward/mean"]) for s in steps] == [(1.0, -1.0)] * 2


@pytest.mark.slow
def test_async_episodes_stream_into_the_staleness_bounded_trainer(tmp_path):
    # the producer plays episodes a step ahead; weight syncs interrupt model turns, which resume under the new
    # weights with their tokens so far (each token keeps the version that sampled it)
    agent = (
        f'agent: {{env: "{ENVS}:Scripted", env_kwargs: {{turns: 1}}, observation_template: "[{{content}}]"}}\n'
        "algorithm: {off_policy: {mode: tis, clip: 2.0}}"
    )
    config = write_config(tmp_path, "[grpo]", 4, agent, tp=1)
    async_mode = ["rl.mode=async", "rl.max_staleness=1", "rl.stale_policy=wait"]
    megarl_train(config, "placement.mode=split", "placement.rollout_gpus=1", *async_mode)
    steps = metrics(tmp_path / "run")
    assert len(steps) == 4
    for step in steps:
        assert step["agent/turns_mean"] == 2.0 and step["agent/failed"] == 0.0
        assert step["async/staleness_max"] <= 1 and step["async/dropped"] == 0
