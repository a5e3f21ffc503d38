"""The Ray node script the Slurm template writes for every task (tools/slurm/megarl.sbatch, heredoc `ray_node.sh`),
run by itself with a stand-in `ray` on PATH: its head wait, its retries of a failing `ray start`, the fixed ports it
passes, and the copy of the node's Ray logs to the job folder. (tests/test_slurm.py runs it under a real Slurm with
the real Ray; a `ray start` that fails at start-up and then succeeds cannot be provoked there on purpose.)"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "tools" / "slurm" / "megarl.sbatch"

FAKE_RAY = """#!/bin/bash
# fails at start-up until the attempt named by FAIL_UNTIL, then "runs": writes its arguments and a raylet log
n=$(( $(cat "$STATE/calls" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STATE/calls"
(( n < FAIL_UNTIL )) && { echo "ray: cannot start ($n)"; exit 1; }
printf '%s\\n' "$@" > "$STATE/args"
mkdir -p "$RAY_TMP/session_x/logs" && echo "raylet ran" > "$RAY_TMP/session_x/logs/raylet.out"
ln -sfn "$RAY_TMP/session_x" "$RAY_TMP/session_latest"
exit 0
"""


def node_script(tmp_path: Path) -> Path:
    body = re.search(r"<<'NODE'\n(.*?)^NODE$", SBATCH.read_text(), re.MULTILINE | re.DOTALL).group(1)
    script = tmp_path / "ray_node.sh"
    script.write_text(body)
    return script


def run_node(tmp_path: Path, port: int, fail_until: int, wait_s: int = 30) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "ray").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STATE": str(state),
        "FAIL_UNTIL": str(fail_until),
        "SLURM_PROCID": "1",  # a worker node: it waits for the head
        "SLURM_LOCALID": "1",  # the second Ray node of its host
        "MEGARL_SETUP": "",
        "MEGARL_NOFILE": "4096",
        "MEGARL_GPUS_PER_NODE": "8",
        "MEGARL_RAY_PORT": str(port),
        "MEGARL_RAY_CLIENT_PORT": "10001",
        "MEGARL_RAY_NODE_PORTS": "20380",
        "MEGARL_RAY_WORKER_PORTS": "21000",
        "MEGARL_RAY_WORKER_PORTS_PER_NODE": "2000",
        "MEGARL_RAY_START_TRIES": "3",
        "MEGARL_RAY_WAIT_S": str(wait_s),
        "MEGARL_RAY_START_ARGS": "--object-store-memory=1000000",
        "MEGARL_LOG_DIR": str(tmp_path / "logs"),
        "MEGARL_START": "2",
        "HEAD_IP": "127.0.0.1",
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_TMP": str(tmp_path / "raytmp"),
    }
    env.pop("SLURM_CPUS_PER_TASK", None)
    done = subprocess.run(["bash", str(node_script(tmp_path))], env=env, capture_output=True, text=True, timeout=120)
    return done, state


def test_a_worker_waits_for_the_head_retries_ray_start_and_keeps_its_logs(tmp_path):
    with socket.socket() as head:  # the head's GCS port answers
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        done, state = run_node(tmp_path, port, fail_until=3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ray start failed at start-up (exit status 1); trying again in 5 s") == 2
    args = (state / "args").read_text().split("\n")
    assert args[:2] == ["start", f"--address=127.0.0.1:{port}"]
    # the second Ray node of a host: 6 fixed ports from 20380 + 10, workers from 21000 + 2000
    for expected in (
        "--node-manager-port=20390",
        "--object-manager-port=20391",
        "--dashboard-agent-grpc-port=20392",
        "--dashboard-agent-listen-port=20393",
        "--metrics-export-port=20394",
        "--runtime-env-agent-port=20395",
        "--min-worker-port=23000",
        "--max-worker-port=24999",
        "--num-gpus=8",
        "--object-store-memory=1000000",
        "--block",
    ):
        assert expected in args, (expected, args)
    host = socket.gethostname().split(".")[0]
    assert (tmp_path / "logs" / "ray" / "start-2" / f"{host}-1" / "raylet.out").read_text() == "raylet ran\n"


def test_a_worker_gives_up_on_a_silent_head_with_a_message(tmp_path):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there once closed
    done, state = run_node(tmp_path, port, fail_until=1, wait_s=2)
    assert done.returncode == 1
    assert f"ERROR: the Ray head at 127.0.0.1:{port} did not answer in 2 s" in done.stdout
    assert not (state / "calls").exists()  # ray start was never tried
