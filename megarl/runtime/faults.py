"""Fault injection for reliability tests: make a process die, or a value go bad, at a named point of a run.

Off unless the environment variable MEGARL_FAULTS is set, so production code pays one dictionary lookup. Its value
is a comma-separated list of `action:point[:count]`:

    MEGARL_FAULTS="sigkill:checkpoint.roles_written:2"   the driver SIGKILLs itself the 2nd time it gets there
    MEGARL_FAULTS="exit:rollout.generate:3"              a rollout worker process exits on its 3rd generate call
    MEGARL_FAULTS="nan:actor.grads:2"                    the actor's 2nd optimizer step sees NaN gradients
    MEGARL_FAULTS="sigterm:step.logged:2"                the driver gets SIGTERM right after logging its 2nd step

Actions: `sigkill` (SIGKILL this process: nothing is flushed or cleaned up), any other signal by name (`sigterm`,
`sigusr1`, `sigint`: sent to this process, which handles it as it would one from outside, at an exact point),
`exit` (os._exit(1)), `raise` (RuntimeError), `nan` (the point's caller makes its value non-finite). Points are
named where `hit` is called.

Counts are per process. With MEGARL_FAULTS_ONCE=DIR a fault fires once per DIR across processes and restarts (a
marker file records it): a run that restarts its workers after the fault does not meet it again.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "MEGARL_FAULTS"
ONCE_ENV = "MEGARL_FAULTS_ONCE"
_hits: Counter[str] = Counter()


def _spec() -> dict[str, tuple[str, int]]:
    faults: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        action, point, *count = item.split(":")
        faults[point] = (action, int(count[0]) if count else 1)
    return faults


def hit(point: str) -> bool:
    """Count a pass through `point`; act if a fault is set for this pass. Returns True for a `nan` fault (the
    caller spoils its value), False otherwise."""
    if ENV not in os.environ:
        return False
    fault = _spec().get(point)
    if fault is None:
        return False
    _hits[point] += 1
    action, count = fault
    if _hits[point] != count:
        return False
    once = os.environ.get(ONCE_ENV)
    if once:
        marker = os.path.join(once, f"{action}-{point}")
        try:
            os.makedirs(once, exist_ok=True)
            with open(marker, "x"):  # exclusive create: the first process to get here fires, no other
                pass
        except FileExistsError:
            return False
    if action.startswith("sig"):
        os.kill(os.getpid(), signal.Signals[action.upper()])
    if action == "exit":
        os._exit(1)
    if action == "raise":
        raise RuntimeError(f"fault injected at {point} (pass {count})")
    return action == "nan"
