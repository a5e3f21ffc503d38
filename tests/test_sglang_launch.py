"""The sglang engine's own launch path: the real `python -m sglang.launch_server` command line and environment
reaching a server process, its failures, and a start on a folder without weights.

SGLang cannot serve on this CPU machine: a stand-in `sglang.launch_server` module (first on the server's PYTHONPATH)
parses the real command line and answers a few endpoints; without it, the installed sglang (or none) exits at once.
"""

from __future__ import annotations

import sys
import time

import pytest

from megarl.rollout.config import SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest
from megarl.rollout.sglang_client import SGLangError
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.sglang_server import SGLangServerError


def test_launched_server_that_dies_reports_exit_code_and_log(tmp_path):
    """The real launch path: `python -m sglang.launch_server` exits at once here (no sglang installed, or only its
    CPU-importable parts for the contract tests)."""
    config = SGLangEngineConfig(startup_timeout_s=600)
    start = time.monotonic()
    with pytest.raises(SGLangServerError) as info:
        SGLangEngine("/ckpt/tiny", config, log_path=tmp_path / "sglang.log")
    assert (
        time.monotonic() - start < 300
    )  # the exit is seen, not the start-up time-out (importing sglang takes a while)
    message = str(info.value)
    assert "exited with code 1 while starting" in message and "last lines of" in message
    assert f"{sys.executable} -m sglang.launch_server --model-path /ckpt/tiny" in message


STAND_IN_LAUNCH_SERVER = '''
"""A stand-in for `python -m sglang.launch_server`: parses the real command line, serves a few endpoints."""
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--base-gpu-id", "--tp-size", "--dtype"):
    parser.add_argument(flag, required=True)
parser.add_argument("--load-format")
parser.add_argument("--skip-server-warmup", action="store_true")
parser.add_argument("--custom-weight-loader", nargs="*")
args = parser.parse_args()
print("argv", json.dumps(sys.argv[1:]), flush=True)
for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"):
    print(name, os.environ.get(name), flush=True)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        print("POST", self.path, flush=True)
        print("scheduler crashed: CUDA error: an illegal memory access was encountered", flush=True)
        os._exit(7)

    def log_message(self, *a):
        pass

HTTPServer((args.host, int(args.port)), Handler).serve_forever()
'''


def stand_in_sglang(tmp_path, monkeypatch) -> None:
    """Put a stand-in `sglang.launch_server` first on the server's PYTHONPATH (ahead of an installed sglang)."""
    package = tmp_path / "stand_in" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STAND_IN_LAUNCH_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stand_in"))


def test_launch_path_with_a_stand_in_sglang_module(tmp_path, monkeypatch):
    """SGLangEngine's own launch: the real command line reaches a stand-in `sglang.launch_server`, which becomes
    healthy, then dies on the first generate call: the error carries its exit code and last log lines."""
    stand_in_sglang(tmp_path, monkeypatch)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    model = tmp_path / "hf"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")  # a folder with weights: SGLang loads them
    engine = SGLangEngine(model, SGLangEngineConfig(startup_timeout_s=30), log_path=tmp_path / "s.log")
    try:
        assert engine.health()["ok"] and engine.url.startswith("http://127.0.0.1:")
        log = engine.server.log_tail()
        assert f'"--model-path", "{model}", "--host", "127.0.0.1"' in log and "--skip-server-warmup" in log
        assert "--load-format" not in log
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB None" in log  # removed from the server's environment
        assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION 0" in log  # GET /health must not generate
        with pytest.raises(SGLangServerError) as info:
            engine.generate([GenerateRequest([1, 2])], SamplingParams(max_new_tokens=2))
        message = str(info.value)
        assert "exited with code 7 during the call" in message and "an illegal memory access" in message
        assert engine.health() == {"ok": False, "weight_version": 0, "url": engine.url,
                                   "error": "server process exited with code 7"}  # fmt: skip
    finally:
        engine.shutdown()


def test_engine_on_a_folder_without_weights_starts_dummy_and_waits_for_the_first_sync(tmp_path, monkeypatch):
    """A megarl checkpoint's hf/ folder has config and tokenizer only: SGLang refuses to start on it unless told
    --load-format dummy; the engine then refuses to generate until a weight update has completed."""
    stand_in_sglang(tmp_path, monkeypatch)
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 64}')
    engine = SGLangEngine(model, SGLangEngineConfig(startup_timeout_s=30), log_path=tmp_path / "s.log")
    try:
        assert '"--load-format", "dummy"' in engine.server.log_tail()
        assert engine.context_len == 64
        with pytest.raises(SGLangError, match="refuses to generate: it started with dummy weights"):
            engine.generate([GenerateRequest([1, 2])], SamplingParams(max_new_tokens=2))
        assert "POST" not in engine.server.log_tail()  # nothing reached the server (the stand-in dies on a POST)
    finally:
        engine.shutdown()
