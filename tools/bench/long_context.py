"""Benchmark chunked log-probs (`micro_batch.logprob_chunk_tokens`, megarl/workers/chunked_logprobs.py): peak
memory of a log-prob pass and of an update (forward + backward + AdamW) against the sequence length, chunked and not,
on a small Megatron model with a large vocabulary, on CPU.

    python tools/bench/long_context.py [--tokens 2048,8192,16384] [--unchunked-tokens 1024,2048]
        [--chunk 1024] [--vocab 152064] [--json FILE]

The model: Qwen3-shaped, hidden 64, 2 layers, a 152064-token vocabulary (Qwen's), fp32, TP=1, one row of `tokens`
tokens per micro-batch, run through the product's `compute_logprobs` / `update_policy`. Each point runs in a fresh
process: the model is built and warmed up (a 64-token log-prob pass and update, so lazily allocated state such as
Adam's moments exists), then the kernel's resident-set high-water mark is reset (`/proc/self/clear_refs` = 5) and the
measured call runs; its peak memory is VmHWM after the call minus VmRSS before it (torch's CPU allocator returns
large blocks to the system on free, so RSS follows the live tensors; tracemalloc would not see torch's memory).

`chunked_slope_ratio`: the least-squares slope of peak memory against tokens of the chunked log-prob pass over that
of the unchunked one (target <= 0.125); `update_slope_ratio` the same for the update. The unchunked path holds
[tokens x vocab] fp32 logits and several tensors of that size (~3 MB per token at this vocabulary: 8.7 GB for a
log-prob pass at 3k tokens), so it is measured at short lengths only (a 24 GiB machine shared with others); the
slope is exact from there. The default points (cut to 16k tokens; `--tokens 2048,16384,32768` reaches 32k) took
6.5 min of user CPU on 2 cores (tools/bench/README.md). Tokens/s: of the chunked points at the longest length
(context parallelism 1), and at `--cp-tokens` for cp = 1 and cp = 2 (two gloo ranks of a rank pool, one thread
each, the whole pass timed on the slower rank; megarl's CPU attention all-gathers keys and values).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.testing.tiny_checkpoint import tiny_config

MODEL = tiny_config("tiny-qwen3") | {"num_hidden_layers": 2, "head_dim": 16, "max_position_embeddings": 65536}
"""The tests' tiny Qwen3 at 2 layers, long positions; the vocabulary comes from --vocab."""
PASSES = ("logprobs", "update")
WARMUP_TOKENS = 64


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _batch(tokens: int, vocab: int, seed: int = 0):
    import torch

    from megarl.algorithms.aggregation import loss_weights
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    response = torch.ones(1, tokens)
    response[:, : min(16, tokens // 2)] = 0  # a prompt
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones(1, tokens, dtype=torch.long),
            "response_mask": response,
            "advantages": torch.randn(1, tokens, generator=g) * response,
            "old_logprobs": torch.full((1, tokens), -12.0),
            "loss_weights": loss_weights("token-mean", response),
        }
    )


def run_point(folder: str, which: str, chunk: int, tokens: int, vocab: int) -> dict:
    """In this (fresh) process: build the model, warm up, measure one call. {peak_bytes, seconds}."""
    from megarl.runtime.distributed import single_process_megatron

    with single_process_megatron():
        return _measure(folder, which, chunk, tokens, vocab)


def run_cp_point(folder: str, which: str, chunk: int, tokens: int, vocab: int) -> dict:
    """On each rank of a context-parallel pool: the same measurement at parallel.cp = world size."""
    import torch.distributed as dist

    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    init_model_parallel(ParallelConfig(cp=dist.get_world_size()))
    return _measure(folder, which, chunk, tokens, vocab, ParallelConfig(cp=dist.get_world_size()))


def _measure(folder: str, which: str, chunk: int, tokens: int, vocab: int, parallel=None) -> dict:
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import ModelSettings, OptimizerSettings
    from megarl.workers.policy import compute_logprobs, update_policy
    from megarl.workers.role_model import build_role_model

    loss_fn = PolicyLoss(PolicyLossConfig(entropy_coef=0.001))  # the entropy with its gradient: the heaviest loss

    def call(batch):
        if which == "logprobs":
            return compute_logprobs(model, batch, 1.0, tokens, with_entropy=True, chunk_tokens=chunk)
        return update_policy(model, batch, loss_fn, 1.0, tokens, chunk_tokens=chunk)

    optimizer = OptimizerSettings(lr=1e-6) if which == "update" else None
    settings = ModelSettings(path=folder, dtype="float32", parallel=parallel or ParallelConfig())
    model = build_role_model(settings, optimizer=optimizer, total_steps=2)
    call(_batch(WARMUP_TOKENS, vocab))
    batch = _batch(tokens, vocab, seed=1)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    start = time.perf_counter()
    call(batch)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    return {"peak_bytes": (peak - before) * 1024, "seconds": seconds}


def _slope(points: list[dict]) -> float:
    """Least-squares slope of peak_bytes against tokens."""
    xs, ys = [p["tokens"] for p in points], [p["peak_bytes"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=_ints, default=_ints("2048,8192,16384"), help="chunked lengths")
    parser.add_argument("--unchunked-tokens", type=_ints, default=_ints("1024,2048"), help="unchunked lengths")
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens of the chunked points")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument(
        "--cp-tokens", type=int, default=8192, help="length of the cp=2 points (one of --tokens; 0: none)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--point", nargs=5, metavar=("FOLDER", "PASS", "CHUNK", "TOKENS", "VOCAB"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.point:
        folder, which, chunk, tokens, vocab = args.point
        print(json.dumps(run_point(folder, which, int(chunk), int(tokens), int(vocab))))
        return
    for name, values in (("--tokens", args.tokens), ("--unchunked-tokens", args.unchunked_tokens)):
        if len(values) < 2 or min(values) < WARMUP_TOKENS:
            raise SystemExit(f"{name} needs at least two lengths of >= {WARMUP_TOKENS} tokens (got {values})")
    if args.chunk < 1:
        raise SystemExit(f"--chunk={args.chunk} must be >= 1")
    if args.cp_tokens and args.cp_tokens not in args.tokens:
        raise SystemExit(f"--cp-tokens={args.cp_tokens} must be one of --tokens {args.tokens} (or 0: no cp=2 points)")
    results = measure(args)
    report(results, args)


def measure(args) -> dict:
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    plan = [(which, 0, n) for which in PASSES for n in args.unchunked_tokens]
    plan += [(which, args.chunk, n) for which in PASSES for n in args.tokens]
    points: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_hf_checkpoint(MODEL | {"vocab_size": args.vocab}, Path(tmp) / "model"))
        start = time.perf_counter()
        for i, (which, chunk, tokens) in enumerate(plan, 1):
            command = [sys.executable, __file__, "--point", folder, which, str(chunk), str(tokens), str(args.vocab)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"point {which} chunk={chunk} tokens={tokens} failed:\n{done.stderr[-3000:]}")
            point = {"pass": which, "chunk_tokens": chunk, "tokens": tokens} | json.loads(done.stdout.splitlines()[-1])
            points.append(point)
            print(
                f"[{i}/{len(plan)}] {which:8s} chunk={chunk:5d} tokens={tokens:6d}: peak "
                f"{point['peak_bytes'] / 2**30:6.2f} GiB, {point['seconds']:6.2f} s "
                f"({time.perf_counter() - start:.0f} s so far)",
                flush=True,
            )
        cp_points = _cp_points(folder, args) if args.cp_tokens else []
    return _summary(points, cp_points, args)


def _cp_points(folder: str, args) -> list[dict]:
    """The chunked passes at --cp-tokens on two gloo ranks at parallel.cp = 2 (each rank one thread: the cp=1 points
    use the machine's threads): the slower rank's seconds, each rank's peak."""
    from megarl.runtime.rank_pool import RankPool

    points = []
    with RankPool(2, timeout_s=1800) as pool:
        for which in PASSES:
            ranks = pool.run(run_cp_point, folder, which, args.chunk, args.cp_tokens, args.vocab)
            point = {"pass": which, "chunk_tokens": args.chunk, "tokens": args.cp_tokens, "cp": 2}
            point |= {"seconds": max(r["seconds"] for r in ranks), "peak_bytes": max(r["peak_bytes"] for r in ranks)}
            points.append(point)
            print(
                f"[cp=2] {which:8s} chunk={args.chunk:5d} tokens={args.cp_tokens:6d}: peak per rank "
                f"{point['peak_bytes'] / 2**30:6.2f} GiB, {point['seconds']:6.2f} s",
                flush=True,
            )
    return points


def _summary(points: list[dict], cp_points: list[dict], args) -> dict:
    def select(which: str, chunked: bool) -> list[dict]:
        return [p for p in points if p["pass"] == which and bool(p["chunk_tokens"]) == chunked]

    slopes = {which: {c: _slope(select(which, c)) for c in (False, True)} for which in PASSES}
    longest = {which: max(select(which, True), key=lambda p: p["tokens"]) for which in PASSES}
    at_cp_length = {p["pass"]: p for p in points if p["chunk_tokens"] and p["tokens"] == args.cp_tokens}
    return {
        "model": MODEL | {"vocab_size": args.vocab, "dtype": "float32"},
        "chunk_tokens": args.chunk,
        "points": points,
        "slope_bytes_per_token": {w: {"unchunked": s[False], "chunked": s[True]} for w, s in slopes.items()},
        "chunked_slope_ratio": slopes["logprobs"][True] / slopes["logprobs"][False],
        "update_slope_ratio": slopes["update"][True] / slopes["update"][False],
        "cp_points": cp_points,
        "tokens_per_s": {
            "tokens": longest["logprobs"]["tokens"],
            "cp1": {w: p["tokens"] / p["seconds"] for w, p in longest.items()},
            "cp_tokens": args.cp_tokens or None,
            "cp1_at_cp_tokens": {w: p["tokens"] / p["seconds"] for w, p in at_cp_length.items()} or None,
            "cp2": {p["pass"]: p["tokens"] / p["seconds"] for p in cp_points} or None,
        },
    }


def report(results: dict, args) -> None:
    print("\n| pass | chunk_tokens | tokens | peak memory GiB | seconds |")
    print("|---|---|---|---|---|")
    for p in results["points"]:
        chunk = p["chunk_tokens"] or "off"
        print(f"| {p['pass']} | {chunk} | {p['tokens']} | {p['peak_bytes'] / 2**30:.2f} | {p['seconds']:.2f} |")
    print("\n| pass | slope unchunked MB/token | slope chunked MB/token | ratio |")
    print("|---|---|---|---|")
    for which, s in results["slope_bytes_per_token"].items():
        ratio = s["chunked"] / s["unchunked"]
        print(f"| {which} | {s['unchunked'] / 1e6:.3f} | {s['chunked'] / 1e6:.4f} | {ratio:.4f} |")
    speed = results["tokens_per_s"]
    print(
        f"\nchunked_slope_ratio = {results['chunked_slope_ratio']:.4f} (target <= 0.125); tokens/s at "
        f"{speed['tokens']} tokens, cp=1: log-probs {speed['cp1']['logprobs']:.0f}, update "
        f"{speed['cp1']['update']:.0f}"
    )
    if speed["cp2"]:
        cp1, cp2 = speed["cp1_at_cp_tokens"], speed["cp2"]
        print(
            f"tokens/s at {speed['cp_tokens']} tokens: cp=1 log-probs {cp1['logprobs']:.0f}, update "
            f"{cp1['update']:.0f}; cp=2 log-probs {cp2['logprobs']:.0f}, update {cp2['update']:.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
