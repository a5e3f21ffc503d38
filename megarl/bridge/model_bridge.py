"""An architecture's weight table bound to the parameters of one rank's Megatron-Core model chunks.

Binding is driven by the model: every parameter of every chunk finds exactly one mapping (a parameter without one
is a bug in the table, reported at once). Layer ids come from the modules themselves (`layer_number` is global),
so every pipeline layout Megatron supports, virtual stages and uneven first/last stages included, binds correctly.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megarl.bridge.mappings import Mapping, VocabInfo
from megarl.errors import UserError

_INDEX = re.compile(r"\.(\d+)\.")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _skeleton(name: str) -> str:
    """A name with its indices blanked: 'decoder.layers.3.mlp.x' and 'decoder.layers.{layer}.mlp.x' agree."""
    return _PLACEHOLDER.sub("#", _INDEX.sub(".#.", name))


def _te_renames() -> dict[str, str]:
    """Transformer Engine's fused norm+linear modules own the layer norms under other names. Megatron's local spec
    declares the correspondence (for checkpoint compatibility); invert it to read TE names as local ones."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    return {te: local for local, te in keys_map.items()}


@dataclass(frozen=True)
class Binding:
    """One mapping bound to one local parameter: which HF tensors it reads and writes."""

    mapping: Mapping
    param_name: str
    """Parameter name inside its chunk (local layer index)."""
    hf_names: tuple[str, ...]
    """HF tensor names (global layer index)."""
    chunk: int
    """Index of the virtual pipeline chunk that holds the parameter."""
    param: torch.nn.Parameter = field(compare=False, repr=False)


def chunk_layer_ids(chunk) -> list[int]:
    """Global (0-based) id of each decoder layer of a chunk, in local order."""
    decoder = getattr(chunk, "decoder", None)
    return [layer.layer_number - 1 for layer in decoder.layers] if decoder is not None else []


class ModelBridge:
    """The weight table of an architecture, bound to this rank's chunks; converts tensors both ways."""

    def __init__(self, mappings: Sequence[Mapping], chunks: Sequence[torch.nn.Module], vocab: VocabInfo):
        self.vocab = vocab
        self.tp_rank, self.tp_size = _tp_rank_and_size()
        self._by_skeleton: dict[str, Mapping] = {}
        for mapping in mappings:
            if self._by_skeleton.setdefault(_skeleton(mapping.mcore), mapping) is not mapping:
                raise RuntimeError(f"the weight table maps {mapping.mcore} twice")
        self._te_renames = _te_renames()
        self.bindings: list[Binding] = [
            self._bind(name, param, index, chunk_layer_ids(chunk))
            for index, chunk in enumerate(chunks)
            for name, param in chunk.named_parameters()
        ]

    def _canonical(self, name: str) -> str:
        for te_part, local_part in self._te_renames.items():
            if te_part in name:
                return name.replace(te_part, local_part)
        return name

    def _bind(self, name: str, param: torch.nn.Parameter, chunk: int, layer_ids: list[int]) -> Binding:
        canonical = self._canonical(name)
        mapping = self._by_skeleton.get(_skeleton(canonical))
        if mapping is None:
            raise RuntimeError(f"Megatron parameter {name!r} has no mapping in the architecture's weight table")
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        if mapping.tp_dim != split:
            raise RuntimeError(f"{name}: the weight table splits dim {mapping.tp_dim} across TP, Megatron dim {split}")
        local = _template_regex(mapping.mcore).fullmatch(canonical).groupdict()
        # Megatron names count layers within the chunk; HF names count them across the whole model.
        global_ids = {"layer": layer_ids[int(local["layer"])]} if "layer" in local else {}
        return Binding(mapping, name, mapping.hf_names(**global_ids), chunk, param)

    # -- tensor conversion, shared by live import/export and the offline converter --------------------------------

    def to_mcore(self, binding: Binding, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full (TP=1) Megatron tensor of a binding, in the parameter's dtype, from HF tensors `read(name)`."""
        full = binding.mapping.hf_to_mcore([read(name) for name in binding.hf_names], self.vocab)
        return full.to(binding.param.dtype)

    def to_hf(
        self, binding: Binding, full: torch.Tensor, dtype_of: Callable[[str], torch.dtype]
    ) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs from a binding's full Megatron tensor, each in its HF dtype."""
        tensors = binding.mapping.mcore_to_hf(full, self.vocab)
        return [(name, t.to(dtype_of(name)).contiguous()) for name, t in zip(binding.hf_names, tensors)]

    def local_shard(self, binding: Binding, full: torch.Tensor) -> torch.Tensor:
        local = binding.mapping.shard(full, self.tp_rank, self.tp_size)
        if local.shape != binding.param.shape:
            raise UserError(
                f"{', '.join(binding.hf_names)} give {binding.param_name} the shape {tuple(local.shape)} on TP rank "
                f"{self.tp_rank}/{self.tp_size}, but the model built from config.json expects "
                f"{tuple(binding.param.shape)}: do the weights belong to this config?"
            )
        return local

    def hf_names(self, exported_only: bool = False) -> list[str]:
        return [n for b in self.bindings if b.mapping.export or not exported_only for n in b.hf_names]


@functools.cache
def _template_regex(template: str) -> re.Pattern:
    """'decoder.layers.{layer}.x' -> a regex capturing the index as group 'layer'."""
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts)))


def _tp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
