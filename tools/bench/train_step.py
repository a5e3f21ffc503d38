"""Benchmark the actor's compute on CPU: log-probs (forward only) and one update step (forward + backward + AdamW) of
megarl's Megatron role model at TP=1 and TP=2 (gloo ranks), next to the same model in plain single-process PyTorch
(transformers, same batch, same loss, torch AdamW) in the same run.

    python tools/bench/train_step.py [--models dense,moe] [--tp 1,2] [--rows 16] [--seq 256] [--reps 3]
        [--json results.json]

Models (generated, fp32, no hub): `dense` is Qwen3-shaped (~42 M parameters), `moe` Qwen3-MoE-shaped (~74 M, 16
experts, top-4). Threads: one per rank (RankPool), so TP=1 runs on 1 thread and TP=2 on 2 ranks x 1 thread; plain
PyTorch gets the same number of threads (1 next to TP=1, 2 next to TP=2). Each measurement is the median of
`--reps` repetitions after `--warmup` ones; every configuration runs in fresh processes, so peak RSS (ru_maxrss of
each process: imports, model, optimizer state and activations) belongs to that configuration alone. The ratio
megarl / plain is the cost of the distributed machinery (Megatron layers, vocab-parallel log-probs, DDP buffers,
schedules, TP collectives) on the same work.

Shapes: B rows, S tokens per row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODELS = {
    "dense": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2)
"""Overrides of --tiny (the smoke test): the same architectures, a few seconds per configuration."""

LR = 1e-6
PROMPT_FRACTION = 0.25
"""Share of each row that is prompt; the rest is response (trained on)."""


# ---- shared by both sides -----------------------------------------------------------------------------------------


def row_lengths(num_rows: int, seq_len: int, kind: str) -> list[int]:
    """full: every row seq_len tokens; skewed: every 8th row seq_len, the others between seq_len/16 and seq_len/4
    (the mean is about a quarter of the longest: RL responses, a few long and many short)."""
    if kind == "full":
        return [seq_len] * num_rows
    import random

    rng = random.Random(0)
    return [seq_len if i % 8 == 0 else rng.randint(seq_len // 16, seq_len // 4) for i in range(num_rows)]


def synthetic_batch(num_rows: int, seq_len: int, vocab_size: int, seed: int = 0, lengths: str = "full"):
    """A fixed RL mini-batch: rows of `row_lengths` real tokens (right-padded), random tokens and advantages, old
    log-probs near a uniform policy, token-mean loss weights."""
    import torch

    from megarl.algorithms.aggregation import loss_weights
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    sizes = row_lengths(num_rows, seq_len, lengths)
    input_ids_BS = torch.randint(1, vocab_size, (num_rows, seq_len), generator=g)
    attention_BS = torch.zeros(num_rows, seq_len, dtype=torch.long)
    response_mask_BS = torch.zeros(num_rows, seq_len)
    for i, n in enumerate(sizes):
        attention_BS[i, :n] = 1
        response_mask_BS[i, int(n * PROMPT_FRACTION) : n] = 1
    input_ids_BS = input_ids_BS * attention_BS
    advantages_BS = torch.randn(num_rows, 1, generator=g) * response_mask_BS
    old_logprobs_BS = (torch.full((num_rows, seq_len), -float(torch.tensor(vocab_size).log())) + 0.01) * (
        response_mask_BS
    )
    return Batch(
        {
            "input_ids": input_ids_BS,
            "attention_mask": attention_BS,
            "response_mask": response_mask_BS,
            "advantages": advantages_BS,
            "old_logprobs": old_logprobs_BS,
            "loss_weights": loss_weights("token-mean", response_mask_BS),
        }
    )


def policy_loss():
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss

    return PolicyLoss(PolicyLossConfig())  # PPO clipped surrogate, no KL, no entropy: what an RL step computes


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def timed(fn, warmup: int, reps: int, sync=lambda: None) -> list[float]:
    """Seconds of each of `reps` calls of fn after `warmup` calls; `sync` runs before each (a barrier)."""
    seconds = []
    for i in range(warmup + reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


# ---- megarl: runs on every rank of a RankPool ---------------------------------------------------------------------


def timed_phase(fn, warmup: int, reps: int, sync) -> dict:
    """{"seconds": [...]} or {"error": the last line of the exception} when megarl cannot run this phase here."""
    try:
        return {"seconds": timed(fn, warmup, reps, sync)}
    except Exception as err:  # the same on every rank (a configuration Megatron refuses), so no rank hangs
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}


def megarl_rank(
    path: str,
    layout: dict,
    num_rows: int,
    seq_len: int,
    warmup: int,
    reps: int,
    max_tokens: int,
    packing: bool = False,
    lengths: str = "full",
) -> dict:
    """Build the trainable actor at `layout` ({"tp", "ep"}), time compute_logprobs and update_policy on this rank's
    data-parallel share of the batch."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import ModelSettings, OptimizerSettings
    from megarl.workers.policy import compute_logprobs, update_policy
    from megarl.workers.role_model import build_role_model

    parallel = ParallelConfig(tp=layout["tp"], ep=layout["ep"])
    init_model_parallel(parallel)
    settings = ModelSettings(path=path, dtype="float32", parallel=parallel)
    model = build_role_model(settings, optimizer=OptimizerSettings(lr=LR), total_steps=10_000)
    rss_model = peak_rss_gb()
    batch = synthetic_batch(num_rows, seq_len, model.vocab.size, lengths=lengths)
    batch = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    loss_fn = policy_loss()
    logprobs = timed_phase(
        lambda: compute_logprobs(model, batch, max_tokens=2 * max_tokens, packing=packing), warmup, reps, dist.barrier
    )
    rss_logprobs = peak_rss_gb()
    update = timed_phase(
        lambda: update_policy(model, batch, loss_fn, max_tokens=max_tokens, packing=packing), warmup, reps, dist.barrier
    )
    return dict(
        logprobs=logprobs, update=update, rss_model=rss_model, rss_logprobs=rss_logprobs, rss_peak=peak_rss_gb()
    )


# ---- plain PyTorch: one process -----------------------------------------------------------------------------------


def plain_process(path: str, num_threads: int, num_rows: int, seq_len: int, warmup: int, reps: int, vocab: int) -> dict:
    """transformers' model with torch AdamW: the same log-prob computation and the same PPO step, no Megatron."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rss_model = peak_rss_gb()
    batch = synthetic_batch(num_rows, seq_len, vocab)
    input_ids_BS = batch["input_ids"]
    loss_fn = policy_loss()

    def token_logprobs() -> torch.Tensor:
        logits_BSV = model(input_ids_BS).logits
        logprobs_BS = torch.log_softmax(logits_BSV.float(), dim=-1)[:, :-1].gather(-1, input_ids_BS[:, 1:, None])
        return torch.nn.functional.pad(logprobs_BS.squeeze(-1), (1, 0))  # aligned as megarl's: column 0 holds 0

    def logprobs() -> None:
        model.eval()
        with torch.no_grad():
            token_logprobs()

    def update() -> None:
        model.train()
        per_token_loss_BS, _ = loss_fn(token_logprobs(), None, batch.tensors)
        (per_token_loss_BS * batch["loss_weights"]).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    logprob_s = timed(logprobs, warmup, reps)
    rss_logprobs = peak_rss_gb()
    update_s = timed(update, warmup, reps)
    return dict(
        logprobs={"seconds": logprob_s},
        update={"seconds": update_s},
        rss_model=rss_model,
        rss_logprobs=rss_logprobs,
        rss_peak=peak_rss_gb(),
    )


# ---- driver -------------------------------------------------------------------------------------------------------


def generate(folder: Path, config: dict) -> None:
    """In a process of its own, like tools/bench/convert.py."""
    code = (
        "import torch, sys; from megarl.testing.tiny_checkpoint import make_hf_checkpoint; "
        f"make_hf_checkpoint({config!r}, sys.argv[1], dtype=torch.float32)"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)


def count_params(config: dict) -> tuple[float, float]:
    """(total, active per token) parameters in millions, from the config."""
    h, v, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = h * d * (2 * heads + 2 * kv) + 2 * d + 2 * h
    if "num_experts" in config:
        experts, top_k, width = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
        mlp_total, mlp_active = experts * 3 * h * width + experts * h, top_k * 3 * h * width + experts * h
    else:
        mlp_total = mlp_active = 3 * h * config["intermediate_size"]
    total = 2 * v * h + h + layers * (attention + mlp_total)
    return total / 1e6, (2 * v * h + h + layers * (attention + mlp_active)) / 1e6


LAYOUTS = {"tp1": {"tp": 1, "ep": 1}, "tp2": {"tp": 2, "ep": 1}, "ep2": {"tp": 1, "ep": 2}}
"""ep2 (MoE only): experts split over 2 ranks, the rest data-parallel (each rank takes half the batch)."""


def run_megarl(path: Path, layout: dict, args, packing: bool = False) -> list[dict]:
    from megarl.runtime.rank_pool import RankPool

    num_ranks = layout["tp"] * layout["ep"]
    with RankPool(num_ranks, timeout_s=3600) as pool:
        settings = (args.rows, args.seq, args.warmup, args.reps, args.max_tokens, packing, args.lengths)
        return pool.run(megarl_rank, str(path), layout, *settings)


def bench_packing(name: str, config: dict, work: Path, args) -> dict:
    """megarl with packing on and off on the same batch, per layout: tokens/s of real tokens."""
    folder = work / name
    generate(folder, config)
    real_tokens = sum(row_lengths(args.rows, args.seq, args.lengths))
    result = {"model": name, "lengths": args.lengths, "real_tokens": real_tokens, "runs": []}
    for layout_name in args.layouts:
        layout = LAYOUTS[layout_name]
        if layout["ep"] > 1 and "num_experts" not in config:
            continue
        for packing in args.packing:
            label = f"megarl {layout_name} packing {'on' if packing else 'off'}"
            print(f"[{name}] {label} ...", flush=True)
            row = summarize(
                label, str(layout["tp"] * layout["ep"]), run_megarl(folder, layout, args, packing), real_tokens
            )
            result["runs"].append({"layout": layout_name, "packing": packing, "row": row})
    return result


def packing_table(result: dict) -> list[str]:
    rows = [
        f"\n{result['model']}: {result['real_tokens']} real tokens ({result['lengths']} lengths).",
        "| run | log-probs s | log-probs tok/s | update s | update tok/s |",
        "|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        row = run["row"]
        cells = [
            f"{row[p]['seconds']:.2f} | {row[p]['tokens_per_s']:.0f}" if "seconds" in row[p] else "failed |"
            for p in ("logprobs", "update")
        ]
        rows.append(f"| {row['label']} | {cells[0]} | {cells[1]} |")
    return rows


def packing_speedup(results: list[dict]) -> float:
    """Update tokens/s with packing over without, the first layout of the first model."""
    by_packing = {run["packing"]: run["row"]["update"] for run in results[0]["runs"][:2]}
    return by_packing[True]["tokens_per_s"] / by_packing[False]["tokens_per_s"]


def run_plain(path: Path, threads: int, vocab: int, args) -> dict:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # a fresh process: its own peak RSS
        job = pool.submit(plain_process, str(path), threads, args.rows, args.seq, args.warmup, args.reps, vocab)
        return job.result()


def summarize(label: str, threads: str, ranks: list[dict], num_tokens: int) -> dict:
    """Per phase: the median over repetitions of the slowest rank (the ranks of one step end together anyway: the
    step ends in collectives), tokens/s of the whole batch."""
    row = {"label": label, "threads": threads, "rss_peak_gb": [r["rss_peak"] for r in ranks]}
    row["rss_model_gb"] = [r["rss_model"] for r in ranks]
    for phase in ("logprobs", "update"):
        errors = [r[phase]["error"] for r in ranks if "error" in r[phase]]
        if errors:
            row[phase] = {"error": errors[0]}
            continue
        per_rep = [max(seconds) for seconds in zip(*(r[phase]["seconds"] for r in ranks))]
        median = statistics.median(per_rep)
        row[phase] = {"seconds": median, "all_seconds": per_rep, "tokens_per_s": num_tokens / median}
    return row


def bench_model(name: str, config: dict, work: Path, args) -> dict:
    folder = work / name
    print(f"[{name}] generating the model in {folder} ...", flush=True)
    generate(folder, config)
    total_m, active_m = count_params(config)
    num_tokens = args.rows * args.seq
    result = {"model": name, "params_m": total_m, "active_params_m": active_m, "tokens": num_tokens, "runs": []}
    plain_by_threads: dict[int, dict] = {}
    for layout_name in args.layouts:
        layout = LAYOUTS[layout_name]
        if layout["ep"] > 1 and "num_experts" not in config:
            continue  # expert parallelism needs experts
        num_ranks = layout["tp"] * layout["ep"]
        label = "megarl " + " ".join(
            f"{axis.upper()}={size}" for axis, size in layout.items() if size > 1 or axis == "tp"
        )
        print(f"[{name}] {label} ({num_ranks} rank(s) x 1 thread) ...", flush=True)
        megarl = summarize(label, f"{num_ranks} x 1", run_megarl(folder, layout, args), num_tokens)
        if num_ranks not in plain_by_threads:  # one plain run per thread count, shared by the layouts using it
            print(f"[{name}] plain PyTorch, {num_ranks} thread(s) ...", flush=True)
            plain_run = run_plain(folder, num_ranks, config["vocab_size"], args)
            plain_by_threads[num_ranks] = summarize("plain PyTorch", str(num_ranks), [plain_run], num_tokens)
        plain = plain_by_threads[num_ranks]
        for row in (megarl, plain):
            print(
                "    "
                + row["label"]
                + ": "
                + ", ".join(
                    f"{phase} {row[phase]['seconds']:.2f} s" if "seconds" in row[phase] else f"{phase} failed"
                    for phase in ("logprobs", "update")
                ),
                flush=True,
            )
        result["runs"].append({"layout": layout_name, "megarl": megarl, "plain": plain})
    return result


def _cells(row: dict, plain: dict, phase: str) -> str:
    if "error" in row[phase]:
        return f"cannot run: `{row[phase]['error'][:120]}` | | "
    ratio = row[phase]["seconds"] / plain[phase]["seconds"]
    return f"{row[phase]['seconds']:.2f} | {row[phase]['tokens_per_s']:.0f} | {ratio:.2f} "


def table(result: dict) -> list[str]:
    rows = [
        f"\n{result['model']}: {result['params_m']:.0f} M parameters ({result['active_params_m']:.0f} M active per "
        f"token), fp32; batch {result['tokens']} tokens. `x plain`: seconds / plain PyTorch's with as many threads.",
        "| run | threads | log-probs s | log-probs tok/s | x plain | update s | update tok/s | x plain "
        "| peak RSS GB per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    shown: set[int] = set()
    for run in result["runs"]:
        plain = run["plain"]
        for row in (run["megarl"], plain):
            if row is plain and id(plain) in shown:
                continue
            shown.add(id(row))
            rss = ", ".join(f"{gb:.2f}" for gb in row["rss_peak_gb"])
            rows.append(
                f"| {row['label']} | {row['threads']} | {_cells(row, plain, 'logprobs')}| "
                f"{_cells(row, plain, 'update')}| {rss} |"
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--layouts", default="tp1,tp2,ep2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--rows", type=int, default=16, help="sequences in the batch")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8192, help="micro-batch budget of the update (x2 forward)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    parser.add_argument("--workdir", default=None, help="where the generated models go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--packing", default=None, help="on,off: compare megarl with and without packing only")
    parser.add_argument("--lengths", default="full", choices=["full", "skewed"], help="row lengths of the batch")
    args = parser.parse_args(argv)
    args.layouts = [name.strip() for name in args.layouts.split(",")]
    if args.packing:
        return _main_packing(args)
    load_at_start = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.models.split(","):
            config = dict(MODELS[name.strip()])
            if args.tiny:
                config.update({k: v for k, v in TINY.items() if k in config})
            results.append(bench_model(name.strip(), config, Path(tmp), args))
    load = {"start": load_at_start, "end": os.getloadavg()}
    header = "Load average (1, 5, 15 min) at start -> end: " + " -> ".join(
        ", ".join(f"{x:.2f}" for x in load[when]) for when in ("start", "end")
    )
    print("\n".join([header, *(row for result in results for row in table(result))]))
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load, "results": results}, indent=1))
    return results


def _main_packing(args) -> list[dict]:
    args.packing = [value.strip() == "on" for value in args.packing.split(",")]
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.models.split(","):
            config = dict(MODELS[name.strip()])
            if args.tiny:
                config.update({k: v for k, v in TINY.items() if k in config})
            results.append(bench_packing(name.strip(), config, Path(tmp), args))
    print("\n".join(row for result in results for row in packing_table(result)))
    headline = {"packing_speedup": packing_speedup(results)} if len(args.packing) == 2 else {}
    print(headline)
    if args.json:
        Path(args.json).write_text(json.dumps(headline | {"results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
