"""Activation memory of one training or forward pass, per GPU: a per-layer formula in micro-batch tokens.

Symbols: T tokens of one micro-batch on this rank (after context parallelism: tokens / cp), h hidden size,
a attention heads, g KV heads, d head size, f MLP width, t tensor-parallel size, s = t with sequence parallelism
(activations outside TP regions are split along the sequence) and 1 without, V_p padded vocabulary.
Activations are bf16 (2 bytes per element); no dropout (megarl sets hidden_dropout=0) and flash / fused attention
(no T x T score matrix is kept). What backward needs, per token, per layer (elements):

- GQA attention: 2h/s (norm input, QKV input) + (2a + 2g) d / t (q, k, v, attention output)
  + (a + g) d / t with qk-norm (q, k before the norm).
- MLA attention: 2h/s + 2 (q_lora + kv_lora + rope) (compressed q and kv, before and after their norms; whole on
  each TP rank) + a (3 qk + (nope + v) + 2 v) / t (q up, q and k for attention, kv up, v, attention output).
- dense SwiGLU MLP: 2h/s (norm input, fc1 input) + 3f/t (gate and up outputs, their product).
- MoE MLP: 2h/s + 4E (fp32 router logits and scores, counted as 2-byte elements)
  + k (2h + 3f_e / etp) / s (each token's k routed copies: permuted input, expert fc1 out (2 f_e), product,
  output) + 3 f_shared / t (shared experts). Assumes balanced routing: a rank gets k x its own tokens.
- Logits on the last stage: T V_p / t x 16 bytes (bf16 logits, fp32 copy divided by the temperature, the loss'
  working copy, and its gradient). With chunked log-probs (micro_batch.logprob_chunk_tokens = c, LM heads only)
  the logits of at most c of the rank's tokens exist at once: min(T, c) V_p / t x 16 bytes.

Full recomputation (megarl's `recompute: true`: granularity full, method uniform, one layer per checkpoint) keeps
only each layer's input, h/s elements per token, and rebuilds one layer at a time in backward: the peak adds two
full layers (the rebuilt activations and their gradients).

Pipeline parallelism: with the 1F1B schedule stage p holds the activations of pp - p micro-batches at once
(stage 0: pp of them); with interleaving (vpp > 1) stage 0 holds (1 + (pp - 1) / (pp vpp)) times the model's
layers' worth (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
A forward-only pass (log-probs, values) keeps nothing between layers: one layer's activations plus the logits.

Where this is off: unbalanced routing sends more than k x T tokens to some experts (Megatron's capacity factor is
off: drop-less); Transformer Engine keeps fp8/bf16 copies and workspaces not counted here; the allocator's
fragmentation adds 5-15% in practice; a micro-batch padded to its longest row holds more tokens than it has.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.model_size import ModelShape
from megarl.runtime.stages import StageLayout

ACTIVATION_BYTES = 2
"""bf16 activations."""
LOGIT_BYTES_PER_ENTRY = 16
"""Per token and vocabulary entry on a TP rank: bf16 logits (2), fp32 copy (4), the loss' copy (4), gradient (4),
rounded up for the entropy's temporaries."""


@dataclass(frozen=True)
class ActivationLayout:
    tp: int
    pp: int
    vpp: int
    etp: int
    cp: int
    sequence_parallel: bool
    recompute: bool
    first: int | None = None
    last: int | None = None
    logit_chunk: int = 0
    """Tokens per LM-head chunk (micro_batch.logprob_chunk_tokens); 0: the head sees every token at once."""

    @property
    def stages(self) -> StageLayout:
        return StageLayout(self.pp, self.vpp, self.first, self.last)


def layer_elements_per_token(shape: ModelShape, layer: int, lay: ActivationLayout) -> float:
    """Elements per token one layer keeps for backward without recomputation (see the module docstring)."""
    h, t = shape.hidden_size, lay.tp
    s = t if lay.sequence_parallel else 1
    a = shape.num_heads
    if shape.mla:
        m = shape.mla
        qk, v = shape.head_dim, shape.v_head_dim
        attention = 2 * h / s + 2 * (m["q_lora_rank"] + m["kv_lora_rank"] + m["qk_rope_head_dim"])
        attention += a * (3 * qk + (m["qk_nope_head_dim"] + v) + 2 * v) / t
    else:
        g, d = shape.num_kv_heads, shape.head_dim
        attention = 2 * h / s + (2 * a + 2 * g) * d / t
        if shape.qk_norm:
            attention += (a + g) * d / t
    if shape.moe and shape.sparse_layers[layer]:
        moe = shape.moe
        mlp = 2 * h / s + 4 * moe["num_experts"]
        mlp += moe["topk"] * (2 * h + 3 * moe["expert_ffn"] / lay.etp) / s
        mlp += 3 * moe["shared_ffn"] / t
    else:
        mlp = 2 * h / s + 3 * shape.ffn_hidden_size / t
    return attention + mlp


def logits_bytes(tokens: int, padded_vocab: int, tp: int, chunk: int = 0) -> float:
    """The LM head's logits and their working copies for `tokens` tokens of a rank, `chunk` of them at a time."""
    rows = min(tokens, chunk) if chunk else tokens
    return rows * padded_vocab / tp * LOGIT_BYTES_PER_ENTRY


def train_activation_bytes(
    shape: ModelShape, lay: ActivationLayout, tokens: int, stage: int, padded_vocab: int, lm_head: bool
) -> float:
    """Peak activation bytes of pipeline stage `stage` during a training step with micro-batches of `tokens`."""
    local_tokens = tokens / lay.cp
    layers = lay.stages.stage_layers(shape.num_layers, stage)
    per_layer = [layer_elements_per_token(shape, i, lay) * local_tokens * ACTIVATION_BYTES for i in layers]
    in_flight = _micro_batches_in_flight(lay.pp, lay.vpp, stage)
    s = lay.tp if lay.sequence_parallel else 1
    if lay.recompute:
        kept = len(layers) * shape.hidden_size / s * local_tokens * ACTIVATION_BYTES
        total = kept * in_flight + 2 * max(per_layer)
    else:
        total = sum(per_layer) * in_flight
    if stage == lay.pp - 1 and lm_head:
        total += logits_bytes(int(local_tokens), padded_vocab, lay.tp, lay.logit_chunk)
    return total


def forward_activation_bytes(
    shape: ModelShape, lay: ActivationLayout, tokens: int, stage: int, padded_vocab: int, lm_head: bool
) -> float:
    """Peak activation bytes of a forward-only pass (no gradients kept): one layer at a time, plus the logits."""
    local_tokens = tokens / lay.cp
    layers = lay.stages.stage_layers(shape.num_layers, stage)
    total = max(layer_elements_per_token(shape, i, lay) for i in layers) * local_tokens * ACTIVATION_BYTES
    if stage == lay.pp - 1 and lm_head:
        total += logits_bytes(int(local_tokens), padded_vocab, lay.tp, lay.logit_chunk)
    return total


def _micro_batches_in_flight(pp: int, vpp: int, stage: int) -> float:
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(pp - stage)
    return pp * (1 + (pp - 1) / (pp * vpp)) if stage == 0 else float(pp - stage)
