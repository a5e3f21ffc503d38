"""Fault injection for reliability tests: make a process die, or a value go bad, at a named point of a run.

Off unless the environment variable MEGARL_FAULTS is set, so production code pays one dictionary lookup. Its value
is a comma-separated list of `action:point[:count]`:

    MEGARL_FAULTS="sigkill:checkpoint.roles_written:2"   the driver SIGKILLs itself the 2nd time it gets there
    MEGARL_FAULTS="exit:rollout.generate:3"              a rollout worker process exits on its 3rd generate call
    MEGARL_FAULTS="nan:actor.grads:2"                    the actor's 2nd optimizer step sees NaN gradients
    MEGARL_FAULTS="sigterm:step.logged:2"                the driver gets SIGTERM right after logging its 2nd step

Actions: `sigkill` (SIGKILL this process: nothing is flushed or cleaned up), any other signal by name (`sigterm`,
`sigusr1`, `sigint`: sent to this process, which handles it as it would one from outside, at an exact point),
`exit` (os._exit(1)), `raise` (RuntimeError), `hang` (sleep for HANG_S: a process that stops answering, for the
phase deadlines' tests), `nan` (the point's caller makes its value non-finite), and the weight
tampering of `tamper` (`swap_layers`, `corrupt_expert`: a sync that sends wrong weights whose norms are right, for
the sync probe's tests). Points are named where `hit` or `tamper` is called.

A point may take several faults at different counts (`sigkill:rollout.generate:2,hang:rollout.generate:4`).
Counts are per process. With MEGARL_FAULTS_RANK=R faults fire only in worker processes of rank R (env RANK: e.g.
rollout engine R), nowhere else. With MEGARL_FAULTS_ONCE=DIR a fault fires once per DIR across processes and restarts (a
marker file records it): a run that restarts its workers after the fault does not meet it again.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter

ENV = "MEGARL_FAULTS"
ONCE_ENV = "MEGARL_FAULTS_ONCE"
RANK_ENV = "MEGARL_FAULTS_RANK"
HANG_S = 3600.0
"""How long a `hang` fault sleeps: longer than any test waits."""
_hits: Counter[str] = Counter()


def _spec() -> dict[str, dict[int, str]]:
    """{point: {count: action}}."""
    faults: dict[str, dict[int, str]] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        action, point, *count = item.split(":")
        faults.setdefault(point, {})[int(count[0]) if count else 1] = action
    return faults


def hit(point: str) -> bool:
    """Count a pass through `point`; act if a fault is set for this pass. Returns True for a `nan` fault (the
    caller spoils its value), False otherwise."""
    if ENV not in os.environ:
        return False
    faults = _spec().get(point)
    rank = os.environ.get(RANK_ENV)
    if faults is None or (rank is not None and rank != os.environ.get("RANK")):
        return False
    _hits[point] += 1
    count = _hits[point]
    action = faults.get(count)
    if action is None:
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
    if action == "hang":
        time.sleep(HANG_S)
    if action == "raise":
        raise RuntimeError(f"fault injected at {point} (pass {count})")
    return action == "nan" or action in TAMPERS


def tamper(point: str, bucket: list) -> list:
    """A weight bucket ([(HF name, tensor)]) as sent, or spoiled by a `swap_layers` / `corrupt_expert` fault set
    for this pass through `point`."""
    if ENV not in os.environ:
        return bucket
    faults = _spec().get(point, {})
    if not any(action in TAMPERS for action in faults.values()) or not hit(point):
        return bucket
    action = faults.get(_hits[point], "")
    return TAMPERS[action](bucket) if action in TAMPERS else bucket


_LAYER_MLP = re.compile(r"\.layers\.([01])\.mlp\.")


def _swap_layers(bucket: list) -> list:
    """Layers 0 and 1 trade their MLP weights (their norms, which a sync's checksums sample, stay in place)."""
    by_name = dict(bucket)

    def other(name: str) -> str:
        return _LAYER_MLP.sub(lambda m: f".layers.{1 - int(m.group(1))}.mlp.", name)

    return [(name, by_name.get(other(name), tensor)) for name, tensor in bucket]


def _corrupt_expert(bucket: list) -> list:
    """Routed expert 0 of every MoE layer in the wrong layout: its weights' rows in reverse order."""
    return [(name, tensor.flip(0) if ".experts.0." in name else tensor) for name, tensor in bucket]


TAMPERS = {"swap_layers": _swap_layers, "corrupt_expert": _corrupt_expert}
