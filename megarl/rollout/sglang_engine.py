"""The `sglang` rollout engine: one SGLang HTTP server per engine, driven through its native API.

Generation is one batched POST /generate with `input_ids` (no text, no chat templates: tokenization happens before
the engine). Each completion is its own batch item with n=1, so every sample can carry its own seed and request id;
SGLang's radix cache shares the prompt's prefill between the samples of a group. Results come back in item order:
`output_ids` (every generated token, including the EOS / stop token and the tokens that completed a stop string:
SGLang trims those from `text` only) and `meta_info` with `finish_reason` ({"type": "stop" | "length" | "abort",
...}), `output_token_logprobs` ([logprob, token_id, text] per output token) and `weight_version` (the version last
set with /update_weight_version, plus `weight_versions` spans when a request ran across an update).

**Sampling parameters** map one to one: temperature, top_p, top_k (megarl's -1 / 0 -> SGLang's -1: whole vocabulary),
max_new_tokens, stop, stop_token_ids, ignore_eos. Seeds: SGLang takes `sampling_params.sampling_seed` per request
(sglang 0.5.23, `srt/sampling/sampling_params.py`) and uses it only when the server runs with
--enable-deterministic-inference (`srt/sampling/sampling_batch_info.py`; otherwise every request shares the
server's RNG), where it samples with a hash of (seed, position): SGLangEngineConfig.deterministic. Sample j of a
request with seed s gets `sample_seed(s, j)`; an unseeded request draws s from the engine's own generator, since
deterministic SGLang would otherwise give every unseeded request the same default seed (42), making all samples of a
group identical. A resumed request keeps its seed: SGLang hashes (seed, position), so it continues the same stream.

**Log-probs.** megarl's convention is log_softmax(logits / temperature) before top-k / top-p truncation. SGLang's
sampler (`srt/layers/sampler.py`, Sampler.forward) divides the logits by the temperature in place, takes the softmax,
and returns log(probs) of that distribution: computed before top-k / top-p / min-p filtering (the filters work on
copies). So SGLang's returned output log-probs are temperature-scaled and untruncated, which is megarl's convention,
provided that:
- SGLANG_RETURN_ORIGINAL_LOGPROB is not set (it switches to log_softmax(logits), before temperature): the launcher
  removes it from the server's environment;
- temperature 0 (greedy): SGLang turns it into temperature 1 with top_k 1, so the log-probs are log_softmax(logits);
- no penalties or logit bias (megarl sends none; SGLang would apply them before the softmax);
- with --enable-deterministic-inference they come from log_softmax (same values); with --rl-on-policy-target they are
  computed in bfloat16, which changes precision, not the convention. Speculative decoding is not used here.

**Partial rollouts.** A request with `prefix_ids` is sent as prompt + prefix; the completion is prefix + new tokens,
with the prefix's recorded log-probs and versions, and the prefix counts against max_new_tokens (a completion never
exceeds it; a prefix that already fills it comes back at once with finish_reason `length`).

**Weight updates** (begin / apply buckets / finish, see sglang_weights): pause generation (SGLangEngineConfig.
pause_mode), open SGLang's weight-update session (/begin_weight_update, absent on older SGLang), load the buckets
(from this process by update_weights_from_tensor, or sent by the trainer's ranks directly: workers/weight_sync.py),
close the session, set the version, flush the radix cache (always), continue generation. A server started on dummy
weights, or left with a partial update (a refused bucket, a sync abandoned by the trainer), refuses to generate
until an update completes; `verify_weights` compares SGLang's own checksums with the tensors sent. A delta bucket
(rollout.weight_sync_delta) goes to megarl's delta loader on the server (megarl/rollout/sglang_delta.py, given to
every server as --custom-weight-loader); one the engine refuses fails the update like any refused bucket.

**Routed experts** (MoE models, `record_routing`): the server runs with --enable-return-routed-experts, each
/generate body asks for `return_routed_experts`, and each item's `meta_info["routed_experts"]` (base64 int32 rows
[prompt + output - 1, decoder layers, topk]) becomes the completion's `routed_experts` (megarl/rollout/routing.py).

**Context window.** SGLang fails a whole batch when one item does not fit its context window; every item is fitted
before it is sent (build_generate_payload: max_new_tokens clamped, items with no room left out and counted).

**GPUs.** An engine launched with `gpu_ids` (a tp > 1 engine: the rollout worker sees all of its node's GPUs and
gets its engine's ids from the driver) runs its server on exactly those GPUs; the colocated transport then puts
tensor-parallel rank r's payload on the engine's GPU r (where SGLang runs rank r: --base-gpu-id 0, step 1), numbered
as this process sees it (`visible_device_index`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megarl.errors import UserError
from megarl.models.moe import RoutingLayout
from megarl.rollout.config import SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import Bucket, Completion, FinishReason, GenerateRequest, RolloutEngine, sample_seed
from megarl.rollout.routing import decode_sglang_routing, engine_routing_layout
from megarl.rollout.sglang_client import SGLangClient, SGLangError
from megarl.rollout.sglang_model import context_length_of, served_dtype
from megarl.rollout.sglang_server import (
    NodePlace,
    SGLangServer,
    build_server_command,
    build_server_env,
    find_free_port,
    has_weight_files,
    url_of,
)
from megarl.rollout.sglang_weights import Serializer, SGLangEndpoint, send_flattened_bucket, sglang_serializer

__all__ = [
    "SGLangEngine",
    "Slot",
    "build_generate_payload",
    "parse_completion",
    "visible_device_index",
]

logger = logging.getLogger(__name__)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class Slot:
    """Where one batch item of a /generate call comes from."""

    request_index: int
    sample_index: int
    max_new_tokens: int
    """New tokens this item may still generate (max_new_tokens minus the prefix, fitted into the context)."""
    dropped: bool = False
    """Not sent: prompt and prefix already fill the server's context window (the completion ends at once, with
    finish_reason `length`)."""


def sampling_params_of(sampling: SamplingParams, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
    """One item's `sampling_params` under SGLang's names (its JSON contract rejects unknown keys)."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def build_generate_payload(
    requests: Sequence[GenerateRequest],
    sampling: SamplingParams,
    draw_seed: Callable[[], int] | None = None,
    context_len: int | None = None,
) -> tuple[dict[str, Any] | None, list[Slot]]:
    """The /generate body for `sampling.n` samples of each request, and where each item came from.

    Sample j of a request with seed s gets `sample_seed(s, j)`; an unseeded request draws s from `draw_seed()`
    (None: its samples get no seed). Samples whose prefix already
    fills max_new_tokens are left out of the body (their Slot has max_new_tokens 0); the body is None when none is
    left. With `context_len`, every item is fitted into the server's context window before it is sent, as SGLang
    checks it (input >= context_len, or input + max_new_tokens > context_len, fails the whole batch with HTTP 400):
    max_new_tokens is clamped to what is left, and a request with no room left is not sent (Slot.dropped).
    """
    input_ids, params, rids, slots = [], [], [], []
    for i, request in enumerate(requests):
        request.check(i)
        tokens = list(request.prompt_ids) + list(request.prefix_ids)
        # the prefix counts towards max_new_tokens: a resumed rollout ends where the uninterrupted one would
        budget = sampling.max_new_tokens - len(request.prefix_ids)
        dropped = context_len is not None and len(tokens) >= context_len
        if context_len is not None:
            budget = 0 if dropped else min(budget, context_len - len(tokens))
        base = request.request_id if request.request_id is not None else uuid.uuid4().hex
        seed = request.seed if request.seed is not None or draw_seed is None else draw_seed()
        for j in range(sampling.n):
            slots.append(Slot(i, j, max(budget, 0), dropped))
            if budget <= 0:
                continue
            input_ids.append(tokens)
            params.append(sampling_params_of(sampling, budget, None if seed is None else sample_seed(seed, j)))
            rids.append(f"{base}/{j}")
    if len(set(rids)) != len(rids):
        duplicates = sorted({r.rsplit("/", 1)[0] for r in rids if rids.count(r) > 1})
        raise UserError(f"request ids must be unique within a generate call; repeated: {duplicates}")
    if not input_ids:
        return None, slots
    return {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rids}, slots


def bucket_label(bucket: Bucket) -> str:
    """A bucket as an error message names it: its first tensor, and how many more."""
    if not bucket:
        return "(empty)"
    first = bucket[0][0]
    return first if len(bucket) == 1 else f"{first} (+{len(bucket) - 1} more)"


def sglang_checksum(tensor: torch.Tensor) -> str | None:
    """SGLang's checksum of a parameter as its weights checker reports it (`f"{tensor_hash(t):016x}"`, sglang
    0.5.23 srt/utils/weight_checker.py): sha256 of the bytes on CPU, its own GPU kernel on CUDA tensors. None where
    SGLang cannot be imported (the check is then skipped with a warning)."""
    try:
        from sglang.srt.managers.mm_utils import tensor_hash
    except Exception:  # not installed, or its imports fail here: verification is skipped, not the run
        return None
    return f"{tensor_hash(tensor.detach().contiguous()):016x}"


def visible_device_index(gpu_id: int | str, visible_devices: str | None) -> int:
    """The CUDA device index under which this process sees GPU `gpu_id`.

    `gpu_id` is as Ray gives it (an entry of the node's CUDA_VISIBLE_DEVICES, or the node's device index when that is
    unset); `visible_devices` is this process's CUDA_VISIBLE_DEVICES: when set, the index is the id's position in
    it, else the id is the index.
    """
    if visible_devices is None:
        try:
            return int(gpu_id)
        except ValueError:
            raise ValueError(f"GPU id {gpu_id!r} is not a device index and CUDA_VISIBLE_DEVICES is unset") from None
    entries = [entry.strip() for entry in visible_devices.split(",")]
    if str(gpu_id).strip() not in entries:
        raise ValueError(
            f"GPU {gpu_id} is not visible to this process (CUDA_VISIBLE_DEVICES={visible_devices!r}): a worker driving "
            f"a multi-GPU engine must see its node's GPUs (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1)"
        )
    return entries.index(str(gpu_id).strip())


def _version_of(value: Any, default: int) -> int:
    """SGLang's weight version (a string) as megarl's integer; anything else (e.g. its initial "default") -> default."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def parse_completion(
    item: dict[str, Any], request: GenerateRequest, current_version: int, routing: RoutingLayout | None = None
) -> Completion:
    """One /generate result item as a Completion (prefix included). Raises SGLangError on a malformed item.
    `routing`: decode the item's routed experts (meta_info["routed_experts"]) for this model's MoE layers."""
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
        finish = meta["finish_reason"]
        entries = meta.get("output_token_logprobs") or []
    except (KeyError, TypeError) as e:
        raise SGLangError(f"unexpected /generate result (missing {e}): {str(item)[:300]}") from None
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in _FINISH_REASONS:
        raise SGLangError(f"unexpected finish_reason {finish!r} for request {meta.get('id')!r}")
    if len(entries) != len(output_ids) or any(int(e[1]) != t for e, t in zip(entries, output_ids)):
        raise SGLangError(
            f"request {meta.get('id')!r}: {len(entries)} output log-probs do not match its {len(output_ids)} "
            f"output tokens"
        )
    logprobs = [float(e[0]) for e in entries]
    version = _version_of(meta.get("weight_version"), current_version)
    token_versions = [version] * len(output_ids)
    for span in meta.get("weight_versions") or []:
        span_version = _version_of(span.get("version"), current_version)
        for t in range(int(span["start"]), min(int(span["end"]), len(output_ids))):
            token_versions[t] = span_version
    return Completion(
        token_ids=list(request.prefix_ids) + output_ids,
        logprobs=list(request.prefix_logprobs) + logprobs,
        finish_reason=_FINISH_REASONS[finish_type],
        weight_version=version,
        token_versions=list(request.prefix_versions) + token_versions,
        request_id=request.request_id,
        routed_experts=_routed_experts(meta, routing),
    )


def _routed_experts(meta: dict[str, Any], routing: RoutingLayout | None) -> torch.Tensor | None:
    """The item's routed experts, decoded; None when not asked for or not returned (the trainer then says so)."""
    if routing is None or not meta.get("routed_experts"):
        return None
    try:
        return decode_sglang_routing(meta["routed_experts"], routing)
    except ValueError as e:
        raise SGLangError(f"request {meta.get('id')!r}: {e}") from None


def _prefix_only(request: GenerateRequest, version: int) -> Completion:
    """A resumed request whose prefix already used up max_new_tokens."""
    return Completion(
        token_ids=list(request.prefix_ids),
        logprobs=list(request.prefix_logprobs),
        finish_reason="length",
        weight_version=version,
        token_versions=list(request.prefix_versions),
        request_id=request.request_id,
    )


class SGLangEngine(RolloutEngine):
    """A RolloutEngine backed by one SGLang server.

    Without `url`, launches the server on this machine (`gpu_ids`, or the GPUs this process sees) listening on
    `host` (the node's address when a trainer on another node sends weights; `port` None picks a free one) and waits
    until it is healthy; with `url`, drives a server that is already running. `weight_sync` says how weights arrive:
    `tensor` (colocated: apply_bucket sends CUDA IPC handles from this process) or `distributed` (split placement:
    an SGLangWeightSender on the trainer broadcasts them; pass `endpoint` to it). The IPC handles point at
    `ipc_device` (default: the engine's first GPU given `gpu_ids`, else the current CUDA device); given `gpu_ids`
    and no `ipc_device`, each tensor-parallel rank gets a copy on its own GPU (`ipc_rank_devices`).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        config: SGLangEngineConfig,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        gpu_ids: Sequence[int | str] | None = None,
        log_path: str | os.PathLike | None = None,
        url: str | None = None,
        weight_sync: Literal["tensor", "distributed"] = "tensor",
        serializer: Serializer = sglang_serializer,
        ipc_device: torch.device | str | None = None,
        load_format: str | None = None,
        advertise_host: str | None = None,
        quantization: dict | None = None,
        node: NodePlace | None = None,
        startup_watch: Callable[[], None] | None = None,
        record_routing: bool = False,
    ) -> None:
        self.model_path = str(model_path)
        self.routing = engine_routing_layout("auto", model_path) if record_routing else None
        """What the server records of each token's routed experts (MoE models; None: nothing)."""
        self.config = config
        self.weight_sync = weight_sync
        self.serializer = serializer
        self.ipc_rank_devices: list[torch.device] | None = None
        """Where tensor-parallel rank r's IPC payload lies (the engine's GPU r); None: every rank reads ipc_device."""
        if ipc_device is None and gpu_ids is not None and weight_sync == "tensor":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.ipc_rank_devices = [torch.device("cuda", visible_device_index(i, visible)) for i in gpu_ids]
            ipc_device = self.ipc_rank_devices[0]
        elif ipc_device is None and torch.cuda.is_available():
            ipc_device = torch.device("cuda", torch.cuda.current_device())
        self.ipc_device = ipc_device
        self.weight_version = 0
        # a server launched here on a folder without weights starts with dummy ones (url given: already running)
        if load_format is None and url is None and not has_weight_files(self.model_path):
            load_format = "dummy"
        self.load_format = load_format
        self.not_serving: str | None = None
        """Why generate is refused (None: serving): no weights yet, or a weight update that did not complete."""
        if self.load_format == "dummy":
            self.not_serving = (
                "it started with dummy weights (--load-format dummy: the trainer's first sync loads them) and no "
                "weight sync has completed yet"
            )
        self.context_len = config.context_length or context_length_of(self.model_path)
        self.num_dropped = 0
        """Requests not sent because their prompt (and prefix) filled the context window, since start."""
        self._sessions = True
        self._rng = random.Random(config.random_seed)
        self.server: SGLangServer | None = None
        if url is None:
            port = port or find_free_port(host)
            url = url_of(host, port)
            self.server = SGLangServer(
                build_server_command(
                    config,
                    self.model_path,
                    host=host,
                    port=port,
                    load_format=self.load_format,
                    quantization=quantization,
                    node=node or NodePlace(),
                    return_routed_experts=self.routing is not None,
                ),
                url,
                env=build_server_env(config, gpu_ids, nnodes=(node or NodePlace()).nnodes),
                log_path=log_path,
                startup_timeout_s=config.startup_timeout_s,
                watch=startup_watch,
            ).start()
        self.url = url
        self.advertised_url = url_of(advertise_host, int(url.rsplit(":", 1)[1])) if advertise_host else url
        """The URL other nodes reach the server at (a trainer's weight sender)."""
        self.client = SGLangClient(
            url, control_timeout_s=config.control_timeout_s, health_timeout_s=config.health_timeout_s
        )

    @property
    def endpoint(self) -> SGLangEndpoint:
        """This engine as an SGLangWeightSender sees it."""
        return SGLangEndpoint(self.advertised_url, self.config.num_gpus())

    def device_uuids(self) -> list[str]:
        """The GPUs the server runs on (its TP ranks' devices), for actor ranks that send it CUDA IPC handles."""
        from megarl.workers.bucket_transport import device_uuid

        if self.ipc_rank_devices is not None:
            return [device_uuid(d) for d in self.ipc_rank_devices]
        return [device_uuid(torch.device(self.ipc_device))] if self.ipc_device is not None else []

    def abandon_weight_update(self, reason: str) -> None:
        """The trainer gave up on an update after some buckets may have landed: stop serving, close the session."""
        self._quarantine(f"a weight update was abandoned ({reason})")

    def _quarantine(self, why: str) -> None:
        """The server may hold a mix of old and new weights: refuse to generate until a complete update, and close
        its weight-update session (a failure there must not hide the error that led here)."""
        self.not_serving = f"{why}; it holds mixed weights"
        if self._sessions:
            with contextlib.suppress(Exception):
                self.client.end_weight_update()

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        if self.not_serving is not None:
            raise SGLangError(f"SGLang engine {self.url} refuses to generate: {self.not_serving}", url=self.url)
        payload, slots = build_generate_payload(requests, sampling, self._draw_seed, self.context_len)
        if payload is not None and self.routing is not None:
            payload["return_routed_experts"] = True
        dropped = sum(slot.dropped for slot in slots)
        if dropped:
            self.num_dropped += dropped
            logger.warning(
                "%d of %d samples not sent to %s: prompt and prefix fill its %d-token context window (%d so far)",
                dropped,
                len(slots),
                self.url,
                self.context_len,
                self.num_dropped,
            )
        items: list[Any] = []
        if payload is not None:
            items = self._call(self.client.generate, payload, self.config.request_timeout_s)
            if isinstance(items, dict):
                items = [items]
            if not isinstance(items, list) or len(items) != len(payload["input_ids"]):
                raise SGLangError(
                    f"SGLang {self.url}/generate answered {type(items).__name__} "
                    f"{len(items) if isinstance(items, list) else ''} for {len(payload['input_ids'])} items"
                )
        results: list[list[Completion]] = [[] for _ in requests]
        sent = iter(items)
        for slot in slots:
            request = requests[slot.request_index]
            if slot.max_new_tokens == 0:
                results[slot.request_index].append(_prefix_only(request, self.weight_version))
            else:
                completion = parse_completion(next(sent), request, self.weight_version, self.routing)
                results[slot.request_index].append(completion)
        return results

    def _draw_seed(self) -> int:
        return self._rng.getrandbits(63)

    def abort(self) -> None:
        self._call(self.client.abort_all)

    # ---- weights ---------------------------------------------------------------------------------------------------
    def begin_weight_update(self, version: int) -> None:
        self._call(self.client.pause_generation, self.config.pause_mode)
        self._sessions = self._call(self.client.begin_weight_update)

    def apply_bucket(self, bucket: Bucket) -> None:
        if self.weight_sync != "tensor":
            raise RuntimeError(
                "SGLangEngine.apply_bucket is the colocated path (weight_sync='tensor'); with weight_sync="
                f"'{self.weight_sync}' the trainer's SGLangWeightSender broadcasts the buckets to {self.url}"
            )
        with self.update_guard(bucket):
            self._call(
                send_flattened_bucket,
                self.client,
                bucket,
                num_ranks=self.config.num_gpus(),
                serializer=self.serializer,
                device=self.ipc_device,
                rank_devices=self.ipc_rank_devices,
            )

    def load_weights_from_disk(self, folder: str) -> tuple[int, int]:
        """The disk transport: SGLang's ranks, on every node of the engine, read the folder the trainer wrote."""
        from megarl.bridge.safetensors_io import read_header

        files = sorted(Path(folder).glob("*.safetensors"))
        specs = [(name, entry) for path in files for name, entry in read_header(path)[0].items()]
        with self.update_guard([(name, None) for name, _ in specs]):
            self._call(self.client.update_weights_from_disk, str(folder))
        return len(specs), sum(entry["data_offsets"][1] - entry["data_offsets"][0] for _, entry in specs)

    @contextlib.contextmanager
    def update_guard(self, bucket: Bucket):
        """Around loading one bucket (by any transport): if it fails, the engine holds a mix of old and new weights,
        so it stops serving until a complete update succeeds, its weight-update session is closed, and the error
        names the first tensor of the bucket SGLang refused."""
        try:
            yield
        except Exception as e:
            self._quarantine(f"a weight update failed at bucket {bucket_label(bucket)}")
            raise SGLangError(
                f"SGLang {self.url} refused weight bucket {bucket_label(bucket)}: {e}. The engine now refuses to "
                f"generate until a complete weight update succeeds",
                url=self.url,
                status=getattr(e, "status", None),
            ) from e

    def finish_weight_update(self, version: int) -> None:
        if self._sessions:
            self._call(self.client.end_weight_update)
        self._call(self.client.update_weight_version, str(version))
        # always: cached prefixes were computed with the old weights (pause_mode never keeps requests in place)
        self._call(self.client.flush_cache)
        self._call(self.client.continue_generation)
        self.weight_version = version
        self.not_serving = None

    def flush_cache(self) -> None:
        self._call(self.client.flush_cache)

    def verify_weights(self, expected: Bucket) -> list[str]:
        """Compare SGLang's own checksums of its parameters (its weights checker, every TP rank) with checksums of
        the tensors the trainer sent, computed by SGLang's hash function on this node's GPU in the server's dtype."""
        if not expected:
            return []
        dtype = served_dtype(self.config, self.model_path)
        device = self.ipc_device if self.ipc_device is not None else "cpu"
        wanted = {name: sglang_checksum(tensor.to(device=device, dtype=dtype)) for name, tensor in expected}
        if None in wanted.values():
            logger.warning("weights of %s not verified: SGLang's hash function cannot be imported here", self.url)
            return []
        problems = []
        for rank, held in enumerate(self._call(self.client.weight_checksums)):
            checksums = held.get("checksums", {})
            for name, want in wanted.items():
                got = checksums.get(name)
                if got is None:
                    problems.append(f"{name}: not among the weights of SGLang {self.url} (rank {rank})")
                elif got != want:
                    problems.append(
                        f"{name}: SGLang {self.url} rank {rank} holds checksum {got}, the trainer sent {want}"
                    )
        return problems

    # ---- memory (colocated training) -------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (SGLang tags: weights, kv_cache, cuda_graph; None: all). Call only with no generation in
        flight: SGLang requires an idle server."""
        self._require_memory_saver()
        self._call(self.client.release_memory_occupation, list(tags) if tags is not None else None)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._require_memory_saver()
        self._call(self.client.resume_memory_occupation, list(tags) if tags is not None else None)

    def _require_memory_saver(self) -> None:
        if not self.config.enable_memory_saver:
            raise UserError(
                "release_memory / resume_memory need the SGLang server started with --enable-memory-saver: "
                "set rollout.sglang.enable_memory_saver=true"
            )

    # ---- health and lifetime ---------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        info: dict[str, Any] = {"ok": False, "weight_version": self.weight_version, "url": self.url}
        if self.server is not None and not self.server.is_alive():
            info["error"] = f"server process exited with code {self.server.process.returncode}"
            return info
        try:
            self.client.health()
            info["ok"] = True
        except SGLangError as e:
            info["error"] = str(e)
        return info

    def health_probe(self, timeout_s: float) -> None:
        """GET /health_generate: the server generates one token (queued behind requests in flight)."""
        self._call(self.client.health_generate, timeout_s)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _call(self, fn, *args, **kwargs):
        """Run one call on the server; if it fails because the server process died, say so (exit code, log tail)."""
        try:
            return fn(*args, **kwargs)
        except SGLangError as e:
            if self.server is not None:  # no HTTP status: the connection failed, maybe because the server is dying
                self.server.check_alive("during the call", wait_s=2.0 if e.status is None else 0.0)
            raise
