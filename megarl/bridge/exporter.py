"""Export: the local shards of a live Megatron-Core model -> a stream of buckets of whole HF-named tensors.

Contract (DESIGN.md): the union of the buckets over all sending ranks is exactly the HF checkpoint, each tensor
once, in its HF dtype. TP shards are gathered to the TP group's first rank, which sends; each pipeline stage sends
its own layers; only the first data-parallel (and context-parallel) replica takes part, the others hold copies.
Memory beyond the model: one bucket plus the tensor being gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from megarl.bridge.buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketBuilder
from megarl.bridge.model_bridge import Binding, ModelBridge


def _dtype_lookup(hf_dtypes: torch.dtype | Mapping[str, torch.dtype]) -> Callable[[str], torch.dtype]:
    if isinstance(hf_dtypes, torch.dtype):
        return lambda name: hf_dtypes
    return hf_dtypes.__getitem__


def _gather_tp(binding: Binding, tp_size: int, group) -> list[torch.Tensor]:
    param = binding.param.detach()
    if binding.mapping.tp_dim is None or tp_size == 1:
        return [param]
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    return shards


def export_hf_weights(
    bridge: ModelBridge,
    hf_dtypes: torch.dtype | Mapping[str, torch.dtype],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[Bucket]:
    """Yield buckets of (hf_name, tensor) on sending ranks.

    Every rank of the model-parallel group must iterate this generator to the end, senders or not: the TP gathers
    inside it are collectives. Yielded tensors may share memory with the parameters: consume a bucket before the
    parameters change.
    """
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
        return
    sender = bridge.tp_rank == 0
    group = parallel_state.get_tensor_model_parallel_group()
    dtype_of = _dtype_lookup(hf_dtypes)
    builder = BucketBuilder(bucket_bytes)
    for binding in bridge.bindings:
        if not binding.mapping.export:
            continue
        shards = _gather_tp(binding, bridge.tp_size, group)
        if not sender:
            continue
        for name, tensor in bridge.to_hf(binding, binding.mapping.unshard(shards), dtype_of):
            if (bucket := builder.add(name, tensor)) is not None:
                yield bucket
    if sender and (bucket := builder.flush()) is not None:
        yield bucket
