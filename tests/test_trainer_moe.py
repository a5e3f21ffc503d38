"""`megarl train` on a MoE model end to end (real Ray, a Megatron actor at EP=2, the hf engine recording each
token's experts): every routing-replay mode runs and logs what a user checks, step by step."""

from __future__ import annotations

import pytest
from job_helpers import megarl_train, metrics, write_config


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "replayed"), [("rollout", 1.0), ("old_logprob", 1.0), ("off", 0.0)])
def test_routing_replay_modes_log_agreement_and_replayed_fraction(tmp_path, mode, replayed):
    extra = f"algorithm: {{routing_replay: {mode}}}"
    megarl_train(write_config(tmp_path, "[grpo]", 3, extra, model="tiny-qwen3-moe", ep=2))
    steps = metrics(tmp_path / "run")
    assert len(steps) == 3
    for step in steps:
        assert step["rollout/routing_replayed"] == replayed
        # fp32 engine and fp32 trainer after an exact weight sync: the same experts for every token
        assert step["rollout/routing_agreement"] == 1.0 and step["rollout/routing_agreement_min_layer"] == 1.0
        assert step["rollout/routing_fallback_samples"] == 0.0
        assert step["mismatch/abs_logprob_diff_max"] < 1e-4
