"""The rollout engine interface (docs/architecture.md): what the trainer asks of any backend.

An engine turns prompts (token ids) into completions with per-token log-probs, takes new weights as buckets of
HF-named tensors (names exactly as in the HF safetensors checkpoint, tensors whole, in the HF dtype), and carries a
weight version into every completion so the trainer can tell how stale a sample is.

Reproducibility: a request with a seed is sampled from its own random streams, one per completion (sample j of a
request with seed s draws from a generator seeded by `sample_seed(s, j)`), so the same request gives the same
completions whatever else is in the batch.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megarl.errors import UserError
from megarl.rollout.config import SamplingParams

Bucket = list[tuple[str, torch.Tensor]]

FinishReason = Literal["stop", "length", "abort"]

VERIFY_PATTERN = r"^model\.norm\.weight$|^model\.layers\.\d+\.(input|post_attention)_layernorm\.weight$"
"""Tensors a weight sync is verified on: norm weights, which every engine keeps under their HF names, whole (no
fusing, no tensor-parallel split), so their bytes can be compared as sent; small (a few MB at 671B)."""

MEMORY_TAGS = ("weights", "kv_cache")
"""What a colocated engine releases and resumes (SGLang's memory-saver tags): weights first back, KV cache last."""


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    """The prompt, as token ids (templates and tokenization happen before the engine)."""
    seed: int | None = None
    """Base seed of this request's completions; None draws from the engine's global generator."""
    request_id: str | None = None
    """Caller's id, echoed in the completions (used to abort or resume a request)."""
    prefix_ids: list[int] = field(default_factory=list)
    """Response tokens generated earlier (a partial rollout resumed under new weights): generation continues after
    prompt + prefix, and the completion includes the prefix."""
    prefix_logprobs: list[float] = field(default_factory=list)
    """Log-probs of the prefix tokens, as recorded when they were generated."""
    prefix_versions: list[int] = field(default_factory=list)
    """Weight version that generated each prefix token."""

    def check(self, i: int) -> None:
        """Raise UserError (naming `requests[i]`) for a request no engine can serve or whose prefix records are
        incomplete."""
        if not self.prompt_ids:
            raise UserError(f"requests[{i}].prompt_ids is empty; the engine needs at least one prompt token")
        num_prefix = len(self.prefix_ids)
        if len(self.prefix_logprobs) != num_prefix or len(self.prefix_versions) != num_prefix:
            raise UserError(
                f"requests[{i}] has {num_prefix} prefix_ids but {len(self.prefix_logprobs)} prefix_logprobs "
                f"and {len(self.prefix_versions)} prefix_versions; give one of each per prefix token"
            )


@dataclass
class Completion:
    token_ids: list[int]
    """Generated tokens, including a final stop token or the tokens that completed a stop string."""
    logprobs: list[float]
    """log p(token) under the sampling distribution at the request's temperature, before top-k/top-p truncation."""
    finish_reason: FinishReason
    """`stop` (EOS, a stop token or string), `length` (max_new_tokens), or `abort` (interrupted)."""
    weight_version: int
    """Weight version of the engine when the completion finished."""
    token_versions: list[int] = field(default_factory=list)
    """Weight version that generated each token (differs from weight_version only for resumed partial rollouts)."""
    request_id: str | None = None
    routed_experts: torch.Tensor | None = None
    """The experts each token was routed to, when the engine records them (MoE models): [len(prompt + token_ids) -
    1, moe_layers, topk], row t for token t (megarl/rollout/routing.py)."""


@dataclass
class SyncStats:
    """What one weight update moved."""

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float


def sample_seed(seed: int, index: int) -> int:
    """A 63-bit seed for completion `index` of a request seeded with `seed` (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


HEALTH_PROBE_TOKEN = 1
"""The prompt of the generic health probe (any id below the vocabulary size)."""


class RolloutEngine(ABC):
    """A rollout backend. Calls block; a Ray rollout worker wraps one engine."""

    weight_version: int = 0

    @abstractmethod
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        """`sampling.n` completions for each request, in request order."""

    @abstractmethod
    def begin_weight_update(self, version: int) -> None:
        """Prepare to receive buckets (pause generation, flush caches as the backend needs)."""

    @abstractmethod
    def apply_bucket(self, bucket: Bucket) -> None:
        """Load one bucket of HF-named tensors into the model."""

    @abstractmethod
    def finish_weight_update(self, version: int) -> None:
        """All buckets are in: the engine now serves weights `version`."""

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> SyncStats:
        """Load a whole stream of buckets: begin, apply each, finish."""
        import time

        start = time.perf_counter()
        num_tensors = num_bytes = 0
        self.begin_weight_update(version)
        for bucket in buckets:
            self.apply_bucket(bucket)
            num_tensors += len(bucket)
            num_bytes += sum(t.nbytes for _, t in bucket)
        self.finish_weight_update(version)
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start)

    def load_weights_from_disk(self, folder: str) -> tuple[int, int]:
        """Load every tensor of the safetensors files in `folder` (the disk transport: each sending rank wrote its
        buckets there), between begin and finish_weight_update; returns (tensors, bytes). Here: each file as a
        bucket through apply_bucket; engines that read a folder themselves (SGLang) override it."""
        from pathlib import Path

        from safetensors.torch import load_file

        num_tensors = num_bytes = 0
        for path in sorted(Path(folder).glob("*.safetensors")):
            bucket = list(load_file(path).items())
            self.apply_bucket(bucket)
            num_tensors += len(bucket)
            num_bytes += sum(t.nbytes for _, t in bucket)
        return num_tensors, num_bytes

    def verify_weights(self, expected: Bucket) -> list[str]:
        """Compare what the engine holds with `expected` (HF-named tensors as the trainer sent them): one line per
        tensor that differs or is missing, [] when all agree. Engines that cannot look return [] (not checked)."""
        return []

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free accelerator memory for a colocated trainer: `tags` among MEMORY_TAGS (None: all); no-op where
        nothing is held."""
        return None  # default: nothing to do

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what release_memory freed (`tags` as there; weights before the KV cache)."""
        return None  # default: nothing to do

    def flush_cache(self) -> None:
        """Drop cached prefixes / KV (they were computed with older weights)."""
        return None  # default: nothing to do

    def abort(self) -> None:
        """Interrupt generation in progress: unfinished completions return with finish_reason `abort`."""
        return None  # default: nothing to do

    def health(self) -> dict[str, Any]:
        """{"ok": bool, "weight_version": int, ...}; must answer quickly."""
        return {"ok": True, "weight_version": self.weight_version}

    def health_probe(self, timeout_s: float) -> None:
        """Prove the engine serves: one greedy token of a one-token prompt (within `timeout_s`, where the backend
        can bound it). Raises when it cannot (the engine's own error)."""
        probe = GenerateRequest([HEALTH_PROBE_TOKEN], seed=0, request_id="health_probe")
        self.generate([probe], SamplingParams(n=1, temperature=0.0, max_new_tokens=1, ignore_eos=True))

    def shutdown(self) -> None:
        """Release every resource (processes, memory)."""
        return None  # default: nothing to do
