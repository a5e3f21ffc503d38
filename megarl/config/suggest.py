"""Wording for "what would be valid" in error messages: the closest names, the list of valid ones.

Shared by the config loader and by every registry (estimators, losses, verifiers, engines, architectures) so that all
of megarl says it the same way: "algorithm.advantage.estimator='grpoo' is not known; valid: gae, grpo, rloo; did you
mean 'grpo'?". Pure standard library (no omegaconf), so any component can import it cheaply.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_matches", "closest", "describe_valid", "unknown_choice"]


def close_matches(name: str, valid: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The names in `valid` closest to `name`, best first (difflib ratio >= cutoff, case-insensitive), at most n."""
    by_lower: dict[str, str] = {}
    for candidate in valid:
        by_lower.setdefault(str(candidate).lower(), str(candidate))
    matches = difflib.get_close_matches(str(name).lower(), list(by_lower), n=n, cutoff=cutoff)
    if not matches:
        # A prefix is a strong hint that difflib's ratio misses on short names ("pp" for "pp_size").
        lowered = str(name).lower()
        matches = [c for c in by_lower if lowered and (c.startswith(lowered) or lowered.startswith(c))][:n]
    return [by_lower[m] for m in matches]


def closest(name: str, valid: Iterable[str], quote: bool = True, n: int = 1) -> str:
    """A "did you mean ...?" phrase for `name` among `valid` (the n closest), or "" when nothing is close.

    >>> closest("grpoo", ["gae", "grpo", "rloo"])
    "did you mean 'grpo'?"
    """
    matches = close_matches(name, valid, n=n)
    if not matches:
        return ""
    shown = [repr(m) if quote else m for m in matches]
    return f"did you mean {' or '.join(shown)}?"


def describe_valid(valid: Iterable[object], limit: int = 30) -> str:
    """The valid names as one comma-separated list (in the given order), shortened past `limit` entries."""
    names = [str(v) for v in valid]
    if not names:
        return "(none)"
    if len(names) > limit:
        return ", ".join(names[:limit]) + f", ... ({len(names) - limit} more)"
    return ", ".join(names)


def unknown_choice(key: str, value: object, valid: Iterable[object], problem: str = "is not known") -> str:
    """The standard message for a name outside its choices: key, value, the valid names and the closest one.

    >>> unknown_choice("algorithm.advantage.estimator", "grpoo", ["gae", "grpo", "rloo"])
    "algorithm.advantage.estimator='grpoo' is not known; valid: gae, grpo, rloo; did you mean 'grpo'?"
    """
    valid = list(valid)
    message = f"{key}={value!r} {problem}; valid: {describe_valid(valid)}"
    hint = closest(str(value), [str(v) for v in valid])
    return f"{message}; {hint}" if hint else message
