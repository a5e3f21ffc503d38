"""The whole model on the meta device (TP=PP=1, no memory): the shape oracle both converter directions share.

It tells the converters, before any weight is read, which Megatron parameters exist, which HF tensors (names,
shapes) they map to, and the keys and offsets of the Megatron checkpoint (through Megatron's own sharded state
dict, so converted checkpoints are exactly what a live model saves and loads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.bridge.mappings import VocabInfo
from megarl.bridge.model_bridge import Binding, ModelBridge
from megarl.bridge.safetensors_io import HFCheckpoint, TensorSpec, join_stacked_rows
from megarl.errors import UserError
from megarl.models.architecture import Architecture
from megarl.models.builder import build_bridge, build_model
from megarl.runtime.parallel import ParallelConfig


@dataclass
class MetaModel:
    chunk: torch.nn.Module
    bridge: ModelBridge

    def __post_init__(self) -> None:
        self._by_name = {b.param_name: b for b in self.bridge.bindings}

    @property
    def bindings(self) -> list[Binding]:
        return self.bridge.bindings

    def binding(self, param_name: str) -> Binding:
        return self._by_name[param_name]

    def hf_specs(self, dtype_of: Callable[[str], torch.dtype]) -> list[TensorSpec]:
        """The HF tensors an export writes (name, dtype, shape), in export order (tensors stacked over experts whole,
        where their first row comes)."""
        specs = []
        for binding in self.bindings:
            if binding.mapping.export:
                for name, tensor in self.bridge.to_hf(binding, binding.param, dtype_of):
                    specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape)))
        return join_stacked_rows(specs)


def build_meta_model(arch: Architecture, hf_config, vocab: VocabInfo, dtype: torch.dtype) -> MetaModel:
    """Needs Megatron's parallel state for one process (see `single_process_megatron`)."""
    (chunk,) = build_model(arch, hf_config, ParallelConfig(), vocab, dtype, meta=True)
    return MetaModel(chunk, build_bridge(arch, hf_config, [chunk], vocab))


def check_checkpoint_matches(checkpoint: HFCheckpoint, expected: list[TensorSpec], config_path: str) -> None:
    """Every tensor the model needs is in the checkpoint with the right shape, and nothing else is (but for the
    derived tensors the caller already left out of `checkpoint.names`)."""
    present = {spec.name: spec for spec in checkpoint.specs()}
    wanted = {spec.name: spec for spec in expected}
    missing = [name for name in wanted if name not in present]
    unexpected = [name for name in present if name not in wanted]
    wrong = [
        f"{name} {present[name].shape} (expected {wanted[name].shape})"
        for name in wanted
        if name in present and present[name].shape != wanted[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
    if wrong:
        problems.append(f"{len(wrong)} tensors with the wrong shape (e.g. {'; '.join(wrong[:3])})")
    if problems:
        raise UserError(
            f"the weights in {checkpoint.folder} do not match the model described by {config_path}: "
            + "; ".join(problems)
        )
