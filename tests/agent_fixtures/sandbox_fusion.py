"""A stand-in of a SandboxFusion server on 127.0.0.1 (loopback only), speaking its documented API: `POST /run_code`
with a RunCodeRequest's JSON, answered with a RunCodeResponse's (`status`, `message`, `run_result`: `status`,
`stdout`, `stderr`, `return_code`, `execution_time`). It runs no code: each test says what it answers. It counts the
requests and the most it held at once; request bodies over 1 MiB are refused (413)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_REQUEST_BYTES = 2**20

Answer = Callable[[dict], tuple[int, Any]]
"""request JSON -> (HTTP status, the answer: a dict sent as JSON, or bytes sent as they are)."""


def finished(stdout: str = "", stderr: str = "", return_code: int = 0, status: str = "Finished") -> dict:
    """A run_code answer of code that ran (status Finished or TimeLimitExceeded)."""
    ok = status == "Finished" and return_code == 0
    run = {"status": status, "execution_time": 0.01, "return_code": return_code, "stdout": stdout, "stderr": stderr}
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "run_result": run}


def print_42(request: dict) -> tuple[int, Any]:
    """What a server answers to the start-up probe, print(6 * 7); other code prints nothing."""
    return 200, finished("42\n" if request["code"] == "print(6 * 7)" else "")


class SandboxFusionStandIn:
    def __init__(self, answer: Answer = print_42, delay_s: float = 0.0):
        self.answer, self.delay_s = answer, delay_s
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                stand_in._serve(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> SandboxFusionStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length", 0))
        if handler.path != "/run_code" or length > MAX_REQUEST_BYTES:
            handler.send_error(404 if handler.path != "/run_code" else 413)
            return
        request = json.loads(handler.rfile.read(length))
        with self._lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            status, answer = self.answer(request)
            body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting (the timeout tests)
        finally:
            with self._lock:
                self.in_flight -= 1
