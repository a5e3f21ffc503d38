"""RoPE over packed rows (THD) without a Python loop over the samples, and over padded rows (BSHD) without copies.

Megatron-Core's unfused THD rotary embedding (`rope_utils._apply_rotary_pos_emb_thd`, used wherever Transformer
Engine's fused kernel is not) splits the packed row into its samples on the host and slices frequencies sample by
sample: a host sync and a few small ops per sample, per layer, for queries and keys, forward and backward. With the
short samples RL packs (tens of them per row) that loop cost 40% of the attention time on CPU (py-spy, the
quickstart-size model). Here each token's position within its sample is computed once on the device and the
frequencies gathered in one op: the same numbers (each sample's positions count from 0, as in Megatron's mode 2),
for context-parallel size 1 and for megarl's context-parallel split (megarl/models/context_parallel.py: each
token rotated by its position in its global sample); other cases go to Megatron's own function.

Megatron's BSHD function slices the rotated part off the input and concatenates the rest back on, even when RoPE
covers every channel (then the slice's backward writes a zero tensor and the concatenation copies queries and keys
again: 40 concatenations per step, 3 ms of a 58 ms update at the quickstart size). With full-width RoPE and no MLA
interleave this applies the same formula to the whole tensor: the same numbers, without the copies; the cosines
and sines are computed once per forward, and the half rotation is one roll.
"""

from __future__ import annotations

import torch

from megarl.data.packing import positions_in_samples
from megarl.models.forward_cache import cached

megatron_thd = megatron_bshd = None
"""Megatron's own functions, once `install` replaced them."""


def rope_positions(cu_seqlens: torch.Tensor, size: int) -> torch.Tensor:
    """Each packed token's RoPE position: its place in its sample, after the tokens a shared-prompt sample takes
    from its root (megarl/data/packing.py; gpt_output hangs the sharing on cu_seqlens)."""
    positions = positions_in_samples(cu_seqlens, size)
    sharing = getattr(cu_seqlens, "shared_prefix", None)
    if sharing is not None:
        positions = positions + sharing.shared.repeat_interleave(cu_seqlens.diff().long(), output_size=size)
    return positions


def _positions(cu_seqlens: torch.Tensor, size: int, split) -> torch.Tensor:
    """RoPE positions of a forward's `size` tokens: every packed token's, or with context parallelism those of
    this rank's tokens in their global samples."""
    if split is None:
        return rope_positions(cu_seqlens, size)
    return rope_positions(cu_seqlens, split.padded_tokens)[split.local.to(cu_seqlens.device)]


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype, signed: bool = False):
    cos_, sin_ = (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)
    if signed:
        half = sin_.shape[-1] // 2
        sin_ = torch.cat([-sin_[..., :half], sin_[..., half:]], dim=-1)
    return cos_, sin_


def install() -> None:
    """Route Megatron's unfused THD and BSHD rotary embeddings through the versions here (idempotent)."""
    global megatron_thd, megatron_bshd
    if megatron_thd is not None:
        return
    from megatron.core.models.common.embeddings import rope_utils

    original = megatron_thd = rope_utils._apply_rotary_pos_emb_thd
    megatron_bshd = rope_utils._apply_rotary_pos_emb_bshd

    def apply_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or freqs.shape[-1] != t.shape[-1]:  # partial RoPE, MLA: Megatron's own code
            return megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        if rotary_interleaved:
            cos_, sin_ = cached("bshd", (freqs, mscale, t.dtype, True), lambda: _cos_sin(freqs, mscale, t.dtype))
            return t * cos_ + rope_utils._rotate_half(t, rotary_interleaved) * sin_
        # rotate_half(t) = cat(-t2, t1) = roll(t, d/2) * [-1.. +1..]: the sign goes into the cached sine, one op
        # (a roll) instead of chunk, neg and cat forward and backward; the same numbers, bit for bit
        cos_, signed_sin = cached(
            "bshd", (freqs, mscale, t.dtype, False), lambda: _cos_sin(freqs, mscale, t.dtype, signed=True)
        )
        return t * cos_ + torch.roll(t, t.shape[-1] // 2, dims=-1) * signed_sin

    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd

    def apply_thd(
        t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
    ):
        split = getattr(cu_seqlens, "context_split", None)  # megarl/models/context_parallel.py
        whole_row = freqs.dim() >= 1 and freqs.size(0) == t.size(0)  # Megatron's offset mode: its own code
        if split is None and (cp_group is None or cp_group.size() != 1 or whole_row):
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        size = t.size(0)
        packed = cached("thd", (freqs, cu_seqlens, size), lambda: freqs[_positions(cu_seqlens, size, split)])
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            packed,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = apply_thd
