"""The Python tool on a remote sandbox server: SandboxFusion's HTTP API (what verl users run), for clusters where the
local sandbox cannot isolate code (no unprivileged user namespaces).

One call is one `POST {url}/run_code` with `{"code", "language": "python", "run_timeout", "memory_limit_MB", ...}`;
the answer's `run_result` (`status` Finished | TimeLimitExceeded | Error, `stdout`, `stderr`, `return_code`) becomes
the same text the local tool returns: the output cut to `max_output_chars`, then a line saying why the code stopped
when it did not end normally. The server runs the code in its own sandbox: what it isolates is the server's business
(its deployment guide); megarl only talks to it.

Bounds: at most `max_concurrency` requests in flight across the process (one semaphore per server), each waiting at
most `timeout_s` for the answer (and never past the environment step's deadline), answers read up to
`MAX_ANSWER_BYTES`; a refused connection or a gateway error (502, 503, 504) is retried `retries` times with a
growing pause. A server that cannot answer is `SandboxUnavailable` (the episode fails, counted; the run goes on):
the model's code is not to blame, so it gets no observation of it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from megarl.agents.code_tool import CodeToolConfig
from megarl.errors import UserError

MAX_ANSWER_BYTES = 8 * 2**20
_GATEWAY_ERRORS = (502, 503, 504)
_DEADLINE_MARGIN_S = 1.0


class SandboxUnavailable(RuntimeError):
    """The sandbox server did not run the code: unreachable, too slow, or it answered with an error of its own."""


@dataclass(frozen=True)
class SandboxFusionConfig:
    url: str
    """The server, e.g. http://sandbox:8080 (`/run_code` is added; a URL ending in /run_code is taken as it is)."""
    timeout_s: float = 30.0
    """Seconds to wait for one answer (the code's wall time plus the server's own overhead)."""
    max_concurrency: int = 8
    """Requests in flight at once, across the process."""
    retries: int = 2
    """Retries of a refused connection or a gateway error (502, 503, 504), 0.5 s, 1 s, ... apart."""


def format_output(text: str, ending: str, max_output_chars: int) -> str:
    """The tool's answer: the output cut to `max_output_chars`, then `ending` (why the code stopped) on a line."""
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + f"\n... (output cut at {max_output_chars} characters)"
    return text + (f"\n{ending}" if ending else "")


_semaphores: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_semaphores_lock = threading.Lock()


def _slots(endpoint: str, limit: int) -> threading.BoundedSemaphore:
    with _semaphores_lock:
        return _semaphores.setdefault((endpoint, limit), threading.BoundedSemaphore(limit))


class SandboxFusionClient:
    """Runs Python code on a SandboxFusion server (see the module docstring)."""

    def __init__(self, config: SandboxFusionConfig, key: str = "agent.env_kwargs"):
        url = urllib.parse.urlsplit(config.url or "")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UserError(f"{key}.sandbox_url={config.url!r} is not a URL like http://host:8080")
        try:
            url.port  # noqa: B018 (parsing it checks it)
        except ValueError:
            raise UserError(f"{key}.sandbox_url={config.url!r} has an invalid port") from None
        if not config.timeout_s > 0:
            raise UserError(f"{key}.sandbox_timeout_s={config.timeout_s} must be > 0")
        if config.max_concurrency < 1:
            raise UserError(f"{key}.sandbox_max_concurrency={config.max_concurrency} must be >= 1")
        if config.retries < 0:
            raise UserError(f"{key}.sandbox_retries={config.retries} must be >= 0")
        path = url.path.rstrip("/")
        self.config = config
        self.url = urllib.parse.urlunsplit(
            (url.scheme, url.netloc, path if path.endswith("/run_code") else f"{path}/run_code", "", "")
        )
        self._slots = _slots(self.url, config.max_concurrency)

    def run_python(self, code: str, limits: CodeToolConfig, time_left: Callable[[], float] = lambda: math.inf) -> str:
        """The output of `code` as the local tool gives it; `time_left()`: seconds before the caller's deadline
        (the request is not sent once it is past, and waits no longer than it)."""
        wall = min(limits.wall_seconds, time_left())
        if wall <= 0:
            raise SandboxUnavailable("not run: the step's deadline passed")
        request = {
            "code": code,
            "language": "python",
            "run_timeout": wall,
            "compile_timeout": wall,
            "memory_limit_MB": limits.memory_mb,
            "stdin": "",
            "files": {},
            "fetch_files": [],
        }
        answer = self._post(json.dumps(request).encode(), time_left)
        if answer is None:
            return format_output("", f"stopped: the output is larger than {MAX_ANSWER_BYTES} bytes", 0)
        return _tool_text(answer, wall, limits.max_output_chars, self.url)

    def check(self) -> None:
        """Raise UserError naming the URL unless the server runs a line of Python and returns its output."""
        try:
            output = self.run_python("print(6 * 7)", CodeToolConfig(wall_seconds=min(10.0, self.config.timeout_s)))
        except SandboxUnavailable as e:
            raise UserError(f"the Python tool's sandbox server {self.url} cannot run code: {e}") from None
        if output != "42\n":
            raise UserError(f"the Python tool's sandbox server {self.url} ran print(6 * 7) and answered {output!r}")

    def _post(self, body: bytes, time_left: Callable[[], float]) -> dict | None:
        """The server's JSON answer (None: larger than MAX_ANSWER_BYTES), retrying what may pass."""
        pause = 0.5
        for attempt in range(self.config.retries + 1):
            last = attempt == self.config.retries
            wait = time_left()  # a free slot is awaited up to the step's deadline, not the server's timeout
            if not self._slots.acquire(timeout=max(wait, 0.0) if math.isfinite(wait) else None):
                raise SandboxUnavailable(
                    f"{self.url}: no free request slot (sandbox_max_concurrency={self.config.max_concurrency}) "
                    "before the step's deadline"
                )
            try:
                # a moment past the caller's deadline, so that the caller's own timeout is what it reports
                status, data = self._exchange(body, min(self.config.timeout_s, time_left() + _DEADLINE_MARGIN_S))
            except OSError as e:  # refused, reset, no route, no such host (timeouts are SandboxUnavailable already)
                if last:
                    raise SandboxUnavailable(f"{self.url} cannot be reached: {e}") from None
                status, data = None, b""
            finally:
                self._slots.release()
            if status == 200:
                return _json_answer(data, self.url) if data is not None else None
            if status is not None and (status not in _GATEWAY_ERRORS or last):
                detail = (data or b"")[:300].decode(errors="replace")
                raise SandboxUnavailable(f"{self.url} answered HTTP {status}: {detail}")
            if time_left() <= pause:
                raise SandboxUnavailable(f"{self.url} did not answer before the step's deadline")
            time.sleep(pause)
            pause *= 2
        raise AssertionError("unreachable")

    def _exchange(self, body: bytes, timeout_s: float) -> tuple[int, bytes | None]:
        """POST `body`; (HTTP status, the answer's bytes or None past MAX_ANSWER_BYTES), all within `timeout_s`."""
        if timeout_s <= 0:
            raise SandboxUnavailable("not sent: the step's deadline passed")
        end = time.monotonic() + timeout_s
        url = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname, url.port, timeout=timeout_s)
        try:
            connection.request("POST", url.path, body, {"Content-Type": "application/json"})
            sock = connection.sock  # each wait on it gets what is left of timeout_s
            sock.settimeout(max(end - time.monotonic(), 1e-3))
            response = connection.getresponse()
            chunks, size = [], 0
            while chunk := response.read(65536):
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    return response.status, None
                chunks.append(chunk)
                if time.monotonic() > end:
                    raise TimeoutError
                with contextlib.suppress(OSError):  # closed once the answer is complete
                    sock.settimeout(max(end - time.monotonic(), 1e-3))
            return response.status, b"".join(chunks)
        except TimeoutError:  # socket.timeout is TimeoutError
            raise SandboxUnavailable(f"{self.url} did not answer within {timeout_s:.3g} s") from None
        finally:
            connection.close()


def _json_answer(data: bytes, url: str) -> dict:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise SandboxUnavailable(f"{url} answered {data[:200]!r}, not a SandboxFusion run_code answer")
    return answer


def _tool_text(answer: dict, wall: float, max_output_chars: int, url: str) -> str:
    """A run_code answer as the local tool's text."""
    run = answer.get("run_result")
    if answer.get("status") == "SandboxError" or not isinstance(run, dict) or run.get("status") == "Error":
        message = answer.get("message") or (run or {}).get("stderr") or "no run result"
        raise SandboxUnavailable(f"{url} could not run the code: {str(message)[:300]}")
    text = (run.get("stdout") or "") + (run.get("stderr") or "")
    if run.get("status") == "TimeLimitExceeded":
        ending = f"stopped: wall time limit ({wall:g} s)"
    elif run.get("return_code") not in (0, None):
        ending = f"exit code {run['return_code']}"
    else:
        ending = ""
    return format_output(text, ending, max_output_chars)
