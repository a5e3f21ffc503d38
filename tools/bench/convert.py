"""Benchmark `megarl convert` on generated models: a dense Llama of 1.55 B parameters (3.1 GB in bf16) and a
DeepSeek-V3-shaped MoE (MLA, 64 routed experts + 1 shared, group-limited sigmoid routing) of 1.0 B (2.0 GB).

    python tools/bench/convert.py [--models dense,moe] [--workdir /tmp/megarl-bench] [--mbridge] [--json out.json]

For each model and direction: wall time and peak RSS of the converting process, next to the time of plainly
copying the same safetensors files with fsync (what the disk allows). Targets: conversion within 3x the copy; peak
RSS under 40% of the model's size (dense) and 25% (MoE). --mbridge also times mbridge (`pip install --no-deps
mbridge`) loading the HF checkpoint into Megatron and saving it back, or says why it cannot run here. --json writes
the headline numbers ({"moe_x_copy": ..., "dense_x_copy": ...: the slower direction's wall time over the copy's;
the same without the imports every run pays, `*_x_copy_without_imports`) and every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "dense": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "moe": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=256,
        num_hidden_layers=18,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
    ),
}
RSS_TARGET = {"dense": 0.40, "moe": 0.25}
CONVERT_FLAGS = {"dense": ["--tp", "2"], "moe": ["--tp", "2", "--ep", "8"]}

MBRIDGE_SCRIPT = """
import sys, time
from megarl.runtime.distributed import single_process_megatron
from transformers import AutoConfig
hf, out = sys.argv[1], sys.argv[2]
with single_process_megatron():
    from mbridge import AutoBridge
    config = AutoConfig.from_pretrained(hf)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    config.rope_theta = rope.get("rope_theta", 10000.0)  # mbridge reads transformers-4 attribute names
    config.rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
    bridge = AutoBridge.from_config(config)
    model = bridge.get_model(bf16=True, use_cpu_initialization=True)
    bridge.load_weights(model, hf)
    bridge.save_weights(model, out)
"""


def generate(folder: Path, config: dict) -> None:
    """In a process of its own: this one must stay small, or its size would show in the children's peak RSS."""
    code = (
        "import torch, sys; from megarl.testing.tiny_checkpoint import make_hf_checkpoint; "
        f"make_hf_checkpoint({config!r}, sys.argv[1], dtype=torch.bfloat16, max_shard_size='1GB')"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)


def folder_bytes(folder: Path, suffix: str = "") -> int:
    return sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file())


def timed_copy(src: Path, dst: Path) -> float:
    """Copy the weight files and fsync them: the floor any conversion has to pay in disk traffic."""
    dst.mkdir()
    start = time.monotonic()
    for path in sorted(src.glob("*.safetensors")):
        shutil.copyfile(path, dst / path.name)
        with open(dst / path.name, "rb+") as f:
            os.fsync(f.fileno())
    seconds = time.monotonic() - start
    shutil.rmtree(dst)
    return seconds


def timed_process(*argv: str) -> tuple[float, float, str]:
    """(seconds, peak RSS in GB, error text or '') of one child process."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stderr=log, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage (ru_maxrss in KiB)
        log.seek(0)
        stderr = log.read()
    failed = os.waitstatus_to_exitcode(status) != 0
    error = next((line for line in reversed(stderr.splitlines()) if line.strip()), "failed") if failed else ""
    return time.monotonic() - start, usage.ru_maxrss / 2**20, error


def startup_cost() -> tuple[float, float]:
    """(seconds, RSS GB) of a process that only imports what `megarl convert` imports: the fixed part of each run."""
    code = "import megarl.cli, megarl.conversion.hf_to_mcore, megarl.conversion.mcore_to_hf"
    seconds, rss, _ = timed_process(sys.executable, "-c", code)
    return seconds, rss


def bench(name: str, work: Path, with_mbridge: bool) -> dict:
    """Generate model `name`, copy it, convert it both ways: {"model", "model_gb", "copy_s", "imports_s",
    "imports_rss_gb", "runs": [{"step", "seconds", "rss_gb", "error"}]}."""
    hf, mcore, back = work / f"{name}-hf", work / f"{name}-mcore", work / f"{name}-hf-back"
    print(f"generating the {name} model in {hf} ...", flush=True)
    generate(hf, MODELS[name])
    model_gb = folder_bytes(hf, ".safetensors") / 1e9
    copy_s = timed_copy(hf, work / "copy")
    convert = [sys.executable, "-m", "megarl.cli", "convert", "--no-progress"]
    runs = [
        (
            f"hf -> mcore ({' '.join(CONVERT_FLAGS[name])})",
            *timed_process(*convert, "--from", "hf", "--to", "mcore", str(hf), str(mcore), *CONVERT_FLAGS[name]),
        ),
        ("mcore -> hf", *timed_process(*convert, "--from", "mcore", "--to", "hf", str(mcore), str(back))),
    ]
    if with_mbridge:
        runs.append(
            (
                "mbridge: load HF into Megatron + save HF",
                *timed_process(sys.executable, "-c", MBRIDGE_SCRIPT, str(hf), str(work / f"{name}-mbridge")),
            )
        )
    imports_s, imports_rss = startup_cost()
    for folder in (hf, mcore, back, work / f"{name}-mbridge"):
        shutil.rmtree(folder, ignore_errors=True)
    return dict(
        model=name,
        model_gb=model_gb,
        copy_s=copy_s,
        imports_s=imports_s,
        imports_rss_gb=imports_rss,
        runs=[dict(step=step, seconds=seconds, rss_gb=rss, error=error) for step, seconds, rss, error in runs],
    )


def table(result: dict) -> list[str]:
    name, model_gb, copy_s = result["model"], result["model_gb"], result["copy_s"]
    start_s, start_rss = result["imports_s"], result["imports_rss_gb"]
    rows = [
        f"\n{name}: {model_gb:.2f} GB of bf16 safetensors; RSS target {RSS_TARGET[name]:.0%} of that. Imports alone "
        f"(in every run): {start_s:.1f} s and {start_rss:.2f} GB.",
        "| step | wall s | x copy | x copy without imports | peak RSS GB | RSS / model | RSS above imports / model |",
        "|---|---|---|---|---|---|---|",
        f"| plain copy of the safetensors (fsync) | {copy_s:.1f} | 1.00 | | | | |",
    ]
    for run in result["runs"]:
        if run["error"]:
            rows.append(f"| {run['step']} | failed: {run['error'][:160]} | | | | | |")
            continue
        seconds, rss = run["seconds"], run["rss_gb"]
        rows.append(
            f"| {run['step']} | {seconds:.1f} | {seconds / copy_s:.2f} | {(seconds - start_s) / copy_s:.2f} | "
            f"{rss:.2f} | {rss / model_gb:.0%} | {(rss - start_rss) / model_gb:.0%} |"
        )
    return rows


def headline(results: list[dict]) -> dict[str, float]:
    """Per model: the slower megarl direction over the copy (`<model>_x_copy`), and the same without the imports
    (`<model>_x_copy_without_imports`); a model whose conversion failed has no entry."""
    out = {}
    for result in results:
        runs = [r for r in result["runs"] if r["step"].startswith(("hf ->", "mcore ->"))]
        if not runs or any(r["error"] for r in runs):
            continue
        slowest = max(r["seconds"] for r in runs)
        out[f"{result['model']}_x_copy"] = round(slowest / result["copy_s"], 3)
        out[f"{result['model']}_x_copy_without_imports"] = round((slowest - result["imports_s"]) / result["copy_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--workdir", default="/tmp/megarl-bench")
    parser.add_argument("--mbridge", action="store_true", help="also time mbridge on the same models")
    parser.add_argument("--json", default=None, help="write the headline numbers and every run here")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = [bench(name.strip(), work, args.mbridge) for name in args.models.split(",")]
    print("\n".join(row for result in results for row in table(result)))
    shutil.rmtree(work, ignore_errors=True)
    summary = headline(results) | {"results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
