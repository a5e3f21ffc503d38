"""The GPU kit (tools/gpu/) on CPU: what prepare.py would carry, what run.sh would run, and the kit's own checks.

The real download (prepare.py without --dry-run) needs PyPI and about 80 MB; it is measured in the README. Here:
the dry-run manifest, run.sh's commands in dry-run mode, the sum check and the results summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from job_helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "gpu"))
import kit
import prepare


def test_the_dry_run_manifest_carries_megarl_needs_and_never_torch(tmp_path):
    carry = tmp_path / "carry"
    out = subprocess.run(
        [sys.executable, "tools/gpu/prepare.py", "--out", str(carry), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    manifest = json.loads((carry / "manifest.json").read_text())
    packages = manifest["packages"]
    assert packages["megatron-core"] == "0.16.1"
    for name in ("omegaconf", "transformers", "tokenizers", "huggingface-hub", "jsonschema", "rpds-py", "psutil"):
        assert name in packages, name
    assert not {"torch", "triton", "numpy", "sympy", "ray"} & set(packages)  # the GPU machine's own, or unpacked
    assert not any(name.startswith("nvidia-") for name in packages)
    assert manifest["ray"]["archive"] == "ray-slim.tar.xz" and "ray/rllib" in manifest["ray"]["dropped"]
    assert manifest["python"] == "3.12" and manifest["dry_run"] is True and manifest["limit_bytes"] == 64 * 2**20
    assert "0 files, 0.0 MiB (limit 64 MiB)" in out.stdout


def test_run_sh_installs_offline_without_torch_then_tests_and_benchmarks(tmp_path):
    carry = tmp_path / "carry"
    subprocess.run([sys.executable, "tools/gpu/prepare.py", "--out", str(carry), "--dry-run"], cwd=REPO, check=True)
    env = {"PATH": "/usr/bin:/bin", "CARRY": str(carry), "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    out = subprocess.run(
        ["bash", "tools/gpu/run.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    lines = [line.removeprefix("+ ") for line in out.stdout.splitlines() if line.startswith("+ ")]
    assert lines[0] == f"python tools/gpu/kit.py verify {carry}"
    assert lines[1] == f"python -m pip install --no-index --no-deps {carry}/wheels/*.whl"
    assert lines[3] == f"tar -xJf {carry}/ray-slim.tar.xz -C {carry}/site"
    assert lines[4].startswith("timeout 330 python -m pytest tests -m gpu")
    assert lines[5].startswith("timeout 120 python tools/bench/gpu_train_step.py")
    assert lines[6].startswith("timeout 90 python tools/bench/gpu_refit.py")
    assert lines[7] == f"python tools/gpu/kit.py summarize {tmp_path / 'out'}"
    assert sum(int(line.split()[1]) for line in lines if line.startswith("timeout")) < 600  # one command's limit
    only_tests = subprocess.run(
        ["bash", "tools/gpu/run.sh", "--dry-run", "tests"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert [line.removeprefix("+ ") for line in only_tests.stdout.splitlines() if line.startswith("+ ")] == [lines[4]]


def test_verify_finds_a_changed_file(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    (tmp_path / "ray-slim.tar.xz").write_bytes(b"ray")
    prepare.write_manifest(tmp_path, {"a": "1.0"}, "2.60.0", dry_run=False)
    assert kit.verify(tmp_path) == []
    (tmp_path / "ray-slim.tar.xz").write_bytes(b"yar")
    assert kit.verify(tmp_path) == ["ray-slim.tar.xz: size or sha256 differs from the manifest"]


def test_summarize_writes_one_results_file_from_every_check(tmp_path):
    (tmp_path / "status.tsv").write_text("pytest-gpu\t1\t200\nbench-refit\t124\t90\n")
    (tmp_path / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a"/>'
        '<testcase classname="tests.test_gpu" name="test_b"><failure message="x"/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "bench-refit.json").write_text('{"ipc_fraction_of_copy": 0.5}')
    results = kit.summarize(tmp_path)
    assert results["checks"] == [
        {"name": "pytest-gpu", "exit_code": 1, "seconds": 200, "timed_out": False},
        {"name": "bench-refit", "exit_code": 124, "seconds": 90, "timed_out": True},
    ]
    assert results["tests"] == [
        {"name": "tests.test_gpu::test_a", "outcome": "passed"},
        {"name": "tests.test_gpu::test_b", "outcome": "failed"},
    ]
    assert results["benchmarks"] == {"refit": {"ipc_fraction_of_copy": 0.5}}
    assert json.loads((tmp_path / "gpu-results.json").read_text()) == results
