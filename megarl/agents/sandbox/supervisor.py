"""The supervisor inside the code tool's sandbox: PID 1 of its PID namespace, the parent of the code.

It runs from its source (`python -I -S -c`), standard library only, under the same seccomp filter and uid as the
code; bubblewrap's `--die-with-parent` kills it, and with it the whole namespace, when the caller dies. It
- starts the code with the per-process limits (address space, file size, open files, process count, CPU);
- enforces what per-process limits cannot: the CPU time of all the code's processes together (RLIMIT_CPU counts
  one process), its private memory plus what it holds in the sandbox's tmpfs, the number of its tasks (threads
  included: RLIMIT_NPROC does not bind a uid that is root outside the namespace), and the wall time; it looks
  every `POLL_SECONDS` and kills every process of the namespace past a limit;
- ends the call when the code's first process ends, killing what it left running, and writes how it ended as one
  JSON line on the status descriptor (which the code never holds: the supervisor is not dumpable, so the code,
  which runs as the same uid, cannot open its descriptors or memory through /proc).
"""

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

POLL_SECONDS = 0.02
TICKS = os.sysconf("SC_CLK_TCK")


def _scan(tmpfs):
    """(CPU seconds, bytes of anonymous memory and tmpfs, tasks) of every process of the namespace but this one."""
    own = os.times()
    ticks = (own.children_user + own.children_system) * TICKS  # the code's processes this one has reaped
    memory = sum(_tmpfs_used(path) for path in tmpfs)
    tasks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except (OSError, IndexError):
            continue  # ended meanwhile
        # utime, stime, cutime, cstime (the reaped children of each live process), num_threads
        ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))
        tasks += int(fields[17])
        memory += _resident_kib(status) * 1024
    return ticks / TICKS, memory, tasks


def _resident_kib(status):
    """Private and shared anonymous memory of a process (RssAnon + RssShmem of /proc/PID/status; not its mapped
    files, which are the read-only system's). A segment shared by several processes counts in each."""
    total = 0
    for line in status.splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1])
    return total


def _tmpfs_used(path):
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def _start(config):
    pid = os.fork()
    if pid:
        return pid
    try:
        mib = 2**20
        for limit, value in [
            (resource.RLIMIT_AS, config["memory_mb"] * mib),
            (resource.RLIMIT_FSIZE, config["disk_mb"] * mib),
            (resource.RLIMIT_NOFILE, 256),
            # counted per uid of the namespace, the supervisor included: one more task than max_processes lets the
            # supervisor see the excess and report the process limit (the kernel ignores it where the uid is root
            # outside the namespace: there the supervisor alone bounds the count)
            (resource.RLIMIT_NPROC, config["max_processes"] + 2),
            (resource.RLIMIT_CORE, 0),
        ]:
            resource.setrlimit(limit, (value, value))
        # SIGXCPU at the soft limit (reported as the CPU limit), SIGKILL a second later if it is caught
        resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"], config["cpu_seconds"] + 1))
        os.closerange(3, 1 << 16)  # the status descriptor above all
        os.setsid()
        for number in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(number, signal.SIG_DFL)
        os.execv(config["argv"][0], config["argv"])
    except BaseException as e:  # the child must never return into the supervisor's loop
        os.write(2, f"sandbox: cannot start the code: {e}\n".encode())
    os._exit(127)


def _supervise(config, pid):
    """Wait for the code's first process; (its wait status or None, the limit that stopped it or None)."""
    deadline = time.monotonic() + config["wall_seconds"]
    pidfd = os.pidfd_open(pid)
    while True:
        select.select([pidfd], [], [], POLL_SECONDS)  # wakes up as soon as the code's process ends
        status = None
        while True:  # reap every ended process: orphans are this process's children
            try:
                ended, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if ended == 0:
                break
            if ended == pid:
                status = wait_status
        if status is not None:
            return status, None
        if time.monotonic() > deadline:
            return None, "wall"
        cpu, memory, tasks = _scan(config["tmpfs"])
        if cpu > config["cpu_seconds"]:
            return None, "cpu"
        if memory > config["memory_mb"] * 2**20:
            return None, "memory"
        if tasks > config["max_processes"]:
            return None, "processes"


def main(config):
    status_fd = config["status_fd"]
    os.set_blocking(status_fd, True)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = _start(config)
    status, limit = _supervise(config, pid)
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)  # every other process of the namespace
    while True:
        try:
            ended, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if ended == pid and status is None and limit is None:
            status = wait_status
    cpu = (lambda t: t.children_user + t.children_system)(os.times())
    report = {"limit": limit, "cpu_seconds": round(cpu, 3)}
    if status is not None:
        report["exit"] = os.waitstatus_to_exitcode(status)
    os.write(status_fd, (json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
