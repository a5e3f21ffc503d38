"""Behavioural check of a weight sync: the engines and the actor score the same greedy tokens.

The checksums of `rollout.verify_sync` compare a sample of tensors (the norm weights); a wrong layout of one expert,
a transposed projection or a stale tensor passes them. The probe catches what changes the model's behaviour: every
engine generates greedily from a few fixed prompts (the first `rollout.sync_probe.prompts` of the training data),
with its log-prob of each token it chose (greedy log-probs are of the unscaled distribution); the actor scores the
same tokens at temperature 1. The mean absolute gap per engine must stay within the tolerance of the weights the
engines serve (`PROBE_TOLERANCE`, or `rollout.sync_probe.tolerance`), or the run stops naming the engine, before any
sample it generates is trained on.

It runs after the syncs that `rollout.verify_sync` verifies (the first of each start, or every one). Colocated on
GPUs the engines generate while they hold the GPUs and the actor scores once it has them back: one handover round
trip, so the engines then get the same weights again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.data.collate import make_rl_batch
from megarl.errors import RunFailure
from megarl.rollout.config import SamplingParams
from megarl.rollout.engine import GenerateRequest

if TYPE_CHECKING:
    from megarl.data.batch import Batch
    from megarl.trainer.lifecycle.handover import Handover
    from megarl.trainer.lifecycle.roles import Roles

log = logging.getLogger("megarl")

PROBE_TOLERANCE = {"float32": 1e-4, "float16": 0.05, "bfloat16": 0.1, "fp8": 0.25}
"""Largest mean |log p_engine - log p_actor| per engine over the probe's tokens, by the weights the engines serve.
fp32: the two forwards differ only in the order of float operations (measured on CPU: 0 to 1.2e-7 for the tiny
test models; TF32 matmuls on a GPU would need a looser rollout.sync_probe.tolerance); bf16 and fp16 engines differ
from the trainer's kernels by 1e-2..3e-2 on real models; FP8 engine weights add their quantization error. Wrong
weights move the log-probs by far more on a trained model; even on the tiny random test models one expert in the
wrong layout moves them by 7.6e-4 and two swapped MLPs by more (tests/test_sync_probe.py)."""


@dataclass
class ProbeResult:
    gaps: list[float]
    """Mean absolute log-prob gap per engine."""
    tokens: int
    """Tokens each engine generated and the actor scored."""


class ProbeMismatch(RunFailure):
    """An engine's log-probs of its own greedy tokens differ from the actor's; `summary` says by how much."""

    def __init__(self, message: str, summary: str):
        super().__init__(message)
        self.summary = summary


class SyncProbe:
    def __init__(self, prompt_ids: list[list[int]], max_new_tokens: int, tolerance: float, pad_id: int):
        if not prompt_ids:
            raise ValueError("the sync probe needs at least one prompt")
        self.prompt_ids = prompt_ids
        self.sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
        self.tolerance = tolerance
        self.pad_id = pad_id

    def __call__(self, roles: Roles, handover: Handover, version: int) -> dict[str, float]:
        """Every engine generates, the actor scores; a gap over the tolerance raises RunFailure naming the engine."""
        handover.to_rollout()  # a no-op unless the roles hold the GPUs
        batches = self._generate(roles.rollout)
        handover.to_training()
        result = self._score(roles.actor, batches)
        worst = max(range(len(result.gaps)), key=result.gaps.__getitem__)
        if result.gaps[worst] > self.tolerance:
            summary = (
                f"weight sync to version {version}: engine {worst} scores its own greedy tokens differently from the "
                f"actor (mean |log-prob gap| {result.gaps[worst]:.4g} over {result.tokens} tokens of "
                f"{len(self.prompt_ids)} probe prompts, tolerance {self.tolerance:g}; per engine: "
                f"{', '.join(f'{gap:.3g}' for gap in result.gaps)})"
            )
            raise ProbeMismatch(
                f"{summary}. Its weights are not the trainer's (a tensor in the wrong layout, a stale or corrupted "
                "one): stopping before training on its samples (rollout.sync_probe.prompts=0 turns the probe off).",
                summary,
            )
        gap, engines = max(result.gaps), len(result.gaps)
        log.info("weight sync probe: largest gap %.3g over %d tokens x %d engine(s)", gap, result.tokens, engines)
        return {"sync/probe_gap_max": max(result.gaps), "sync/probe_tokens": float(result.tokens)}

    def _generate(self, rollout) -> list[Batch]:
        """Per engine: the probe prompts, its greedy completions and its log-probs of them."""
        requests = [GenerateRequest(ids, seed=0, request_id=f"sync-probe-{i}") for i, ids in enumerate(self.prompt_ids)]
        num = rollout.world_size
        per_engine = rollout.call("generate", [requests] * num, [self.sampling] * num, dispatch="per_rank")
        batches = []
        for completions in per_engine:
            outs = [group[0] for group in completions]
            batches.append(
                make_rl_batch(
                    self.prompt_ids,
                    [out.token_ids for out in outs],
                    pad_id=self.pad_id,
                    rollout_logprobs=[out.logprobs for out in outs],
                )
            )
        return batches

    def _score(self, actor, batches: list[Batch]) -> ProbeResult:
        from megarl.data.batch import Batch

        merged = Batch.concat(batches)
        # every data-parallel rank gets at least one row: the batch is repeated up to the DP size
        repeats = -(-actor.parallel_infos()[0].dp_size // len(merged))
        scored = Batch.concat([merged] * repeats) if repeats > 1 else merged
        out = actor.call("compute_logprobs", scored, 1.0, dispatch="dp_split", collect="dp_leaders")
        logprobs = out["logprobs"][: len(merged)]
        mask = merged["response_mask"].bool()
        gap = (logprobs - merged["rollout_logprobs"]).abs().masked_fill(~mask, 0.0)
        rows = len(self.prompt_ids)
        gaps = [
            (gap[i * rows : (i + 1) * rows].sum() / mask[i * rows : (i + 1) * rows].sum().clamp(min=1)).item()
            for i in range(len(batches))
        ]
        return ProbeResult(gaps, int(mask[:rows].sum().item()))


def build_probe(config, prompts, tokenizer, quantization: dict | None) -> SyncProbe | None:
    """The run's probe (None when rollout.sync_probe.prompts is 0 or there are no training prompts)."""
    from megarl.data.render import pad_id_of

    settings = config.rollout.sync_probe
    if settings.prompts == 0 or prompts is None or len(prompts) == 0:
        return None
    tolerance = settings.tolerance if settings.tolerance is not None else default_tolerance(config, quantization)
    prompt_ids = [prompts[i].prompt_ids for i in range(min(settings.prompts, len(prompts)))]
    return SyncProbe(prompt_ids, settings.max_new_tokens, tolerance, pad_id_of(tokenizer))


def default_tolerance(config, quantization: dict | None) -> float:
    """PROBE_TOLERANCE of the coarser of the trainer's dtype and the engines' (FP8 engine weights: fp8)."""
    from megarl.models.hf_config import parse_dtype

    trained = str(parse_dtype(config.actor.model.dtype)).removeprefix("torch.")
    rollout = config.rollout
    if quantization:
        served = "fp8"
    elif rollout.backend == "hf":
        served = rollout.hf.dtype
    else:
        served = {"auto": trained, "half": "float16", "float": "float32"}.get(
            rollout.sglang.dtype, rollout.sglang.dtype
        )
    return max(PROBE_TOLERANCE[trained], PROBE_TOLERANCE[served])
