"""Benchmark delta weight sync (rollout.weight_sync_delta, megarl/workers/weight_delta.py) against full syncs.

    python tools/bench/delta_sync.py [--steps 20] [--lrs 1e-6,1e-5] [--json results.json]

A small Llama-shaped model (generated, no hub: 4 layers, hidden 256, vocab 4096, 5.3 M parameters) trains on CPU
with real steps: fp32 master weights, bf16 autocast forward and backward, AdamW at each learning rate, random
token batches (8 x 64). After every step the trainer's weights are exported in bf16 (what the engine serves), cut
into 1 MiB buckets, and synced into the hf rollout engine (bf16, megarl/rollout/hf_engine.py) as deltas: each
bucket encoded against the sender's snapshot, applied in place by the engine's weight loader, its checksum verified
there. After each sync the engine's weights are compared with the trainer's bf16 export, bit for bit; then the same
buckets are loaded whole, timed, as the full sync's cost.

--json writes, per learning rate, every step's bytes (full, delta), changed fraction and seconds (encode, apply,
full load), and at the top `bytes_ratio`: the median over the steps of full bytes / delta bytes at the first
learning rate (1e-6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BUCKET_BYTES = 2**20


def build_model(folder: Path) -> torch.nn.Module:
    """The trainer's model (fp32), also saved in bf16 as the engine's starting checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    return model.float()


def buckets_of(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The trainer's weights in bf16, in 1 MiB buckets (megarl/bridge/buckets.py)."""
    from megarl.bridge.buckets import BucketBuilder

    builder, buckets = BucketBuilder(BUCKET_BYTES), []
    for name, param in model.state_dict().items():
        if (bucket := builder.add(name, param.detach().to(torch.bfloat16))) is not None:
            buckets.append(bucket)
    if (bucket := builder.flush()) is not None:
        buckets.append(bucket)
    return buckets


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> float:
    ids = torch.randint(0, model.config.vocab_size, (8, 64), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def engine_equals_trainer(engine, buckets) -> bool:
    loader = engine.weights
    for bucket in buckets:
        for name, tensor in bucket:
            dest = loader.plan[name]
            target = loader._tensors[dest.target]
            region = target[dest.index] if dest.index else target
            if not torch.equal(region.view(torch.int16), tensor.view(torch.int16)):
                return False
    return True


def run(lr: float, steps: int) -> dict:
    from megarl.rollout.config import HFEngineConfig
    from megarl.rollout.hf_engine import HFEngine
    from megarl.workers.weight_delta import DeltaEncoder

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        engine = HFEngine(tmp, HFEngineConfig(dtype="bfloat16", device="cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    encoder, generator = DeltaEncoder(), torch.Generator().manual_seed(1)
    rows = []
    for step in range(steps + 1):  # step 0: the first sync, full
        loss = train_step(model, optimizer, generator) if step else float("nan")
        buckets = buckets_of(model)
        engine.begin_weight_update(step + 1)
        start = time.perf_counter()
        deltas = [encoder.encode(bucket) for bucket in buckets]
        encoded = time.perf_counter()
        for delta in deltas:
            engine.weights.apply_delta(delta)
        applied = time.perf_counter()
        engine.finish_weight_update(step + 1)
        equal = engine_equals_trainer(engine, buckets)
        if not equal:
            raise SystemExit(f"lr {lr:g} step {step}: the engine's weights differ from the trainer's after the delta")
        engine.begin_weight_update(step + 1001)
        full_start = time.perf_counter()
        for bucket in buckets:
            engine.weights.load(bucket)
        full_seconds = time.perf_counter() - full_start
        engine.finish_weight_update(step + 1001)
        full_bytes = sum(d.full_bytes for d in deltas)
        delta_bytes = sum(d.nbytes for d in deltas)
        elements = sum(t.numel() for bucket in buckets for _, t in bucket)
        rows.append(
            {
                "step": step,
                "loss": loss,
                "full_bytes": full_bytes,
                "delta_bytes": delta_bytes,
                "bytes_ratio": full_bytes / delta_bytes,
                "changed_fraction": sum(d.changed_elements for d in deltas) / elements,
                "encode_s": encoded - start,
                "apply_s": applied - encoded,
                "full_load_s": full_seconds,
                "checksums_verified": len(deltas),
                "bit_exact": equal,
            }
        )
        print(
            f"lr {lr:g} step {step:2d}: {delta_bytes / 1e6:7.3f} MB of {full_bytes / 1e6:.3f} MB "
            f"(changed {rows[-1]['changed_fraction']:.4%}), encode {rows[-1]['encode_s'] * 1e3:.1f} ms, "
            f"apply {rows[-1]['apply_s'] * 1e3:.1f} ms, full load {full_seconds * 1e3:.1f} ms",
            file=sys.stderr,
        )
    later = rows[1:]  # the deltas (step 0 is the full first sync)
    return {
        "lr": lr,
        "steps": rows,
        "bytes_ratio_median": statistics.median(r["bytes_ratio"] for r in later),
        "changed_fraction_median": statistics.median(r["changed_fraction"] for r in later),
        "delta_sync_s_median": statistics.median(r["encode_s"] + r["apply_s"] for r in later),
        "full_load_s_median": statistics.median(r["full_load_s"] for r in later),
        "all_bit_exact": all(r["bit_exact"] for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates; the first heads --json")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = [run(float(lr), args.steps) for lr in args.lrs.split(",")]
    summary = {
        "bytes_ratio": results[0]["bytes_ratio_median"],
        "lr": results[0]["lr"],
        "steps": args.steps,
        "bucket_bytes": BUCKET_BYTES,
        "runs": results,
    }
    for result in results:
        print(
            f"lr {result['lr']:g}: bytes ratio {result['bytes_ratio_median']:.1f} (median), changed "
            f"{result['changed_fraction_median']:.4%} per step, delta sync {result['delta_sync_s_median'] * 1e3:.1f} "
            f"ms vs full load {result['full_load_s_median'] * 1e3:.1f} ms, bit exact: {result['all_bit_exact']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
