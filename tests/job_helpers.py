"""Helpers of the end-to-end tests: a tiny job config, running `megarl train` as a user would, reading metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "trainer_fixtures"
REPO = Path(__file__).parents[1]


def write_prompts(path: Path, num: int) -> Path:
    with path.open("w") as f:
        for i in range(num):
            f.write(json.dumps({"prompt": f"Q{i % 97}:", "label": str(i % 10), "response": f"{i % 10}{i % 7}"}) + "\n")
    return path


def write_config(
    tmp_path: Path, stages: str, num_steps: int, extra: str = "", tp: int = 2, model: str = "tiny-qwen3", ep: int = 1
) -> Path:
    """A small job on `model` (configs/models/) at TP=`tp` (or, with `ep` > 1, TP=1 and EP=`ep` on `tp` ranks)."""
    parallel = f"{{tp: {tp}}}" if ep == 1 else f"{{ep: {ep}}}"
    data = write_prompts(tmp_path / "prompts.jsonl", 64)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"""
run: {{name: test, dir: {tmp_path / "run"}, stages: {stages}, seed: 3}}
model: {{path: {tmp_path / "model"}, init: {{config: {REPO / f"configs/models/{model}.json"}}}}}
placement: {{train_gpus: {tp}}}
actor:
  model: {{dtype: float32, parallel: {parallel}}}
  optim: {{lr: 1.0e-2, clip_grad: 1.0}}
critic:
  model: {{dtype: float32, parallel: {{tp: {tp}}}}}
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


def megarl_train(
    config: Path, *overrides: str, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(config), *overrides]
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
    if check:
        assert out.returncode == 0, (
            f"megarl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        )
    return out


def metrics(run_dir: Path) -> list[dict]:
    from megarl.trainer.observability.metrics import read_metrics

    return [m for m in read_metrics(run_dir) if "reward/mean" in m]


def interrupt_after(config: Path, run_dir: Path, step: int, timeout: float = 600, signum: int | None = None) -> int:
    """Start `megarl train`, send `signum` (default SIGINT: Ctrl-C) once step `step` is logged; the exit code."""
    import signal
    import time

    signum = signal.SIGINT if signum is None else signum

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= step:
                proc.send_signal(signum)
                break
            time.sleep(0.2)
        return proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
