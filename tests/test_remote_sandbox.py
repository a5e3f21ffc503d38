"""The Python tool on a SandboxFusion server (remote_sandbox.py), against a stand-in on 127.0.0.1 that speaks the
documented run_code API (the real server is a Docker service: it cannot run here): the local tool's result format,
HTTP errors and slow servers as clear failures, bounded retries, at most N requests in flight, start-up checks."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.agents.code_tool import CodeToolConfig
from megarl.agents.environment import ToolEnvironment, load_environment
from megarl.agents.remote_sandbox import SandboxFusionClient, SandboxFusionConfig, SandboxUnavailable
from megarl.errors import UserError

sys.path.insert(0, str(Path(__file__).parent / "agent_fixtures"))
from sandbox_fusion import SandboxFusionStandIn, finished

LIMITS = CodeToolConfig(wall_seconds=2, memory_mb=256, max_output_chars=40)


def _client(url: str, **kwargs) -> SandboxFusionClient:
    return SandboxFusionClient(SandboxFusionConfig(url, **kwargs))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_answers_read_as_the_local_tool_writes_them():
    answers = {
        "ok": finished("4\n"),
        "raises": finished("partial\n", "ZeroDivisionError\n", 1),
        "slow": finished("tick\n", status="TimeLimitExceeded", return_code=-9),
        "loud": finished("x" * 100),
    }
    with SandboxFusionStandIn(lambda request: (200, answers[request["code"]])) as server:
        client = _client(server.url + "/")
        results = {code: client.run_python(code, LIMITS) for code in answers}
    assert results == {
        "ok": "4\n",
        "raises": "partial\nZeroDivisionError\n\nexit code 1",
        "slow": "tick\n\nstopped: wall time limit (2 s)",
        "loud": "x" * 40 + "\n... (output cut at 40 characters)",
    }
    # the documented request: python, the code's wall time and memory as the server's limits
    assert server.requests[0] == {"code": "ok", "language": "python", "run_timeout": 2, "compile_timeout": 2,
                                  "memory_limit_MB": 256, "stdin": "", "files": {}, "fetch_files": []}  # fmt: skip


def test_server_errors_fail_clearly_and_only_gateway_errors_are_retried():
    with SandboxFusionStandIn(lambda request: (500, b'{"detail": "runner crashed"}')) as server:
        with pytest.raises(SandboxUnavailable, match=r'run_code answered HTTP 500: \{"detail": "runner crashed"\}'):
            _client(server.url).run_python("1", LIMITS)
        assert len(server.requests) == 1  # a 500 is the server's answer: asking again gives the same
    with SandboxFusionStandIn(lambda request: (503, b"busy")) as server:
        with pytest.raises(SandboxUnavailable, match="answered HTTP 503: busy"):
            _client(server.url, retries=2).run_python("1", LIMITS)
        assert len(server.requests) == 3
    calls = []

    def busy_once(request):
        calls.append(1)
        return (504, b"gateway") if len(calls) == 1 else (200, finished("ok\n"))

    with SandboxFusionStandIn(busy_once) as server:
        assert _client(server.url).run_python("1", LIMITS) == "ok\n" and len(server.requests) == 2
    error = {"status": "SandboxError", "message": "no runner for python", "run_result": None}
    not_run = pytest.raises(SandboxUnavailable, match="could not run the code: no runner for python")
    with SandboxFusionStandIn(lambda request: (200, error)) as server, not_run:
        _client(server.url).run_python("1", LIMITS)
    not_json = pytest.raises(SandboxUnavailable, match="answered b'<html>proxy login</html>', not a SandboxFusion")
    with SandboxFusionStandIn(lambda request: (200, b"<html>proxy login</html>")) as server, not_json:
        _client(server.url).run_python("1", LIMITS)


def test_a_slow_server_is_given_up_on_at_the_timeout_and_an_absent_one_after_bounded_retries():
    with SandboxFusionStandIn(delay_s=3.0) as server:
        start = time.monotonic()
        with pytest.raises(SandboxUnavailable, match=r"did not answer within 0\.5 s"):
            _client(server.url, timeout_s=0.5).run_python("1", LIMITS)
        assert time.monotonic() - start < 1.5
    url = f"http://127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=f"{url}/run_code cannot be reached: .*Connection refused"):
        _client(url, retries=2).run_python("1", LIMITS)
    assert 1.5 <= time.monotonic() - start < 3.0  # two pauses: 0.5 s and 1 s


def test_at_most_max_concurrency_requests_are_in_flight_across_the_process():
    with SandboxFusionStandIn(lambda request: (200, finished("done\n")), delay_s=0.3) as server:
        clients = [_client(server.url, max_concurrency=3) for _ in range(2)]  # e.g. two episodes' environments
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(clients[i % 2].run_python("1", LIMITS)))
            for i in range(10)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == ["done\n"] * 10 and len(server.requests) == 10 and server.max_in_flight == 3


def test_tool_environment_runs_python_on_the_server():
    with SandboxFusionStandIn(lambda request: (200, finished(f"ran {len(request['code'])} chars\n"))) as server:
        env = ToolEnvironment(tools=["python"], code_backend="sandbox_fusion", sandbox_url=server.url)
        result = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    assert (result.observation, result.tool_calls, result.tool_errors) == ("ran 8 chars\n", 1, 0)


def test_start_up_refuses_a_bad_or_unreachable_server_naming_the_url():
    kwargs = {"tools": ["python"], "code_backend": "sandbox_fusion"}
    with SandboxFusionStandIn() as server:
        make_env = load_environment("tools", {**kwargs, "sandbox_url": server.url})
        assert [r["code"] for r in server.requests] == ["print(6 * 7)"]  # the probe ran; episodes may start
        assert make_env().remote.url == f"{server.url}/run_code"
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(UserError, match=f"sandbox server {url}/run_code cannot run code: .* cannot be reached"):
        load_environment("tools", {**kwargs, "sandbox_url": url, "sandbox_retries": 0})
    wrong = pytest.raises(UserError, match=r"ran print\(6 \* 7\) and answered 'hello\\n'")
    with SandboxFusionStandIn(lambda request: (200, finished("hello\n"))) as server, wrong:
        load_environment("tools", {**kwargs, "sandbox_url": server.url})
    refusals = {
        "code_backend=sandbox_fusion needs agent.env_kwargs.sandbox_url": {},
        r"sandbox_url='localhost:8080' is not a URL like http://host:8080": {"sandbox_url": "localhost:8080"},
        r"sandbox_url='http://h:99999' has an invalid port": {"sandbox_url": "http://h:99999"},
        r"sandbox_timeout_s=5 must be longer than the code's wall time \(agent.env_kwargs.code_limits.wall_seconds=10":
            {"sandbox_url": "http://h:1", "sandbox_timeout_s": 5},
        "sandbox_max_concurrency=0 must be >= 1": {"sandbox_url": "http://h:1", "sandbox_max_concurrency": 0},
    }  # fmt: skip
    for message, extra in refusals.items():
        with pytest.raises(UserError, match=message):
            load_environment("tools", {**kwargs, **extra})
    with pytest.raises(UserError, match="code_backend='docker': valid are local, sandbox_fusion"):
        load_environment("tools", {"tools": ["python"], "code_backend": "docker"})
    with pytest.warns(UserWarning, match=r"agent.env_kwargs \['sandbox_url'\] have no effect with code_backend=local"):
        load_environment("tools", {"tools": ["calculator"], "sandbox_url": "http://h:1"})
