"""The SGLang server launcher: command line, environment, config checks, and the subprocess lifecycle.

SGLang itself cannot be installed or run on this CPU machine. What stands in for it:
- the command lines are asserted argv by argv; every flag was checked against SGLang's ServerArgs (sglang 0.5.23,
  `srt/arg_groups/fields/*.py`; parsed once with SGLang's own argument parser while writing these tests);
- the lifecycle runs small Python processes in SGLang's place: one that exits at start-up, one that never answers,
  and a fake server that answers /health_generate with 503 (starting) and then 200, with a child process that
  ignores SIGTERM, so shutdown has to reach the whole process group.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.errors import UserError
from megarl.rollout.config import SGLangEngineConfig
from megarl.rollout.sglang_server import (
    SGLangServer,
    SGLangServerError,
    build_server_args,
    build_server_command,
    build_server_env,
    find_free_port,
    url_of,
)

# ---- command line ------------------------------------------------------------------------------------------------


def test_default_config_argv():
    args = build_server_args(SGLangEngineConfig(), "/ckpt/qwen", host="127.0.0.1", port=30000)
    assert args == [
        "--model-path", "/ckpt/qwen",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--base-gpu-id", "0",
        "--tp-size", "1",
        "--dtype", "auto",
        "--skip-server-warmup",
        "--custom-weight-loader", "megarl.rollout.sglang_delta.load_delta_bucket",  # on every server
    ]  # fmt: skip


def test_full_config_argv():
    config = SGLangEngineConfig(
        tp=8,
        dp=4,
        ep=8,
        enable_dp_attention=True,
        mem_fraction_static=0.55,
        dtype="bfloat16",
        trust_remote_code=True,
        random_seed=7,
        deterministic=True,
        enable_memory_saver=True,
        extra_args={
            "chunked_prefill_size": "8192",
            "disable-radix-cache": "true",
            "enable_metrics": "false",
            "attention_backend": "triton",
            "log_level": "",
        },
    )
    args = build_server_args(config, "/ckpt/dsv3", host="10.0.0.1", port=30001, base_gpu_id=2)
    assert args == [
        "--model-path", "/ckpt/dsv3",
        "--host", "10.0.0.1",
        "--port", "30001",
        "--base-gpu-id", "2",
        "--tp-size", "8",
        "--attn-dp-size", "4",
        "--ep-size", "8",
        "--mem-fraction-static", "0.55",
        "--dtype", "bfloat16",
        "--random-seed", "7",
        "--trust-remote-code",
        "--enable-deterministic-inference",
        "--enable-memory-saver",
        "--skip-server-warmup",
        "--custom-weight-loader", "megarl.rollout.sglang_delta.load_delta_bucket",
        "--chunked-prefill-size", "8192",
        "--disable-radix-cache",
        "--attention-backend", "triton",
        "--log-level",
    ]  # fmt: skip


def test_tp_only_config_leaves_sglang_defaults():
    config = SGLangEngineConfig(tp=4, skip_server_warmup=False)
    args = build_server_args(config, "m", host="::1", port=1)
    assert args == ["--model-path", "m", "--host", "::1", "--port", "1", "--base-gpu-id", "0", "--tp-size", "4",
                    "--dtype", "auto",
                    "--custom-weight-loader", "megarl.rollout.sglang_delta.load_delta_bucket"]  # fmt: skip


def test_command_runs_sglang_launch_server_with_this_python():
    command = build_server_command(SGLangEngineConfig(), "m", host="h", port=2)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert command[3:] == build_server_args(SGLangEngineConfig(), "m", host="h", port=2)
    # rollout.sglang.python: the server runs in another environment (SGLang's own pinned torch)
    assert build_server_command(SGLangEngineConfig(python="/venv/bin/python"), "m", host="h", port=2)[0] == (
        "/venv/bin/python"
    )


def test_url_of():
    assert url_of("10.1.2.3", 30000) == "http://10.1.2.3:30000"
    assert url_of("0.0.0.0", 5) == "http://127.0.0.1:5"
    assert url_of("fe80::1", 5) == "http://[fe80::1]:5"
    assert url_of("::", 5) == "http://[::1]:5"


# ---- environment -------------------------------------------------------------------------------------------------


def test_env_selects_gpus_and_drops_what_breaks_the_logprob_convention():
    base = {
        "PATH": "/bin",
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    env = build_server_env(SGLangEngineConfig(tp=2), gpu_ids=[3, 5], base=base)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # only the memory saver minds it
    assert env["PATH"] == "/bin"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # GET /health answers without generating
    saver = build_server_env(SGLangEngineConfig(enable_memory_saver=True), base=base)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in saver and "CUDA_VISIBLE_DEVICES" not in saver
    assert base["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"  # the caller's mapping is left alone


def test_env_rejects_wrong_gpu_count():
    with pytest.raises(ValueError, match=r"tp=2 on 1 node\(s\) needs 2 GPUs per node, got gpu_ids=\[0\]"):
        build_server_env(SGLangEngineConfig(tp=2), gpu_ids=[0], base={})
    # an engine across nodes: each node's process sees that node's share of the GPUs
    env = build_server_env(SGLangEngineConfig(tp=8), gpu_ids=[4, 5, 6, 7], base={}, nnodes=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ValueError, match=r"tp=8 on 2 node\(s\) needs 4 GPUs per node"):
        build_server_env(SGLangEngineConfig(tp=8), gpu_ids=[0, 1], base={}, nnodes=2)


# ---- config checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"rollout.sglang.tp=0 must be >= 1"),
        ({"tp": 4, "ep": 3}, r"rollout.sglang.ep=3 must divide rollout.sglang.tp=4; valid: 1, 2, 4"),
        ({"dp": 2}, r"rollout.sglang.dp=2 without rollout.sglang.enable_dp_attention: SGLang cannot update"),
        ({"tp": 6, "dp": 4, "enable_dp_attention": True}, r"dp=4 must divide rollout.sglang.tp=6 .*1, 2, 3, 6"),
        ({"mem_fraction_static": 1.2}, r"mem_fraction_static=1.2 must be in \(0, 1\)"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s=0 must be > 0"),
        ({"extra_args": {"--tp-size": "2"}}, r"extra_args.--tp-size is set by megarl \(tp\)"),
        ({"extra_args": {"random_seed": "1"}}, r"extra_args.random_seed is set by megarl \(random_seed\)"),
    ],
)
def test_config_check_names_key_and_fix(kwargs, message):
    with pytest.raises(UserError, match=message):
        SGLangEngineConfig(**kwargs).check("rollout.sglang")


def test_config_check_accepts_dp_attention_and_warns_on_no_effect():
    SGLangEngineConfig(tp=8, dp=8, ep=8, enable_dp_attention=True).check("rollout.sglang")
    with pytest.warns(UserWarning, match="enable_dp_attention has no effect with rollout.sglang.dp=1"):
        SGLangEngineConfig(enable_dp_attention=True).check("rollout.sglang")
    assert SGLangEngineConfig(tp=4).num_gpus() == 4


# ---- the subprocess ----------------------------------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_server_that_exits_at_startup_fails_fast_with_exit_code_and_log(tmp_path):
    command = _python("""
        import sys
        print("loading weights from /ckpt ...", flush=True)
        print("ValueError: tp_size=3 does not divide num_attention_heads=32", file=sys.stderr, flush=True)
        sys.exit(3)
    """)
    port = find_free_port()
    server = SGLangServer(command, url_of("127.0.0.1", port), log_path=tmp_path / "s.log", startup_timeout_s=60)
    start = time.monotonic()
    with pytest.raises(SGLangServerError) as info:
        server.start()
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "exited with code 3 while starting" in message
    assert "tp_size=3 does not divide num_attention_heads=32" in message and "loading weights" in message
    assert str(tmp_path / "s.log") in message
    assert server.process.returncode == 3


def test_server_that_never_gets_healthy_times_out(tmp_path):
    server = SGLangServer(
        _python("import time; time.sleep(60)"),
        url_of("127.0.0.1", find_free_port()),
        log_path=tmp_path / "s.log",
        startup_timeout_s=1.5,
        poll_interval_s=0.2,
    )
    start = time.monotonic()
    with pytest.raises(SGLangServerError, match=r"not healthy after 1.5 s \(last probe: SGLang GET .*/health_generate"):
        server.start()
    assert time.monotonic() - start < 10
    assert server.process.poll() is not None  # stopped, not left behind


FAKE_SERVER = """
    import http.server, os, signal, subprocess, sys
    port, pid_file = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    open(pid_file, "w").write(str(child.pid))
    probes = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            probes.append(self.path)
            status = 503 if len(probes) <= 2 else 200  # SGLang answers 503 while it starts
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            print("probe", self.path, flush=True)

    print("server starting", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_server_ready_after_503s_and_stop_kills_its_process_group(tmp_path):
    port = find_free_port()
    pid_file = tmp_path / "child.pid"
    command = [*_python(FAKE_SERVER), str(port), str(pid_file)]
    server = SGLangServer(command, url_of("127.0.0.1", port), log_path=tmp_path / "s.log", poll_interval_s=0.1)
    with server:
        assert server.is_alive()
        server.check_alive()
        child = int(pid_file.read_text())
        assert _alive(child)
        assert server.log_tail().count("probe /health_generate") == 3
    assert not server.is_alive()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the SIGTERM-ignoring child outlived stop()"
    assert server.stop() == server.process.returncode  # stopping twice is harmless


def test_stop_escalates_to_sigkill(tmp_path):
    command = _python("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(120)
    """)
    server = SGLangServer(command, "http://127.0.0.1:1", log_path=tmp_path / "s.log")
    server._wait_ready = lambda: None  # nothing to probe: only the shutdown path is under test
    server.start()
    deadline = time.monotonic() + 10
    while "up" not in server.log_tail() and time.monotonic() < deadline:  # SIGTERM handler installed
        time.sleep(0.02)
    start = time.monotonic()
    code = server.stop(grace_s=0.5)
    assert code == -9 and time.monotonic() - start < 5
    with pytest.raises(SGLangServerError, match="was killed by signal 9"):
        server.check_alive()


def test_default_log_file_is_created(tmp_path):
    server = SGLangServer(_python("pass"), "http://127.0.0.1:1")
    assert server.log_path.exists() and server.log_path.name.startswith("megarl-sglang-")
    os.unlink(server.log_path)


def test_log_goes_to_megarl_log_dir_when_set(tmp_path, monkeypatch):
    """On a cluster the Slurm template sets MEGARL_LOG_DIR to the job folder: the servers' logs must outlive the
    allocation's node-local /tmp, one file per server, named by host."""
    monkeypatch.setenv("MEGARL_LOG_DIR", str(tmp_path / "logs"))
    first = SGLangServer(_python("pass"), "http://127.0.0.1:1")
    second = SGLangServer(_python("pass"), "http://127.0.0.1:2")
    host = socket.gethostname().split(".")[0]
    for server in (first, second):
        assert server.log_path.parent == tmp_path / "logs" / "sglang"
        assert server.log_path.name.startswith(f"sglang-{host}-") and server.log_path.is_file()
    assert first.log_path != second.log_path
