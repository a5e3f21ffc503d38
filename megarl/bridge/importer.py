"""Import: HF safetensors -> the local shards of a live Megatron-Core model, at any TP/PP/VPP layout."""

from __future__ import annotations

import torch

from megarl.bridge.model_bridge import ModelBridge
from megarl.bridge.safetensors_io import HFCheckpoint


@torch.no_grad()
def load_hf_weights(bridge: ModelBridge, checkpoint: HFCheckpoint) -> None:
    """Copy every parameter of the bridged chunks from the checkpoint. Each rank reads only the HF tensors its own
    parameters need, one mapping at a time."""
    for binding in bridge.bindings:
        full = bridge.to_mcore(binding, checkpoint.get)
        binding.param.copy_(bridge.local_shard(binding, full))
