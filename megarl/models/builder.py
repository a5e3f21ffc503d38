"""Build the Megatron-Core model chunks of one rank for a HF checkpoint's architecture.

The parallel layout comes in from outside (Megatron's parallel state must be initialized); the architecture entry
says what the model is. Layer specs: see models/specs.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from megarl.bridge.mappings import VocabInfo
from megarl.models.architecture import Architecture, McoreModelSpec
from megarl.models.heads import Head, attach_value_head
from megarl.models.specs import TE_TO_LOCAL, SpecBackend, decoder_block_spec, uses_transformer_engine
from megarl.runtime.parallel import ParallelConfig


def _runtime_kwargs(spec: McoreModelSpec, backend: SpecBackend) -> dict:
    """Settings that depend on the machine rather than the model."""
    kwargs: dict = {
        "use_cpu_initialization": not torch.cuda.is_available(),
        # Batched isend/irecv over gloo corrupts activations in the interleaved schedule's training passes (the
        # third micro-batch on saw its inputs change; mcore 0.16.1): plain point-to-point ops there.
        "batch_p2p_comm": torch.cuda.is_available(),
        # Free pipeline outputs once sent, and run backward through the autograd engine directly (Megatron-LM's
        # default). torch.autograd.backward would dispatch to the CPU compatibility mode, which switches itself off
        # while handling a call: the whole backward pass (e.g. the MoE all-gather's) would see CUDA devices again.
        "deallocate_pipeline_outputs": True,
    }
    if spec.moe:
        # all-to-all dispatch needs CUDA streams; grouped GEMMs need Transformer Engine.
        kwargs["moe_token_dispatcher_type"] = "alltoall" if torch.cuda.is_available() else "allgather"
        kwargs["moe_grouped_gemm"] = uses_transformer_engine(backend)
    return kwargs


def build_transformer_config(
    spec: McoreModelSpec, parallel: ParallelConfig, dtype: torch.dtype, backend: SpecBackend = "auto", **overrides
):
    """Megatron's TransformerConfig: the model's own fields plus the layout, precision and device settings."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kwargs = dict(
        spec.config_kwargs,
        **parallel.megatron_sizes(),
        **parallel.megatron_stage_kwargs(),
        sequence_parallel=parallel.sequence_parallel,
        cp_comm_type=parallel.cp_comm_type if parallel.cp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **_runtime_kwargs(spec, backend),
    )
    kwargs.update(overrides)
    return (MLATransformerConfig if spec.mla else TransformerConfig)(**kwargs)


def build_model(
    arch: Architecture,
    hf_config,
    parallel: ParallelConfig,
    vocab: VocabInfo,
    dtype: torch.dtype = torch.float32,
    meta: bool = False,
    spec_backend: SpecBackend = "auto",
    head: Head = "lm",
    config_overrides: dict | None = None,
) -> list:
    """This rank's model chunks (one per virtual pipeline stage), as `megatron.core.models.gpt.GPTModel`s.

    meta: build on the meta device (shapes and names only, no memory, no initialization), e.g. to plan a
        checkpoint at TP=1.
    head: "lm" (vocab-parallel logits) or "value" (one number per position: critics and reward models).
    config_overrides: TransformerConfig fields set by the role (e.g. recomputation, per-token loss scaling).

    Real weights are always initialized, even when a checkpoint is loaded next: Megatron sets the tensor-parallel
    attributes of a parameter (`tensor_model_parallel`, `partition_dim`) only in its initialization path, and
    gradient clipping and DDP rely on them.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megarl.models import packed_rope, plain_linear

    packed_rope.install()  # packed micro-batches' RoPE without a per-sample loop
    plain_linear.install()  # linear layers that need no tensor-parallel communication: no Python backward
    spec = arch.to_mcore(hf_config)
    backend = "local" if meta else spec_backend
    overrides = dict(config_overrides or {})
    if meta:
        overrides.update(use_cpu_initialization=True, perform_initialization=False)
    config = build_transformer_config(spec, parallel, dtype, backend, **overrides)
    gpt_kwargs = dict(spec.gpt_kwargs)
    if head == "value":
        gpt_kwargs["share_embeddings_and_output_weights"] = False  # the value head replaces the output layer
    chunks = []
    for vp_stage in range(parallel.vpp):
        stage = vp_stage if parallel.vpp > 1 else None
        with torch.device("meta") if meta else nullcontext():
            model = GPTModel(
                config,
                decoder_block_spec(config, backend, stage),
                vocab_size=vocab.padded_size,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                **gpt_kwargs,
            )
            if head == "value":
                attach_value_head(model)
        _mark_sink_logits_split(model)
        if spec.rope_inv_freq is not None:
            # Megatron's rotary embedding knows fewer scaling schemes than HF: use the checkpoint's own frequencies.
            model.rotary_pos_emb.inv_freq = spec.rope_inv_freq.to(model.rotary_pos_emb.inv_freq.device)
        chunks.append(model)
    return chunks


def _mark_sink_logits_split(model) -> None:
    """Megatron's core attentions hold the sink logits of this TP rank's heads (`softmax_offset`, softmax_type
    'learnable') without the tensor-parallel marks its linear layers get, though its checkpoints split them by heads:
    marked here, so the bridge splits them and gradient clipping counts every rank's."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset") and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, 0, 1)


def build_bridge(arch: Architecture, hf_config, chunks: list, vocab: VocabInfo, head: Head = "lm"):
    """The architecture's weight table bound to `chunks` (whichever layer spec built them)."""
    from megarl.bridge.model_bridge import ModelBridge

    return ModelBridge(
        arch.mappings(hf_config, head), chunks, vocab, param_aliases=TE_TO_LOCAL, load_groups=arch.load_groups
    )
