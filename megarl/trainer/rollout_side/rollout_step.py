"""Controller side of rollout: prompts -> requests for the engines -> completions -> a Batch.

Requests are split evenly among the rollout engines (contiguous shares, so each engine prefills a prompt once for
its n samples). Every request carries a seed derived from (run seed, step, request index): the samples do not
depend on how many engines there are or which one served them, and a resumed run draws the same ones.

The Batch rows are grouped by prompt (the n completions of prompt i are rows i*n .. i*n+n-1, `group_ids` = i), with
`rollout_logprobs` aligned like every per-token tensor and per-row metadata: prompt and response text, label,
finish reason, weight version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megarl.data.batch import Batch
from megarl.data.collate import make_rl_batch
from megarl.data.prompts import PromptSample
from megarl.data.render import pad_id_of
from megarl.rollout.config import SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest, sample_seed
from megarl.trainer.rollout_side.routing import RoutingPlan, add_rollout_routing


@dataclass
class RolloutResult:
    batch: Batch
    num_tokens: int
    """Generated tokens (all completions)."""
    metrics: dict[str, float] = field(default_factory=dict)


MAX_DRAWS = 2**32
"""Generate rounds of one step that get seeds of their own (DAPO's max_sampling_rounds is bounded by it)."""


def draw_key(step: int, draw: int) -> int:
    """One integer per (step, draw) pair, never the same for two pairs: the `step` argument of `request_seed`."""
    if not 0 <= draw < MAX_DRAWS:
        raise ValueError(f"draw {draw} outside [0, {MAX_DRAWS})")
    return step * MAX_DRAWS + draw


def request_seed(run_seed: int, step: int, index: int) -> int:
    """The seed of request `index` of generate round `step` (a `draw_key`)."""
    return sample_seed(sample_seed(run_seed, step), index)


def generate_batch(
    rollout_group,
    samples: Sequence[PromptSample],
    sampling: SamplingParams,
    tokenizer,
    run_seed: int,
    step: int,
    routing: RoutingPlan | None = None,
) -> RolloutResult:
    """Generate `sampling.n` completions per prompt on the rollout engines and collate them."""
    requests = [
        GenerateRequest(s.prompt_ids, seed=request_seed(run_seed, step, i), request_id=str(s.index))
        for i, s in enumerate(samples)
    ]
    completions = generate_on_engines(rollout_group, requests, sampling)
    result = collate_rollout(samples, completions, tokenizer, routing)
    if getattr(rollout_group, "recovers", False):  # an EngineFleet that restarts failed engines
        result.metrics.update(rollout_group.take_metrics())
    return result


def generate_on_engines(group, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
    """Completions of `requests` (request order) from the engines of `group`; a fleet that restarts its failed
    engines (engine_fleet.py) sends a failed engine's requests to the others."""
    if getattr(group, "recovers", False):
        return group.generate(requests, sampling)
    num_engines = group.world_size
    bounds = [len(requests) * i // num_engines for i in range(num_engines + 1)]
    shares = [requests[bounds[i] : bounds[i + 1]] for i in range(num_engines)]
    per_engine = group.call("generate", shares, [sampling] * num_engines, dispatch="per_rank")
    return [completions for share in per_engine for completions in share]


def collate_rollout(
    samples: Sequence[PromptSample],
    completions: list[list[Completion]],
    tokenizer,
    routing: RoutingPlan | None = None,
) -> RolloutResult:
    """The batch of every completion; with `routing` (a MoE model whose engines record routing), their routed
    experts too (megarl/trainer/rollout_side/routing.py)."""
    prompt_ids, response_ids, logprobs = [], [], []
    routed, names = [], []
    meta: dict[str, list] = {k: [] for k in ("prompt", "response", "label", "finish_reason", "weight_version")}
    group_ids = []
    for group, (sample, outs) in enumerate(zip(samples, completions)):
        for j, out in enumerate(outs):
            prompt_ids.append(sample.prompt_ids)
            response_ids.append(out.token_ids)
            logprobs.append(out.logprobs)
            group_ids.append(group)
            routed.append(out.routed_experts)
            names.append(f"(prompt {sample.index}, completion {j})")
            meta["prompt"].append(sample.text)
            meta["response"].append(tokenizer.decode(out.token_ids, skip_special_tokens=True))
            meta["label"].append(sample.label)
            meta["finish_reason"].append(out.finish_reason)
            meta["weight_version"].append(out.weight_version)
    batch = make_rl_batch(prompt_ids, response_ids, pad_id=pad_id_of(tokenizer), meta=meta, rollout_logprobs=logprobs)
    batch = batch.with_tensors(group_ids=torch.tensor(group_ids, dtype=torch.long))
    metrics: dict[str, float] = {}
    if routing is not None and routing.layout is not None:
        batch, metrics = add_rollout_routing(batch, routed, routing, names)
    return RolloutResult(batch, sum(len(r) for r in response_ids), metrics)


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Response lengths, finish reasons, the number of samples and the weight versions that generated them."""
    lengths = batch["response_mask"].sum(dim=1).float()
    reasons = batch.meta["finish_reason"]
    versions = batch.meta["weight_version"]
    return {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_frac": sum(r == "length" for r in reasons) / max(len(reasons), 1),
        "rollout/samples": float(len(reasons)),
        "rollout/weight_version_min": float(min(versions)),
        "rollout/weight_version_max": float(max(versions)),
    }
