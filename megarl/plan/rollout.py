"""Per-GPU memory of a rollout engine: its share of the weights and its KV cache.

SGLang reserves `mem_fraction_static` x GPU memory for weights plus KV cache (the "static" pool); the rest is left
for its activations, CUDA graphs and other processes. The KV cache gets what the weights leave of the pool.

Weights per GPU of an engine of tp GPUs (SGLang's DeepSeek/Llama/Qwen model code): attention projections split
over the attention-TP group (tp / dp with DP attention, else tp; KV heads are replicated when there are fewer than
attention-TP ranks; MLA's down projections are whole on every GPU); embedding and output head split over the
attention-TP group; dense MLP and shared experts over tp; routed experts over ep, each expert over tp / ep, i.e. all
experts over tp; norms and router whole.

KV cache per token per GPU: GQA: 2 (K and V) x layers x ceil(kv_heads / attention-TP) x head_dim x bytes (layers:
the full-attention ones of a hybrid model, ModelShape.kv_layers);
MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes (the compressed latent, whole on every attention-TP rank).
An engine with DP attention keeps dp separate caches (one per attention group): its token capacity is dp times one
GPU's.

The hf engine (CPU) is not planned here: its memory is host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.plan.model_size import ModelShape, dtype_bytes
from megarl.rollout.config import SGLangEngineConfig

DEFAULT_MEM_FRACTION = 0.85
"""What the plan assumes when sglang.mem_fraction_static is null (SGLang's own estimate is about this on 80 GB
GPUs with tp >= 2; it is lower on small GPUs)."""
SGLANG_RUNTIME_GB = 4.0
"""What a generating SGLang server needs outside its static pool: activations of a prefill chunk, CUDA graphs,
sampling buffers (a few GB for large models; SGLang keeps 1 - mem_fraction_static free for it)."""
_KV_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "fp8": 1, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of one engine."""

    tp: int
    dp: int
    ep: int
    weight_bytes: float
    static_bytes: float
    """mem_fraction_static x GPU memory: weights plus KV cache."""
    mem_fraction: float
    mem_fraction_assumed: bool
    kv_bytes_per_token: float
    """KV cache bytes of one token on one GPU."""
    weight_dtype_bytes: int
    kv_dtype_bytes: int
    fp8: bool = False
    """Weights served in block-wise FP8 (rollout.weights_format): decoder layers at one byte per weight."""

    @property
    def weights_label(self) -> str:
        return "FP8 (embeddings, head 16-bit)" if self.fp8 else f"{self.weight_dtype_bytes * 8}-bit"

    @property
    def kv_bytes(self) -> float:
        return self.static_bytes - self.weight_bytes

    @property
    def token_capacity(self) -> int:
        """Tokens the engine's KV cache holds (over its DP-attention groups)."""
        if self.kv_bytes <= 0:
            return 0
        return int(self.kv_bytes // self.kv_bytes_per_token) * self.dp


def engine_memory(shape: ModelShape, config: SGLangEngineConfig, gpu_bytes: float, fp8: bool = False) -> EngineMemory:
    """One engine GPU's memory; fp8: the decoder layers' weights at one byte each (norms and routers included: a
    slight overestimate of the savings' complement), embeddings and head at the served width."""
    attn_dp = config.dp if config.enable_dp_attention else 1
    attn_tp = config.tp // attn_dp
    w_bytes = _engine_dtype_bytes(config.dtype, shape.hf_dtype_bytes)
    kv_name = config.extra_args.get("kv_cache_dtype", "auto")
    kv_bytes = _KV_BYTES.get(kv_name, w_bytes)
    numel = layers_numel = 0.0
    kv_heads = math.ceil(shape.num_kv_heads / attn_tp)
    for layer in shape.layers:
        for spec in layer:
            layers_numel += _engine_share(spec.name, spec.total(), spec.split, shape, config.tp, attn_tp, kv_heads)
    vocab = shape.vocab_size * shape.hidden_size
    numel = vocab / attn_tp * (1 if shape.tied_embeddings else 2) + shape.final_norm
    kv_layers = shape.num_layers if shape.kv_layers is None else shape.kv_layers
    if shape.mla:
        per_token = kv_layers * (shape.mla["kv_lora_rank"] + shape.mla["qk_rope_head_dim"]) * kv_bytes
    else:
        per_token = 2 * kv_layers * kv_heads * shape.head_dim * kv_bytes
    fraction = config.mem_fraction_static
    return EngineMemory(
        tp=config.tp,
        dp=attn_dp,
        ep=config.ep,
        weight_bytes=numel * w_bytes + layers_numel * (1 if fp8 else w_bytes),
        static_bytes=(fraction or DEFAULT_MEM_FRACTION) * gpu_bytes,
        mem_fraction=fraction or DEFAULT_MEM_FRACTION,
        mem_fraction_assumed=fraction is None,
        kv_bytes_per_token=per_token,
        weight_dtype_bytes=w_bytes,
        kv_dtype_bytes=kv_bytes,
        fp8=fp8,
    )


def _engine_dtype_bytes(name: str, hf_bytes: int) -> int:
    if name == "auto":
        return 2  # the checkpoint's dtype, fp32 served as fp16
    return dtype_bytes(name, default=hf_bytes)


def _engine_share(name: str, total: int, split: str, shape: ModelShape, tp: int, attn_tp: int, kv_heads: int) -> float:
    """Elements of one Megatron parameter group an engine GPU holds (see the module docstring)."""
    if split == "expert" or name.startswith(("mlp.", "shared_experts.")):
        return total / tp
    if name.startswith(("linear_qkv",)):
        # q heads split; KV heads split, or replicated once there are fewer of them than ranks.
        per_row = total / ((shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim)
        return (shape.num_heads / attn_tp + 2 * kv_heads) * shape.head_dim * per_row
    if split == "replicated" or "down_proj" in name:
        return total
    return total / attn_tp
