"""`megarl train` end to end on CPU: real Ray, a Megatron actor at TP=2, hf rollout engines, weight sync every step.

Runs are subprocesses of the real command line. The task is trivially learnable (reward: the fraction of digits in
the response), so a few steps must raise the reward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "trainer_fixtures"
REPO = Path(__file__).parents[1]


def write_prompts(path: Path, num: int) -> Path:
    with path.open("w") as f:
        for i in range(num):
            f.write(json.dumps({"prompt": f"Q{i % 97}:", "label": str(i % 10), "response": f"{i % 10}{i % 7}"}) + "\n")
    return path


def write_config(tmp_path: Path, stages: str, num_steps: int, extra: str = "") -> Path:
    data = write_prompts(tmp_path / "prompts.jsonl", 64)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"""
run: {{name: test, dir: {tmp_path / "run"}, stages: {stages}, seed: 3}}
model: {{path: {tmp_path / "model"}, init: {{config: {REPO / "configs/models/tiny-qwen3.json"}}}}}
placement: {{train_gpus: 2}}
actor:
  model: {{dtype: float32, parallel: {{tp: 2}}}}
  optim: {{lr: 1.0e-2, clip_grad: 1.0}}
critic:
  model: {{dtype: float32, parallel: {{tp: 2}}}}
  optim: {{lr: 1.0e-3}}
rollout:
  sampling: {{n: 4, temperature: 1.0, max_new_tokens: 6}}
  eval_sampling: {{temperature: 0.0, max_new_tokens: 6}}
reward: {{fn: "{FIXTURES / "digit_reward.py"}:digit_fraction", num_workers: 0}}
data: {{train_files: [{data}], eval_files: [{data}], eval_max_samples: 8}}
rl: {{num_steps: {num_steps}, prompts_per_step: 8}}
logging: {{tensorboard: true, plots: false, progress: false}}
{extra}
"""
    )
    return config


def megarl_train(config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(config), *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, f"megarl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def metrics(run_dir: Path) -> list[dict]:
    from megarl.trainer.metrics import read_metrics

    return [m for m in read_metrics(run_dir) if "reward/mean" in m]


@pytest.mark.slow
def test_grpo_raises_the_reward_and_writes_the_run_folder(tmp_path):
    megarl_train(write_config(tmp_path, "[grpo]", 8))
    run = tmp_path / "run"
    steps = metrics(run)
    assert len(steps) == 8
    first, last = steps[0]["reward/mean"], sum(s["reward/mean"] for s in steps[-2:]) / 2
    assert last > first + 0.2, [s["reward/mean"] for s in steps]
    assert all(s["mismatch/abs_logprob_diff_max"] < 1e-4 for s in steps)  # engine and actor agree after every sync
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "model" / "metadata.json").is_file()
    assert (latest / "actor" / "optimizer" / "metadata.json").is_file()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["weight_version"] == 9  # one sync at the start, one per step


@pytest.mark.slow
def test_ppo_trains_a_critic(tmp_path):
    config = write_config(tmp_path, "[ppo]", 6, "algorithm: {advantage: {estimator: gae, gamma: 1.0, lam: 0.95}}")
    megarl_train(config)
    steps = metrics(tmp_path / "run")
    assert len(steps) == 6
    assert all("critic/vf_loss" in s and "actor/pg_loss" in s for s in steps)
    assert sum(s["reward/mean"] for s in steps[-2:]) / 2 > steps[0]["reward/mean"] + 0.1


def interrupt_after(config: Path, run_dir: Path, step: int, timeout: float = 600) -> int:
    """Start `megarl train`, press Ctrl-C (SIGINT) once step `step` is logged; the run's exit code."""
    import signal
    import time

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= step:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.2)
        return proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_ctrl_c_saves_and_a_rerun_resumes_with_the_same_numbers(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    megarl_train(write_config(straight, "[grpo]", 5))
    config = write_config(split, "[grpo]", 5)
    assert interrupt_after(config, split / "run", step=2) == 130  # finishes its step, saves, stops
    assert (split / "run/checkpoints/latest").is_file()
    megarl_train(config)  # the same command again resumes
    a, b = metrics(straight / "run"), metrics(split / "run")
    assert [s["step"] for s in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["actor/loss"] == pytest.approx(y["actor/loss"], abs=1e-5)
    state = json.loads((split / "run/checkpoints/step_5/trainer_state.json").read_text())
    assert state["data"]["prompts"]["position"] == 40 and state["weight_version"] == 6
