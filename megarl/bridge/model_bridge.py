"""An architecture's weight table bound to the parameters of one rank's Megatron-Core model chunks.

Binding is driven by the model: every parameter (and persistent buffer, e.g. the router's expert bias) of every
chunk finds exactly one mapping; one without is a bug in the table, reported at once. Global ids come from the
modules themselves: a decoder layer's `layer_number` (so every pipeline layout Megatron supports binds correctly)
and an MoE layer's `local_expert_indices` (expert parallelism: global id = ep_rank * local experts + local id).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field, replace

import torch

from megarl.bridge.buckets import part_name
from megarl.bridge.mappings import TP_DIM_FROM_MODEL, Mapping, VocabInfo, whole_tensor_name
from megarl.errors import UserError

# indices inside Megatron names: whole dot-separated segments ('layers.3.'), or numbered grouped-GEMM weights
# ('linear_fc1.weight3'); placeholders in templates ('{layer}', 'weight{expert}')
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|(?<=\.weight)\d+$|(?<=\.bias)\d+$")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _skeleton(name: str) -> str:
    """A name with its indices blanked: 'decoder.layers.3.mlp.x' and 'decoder.layers.{layer}.mlp.x' agree."""
    return _PLACEHOLDER.sub("#", _INDEX.sub("#", name))


@dataclass(frozen=True)
class Binding:
    """One mapping bound to one local parameter: which HF tensors it reads and writes."""

    mapping: Mapping
    param_name: str
    """Parameter name inside its chunk (local layer and expert indices)."""
    hf_names: tuple[str, ...]
    """HF tensor names (global layer and expert indices)."""
    chunk: int
    """Index of the virtual pipeline chunk that holds the parameter."""
    param: torch.Tensor = field(compare=False, repr=False)

    @property
    def expert(self) -> bool:
        """Expert weights are split by expert tensor parallelism (ETP), the rest by tensor parallelism."""
        return "{expert}" in self.mapping.mcore


def chunk_layer_ids(chunk) -> list[int]:
    """Global (0-based) id of each decoder layer of a chunk, in local order."""
    decoder = getattr(chunk, "decoder", None)
    return [layer.layer_number - 1 for layer in decoder.layers] if decoder is not None else []


def _global_ids(chunk, local: dict[str, str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    if "layer" in local:
        layer = chunk.decoder.layers[int(local["layer"])]
        ids["layer"] = layer.layer_number - 1
        if "expert" in local:
            ids["expert"] = layer.mlp.local_expert_indices[int(local["expert"])]
    return ids


def _state_tensors(chunk) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, as a checkpoint holds them (not Megatron's `_extra_state` objects)."""
    return [(n, t) for n, t in chunk.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)]


class ModelBridge:
    """The weight table of an architecture, bound to this rank's chunks; converts tensors both ways.

    param_aliases: name parts a layer spec uses for parameters the table names otherwise (Transformer Engine's
    fused norms), mapped to the table's spelling.
    """

    def __init__(
        self,
        mappings: Sequence[Mapping],
        chunks: Sequence[torch.nn.Module],
        vocab: VocabInfo,
        param_aliases: MappingType[str, str] | None = None,
        load_groups: Sequence[tuple[str, ...]] = (),
    ):
        from megatron.core import parallel_state as ps

        self.vocab = vocab
        self.load_groups = tuple(load_groups)
        """Tensors that must share a weight-sync bucket (Architecture.load_groups)."""
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self._aliases = dict(param_aliases or {})
        self._by_skeleton: dict[str, Mapping] = {}
        for mapping in mappings:
            if self._by_skeleton.setdefault(_skeleton(mapping.mcore), mapping) is not mapping:
                raise RuntimeError(f"the weight table maps {mapping.mcore} twice")
        self.bindings: list[Binding] = [
            self._bind(name, tensor, index, chunk)
            for index, chunk in enumerate(chunks)
            for name, tensor in _state_tensors(chunk)
        ]

    def _canonical(self, name: str) -> str:
        for alias, canonical in self._aliases.items():
            if alias in name:
                return name.replace(alias, canonical)
        return name

    def _bind(self, name: str, param: torch.Tensor, chunk_index: int, chunk) -> Binding:
        canonical = self._canonical(name)
        mapping = self._by_skeleton.get(_skeleton(canonical))
        if mapping is None:
            raise RuntimeError(f"Megatron parameter {name!r} has no mapping in the architecture's weight table")
        mapping = self._check_split(name, param, mapping, recorded=chunk.config.perform_initialization)
        local = _template_regex(mapping.mcore).fullmatch(canonical).groupdict()
        # Megatron names count layers within the chunk and experts within the EP rank; HF names count globally.
        return Binding(mapping, name, mapping.hf_names(**_global_ids(chunk, local)), chunk_index, param)

    def _check_split(self, name: str, param: torch.Tensor, mapping: Mapping, recorded: bool) -> Mapping:
        """The table's TP split dim must be Megatron's. Megatron records it only when it initializes a weight:
        uninitialized (meta) models carry no record, which is harmless where nothing is split."""
        if not recorded:
            if max(self.tp_size, self.etp_size) > 1:
                raise RuntimeError(f"{name}: a model split across TP must be built with weight initialization")
            return replace(mapping, tp_dim=None) if mapping.tp_dim == TP_DIM_FROM_MODEL else mapping
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        if mapping.tp_dim == TP_DIM_FROM_MODEL:
            mapping = replace(mapping, tp_dim=split)
        if mapping.tp_dim != split:
            raise RuntimeError(f"{name}: the weight table splits dim {mapping.tp_dim} across TP, Megatron dim {split}")
        return mapping

    def tp_rank_and_size(self, binding: Binding) -> tuple[int, int]:
        return (self.etp_rank, self.etp_size) if binding.expert else (self.tp_rank, self.tp_size)

    # -- tensor conversion, shared by live import/export and the offline converter --------------------------------

    def to_mcore(self, binding: Binding, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full (TP=1) Megatron tensor of a binding, in the parameter's dtype, from HF tensors `read(name)`."""
        full = binding.mapping.hf_to_mcore([read(name) for name in binding.hf_names], self.vocab)
        return full.to(binding.param.dtype)

    def to_hf(
        self, binding: Binding, full: torch.Tensor, dtype_of: Callable[[str], torch.dtype]
    ) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs from a binding's full Megatron tensor, each in its HF dtype (a row of a stacked
        tensor, `name[i]`, in the whole tensor's)."""
        tensors = binding.mapping.mcore_to_hf(full, self.vocab)
        return [
            (name, t.to(dtype_of(whole_tensor_name(name))).contiguous()) for name, t in zip(binding.hf_names, tensors)
        ]

    def to_hf_parts(
        self, binding: Binding, dtype_of: Callable[[str], torch.dtype]
    ) -> list[tuple[str, torch.Tensor]] | None:
        """This rank's parts of the binding's HF tensors, from its own shard (`Mapping.hf_parts`), as
        (`part_name`, part) pairs in their HF dtypes; None where the layout needs the shards of every TP rank."""
        rank, size = self.tp_rank_and_size(binding)
        parts = binding.mapping.hf_parts(binding.param.detach(), rank, size, self.vocab)
        if parts is None:
            return None
        return [
            (part_name(name, where), t.to(dtype_of(name)).contiguous())
            for name, (where, t) in zip(binding.hf_names, parts)
        ]

    def local_shard(self, binding: Binding, full: torch.Tensor) -> torch.Tensor:
        rank, size = self.tp_rank_and_size(binding)
        return self.check_local(binding, binding.mapping.shard(full, rank, size))

    def check_local(self, binding: Binding, local: torch.Tensor) -> torch.Tensor:
        """`local` if it has the parameter's shape; else a UserError naming the HF tensors and both shapes."""
        rank, size = self.tp_rank_and_size(binding)
        if local.shape != binding.param.shape:
            raise UserError(
                f"{', '.join(binding.hf_names)} give {binding.param_name} the shape {tuple(local.shape)} on TP rank "
                f"{rank}/{size}, but the model built from config.json expects "
                f"{tuple(binding.param.shape)}: do the weights belong to this config?"
            )
        return local

    def hf_names(self, exported_only: bool = False) -> list[str]:
        """The checkpoint tensors the bound parameters read (or write), stacked tensors once by their whole name."""
        names = [n for b in self.bindings if b.mapping.export or not exported_only for n in b.hf_names]
        return list(dict.fromkeys(whole_tensor_name(n) for n in names))


@functools.cache
def _template_regex(template: str) -> re.Pattern:
    """'decoder.layers.{layer}.x' -> a regex capturing the index as group 'layer'."""
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts)))
