"""RoPE over packed rows (THD) without a Python loop over the samples.

Megatron-Core's unfused THD rotary embedding (`rope_utils._apply_rotary_pos_emb_thd`, used wherever Transformer
Engine's fused kernel is not) splits the packed row into its samples on the host and slices frequencies sample by
sample: a host sync and a few small ops per sample, per layer, for queries and keys, forward and backward. With the
short samples RL packs (tens of them per row) that loop cost 40% of the attention time on CPU (py-spy, the
quickstart-size model). Here each token's position within its sample is computed once on the device and the
frequencies gathered in one op: the same numbers (each sample's positions count from 0, as in Megatron's mode 2),
for context-parallel size 1; other cases go to Megatron's own function.
"""

from __future__ import annotations

from megarl.data.packing import positions_in_samples

megatron_thd = None
"""Megatron's own function, once `install` replaced it."""


def install() -> None:
    """Route Megatron's unfused THD rotary embedding through the vectorized version (idempotent)."""
    global megatron_thd
    if megatron_thd is not None:
        return
    from megatron.core.models.common.embeddings import rope_utils

    original = megatron_thd = rope_utils._apply_rotary_pos_emb_thd

    def apply_thd(
        t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
    ):
        whole_row = freqs.dim() >= 1 and freqs.size(0) == t.size(0)  # Megatron's offset mode: its own code
        if cp_group is None or cp_group.size() != 1 or whole_row:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        packed = freqs[positions_in_samples(cu_seqlens, t.size(0))]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            packed,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = apply_thd
