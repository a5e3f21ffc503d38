"""The embedded rollout engine: a transformers model in the trainer's process (the CPU default).

Generation runs in rounds of at most `max_batch_size` completions. A round prefills each distinct context
(prompt + resumed prefix) once, left-padded with an attention mask and position ids counted from each row's first
real token, so a row's numbers do not depend on its neighbors; the `n` completions of a request then share that
prefill's KV cache rows. Decoding feeds one token per row per step through the KV cache; rows that finish leave
the batch (their cache rows are dropped). Sampling draws from one generator per completion (see hf_sampling.py).

With `record_routing` (MoE models) hooks on the HF routers record the experts of every token fed, prefill and
decode alike, into each completion's `routed_experts` (megarl/rollout/routing.py).

Weights arrive as buckets of checkpoint-named tensors and are written in place by `WeightLoader` (hf_weights.py).
The engine is single-user: `generate` and the weight-update calls serialize on one lock; `abort` and `health` may
be called from any thread at any time.

Shapes: B rows being decoded, U distinct contexts of a round, L padded context length, V vocabulary.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserError
from megarl.rollout.config import HFEngineConfig, SamplingParams
from megarl.rollout.engine import MEMORY_TAGS, Bucket, Completion, GenerateRequest, RolloutEngine, sample_seed
from megarl.rollout.hf_sampling import StopStringWatcher, sample_tokens
from megarl.rollout.hf_weights import WeightLoader
from megarl.rollout.routing import RoutingRecorder
from megarl.rollout.shared_weights import SharedWeights, move_to_shared_memory, region_of

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Rollout:
    """One completion being generated."""

    request_index: int
    context: list[int]
    """Prompt + prefix: what the model reads before the first new token."""
    prefix: GenerateRequest
    max_new_tokens: int
    """New tokens allowed after the prefix."""
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    watcher: StopStringWatcher | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routing: list[torch.Tensor] = field(default_factory=list)
    """Experts chosen for the tokens fed so far [positions, moe_layers, topk] per forward (when recorded)."""

    def append(self, token_id: int, logprob: float, version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token_id in self.stop_ids or (self.watcher is not None and self.watcher.add(token_id)):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"

    def completion(self, weight_version: int, request_id: str | None) -> Completion:
        p = self.prefix
        return Completion(
            token_ids=[*p.prefix_ids, *self.token_ids],
            logprobs=[*p.prefix_logprobs, *self.logprobs],
            finish_reason=self.finish_reason or "abort",
            weight_version=weight_version,
            token_versions=[*p.prefix_versions, *self.versions],
            request_id=request_id,
            routed_experts=torch.cat(self.routing) if self.routing else None,
        )


class HFEngine(RolloutEngine):
    """`RolloutEngine` over a transformers causal LM loaded from a local HF folder."""

    def __init__(self, model_path: str | Path, config: HFEngineConfig | None = None, record_routing: bool = False):
        self.config = config or HFEngineConfig()
        self.config.check("rollout.hf")
        self.model_path = Path(model_path)
        self.device = _engine_device(self.config.device)
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)  # process-wide: the engine owns its process's threads
        self.model = self._build_model()
        # transformers renamed past_key_values to cache (warning on every forward under the old name)
        forward_parameters = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_parameters else "past_key_values"
        self.tokenizer = self._build_tokenizer()
        self.eos_token_ids = self._eos_token_ids()
        self.weights = WeightLoader(self.model)
        self.routing = self._routing_recorder() if record_routing else None
        if self._fp8 is not None:
            self._load_dequantized()
        self.weight_version = 0
        self._generator = torch.Generator().manual_seed(self.config.seed)  # seeds of unseeded requests
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._generating = False
        self._updating_to: int | None = None
        self._num_decode_steps = 0
        self._shared: tuple[object, int, SharedWeights] | None = None
        """(mapping, memfd, description) once the weights are in shared memory (`share_weights`)."""

    # ---- construction -------------------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from megarl.models.hf_config import load_hf_config

        if not (self.model_path / "config.json").is_file():
            raise UserError(f"hf engine: {self.model_path} is not a HF model folder (no config.json)")
        from megarl.bridge.fp8 import BlockFP8
        from megarl.models.registry import required_hf_attn_implementation

        dtype = getattr(torch, self.config.dtype)
        hf_config = load_hf_config(self.model_path)
        attn_implementation = required_hf_attn_implementation(hf_config) or self.config.attn_implementation
        self._fp8 = BlockFP8.of_folder(self.model_path)
        if not any(self.model_path.glob("*.safetensors")) or self._fp8 is not None:
            # A config-only folder (a megarl checkpoint's hf/): the weights arrive with the first weight sync. An
            # FP8 checkpoint: built unquantized, its weights read dequantized next (transformers' FP8 needs a GPU).
            config = hf_config
            config._attn_implementation = attn_implementation
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path,
                config=hf_config,  # aliased model_types (Kimi K2) as their family's
                dtype=dtype,
                attn_implementation=attn_implementation,
                local_files_only=True,
            )
        return model.eval().requires_grad_(False).to(self.device)

    def _routing_recorder(self) -> RoutingRecorder | None:
        """Records the experts of every token fed (R3: megarl/rollout/routing.py); None for a dense model."""
        from megarl.models.registry import routing_layout

        layout = routing_layout(self.model.config)
        return RoutingRecorder(self.model, layout) if layout is not None else None

    def _load_dequantized(self) -> None:
        """The weights of an FP8 checkpoint, dequantized (megarl.bridge.fp8) into the model, one tensor at a time."""
        from megarl.bridge.safetensors_io import HFCheckpoint

        checkpoint = HFCheckpoint(self.model_path, dequantize_to=getattr(torch, self.config.dtype))
        for name in checkpoint.names:
            self.weights.load([(name, checkpoint.get(name))])

    def _build_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except (OSError, ValueError) as err:  # a weights-only folder still generates; stop strings need a tokenizer
            logger.warning("hf engine: no tokenizer in %s (%s); stop strings are unavailable", self.model_path, err)
            return None

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation_config = getattr(self.model, "generation_config", None)
        for source in (getattr(generation_config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    # ---- generation ---------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        self._check_alive()
        sampling.check("sampling")
        self._check_requests(requests, sampling)
        with self._lock:
            self._check_alive()
            if self._updating_to is not None:
                raise RuntimeError(f"hf engine: generate called during the weight update to {self._updating_to}")
            self._abort.clear()  # abort() interrupts the generation in progress, not a later one
            self._generating = True
            try:
                rollouts = [self._new_rollouts(i, request, sampling) for i, request in enumerate(requests)]
                pending = [r for group in rollouts for r in group if r.finish_reason is None]
                # similar lengths share a round (less padding); samples of one request stay together (one prefill)
                pending.sort(key=lambda r: (len(r.context), r.request_index))
                size = self.config.max_batch_size
                with torch.inference_mode():
                    for start in range(0, len(pending), size):
                        if self._abort.is_set():
                            break
                        self._decode_round(pending[start : start + size], sampling)
            finally:
                self._generating = False
                self._abort.clear()
            version = self.weight_version
            return [[r.completion(version, req.request_id) for r in group] for req, group in zip(requests, rollouts)]

    def _check_requests(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> None:
        vocab_size = self.model.get_input_embeddings().num_embeddings
        for i, request in enumerate(requests):
            request.check(i)
            bad = [t for t in (*request.prompt_ids, *request.prefix_ids) if not 0 <= t < vocab_size]
            if bad:
                raise UserError(f"requests[{i}] holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if sampling.stop and self.tokenizer is None:
            raise UserError(f"sampling.stop={sampling.stop} needs a tokenizer, and {self.model_path} has none")

    def _new_rollouts(self, index: int, request: GenerateRequest, sampling: SamplingParams) -> list[_Rollout]:
        seed = request.seed
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=self._generator))
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        # the prefix counts towards max_new_tokens: a resumed rollout ends where the uninterrupted one would
        max_new_tokens = sampling.max_new_tokens - len(request.prefix_ids)
        rollouts = []
        for j in range(sampling.n):
            generator = None
            if sampling.temperature > 0:
                generator = torch.Generator().manual_seed(sample_seed(seed, j))
                for _ in request.prefix_ids:  # skip the prefix's draws: sampling continues the same stream
                    torch.rand(1, generator=generator, dtype=torch.float64)
            watcher = StopStringWatcher(self.tokenizer, sampling.stop, request.prefix_ids) if sampling.stop else None
            rollout = _Rollout(
                index, [*request.prompt_ids, *request.prefix_ids], request, max_new_tokens, stop_ids, generator, watcher
            )
            if max_new_tokens <= 0:
                rollout.finish_reason = "length"
            rollouts.append(rollout)
        return rollouts

    def _forward(self, input_ids_BL, attention_mask_BL, position_ids_BL, cache) -> torch.Tensor:
        """Logits of each row's last position [B, V]."""
        out = self.model(
            input_ids=input_ids_BL,
            attention_mask=attention_mask_BL,
            position_ids=position_ids_BL,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1]

    def _prefill(self, rollouts: list[_Rollout]):
        """Prefill each distinct context once, left-padded; expand to one cache row per rollout.
        Returns (cache, logits [B, V], attention mask [B, L], next position [B])."""
        from transformers import DynamicCache

        first_of: dict[int, int] = {}
        row_of_rollout = [first_of.setdefault(r.request_index, len(first_of)) for r in rollouts]
        contexts = [rollouts[row_of_rollout.index(u)].context for u in range(len(first_of))]
        length = max(len(c) for c in contexts)
        input_ids_UL = torch.zeros(len(contexts), length, dtype=torch.long)
        attention_mask_UL = torch.zeros(len(contexts), length, dtype=torch.long)
        for u, context in enumerate(contexts):
            input_ids_UL[u, length - len(context) :] = torch.tensor(context)
            attention_mask_UL[u, length - len(context) :] = 1
        position_ids_UL = (attention_mask_UL.cumsum(-1) - 1).clamp_(min=0)
        device = self.device
        input_ids_UL, attention_mask_UL, position_ids_UL = (
            input_ids_UL.to(device),
            attention_mask_UL.to(device),
            position_ids_UL.to(device),
        )
        cache = DynamicCache(config=self.model.config)
        logits_UV = self._forward(input_ids_UL, attention_mask_UL, position_ids_UL, cache)
        if self.routing is not None:  # each rollout gets its context's routing (left padding dropped)
            routed_UL = self.routing.take().view(len(contexts), length, *self.routing.layout_shape)
            for rollout, u in zip(rollouts, row_of_rollout):
                rollout.routing.append(routed_UL[u, length - len(rollout.context) :])
        rows_B = torch.tensor(row_of_rollout, device=device)
        if len(contexts) != len(rollouts):
            # reorder_cache selects rows like batch_select_indices, and every cache layer has it (the linear-
            # attention layers of hybrid models such as Qwen3-Next have no batch_select_indices)
            cache.reorder_cache(rows_B)
        return cache, logits_UV[rows_B], attention_mask_UL[rows_B], position_ids_UL[rows_B, -1] + 1

    def _decode_round(self, rollouts: list[_Rollout], sampling: SamplingParams) -> None:
        cache, logits_BV, attention_mask_BL, next_position_B = self._prefill(rollouts)
        active = rollouts
        while True:
            tokens_B, logprobs_B = sample_tokens(logits_BV, sampling, [r.generator for r in active])
            # the one host sync per step: stop tokens, stop strings and lengths are checked on the host
            tokens, logprobs = tokens_B.tolist(), logprobs_B.tolist()
            self._num_decode_steps += 1
            for rollout, token, logprob in zip(active, tokens, logprobs):
                rollout.append(token, logprob, self.weight_version)
            keep = [i for i, r in enumerate(active) if r.finish_reason is None]
            if not keep or self._abort.is_set():
                return  # unfinished rollouts read as aborted
            if len(keep) < len(active):  # finished rows leave the batch
                keep_B = torch.tensor(keep, device=self.device)
                cache.reorder_cache(keep_B)
                attention_mask_BL, next_position_B, tokens_B = (
                    attention_mask_BL[keep_B],
                    next_position_B[keep_B],
                    tokens_B[keep_B],
                )
                active = [active[i] for i in keep]
            attention_mask_BL = torch.cat([attention_mask_BL, attention_mask_BL.new_ones(len(active), 1)], dim=1)
            logits_BV = self._forward(tokens_B[:, None], attention_mask_BL, next_position_B[:, None], cache)
            next_position_B = next_position_B + 1
            if self.routing is not None:  # the routing of each row's token just fed
                routed_B = self.routing.take()
                for i, rollout in enumerate(active):
                    rollout.routing.append(routed_B[i : i + 1])

    def abort(self) -> None:
        """Interrupt the generate call in progress (checked before every decode step): its unfinished completions
        return with finish_reason `abort` and the tokens generated so far. No effect when nothing is generating."""
        if self._generating:
            self._abort.set()

    # ---- weights ------------------------------------------------------------------------------------------------
    def begin_weight_update(self, version: int) -> None:
        with self._lock:  # waits for a generate call in progress
            self._check_alive()
            if self._updating_to is not None:
                raise RuntimeError(f"hf engine: weight update to {self._updating_to} is still open")
            self.weights.reset()
            self._updating_to = version

    def apply_bucket(self, bucket: Bucket) -> None:
        with self._lock:
            if self._updating_to is None:
                raise RuntimeError("hf engine: apply_bucket outside begin_weight_update / finish_weight_update")
            self.weights.load(bucket)

    def share_weights(self, node_id: str) -> SharedWeights | None:
        """Move the weights into shared memory (once) for the trainer's ranks on this node to write them in place
        (megarl/rollout/shared_weights.py); None for an engine on a GPU (its roads are CUDA IPC and the object
        store)."""
        with self._lock:
            self._check_alive()
            if self.device.type != "cpu":
                return None
            if self._shared is None:
                mapping, fd, token = move_to_shared_memory(self.model, self.weights.targets())
                regions = {name: region_of(tensor) for name, tensor in self.weights.regions().items()}
                path = f"/proc/{os.getpid()}/fd/{fd}"
                self._shared = (mapping, fd, SharedWeights(node_id, path, len(mapping), token, regions))
                logger.info("hf engine: weights in shared memory (%.2f GB, %s)", len(mapping) / 1e9, path)
            return self._shared[2]

    @property
    def shared_weights(self) -> SharedWeights | None:
        """The description `share_weights` returned, once the weights are in shared memory (None before)."""
        return None if self._shared is None else self._shared[2]

    def apply_shared_writes(self, names: list[str]) -> None:
        """Count the entries a sending rank wrote into the shared weights itself (checked as `apply_bucket` checks a
        bucket's)."""
        with self._lock:
            if self._updating_to is None:
                raise RuntimeError("hf engine: shared weights written outside a weight update (begin .. finish)")
            self.weights.record_written(names)

    def finish_weight_update(self, version: int) -> None:
        with self._lock:
            if self._updating_to != version:
                raise RuntimeError(
                    f"hf engine: finish_weight_update({version}) but the open update is to {self._updating_to}"
                )
            self._updating_to = None
            counts, missing = self.weights.counts, self.weights.missing()
            if missing and self.config.strict_weight_sync:
                raise UserError(
                    f"weight update to version {version} left {len(missing)} of {len(self.weights.names)} checkpoint "
                    f"tensors unsent (first: {missing[:3]}); the export stream must cover the whole checkpoint "
                    "(or set rollout.hf.strict_weight_sync=false for partial updates)"
                )
            self.weight_version = version
            logger.info(
                "hf engine: weights v%d (%d tensors loaded, %d skipped)",
                version,
                counts.num_tensors,
                counts.num_skipped,
            )

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def verify_weights(self, expected: Bucket) -> list[str]:
        params = dict(self.model.named_parameters())
        problems = []
        for name, tensor in expected:
            held = params.get(name)
            if held is None:
                problems.append(f"{name}: not a parameter of the engine's model")
            elif not torch.equal(held.detach().cpu(), tensor.to(held.dtype).cpu()):
                problems.append(f"{name}: the engine holds other values than the trainer sent")
        return problems

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.model is not None,
            "weight_version": self.weight_version,
            "generating": self._generating,
            "updating": self._updating_to is not None,
            "num_decode_steps": self._num_decode_steps,
        }

    def flush_cache(self) -> None:
        """No-op: KV caches live only inside one generate call, so none outlives a weight update."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """On a GPU, "weights" moves the model to host memory (KV caches live only inside a generate call, so
        "kv_cache" has nothing to free). On the CPU the weights stay in host memory, shared with a colocated
        trainer anyway: a no-op."""
        if self.device.type == "cuda" and "weights" in (tags or MEMORY_TAGS):
            with self._lock:
                self.model.to("cpu")  # parameters keep their identity: the weight loader's views stay valid
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        if self.device.type == "cuda" and "weights" in (tags or MEMORY_TAGS):
            with self._lock:
                self.model.to(self.device)

    def shutdown(self) -> None:
        self.abort()
        with self._lock:
            self.model = None
            self.weights = None
            if self._shared is not None:  # the memory is freed once no sending rank maps it either
                os.close(self._shared[1])
                self._shared = None

    def _check_alive(self) -> None:
        if self.model is None:
            raise RuntimeError("hf engine: used after shutdown()")


def _engine_device(choice: str) -> torch.device:
    """rollout.hf.device: auto takes this process's GPU (a rollout worker sees the one Ray gave it) if any."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("rollout.hf.device=cuda, but this rollout worker sees no CUDA device; use auto or cpu")
    return torch.device("cuda", torch.cuda.current_device())
