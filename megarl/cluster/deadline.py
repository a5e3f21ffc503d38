"""Phase deadlines: a bound on every worker-group call made during a named phase of the controller's work.

`with phase_deadline("update", 600, "run.phase_timeouts.update"):` bounds every call the body waits for (on this
thread) to what is left of the phase's 600 s, on top of each call's own limit (`GroupTimeouts.call_s`). A call that
outlives the phase fails as any silent call does (worker_group.py: the silent ranks named, the group killed), with
`PhaseTimeoutError`, whose message names the phase, the role, the ranks that did not answer and the key that sets the
deadline. Calls made after the deadline passed (clean-up such as abandoning a weight update) get the group's
`failure_grace_s`, not nothing.

Deadlines are per thread (a context variable): the asynchronous producer sets its own around its generate calls.
Nested phases keep the earlier end. Imports nothing heavy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from megarl.cluster.errors import WorkerTimeoutError


@dataclass(frozen=True)
class PhaseDeadline:
    phase: str
    seconds: float
    """The phase's whole allowance."""
    ends: float
    """time.monotonic() at which it passes."""
    key: str = ""
    """The config key that sets it (named in the error), e.g. run.phase_timeouts.update."""

    def remaining(self) -> float:
        return self.ends - time.monotonic()

    def describe(self) -> str:
        where = f" ({self.key})" if self.key else ""
        return f"Phase '{self.phase}' passed its deadline of {self.seconds:g} s{where}."


class PhaseTimeoutError(WorkerTimeoutError):
    """A call did not end before its phase's deadline: the silent ranks are named, the group has been shut down."""

    def __init__(self, role: str, what: str, failures: dict, note: str, deadline: PhaseDeadline):
        self.deadline = deadline
        super().__init__(role, what, failures, note)


_current: ContextVar[PhaseDeadline | None] = ContextVar("megarl_phase_deadline", default=None)


def current_deadline() -> PhaseDeadline | None:
    """The deadline of the phase this thread is in (None: none set)."""
    return _current.get()


@contextmanager
def phase_deadline(phase: str, seconds: float | None, key: str = "") -> Iterator[PhaseDeadline | None]:
    """Bound every worker-group call of the body by `seconds` from now (None: no phase bound, only the calls'
    own limits). Inside another phase's deadline, the earlier end wins."""
    if seconds is None:
        yield _current.get()
        return
    if not seconds > 0:
        raise ValueError(f"phase {phase!r}: deadline {seconds} must be > 0 seconds")
    deadline = PhaseDeadline(phase, float(seconds), time.monotonic() + seconds, key)
    outer = _current.get()
    if outer is not None and outer.ends <= deadline.ends:
        deadline = outer
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


def call_limit(call_s: float | None, grace_s: float) -> tuple[float | None, PhaseDeadline | None]:
    """(how long one call may wait, the phase deadline when it is the tighter bound). After the deadline passed,
    a call still gets `grace_s` (clean-up calls answer or are named)."""
    deadline = _current.get()
    if deadline is None:
        return call_s, None
    left = max(deadline.remaining(), min(grace_s, call_s) if call_s is not None else grace_s)
    if call_s is not None and call_s <= left:
        return call_s, None
    return left, deadline
