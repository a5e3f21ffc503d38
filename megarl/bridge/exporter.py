"""Export: the local shards of a live Megatron-Core model -> a stream of buckets of whole HF-named tensors.

Contract (docs/architecture.md, Export stream): the union of the buckets over all sending ranks is exactly the HF
checkpoint, each tensor once, in its HF dtype. TP shards are gathered to the TP group's first rank, which sends; each
pipeline stage sends its own layers; each expert-parallel rank sends its own experts (gathered over expert TP); tensors
an engine fuses at load time share a bucket (Architecture.load_groups); a tensor stacked over experts (gpt-oss) is sent
whole, by the first expert-parallel rank, which gathers the other ranks' experts for it. Of the replicas holding the
same weights, only the first takes part: data-parallel (and context-parallel) rank 0 for dense weights,
expert-data-parallel rank 0 for experts. Memory beyond the model: one bucket plus the tensor being gathered (a stacked
tensor: all of it, on the first expert-parallel rank).

For an engine that takes parts of tensors (the hf engine), `parts=True` drops the gathers where the layout allows:
each TP rank sends its own part of each split tensor, cut from its shard (see `export_hf_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megarl.bridge.buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketBuilder, travel_groups
from megarl.bridge.mappings import stacked_row
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


class _StackedTensors:
    """Rows of tensors stacked over experts (`name[i]`) joined into the whole tensor: this rank's rows once all have
    come, then the expert-parallel group's, on its first rank (the others send it theirs and yield nothing).
    Megatron numbers experts by EP rank (rank r holds a contiguous run), so the whole is the ranks' runs in order.
    Every rank of the group finishes a tensor at the same binding: the point-to-point sends stay matched."""

    def __init__(self, bindings: Sequence[Binding]):
        self.local_rows: dict[str, int] = {}
        for binding in bindings:
            for row in filter(None, map(stacked_row, binding.hf_names if binding.mapping.export else ())):
                self.local_rows[row[0]] = self.local_rows.get(row[0], 0) + 1
        self._rows: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        row = stacked_row(name)
        if row is None:
            yield name, tensor
            return
        rows = self._rows.setdefault(row[0], {})
        rows[row[1]] = tensor
        if len(rows) < self.local_rows[row[0]]:
            return
        del self._rows[row[0]]
        whole = self._gather(row[0], rows)
        if whole is not None:
            yield row[0], whole

    def _gather(self, name: str, rows: dict[int, torch.Tensor]) -> torch.Tensor | None:
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        count = len(rows)
        if sorted(rows) != list(range(rank * count, (rank + 1) * count)):
            raise RuntimeError(f"{name}: EP rank {rank} holds rows {sorted(rows)}, not a run of {count} in rank order")
        local = torch.stack([rows[i] for i in sorted(rows)])
        if size == 1:
            return local
        if rank != 0:
            dist.send(local, dst=dist.get_global_rank(group, 0), group=group)
            return None
        parts = [local]
        for group_rank in range(1, size):
            parts.append(torch.empty_like(local))
            dist.recv(parts[-1], src=dist.get_global_rank(group, group_rank), group=group)
        return torch.cat(parts)


def export_hf_weights(
    bridge: ModelBridge,
    hf_dtypes: torch.dtype | Mapping[str, torch.dtype],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    parts: bool = False,
) -> Iterator[Bucket]:
    """Yield buckets of (hf_name, tensor) on sending ranks.

    Every rank of the model-parallel group must iterate this generator to the end, senders or not: the TP gathers
    inside it are collectives. Yielded tensors may share memory with the parameters: consume a bucket before the
    parameters change.

    `parts`: for an engine that takes parts of tensors (megarl/bridge/buckets.py `part_name`; the hf engine), every
    TP rank sends its own part of each tensor whose layout allows it (`Mapping.hf_parts`: split weights, q/k/v and
    gate/up, vocabulary rows), cut from its shard with no gather, so all ranks convert and send at once; tensors
    stacked over experts and layouts that need every shard are gathered and sent whole as without `parts`. The
    union over the senders then covers every HF tensor exactly once, in whole tensors and parts. Buckets keep no
    travel groups (they are for SGLang's loader, which takes whole tensors only).
    """
    roles = _Roles()
    dtype_of = _dtype_lookup(hf_dtypes)
    together = {} if parts else travel_groups(bridge.hf_names(exported_only=True), bridge.load_groups)
    builder = BucketBuilder(bucket_bytes, together)
    stacked = _StackedTensors(bridge.bindings)
    for binding in bridge.bindings:
        participates, group = roles.of(binding)
        if not binding.mapping.export or not participates:
            continue
        own = _own_parts(bridge, binding, dtype_of) if parts else None
        if own is None:
            own = _gathered(bridge, binding, group, dtype_of, stacked)
        for name, tensor in own:
            if (bucket := builder.add(name, tensor)) is not None:
                yield bucket
    if (bucket := builder.flush()) is not None:
        yield bucket


def _own_parts(bridge: ModelBridge, binding: Binding, dtype_of) -> list[tuple[str, torch.Tensor]] | None:
    """This rank's parts of the binding's tensors; None where they go whole (not split, stacked over experts, or a
    layout that needs every shard): the same answer on every rank of the TP group, so the gathers stay matched."""
    if binding.mapping.tp_dim is None or any(stacked_row(name) for name in binding.hf_names):
        return None
    return bridge.to_hf_parts(binding, dtype_of)


def _gathered(
    bridge: ModelBridge, binding: Binding, group, dtype_of, stacked: _StackedTensors
) -> Iterator[tuple[str, torch.Tensor]]:
    """The binding's whole HF tensors on the TP group's first rank (its shards gathered there), nothing elsewhere."""
    rank, size = bridge.tp_rank_and_size(binding)
    shards = _gather_shards(binding, size, group)
    if rank != 0:
        return
    for hf_name, hf_tensor in bridge.to_hf(binding, binding.mapping.unshard(shards), dtype_of):
        yield from stacked.add(hf_name, hf_tensor)
