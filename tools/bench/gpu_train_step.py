"""GPU benchmark: one actor update step of megarl's Megatron role model next to plain transformers + torch AdamW, on
the same ~0.5B Qwen2-class model (built from a config, bf16), the same batch and the same policy loss, on one GPU.

    python tools/bench/gpu_train_step.py [--rows 8] [--seq 1024] [--reps 5] [--jsonl out.jsonl]

Reports tokens/s and MFU (6 x parameters x tokens / time / the device's dense bf16 peak) of each, and their ratio
(target: megarl >= 1.3x plain). The peak comes from the device name (H100 / H200: 989 TFLOP/s, A100: 312), or
MEGARL_PEAK_TFLOPS. Each measurement is appended to --jsonl as one JSON line the moment it is taken (megarl's step
first), so a run stopped by its time limit keeps what it measured. Run by tools/gpu/run.sh; results go to
tools/bench/README.md with device, date and command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN2_HALF_B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def record(path: str | None, bench: str, measurement: str, values: dict) -> None:
    """Append one measurement to `path` (JSON lines) now: a benchmark stopped by its limit keeps what it measured."""
    line = json.dumps({"bench": bench, "measurement": measurement, "device": torch.cuda.get_device_name(), **values})
    print(f"{bench}/{measurement}: {line}", flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def peak_flops() -> float:
    if "MEGARL_PEAK_TFLOPS" in os.environ:
        return float(os.environ["MEGARL_PEAK_TFLOPS"]) * 1e12
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), float("nan"))


def build_checkpoint(folder: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**QWEN2_HALF_B)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)  # the role model needs config and weights only, no tokenizer
    return sum(p.numel() for p in model.parameters())


def synthetic_batch(rows: int, seq: int, vocab: int):
    from megarl.algorithms.aggregation import loss_weights
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (rows, seq), generator=g)
    attention = torch.ones(rows, seq, dtype=torch.long)
    response = torch.zeros(rows, seq)
    response[:, seq // 4 :] = 1
    batch = Batch({"input_ids": input_ids, "attention_mask": attention, "response_mask": response})
    return batch.with_tensors(
        advantages=torch.randn(rows, 1, generator=g) * response,
        old_logprobs=torch.full((rows, seq), -5.0),
        loss_weights=loss_weights("token-mean", response),
        group_ids=torch.arange(rows),
    )


def timed(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def megarl_step_seconds(folder: Path, batch, args) -> float:
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.runtime.device import local_device, to_device
    from megarl.runtime.distributed import init_distributed, init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import ModelSettings, OptimizerSettings
    from megarl.workers.policy import update_policy
    from megarl.workers.role_model import build_role_model

    init_distributed()
    init_model_parallel(ParallelConfig())
    settings = ModelSettings(path=str(folder), dtype="bfloat16", parallel=ParallelConfig())
    model = build_role_model(settings, optimizer=OptimizerSettings(lr=1e-6), total_steps=100)
    batch = to_device(batch, local_device())
    loss = PolicyLoss(PolicyLossConfig())
    return timed(lambda: update_policy(model, batch, loss, 1.0, args.rows * args.seq), args.warmup, args.reps)


def plain_step_seconds(folder: Path, batch, args) -> float:
    """transformers in bf16 with torch's fused AdamW: the same surrogate loss on the same tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    tensors = {name: t.cuda() for name, t in batch.tensors.items()}

    def step():
        logits = model(tensors["input_ids"]).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, tensors["input_ids"][:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logprobs - tensors["old_logprobs"][:, 1:])
        per_token = -ratio * tensors["advantages"][:, 1:]
        loss = (per_token * tensors["loss_weights"][:, 1:]).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, args.warmup, args.reps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--jsonl", default=None, help="append each measurement to this file as it is taken")
    args = parser.parse_args(argv)
    peak = peak_flops()
    result: dict = {"device": torch.cuda.get_device_name(), "peak_flops": peak}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2-0.5b"
        num_params = build_checkpoint(folder)
        batch = synthetic_batch(args.rows, args.seq, QWEN2_HALF_B["vocab_size"])
        tokens = args.rows * args.seq
        result |= {"params": num_params, "tokens": tokens}
        for name, measure in (("megarl", megarl_step_seconds), ("plain", plain_step_seconds)):
            seconds = measure(folder, batch, args)
            result[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                            "mfu": 6 * num_params * tokens / seconds / peak}  # fmt: skip
            record(args.jsonl, "train_step", name, {"params": num_params, "tokens": tokens, **result[name]})
    result["speedup"] = result["plain"]["seconds"] / result["megarl"]["seconds"]
    record(args.jsonl, "train_step", "speedup", {"megarl_over_plain": result["speedup"], "target": 1.3})
    print(
        f"update step, {num_params / 1e9:.2f} B params, {tokens} tokens: megarl {result['megarl']['seconds']:.3f} s "
        f"(MFU {result['megarl']['mfu']:.1%}), plain {result['plain']['seconds']:.3f} s "
        f"(MFU {result['plain']['mfu']:.1%}): {result['speedup']:.2f}x (target 1.3x)"
    )
    return result


if __name__ == "__main__":
    main()
