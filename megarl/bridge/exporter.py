"""Export: the local shards of a live Megatron-Core model -> a stream of buckets of whole HF-named tensors.

Contract (docs/architecture.md, Export stream): the union of the buckets over all sending ranks is exactly the HF
checkpoint, each tensor once, in its HF dtype. TP shards are gathered to the TP group's first rank, which sends; each
pipeline stage sends its own layers; each expert-parallel rank sends its own experts (gathered over expert TP); tensors
an engine fuses at load time share a bucket (Architecture.load_groups). Of the replicas holding the same weights, only
the first takes part: data-parallel (and context-parallel) rank 0 for dense weights, expert-data-parallel rank 0 for
experts. Memory beyond the model: one bucket plus the tensor being gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from megarl.bridge.buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketBuilder, travel_groups
from megarl.bridge.model_bridge import Binding, ModelBridge


def _dtype_lookup(hf_dtypes: torch.dtype | Mapping[str, torch.dtype]) -> Callable[[str], torch.dtype]:
    if isinstance(hf_dtypes, torch.dtype):
        return lambda name: hf_dtypes
    return hf_dtypes.__getitem__


def _gather_shards(binding: Binding, size: int, group) -> list[torch.Tensor]:
    """The TP shards of a parameter on the group's rank 0 (the one that sends), [] on the others. A gather, not an
    all-gather: only the sender needs them (tools/bench/refit.py: half the traffic, no buffers on the others)."""
    param = binding.param.detach()
    if binding.mapping.tp_dim is None or size == 1:
        return [param]
    param = param.contiguous()
    if dist.get_rank(group) != 0:
        dist.send(param, dst=dist.get_global_rank(group, 0), group=group)
        return []
    shards = [param]
    for group_rank in range(1, size):  # point to point: gloo's gather was 2.5x slower here (tools/bench/refit.py)
        shards.append(torch.empty_like(param))
        dist.recv(shards[-1], src=dist.get_global_rank(group, group_rank), group=group)
    return shards


class _Roles:
    """Who gathers and who sends, for dense and for expert weights. Every member of a gather group makes the same
    choice, so the collectives stay matched."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.dense = (ps.get_data_parallel_rank(with_context_parallel=True) == 0, ps.get_tensor_model_parallel_group())
        self.expert = (ps.get_expert_data_parallel_rank() == 0, ps.get_expert_tensor_parallel_group())

    def of(self, binding: Binding) -> tuple[bool, object]:
        return self.expert if binding.expert else self.dense


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
    roles = _Roles()
    dtype_of = _dtype_lookup(hf_dtypes)
    builder = BucketBuilder(bucket_bytes, travel_groups(bridge.hf_names(exported_only=True), bridge.load_groups))
    for binding in bridge.bindings:
        participates, group = roles.of(binding)
        if not binding.mapping.export or not participates:
            continue
        rank, size = bridge.tp_rank_and_size(binding)
        shards = _gather_shards(binding, size, group)
        if rank != 0:
            continue
        for name, tensor in bridge.to_hf(binding, binding.mapping.unshard(shards), dtype_of):
            if (bucket := builder.add(name, tensor)) is not None:
                yield bucket
    if (bucket := builder.flush()) is not None:
        yield bucket
