"""Smoke tests of the benchmarks in tools/bench/: each runs end to end at a tiny size and reports what it should.

No timing is checked here (benchmarks are not tests; their numbers live in tools/bench/README.md).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    """The benchmark scripts, imported by file name (their rank-side functions are found the same way by the
    spawned rank processes, which inherit sys.path)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import refit
        import train_step

        yield train_step, refit
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_train_step_benchmark_runs_at_a_tiny_size(bench_modules, tmp_path):
    train_step, _ = bench_modules
    out = tmp_path / "train_step.json"
    argv = ["--tiny", "--models", "dense", "--layouts", "tp2", "--rows", "2", "--seq", "32"]
    results = train_step.main([*argv, "--warmup", "0", "--reps", "1", "--json", str(out)])
    (run,) = results[0]["runs"]
    for side in ("megarl", "plain"):
        for phase in ("logprobs", "update"):
            row = run[side][phase]
            assert row["seconds"] == statistics.median(row["all_seconds"]) and len(row["all_seconds"]) == 1
            assert row["tokens_per_s"] == results[0]["tokens"] / row["seconds"]  # the table's throughput
    assert len(run["megarl"]["rss_peak_gb"]) == 2  # one per rank
    assert json.loads(out.read_text())["results"][0]["tokens"] == results[0]["tokens"] == 2 * 32


def test_moe_layouts_report_what_megatron_cannot_run(bench_modules):
    """MoE training at TP=2 needs sequence parallelism, which Megatron's torch norms refuse on CPU: the benchmark
    says so in the table instead of failing."""
    train_step, _ = bench_modules
    row = train_step.summarize(
        "megarl TP=2",
        "2 x 1",
        [
            {"logprobs": {"seconds": [1.0]}, "update": {"error": "ValueError: no"}, "rss_peak": 1.0, "rss_model": 0.5}
            for _ in range(2)
        ],
        num_tokens=10,
    )
    plain = train_step.summarize(
        "plain",
        "2",
        [{"logprobs": {"seconds": [0.5]}, "update": {"seconds": [2.0]}, "rss_peak": 1.0, "rss_model": 0.5}],
        10,
    )
    lines = train_step.table(
        {
            "model": "moe",
            "params_m": 1,
            "active_params_m": 1,
            "tokens": 10,
            "runs": [{"layout": "tp2", "megarl": row, "plain": plain}],
        }
    )
    assert "cannot run: `ValueError: no`" in lines[3]
    assert "| 1.00 | 10 | 2.00 |" in lines[3]


@pytest.mark.slow
def test_refit_benchmark_runs_at_a_tiny_size(bench_modules, tmp_path):
    _, refit = bench_modules
    out = tmp_path / "refit.json"
    result = refit.main(["--tiny", "--bucket-mb", "0.0625", "--warmup", "0", "--reps", "1", "--json", str(out)])
    (row,) = result["rows"]
    assert result["sent_bytes"] > 0.9 * result["model_bytes"]  # the safetensors file adds a header
    for path in ("sync", "sync_parts", "sync_gathered", "parts", "now"):
        assert (
            row[path]["seconds"] == statistics.median(row[path]["all_seconds"]) and len(row[path]["all_seconds"]) == 1
        )
        assert set(row[path]["extra_memory"]) == {"actor rank 0", "actor rank 1", "engine"}
    # the trainer's road writes into the engine's shared memory from both ranks; the others go by the object store
    assert [r["shared_memory_engines"] for r in row["sync"]["returned"]] == [1.0, 1.0]
    assert [r["shared_memory_engines"] for r in row["sync_parts"]["returned"]] == [0.0, 0.0]
    assert row["now"]["returned"][0]["buckets"] > 1  # 64 KiB buckets: the stream is cut
    assert row["now"]["returned"][1]["buckets"] == 0 < row["parts"]["returned"][1]["buckets"]  # rank 1 sends parts
    # the headline is the table's "% of memcpy" of the trainer's sync
    assert result["fraction_of_memcpy"] == round(result["memcpy_s"][1] / row["sync"]["seconds"], 4)
    assert json.loads(out.read_text())["fraction_of_memcpy"] == result["fraction_of_memcpy"]


def test_convert_benchmark_headline_is_the_slower_direction_over_the_copy():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import convert
    finally:
        sys.path.remove(str(BENCH_DIR))

    def result(model, hf_to_mcore, mcore_to_hf, error=""):
        runs = [
            dict(step="hf -> mcore (--tp 2)", seconds=hf_to_mcore, rss_gb=0.5, error=""),
            dict(step="mcore -> hf", seconds=mcore_to_hf, rss_gb=0.5, error=error),
            dict(step="mbridge: load HF into Megatron + save HF", seconds=1.0, rss_gb=None, error="NameError"),
        ]
        return dict(model=model, model_gb=2.0, copy_s=4.0, imports_s=2.0, imports_rss_gb=0.4, runs=runs)

    # moe: the slower of 10 s and 12 s over a 4 s copy; without the 2 s of imports, 10 / 4; mbridge's failure is
    # not megarl's; dense failed one way: no headline for it
    headline = convert.headline([result("moe", 10.0, 12.0), result("dense", 8.0, 9.0, error="Traceback")])
    assert headline == {"moe_x_copy": 3.0, "moe_x_copy_without_imports": 2.5}
    assert "| mcore -> hf | 12.0 | 3.00 | 2.50 | 0.50 | 25% | 5% |" in convert.table(result("moe", 10.0, 12.0))


def test_fp8_refit_benchmark_reports_the_bytes_saved(tmp_path):
    import json
    import subprocess

    out = tmp_path / "fp8.json"
    done = subprocess.run(
        [sys.executable, str(BENCH_DIR / "fp8_refit.py"), "--tiny", "--reps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    # every quantized weight travels as FP8 plus its scale: more tensors, fewer bytes
    assert rows["fp8"]["tensors"] > rows["bf16"]["tensors"] and result["bytes_ratio"] < 0.75
    assert "FP8 sends" in done.stdout
