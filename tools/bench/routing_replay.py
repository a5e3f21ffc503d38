"""Measure what routing replay (R3) buys: the rollout engine's and the trainer's expert choices and log-probs, bf16.

    python tools/bench/routing_replay.py [--models tiny-mixtral,tiny-qwen3-moe,tiny-deepseek-v3] [--ep 2]
                                         [--prompts 16] [--samples 4] [--tokens 32] [--json results.json]

For each tiny MoE model (configs/models/, random weights saved in bf16): the embedded hf engine (transformers, bf16)
samples completions and records the experts of every token; the Megatron actor (bf16, EP as given, on a gloo rank
pool) computes the log-probs of the same tokens twice, routing live and replaying the engine's routing. Reported:
routing agreement (the fraction of (token, MoE layer) top-k sets the trainer's live router chose as the engine did;
its minimum over layers) and the engine-vs-trainer log-prob gap on the response tokens, live and replayed. The two
sides compute in bf16 with different kernels, so near-tied router scores flip: the disagreement R3 removes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


# ---- megarl: runs on every rank of a RankPool ---------------------------------------------------------------------


def trainer_logprobs(path: str, ep: int, batch):
    """(dp rank, live log-probs, replayed log-probs, agree counts, compared counts) from output ranks."""
    from megatron.core import parallel_state as ps

    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import ModelSettings
    from megarl.workers.policy import compute_logprobs
    from megarl.workers.role_model import build_role_model

    parallel = ParallelConfig(ep=ep)
    init_model_parallel(parallel)
    model = build_role_model(ModelSettings(path=path, dtype="bfloat16", parallel=parallel))
    part = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    live = compute_logprobs(model, part, max_tokens=4096, routing="observe")
    replayed = compute_logprobs(model, part, max_tokens=4096, routing="replay")
    if live is None:
        return None
    dp_rank = ps.get_data_parallel_rank()
    return dp_rank, live["logprobs"], replayed["logprobs"], live["routing_agree"], live["routing_observed"]


# ---- driver ---------------------------------------------------------------------------------------------------------


class _NoText:
    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids, skip_special_tokens=True):
        return ""


def rollout_batch(folder: Path, num_prompts: int, num_samples: int, num_tokens: int):
    from megarl.data.prompts import PromptSample
    from megarl.models.registry import routing_layout
    from megarl.rollout.config import HFEngineConfig, SamplingParams
    from megarl.rollout.engine import GenerateRequest
    from megarl.rollout.hf_engine import HFEngine
    from megarl.trainer.rollout_side.rollout_step import collate_rollout
    from megarl.trainer.rollout_side.routing import RoutingPlan

    engine = HFEngine(folder, HFEngineConfig(dtype="bfloat16"), record_routing=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (16,), generator=g).tolist() for _ in range(num_prompts)]
    samples = [PromptSample(i, "", prompt, None) for i, prompt in enumerate(prompts)]
    requests = [GenerateRequest(s.prompt_ids, seed=i) for i, s in enumerate(samples)]
    sampling = SamplingParams(n=num_samples, temperature=1.0, max_new_tokens=num_tokens, ignore_eos=True)
    completions = engine.generate(requests, sampling)
    plan = RoutingPlan(routing_layout(engine.model.config), "rollout", "error")
    return collate_rollout(samples, completions, _NoText(), plan).batch


def measure(pool, name: str, ep: int, args, root: Path) -> dict:
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    folder = make_hf_checkpoint(name, root / name, dtype=torch.bfloat16)
    batch = rollout_batch(folder, args.prompts, args.samples, args.tokens)
    results = sorted((r for r in pool.run(trainer_logprobs, str(folder), ep, batch) if r), key=lambda r: r[0])
    live, replayed = torch.cat([r[1] for r in results]), torch.cat([r[2] for r in results])
    agree, observed = torch.cat([r[3] for r in results]).sum(0), torch.cat([r[4] for r in results]).sum(0)
    response = batch["response_mask"].bool()
    live_gap = (live - batch["rollout_logprobs"])[response].abs()
    replayed_gap = (replayed - batch["rollout_logprobs"])[response].abs()
    return {
        "model": name,
        "ep": ep,
        "tokens": int(observed[0]),
        "agreement": (agree.sum() / observed.sum()).item(),
        "agreement_min_layer": (agree / observed).min().item(),
        "gap_live_mean": live_gap.mean().item(),
        "gap_replayed_mean": replayed_gap.mean().item(),
        "gap_live_max": live_gap.max().item(),
        "gap_replayed_max": replayed_gap.max().item(),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | EP | tokens | routing agreement (min layer) | mean abs log-prob gap: live -> replayed "
        "| max: live -> replayed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ep']} | {r['tokens']} | {r['agreement']:.4f} ({r['agreement_min_layer']:.4f}) | "
            f"{r['gap_live_mean']:.5f} -> {r['gap_replayed_mean']:.5f} | {r['gap_live_max']:.4f} -> "
            f"{r['gap_replayed_max']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    import tempfile

    from megarl.runtime.rank_pool import RankPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-mixtral,tiny-qwen3-moe,tiny-deepseek-v3")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RankPool(args.ep, timeout_s=1800) as pool:
        for name in args.models.split(","):
            rows.append(measure(pool, name, args.ep, args, Path(tmp)))
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
