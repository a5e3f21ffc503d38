"""The engine health probe: before each step's rollout every engine generates one token (SGLang: GET
/health_generate; the hf engine: one greedy token), within the `health` phase's deadline (run.phase_timeouts.health).

A healthy fleet gives `rollout/engines_healthy` (how many engines answered) and `rollout/engine_health_s` (the
slowest engine's seconds). An engine that fails the probe (a dead server, a lost node, an engine that refuses to
generate after an abandoned weight update), died, or does not answer in time is started again alone and synced
when the fleet restarts engines (engine_fleet.py, rollout.max_engine_restarts), and otherwise stops the step with a
WorkerError naming its rank (rank k of the rollout role is engine k) and the phase: a failure for run.max_restarts.
"""

from __future__ import annotations

from megarl.trainer.loops.steps import Steps

HEALTH = "health"
DEFAULT_PROBE_S = 120.0
"""How long one engine's probe may take when no deadline is set for the health phase."""


def probe_engines(rollout, timeout_s: float = DEFAULT_PROBE_S) -> dict[str, float]:
    """Probe every engine of `rollout` (a worker group, or a hybrid job's EngineView); its health metrics."""
    if getattr(rollout, "recovers", False):  # an EngineFleet: failed engines are started again
        seconds = rollout.probe(timeout_s)
    else:
        seconds = rollout.call("health_probe", timeout_s)
    return {"rollout/engines_healthy": float(len(seconds)), "rollout/engine_health_s": max(seconds, default=0.0)}


def check_engines(rollout, steps: Steps) -> dict[str, float]:
    """`probe_engines` within the health phase's deadline (untimed: it runs inside the rollout phase, once the
    engines hold their memory)."""
    with steps.deadline(HEALTH) as deadline:
        return probe_engines(rollout, deadline.seconds if deadline is not None else DEFAULT_PROBE_S)
