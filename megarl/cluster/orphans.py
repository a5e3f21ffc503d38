"""Clean up after a driver that died without shutting its local Ray instance down (SIGKILL, OOM killer).

A local Ray instance is started by the driver; killed hard, the driver leaves some of Ray's processes behind (its
dashboard and runtime-env agents, ~180 MB). The trainer records the processes of its instance in the run folder;
the next run in that folder kills those still alive (matched by pid *and* start time, so a reused pid is never
touched) before it starts its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

RECORD = ".ray_processes.json"


def record_local_processes(run_dir: str | Path) -> None:
    """Note every descendant of this process (the local Ray instance and its workers) with its start time."""
    children = psutil.Process(os.getpid()).children(recursive=True)
    rows = [[p.pid, p.create_time()] for p in children if p.is_running()]
    (Path(run_dir) / RECORD).write_text(json.dumps({"driver": os.getpid(), "processes": rows}) + "\n")


def kill_leftover_processes(run_dir: str | Path) -> int:
    """Kill the recorded processes of an earlier driver of this run that are still alive; returns how many."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return 0
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    if psutil.pid_exists(record.get("driver", -1)) and record["driver"] != os.getpid():
        return 0  # that driver is still running: its processes are not leftovers
    killed = 0
    for pid, started in record.get("processes", []):
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - started) < 1e-3:
                process.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    path.unlink(missing_ok=True)
    return killed
