"""The Python code tool: run model-written code isolated at the OS level, with CPU, memory, wall and output limits.

Each call runs `python -I` in new Linux namespaces (`unshare`: user, mount, network, PID) inside a root made of
read-only bind mounts of the system and interpreter folders plus a writable sandbox folder (the working directory,
`/sandbox`), then `chroot`. So the code:
- reads no file outside the sandbox but the system's and the interpreter's own (no /etc, no home, no run folder);
- has no network (a fresh network namespace has only a loopback, down);
- cannot outlive the call: the namespace's first process is killed with the call, and with it every process the
  code started (PID namespace);
- gets `cpu_seconds` of CPU (RLIMIT_CPU), `memory_mb` of address space (RLIMIT_AS), `wall_seconds` in all, and its
  combined stdout/stderr is cut to `max_output_chars`.

Where unprivileged user namespaces are unavailable the tool refuses to run (`check_sandbox` says why at start-up):
running untrusted code without isolation is not an option. Fork bombs are bounded by the wall limit and memory, not
by a process count (the limits of a cgroup would need privileges).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megarl.errors import UserError

_ROOT_SETUP = r"""
set -e
root=$(mktemp -d)
mount -t tmpfs tmpfs "$root"
for d in /usr /lib /lib32 /lib64 /bin /sbin "$MEGARL_PYTHON_PREFIX"; do
  [ -d "$d" ] || continue
  mkdir -p "$root$d"
  mount --rbind "$d" "$root$d"
  mount -o remount,bind,ro "$root$d" 2>/dev/null || true
done
mkdir -p "$root/sandbox" "$root/tmp" "$root/dev" "$root/proc"
mount --bind "$MEGARL_SANDBOX" "$root/sandbox"
mount -t tmpfs -o size=64m tmpfs "$root/tmp"
for f in null zero urandom; do touch "$root/dev/$f"; mount --bind "/dev/$f" "$root/dev/$f"; done
mount -t proc proc "$root/proc"
# the code runs as a child of this shell (PID 1 of the namespace), which reports a signal that stopped it
exec chroot "$root" /bin/sh -c 'cd /sandbox; "$0" "$@"; s=$?
[ $s -gt 128 ] && echo "megarl-signal $((s - 128))"; exit $s' "$@"
"""


@dataclass
class CodeToolConfig:
    cpu_seconds: int = 5
    """CPU time of the code (all its threads), seconds."""
    wall_seconds: float = 10.0
    """Wall time of the whole call, seconds."""
    memory_mb: int = 1024
    """Address space of each process, MiB (Python itself takes about 30)."""
    max_output_chars: int = 2000
    """stdout and stderr together, cut to this many characters."""


def run_python(code: str, config: CodeToolConfig | None = None, sandbox: str | Path | None = None) -> str:
    """Run `code` isolated; its output (cut to the limit), plus a line saying why it stopped if it did not end
    normally. `sandbox`: the working folder it may read and write (default: a fresh temporary one, removed after)."""
    folder = Path(sandbox) if sandbox is not None else Path(tempfile.mkdtemp(prefix="megarl-code-"))
    try:
        (folder / "main.py").write_text(code)
        return _run_in_namespace(["main.py"], config or CodeToolConfig(), folder)
    finally:
        if sandbox is None:
            shutil.rmtree(folder, ignore_errors=True)


def _run_in_namespace(args: list[str], config: CodeToolConfig, folder: Path) -> str:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise UserError("the Python code tool needs `unshare` (util-linux) to isolate the code; it is not installed")
    command = [unshare, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]
    command += ["/bin/sh", "-c", _ROOT_SETUP, "sh", sys.executable, "-I", *args]
    # the interpreter's own folder (a venv's interpreter links to its base one), read-only inside
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "MEGARL_SANDBOX": str(folder),
        "MEGARL_PYTHON_PREFIX": sys.base_prefix,
    }
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # one process group: killed whole at the deadline
        preexec_fn=lambda: _limit(config),
    )
    try:
        output, _ = process.communicate(timeout=config.wall_seconds)
        ending = _ending(process.returncode, config)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        ending = f"stopped: wall time limit ({config.wall_seconds:g} s)"
    text, ending = _signal_ending(output.decode("utf-8", errors="replace"), config, ending)
    if len(text) > config.max_output_chars:
        text = text[: config.max_output_chars] + f"\n... (output cut at {config.max_output_chars} characters)"
    return text + (f"\n{ending}" if ending else "")


def _limit(config: CodeToolConfig) -> None:
    """In the child, before exec: the limits every process of the call inherits."""
    # SIGXCPU at the soft limit (reported as the CPU limit), SIGKILL a second later if it is caught
    resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_seconds, config.cpu_seconds + 1))
    memory = config.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 2**20, 64 * 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _ending(returncode: int, config: CodeToolConfig) -> str:
    return "" if returncode == 0 else f"exit code {returncode}"


def _signal_ending(text: str, config: CodeToolConfig, ending: str) -> tuple[str, str]:
    """The code's output without the sandbox's own lines, and why it stopped when a signal stopped it (the shell
    inside the sandbox reports it: `unshare` itself only says it was interrupted)."""
    lines = [line for line in text.split("\n") if not line.startswith("unshare: ")]
    if lines and lines[-1] == "":
        lines.pop()
    if lines and lines[-1].startswith("megarl-signal "):
        number = int(lines.pop().split()[1])
        if lines and (lines[-1] == "Killed" or lines[-1].startswith("CPU time limit exceeded")):
            lines.pop()  # the shell's own notice of the signal
        ending = {
            signal.SIGXCPU: f"stopped: CPU time limit ({config.cpu_seconds} s)",
            signal.SIGKILL: "stopped: killed (memory or time limit)",
        }.get(number, f"stopped by signal {number}")
    return "\n".join(lines) + ("\n" if lines else ""), ending


def check_sandbox() -> None:
    """Raise UserError saying why the code tool cannot isolate code on this machine (nothing when it can)."""
    with tempfile.TemporaryDirectory(prefix="megarl-code-check-") as folder:
        try:
            output = _run_in_namespace(["-c", "print('isolated')"], CodeToolConfig(wall_seconds=30), Path(folder))
        except OSError as e:
            raise UserError(f"the Python code tool cannot start its sandbox: {e}") from None
    if output.strip() != "isolated":
        raise UserError(
            "the Python code tool cannot isolate code here (unprivileged user namespaces, mounts or chroot refused): "
            f"{output.strip()[-500:]}; it does not run code without isolation"
        )
