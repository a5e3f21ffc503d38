"""A fault campaign: kill training runs at chosen points, resume them, and check that nothing was lost or corrupted.

A scenario is a chain of one or more kills. Each kill is a SIGKILL of the driver (at a named point of a
checkpoint or a step, through megarl.runtime.faults, or at a random moment) or of one worker process mid-step
(the run then restarts its roles from the last checkpoint by itself). After every kill the harness checks the
run folder, reruns the same command (which resumes), and after the last kill lets the run finish. Then:
  - every checkpoint in the folder is loadable or absent (never half-visible), `latest` names a complete one;
  - the run finished;
  - every step's metrics equal those of an uninterrupted run of the same config (CPU runs with the same seed are
    deterministic); timings are not compared.
A line per scenario also says whether rotation deleted the checkpoint a resume started from (the case that once
crashed every long resumed run).

    python tools/faults/kill_resume.py --config JOB.yaml [--points 10] [--seed 0] [--chains] [override ...]

Deterministic in --seed. Prints one line per scenario and `N passed, M failed`; exits non-zero if any failed.
Driver points: checkpoint.{roles_written,state_written,renamed,latest_updated,rotating}, phase.{rollout,update,
sync,...}, step.logged. Worker points: rollout.generate, actor.update, actor.sync.
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

CHECKPOINT_POINTS = (
    "checkpoint.roles_written",
    "checkpoint.state_written",
    "checkpoint.renamed",
    "checkpoint.latest_updated",
    "checkpoint.rotating",
)
STEP_POINTS = ("phase.rollout", "phase.update", "phase.sync", "step.logged")
ASYNC_PHASES = {"phase.rollout": "phase.wait"}
"""The async loop has no rollout phase on the main thread (a producer thread generates): it waits for a batch."""
WORKER_POINTS = ("rollout.generate", "actor.update", "actor.sync")
VOLATILE = (
    "time",
    "timing/",
    "throughput/",
    "memory/",
    "sync/seconds",
    "sync/engine_seconds",
    "async/",
    "rollout/engine_health_s",
)
"""Metric keys that measure the machine, not the run (wall times, memory): not compared."""


@dataclass(frozen=True)
class Kill:
    """One fault: SIGKILL of the driver at a named point's n-th pass (per process) or `after_s` seconds after its
    start, or (target="worker") SIGKILL of the first worker process to reach a named point's n-th pass."""

    point: str | None = None
    count: int = 1
    after_s: float = 0.0
    target: str = "driver"

    def describe(self) -> str:
        if self.point is None:
            return f"t+{self.after_s:.1f}s"
        return f"{'worker ' if self.target == 'worker' else ''}{self.point} #{self.count}"


@dataclass(frozen=True)
class Scenario:
    kills: tuple[Kill, ...]

    def describe(self) -> str:
        return " then ".join(kill.describe() for kill in self.kills)

    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.describe()).strip("-")


def scenarios(
    num: int, seed: int, max_count: int, run_seconds: float, chains: bool = False, async_loop: bool = False
) -> list[Scenario]:
    """`num` scenarios, deterministic in `seed`: checkpoint points, step points, random moments and (with
    `chains`) worker kills and kill-resume-kill chains, in turn. Named checkpoint points fire on one of their first
    `max_count` passes; step points within the first few steps."""
    rng = random.Random(seed)

    def checkpoint_kill(i: int) -> Kill:
        return Kill(CHECKPOINT_POINTS[i % len(CHECKPOINT_POINTS)], rng.randint(1, max_count))

    def step_kill(i: int) -> Kill:
        point = STEP_POINTS[i % len(STEP_POINTS)]
        return Kill(ASYNC_PHASES.get(point, point) if async_loop else point, rng.randint(1, 3 * max_count))

    def moment() -> Kill:
        return Kill(after_s=rng.uniform(0.15, 0.65) * run_seconds)

    kinds = ["checkpoint", "moment", "step", "worker", "chain"] if chains else ["checkpoint", "moment"]
    out = []
    for i in range(num):
        kind, turn = kinds[i % len(kinds)], i // len(kinds)
        if kind == "checkpoint":
            out.append(Scenario((checkpoint_kill(turn if chains else i // 2),)))
        elif kind == "moment":
            out.append(Scenario((moment(),)))
        elif kind == "step":
            out.append(Scenario((step_kill(turn),)))
        elif kind == "worker":
            point = WORKER_POINTS[turn % len(WORKER_POINTS)]
            out.append(Scenario((Kill(point, rng.randint(2, 4), target="worker"),)))
        else:  # a resumed run killed again elsewhere, then resumed again
            second = step_kill(turn + 1) if turn % 2 else moment()
            out.append(Scenario((checkpoint_kill(turn + 2), second)))
    return out


def train_command(config: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", "--config", str(config), f"run.dir={run_dir}", *overrides]


def run(
    cmd: list[str],
    env: dict | None = None,
    kill_after: float | None = None,
    timeout: float = 900,
    log: Path | None = None,
) -> int:
    """Run `cmd` (output appended to `log`); SIGKILL it after `kill_after` seconds. Its exit code (-9: killed)."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=out)
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
                proc.wait()
    finally:
        if log:
            out.close()


def check_checkpoints(run_dir: Path) -> list[str]:
    """Problems with the checkpoints of a run folder: every visible step folder complete and loadable, `latest`
    naming a complete one."""
    from megarl.checkpoint.model_dir import ModelCheckpointInfo
    from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState

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
    """Every step's metrics (SFT and RL), by step."""
    from megarl.trainer.observability.metrics import read_metrics

    return {int(m["step"]): m for m in read_metrics(run_dir) if "step" in m}


def compare(reference: dict[int, dict], resumed: dict[int, dict], tolerance: float = 1e-5) -> list[str]:
    """Differences between two runs' metrics, step by step, over every key that does not measure the machine."""
    problems = []
    if sorted(resumed) != sorted(reference):
        problems.append(f"steps {sorted(resumed)} != uninterrupted {sorted(reference)}")
    for step in sorted(set(reference) & set(resumed)):
        a_step, b_step = reference[step], resumed[step]
        keys = {k for k in (*a_step, *b_step) if k != "step" and not k.startswith(VOLATILE)}
        for key in sorted(keys):
            a, b = a_step.get(key), b_step.get(key)
            if a is None or b is None or abs(a - b) > tolerance * max(1.0, abs(a)):
                problems.append(f"step {step} {key}: {b} (uninterrupted {a})")
    return problems


def _latest_name(run_dir: Path) -> str | None:
    pointer = run_dir / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def run_scenario(
    config: Path, work: Path, scenario: Scenario, reference: dict[int, dict], overrides: list[str]
) -> tuple[list[int], list[str], bool]:
    """(exit codes of the faulted runs, problems found, whether rotation deleted a checkpoint a resume started
    from) for one scenario."""
    run_dir = work / scenario.slug()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir.with_suffix(".log")
    log.unlink(missing_ok=True)
    cmd = train_command(config, run_dir, overrides)
    codes, problems, resumed_from = [], [], []
    for index, kill in enumerate(scenario.kills):
        env, fired = {}, run_dir.with_name(f"{run_dir.name}.faults-{index}")
        shutil.rmtree(fired, ignore_errors=True)
        if kill.point:
            env["MEGARL_FAULTS"] = f"sigkill:{kill.point}:{kill.count}"
            env["MEGARL_FAULTS_ONCE"] = str(fired)  # fires once, even across worker restarts; leaves a marker
        resumed_from.append(_latest_name(run_dir))
        code = run(cmd, env=env, kill_after=None if kill.point else kill.after_s, log=log)
        codes.append(code)
        problems += [f"after kill {index + 1}: {p}" for p in check_checkpoints(run_dir)]
        if (kill.point and not fired.is_dir()) or (not kill.point and code != -signal.SIGKILL):
            problems.append(f"kill {index + 1} ({kill.describe()}) never fired (exit {code})")
    if codes[-1] != 0:  # the last fault stopped the run: resume it to the end
        resumed_from.append(_latest_name(run_dir))
        if run(cmd, log=log) != 0:
            problems.append(f"the resumed run failed (log: {log})")
    problems += check_checkpoints(run_dir) + compare(reference, read_steps(run_dir))
    root = run_dir / "checkpoints"
    rotated = any(name and not (root / name).exists() for name in resumed_from)
    return codes, problems, rotated


def _is_async(args) -> bool:
    from megarl.config import load_config
    from megarl.job import JobConfig

    return load_config(JobConfig, args.config, args.overrides).rl.mode == "async"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--points", type=int, default=10, help="number of scenarios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chains", action="store_true", help="add step points, worker kills and kill chains")
    parser.add_argument("--work", type=Path, default=Path("runs/kill-resume"))
    parser.add_argument(
        "--max-count", type=int, default=2, help="checkpoint points fire on one of their first N passes"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    reference_dir = args.work / "uninterrupted"
    shutil.rmtree(reference_dir, ignore_errors=True)
    start = time.monotonic()
    if run(train_command(args.config, reference_dir, args.overrides), log=args.work / "uninterrupted.log") != 0:
        print(f"the uninterrupted run failed (log: {args.work / 'uninterrupted.log'})", file=sys.stderr)
        return 1
    seconds = time.monotonic() - start
    print(f"uninterrupted run: {seconds:.0f} s", flush=True)
    reference = read_steps(reference_dir)
    failures = 0
    for scenario in scenarios(args.points, args.seed, args.max_count, seconds, args.chains, _is_async(args)):
        began = time.monotonic()
        codes, problems, rotated = run_scenario(args.config, args.work, scenario, reference, args.overrides)
        failures += bool(problems)
        status = "ok" if not problems else "FAILED: " + "; ".join(problems[:5])
        note = ", resume checkpoint rotated away" if rotated else ""
        exits = ",".join(map(str, codes))
        print(
            f"kill at {scenario.describe():<48} (exit {exits}{note}; {time.monotonic() - began:.0f} s) -> {status}",
            flush=True,
        )
    print(f"campaign: {time.monotonic() - start:.0f} s")
    print(f"{args.points - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
