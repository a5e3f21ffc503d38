"""Kill a training run at chosen points, resume it, and check nothing was lost or corrupted.

For each kill point the harness runs `megarl train` in a fresh run folder until it dies (SIGKILL of the driver: at
a random moment, or at a named point such as the middle of a checkpoint write, through megarl.runtime.faults),
checks every checkpoint in the folder, reruns the same command to completion, and compares its per-step metrics
with an uninterrupted run of the same config (CPU runs with the same seed are deterministic).

    python tools/faults/kill_resume.py --config JOB.yaml [--points 10] [--seed 0] [override ...]

Prints one line per kill point and exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NAMED_POINTS = ("checkpoint.roles_written", "checkpoint.renamed", "step.logged")
COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm")


@dataclass(frozen=True)
class KillPoint:
    """Where a run is killed: a named fault point (its n-th pass) or a moment after start (seconds)."""

    point: str | None = None
    count: int = 1
    after_s: float = 0.0

    def describe(self) -> str:
        return f"{self.point} #{self.count}" if self.point else f"t+{self.after_s:.1f}s"


def kill_points(num: int, seed: int, num_checkpoints: int, run_seconds: float) -> list[KillPoint]:
    """A mix of named points (mid-checkpoint included) and random moments, deterministic in `seed`."""
    rng = random.Random(seed)
    points = []
    for i in range(num):
        if i % 2 == 0:
            points.append(KillPoint(NAMED_POINTS[(i // 2) % len(NAMED_POINTS)], rng.randint(1, num_checkpoints)))
        else:
            points.append(KillPoint(after_s=rng.uniform(0.3, 0.9) * run_seconds))
    return points


def train_command(config: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", "--config", str(config), f"run.dir={run_dir}", *overrides]


def run(cmd: list[str], env: dict | None = None, kill_after: float | None = None, timeout: float = 900) -> int:
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if kill_after is not None:
            try:
                return proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def check_checkpoints(run_dir: Path) -> list[str]:
    """Problems with the checkpoints of a run folder: every step folder complete and loadable, `latest` valid."""
    from megarl.checkpoint.model_dir import ModelCheckpointInfo
    from megarl.trainer.run_checkpoint import RunCheckpoints, TrainerState

    root = run_dir / "checkpoints"
    problems = []
    if not root.is_dir():
        return problems
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")):
        try:
            TrainerState.load(folder)
            for role in (p for p in folder.iterdir() if p.is_dir()):
                ModelCheckpointInfo.load(role)
                if not (role / "optimizer" / "metadata.json").is_file():
                    problems.append(f"{role}: optimizer state incomplete")
        except Exception as err:  # any unreadable part is a finding
            problems.append(f"{folder}: {err}")
    try:
        RunCheckpoints(run_dir).latest()
    except Exception as err:
        problems.append(f"latest: {err}")
    return problems


def read_steps(run_dir: Path) -> dict[int, dict]:
    from megarl.trainer.metrics import read_metrics

    return {int(m["step"]): m for m in read_metrics(run_dir) if "reward/mean" in m}


def compare(reference: dict[int, dict], resumed: dict[int, dict], tolerance: float = 1e-5) -> list[str]:
    problems = []
    if sorted(resumed) != sorted(reference):
        problems.append(f"steps {sorted(resumed)} != uninterrupted {sorted(reference)}")
    for step in sorted(set(reference) & set(resumed)):
        for key in COMPARED:
            a, b = reference[step].get(key), resumed[step].get(key)
            if a is None or b is None or abs(a - b) > tolerance * max(1.0, abs(a)):
                problems.append(f"step {step} {key}: {b} (uninterrupted {a})")
    return problems


def kill_and_resume(
    config: Path, work: Path, point: KillPoint, reference: dict[int, dict], overrides: list[str]
) -> tuple[int, list[str]]:
    """(exit code of the killed run, problems found) for one kill point."""
    run_dir = work / f"kill-{point.describe().replace(' ', '').replace('#', '-').replace('+', '')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_command(config, run_dir, overrides)
    env = {"MEGARL_FAULTS": f"sigkill:{point.point}:{point.count}"} if point.point else None
    code = run(cmd, env=env, kill_after=None if point.point else point.after_s)
    problems = check_checkpoints(run_dir)
    if run(cmd) != 0:
        problems.append("the resumed run failed")
    problems += check_checkpoints(run_dir) + compare(reference, read_steps(run_dir))
    return code, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("runs/kill-resume"))
    parser.add_argument("--max-count", type=int, default=2, help="named points fire on one of their first N passes")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    reference_dir = args.work / "uninterrupted"
    shutil.rmtree(reference_dir, ignore_errors=True)
    start = time.monotonic()
    if run(train_command(args.config, reference_dir, args.overrides)) != 0:
        print("the uninterrupted run failed", file=sys.stderr)
        return 1
    seconds = time.monotonic() - start
    reference = read_steps(reference_dir)
    failures = 0
    for point in kill_points(args.points, args.seed, args.max_count, seconds):
        code, problems = kill_and_resume(args.config, args.work, point, reference, args.overrides)
        failures += bool(problems)
        status = "ok" if not problems else "FAILED: " + "; ".join(problems[:5])
        print(f"kill at {point.describe():<32} (exit {code}) -> {status}", flush=True)
    print(f"{args.points - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
