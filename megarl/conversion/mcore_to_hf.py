"""`megarl convert --from mcore --to hf`: a megarl Megatron checkpoint folder -> a HF safetensors folder.

Parameters are read from the distributed checkpoint in groups of at most `read_group_bytes`, converted to HF tensors
and streamed into safetensors files whose headers were planned up front: memory holds one group, never the model.
The folder loads with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from megarl.bridge.fused_experts import ExpertFuser, fused_specs
from megarl.bridge.model_bridge import Binding
from megarl.bridge.safetensors_io import HFCheckpoint, ShardedSafetensorsWriter, TensorSpec
from megarl.checkpoint.model_dir import (
    EXTRA_DIR,
    HF_DIR,
    MODEL_DIR,
    ModelCheckpointInfo,
    copy_hf_side_files,
    load_manifest,
)
from megarl.checkpoint.staging import check_destination, staged_folder
from megarl.checkpoint.verify import check_dist_checkpoint
from megarl.conversion.hf_to_mcore import ConversionReport
from megarl.conversion.meta_model import build_meta_model
from megarl.errors import UserError
from megarl.models.hf_config import config_dtype, dtype_name, language_model_part, load_hf_config, read_config_json
from megarl.models.registry import get_architecture
from megarl.runtime.distributed import single_process_megatron
from megarl.runtime.memory import trim_heap
from megarl.runtime.progress import progress_bar

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# Each group costs one distributed-checkpoint read (metadata included): 64 MB keeps the reads few and memory small.
DEFAULT_READ_GROUP_BYTES = 64 * 2**20


def _dtype_policy(manifest: list[TensorSpec] | None, default: torch.dtype, override: torch.dtype | None):
    """Each tensor goes back to its dtype in the source checkpoint; --dtype overrides floating-point tensors."""
    source = {spec.name: spec.dtype for spec in manifest or []}

    def dtype_of(name: str) -> torch.dtype:
        dtype = source.get(name, default)
        return override if override is not None and dtype.is_floating_point else dtype

    return dtype_of


def _check_manifest(manifest: list[TensorSpec] | None, planned: list[TensorSpec], src: Path) -> None:
    if manifest is None:
        return
    recorded = {spec.name: spec.shape for spec in manifest}
    planned_shapes = {spec.name: spec.shape for spec in planned}
    if recorded != planned_shapes:
        diff = sorted(set(recorded.items()) ^ set(planned_shapes.items()))[:3]
        raise UserError(
            f"{src / HF_DIR}/config.json describes other tensors than the checkpoint recorded in hf_tensors.json "
            f"(e.g. {diff}): was config.json edited after conversion?"
        )


def _groups(bindings: list[Binding], max_bytes: int) -> list[list[Binding]]:
    groups: list[list[Binding]] = [[]]
    size = 0
    for binding in bindings:
        nbytes = binding.param.nbytes
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(binding)
        size += nbytes
    return groups


def _without_prepended_axes(shard):
    """The same chunk with Megatron's stacked-layer axes as ordinary dims of size 1 (a view, same memory).

    Megatron loads tensors with prepended axes through a torch ShardedTensor spanning the whole layer grid, which
    a single process reading only some layers cannot satisfy; plain chunks are read by offset, one at a time.
    """
    axes = shard.prepend_axis_num
    if axes == 0:
        return shard
    local_shape = (1,) * axes + tuple(shard.local_shape)
    return replace(shard, data=shard.data.view(local_shape), local_shape=local_shape, prepend_axis_num=0)


@contextmanager
def _metadata_read_once(model_dir: Path) -> Iterator[None]:
    """Megatron's loader opens the checkpoint anew for every load call and unpickles its metadata (every item of
    the checkpoint) each time: 20% of a MoE conversion read in 64 MB groups. Here every group's load shares one
    reader, whose metadata is read once."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original = torch_strategy._get_filesystem_reader
    shared = original(model_dir, cache_metadata=True)

    def reader(checkpoint_dir, cache_metadata: bool = False):
        return (
            shared if Path(checkpoint_dir) == model_dir and cache_metadata else original(checkpoint_dir, cache_metadata)
        )

    torch_strategy._get_filesystem_reader = reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original


def _load_group(sharded_state_dict: dict, group: list[Binding], model_dir: Path) -> dict[str, torch.Tensor]:
    """Read the full (TP=1) values of a group of parameters from the distributed checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    values, request = {}, {}
    for binding in group:
        value = torch.empty(binding.param.shape, dtype=binding.param.dtype)
        entry = replace(sharded_state_dict[binding.param_name], data=value)  # a copy: the original holds meta data
        shards = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
        for index, shard in enumerate(shards):
            if shard.data.untyped_storage().data_ptr() != value.untyped_storage().data_ptr():
                raise RuntimeError(
                    f"{binding.param_name}: a checkpoint factory copied the parameter instead of viewing"
                )
            request[f"{binding.param_name}#{index}"] = _without_prepended_axes(shard)
        values[binding.param_name] = value
    # The request covers some layers of each stacked tensor only: skip the check that every shard is read.
    dist_checkpointing.load(request, str(model_dir), validate_access_integrity=False)
    return values


def convert_mcore_to_hf(
    src: str | Path,
    dst: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    read_group_bytes: int = DEFAULT_READ_GROUP_BYTES,
    overwrite: bool = False,
    show_progress: bool = True,
) -> ConversionReport:
    start = time.monotonic()
    src = Path(src)
    info = ModelCheckpointInfo.load(src)
    check_dist_checkpoint(src / MODEL_DIR)  # a lost or truncated .distcp shard, named before anything is read
    hf_config = load_hf_config(src / HF_DIR)
    arch = get_architecture(hf_config.model_type)
    arch.check_supported(hf_config)
    dst = check_destination(dst, overwrite, sources=(src,))
    manifest = load_manifest(src)
    dtype_of = _dtype_policy(manifest, config_dtype(hf_config), dtype)

    extra = HFCheckpoint(src / EXTRA_DIR) if (src / EXTRA_DIR).is_dir() else None

    # a vision-language checkpoint's language model goes back under its own names (hf_config.VISION_LANGUAGE), its
    # experts fused where the published checkpoints store them so (megarl/bridge/fused_experts.py)
    part = language_model_part(read_config_json(src / HF_DIR))
    stored = part.stored_name if part is not None else str
    fuser = ExpertFuser() if part is not None and part.fused_experts else None

    with single_process_megatron():
        meta = build_meta_model(arch, hf_config, info.vocab, info.dtype)
        specs = meta.hf_specs(dtype_of)
        _check_manifest(manifest, specs, src)
        specs = fused_specs(specs) if fuser is not None else specs
        specs = [replace(spec, name=stored(spec.name)) for spec in specs] + (extra.specs() if extra else [])
        sharded_state_dict = meta.chunk.sharded_state_dict()
        exported = [b for b in meta.bindings if b.mapping.export]
        with staged_folder(dst, overwrite) as tmp, _metadata_read_once(src / MODEL_DIR):
            writer = ShardedSafetensorsWriter(tmp, specs, max_shard_bytes)
            with progress_bar(len(exported), f"mcore -> hf {src.name}", show_progress) as advance:
                for group in _groups(exported, read_group_bytes):
                    trim_heap()
                    loaded = _load_group(sharded_state_dict, group, src / MODEL_DIR)
                    for binding in group:
                        tensors = meta.bridge.to_hf(binding, loaded.pop(binding.param_name), dtype_of)
                        if fuser is not None:
                            tensors = [item for name, tensor in tensors for item in fuser.add(name, tensor)]
                        writer.write_all((stored(name), tensor) for name, tensor in tensors)
                        advance(binding.param_name)
            if fuser is not None:
                fuser.check_done()
            for name in extra.names if extra else []:  # carried through unchanged (multi-token prediction)
                writer.write(name, extra.get(name))
            writer.close()
            copy_hf_side_files(src / HF_DIR, tmp)
            if dtype is not None:
                _set_config_dtype(tmp / "config.json", dtype)
    return ConversionReport(len(specs), sum(s.nbytes for s in specs), time.monotonic() - start, dst)


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    config = json.loads(path.read_text())
    config["dtype"] = dtype_name(dtype)
    config.pop("torch_dtype", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
