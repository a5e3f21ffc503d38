"""`megarl train` in asynchronous mode (rl.mode=async, split placement) end to end on CPU: real Ray, a Megatron actor,
an hf rollout engine on a logical GPU of its own, weight sync every step, the digit-reward task of test_trainer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from job_helpers import FIXTURES, REPO, interrupt_after, megarl_train, metrics, write_prompts

from megarl.trainer.observability.metrics import read_samples


def write_async_config(tmp_path: Path, num_steps: int, rl: str = "", algorithm: str = "") -> Path:
    """The tiny GRPO job of test_trainer.py with the actor on one logical GPU and the rollout engine on another."""
    data = write_prompts(tmp_path / "prompts.jsonl", 64)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"""
run: {{name: test, dir: {tmp_path / "run"}, stages: [grpo], seed: 3}}
model: {{path: {tmp_path / "model"}, init: {{config: {REPO / "configs/models/tiny-qwen3.json"}}}}}
placement: {{mode: split, train_gpus: 1, rollout_gpus: 1}}
actor:
  model: {{dtype: float32}}
  optim: {{lr: 1.0e-2, clip_grad: 1.0}}
rollout:
  sampling: {{n: 4, temperature: 1.0, max_new_tokens: 6}}
  eval_sampling: {{temperature: 0.0, max_new_tokens: 6}}
reward: {{fn: "{FIXTURES / "digit_reward.py"}:digit_fraction", num_workers: 0}}
data: {{train_files: [{data}], eval_files: [{data}], eval_max_samples: 8}}
rl: {{num_steps: {num_steps}, prompts_per_step: 8{", " + rl if rl else ""}}}
algorithm: {{{algorithm}}}
logging: {{tensorboard: false, plots: false, progress: false}}
"""
    )
    return config


def versions(run_dir: Path) -> list[dict]:
    """Per step, the consumed samples' versions as the async loop logs them (samples.jsonl, `async/versions`)."""
    return [json.loads(r["text"]) for r in read_samples(run_dir) if r["name"] == "async/versions"]


@pytest.mark.slow
def test_max_staleness_0_reproduces_the_synchronous_numbers(tmp_path):
    (tmp_path / "sync").mkdir(), (tmp_path / "async").mkdir()
    megarl_train(write_async_config(tmp_path / "sync", 4))
    megarl_train(write_async_config(tmp_path / "async", 4, "mode: async, max_staleness: 0"))
    a, b = metrics(tmp_path / "sync/run"), metrics(tmp_path / "async/run")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["actor/loss"] == pytest.approx(y["actor/loss"], abs=1e-5)
        assert x["actor/pg_loss"] == pytest.approx(y["actor/pg_loss"], abs=1e-5)
    assert all(s["async/staleness_0"] == 1.0 and s["async/dropped"] == 0 for s in b)
    assert [s["rollout/engines_healthy"] for s in b] == [1.0] * 4  # probed after every sync, generation paused
    assert [v["staleness"] for v in versions(tmp_path / "async/run")] == [[0] * 32] * 4


@pytest.mark.slow
def test_one_step_off_with_truncated_is_learns_and_never_trains_on_older_samples(tmp_path):
    config = write_async_config(
        tmp_path, 10, "mode: async, max_staleness: 1, stale_policy: wait", "off_policy: {mode: tis, clip: 2.0}"
    )
    megarl_train(config)
    run = tmp_path / "run"
    steps = metrics(run)
    assert len(steps) == 10
    first, last = steps[0]["reward/mean"], sum(s["reward/mean"] for s in steps[-2:]) / 2
    assert last > first + 0.2, [s["reward/mean"] for s in steps]
    records = versions(run)
    assert len(records) == 10
    for step, record in enumerate(records):  # every consumed sample, checked
        assert record["actor_version"] == step + 1  # one sync before the first step, one per step
        assert all(record["actor_version"] - v <= 1 for v in record["oldest_version"])
        assert record["staleness"] == [record["actor_version"] - v for v in record["oldest_version"]]
    assert any(max(r["staleness"]) == 1 for r in records)  # the rollout did run ahead
    for s in steps:
        assert s["async/staleness_0"] + s["async/staleness_1"] == pytest.approx(1.0)
        assert s["async/is_weight_var"] >= 0 and "async/trainer_wait_s" in s and "async/rollout_idle_s" in s
        assert 0 <= s["actor/is_clipped"] <= 1 and s["actor/is_weight"] > 0  # the loss saw rollout_logprobs
    stale = [s for s in steps if s["async/staleness_1"] > 0]
    assert any(s["async/is_weight_var"] > 0 for s in stale)  # older samples: the weights differ from 1


@pytest.mark.slow
def test_ctrl_c_in_async_mode_saves_and_a_rerun_resumes(tmp_path):
    # 8 steps: Ctrl-C after step 2 must land before the last step (a stop asked during the last step just finishes
    # the run, exit 0); with 5 steps a loaded machine once logged steps 3-4 before the signal was handled
    config = write_async_config(tmp_path, 8, "mode: async, max_staleness: 1, stale_policy: wait")
    run = tmp_path / "run"
    assert interrupt_after(config, run, step=2) == 130
    latest = run / "checkpoints" / (run / "checkpoints/latest").read_text().strip()
    state = json.loads((latest / "trainer_state.json").read_text())
    consumed = state["global_step"]
    assert state["data"]["prompts"]["position"] == 8 * consumed  # batches drawn ahead are not counted
    megarl_train(config)
    assert [s["step"] for s in metrics(run)] == list(range(1, 9))
    state = json.loads((run / "checkpoints/step_8/trainer_state.json").read_text())
    assert state["data"]["prompts"]["position"] == 64 and state["weight_version"] == 9
    records = versions(run)
    assert [r["batch"] for r in records] == list(range(8))  # in-flight batches regenerated with the same numbers
    assert all(max(r["staleness"]) <= 1 for r in records)
