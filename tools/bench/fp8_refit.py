"""Benchmark the sending side of an FP8 weight sync against bf16: bytes on the wire and seconds per sync.

    python tools/bench/fp8_refit.py [--reps 3] [--bucket-mb 512] [--json results.json] [--tiny]

One process holds a whole DeepSeek-V3-shaped model (generated, bf16; widths multiples of 128 so every block is
whole, as in the 671B model) and runs megarl's own sender (megarl/workers/weight_sync.py `send_weights`) with the
transport cut off: the export stream (HF layout, bucketing) and, for FP8, the block-wise quantization of every
attention and expert projection (megarl/bridge/fp8.py). What the engines then do with the bytes depends on the road
(CUDA IPC, NCCL, object store) and is measured by gpu_refit.py on a GPU; the bytes ratio carries over to every road.
On a GPU (CUDA available) the model and the quantization run on the GPU.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MODEL = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=32,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(num_hidden_layers=2, n_routed_experts=4, vocab_size=1024)


def sync_once(model, quantization: dict | None, bucket_bytes: int) -> tuple[float, float, int]:
    """(seconds, bytes, tensors) of one sending pass, buckets dropped once made (the transport cut off)."""
    import megarl.workers.weight_sync as weight_sync

    weight_sync._send_bucket = lambda bucket, route, roads, state: ([], None)
    route = weight_sync.SyncRoute("object_store", (), quantization=quantization)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats = weight_sync.send_weights(model, route, 1, bucket_bytes, weight_sync.SenderState())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, stats["bytes"], int(stats["tensors"])


def run(args) -> dict:
    from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import single_process_megatron
    from megarl.runtime.parallel import ParallelConfig
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    config = dict(MODEL, **(TINY if args.tiny else {}))
    with tempfile.TemporaryDirectory() as tmp, single_process_megatron():
        folder = make_hf_checkpoint(config, Path(tmp) / "model", dtype=torch.bfloat16, with_tokenizer=False)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        model = load_model(folder, ParallelConfig(), torch.bfloat16)
        if torch.cuda.is_available():
            for chunk in model.chunks:
                chunk.cuda()
        params = sum(p.numel() for chunk in model.chunks for p in chunk.parameters())
        rows = {}
        for name, quantization in (("bf16", None), ("fp8", DEEPSEEK_QUANTIZATION)):
            sync_once(model, quantization, args.bucket_mb * 2**20)  # warm-up
            runs = [sync_once(model, quantization, args.bucket_mb * 2**20) for _ in range(args.reps)]
            seconds = statistics.median(r[0] for r in runs)
            rows[name] = {"seconds": seconds, "bytes": runs[0][1], "tensors": runs[0][2]}
            print(f"{name}: {runs[0][1] / 1e9:.3f} GB in {runs[0][2]} tensors, {seconds:.3f} s (median of {args.reps})")
    ratio = rows["fp8"]["bytes"] / rows["bf16"]["bytes"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"device": device, "params": params, "bucket_mb": args.bucket_mb, "rows": rows, "bytes_ratio": ratio}
    print(f"{params / 1e6:.0f} M parameters on {device}: FP8 sends {ratio:.1%} of the bf16 bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--json", default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
