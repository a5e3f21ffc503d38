"""The Python code tool: run model-written code in a bubblewrap sandbox, with CPU, memory, disk, process, wall and
output limits that hold even when the caller dies.

The policy writing the code is treated as an adversary: RL optimizes it to get reward, and whatever the sandbox lets
through, training will find. Each call runs `python -I` under bubblewrap (megarl/agents/sandbox/bwrap.py: new
namespaces of every kind, pivot_root into a read-only root holding only the system's and the interpreter's folders,
an unprivileged uid, no capabilities, no_new_privs, no network, a seccomp filter, sandbox/seccomp.py), started by
a supervisor that is PID 1 of the sandbox (sandbox/supervisor.py) and enforces the limits over all the processes
the code starts. The caller reads the output with a bound and kills the sandbox past it or past the wall time.

Where isolation cannot be had (no bwrap, user namespaces off, no seccomp table for the machine) the tool refuses to
run: `check_sandbox` says why at start-up. docs/sandbox.md has the threat model and what the host needs.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.agents.sandbox import bwrap
from megarl.agents.sandbox.seccomp import build_filter
from megarl.errors import UserError

_GRACE_SECONDS = 2.0
"""How long past wall_seconds the caller waits for the supervisor before it kills the sandbox itself."""


@dataclass
class CodeToolConfig:
    cpu_seconds: int = 5
    """CPU time of the code, all its processes and threads together, seconds."""
    wall_seconds: float = 10.0
    """Wall time of the whole call, seconds."""
    memory_mb: int = 1024
    """Address space of each process, and anonymous memory of all processes plus what the sandbox's tmpfs hold, MiB
    (Python itself takes about 30 of address space)."""
    disk_mb: int = 64
    """Size of each writable place (the working folder, /tmp, /dev/shm: memory-backed), and of any one file, MiB."""
    max_processes: int = 32
    """Processes and threads of the code at once."""
    max_output_chars: int = 2000
    """stdout and stderr together, cut to this many characters (the sandbox is killed past 4x as many bytes)."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_mb", "disk_mb", "max_processes", "max_output_chars"):
            value, kinds = getattr(self, name), (int, float) if name == "wall_seconds" else int
            if not isinstance(value, kinds) or isinstance(value, bool) or value <= 0:
                kind = "number" if name == "wall_seconds" else "integer"
                raise UserError(f"code tool limit {name}={value!r}: must be a positive {kind}")


def run_python(code: str, config: CodeToolConfig | None = None, sandbox: str | Path | None = None) -> str:
    """Run `code` isolated; its output (cut to the limit), plus a line saying why it stopped if it did not end
    normally. `sandbox`: a folder whose files are copied into the code's working folder first (what the code
    writes stays in the sandbox and goes with it)."""
    config = config or CodeToolConfig()
    files = _input_files(Path(sandbox), config) if sandbox is not None else {}
    files["main.py"] = code.encode()
    return _run(["main.py"], config, files)


def _input_files(folder: Path, config: CodeToolConfig) -> dict[str, bytes]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            files[path.relative_to(folder).as_posix()] = path.read_bytes()
    if sum(len(data) for data in files.values()) > config.disk_mb * 2**20:
        raise UserError(f"the code tool's input folder {folder} holds more than disk_mb={config.disk_mb} MiB")
    return files


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("megarl-code-tool")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run(args: list[str], config: CodeToolConfig, files: dict[str, bytes]) -> str:
    try:
        program = build_filter()
    except KeyError as e:
        raise UserError(f"the Python code tool cannot isolate code here: {e.args[0]}") from None
    binary, (python, _) = bwrap.find_bwrap(), bwrap.interpreter()
    supervisor = {
        "memory_mb": config.memory_mb,
        "disk_mb": config.disk_mb,
        "max_processes": config.max_processes,
        "cpu_seconds": config.cpu_seconds,
        "wall_seconds": config.wall_seconds,
        "tmpfs": bwrap.tmpfs_paths(),
        "argv": [python, "-I", *args],
    }
    status_read, status_write = os.pipe()
    descriptors = [status_write, _memfd(program)] + [_memfd(data) for data in files.values()]
    try:
        supervisor["status_fd"] = status_write
        folders = sorted({p.parent.as_posix() for p in map(Path, files) if p.parent != Path(".")}, key=len)
        argv = [python, "-I", "-S", "-c", bwrap.supervisor_source(), json.dumps(supervisor)]
        command = bwrap.command(
            binary, config.disk_mb, descriptors[1], dict(zip(files, descriptors[2:])), folders, argv
        )
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={},
            pass_fds=descriptors,
            start_new_session=True,  # one process group: killed whole past a limit
        )
    except BaseException:
        os.close(status_read)
        raise
    finally:
        for fd in descriptors:
            os.close(fd)
    try:
        output, stopped = _read_bounded(process, config)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
        report = _read_report(status_read)
    text = output.decode("utf-8", errors="replace")
    if len(text) > config.max_output_chars:
        text = text[: config.max_output_chars] + f"\n... (output cut at {config.max_output_chars} characters)"
    if report is None and stopped is None:  # the sandbox itself failed: bwrap says why in the output
        stopped = f"sandbox failed (exit code {process.returncode})"
    ending = stopped or _ending(report, config)
    return text + (f"\n{ending}" if ending else "")


def _read_bounded(process: subprocess.Popen, config: CodeToolConfig) -> tuple[bytes, str | None]:
    """The sandbox's output, read until it ends, it passes 4x max_output_chars bytes (plus 64 KiB) or the wall time
    passes (plus a grace for the supervisor to report): (the bytes, why the caller stopped it or None)."""
    cap = 4 * config.max_output_chars + 2**16
    deadline = time.monotonic() + config.wall_seconds + _GRACE_SECONDS
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), f"stopped: wall time limit ({config.wall_seconds:g} s)"
            if not selector.select(left):
                continue
            chunk = os.read(process.stdout.fileno(), 2**16)
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return b"".join(chunks), f"stopped: output limit ({config.max_output_chars} characters)"


def _read_report(fd: int) -> dict | None:
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 4096)
    except BlockingIOError:
        data = b""
    finally:
        os.close(fd)
    try:
        return json.loads(data)
    except ValueError:
        return None


def _ending(report: dict, config: CodeToolConfig) -> str:
    limit = {
        "cpu": f"stopped: CPU time limit ({config.cpu_seconds} s)",
        "wall": f"stopped: wall time limit ({config.wall_seconds:g} s)",
        "memory": f"stopped: memory limit ({config.memory_mb} MiB)",
        "processes": f"stopped: process limit ({config.max_processes})",
    }
    if report["limit"] is not None:
        return limit[report["limit"]]
    code = report["exit"]
    if code >= 0:
        return "" if code == 0 else f"exit code {code}"
    return {
        signal.SIGXCPU: limit["cpu"],
        signal.SIGXFSZ: f"stopped: file size limit ({config.disk_mb} MiB)",
    }.get(-code, f"stopped by signal {-code} ({signal.Signals(-code).name})")


def check_sandbox() -> None:
    """Raise UserError saying why the code tool cannot isolate code on this machine (nothing when it can)."""
    probe = (
        "import os\n"
        "status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines())\n"
        "try:\n"
        "    os.chroot('/tmp')\n"
        "except PermissionError:\n"
        "    checks = [os.getuid() == 65534, status['Seccomp'].strip() == '2', status['NoNewPrivs'].strip() == '1',\n"
        "              int(status['CapEff'], 16) == 0]\n"
        "    print('isolated' if all(checks) else f'checks failed: {checks}')\n"
    )
    try:
        output = _run(["-c", probe], CodeToolConfig(wall_seconds=30), {})
    except OSError as e:
        raise UserError(f"the Python code tool cannot start its sandbox: {e}") from None
    if output != "isolated\n":
        raise UserError(
            "the Python code tool cannot isolate code here (bubblewrap needs unprivileged user namespaces, or root; "
            f"see docs/sandbox.md): {output.strip()[-500:]}; it does not run code without isolation"
        )
