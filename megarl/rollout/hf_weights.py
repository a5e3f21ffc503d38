"""Load HF-named checkpoint tensors into a live transformers model, in place and exactly.

The trainer streams weights as buckets of `(hf_name, tensor)`, names exactly as `save_pretrained` writes them. The
in-memory layout of a transformers 5.x model can differ from the checkpoint: MoE experts are fused into 3-D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H] holds every expert's gate and up projections, `mlp.experts.down_proj`
[E, H, I] their down projections) and some names are renamed (Mixtral's `block_sparse_moe` is `mlp`).

We do not keep a table of our own for this. transformers describes each model's conversion as data: a list of
`WeightRenaming` and `WeightConverter` entries (`conversion_mapping.py`), applied by `from_pretrained`. Its loader
needs every expert of a fused tensor at once, while a bucket may hold any subset, so this module reads the same
entries and turns each checkpoint name into a *destination*: a region of one model tensor (a whole tensor, or for
a converter `MergeModulelist(dim=d)` + `Concatenate(dim=c)`: index `e` on dim d and a slice on dim c). A bucket
then writes each tensor into its region with one `copy_`, which gives the same bits as `from_pretrained` (same
values, same cast to the model dtype).

The plan is built once per model and checked: the checkpoint names are those transformers' own save path would
write for this model (tied weights removed, conversions reverted), each must map to exactly one region of the
right shape, and the regions must cover every model tensor exactly once. A converter whose operations this module
does not know fails at build time, naming it.

A bucket entry may also be a part of a checkpoint tensor (`NAME@DIM:START:STOP`, megarl/bridge/buckets.py: what
each TP rank of the trainer sends of its own shard): it is written into that slice of the tensor's region, and the
tensor counts as loaded once its parts have covered all of it.

Names a bucket may carry that the model does not hold are skipped and counted: derived buffers (rotary
`inv_freq`, recomputed from the config) and layers past `num_hidden_layers` (DeepSeek multi-token prediction).
Any other unknown name raises `UserError` naming the tensor.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from megarl.bridge.buckets import split_part_name
from megarl.errors import UserError

Index = tuple[int | slice, ...]

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Destination:
    """Where one checkpoint tensor lives in the model: `model_tensor[index]`, of shape `shape`."""

    target: str
    """Name of the model tensor (a key of `model.state_dict()`)."""
    index: Index
    """Region of the target; empty for the whole tensor."""
    shape: tuple[int, ...]
    """Shape of the checkpoint tensor (equal to the region's shape)."""


Part = tuple[int, int, int] | None
"""(dim, start, stop) of a part of a checkpoint tensor; None for the whole tensor."""


@dataclass
class LoadCounts:
    """What `WeightLoader.load` did since the last `reset`."""

    loaded: set[str] = field(default_factory=set)
    """Checkpoint names written into the model."""
    num_tensors: int = 0
    """Tensors written (a name sent twice counts twice)."""
    num_skipped: int = 0
    """Tensors ignored: derived buffers and layers the model does not hold."""
    part_spans: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Checkpoint names arriving in parts: the (dim, start, stop) written so far, disjoint and along one dim
    (`loaded` once they cover the tensor)."""


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and shapes `model.save_pretrained` would write, computed on the meta device (no copies)."""
    state = model.state_dict()
    for name in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(name, None)
    state = remove_tied_weights_from_state_dict(state, model)
    meta = {name: tensor.to("meta") for name, tensor in state.items()}
    return {name: tuple(tensor.shape) for name, tensor in revert_weight_conversion(model, meta).items()}


def _stack_and_concat_dims(converter: WeightConverter) -> tuple[int | None, int | None]:
    """The dims of a converter made of `MergeModulelist` (stack one tensor per module) then `Concatenate`."""
    stack_dim = concat_dim = None
    for op in converter.operations:
        if isinstance(op, MergeModulelist) and stack_dim is None and concat_dim is None:
            stack_dim = op.dim
        elif isinstance(op, Concatenate) and concat_dim is None:
            concat_dim = op.dim
        else:
            raise UserError(
                f"transformers converts {converter.source_patterns} -> {converter.target_patterns} with operations "
                f"{converter.operations}; the hf engine can load only MergeModulelist and/or Concatenate in place"
            )
    return stack_dim, concat_dim


def _converter_destinations(
    target: str,
    target_shape: tuple[int, ...],
    converter: WeightConverter,
    names_by_pattern: dict[str, list[str]],
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, Destination]:
    """Regions of one fused model tensor, one per checkpoint name, in the order `from_pretrained` builds them:
    source patterns in the converter's order, names of one pattern in natural order (expert 0, 1, ..., 10)."""
    stack_dim, concat_dim = _stack_and_concat_dims(converter)
    ndim = len(target_shape)
    stack_dim = None if stack_dim is None else stack_dim % ndim
    concat_dim = None if concat_dim is None else concat_dim % ndim
    if stack_dim is not None and stack_dim == concat_dim:
        raise UserError(f"{target}: transformers stacks and concatenates on the same dim; not loadable in place")
    destinations: dict[str, Destination] = {}
    offset = 0
    for pattern in converter.source_patterns:
        names = sorted(names_by_pattern.get(pattern, []), key=dot_natural_key)
        for position, name in enumerate(names):
            shape = shapes[name]
            index: list[int | slice] = [slice(None)] * ndim
            if stack_dim is not None:
                index[stack_dim] = position
            if concat_dim is not None:
                source_dim = concat_dim - (stack_dim is not None and stack_dim < concat_dim)
                width = shape[source_dim]
                index[concat_dim] = slice(offset, offset + width)
                if stack_dim is None or position == len(names) - 1:
                    offset += width
            destinations[name] = Destination(target, tuple(index), shape)
    return destinations


def build_plan(model: torch.nn.Module) -> dict[str, Destination]:
    """Checkpoint name -> destination for every tensor `save_pretrained` writes, checked to cover the model."""
    shapes = checkpoint_shapes(model)
    state = model.state_dict()
    transforms = get_model_conversion_mapping(model)  # what from_pretrained applies, legacy renamings included
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}

    plan: dict[str, Destination] = {}
    grouped: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # target -> pattern -> names
    converter_of_target: dict[str, WeightConverter] = {}
    for name, shape in shapes.items():
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
        if target not in state:
            raise RuntimeError(f"transformers maps checkpoint tensor {name} to {target}, which the model lacks")
        if pattern is None:
            plan[name] = Destination(target, (), shape)
        else:
            grouped[target][pattern].append(name)
            converter_of_target[target] = converter_of[pattern]
    for target, names_by_pattern in grouped.items():
        converter = converter_of_target[target]
        plan.update(_converter_destinations(target, tuple(state[target].shape), converter, names_by_pattern, shapes))
    check_plan(plan, state)
    return plan


def check_plan(plan: dict[str, Destination], state: dict[str, torch.Tensor]) -> None:
    """Every region has its checkpoint tensor's shape, no two names share a region, and the regions of each model
    tensor add up to all of it (with distinct regions that are disjoint by construction, this is exact cover)."""
    covered: dict[str, int] = defaultdict(int)
    seen: dict[tuple[str, str], str] = {}
    for name, dest in plan.items():
        region = state[dest.target][dest.index] if dest.index else state[dest.target]
        if tuple(region.shape) != dest.shape:
            raise RuntimeError(
                f"{name} has shape {dest.shape} but its region of {dest.target} has {tuple(region.shape)}"
            )
        key = (dest.target, repr(dest.index))
        if key in seen:
            raise RuntimeError(f"{name} and {seen[key]} both map to {dest.target}{list(dest.index)}")
        seen[key] = name
        covered[dest.target] += region.numel()
    # tied weights share storage: a tensor counts as covered if the tensor it aliases is
    storage_of = {name: (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape) for name, t in state.items()}
    covered_storage = {storage_of[target] for target, numel in covered.items() if numel == state[target].numel()}
    for target, tensor in state.items():
        if covered[target] > tensor.numel():
            raise RuntimeError(f"checkpoint regions of {target} overlap ({covered[target]} > {tensor.numel()})")
        if storage_of[target] not in covered_storage:
            raise RuntimeError(f"{target}: checkpoint tensors cover {covered[target]} of {tensor.numel()} elements")


class WeightLoader:
    """Writes buckets of checkpoint-named tensors into `model`'s tensors (built once per model)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.plan = build_plan(model)
        self._tensors = {name: model.get_parameter_or_buffer(name) for name in {d.target for d in self.plan.values()}}
        persistent = model.state_dict().keys()
        self._derived_leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_buffers() if n not in persistent}
        self._ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._num_layers: int | None = getattr(config, "num_hidden_layers", None)
        self.counts = LoadCounts()

    @property
    def names(self) -> list[str]:
        """Every checkpoint name this model takes."""
        return list(self.plan)

    def reset(self) -> None:
        self.counts = LoadCounts()

    def missing(self) -> list[str]:
        """Checkpoint names not loaded since the last `reset`."""
        return [name for name in self.plan if name not in self.counts.loaded]

    def is_skipped(self, name: str) -> bool:
        """A name the model does not hold on purpose: a derived buffer or a layer past num_hidden_layers."""
        if name.rsplit(".", 1)[-1] in self._derived_leaves:
            return True
        match = _LAYER_ID.search(name)
        if match and self._num_layers is not None and int(match.group(1)) >= self._num_layers:
            return True
        return any(pattern.search(name) for pattern in self._ignore)

    def destination(self, name: str) -> Destination | None:
        """Where `name` goes; None for a skipped name; UserError for an unknown one."""
        dest = self.plan.get(name)
        if dest is None and not self.is_skipped(name):
            close = difflib.get_close_matches(name, self.plan, n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise UserError(
                f"weight update: tensor {name!r} is not a checkpoint tensor of this "
                f"{type(self.model).__name__} ({len(self.plan)} known names){hint}"
            )
        return dest

    @torch.no_grad()
    def load(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into its region (cast to the model's dtype). Checks every name and shape first, so a bad
        bucket changes nothing. A delta bucket (megarl/workers/weight_delta.py wire format) is applied in place and
        its checksum verified."""
        from megarl.workers.weight_delta import bucket_to_delta

        bucket = list(bucket)
        delta = bucket_to_delta(bucket, lambda name: self._destination_shape(name))
        if delta is not None:
            self.apply_delta(delta)
            return
        writes, spans = [], {base: list(parts) for base, parts in self.counts.part_spans.items()}
        for name, tensor in bucket:
            found = self._find(name)
            if found is None:
                self.counts.num_skipped += 1
                continue
            base, dest, part = found
            if tuple(tensor.shape) != _part_shape(dest, part):
                raise UserError(
                    f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                    f"{_part_shape(dest, part)}"
                )
            if part is not None:
                _check_disjoint(base, part, spans.setdefault(base, []))
                spans[base].append(part)
            writes.append((base, dest, part, tensor))
        for base, dest, part, tensor in writes:
            self._region(dest, part).copy_(tensor)
            self._count(base, dest, part)

    def regions(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the model's tensor (a view) it is written into."""
        return {name: self._region(dest, None) for name, dest in self.plan.items()}

    def targets(self) -> list[torch.Tensor]:
        """The model's tensors that checkpoint tensors are written into."""
        return list(self._tensors.values())

    def record_written(self, names: Iterable[str]) -> None:
        """Count entries a sender wrote into the model's memory itself (megarl/rollout/shared_weights.py), with the
        checks `load` makes: known names, parts within bounds and disjoint. The bytes are already in place here: a
        failure fails the update, and the engine's worker then refuses to generate until a full one."""
        found = [self._find(name) for name in names]
        spans = {base: list(parts) for base, parts in self.counts.part_spans.items()}
        for where in filter(None, found):
            base, _, part = where
            if part is not None:
                _check_disjoint(base, part, spans.setdefault(base, []))
                spans[base].append(part)
        for where in found:
            if where is None:
                self.counts.num_skipped += 1
            else:
                self._count(*where)

    def _find(self, name: str) -> tuple[str, Destination, Part] | None:
        """(checkpoint name, its destination, the part or None) of a bucket entry's name; None for a skipped one."""
        split = split_part_name(name)
        base, part = split if split is not None else (name, None)
        dest = self.destination(base)
        if dest is None or part is None:
            return None if dest is None else (base, dest, None)
        dim, start, stop = part
        if not (dim < len(dest.shape) and 0 <= start < stop <= dest.shape[dim]):
            raise UserError(f"weight update: part {name!r} lies outside {base!r}, of shape {dest.shape}")
        return base, dest, part

    def _region(self, dest: Destination, part: Part) -> torch.Tensor:
        """The model's tensor (a view) that a checkpoint tensor, or a part of it, is written into."""
        target = self._tensors[dest.target]
        region = target[dest.index] if dest.index else target
        return region if part is None else region.narrow(part[0], part[1], part[2] - part[1])

    def _count(self, base: str, dest: Destination, part: Part) -> None:
        self.counts.num_tensors += 1
        if part is None:
            self.counts.loaded.add(base)
            return
        spans = self.counts.part_spans.setdefault(base, [])
        spans.append(part)  # (checked disjoint from the others before any copy)
        if sum(stop - start for _, start, stop in spans) == dest.shape[part[0]]:
            self.counts.loaded.add(base)

    def _destination_shape(self, name: str) -> tuple[int, ...]:
        found = self._find(name)
        if found is None:
            raise UserError(f"weight update: a delta for {name!r}, which this model does not hold")
        return _part_shape(found[1], found[2])

    @torch.no_grad()
    def apply_delta(self, delta) -> None:
        """A delta bucket (megarl/workers/weight_delta.py `DeltaBucket`) in place: each sent tensor's region of the
        model (or its part's) gets the changed elements, then the bucket's checksum is verified (DeltaMismatch
        otherwise)."""
        from megarl.workers.weight_delta import apply_delta

        found = {entry.name: self._find(entry.name) for entry in delta.entries}
        if None in found.values():  # skipped names: the checksum covers what the sender sent
            raise UserError(
                "weight update: a delta bucket names tensors this model does not hold "
                f"({sorted(name for name, where in found.items() if where is None)[:3]}); send such names whole"
            )
        spans = {base: list(parts) for base, parts in self.counts.part_spans.items()}
        for base, _, part in found.values():
            if part is not None:
                _check_disjoint(base, part, spans.setdefault(base, []))
                spans[base].append(part)
        apply_delta(delta, lambda name: self._region(found[name][1], found[name][2]))
        for base, dest, part in found.values():
            self._count(base, dest, part)


def _check_disjoint(base: str, part: tuple[int, int, int], written: list[tuple[int, int, int]]) -> None:
    """Parts of one tensor are slices along one dim that do not overlap: then they cover it exactly once when their
    lengths add up to its size."""
    dim, start, stop = part
    for other_dim, other_start, other_stop in written:
        if other_dim != dim or (start < other_stop and other_start < stop):
            raise UserError(
                f"weight update: the parts sent of {base!r} overlap ({base}@{dim}:{start}:{stop} and "
                f"{base}@{other_dim}:{other_start}:{other_stop})"
            )


def _part_shape(dest: Destination, part: Part) -> tuple[int, ...]:
    if part is None:
        return dest.shape
    dim, start, stop = part
    return (*dest.shape[:dim], stop - start, *dest.shape[dim + 1 :])
