"""Writing a layer's routed experts fused, as Qwen3.5's published checkpoints store them.

The weight tables name experts one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`), what transformers' `save_pretrained` writes. Qwen3.5 as published stores each layer's experts in two
tensors instead: `mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden] (each expert's gate rows, then its up rows)
and `mlp.experts.down_proj` [experts, hidden, ffn]. The reader lists such a checkpoint one tensor per expert
(HFCheckpoint split_fused_experts); `megarl convert` writes a vision-language Qwen3.5 back in the published layout
with `fused_specs` (the files' plan) and `ExpertFuser` (the stream): rows `name[e]` the sharded writer joins.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from megarl.bridge.safetensors_io import TensorSpec

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _fused_name(prefix: str, projection: str) -> str:
    return prefix + ("down_proj" if projection == "down_proj" else "gate_up_proj")


def fused_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The specs with each layer's per-expert tensors replaced by the two fused ones, each at the place of its first
    expert's tensor (where the writer's queue expects it: it completes before anything after it arrives)."""
    experts: dict[str, int] = {}
    for spec in specs:
        if (match := _PER_EXPERT.fullmatch(spec.name)) is not None:
            experts[match[1]] = max(experts.get(match[1], 0), int(match[2]) + 1)
    out: dict[str, TensorSpec] = {}
    for spec in specs:
        match = _PER_EXPERT.fullmatch(spec.name)
        if match is None:
            out[spec.name] = spec
            continue
        name = _fused_name(match[1], match[3])
        rows, columns = spec.shape
        rows = rows if match[3] == "down_proj" else 2 * rows  # gate_up_proj: gate's rows, then up's
        out.setdefault(name, replace(spec, name=name, shape=(experts[match[1]], rows, columns)))
    return list(out.values())


class ExpertFuser:
    """Turns per-expert tensors into rows of the fused ones (`gate_up_proj[e]` once expert e's gate and up have
    both come); every other tensor passes through."""

    def __init__(self):
        self._gates: dict[tuple[str, int], torch.Tensor] = {}
        self._ups: dict[tuple[str, int], torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            return
        prefix, expert, projection = match[1], int(match[2]), match[3]
        if projection == "down_proj":
            yield f"{prefix}down_proj[{expert}]", tensor
            return
        (self._gates if projection == "gate_proj" else self._ups)[prefix, expert] = tensor
        if (prefix, expert) in self._gates and (prefix, expert) in self._ups:
            gate, up = self._gates.pop((prefix, expert)), self._ups.pop((prefix, expert))
            yield f"{prefix}gate_up_proj[{expert}]", torch.cat([gate, up])

    def check_done(self) -> None:
        """Every expert's gate met its up (a bug otherwise: the writer would miss rows)."""
        left = sorted({f"{p}{e}" for p, e in [*self._gates, *self._ups]})
        if left:
            raise RuntimeError(f"experts with a gate or up projection but not both: {left[:3]}")
