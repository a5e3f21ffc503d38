"""The HTTP boundary to one SGLang server: every endpoint megarl uses, with timeouts and errors that say what failed.

Endpoints and request bodies follow SGLang's HTTP server (sglang 0.5.23: `srt/entrypoints/http_server.py` for the
routes, `srt/managers/io_struct.py` for the bodies). Failures come back from SGLang in a few shapes, all turned into
one `SGLangError` naming the URL, the HTTP status and SGLang's message:
- weight / group endpoints: `{"success": false, "message": ...}` with HTTP 400;
- generate / memory / abort errors: `{"error": {"message": ...}}`; request validation: `{"detail": ...}`;
- /flush_cache: plain text with HTTP 400 while requests are running.

Only the standard library is used (no torch): the rollout worker, the trainer's weight sender and the tests all share
this client. Proxies from the environment are ignored on purpose: engines live on the cluster's own addresses.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["SGLangClient", "SGLangError"]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SGLangError(RuntimeError):
    """An SGLang server refused a call, failed it, or could not be reached in time."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


def _message_of(body: bytes) -> str:
    """SGLang's own words from an error body, whatever its shape."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return json.dumps(data["detail"]) if not isinstance(data["detail"], str) else data["detail"]
    return text


class SGLangClient:
    """Calls on one SGLang server at `base_url` (e.g. http://10.0.0.3:30000)."""

    def __init__(self, base_url: str, *, control_timeout_s: float = 600.0, health_timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s

    # ---- transport -------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, payload: Any = None, *, timeout_s: float) -> Any:
        """One HTTP call; returns the decoded JSON body (text if not JSON, None if empty). Raises SGLangError."""
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(
                f"SGLang {method} {url} failed: HTTP {e.code}: {_message_of(e.read())}", url=url, status=e.code
            ) from None
        except TimeoutError:
            raise SGLangError(f"SGLang {method} {url} timed out after {timeout_s:g} s", url=url) from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise SGLangError(f"SGLang {method} {url} timed out after {timeout_s:g} s", url=url) from None
            raise SGLangError(f"SGLang {method} {url} failed: cannot connect ({reason})", url=url) from None
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body.decode("utf-8", errors="replace")

    def control(self, path: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        """POST a control call; a `{"success": false, "message": ...}` answer raises SGLangError."""
        url = f"{self.base_url}{path}"
        result = self.request("POST", path, payload if payload is not None else {}, timeout_s=self._t(timeout_s))
        if isinstance(result, dict) and result.get("success") is False:
            raise SGLangError(f"SGLang POST {url} failed: {result.get('message', '(no message)')}", url=url)
        return result

    def _t(self, timeout_s: float | None) -> float:
        return self.control_timeout_s if timeout_s is None else timeout_s

    # ---- health ----------------------------------------------------------------------------------------------------
    def health(self, timeout_s: float | None = None) -> None:
        """GET /health: 200 once the server is up (no generation, answers fast). Raises SGLangError otherwise."""
        self.request("GET", "/health", timeout_s=self.health_timeout_s if timeout_s is None else timeout_s)

    def health_generate(self, timeout_s: float) -> None:
        """GET /health_generate: generates one token; 503 while the server starts. Raises SGLangError otherwise."""
        self.request("GET", "/health_generate", timeout_s=timeout_s)

    def model_info(self) -> dict[str, Any]:
        """GET /model_info: model path, weight_version, ..."""
        return self.request("GET", "/model_info", timeout_s=self.health_timeout_s)

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate(self, payload: dict[str, Any], timeout_s: float) -> Any:
        """POST /generate (a GenerateReqInput body); a batched body returns a list, one result per item."""
        return self.request("POST", "/generate", payload, timeout_s=timeout_s)

    def abort_all(self) -> None:
        """POST /abort_request {"abort_all": true}: running requests finish with finish_reason abort."""
        self.request("POST", "/abort_request", {"abort_all": True}, timeout_s=self.health_timeout_s)

    def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause_generation: `abort` returns running requests, `retract` / `in_place` hold them in SGLang."""
        self.control("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.control("/continue_generation", {})

    def flush_cache(self, timeout_s: float | None = None) -> None:
        """POST /flush_cache, retried while SGLang answers 400 (it refuses while requests are still running)."""
        deadline = time.monotonic() + self._t(timeout_s)
        while True:
            try:
                self.request("POST", "/flush_cache", timeout_s=self._t(timeout_s))
                return
            except SGLangError as e:
                if e.status != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    # ---- memory (colocated training) -------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation; tags among weights, kv_cache, cuda_graph (None: all). Needs
        --enable-memory-saver and an idle server."""
        self.control("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.control("/resume_memory_occupation", {"tags": tags})

    # ---- weights ---------------------------------------------------------------------------------------------------
    def begin_weight_update(self) -> bool:
        """POST /begin_weight_update (opens SGLang's weight-update session, required since the session API exists).
        Returns False on a server without the endpoint (HTTP 404: older SGLang, no session needed)."""
        try:
            self.control("/begin_weight_update", {})
        except SGLangError as e:
            if e.status == 404:
                return False
            raise
        return True

    def end_weight_update(self) -> None:
        self.control("/end_weight_update", {})

    def update_weight_version(self, version: str) -> None:
        """POST /update_weight_version: the version SGLang reports in every completion's meta_info."""
        self.control("/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], *, load_format: str | None, flush_cache: bool = False
    ) -> None:
        """POST /update_weights_from_tensor: one base64 payload per tensor-parallel rank of the server."""
        self.control(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": flush_cache,
            },
        )

    def update_weights_from_disk(self, model_path: str) -> None:
        """POST /update_weights_from_disk: every rank of the server (on every node) reads the safetensors files in
        `model_path` and loads the tensors it holds; generation stays paused (keep_pause) until continue."""
        self.control(
            "/update_weights_from_disk",
            {"model_path": model_path, "load_format": "auto", "abort_all_requests": False, "keep_pause": True},
        )

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """POST /init_weights_update_group: each server rank joins group `group_name` as rank_offset + its tp rank.
        Returns only once the whole group has formed (the sender must join concurrently)."""
        self.control(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def weight_checksums(self) -> list[dict[str, Any]]:
        """POST /weights_checker {"action": "checksum"}: per tensor-parallel rank, {"checksums": {parameter name:
        hex digest}, "parallelism_info": {...}} of every parameter it holds (SGLang's WeightChecker)."""
        answer = self.control("/weights_checker", {"action": "checksum"})
        return list(answer.get("ranks") or []) if isinstance(answer, dict) else []

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.control("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = False,
        load_format: str | None = None,
    ) -> None:
        """POST /update_weights_from_distributed: the server receives the tensors by a broadcast from rank 0 of the
        group, in the order given (load_format "flattened_bucket": all of them as one flat byte tensor). Returns once
        all are received and loaded."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        self.control("/update_weights_from_distributed", body)
