"""Import: HF safetensors -> the local shards of a live Megatron-Core model, at any TP/PP/VPP layout."""

from __future__ import annotations

from collections.abc import Collection

import torch

from megarl.bridge.model_bridge import ModelBridge
from megarl.bridge.safetensors_io import HFCheckpoint


@torch.no_grad()
def load_hf_weights(bridge: ModelBridge, checkpoint: HFCheckpoint, missing_ok: Collection[str] = ()) -> list[str]:
    """Copy every parameter of the bridged chunks from the checkpoint. Each rank reads only the HF tensors its own
    parameters need, one mapping at a time, and of a tensor split across TP ranks only its own slice where the
    layout allows (`Mapping.hf_slices`: TP=8 reads the checkpoint about once, not 8 times).

    missing_ok: HF names the checkpoint may lack (e.g. a value head initialized fresh when a critic starts from a
    language model); such parameters keep their initialization. Returns the HF names that were missing."""
    missing = []
    for binding in bridge.bindings:
        absent = [name for name in binding.hf_names if name not in checkpoint]
        if absent and set(absent) <= set(missing_ok):
            missing += absent
            continue
        rank, size = bridge.tp_rank_and_size(binding)
        shapes = [checkpoint.spec(name).shape for name in binding.hf_names]
        slices = binding.mapping.hf_slices(rank, size, shapes)
        if slices is None:
            local = bridge.local_shard(binding, bridge.to_mcore(binding, checkpoint.get))
        else:
            slice_of = dict(zip(binding.hf_names, slices))
            full = bridge.to_mcore(binding, lambda name, of=slice_of: checkpoint.get_slice(name, *of[name]))
            local = bridge.check_local(binding, full)
        binding.param.copy_(local)
    return missing
