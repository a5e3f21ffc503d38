"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, serving model folders: enough for the real
`huggingface_hub` client (`snapshot_download`) pointed at it with HF_ENDPOINT. huggingface.co cannot be reached from
this machine; everything on the client side (requests, allow_patterns, the cache layout, errors) is the real one.

Endpoints, as the client (huggingface_hub 2.4) calls them: the model info of a revision (`/api/models/ORG/NAME/
revision/REV`), its file tree (`.../tree/COMMIT`), and each file (`HEAD`/`GET /ORG/NAME/resolve/COMMIT/FILE`,
with the commit and ETag headers the client keys its cache on). An unknown model answers 404 `RepoNotFound`, an
unknown revision 404 `RevisionNotFound`, like the Hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


class HubStandIn:
    def __init__(self, models: dict[str, Path]):
        self.models = {
            repo: {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
            for repo, folder in models.items()
        }
        self.requests: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                stand_in.requests.append(("HEAD", self.path))
                stand_in._file(self, body=False)

            def do_GET(self):
                stand_in.requests.append(("GET", self.path))
                if self.path.startswith("/api/models/"):
                    stand_in._api(self)
                else:
                    stand_in._file(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _find(self, handler, path: str) -> tuple[str, str, str] | None:
        """(repo, revision, rest) of `path` for a served repo; answers 404 itself otherwise."""
        for repo in self.models:
            if path.startswith(f"{repo}/"):
                revision, _, rest = path[len(repo) + 1 :].partition("/")
                if revision not in ("main", COMMIT):
                    self._error(handler, "RevisionNotFound")
                    return None
                return repo, revision, rest
        self._error(handler, "RepoNotFound")
        return None

    def _api(self, handler) -> None:
        path = handler.path.split("?")[0].removeprefix("/api/models/")
        for kind in ("revision", "tree"):
            path = path.replace(f"/{kind}/", "/", 1) if f"/{kind}/" in path else path
        found = self._find(handler, path)
        if found is None:
            return
        files = self.models[found[0]]
        if "/tree/" in handler.path:
            body = [{"type": "file", "path": n, "size": len(d), "oid": _oid(d)} for n, d in files.items()]
        else:
            body = {"id": found[0], "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
        self._send(handler, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, handler, body: bool) -> None:
        repo_path, _, rest = handler.path.lstrip("/").partition("/resolve/")
        found = self._find(handler, f"{repo_path}/{rest}")
        if found is None:
            return
        data = self.models[found[0]].get(found[2])
        if data is None:
            self._error(handler, "EntryNotFound")
            return
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"'}
        self._send(handler, 200, data if body else b"", headers, length=len(data))

    def _error(self, handler, code: str) -> None:
        self._send(handler, 404, b"", {"X-Error-Code": code})

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], length: int | None = None) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data) if length is None else length))
        handler.end_headers()
        if data:
            handler.wfile.write(data)


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
