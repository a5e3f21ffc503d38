"""A pool of long-lived processes forming one torch.distributed world, to run SPMD functions on N ranks.

Starting a rank costs seconds (torch + Megatron imports), so tests and tools keep one pool and send it many
functions. Each function runs on every rank with the same arguments; Megatron's parallel state is torn down after
each call so the next one starts clean. A rank that raises, dies or hangs fails the call with every rank's
traceback, and the pool restarts itself on the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from megarl.runtime.ports import find_free_port

MAX_RANK_THREADS = 400
"""A rank holding more threads than this after a call is restarted before the next one (see _num_threads). A
Megatron layout leaves about 25 threads behind per call: a restart (seconds of imports) every dozen calls."""


class RankFailure(RuntimeError):
    """A function failed on at least one rank; the message holds each failing rank's traceback."""


def _rank_main(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue, env: dict) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from megarl.runtime.distributed import (
        destroy_groups_since,
        destroy_model_parallel,
        init_distributed,
        process_groups,
    )

    init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, timeout_s=300)
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, fn, args, kwargs = task
        groups_before = process_groups()
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException:  # report everything, including SystemExit from a bad function
            outcome = (False, traceback.format_exc())
        destroy_model_parallel()
        # groups a function made itself (dist.new_group outside Megatron): each holds gloo threads
        destroy_groups_since(groups_before)
        results.put((task_id, rank, *outcome, _num_threads()))


def _num_threads() -> int:
    """This process's threads: gloo keeps a group's threads until its last reference dies, and Megatron's
    modules and caches keep some alive after their groups are destroyed, so a long-lived rank piles them up (each
    wakes on its own; hundreds of them cost a core in system time)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: never recycle
        return 0


class RankPool:
    """`num_ranks` processes in one gloo world; `run(fn, ...)` calls `fn` on all of them."""

    def __init__(self, num_ranks: int, timeout_s: float = 600.0, env: dict[str, str] | None = None):
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._task_queues: list = []
        self._results = None
        self._next_task = 0
        self._recycle = False

    def _start(self) -> None:
        port = find_free_port()
        self._results = self._ctx.Queue()
        self._task_queues = [self._ctx.Queue() for _ in range(self.num_ranks)]
        self._procs = [
            self._ctx.Process(
                target=_rank_main,
                args=(rank, self.num_ranks, port, self._task_queues[rank], self._results, self.env),
                daemon=False,  # Megatron's checkpoint writer starts processes of its own
            )
            for rank in range(self.num_ranks)
        ]
        for proc in self._procs:
            proc.start()
        atexit.register(self.close)  # non-daemon ranks would otherwise keep the interpreter from exiting

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        task_id = self._next_task
        self._next_task += 1
        for task_queue in self._task_queues:
            task_queue.put((task_id, fn, args, kwargs))
        results, failures = self._collect(task_id, timeout_s or self.timeout_s)
        if self._recycle and self._procs:
            self.close()  # a fresh world on the next call, without the piled-up gloo threads (costs an import)
        if failures:
            detail = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items()))
            raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failures)}:\n{detail}")
        return [results[rank] for rank in range(self.num_ranks)]

    def _collect(self, task_id: int, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < self.num_ranks:
            if failures:
                # Once a rank failed, the others may wait forever in a collective: give them a short grace.
                deadline = min(deadline, time.monotonic() + 10.0)
            try:
                tid, rank, ok, value, threads = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [rank for rank, proc in enumerate(self._procs) if not proc.is_alive()]
                if dead or time.monotonic() > deadline:
                    missing = set(range(self.num_ranks)) - set(results) - set(failures)
                    reason = (
                        f"rank process died (exit codes {[self._procs[r].exitcode for r in dead]})"
                        if dead
                        else (f"no answer within {timeout_s:.0f} s (hung in a collective?)")
                    )
                    failures.update({rank: reason for rank in missing})
                    self.close()  # hung or dead ranks leave the world unusable: start afresh next call
                    break
                continue
            if tid != task_id:
                continue  # a late answer from an earlier, failed call
            self._recycle = self._recycle or threads > MAX_RANK_THREADS
            if ok:
                results[rank] = value
            else:
                failures[rank] = value
        return results, failures

    def close(self) -> None:
        for task_queue in self._task_queues:
            with contextlib.suppress(ValueError, OSError):
                task_queue.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        self._task_queues = []
        self._recycle = False

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
