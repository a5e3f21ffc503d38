"""Build the Megatron-Core model chunks of one rank for a HF checkpoint's architecture.

The parallel layout comes in from outside (Megatron's parallel state must be initialized); the architecture entry
says what the model is. Local (non-TE) layer specs on CPU, Transformer Engine specs where TE and CUDA exist.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from typing import Literal

import torch

from megarl.bridge.mappings import VocabInfo
from megarl.models.architecture import Architecture, McoreModelSpec
from megarl.runtime.parallel import ParallelConfig

SpecBackend = Literal["auto", "local", "te"]


def transformer_engine_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(qk_norm: bool, backend: SpecBackend = "auto"):
    from megatron.core.models.gpt import gpt_layer_specs

    if backend == "te" or (backend == "auto" and transformer_engine_available()):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")


def build_transformer_config(spec: McoreModelSpec, parallel: ParallelConfig, dtype: torch.dtype, **overrides):
    """Megatron's TransformerConfig: the model's own fields plus the layout, precision and device settings."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        spec.config_kwargs,
        **parallel.megatron_sizes(),
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(
    arch: Architecture,
    hf_config,
    parallel: ParallelConfig,
    vocab: VocabInfo,
    dtype: torch.dtype = torch.float32,
    meta: bool = False,
    spec_backend: SpecBackend = "auto",
) -> list:
    """This rank's model chunks (one per virtual pipeline stage), as `megatron.core.models.gpt.GPTModel`s.

    meta: build on the meta device (shapes and names only, no memory), e.g. to plan a checkpoint.

    Weights are always initialized, even when a checkpoint is loaded next: Megatron sets the tensor-parallel
    attributes of a parameter (`tensor_model_parallel`, `partition_dim`) only in its initialization path, and
    gradient clipping and DDP rely on them.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    spec = arch.to_mcore(hf_config)
    overrides = {"use_cpu_initialization": True} if meta else {}
    config = build_transformer_config(spec, parallel, dtype, **overrides)
    transformer_layer_spec = layer_spec(spec.qk_norm, "local" if meta else spec_backend)
    chunks = []
    for vp_stage in range(parallel.vpp):
        stage = vp_stage if parallel.vpp > 1 else None
        with torch.device("meta") if meta else nullcontext():
            model = GPTModel(
                config,
                transformer_layer_spec,
                vocab_size=vocab.padded_size,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                **spec.gpt_kwargs,
            )
        # Megatron's rotary embedding knows fewer scaling schemes than HF: use the checkpoint's own frequencies.
        model.rotary_pos_emb.inv_freq = spec.rope_inv_freq.to(model.rotary_pos_emb.inv_freq.device)
        chunks.append(model)
    return chunks
