"""What a failed worker-group call raises: which ranks failed, how, and each failing rank's own traceback."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

FailureKind = Literal["raised", "died", "no answer"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MAX_DETAILED_RANKS = 8  # a failure on 512 ranks should not print 512 tracebacks


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: FailureKind
    """"raised": the method (or `__init__`) raised; "died": the worker process ended; "no answer": still running
    when the controller stopped waiting."""
    detail: str
    """The worker's traceback (or Ray's account of the death); empty for "no answer"."""


class WorkerError(RuntimeError):
    """A worker-group call (or start-up) failed on at least one rank; the group has been shut down."""

    def __init__(self, role: str, what: str, failures: dict[int, RankFailure], note: str = ""):
        self.role = role
        self.what = what
        self.failures = dict(sorted(failures.items()))
        super().__init__(format_failures(role, what, self.failures, note))

    def raised(self, exception_name: str) -> bool:
        """Whether some rank raised an exception of this class name (read from its traceback)."""
        return any(f.kind == "raised" and f"{exception_name}:" in f.detail for f in self.failures.values())

    @property
    def ranks(self) -> list[int]:
        """Every rank that failed, died or did not answer."""
        return list(self.failures)


class WorkerTimeoutError(WorkerError):
    """No rank failed, but some gave no answer within the call's time limit (the group has been shut down)."""


def clean_traceback(text: str) -> str:
    """Ray's error text without terminal colour codes or its caret-only lines."""
    lines = _ANSI.sub("", text).splitlines()
    return "\n".join(line for line in lines if line.strip(" ^~") or not line.strip())


def format_failures(role: str, what: str, failures: dict[int, RankFailure], note: str = "") -> str:
    """ "critic call 'update' failed: rank 1 raised, ranks [0, 2] no answer." + the note + each rank's traceback."""
    by_kind: dict[str, list[int]] = {}
    for failure in sorted(failures.values(), key=lambda f: (_KIND_ORDER[f.kind], f.rank)):
        by_kind.setdefault(failure.kind, []).append(failure.rank)
    summary = ", ".join(f"{_ranks(ranks)} {kind}" for kind, ranks in by_kind.items())
    lines = [f"{role} {what} failed" + (f": {summary}." if summary else ".") + (f" {note}" if note else "")]
    detailed = [failure for failure in failures.values() if failure.detail]
    for failure in detailed[:_MAX_DETAILED_RANKS]:
        lines += [f"--- {role} rank {failure.rank} ({failure.kind}) ---", failure.detail.rstrip()]
    if len(detailed) > _MAX_DETAILED_RANKS:
        lines.append(f"--- and {len(detailed) - _MAX_DETAILED_RANKS} more ranks: see WorkerError.failures ---")
    return "\n".join(lines)


_KIND_ORDER = {"raised": 0, "died": 1, "no answer": 2}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
