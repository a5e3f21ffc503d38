"""Test helpers, including the rank-side functions that run inside the gloo rank pools."""

from __future__ import annotations

from pathlib import Path

import torch

# (tp, pp, vpp) layouts every architecture is checked at on four ranks.
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]


def layout_id(layout: tuple[int, int, int]) -> str:
    tp, pp, vpp = layout
    return f"tp{tp}-pp{pp}" + (f"-vpp{vpp}" if vpp > 1 else "")


def sample_ids(vocab_size: int, batch: int = 2, seq: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference logits of the HF model, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits


def one_result(results: list):
    """The single non-None result of a pool call (e.g. logits from the last stage's first TP rank)."""
    found = [r for r in results if r is not None]
    assert len(found) == 1, f"expected one rank to answer, got {len(found)}"
    return found[0]


# ---- rank side ---------------------------------------------------------------------------------------------------


def _is_reporting_rank() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def megatron_logits(path: str, layout: tuple[int, int, int], input_ids: torch.Tensor):
    """Load `path` (HF or megarl checkpoint) at `layout` in fp32; full logits from one last-stage rank."""
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.runtime.pipeline import forward_logits

    parallel = ParallelConfig(*layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.float32)
    logits = forward_logits(model.chunks, input_ids, model.vocab.size)
    return logits if logits is not None and _is_reporting_rank() else None


def exported_weights(path: str, layout: tuple[int, int, int], bucket_bytes: int, dtype: str = "float32"):
    """Load at `layout` and export: (list of (name, tensor) this rank sent, sizes of its buckets)."""
    from megarl.bridge.exporter import export_hf_weights
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    parallel = ParallelConfig(*layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, getattr(torch, dtype))
    sent, bucket_sizes = [], []
    for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes=bucket_bytes):
        sent += [(name, tensor.clone()) for name, tensor in bucket]
        bucket_sizes.append([tensor.nbytes for _, tensor in bucket])
    return sent, bucket_sizes


def save_at_layout(path: str, layout: tuple[int, int, int], dst: str) -> None:
    """Load `path` at `layout` and save it as a megarl checkpoint from the live, sharded model."""
    from megarl.checkpoint.model_io import load_model, save_model
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    parallel = ParallelConfig(*layout)
    init_model_parallel(parallel)
    save_model(load_model(path, parallel, torch.float32), dst)
