"""A fault campaign for the rollout fleet: kill, freeze or feed a spoiled bucket to one rollout engine at chosen
points of real runs, and check that each run finishes with what an uninterrupted run gives.

The job is split placement with two rollout engines (rollout.max_engine_restarts on), synchronous GRPO, a
checkpoint every step. Each point is one run with one fault (megarl.runtime.faults; fired once across the run's
processes and restarts). Then, for each point:
  - the run finished (exit 0) and its checkpoints are complete;
  - every step was logged once, and its batch was whole (prompts_per_step x n samples): every prompt of every step
    trained on exactly once;
  - no batch mixed weight versions (rollout/weight_version_min == _max == the version of the step's sync);
  - every step's metrics equal those of the uninterrupted run (CPU runs with the same seed are deterministic; the
    prompts of a failed engine are generated again by the others with their own seeds);
  - the log shows the recovery the point expects: the engine restarted alone (the fleet), every role restarted from
    the last checkpoint (run.max_restarts: a failure inside a weight sync or the sync probe, plain group calls), or
    the version synced again in full after the sync probe caught wrong weights.

    python tools/faults/engine_faults.py [--points 8] [--only NAME,...] [--work runs/engine-faults] [override ...]

Prints one line per point and `N passed, M failed`; exits non-zero if any failed. Overrides apply to the job (e.g.
`rollout.backend=sglang` with a server megarl can start).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kill_resume import check_checkpoints, compare, read_steps, run, train_command

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, SAMPLES = 4, 8, 4
HANG_S = 20
"""The deadline of the phase a frozen engine stops (rollout, health, sync): how long the run waits for it."""
JOB = [
    "run.stages=[grpo]",
    "run.max_restarts=1",
    f"run.phase_timeouts={{rollout: {HANG_S}, health: {HANG_S}, sync: {HANG_S}}}",
    "placement.mode=split",
    "placement.train_gpus=2",
    "placement.rollout_gpus=2",  # two one-GPU engines
    "rollout.max_engine_restarts=3",
    "rollout.verify_sync=every",  # every sync verified and probed
    "rollout.sync_probe.prompts=2",
    f"rollout.sampling.n={SAMPLES}",
    "rollout.sampling.max_new_tokens=8",
    "rollout.eval_sampling.max_new_tokens=8",
    f"rl.num_steps={STEPS}",
    f"rl.prompts_per_step={PROMPTS}",
    "rl.eval_every=0",
    "rl.eval_at_start=false",
    "checkpoint.every=1",
    "logging.plots=false",
    "reward.fn=format",  # 1 for a response with a digit: the untrained model earns some, so every step trains
    "reward.kwargs={pattern: '[0-9]'}",
]
"""The campaign's job, as overrides of configs/quickstart.yaml (its 0.8 M-parameter model)."""


def job(work: Path) -> list[str]:
    """JOB, its model built on first use in the campaign's folder (not the quickstart's)."""
    return [f"model.path={work.resolve() / 'model'}", *JOB]


RECOVERY = ("rollout/engine_restarts", "rollout/requeued_prompts", "rollout/engines_healthy", "sync/retries")
"""Metrics that count the failure and the recovery itself (engines_healthy: those that passed the step's health
probe): they differ from the uninterrupted run's by design."""
ALONE = "restarting it alone"
EVERY_ROLE = "restarting every role from"
RESYNCED = "again in full, then probing again"


@dataclass(frozen=True)
class Point:
    name: str
    faults: str
    """MEGARL_FAULTS: action:point:count (counts are per process; the engine's worker counts its own calls)."""
    recovery: str
    """A line the run's log must hold: how it recovered."""
    rank: int | None = 1
    """The engine the fault hits (MEGARL_FAULTS_RANK); None: any process that gets there (the actor's ranks)."""
    differs: tuple[str, ...] = ()
    """Metrics the fault itself changes (a spoiled bucket travels as a larger delta)."""


POINTS = [
    # generate calls of an engine: 1 = the sync probe after the first sync, 2 = step 1's rollout, then the sync probe
    # after step 1's sync and step 2's rollout (3, 4), ...
    Point("generate: SIGKILL", "sigkill:rollout.generate:4", ALONE),
    Point("generate: SIGSTOP", "sigstop:rollout.generate:6", ALONE),
    Point("health probe: SIGKILL", "sigkill:rollout.health:2", ALONE),
    Point("health probe: SIGSTOP", "sigstop:rollout.health:3", ALONE),
    Point("between buckets of a sync: SIGKILL", "sigkill:rollout.sync_bucket:2", EVERY_ROLE),
    Point("between buckets of a sync: SIGSTOP", "sigstop:rollout.sync_bucket:3", EVERY_ROLE),
    Point("sync probe: SIGKILL", "sigkill:rollout.generate:3", EVERY_ROLE),
    Point(
        "a spoiled bucket (two layers' MLPs swapped)",
        "swap_layers:sync.bucket:2",
        RESYNCED,
        rank=None,
        differs=("sync/bytes",),
    ),
]


def check_run(run_dir: Path, reference: dict[int, dict], log: str, point: Point) -> list[str]:
    """What the module docstring promises, for one faulted run that exited 0."""
    steps = read_steps(run_dir)
    problems = check_checkpoints(run_dir)
    for step, metrics in sorted(steps.items()):
        if metrics.get("rollout/samples") != PROMPTS * SAMPLES:
            problems.append(f"step {step}: {metrics.get('rollout/samples')} samples, not {PROMPTS * SAMPLES}")
        versions = {metrics.get("rollout/weight_version_min"), metrics.get("rollout/weight_version_max")}
        if versions != {float(step)}:
            problems.append(f"step {step}: generated with weight versions {sorted(map(str, versions))}, not {step}")
    faulted = {step: without_recovery(m, point.differs) for step, m in steps.items()}
    problems += compare({step: without_recovery(m, point.differs) for step, m in reference.items()}, faulted)
    if point.recovery not in log:
        problems.append(f"the log does not say {point.recovery!r}")
    return problems


def without_recovery(metrics: dict, also: tuple[str, ...] = ()) -> dict:
    """`metrics` without the RECOVERY keys (and the keys `also`)."""
    return {key: value for key, value in metrics.items() if key not in RECOVERY and key not in also}


def run_point(point: Point, work: Path, reference: dict[int, dict], overrides: list[str]) -> tuple[int, list[str]]:
    slug = "".join(c if c.isalnum() else "-" for c in point.name).strip("-")
    run_dir, log, fired = work / slug, work / f"{slug}.log", work / f"{slug}.fired"
    for path in (run_dir, fired):
        shutil.rmtree(path, ignore_errors=True)
    log.unlink(missing_ok=True)
    env = {"MEGARL_FAULTS": point.faults, "MEGARL_FAULTS_ONCE": str(fired)}
    if point.rank is not None:
        env["MEGARL_FAULTS_RANK"] = str(point.rank)
    code = run(train_command(REPO / "configs/quickstart.yaml", run_dir, job(work) + overrides), env=env, log=log)
    text = log.read_text(errors="replace")
    if not fired.is_dir():
        return code, [f"the fault never fired (exit {code}; log: {log})"]
    if code != 0:
        return code, [f"the run failed (exit {code}; log: {log}): {text.strip().splitlines()[-1][:300]}"]
    return code, check_run(run_dir, reference, text, point)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=len(POINTS), help=f"the first N points (of {len(POINTS)})")
    parser.add_argument("--only", default="", help="comma-separated point names (as printed), instead of --points")
    parser.add_argument("--work", type=Path, default=Path("runs/engine-faults"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    chosen = POINTS[: args.points]
    if args.only:
        names = [name.strip() for name in args.only.split(",")]
        unknown = [name for name in names if name not in {p.name for p in POINTS}]
        if unknown:
            parser.error(f"--only: unknown point(s) {unknown}; valid: {[p.name for p in POINTS]}")
        chosen = [p for p in POINTS if p.name in names]
    args.work.mkdir(parents=True, exist_ok=True)
    reference_dir = args.work / "uninterrupted"
    shutil.rmtree(reference_dir, ignore_errors=True)
    start = time.monotonic()
    command = train_command(REPO / "configs/quickstart.yaml", reference_dir, job(args.work) + args.overrides)
    if run(command, log=args.work / "uninterrupted.log") != 0:
        print(f"the uninterrupted run failed (log: {args.work / 'uninterrupted.log'})", file=sys.stderr)
        return 1
    print(f"uninterrupted run: {time.monotonic() - start:.0f} s", flush=True)
    reference = {step: without_recovery(m) for step, m in read_steps(reference_dir).items()}
    failures = 0
    for point in chosen:
        began = time.monotonic()
        code, problems = run_point(point, args.work, reference, args.overrides)
        failures += bool(problems)
        status = "ok" if not problems else "FAILED: " + "; ".join(problems[:5])
        print(f"{point.name:<45} (exit {code}; {time.monotonic() - began:.0f} s) -> {status}", flush=True)
    print(f"{len(chosen) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
