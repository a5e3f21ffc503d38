"""The Batch: what moves between the controller and the role workers.

A dict of tensors that all share the first dimension (one row per sample) plus per-sample metadata (Python lists of
the same length). Conventions for token tensors, shape [batch, seq] and right-padded:
- `input_ids`: prompt followed by response, then padding;
- `attention_mask`: 1 on real tokens (prompt and response), 0 on padding;
- `response_mask`: 1 on response tokens, the ones a policy is trained on.
Per-token results (log-probs, values) are aligned with `input_ids`: column t is about token t (its log-prob given
the tokens before it); column 0 has no prediction and holds 0. Token tensors may have more dimensions: MoE rollouts
carry `routed_experts` [batch, seq, moe_layers, topk], the experts token t was routed to
(megarl/trainer/rollout_side/routing.py); splitting, trimming and padding treat them like any token tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.tensors.items()}
        sizes.update({name: len(values) for name, values in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields differ in length: {sizes}")

    def __len__(self) -> int:
        for tensor in self.tensors.values():
            return tensor.shape[0]
        for values in self.meta.values():
            return len(values)
        return 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.meta

    def with_tensors(self, **tensors: torch.Tensor) -> Batch:
        """A new batch with these tensors added or replaced (the others shared)."""
        return Batch({**self.tensors, **tensors}, dict(self.meta))

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        index = torch.as_tensor(indices, dtype=torch.long)
        meta = {name: [values[i] for i in index.tolist()] for name, values in self.meta.items()}
        return Batch({name: t[index] for name, t in self.tensors.items()}, meta)

    def split(self, num_parts: int) -> list[Batch]:
        """Contiguous parts whose sizes differ by at most one (data-parallel ranks get part i in rank order)."""
        bounds = [len(self) * i // num_parts for i in range(num_parts + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(num_parts)]

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        batches = [b for b in batches if len(b) or b.tensors or b.meta]
        if not batches:
            return Batch()
        names, meta_names = set(batches[0].tensors), set(batches[0].meta)
        for batch in batches:
            if set(batch.tensors) != names or set(batch.meta) != meta_names:
                raise ValueError("batches to concatenate must have the same fields")
        tensors = {name: _cat_padded([b.tensors[name] for b in batches]) for name in batches[0].tensors}
        meta = {name: [v for b in batches for v in b.meta[name]] for name in batches[0].meta}
        return Batch(tensors, meta)

    # -- token views ----------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per sample (prompt + response)."""
        return self.tensors["attention_mask"].sum(dim=1)

    def trim(self) -> Batch:
        """Drop padding columns that no sample uses (token tensors only: those as wide as input_ids)."""
        width = int(self.lengths.max().item()) if len(self) else 0  # one host sync, outside any step
        full = self.tensors["input_ids"].shape[1]
        return Batch(
            {n: t[:, :width] if t.dim() >= 2 and t.shape[1] == full else t for n, t in self.tensors.items()},
            dict(self.meta),
        )


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along rows; token tensors of different widths are right-padded with zeros first."""
    if tensors[0].dim() >= 2 and len({t.shape[1] for t in tensors}) > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors]
    return torch.cat(tensors)
