"""Balanced data parallelism: one update step at DP=2 with the plain contiguous split and with megarl's balanced
order (megarl/trainer/loops/dp_balance.py), on a batch whose long rows come first (what prompt groups of long answers
give the plain split).

    python tools/bench/dp_balance.py [--rows 32] [--seq 512] [--reps 3] [--packing on] [--json results.json]

Two gloo ranks of one thread each (a RankPool) build the Qwen3-shaped dense model of tools/bench/train_step.py and
time `update_policy` on their share; the step's time is the slower rank's (the ranks meet in the gradient
all-reduce). Reported: the median step time of each order and the cost imbalance (max / mean rank cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from train_step import LR, MODELS, generate, policy_loss, synthetic_batch


def rank_update(path: str, rows: int, seq: int, order: list[int], reps: int, packing: bool) -> list[float]:
    """On each of 2 ranks: this rank's contiguous share of the batch in `order`, timed update steps."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import ModelSettings, OptimizerSettings
    from megarl.workers.policy import update_policy
    from megarl.workers.role_model import build_role_model

    init_model_parallel(ParallelConfig())
    settings = ModelSettings(path=path, dtype="float32", parallel=ParallelConfig())
    model = build_role_model(settings, optimizer=OptimizerSettings(lr=LR), total_steps=1000)
    batch = synthetic_batch(rows, seq, model.vocab.size, lengths="skewed").select(order)
    part = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    loss = policy_loss()
    seconds = []
    for i in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        update_policy(model, part, loss, max_tokens=8192, packing=packing)
        dist.barrier()
        if i:  # the first step warms up
            seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    import torch
    from train_step import row_lengths

    from megarl.runtime.rank_pool import RankPool
    from megarl.trainer.loops.dp_balance import dp_order, imbalance, row_cost

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--packing", default="on", choices=["on", "off"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lengths = row_lengths(args.rows, args.seq, "skewed")
    longest_first = sorted(range(args.rows), key=lambda i: -lengths[i])  # the plain split's worst case
    ordered = torch.tensor([lengths[i] for i in longest_first])
    balanced, _, metrics = dp_order(ordered, 2)
    costs = [row_cost(n) for n in ordered.tolist()]
    half = args.rows // 2
    plain_imbalance = imbalance(costs, [range(half), range(half, args.rows)])
    results = {}
    with tempfile.TemporaryDirectory() as tmp, RankPool(2, timeout_s=3600) as pool:
        folder = Path(tmp) / "dense"
        generate(folder, dict(MODELS["dense"]))
        for name, order in (("plain split", longest_first), ("balanced", [longest_first[i] for i in balanced])):
            print(f"{name} ...", flush=True)
            per_rank = pool.run(rank_update, str(folder), args.rows, args.seq, order, args.reps, args.packing == "on")
            results[name] = statistics.median(max(times) for times in zip(*per_rank))
    print(f"\n{args.rows} rows of skewed lengths (longest {args.seq}), DP=2, packing {args.packing}:")
    print("| order | cost imbalance (max / mean) | step s |\n|---|---|---|")
    print(f"| plain split | {plain_imbalance:.2f} | {results['plain split']:.2f} |")
    print(f"| balanced | {metrics['balance/dp_imbalance']:.2f} | {results['balanced']:.2f} |")
    speedup = results["plain split"] / results["balanced"]
    print(f"\nbalanced is {speedup:.2f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({"balance_speedup": speedup, "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
