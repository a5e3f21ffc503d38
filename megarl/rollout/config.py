"""Rollout settings: sampling and the engine backends. Imports nothing heavy (the config loader reads it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from megarl.errors import UserError

MANAGED_ARGS = {
    "model_path": "the rollout model",
    "host": "the engine's address",
    "port": "the engine's address",
    "base_gpu_id": "the engine's GPUs",
    "gpu_id_step": "the engine's GPUs",
    "tp_size": "tp",
    "attn_dp_size": "dp with enable_dp_attention",
    "dp_size": "dp with enable_dp_attention",
    "enable_dp_attention": "enable_dp_attention",
    "ep_size": "ep",
    "mem_fraction_static": "mem_fraction_static",
    "dtype": "dtype",
    "trust_remote_code": "trust_remote_code",
    "random_seed": "random_seed",
    "enable_deterministic_inference": "deterministic",
    "enable_memory_saver": "enable_memory_saver",
    "skip_server_warmup": "skip_server_warmup",
    "load_format": "the rollout model (dummy when it has no weight files: the first sync loads them)",
    "context_length": "context_length",
    "nnodes": "the engine's nodes",
    "node_rank": "the engine's nodes",
    "dist_init_addr": "the engine's nodes",
    "custom_weight_loader": "megarl's delta loader (rollout.weight_sync_delta)",
}
"""ServerArgs names the engine sets from its own settings (SGLang's name -> the setting that controls it)."""
DELTA_LOADER = "megarl.rollout.sglang_delta.load_delta_bucket"
"""SGLang's --custom-weight-loader for delta buckets (megarl/rollout/sglang_delta.py): the load_format they are
posted with."""
UNKNOWN_FAMILY = "the model's family is not known here"
SGLANG_DELTA_ROADS = ("ipc", "object_store")
"""rollout.weight_sync roads on which SGLang engines take delta buckets (update_weights_from_tensor, the only road
that calls --custom-weight-loader)."""


@dataclass
class SamplingParams:
    """How completions are sampled. Log-probs are always those of the sampling distribution at `temperature`
    before top-k / top-p truncation (what the Megatron actor recomputes)."""

    n: int = 1
    """Completions per prompt (a GRPO group)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0 keeps all."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    max_new_tokens: int = 256
    """Longest completion, in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the decoded completion contains one (the tokens that completed it are
    kept)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (kept in the completion), in addition to the tokenizer's EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    def check(self, key: str) -> None:
        if self.n < 1:
            raise UserError(f"{key}.n={self.n} must be >= 1")
        if self.temperature < 0:
            raise UserError(f"{key}.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"{key}.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise UserError(f"{key}.max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass
class HFEngineConfig:
    """The embedded transformers engine (CPU default)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype of the engine's model."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine computes; auto: the rollout worker's GPU when it has one, else the CPU."""
    max_batch_size: int = 64
    """Most sequences decoded together in one forward pass; larger requests run in several rounds."""
    num_threads: int = 0
    """torch intra-op threads of the engine process; 0 keeps torch's default."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers attention kernel of the engine's model (gpt-oss runs eager: transformers has no sdpa for it)."""
    seed: int = 0
    """Seed of the engine's generator, from which requests without a seed draw theirs."""
    strict_weight_sync: bool = True
    """finish_weight_update fails unless every checkpoint tensor arrived since begin_weight_update; false accepts
    partial updates (tensors not sent keep their old values)."""
    hybrid: Literal["auto", "on", "off"] = "auto"
    """Run the engine inside the actor's worker process (verl's hybrid engine): generation computes on the actor's
    own thread and the weight sync is an in-process copy, with no Ray call or host copy between them. Possible
    with placement.mode=colocated, one-GPU engines (rollout.gpus_per_engine=1: each actor worker hosts one) and
    rollout.weight_sync=auto (megarl/job.py `hybrid_engine`). auto: whenever possible on a machine without CUDA
    (a local Ray instance; on GPUs it has not run yet); on: also on GPUs, and refuse a job where it is not
    possible; off: the engine has a worker of its own."""

    def check(self, key: str) -> None:
        if self.max_batch_size < 1:
            raise UserError(f"{key}.max_batch_size={self.max_batch_size} must be >= 1")
        if self.num_threads < 0:
            raise UserError(f"{key}.num_threads={self.num_threads} must be >= 0 (0 keeps torch's default)")


@dataclass
class SGLangEngineConfig:
    """One SGLang HTTP server per rollout engine (GPU clusters), launched by the rollout worker on its GPUs.

    Flags are those of SGLang's `ServerArgs` (checked against sglang 0.5.23); unset values keep SGLang's defaults.
    One engine uses `tp` GPUs: DP attention and expert parallelism live inside them."""

    tp: int = 1
    """Tensor-parallel size of one engine, i.e. the GPUs it uses (SGLang's --tp-size)."""
    dp: int = 1
    """Attention data-parallel groups inside the engine's `tp` GPUs (SGLang's --attn-dp-size); needs
    enable_dp_attention. SGLang cannot update the weights of data-parallel replicas: scale out with more engines."""
    ep: int = 1
    """Expert-parallel size inside one engine (SGLang's --ep-size); must divide tp."""
    enable_dp_attention: bool = False
    """DP attention (DeepSeek-style MLA serving): `dp` attention groups share the tensor-parallel FFN."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory SGLang reserves for weights and KV cache (0 < f < 1); lower it when colocated with
    training; None keeps SGLang's estimate."""
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    """Weights and compute dtype of the server (SGLang's --dtype); auto follows the checkpoint (fp32 -> fp16)."""
    trust_remote_code: bool = False
    """Let SGLang run model code shipped with the checkpoint."""
    random_seed: int | None = None
    """Server seed (SGLang's --random-seed); None lets SGLang choose."""
    deterministic: bool = False
    """SGLang's --enable-deterministic-inference: batch-invariant kernels and its pytorch sampling backend. Needed
    for per-request seeds (GenerateRequest.seed) to take effect: without it SGLang ignores them."""
    enable_memory_saver: bool = False
    """SGLang's --enable-memory-saver, needed by release_memory / resume_memory (engine colocated with training)."""
    pause_mode: Literal["abort", "retract"] = "abort"
    """How generation pauses for a weight update: `abort` returns unfinished completions (finish_reason abort) to be
    resumed as partial rollouts; `retract` keeps them in SGLang and recomputes them under the new weights. (SGLang's
    `in_place` is refused: it keeps old-weight KV entries that SGLang then cannot flush.)"""
    context_length: int | None = None
    """The server's context window in tokens (SGLang's --context-length); None: the checkpoint's
    max_position_embeddings. Requests are fitted into it before they are sent (see sglang_engine)."""
    port: int = 30000
    """HTTP port of the first engine on a node; engine k of a node uses port + k (open these between nodes)."""
    python: str | None = None
    """Interpreter that runs the server (`python -m sglang.launch_server`), e.g. a separate environment or a
    container's python with SGLang's pinned torch; None: the rollout worker's own interpreter."""
    skip_server_warmup: bool = True
    """Skip SGLang's warm-up request at start-up (readiness is probed with /health_generate instead)."""
    extra_args: dict[str, str] = field(default_factory=dict)
    """Further server arguments by ServerArgs name (e.g. {"chunked_prefill_size": "8192"}); "true" or "" gives a
    bare switch, "false" leaves it out."""
    startup_timeout_s: float = 600.0
    """How long to wait for the server to become healthy, in seconds."""
    request_timeout_s: float = 3600.0
    """Longest wait for one generate call, in seconds."""
    control_timeout_s: float = 600.0
    """Longest wait for one control call (weight update, pause, flush, memory release / resume), in seconds."""
    health_timeout_s: float = 5.0
    """Longest wait for one health probe, in seconds."""

    def num_gpus(self) -> int:
        """GPUs one engine occupies."""
        return self.tp

    def check(self, key: str) -> None:
        import warnings

        def divisors(n: int) -> str:
            return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

        for axis in ("tp", "dp", "ep"):
            if getattr(self, axis) < 1:
                raise UserError(f"{key}.{axis}={getattr(self, axis)} must be >= 1")
        if self.tp % self.ep:
            raise UserError(f"{key}.ep={self.ep} must divide {key}.tp={self.tp}; valid: {divisors(self.tp)}")
        if self.dp > 1 and not self.enable_dp_attention:
            raise UserError(
                f"{key}.dp={self.dp} without {key}.enable_dp_attention: SGLang cannot update the weights of "
                f"data-parallel replicas; run more engines instead, or set {key}.enable_dp_attention=true"
            )
        if self.enable_dp_attention and self.tp % self.dp:
            raise UserError(
                f"{key}.dp={self.dp} must divide {key}.tp={self.tp} with DP attention; valid: {divisors(self.tp)}"
            )
        if self.enable_dp_attention and self.dp == 1:
            warnings.warn(f"{key}.enable_dp_attention has no effect with {key}.dp=1", stacklevel=2)
        if self.pause_mode not in ("abort", "retract"):
            raise UserError(
                f"{key}.pause_mode={self.pause_mode!r}: valid are abort, retract (SGLang's in_place pause keeps KV "
                f"entries computed with the old weights and cannot flush them after the update)"
            )
        if not 1024 <= self.port <= 65535 - 200:
            raise UserError(f"{key}.port={self.port} must be in 1024..{65535 - 200} (engines use port .. port + 199)")
        if self.context_length is not None and self.context_length < 2:
            raise UserError(f"{key}.context_length={self.context_length} must be >= 2 or null")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise UserError(f"{key}.mem_fraction_static={self.mem_fraction_static} must be in (0, 1) or null")
        for name in ("startup_timeout_s", "request_timeout_s", "control_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"{key}.{name}={getattr(self, name)} must be > 0")
        override = self.extra_args.get("json_model_override_args")
        if override:
            try:
                json.loads(override)
            except ValueError as err:
                raise UserError(f"{key}.extra_args.json_model_override_args is not valid JSON ({err})") from err
        for name in self.extra_args:
            flag = name.replace("-", "_").lstrip("_")
            if flag in MANAGED_ARGS:
                raise UserError(
                    f"{key}.extra_args.{name} is set by megarl ({MANAGED_ARGS[flag]}); remove it from extra_args"
                )


@dataclass
class SyncProbeConfig:
    """The behavioural check of a weight sync (megarl/trainer/rollout_side/sync_probe.py): after the syncs that
    rollout.verify_sync verifies, every engine generates greedily from the first `prompts` training prompts and the
    actor scores the same tokens; a mean log-prob gap over the tolerance stops the run naming the engine."""

    prompts: int = 4
    """Probe prompts (the first of the training data); 0 turns the probe off."""
    max_new_tokens: int = 8
    """Tokens each engine generates per probe prompt."""
    tolerance: float | None = None
    """Largest mean |log-prob gap| per engine; null: by the coarser of the trainer's and the engines' weights (fp32
    1e-4, fp16 0.05, bf16 0.1, fp8 0.25)."""

    def check(self, key: str) -> None:
        if self.prompts < 0:
            raise UserError(f"{key}.prompts={self.prompts} must be >= 0 (0 turns the probe off)")
        if self.max_new_tokens < 1:
            raise UserError(f"{key}.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.tolerance is not None and self.tolerance <= 0:
            raise UserError(f"{key}.tolerance={self.tolerance} must be > 0 or null (by the engines' dtype)")


@dataclass
class RolloutConfig:
    backend: Literal["hf", "sglang"] = "hf"
    """Rollout engine: `hf` (embedded transformers, CPU) or `sglang` (GPU clusters)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling for training rollouts."""
    eval_sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    """Sampling for evaluation (greedy by default)."""
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    gpus_per_engine: int = 1
    """GPUs of one rollout engine (sglang: its tp; hf: 1). The engines share the rollout GPUs evenly."""
    bucket_bytes: int = 512 * 2**20
    """Largest weight-sync bucket, in bytes."""
    weight_sync: Literal["auto", "ipc", "nccl", "object_store", "disk"] = "auto"
    """How weights reach the engines: `ipc` (CUDA IPC handles from the actor's GPU, engines on the same GPUs),
    `nccl` (SGLang engines on other GPUs: a broadcast group set up once), `object_store` (host copies through Ray's
    object store: CPU, and the fallback), `disk` (safetensors files in the run directory, read by every engine on
    every node: engines across nodes); `auto` picks ipc when colocated on GPUs, nccl when split with SGLang (any
    actor layout: the sending ranks take turns), object_store otherwise, and disk for engines across nodes that no
    broadcast reaches."""
    weight_sync_delta: Literal["auto", "on", "off"] = "auto"
    """Delta sync (megarl/workers/weight_delta.py): after a full sync, each sending rank sends only the elements whose
    bytes changed (indices + values) with a checksum per bucket and a hash per tensor that the engine verifies; a
    mismatch fails the sync, quarantines the engines and the next sync is full, as after any engine restart, resume
    or layout change. `on`: every sync after the first; `off`: whole tensors; `auto`: on where the engine can apply
    deltas and bytes travel: the hf engine (in place; not the hybrid engine's in-process copy), and SGLang on the
    object_store road (update_weights_from_tensor into megarl's --custom-weight-loader,
    megarl/rollout/sglang_delta.py) for models whose loaders only copy. On the ipc road a CUDA IPC handle is all
    that travels, while applying a delta maps every element through SGLang's loaders (on CPU 3-5 s against 0.1-0.2 s
    for a full load of 26 M parameters; not measured on a GPU): `auto` keeps whole tensors there, `on` sends deltas.
    Off for SGLang on the nccl, disk and relayed roads (SGLang calls custom loaders only from
    update_weights_from_tensor), with FP8 rollout weights (the loaders quantize), for MLA models (DeepSeek-V3
    family: the loaders post-process kv_b_proj into w_kc/w_vc) and where the model's family is not known. `on` is
    refused where a reason above is known (at the config check for the roads and fp8, when the run sets up its sync
    for the model), and trusted where the family is not known (the engine's loader still refuses MLA and FP8
    models)."""
    weights_format: Literal["auto", "bf16", "fp8"] = "auto"
    """The weights the engines serve: `fp8` (block-wise 128x128 e4m3 with weight_scale_inv, as DeepSeek-V3/R1
    publish theirs; the sending ranks quantize at every sync, training stays bf16; SGLang only), `bf16` (the training
    weights as they are), or `auto`: the format of the checkpoint the run started from (model.path)."""
    routed_experts: Literal["auto", "off"] = "auto"
    """MoE models: the engines record the experts each token was routed to (megarl/rollout/routing.py; SGLang
    --enable-return-routed-experts), for algorithm.routing_replay=rollout and the rollout/routing_* metrics. `auto`:
    on for MoE models; `off`: not recorded (no replay from the rollout, no agreement metric)."""
    verify_sync: Literal["first", "every", "never"] = "first"
    """Check that the engine holds the weights just sent (SGLang: checksums of a sample of tensors through its
    weights checker; a mismatch stops the run naming the tensor), and that it behaves like the trainer
    (`sync_probe`): after the first sync, after every sync (the synchronous loop; the asynchronous one probes its
    first), or never."""
    sync_probe: SyncProbeConfig = field(default_factory=SyncProbeConfig)
    max_engine_restarts: int = 3
    """Split placement, synchronous RL: how many times a run restarts a single rollout engine that died, hung past
    its phase deadline or failed its health probe (killed, started again on its own GPUs, given a full weight sync;
    the prompts it held go to the other engines). One more failure stops the run with the list of every engine
    failure (engine, step, cause). 0: any engine failure restarts every role from the last checkpoint
    (run.max_restarts), as it always does for hybrid engines, colocated placement and asynchronous RL."""

    def delta_refusal(self, transport: str, quantization: dict | None = None, mla: bool | None = None) -> str | None:
        """Why the engines cannot take deltas on the road `transport` (None: they can). `quantization`: the
        rollout weights' format resolved (weights_format.py); `mla`: the model's attention is MLA (None: not known)."""
        if self.backend == "hf":
            return "the hybrid engine copies whole tensors in process" if transport == "in_process" else None
        if transport not in SGLANG_DELTA_ROADS:
            return (
                f"weight_sync={transport}: SGLang calls megarl's delta loader only from update_weights_from_tensor "
                f"(the colocated roads {', '.join(SGLANG_DELTA_ROADS)}); its broadcast, disk and relayed roads load "
                "whole tensors"
            )
        if quantization is not None or self.weights_format == "fp8":
            return "FP8 rollout weights: SGLang's loaders quantize what they load"
        if mla:
            return "an MLA model (DeepSeek-V3 family): SGLang's loaders post-process kv_b_proj into w_kc/w_vc"
        if mla is None:
            return UNKNOWN_FAMILY
        return None

    def sync_delta(self, transport: str, quantization: dict | None = None, mla: bool | None = None) -> bool:
        """Whether syncs after the first send deltas (weight_sync_delta resolved for the road `transport`, the
        rollout weights' `quantization` and whether the model is `mla`; delta_refusal). `on` where the engines
        cannot take deltas raises UserError; `on` with SGLang and the family not known trusts the setting (the
        engine's loader still refuses MLA and FP8 models, and the sync then fails naming the reason)."""
        if self.weight_sync_delta == "off":
            return False
        if self.weight_sync_delta == "auto" and self.backend == "sglang" and transport == "ipc":
            return False  # nothing travels to save: a CUDA IPC handle is the whole payload (see the docstring)
        reason = self.delta_refusal(transport, quantization, mla)
        if reason is None:
            return True
        if self.weight_sync_delta == "on" and self.backend == "sglang":
            if reason == UNKNOWN_FAMILY:
                return True  # as set: the engine's loader still refuses MLA and FP8 models (the sync fails)
            raise UserError(f"rollout.weight_sync_delta=on: {reason}; use auto or off")
        return False

    def check(self, key: str) -> None:
        if self.gpus_per_engine < 1:
            raise UserError(f"{key}.gpus_per_engine={self.gpus_per_engine} must be >= 1")
        if self.backend == "hf" and self.gpus_per_engine != 1:
            raise UserError(f"{key}.gpus_per_engine={self.gpus_per_engine}: the hf engine uses 1")
        if self.backend == "sglang" and self.gpus_per_engine != self.sglang.num_gpus():
            raise UserError(
                f"{key}.gpus_per_engine={self.gpus_per_engine} must equal the SGLang engine's GPUs "
                f"({key}.sglang.tp={self.sglang.tp}): {self.sglang.num_gpus()}"
            )
        if self.weights_format not in ("auto", "bf16", "fp8"):
            raise UserError(f"{key}.weights_format={self.weights_format!r}: valid are auto, bf16, fp8")
        if self.weights_format == "fp8" and self.backend != "sglang":
            raise UserError(
                f"{key}.weights_format=fp8 needs {key}.backend=sglang (the hf engine computes in {key}.hf.dtype); "
                "use auto or bf16"
            )
        if self.weight_sync_delta not in ("auto", "on", "off"):
            raise UserError(f"{key}.weight_sync_delta={self.weight_sync_delta!r}: valid are auto, on, off")
        if self.weight_sync_delta == "on" and self.backend == "sglang":
            if self.weight_sync in ("nccl", "disk"):
                raise UserError(
                    f"{key}.weight_sync_delta=on with {key}.weight_sync={self.weight_sync}: SGLang applies deltas only "
                    f"on the colocated tensor road ({key}.weight_sync ipc, object_store or auto); use auto or off"
                )
            if self.weights_format == "fp8":
                raise UserError(
                    f"{key}.weight_sync_delta=on with {key}.weights_format=fp8: SGLang's loaders quantize what they "
                    "load, so a delta cannot be applied to FP8 weights; use auto or off"
                )
        if self.routed_experts not in ("auto", "off"):
            raise UserError(f"{key}.routed_experts={self.routed_experts!r}: valid are auto, off")
        if isinstance(self.max_engine_restarts, bool) or self.max_engine_restarts < 0:
            raise UserError(f"{key}.max_engine_restarts={self.max_engine_restarts} must be an integer >= 0")
        if self.bucket_bytes < 2**20:
            raise UserError(f"{key}.bucket_bytes={self.bucket_bytes} must be at least 1 MiB")
