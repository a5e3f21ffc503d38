"""Save a Megatron-Core torch_dist checkpoint whose tensors are computed one at a time, while being written.

`megatron.core.dist_checkpointing.save` wants every tensor in memory at once (its async writer snapshots them all
before a child process writes). For offline conversion that would hold the whole model; here the sharded state dict
of a *meta-device* model describes the checkpoint (keys, global shapes, offsets: Megatron's own logic, so the result
is exactly what a live model would save), and a planner asks for each tensor's data only when the writer reaches it.

The file writer is torch's, but for its loop: torch's keeps the last tensor written under every key until the
file is closed (for its safetensors format), and with one file per rank and per-layer keys (MoE models are not
stacked by layer) that is every attention weight of the model.

Internals used, all isolated here: Megatron-Core's `strategies.torch` (`_replace_state_dict_keys_with_sharded_keys`,
`mcore_to_pyt_state_dict`, `MCoreSavePlanner`, `TorchDistSaveShardedStrategy`) and torch DCP's `_write_item`.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.futures import Future

from megarl.runtime.memory import trim_heap


@dataclass(frozen=True)
class _Source:
    """Where a checkpoint shard's data comes from: a view (size/stride/offset) of a full parameter."""

    param_name: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class _ParamCache:
    """Produces full parameters on demand, keeping only the latest (shards of one parameter arrive together)."""

    def __init__(self, produce: Callable[[str], torch.Tensor], on_param: Callable[[str], None]):
        self._produce = produce
        self._on_param = on_param
        self._name: str | None = None
        self._tensor: torch.Tensor | None = None
        self._produced = 0

    def get(self, name: str) -> torch.Tensor:
        if name != self._name:
            self._tensor = None  # free the previous parameter before producing the next
            self._produced += 1
            if self._produced % 256 == 0:
                trim_heap()
            self._tensor = self._produce(name).contiguous()
            self._name = name
            self._on_param(name)
        return self._tensor


def _collect_sources(sharded_state_dict: dict) -> dict[tuple[str, tuple[int, ...]], _Source]:
    """Apply Megatron's sharded-tensor factories (e.g. SwiGLU's gate/up split) to the meta state dict, in place,
    and record for every resulting ShardedTensor which parameter view holds its data."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sources = {}
    for param_name, value in list(sharded_state_dict.items()):
        if isinstance(value, ShardedTensorFactory):
            value = value.build()
            sharded_state_dict[param_name] = value
        for sh_ten in nested_values({"x": value}):
            if isinstance(sh_ten, ShardedTensor):
                data = sh_ten.data
                sources[(sh_ten.key, tuple(sh_ten.global_offset))] = _Source(
                    param_name, tuple(data.shape), tuple(data.stride()), data.storage_offset()
                )
    return sources


def _resolve(planner, item):
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        data = data.detach()
        if data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone()  # a view would save its whole storage
    return data


class _StreamingFileWriter(dcp.FileSystemWriter):
    """torch's FileSystemWriter, writing one item at a time and keeping none. The next item is produced (read from
    the HF files and converted) in a helper thread while the current one is serialized: two items in memory."""

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        from torch.distributed.checkpoint.filesystem import _write_item

        results = []
        with ThreadPoolExecutor(max_workers=1) as producer:  # one thread: items are produced in plan order
            while not file_queue.empty():
                path, file_name, items = file_queue.get_nowait()
                with self.fs.create_stream(path, "wb") as stream:
                    upcoming = producer.submit(_resolve, planner, items[0]) if items else None
                    for index, item in enumerate(items):
                        data = upcoming.result()
                        if index + 1 < len(items):
                            upcoming = producer.submit(_resolve, planner, items[index + 1])
                        results.append(
                            _write_item(self.transforms, stream, data, item, file_name, self.serialization_format)
                        )
                        del data
                    self._sync(stream)
        future: Future = Future()
        future.set_result(results)
        return future

    def _sync(self, stream) -> None:
        if self.sync_files:
            stream.flush()
            os.fsync(stream.fileno())


def _strategy(sources: dict, params: _ParamCache):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item: WriteItem):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            source = sources[(write_item.index.fqn, tuple(write_item.index.offset))]
            full = params.get(source.param_name)
            shard = full.as_strided(source.size, source.stride, source.storage_offset)
            return shard.reshape(write_item.tensor_data.chunk.sizes)

    class LazySaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt_state = mcore_to_pyt_state_dict(state, is_loading=False)
            # One file, in the plan's order: the shards of a parameter are written one after another.
            writer = _StreamingFileWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1)
            planner = LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
            # The converter is one process: no collectives to exchange plans (pickling thousands of items).
            dcp.save(pyt_state, storage_writer=writer, planner=planner, no_dist=torch.distributed.get_world_size() == 1)

    return LazySaveStrategy("torch_dist", 1)


def save_lazily(
    meta_sharded_state_dict: dict,
    checkpoint_dir: str | Path,
    produce: Callable[[str], torch.Tensor],
    on_param: Callable[[str], None] = lambda name: None,
) -> None:
    """Write a torch_dist checkpoint described by the flat sharded state dict of a meta-device model chunk.

    produce(param_name) returns the full value of that parameter (shape and dtype of the meta parameter); it is
    called once per parameter, and at most one produced parameter is held at a time. on_param reports progress.
    """
    from megatron.core import dist_checkpointing

    sources = _collect_sources(meta_sharded_state_dict)
    strategy = _strategy(sources, _ParamCache(produce, on_param))
    dist_checkpointing.save(meta_sharded_state_dict, str(checkpoint_dir), sharded_strategy=strategy)
