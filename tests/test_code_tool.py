"""The Python code tool runs model-written code isolated: it reads nothing outside its sandbox folder but the system's
and the interpreter's files, opens no socket, and cannot outlive its CPU, memory and wall limits or the call."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from megarl.agents.code_tool import CodeToolConfig, check_sandbox, run_python
from megarl.agents.environment import ToolEnvironment

LIMITS = CodeToolConfig(cpu_seconds=1, wall_seconds=4, memory_mb=256, max_output_chars=300)


@pytest.fixture(scope="module", autouse=True)
def isolation():
    check_sandbox()  # CI machines have unprivileged user namespaces; a machine without them refuses the tool


def test_code_runs_in_its_sandbox_folder(tmp_path):
    (tmp_path / "data.txt").write_text("21")
    code = "import os\nprint(os.getcwd(), int(open('data.txt').read()) * 2)\nopen('out.txt', 'w').write('ok')"
    out = run_python(code, LIMITS, tmp_path)
    assert out == "/sandbox 42\n" and (tmp_path / "out.txt").read_text() == "ok"


def test_code_cannot_read_files_outside_its_sandbox(tmp_path):
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


def test_code_cannot_open_sockets():
    code = (
        "import socket\n"
        "for target in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=2)\n"
        "        print('connected')\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    assert run_python(code, LIMITS).split("\n")[:2] == ["refused 101", "refused 101"]  # ENETUNREACH: no network


def test_code_cannot_outlive_its_limits():
    start = time.perf_counter()
    assert run_python("while True:\n    pass", LIMITS) == "\nstopped: CPU time limit (1 s)"
    assert run_python("import time\ntime.sleep(60)", LIMITS) == "\nstopped: wall time limit (4 s)"
    assert time.perf_counter() - start < 8
    assert run_python("x = bytearray(512 * 2**20)", LIMITS).endswith("MemoryError\n\nexit code 1")
    out = run_python("print('x' * 5000)", LIMITS)
    assert out == "x" * 300 + "\n... (output cut at 300 characters)"


def test_processes_the_code_starts_die_with_the_call():
    marker = uuid.uuid4().hex
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(120)', '{marker}']"
    code = f"import subprocess, sys\nsubprocess.Popen({sleeper})\nprint('started')"
    assert run_python(code, LIMITS) == "started\n"
    time.sleep(0.5)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert survivors == []


def test_the_python_tool_answers_tool_calls():
    env = ToolEnvironment(tools=["calculator", "python"], tool_format="tag", code_limits={"wall_seconds": 5})
    result = env.step("<tool>python(print(sum(range(10))))</tool> <tool>calculator(2**10)</tool>")
    assert result.observation == "45\n\n1024" and result.tool_errors == 0
