"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary on one rank.

Shapes: logits_BSV are this TP rank's slice of the (padded) vocabulary, [batch, seq, vocab / tp]; ids_BS and the
results are [batch, seq], aligned with the input tokens: result[:, t] is about token t given tokens < t, and
result[:, 0] (no prediction) is 0. Vocabulary padding (Megatron pads to a multiple of 128 x TP) is masked out: the
padded rows of the output layer give logit 0, which would otherwise take probability mass from real tokens.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megarl.bridge.mappings import VocabInfo
from megarl.runtime.distributed import all_reduce


def _mask_padded_vocab(logits_BSV: torch.Tensor, vocab: VocabInfo) -> torch.Tensor:
    shard = logits_BSV.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab.size:
        return logits_BSV
    padded = torch.arange(start, start + shard, device=logits_BSV.device) >= vocab.size
    return logits_BSV.masked_fill(padded, torch.finfo(logits_BSV.dtype).min)


def prepare_logits(logits_BSV: torch.Tensor, vocab: VocabInfo, temperature: float = 1.0) -> torch.Tensor:
    """fp32, divided by the sampling temperature, padding masked."""
    logits = logits_BSV.float()
    if temperature != 1.0:
        logits = logits / temperature
    return _mask_padded_vocab(logits, vocab)


def token_logprobs(
    logits_BSV: torch.Tensor, ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(token t | tokens < t) from prepared logits (see `prepare_logits`); differentiable. Packed rows
    (`position_ids_BS`, megarl/data/packing.py): 0 at every sample's first token too."""
    targets_BS = torch.roll(ids_BS, shifts=-1, dims=1)  # logits at t predict t + 1
    return align_to_tokens(position_logprobs(logits_BSV, targets_BS), position_ids_BS)


def position_logprobs(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """log p(targets_BS) at each position (not aligned: `token_logprobs` is this with the next tokens, aligned)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        # the whole vocabulary on this rank: torch's fused loss (no copy, no collectives; equal to float rounding)
        vocab_size = logits_BSV.shape[-1]
        nll = torch.nn.functional.cross_entropy(
            logits_BSV.reshape(-1, vocab_size), targets_BS.reshape(-1), reduction="none"
        )
        return -nll.view_as(targets_BS)
    # Megatron's loss wants [seq, batch, vocab] and works in place on it: always give it a copy (for one row,
    # transpose().contiguous() would be a view, and the caller's logits would change under it).
    logits_SBV = logits_BSV.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    return -vocab_parallel_cross_entropy(logits_SBV, targets_BS.transpose(0, 1).contiguous()).transpose(0, 1)


def token_entropy(logits_BSV: torch.Tensor, position_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like `token_logprobs`; differentiable."""
    return align_to_tokens(position_entropy(logits_BSV), position_ids_BS)


def position_entropy(logits_BSV: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution at each position (not aligned): H = log Z - sum_v p_v z_v, with the max, Z and
    the sum reduced across TP ranks."""
    local_max = logits_BSV.max(dim=-1, keepdim=True).values.detach()
    global_max = local_max.clone()
    all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=_tp_group())
    shifted = logits_BSV - global_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1, keepdim=True))
    # exp * shifted is 0 where exp underflows (masked padding): no 0 * -inf
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted.clamp(min=-1e30)).sum(dim=-1, keepdim=True))
    return (sum_exp.log() - weighted / sum_exp).squeeze(-1)


def token_sum_pi_squared(logits_BSV: torch.Tensor, position_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """sum_v p_v^2 of the next-token distribution (the optimal token baseline's gradient-norm term), aligned like
    `token_logprobs`. Not differentiable (a statistic of the log-prob pass)."""
    return align_to_tokens(position_sum_pi_squared(logits_BSV), position_ids_BS)


def position_sum_pi_squared(logits_BSV: torch.Tensor) -> torch.Tensor:
    """sum_v p_v^2 at each position (not aligned): sum_v exp(2 z_v) / Z^2 with the max-shifted logits z, the max
    and both sums reduced across TP ranks."""
    local_max = logits_BSV.max(dim=-1, keepdim=True).values.detach()
    global_max = local_max.clone()
    all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=_tp_group())
    exp = (logits_BSV.detach() - global_max).exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1, keepdim=True))
    sum_sq = reduce_from_tensor_model_parallel_region(exp.square().sum(dim=-1, keepdim=True))
    return (sum_sq / sum_exp.square()).squeeze(-1)


def align_to_tokens(per_position_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Predictions for token t + 1 made at t -> column t + 1; column 0 gets 0, and so does every packed sample's
    first token (predicted from the sample before it)."""
    aligned = torch.nn.functional.pad(per_position_BS[:, :-1], (1, 0))
    if position_ids_BS is not None:
        aligned = aligned.masked_fill(position_ids_BS == 0, 0.0)
    return aligned


def _tp_group():
    return parallel_state.get_tensor_model_parallel_group()
