"""Context parallelism (`parallel.cp`): each packed sample split over the CP ranks, every number equal to cp = 1.

The split (Transformer Engine's THD layout, the "zig-zag"): every sample of a packed micro-batch is padded at its end
to a multiple of 2 x cp tokens (at most 2 cp - 1 tokens, which attend only to the tokens before them and are never
read back), cut into 2 x cp equal chunks, and CP rank r holds chunks r and 2 cp - 1 - r of every sample, so causal
attention costs each rank the same. A padded (unpacked) micro-batch runs as a packed one, each row a sample.

What each part does with it:
- the forward (workers/schedule.py `gpt_output`) feeds the model this rank's tokens, and the packed-sequence
  parameters the padded global `cu_seqlens` (what Transformer Engine's CP attention takes on GPU);
- RoPE (models/packed_rope.py) rotates each token by its position in its global sample;
- megarl's SDPA core attention (models/sdpa_attention.py) all-gathers keys and values over the CP group and runs
  this rank's queries against the whole sample, causally by global position (shared prompts too);
- the heads (log-probs, entropy, values) compute on this rank's tokens with next-token targets taken from the
  global sequence (rolled before the split, so a label at a chunk boundary comes from the next chunk), and gather
  the per-token results back into the global order on every CP rank: the loss above sees what cp = 1 gives.

Gradients: every CP rank computes the same loss from the gathered per-token values, so the gather's backward keeps
this rank's slice of the incoming gradient (no communication, no double counting); the keys' and values' all-gather
sums the gradients every rank's queries sent them. Megatron's DDP sums gradients over the data- and context-parallel
ranks together, which makes the sum over all tokens: the cp = 1 gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.data.packing import positions_in_samples
from megarl.models.forward_cache import cached


@dataclass(frozen=True)
class ContextSplit:
    """How one micro-batch's tokens are split over the CP ranks (the same on every rank but `rank`)."""

    size: int
    rank: int
    group: dist.ProcessGroup
    rows: tuple[int, int]
    """(b, s) of the micro-batch's per-token tensors (packed: (1, T))."""
    cu_seqlens: torch.Tensor
    """Where each padded sample starts in the padded global row [n + 1] int32 (T_pad at the end)."""
    longest: int
    """The longest padded sample (with shared prompts: plus its shared tokens): RoPE's longest position."""
    real: torch.Tensor
    """[b * s] the padded global position of every real token, in row order."""
    local: torch.Tensor
    """[T_pad / size] the padded global positions this rank holds, in its local order."""
    from_ranks: torch.Tensor
    """[T_pad] where each padded global position lies in the rank-major concatenation of every rank's tokens."""

    @property
    def padded_tokens(self) -> int:
        return self.local.numel() * self.size

    def local_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the micro-batch [b, s, ...] -> this rank's tokens [1, T_pad / size, ...] (padding
        zeros)."""
        flat = tensor.reshape(-1, *tensor.shape[2:])
        padded = flat.new_zeros(self.padded_tokens, *flat.shape[1:]).index_copy(0, self.real.to(flat.device), flat)
        return padded[self.local.to(flat.device)].unsqueeze(0)

    def local_positions(self) -> torch.Tensor:
        """[1, T_pad / size] each local token's position in its padded sample."""
        return positions_in_samples(self.cu_seqlens, self.padded_tokens)[self.local].unsqueeze(0)

    def local_rows(self) -> torch.Tensor:
        """[1, T_pad / size] the micro-batch row of each of this rank's tokens (-1: split padding)."""
        rows = torch.full((self.padded_tokens,), -1, dtype=torch.long)
        rows[self.real] = torch.arange(self.real.numel()) // self.rows[1]
        return rows[self.local].unsqueeze(0)

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values [1, T_pad / size, ...] -> every token's [b, s, ...] in the global order, on
        every CP rank (the padding dropped). Backward: this rank's slice of the gradient (see the module doc)."""
        values = _GatherTokens.apply(local[0], self)
        return values.view(*self.rows, *values.shape[1:])

    def gather_padded(self, local: torch.Tensor) -> torch.Tensor:
        """Keys or values [T_pad / size, ...] -> the padded global row [T_pad, ...]; the backward sums the
        gradients of every rank (an all-reduce, then this rank's slice)."""
        return _GatherKeys.apply(local, self)

    def _all_ranks(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, split: ContextSplit) -> torch.Tensor:
        ctx.split = split
        index = split.from_ranks[split.real].to(local.device)
        ctx.save_for_backward(index)
        return split._all_ranks(local).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split: ContextSplit = ctx.split
        (index,) = ctx.saved_tensors
        count = split.local.numel()
        full = grad.new_zeros(count * split.size, *grad.shape[1:]).index_copy(0, index, grad)
        return full[split.rank * count : (split.rank + 1) * count], None


class _GatherKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, split: ContextSplit) -> torch.Tensor:
        ctx.split = split
        return split._all_ranks(local).index_select(0, split.from_ranks.to(local.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split: ContextSplit = ctx.split
        grad = grad.contiguous()
        dist.all_reduce(grad, group=split.group)
        return grad.index_select(0, split.local.to(grad.device)), None


def zigzag_index(cu_seqlens: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """The padded global positions CP rank `rank` of `size` holds: chunks rank and 2 size - 1 - rank of every
    sample (`cu_seqlens`: samples padded to multiples of 2 size), sample by sample."""
    bounds = cu_seqlens.to("cpu", torch.long)
    chunk = bounds.diff() // (2 * size)
    held = 2 * chunk  # tokens of each sample on one rank
    total = int(held.sum())
    local_bounds = torch.cat([held.new_zeros(1), held.cumsum(0)])
    within = positions_in_samples(local_bounds, total)  # 0 .. 2 chunk - 1 in every sample
    sample = torch.arange(len(chunk)).repeat_interleave(held, output_size=total)
    c = chunk[sample]
    first = within < c
    offset = torch.where(first, rank * c + within, (2 * size - 1 - rank) * c + within - c)
    return bounds[:-1][sample] + offset


def context_split(tensors: dict[str, torch.Tensor], multiple: int = 1) -> ContextSplit | None:
    """The split of micro-batch `tensors` over this rank's CP group; None without context parallelism. Computed once
    per micro-batch: the first call (the forward's, which knows the model's `packing_multiple`) fixes it, and later
    calls for the same micro-batch (the head's) get that one whatever their `multiple`."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size == 1:
        return None
    ids = tensors["input_ids"]
    return cached(
        "context_split",
        (ids, size),
        lambda: _split(tensors, size, ps.get_context_parallel_rank(), ps.get_context_parallel_group(), multiple),
    )


def forward_split(model: torch.nn.Module, tensors: dict[str, torch.Tensor], split) -> torch.Tensor:
    """The forward of this CP rank's share of a micro-batch (see the module doc): its tokens of every
    padded sample; the packed-sequence parameters carry the padded global row, and the split hangs on it for RoPE
    and the attention. Last stage: this rank's logits [1, t, V/tp] or values [1, t, 1]."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.data.packing import SharedPrefix

    device = tensors["input_ids"].device
    cu_seqlens = split.cu_seqlens.to(device)
    cu_seqlens.context_split = split
    params = PackedSeqParams("thd", cu_seqlens, cu_seqlens, max_seqlen_q=split.longest, max_seqlen_kv=split.longest)
    shared = tensors.get("segment_shared")
    if shared is not None:
        params.shared_prefix = cu_seqlens.shared_prefix = SharedPrefix(
            shared.to(device), tensors["segment_root"].to(device)
        )
    input_ids = split.local_tokens(tensors["input_ids"])
    return model(input_ids, split.local_positions().to(device), attention_mask=None, packed_seq_params=params)


CP_TOKENS = "cp_tokens"
"""Micro-batch tensor (a scalar): the padded global tokens every micro-batch of a fixed-shape schedule is padded to
(`padded_tokens` agreed over the micro-batches, and over the ranks where they must agree): the last sample's padding
grows, so every CP rank of every micro-batch holds the same number of tokens."""


def padded_tokens(tensors: dict[str, torch.Tensor], size: int, multiple: int = 1) -> int:
    """The tokens of micro-batch `tensors` once each sample is padded for a CP split over `size` ranks."""
    return int(_padded_sizes(tensors, size, multiple)[1].sum())


def _padded_sizes(tensors: dict[str, torch.Tensor], size: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample bounds [n + 1], padded sample sizes [n]) of a micro-batch; padded rows are samples of their width."""
    rows = tensors["input_ids"].shape
    if "cu_seqlens" in tensors:
        bounds = tensors["cu_seqlens"].to("cpu", torch.long)
    else:
        bounds = torch.arange(rows[0] + 1) * rows[1]
    unit = 2 * size * multiple  # sequence parallelism splits each rank's tokens again over TP
    return bounds, -(-bounds.diff() // unit) * unit


def _split(tensors, size: int, rank: int, group, multiple: int) -> ContextSplit:
    rows = tuple(tensors["input_ids"].shape[:2])
    bounds, padded_sizes = _padded_sizes(tensors, size, multiple)
    sizes = bounds.diff()
    if CP_TOKENS in tensors:  # a fixed shape: the last sample's padding takes up the difference
        padded_sizes[-1] += int(tensors[CP_TOKENS]) - int(padded_sizes.sum())
    padded_bounds = torch.cat([sizes.new_zeros(1), padded_sizes.cumsum(0)])
    total = int(bounds[-1])
    sample = torch.arange(len(sizes)).repeat_interleave(sizes, output_size=total)
    real = padded_bounds[:-1][sample] + positions_in_samples(bounds, total)
    cu_seqlens = padded_bounds.to(torch.int32)
    locals_ = [zigzag_index(cu_seqlens, size, r) for r in range(size)]
    from_ranks = torch.empty(int(padded_bounds[-1]), dtype=torch.long)
    from_ranks[torch.cat(locals_)] = torch.arange(int(padded_bounds[-1]))
    shared = tensors.get("segment_shared")
    longest = int((padded_sizes + shared).max() if shared is not None else padded_sizes.max())
    return ContextSplit(size, rank, group, rows, cu_seqlens, longest, real, locals_[rank], from_ranks)
