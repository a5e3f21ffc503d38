"""Mapping primitives: how one Megatron-Core parameter relates to one or more HF checkpoint tensors.

Every primitive is invertible and works in two layers:
- layout: `hf_to_mcore` turns the HF tensors into the *full* Megatron tensor (the one a TP=1 model holds), and
  `mcore_to_hf` turns it back;
- sharding: `shard` cuts the full tensor into what TP rank r of T holds, and `unshard` rebuilds it from all T shards.
Import reads a table of these left to right, export right to left; nothing else in the bridge knows a layout.

Where TP rank r's shard is the r-th of equal parts of every HF tensor along one dim (`even_split_dim`), a rank reads
only those slices on import (`hf_slices`) and sends only its own parts on export (`hf_parts`), with no gather.

Names are templates: "{layer}" is the decoder layer index (local in Megatron names, global in HF names). A HF name
ending in "[{expert}]" is one slice of a tensor stacked over experts along dim 0 (gpt-oss stores each projection of
all of a layer's experts as one tensor): `stacked_row` splits it; the checkpoint reader reads the slice, and export
joins a layer's slices back into the whole tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TP_DIM_FROM_MODEL = "from-model"
"""A `tp_dim` meaning: split as the Megatron parameter says (its layout differs between layer specs)."""


@dataclass(frozen=True)
class VocabInfo:
    """The tokenizer vocabulary and the padded size Megatron's vocab-parallel layers use."""

    size: int
    padded_size: int


def pad_vocab_size(vocab_size: int, multiple: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * tp` so every TP rank holds an
    equal slice of the embedding and output layer."""
    step = multiple * tp
    return -(-vocab_size // step) * step


_STACKED_ROW = re.compile(r"(.+)\[(\d+)\]")


def stacked_row(name: str) -> tuple[str, int] | None:
    """('model.layers.0.mlp.experts.down_proj', 3) for 'model.layers.0.mlp.experts.down_proj[3]'; None for a name
    that is a whole tensor."""
    match = _STACKED_ROW.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


def whole_tensor_name(name: str) -> str:
    """The checkpoint tensor a HF name is part of (itself, or the stacked tensor of a row)."""
    row = stacked_row(name)
    return row[0] if row else name


Slice = tuple[int, int, int]
"""(dim, start, stop) of one HF tensor."""


def _even_slices(shapes: Sequence[tuple[int, ...]], dim: int, rank: int, size: int) -> list[Slice] | None:
    """Part `rank` of `size` equal parts of each tensor along `dim` (None when a tensor does not divide evenly)."""
    if any(len(shape) <= dim or shape[dim] % size for shape in shapes):
        return None
    return [(dim, shape[dim] // size * rank, shape[dim] // size * (rank + 1)) for shape in shapes]


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter <-> HF tensors with the same values (the identity layout)."""

    mcore: str
    """Megatron parameter name (local spec naming); "{layer}" stands for the decoder layer index."""
    hf: tuple[str, ...]
    """HF checkpoint tensor names, in the order `hf_to_mcore` takes them."""
    tp_dim: int | str | None = None
    """Dimension split across tensor-parallel ranks; None when every TP rank holds the whole tensor;
    TP_DIM_FROM_MODEL to take it from the parameter when it is bound."""
    export: bool = True
    """False for import-only aliases (a tied output layer reads the embedding but is never written back)."""

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        (tensor,) = hf
        return tensor

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        return [full]

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        if self.tp_dim is None or tp_size == 1:
            return full
        return full.chunk(tp_size, dim=self.tp_dim)[tp_rank]

    def even_split_dim(self, tp_size: int) -> int | None:
        """The HF dim along which TP rank r of `tp_size` holds the r-th of `tp_size` equal parts of every HF tensor
        of this mapping, and `mcore_to_hf` of its shard alone gives those parts; None where a rank's share is not
        such a slice (the layout needs every shard)."""
        return self.tp_dim if isinstance(self.tp_dim, int) and len(self.hf) == 1 else None

    def hf_slices(self, tp_rank: int, tp_size: int, shapes: Sequence[tuple[int, ...]]) -> list[Slice] | None:
        """The part of each HF tensor whose `hf_to_mcore` is TP rank `tp_rank`'s shard, as (dim, start, stop), so a
        rank reads only its slice of the checkpoint; None: read whole tensors and `shard` (the layout needs it)."""
        dim = self.even_split_dim(tp_size) if tp_size > 1 and self.tp_dim is not None else None
        return None if dim is None else _even_slices(shapes, dim, tp_rank, tp_size)

    def hf_parts(
        self, shard: torch.Tensor, tp_rank: int, tp_size: int, vocab: VocabInfo
    ) -> list[tuple[Slice, torch.Tensor]] | None:
        """TP rank `tp_rank`'s part of each HF tensor, from its own shard alone, in `hf` order: (where it lies in
        the whole HF tensor, the part), so that export needs no gather; None where the layout needs every shard.
        The same answer on every rank of a TP group (it depends on the mapping and `tp_size` only)."""
        dim = self.even_split_dim(tp_size) if tp_size > 1 and self.tp_dim is not None else None
        if dim is None:
            return None
        parts = self.mcore_to_hf(shard, vocab)
        return [((dim, part.shape[dim] * tp_rank, part.shape[dim] * (tp_rank + 1)), part) for part in parts]

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        return torch.cat(list(shards), dim=self.tp_dim)

    def hf_names(self, **indices: int | None) -> tuple[str, ...]:
        """The HF names for global indices, e.g. hf_names(layer=7)."""
        return tuple(name.format(**indices) for name in self.hf)


@dataclass(frozen=True)
class Direct(Mapping):
    """Same tensor on both sides; split along `tp_dim` or replicated."""


@dataclass(frozen=True)
class VocabRows(Mapping):
    """Embedding or output-layer rows: zero-padded to the padded vocabulary on import, stripped on export."""

    tp_dim: int | None = 0

    def even_split_dim(self, tp_size: int) -> int | None:
        return None  # the padding rows belong to the last ranks: import reads whole tensors, then `shard`

    def hf_parts(
        self, shard: torch.Tensor, tp_rank: int, tp_size: int, vocab: VocabInfo
    ) -> list[tuple[Slice, torch.Tensor]] | None:
        if tp_size == 1 or self.tp_dim is None:
            return None
        # rank r holds padded rows [r * n, (r + 1) * n); the HF tensor has the first `vocab.size` of them
        start = shard.shape[0] * tp_rank
        stop = min(start + shard.shape[0], vocab.size)
        return [((0, start, stop), shard[: stop - start])] if stop > start else []  # [] : padding rows only

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        (tensor,) = hf
        if tensor.shape[0] != vocab.size:
            raise ValueError(f"{self.hf[0]} has {tensor.shape[0]} rows but the config's vocab_size is {vocab.size}")
        padding = tensor.new_zeros((vocab.padded_size - vocab.size, *tensor.shape[1:]))
        return torch.cat([tensor, padding]) if padding.numel() else tensor

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        return [full[: vocab.size]]


@dataclass(frozen=True)
class QKV(Mapping):
    """HF q/k/v projections <-> Megatron's fused `linear_qkv`, laid out per query group:
    [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]. TP splits whole groups."""

    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    tp_dim: int | None = 0

    def _group_rows(self) -> list[int]:
        return [self.num_heads // self.num_kv_heads * self.head_dim, self.head_dim, self.head_dim]

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        rest = hf[0].shape[1:]  # any number of whole query groups: all of them, or one TP rank's
        groups = [t.reshape(-1, rows, *rest) for t, rows in zip(hf, self._group_rows())]
        return torch.cat(groups, dim=1).reshape(-1, *rest)

    def even_split_dim(self, tp_size: int) -> int | None:
        # TP rank r holds query groups [r * G / tp, (r + 1) * G / tp): the same rows of q, k and v.
        return None if self.num_kv_heads % tp_size else 0

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        rest = full.shape[1:]  # any number of whole query groups: all of them, or one TP rank's
        grouped = full.reshape(-1, sum(self._group_rows()), *rest)
        return [part.reshape(-1, *rest) for part in grouped.split(self._group_rows(), dim=1)]


@dataclass(frozen=True)
class GateUp(Mapping):
    """HF gate and up projections <-> Megatron's `linear_fc1`. The full tensor is [gate; up]; TP rank r holds
    [gate_r; up_r], so each rank's SwiGLU sees matching halves."""

    tp_dim: int | None = 0

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        return torch.cat(list(hf), dim=0)

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        return list(full.chunk(2, dim=0))

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])

    def even_split_dim(self, tp_size: int) -> int | None:
        return 0 if len(self.hf) == 2 else None  # a shard is [gate_r; up_r]: rows r of gate and of up

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]  # already [gate; up]: no copy
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])


@dataclass(frozen=True)
class InterleavedGateUp(GateUp):
    """gpt-oss experts: gate and up are the even and odd columns of one HF tensor `gate_up_proj` [hidden, 2 x ffn]
    (weights stored input-major, `transposed`) or of its bias [2 x ffn] <-> Megatron's [gate; up] `linear_fc1`."""

    transposed: bool = False

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        (tensor,) = hf
        rows = tensor.t() if self.transposed else tensor
        return torch.cat([rows[0::2], rows[1::2]])

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        gate, up = full.chunk(2, dim=0)
        rows = torch.stack([gate, up], dim=1).reshape(full.shape)
        return [rows.t() if self.transposed else rows]

    def even_split_dim(self, tp_size: int) -> int | None:
        return None


@dataclass(frozen=True)
class Transposed(Mapping):
    """A weight the HF checkpoint stores input-major ([in, out]: gpt-oss `experts.down_proj`) <-> Megatron's
    [out, in]."""

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        (tensor,) = hf
        return tensor.t()

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        return [full.t()]

    def even_split_dim(self, tp_size: int) -> int | None:
        return None


@dataclass(frozen=True)
class Sections(Mapping):
    """Megatron rows made of consecutive sections, each split across TP ranks on its own (Gated DeltaNet's conv1d:
    q, k and v channels; its in_proj: q, k, v, z, b, a): TP rank r holds the r-th part of every section, in order.
    `sections`: the full row count of each. The HF side is one tensor holding them all, or consecutive tensors of
    whole sections (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): `sections_per_hf_tensor`."""

    sections: tuple[int, ...] = ()
    sections_per_hf_tensor: tuple[int, ...] = ()
    """How many consecutive sections each HF tensor holds; empty: one tensor holds all of them."""
    tp_dim: int | None = 0

    def _hf_rows(self) -> list[int]:
        counts, rows, start = self.sections_per_hf_tensor or (len(self.sections),), [], 0
        for count in counts:
            rows.append(sum(self.sections[start : start + count]))
            start += count
        return rows

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        return hf[0] if len(hf) == 1 else torch.cat(list(hf))

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        return list(full.split(self._hf_rows())) if len(self._hf_rows()) > 1 else [full]

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        parts = full.split(list(self.sections), dim=0)
        return torch.cat([part.chunk(tp_size)[tp_rank] for part in parts])

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(shards) == 1:
            return shards[0]
        local = [size // len(shards) for size in self.sections]
        pieces = [shard.split(local, dim=0) for shard in shards]
        return torch.cat([piece[s] for s in range(len(local)) for piece in pieces])

    def even_split_dim(self, tp_size: int) -> int | None:
        return None


@dataclass(frozen=True)
class GatedDeltaNetInProj(Sections):
    """Qwen3-Next's `linear_attn.in_proj_qkvz` and `in_proj_ba` <-> Megatron's Gated DeltaNet `in_proj`.

    HF groups rows per key head g: [q_g, k_g, v_g, z_g] (v and z: the `num_v_heads / num_k_heads` value heads of
    key head g) and [b_g, a_g]; Megatron puts each kind together: [q, k, v, z, b, a], heads in order. TP rank r holds
    the r-th part of each kind (key heads r * nk / tp ..): the rows of whole key-head groups of both HF tensors."""

    num_key_heads: int = 0
    key_head_dim: int = 0
    num_value_heads: int = 0
    value_head_dim: int = 0

    def _rows(self) -> tuple[list[int], list[int]]:
        per_key = self.num_value_heads // self.num_key_heads
        value_rows = per_key * self.value_head_dim
        return [self.key_head_dim, self.key_head_dim, value_rows, value_rows], [per_key, per_key]

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        qkvz_rows, ba_rows = self._rows()
        rest = hf[0].shape[1:]
        kinds = []  # any number of whole key-head groups: all of them, or one TP rank's
        for tensor, rows in ((hf[0], qkvz_rows), (hf[1], ba_rows)):
            grouped = tensor.reshape(-1, sum(rows), *rest)
            kinds += [part.reshape(-1, *rest) for part in grouped.split(rows, dim=1)]
        return torch.cat(kinds)

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        qkvz_rows, ba_rows = self._rows()
        rest = full.shape[1:]
        nk = full.shape[0] // (sum(qkvz_rows) + sum(ba_rows))  # key heads: all of them, or one TP rank's
        kinds = full.split([nk * rows for rows in qkvz_rows + ba_rows])
        qkvz = torch.cat([kind.reshape(nk, -1, *rest) for kind in kinds[:4]], dim=1).reshape(-1, *rest)
        ba = torch.cat([kind.reshape(nk, -1, *rest) for kind in kinds[4:]], dim=1).reshape(-1, *rest)
        return [qkvz, ba]

    def even_split_dim(self, tp_size: int) -> int | None:
        return None if self.num_key_heads % tp_size else 0


@dataclass(frozen=True)
class GatedQKV(QKV):
    """Gated attention (Qwen3-Next): HF `q_proj` holds each query head's rows followed by its output-gate rows
    ([q_0, gate_0, q_1, gate_1, ...]); Megatron's `linear_qkv` with attention_output_gate lays out each query group
    as [q heads, gate heads, k, v]. TP splits whole groups."""

    def _group_rows(self) -> list[int]:
        q_rows = self.num_heads // self.num_kv_heads * self.head_dim
        return [q_rows, q_rows, self.head_dim, self.head_dim]

    def hf_to_mcore(self, hf: Sequence[torch.Tensor], vocab: VocabInfo) -> torch.Tensor:
        rest = hf[0].shape[1:]
        heads = hf[0].reshape(-1, 2, self.head_dim, *rest)  # [query heads, (query, gate), head_dim, ...]
        query, gate = heads[:, 0].reshape(-1, *rest), heads[:, 1].reshape(-1, *rest)
        return super().hf_to_mcore([query, gate, hf[1], hf[2]], vocab)

    def mcore_to_hf(self, full: torch.Tensor, vocab: VocabInfo) -> list[torch.Tensor]:
        rest = full.shape[1:]
        query, gate, key, value = super().mcore_to_hf(full, vocab)
        heads = torch.stack([query.reshape(-1, self.head_dim, *rest), gate.reshape(-1, self.head_dim, *rest)], 1)
        return [heads.reshape(-1, *rest), key, value]
