"""Core attention on torch's scaled_dot_product_attention, for Megatron-Core layer specs without Transformer Engine.

Megatron's local `DotProductAttention` takes one head size for keys and values, so it cannot run Multi-head Latent
Attention (DeepSeek: keys are nope+rope dims wide, values v_head_dim). This module has the same constructor and
forward contract as Megatron's core attentions, and any key/value head sizes.

It also runs packed sequences (Megatron's THD layout, megarl/data/packing.py), which Megatron's local attention
does not: the packed tokens are laid out sample by sample, padded to the longest, and attended causally per sample
(one batched SDPA call, so the attention cost is that of the samples, never of the whole packed row).

Context parallelism (megarl/models/context_parallel.py): each rank holds two chunks of every packed sample; keys
and values are all-gathered over the CP group and each local query attends to its sample's keys up to its global
position (shared prompts too), which Megatron's local attention refuses.

Sliding windows and attention sinks (gpt-oss): the layers Megatron's `window_size` and `window_attn_skip_freq`
name read only the last `window_size[0] + 1` positions (their own included), and `softmax_type="learnable"` adds a
learned logit per head (`softmax_offset`, HF's `sinks`) to each softmax's denominator. SDPA has neither, so those
layers write the softmax out (`softmax_attention`) with the same masks, on every path above.

Shapes: query [seq, batch, heads, k_dim], key [seq, batch, kv_heads, k_dim], value [seq, batch, kv_heads, v_dim]
-> output [seq, batch, heads * v_dim] (heads being this TP rank's share). Packed: [tokens, heads, dim] in,
[tokens, heads * v_dim] out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from megarl.data.packing import packed_attention_index, positions_in_samples
from megarl.models.forward_cache import cached


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window: int | None = None
        """Keys this many positions back at most (sliding-window layers); None: all earlier keys."""
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise NotImplementedError(f"SDPACoreAttention runs causal windows (left, 0), not {config.window_size}")
            self.window = left
        self.softmax_offset: torch.nn.Parameter | None = None
        if config.softmax_type == "learnable":
            heads = config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)  # this rank's heads
        elif config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"SDPACoreAttention runs softmax_type vanilla or learnable, not {config.softmax_type}"
            )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The sink logits split by heads across TP, as Megatron's own core attentions save them."""
        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of [batch, heads, seq, dim] tensors: `mask` True where a query may read a key, or causal; key
        slot j holds position j, query slot i position i unless `query_positions` ([..., queries, 1]) says."""
        dropout = self.dropout if self.training else 0.0
        if self.window is None and self.softmax_offset is None:
            return F.scaled_dot_product_attention(
                q, k, v, mask, dropout, is_causal, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        queries, keys = q.shape[-2], k.shape[-2]
        key_positions = torch.arange(keys, device=q.device)
        if query_positions is None:
            query_positions = torch.arange(queries, device=q.device)[:, None]
        if is_causal:  # SDPA's is_causal: query slot i reads key slots up to i
            causal = key_positions <= torch.arange(queries, device=q.device)[:, None]
            mask = causal if mask is None else mask & causal
        if self.window is not None:
            in_window = key_positions >= query_positions - self.window
            mask = in_window if mask is None else mask & in_window
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        return softmax_attention(q, k, v, mask, scale, self.softmax_offset, dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type or self.attn_mask_type
        # Megatron masks are True where attention is *not* allowed; SDPA's boolean masks the opposite.
        mask = None if attention_mask is None else ~attention_mask
        causal = mask is None and mask_type == AttnMaskType.causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [batch, heads, seq, dim]
        out = self._attend(q, k, v, mask, causal)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPACoreAttention packs only the thd format, not {params.qkv_format!r}")
        sharing = getattr(params, "shared_prefix", None)
        split = getattr(params.cu_seqlens_q, "context_split", None)
        if split is not None:
            return self._context_parallel(query, key, value, params.cu_seqlens_q, split, sharing)
        if sharing is not None:
            return self._shared_prompts(query, key, value, params.cu_seqlens_q, sharing)
        index, samples, longest = packed_attention_index(params.cu_seqlens_q)
        index = index.to(query.device)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [tokens, h, d] -> [samples, h, longest, d]
            out = t.new_zeros(samples * longest, *t.shape[1:]).index_copy(0, index, t)
            return out.view(samples, longest, *t.shape[1:]).transpose(1, 2)

        q, k, v = padded(query), padded(key), padded(value)
        out = self._attend(q, k, v, is_causal=True)  # causal: a sample's padding comes after its tokens, never before
        out = out.transpose(1, 2).reshape(samples * longest, -1)
        return out.index_select(0, index)

    def _context_parallel(self, query, key, value, cu_seqlens: torch.Tensor, split, sharing) -> torch.Tensor:
        """This CP rank's queries against the keys and values of the whole padded row, all-gathered over the CP
        group (megarl/models/context_parallel.py): each sample's keys laid in slots as without CP (shared prompts:
        the root's first tokens, then the sample's own), each query masked causally by its global slot."""
        keys, values = split.gather_padded(key), split.gather_padded(value)
        layout = cp_attention_layout(cu_seqlens, split, sharing)
        samples, width, queries = layout.samples, layout.width, layout.queries
        if sharing is not None:
            keys, values = (
                torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, layout.keys) for t in (keys, values)
            )
        else:
            keys, values = (
                t.new_zeros(samples * width, *t.shape[1:]).index_copy(0, layout.keys, t) for t in (keys, values)
            )
        k, v = (t.view(samples, width, *t.shape[1:]).transpose(1, 2) for t in (keys, values))
        q = query.new_zeros(samples * queries, *query.shape[1:]).index_copy(0, layout.query_slots, query)
        q = q.view(samples, queries, *query.shape[1:]).transpose(1, 2)
        out = self._attend(q, k, v, layout.mask, query_positions=layout.positions)
        return out.transpose(1, 2).reshape(samples * queries, -1).index_select(0, layout.query_slots)

    def _shared_prompts(self, query, key, value, cu_seqlens: torch.Tensor, sharing) -> torch.Tensor:
        """Packed samples that take their first `shared` tokens from a root sample: each sample's slots are the
        root's first `shared` tokens, then its own, so causal attention over the slots reads exactly the keys the
        sample would have alone. Queries in the root's slots are computed and dropped."""
        gather, slot_of_token, samples, width = shared_prompt_slots(cu_seqlens, sharing)

        def slots(t: torch.Tensor) -> torch.Tensor:  # [tokens, h, d] -> [samples, h, width, d]; empty slots 0
            padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, gather)
            return padded.view(samples, width, *t.shape[1:]).transpose(1, 2)

        out = self._attend(slots(query), slots(key), slots(value), is_causal=True)
        return out.transpose(1, 2).reshape(samples * width, -1).index_select(0, slot_of_token)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T scale, where `mask` allows) v in fp32, for [batch, heads, seq, dim] tensors (keys and values
    may have fewer heads: grouped queries). `sinks` [heads]: one more logit per head in each row's softmax, whose
    probability reads no value (HF gpt-oss's `eager_attention_forward`; Megatron's SoftmaxOne)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    logits = (q @ k.transpose(-1, -2)).float() * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return F.dropout(probs, dropout).to(v.dtype) @ v


@dataclass(frozen=True)
class _CPLayout:
    samples: int
    width: int
    """Key slots per sample (the longest padded sample, plus its shared tokens)."""
    queries: int
    """Query slots per sample: the most tokens this rank holds of one sample."""
    keys: torch.Tensor
    """Without sharing: the key slot of each padded global token; with it: the padded token in each key slot
    (T_pad for an empty slot)."""
    query_slots: torch.Tensor
    """[local tokens] the query slot of each of this rank's tokens."""
    mask: torch.Tensor
    """[samples, 1, queries, width] True where a query slot may read a key slot (causal by global slot)."""
    positions: torch.Tensor
    """[samples, 1, queries, 1] the key slot of each query slot's own token (its position: sliding windows)."""


def cp_attention_layout(cu_seqlens: torch.Tensor, split, sharing) -> _CPLayout:
    """The slots of `SDPACoreAttention._context_parallel`, once per forward."""
    return cached("cp_slots", (cu_seqlens,), lambda: _cp_layout(cu_seqlens, split, sharing))


def _cp_layout(cu_seqlens: torch.Tensor, split, sharing) -> _CPLayout:
    local = split.local.to(cu_seqlens.device)
    if sharing is not None:
        keys, slot_of_token, samples, width = shared_prompt_slots(cu_seqlens, sharing)
        global_slot = slot_of_token[local]
    else:
        keys, samples, width = packed_attention_index(cu_seqlens)
        keys = keys.to(cu_seqlens.device)
        global_slot = keys[local]
    sample, key_position = global_slot // width, global_slot % width
    local_bounds = torch.div(cu_seqlens.long(), split.size, rounding_mode="floor")
    held = local_bounds.diff()
    queries = int(held.max())
    query_slots = sample * queries + positions_in_samples(local_bounds, local.numel())
    position = torch.zeros(samples * queries, dtype=torch.long, device=cu_seqlens.device)
    position = position.index_copy(0, query_slots, key_position).view(samples, 1, queries, 1)
    mask = torch.arange(width, device=cu_seqlens.device) <= position  # empty query slots read slot 0: no NaN
    return _CPLayout(samples, width, queries, keys, query_slots, mask, position)


def shared_prompt_slots(cu_seqlens: torch.Tensor, sharing) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(gather, slot_of_token, samples, width) for `SDPACoreAttention._shared_prompts`: `gather[slot]` is the packed
    token in each of the [samples * width] slots (the number of tokens for an empty slot: a zero row), and
    `slot_of_token[t]` the slot of packed token t. The same for every layer of a forward: computed once."""
    return cached("slots", (cu_seqlens,), lambda: _slots(cu_seqlens, sharing))


def _slots(cu_seqlens: torch.Tensor, sharing) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    bounds = cu_seqlens.long()
    starts, sizes = bounds[:-1], bounds.diff()
    shared, root = sharing.shared.long(), sharing.root.long()
    samples, total = len(sizes), int(bounds[-1])
    width = int((sizes + shared).max())
    slot = torch.arange(width, device=bounds.device)[None]  # [1, width]
    own = slot - shared[:, None]
    gather = torch.where(
        slot < shared[:, None],
        starts[root][:, None] + slot,
        torch.where(own < sizes[:, None], starts[:, None] + own, total),
    )
    sample = torch.arange(samples, device=bounds.device).repeat_interleave(sizes, output_size=total)
    slot_of_token = sample * width + shared[sample] + positions_in_samples(cu_seqlens, total)
    return gather.reshape(-1), slot_of_token, samples, width
