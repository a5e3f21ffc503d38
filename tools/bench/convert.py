"""Benchmark `megarl convert` on a generated dense model of about 1.6 B parameters in bf16 (about 3.1 GB).

    python tools/bench/convert.py [--workdir /tmp/megarl-bench] [--layers 30]

Reports, for HF -> mcore and mcore -> HF: wall time, peak RSS of the converting process, and the time of plainly
copying the same safetensors files with fsync (what the disk allows). Targets: conversion within 3x the copy,
peak RSS under 40% of the model's size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODEL = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def generate(folder: Path, layers: int) -> None:
    """In a process of its own: this one must stay small, or its size would show in the children's peak RSS."""
    config = {**MODEL, "num_hidden_layers": layers}
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
    return time.monotonic() - start


def timed_convert(*argv: str) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of one `megarl convert` process."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "convert", *argv])
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage (ru_maxrss in KiB)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"megarl convert {' '.join(argv)} failed")
    return time.monotonic() - start, usage.ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/megarl-bench")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf, mcore, back, copy = work / "hf", work / "mcore", work / "hf_back", work / "copy"

    print(f"generating a {args.layers}-layer model in {hf} ...", flush=True)
    generate(hf, args.layers)
    model_gb = folder_bytes(hf, ".safetensors") / 1e9
    copy_s = timed_copy(hf, copy)
    shutil.rmtree(copy)
    # The import (RSS peak) is measured in a fresh process each time; the first conversion warms the page cache
    # for the HF files exactly as the copy above did.
    to_mcore_s, to_mcore_rss = timed_convert("--from", "hf", "--to", "mcore", str(hf), str(mcore), "--tp", "2")
    to_hf_s, to_hf_rss = timed_convert(
        "--from", "mcore", "--to", "hf", str(mcore), str(back), "--max-shard-size", "1GB"
    )

    rows = [
        ("plain copy of the safetensors (fsync)", copy_s, None),
        ("hf -> mcore (--tp 2)", to_mcore_s, to_mcore_rss),
        ("mcore -> hf", to_hf_s, to_hf_rss),
    ]
    print(f"\nmodel: {model_gb:.2f} GB of bf16 safetensors ({args.layers} layers)")
    print("| step | wall s | x copy | peak RSS GB | RSS / model |")
    print("|---|---|---|---|---|")
    for name, seconds, rss in rows:
        ratio = f"{seconds / copy_s:.2f}"
        rss_text = f"{rss:.2f} | {rss / model_gb:.0%}" if rss is not None else "- | -"
        print(f"| {name} | {seconds:.1f} | {ratio} | {rss_text} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
