"""A fake SGLang HTTP server for the sglang engine's tests (SGLang itself needs a GPU; see test_sglang_engine.py).

The endpoints SGLangEngine uses, on 127.0.0.1 in a thread, with SGLang's request bodies, answers and failure shapes;
every body first goes through SGLang's own request types (tests/sglang_contract.py) where the pinned sglang is
installed, so the fake cannot drift from SGLang.
"""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import sglang_contract
import torch

from megarl.rollout.sglang_engine import sglang_checksum


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers JSON (or text) with a status."""

    def reply(self, status: int, answer: Any) -> None:
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        with contextlib.suppress(ConnectionError):  # the client may have timed out already
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str, threading.Thread]:
    """`handler` on a free port of 127.0.0.1, served by a daemon thread: (the server, its URL, the thread)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", thread


class FakeSGLang:
    """The endpoints SGLangEngine uses, answering as SGLang does. `calls` records (path, body) in order."""

    def __init__(self, *, sessions: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.version = "default"
        self.weights: dict[str, torch.Tensor] = {}
        self.sessions = sessions
        self.session_open = False
        self.fail_update: str | None = None
        self.flush_refusals = 0
        self.delay: dict[str, float] = {}
        self.rejected: list[tuple[str, str]] = []
        self.routing: tuple[int, list[int], int] | None = None
        """(decoder layers, MoE layers, top-k) of the model served: routed experts returned when asked for."""
        fake = self

        class Handler(QuietHandler):
            def do_GET(self):
                self._serve(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._serve(json.loads(self.rfile.read(length)) if length else None)

            def _serve(self, body):
                path = self.path.split("?")[0]
                fake.calls.append((path, body))
                time.sleep(fake.delay.get(path, 0.0))
                self.reply(*(fake.validate(path, body) or fake.route(path, body)))

        self.httpd, self.url, self.thread = serve(Handler)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def validate(self, path: str, body: Any) -> tuple[int, Any] | None:
        """Every body goes through SGLang's own request types first (where the pinned sglang is installed, as in CI):
        what SGLang would refuse, this server refuses too, so the fake cannot drift from SGLang."""
        if not sglang_contract.installed() or path not in sglang_contract.REQUEST_TYPES | {"/generate": ""}:
            return None
        try:
            sglang_contract.validate_request(path, body)
        except Exception as e:  # SGLang's HTTP layer answers 422 (FastAPI) or 400 for bodies it cannot read
            self.rejected.append((path, str(e)))
            return 422, {"detail": f"{type(e).__name__}: {e}"}
        return None

    # ---- SGLang's behaviour, endpoint by endpoint ----
    def route(self, path: str, body: Any) -> tuple[int, Any]:
        handler = getattr(self, "on" + path.replace("/", "_"), None)
        if handler is None or (path in ("/begin_weight_update", "/end_weight_update") and not self.sessions):
            return 404, {"detail": "Not Found"}
        return handler(body)

    def on_health(self, body):
        return 200, ""

    on_health_generate = on_health

    def on_generate(self, body):
        if any(not ids for ids in body["input_ids"]):
            return 400, {"error": {"message": "input_ids cannot be empty."}}
        items = [self._generate_one(ids, p, rid) for ids, p, rid in zip(body["input_ids"], body["sampling_params"],
                                                                         body["rid"])]  # fmt: skip
        if body.get("return_routed_experts") and self.routing is not None:
            for ids, item in zip(body["input_ids"], items):
                item["meta_info"]["routed_experts"] = self._routed_experts(len(ids) + len(item["output_ids"]))
        return 200, items

    def _routed_experts(self, seqlen: int) -> str:
        """As SGLang returns them: base64 of int32 [seqlen - 1, every decoder layer, topk] (dense layers zero)."""
        num_layers, moe_layers, topk = self.routing
        rows = torch.zeros(seqlen - 1, num_layers, topk, dtype=torch.int32)
        rows[:, moe_layers] = torch.arange(topk, dtype=torch.int32) + 1  # experts 1..topk everywhere
        return base64.b64encode(rows.numpy().tobytes()).decode()

    def _generate_one(self, input_ids, params, rid):
        """Tokens from (seed, prompt); a stop token ends (and stays in) the output."""
        rng = random.Random(params.get("sampling_seed", 0) * 1_000_003 + sum(input_ids))
        output, logprobs, finish = [], [], {"type": "length", "length": params["max_new_tokens"]}
        for k in range(params["max_new_tokens"]):
            token = rng.randrange(10, 60)
            output.append(token)
            logprobs.append([-(k + 1) / 8, token, None])
            if token in params.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": token}
                break
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids), "weight_version": self.version,
                "output_token_logprobs": logprobs, "completion_tokens": len(output), "cached_tokens": 0}  # fmt: skip
        return {"text": "", "output_ids": output, "meta_info": meta}

    def on_flush_cache(self, body):
        if self.flush_refusals:
            self.flush_refusals -= 1
            return 400, "Flush cache failed: requests are still running.\n"
        return 200, "Cache flushed.\n"

    def on_abort_request(self, body):
        return 200, ""

    def on_pause_generation(self, body):
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def on_continue_generation(self, body):
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def on_begin_weight_update(self, body):
        if self.session_open:
            return 400, {"success": False, "message": "a weight-update session is already open"}
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def on_end_weight_update(self, body):
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def on_update_weight_version(self, body):
        self.version = body["new_version"]
        return 200, {
            "success": True,
            "message": f"Weight version updated to {self.version}",
            "new_version": self.version,
        }

    def on_update_weights_from_tensor(self, body):
        if self.sessions and not self.session_open:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                         "begin_weight_update() and end_weight_update()"}  # fmt: skip
        if self.fail_update:
            return 400, {"success": False, "message": self.fail_update}
        assert body["load_format"] == "flattened_bucket"
        for rank_payload in body["serialized_named_tensors"]:  # each rank reads its own copy
            data = pickle.loads(base64.b64decode(rank_payload))
            for meta in data["metadata"]:  # FlattenedTensorBucket.reconstruct_tensors (0.5.23)
                flat = data["flattened_tensor"]
                tensor = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
                self.weights[meta.name] = tensor.clone()
        return 200, {"success": True, "message": "Success"}

    def on_update_weights_from_disk(self, body):
        """Every rank reads the folder's safetensors files (SGLang's DefaultModelLoader on model_path)."""
        from safetensors.torch import load_file

        if self.fail_update:
            return 400, {"success": False, "message": self.fail_update}
        for path in sorted(Path(body["model_path"]).glob("*.safetensors")):
            self.weights.update(load_file(path))
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def on_weights_checker(self, body):
        """SGLang's WeightChecker "checksum" action: per TP rank, a checksum of every parameter it holds (here: the
        tensors as received; SGLang's own hash function, see sglang_checksum)."""
        checksums = {name: sglang_checksum(t) for name, t in self.weights.items()}
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": 0, "size": 1}  # fmt: skip
        ranks = [{"checksums": checksums, "per_gpu_checksum": "x", "parallelism_info": [info]}]
        return 200, {"success": True, "message": "", "ranks": ranks, "per_engine_checksum": "y"}

    def on_release_memory_occupation(self, body):
        return 200, None

    on_resume_memory_occupation = on_release_memory_occupation
