"""How a call's arguments reach the ranks (dispatch modes) and how their results come back (collect modes).

Variants are data: each mode is one registry entry. Dispatch turns the call's arguments into one (args, kwargs) per
rank; collect says which ranks send their result back and how those results are combined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.cluster.worker import ParallelInfo

RankArgs = tuple[tuple[Any, ...], dict[str, Any]]
Put = Callable[[Any], Any]
"""Stores an argument once for all ranks that receive it (ray.put in a group); identity where nothing is shared."""


def dispatch_broadcast(
    args: tuple, kwargs: dict, world_size: int, parallel: list[ParallelInfo] | None, put: Put
) -> list[RankArgs]:
    """The same arguments to every rank (each stored once)."""
    shared_args = tuple(put(arg) for arg in args)
    shared_kwargs = {name: put(value) for name, value in kwargs.items()}
    return [(shared_args, shared_kwargs)] * world_size


def dispatch_dp_split(
    args: tuple, kwargs: dict, world_size: int, parallel: list[ParallelInfo] | None, put: Put
) -> list[RankArgs]:
    """The first argument split into DP-size parts (`arg.split(num_parts)`); part d goes to every rank of DP rank
    d (its TP peers and pipeline stages alike). The other arguments are broadcast."""
    assert parallel is not None
    if not args or not callable(getattr(args[0], "split", None)):
        raise TypeError(
            "dp_split dispatch splits the first positional argument, which needs a split(num_parts) method "
            f"(e.g. a Batch); got {type(args[0]).__name__ if args else 'no arguments'}"
        )
    dp_size = parallel[0].dp_size
    parts = list(args[0].split(dp_size))
    if len(parts) != dp_size:
        raise ValueError(f"{type(args[0]).__name__}.split({dp_size}) returned {len(parts)} parts")
    part_refs = [put(part) for part in parts]
    rest_args = tuple(put(arg) for arg in args[1:])
    shared_kwargs = {name: put(value) for name, value in kwargs.items()}
    return [((part_refs[info.dp_rank], *rest_args), shared_kwargs) for info in parallel]


def dispatch_per_rank(
    args: tuple, kwargs: dict, world_size: int, parallel: list[ParallelInfo] | None, put: Put
) -> list[RankArgs]:
    """Every argument is a list with one item per rank; rank r gets item r of each."""
    named = [(f"argument {i}", arg) for i, arg in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in named:
        if not isinstance(value, Sequence) or isinstance(value, str | bytes) or len(value) != world_size:
            size = len(value) if isinstance(value, Sequence) else type(value).__name__
            raise ValueError(
                f"per_rank dispatch needs every argument as a list of {world_size} items (one per rank); "
                f"{label} is {size}"
            )
    return [
        (tuple(arg[rank] for arg in args), {name: value[rank] for name, value in kwargs.items()})
        for rank in range(world_size)
    ]


DISPATCH_MODES: dict[str, Callable[..., list[RankArgs]]] = {
    "broadcast": dispatch_broadcast,
    "dp_split": dispatch_dp_split,
    "per_rank": dispatch_per_rank,
}
NEEDS_PARALLEL_INFO = {"dp_split"}


@dataclass(frozen=True)
class CollectMode:
    needs_parallel_info: bool
    keep: Callable[[int, list[ParallelInfo] | None], list[bool]]
    """Which ranks send their result back (the others answer None)."""
    combine: Callable[[list[Any], list[ParallelInfo] | None], Any]
    """Results in rank order (None where not kept) -> what `call` returns."""


def _dp_leader_ranks(parallel: list[ParallelInfo]) -> list[int]:
    """Ranks of the DP leaders, in DP-rank order."""
    return [rank for _, rank in sorted((info.dp_rank, rank) for rank, info in enumerate(parallel) if info.is_dp_leader)]


def _combine_dp_leaders(results: list[Any], parallel: list[ParallelInfo] | None) -> Any:
    assert parallel is not None
    values = [results[rank] for rank in _dp_leader_ranks(parallel)]
    concat = getattr(type(values[0]), "concat", None) if values else None
    if callable(concat) and all(type(value) is type(values[0]) for value in values):
        return concat(values)
    return values


COLLECT_MODES: dict[str, CollectMode] = {
    "all": CollectMode(False, lambda world_size, _: [True] * world_size, lambda results, _: results),
    "rank0": CollectMode(
        False, lambda world_size, _: [rank == 0 for rank in range(world_size)], lambda results, _: results[0]
    ),
    "dp_leaders": CollectMode(True, lambda _, parallel: [info.is_dp_leader for info in parallel], _combine_dp_leaders),
}


def check_parallel_infos(role: str, parallel: list[ParallelInfo]) -> None:
    """The workers' DP layout must be one: the same dp_size everywhere, every DP rank present with one leader."""
    dp_sizes = {info.dp_size for info in parallel}
    problems = []
    if len(dp_sizes) != 1:
        problems.append(f"ranks disagree on dp_size: {sorted(dp_sizes)}")
    else:
        dp_size = dp_sizes.pop()
        for dp_rank in range(dp_size):
            members = [rank for rank, info in enumerate(parallel) if info.dp_rank == dp_rank]
            leaders = [rank for rank in members if parallel[rank].is_dp_leader]
            if not members or len(leaders) != 1:
                problems.append(f"dp_rank {dp_rank} has ranks {members} with leaders {leaders} (needs exactly one)")
        stray = [rank for rank, info in enumerate(parallel) if not 0 <= info.dp_rank < dp_size]
        if stray:
            problems.append(f"ranks {stray} have dp_rank outside 0..{dp_size - 1}")
    if problems:
        raise RuntimeError(f"{role}: the workers' parallel_info() is inconsistent: {'; '.join(problems)}")
