"""Token choice for the hf engine: temperature, top-k, top-p, per-row random streams, and stop-string detection.

Every row of a batch draws from its own `torch.Generator`, one uniform number per sampled token (inverse-CDF
sampling), so a completion's tokens depend only on its seed and its own logits: not on its neighbors in the batch,
and a resumed completion can skip the draws of its prefix to continue the same stream.

Shapes: B rows of the batch, V vocabulary, K candidates kept (V, or top_k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.rollout.config import SamplingParams


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) per row, each from its row's generator (float64) [B]."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_tokens(
    logits_BV: torch.Tensor, sampling: SamplingParams, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probs [B]) for one decode step.

    Temperature 0 is greedy (argmax) with log-probs of the unscaled distribution. Otherwise the log-probs are
    log_softmax(logits / temperature) of the chosen token, before truncation; the token is drawn from that
    distribution restricted to the top_k most likely tokens, then renormalized and restricted to the smallest set
    whose probability reaches top_p (the order of transformers' and vLLM's warpers).
    """
    logits_BV = logits_BV.float()
    if sampling.temperature == 0:
        tokens_B = logits_BV.argmax(dim=-1)
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    logprobs_BV = torch.log_softmax(logits_BV / sampling.temperature, dim=-1)
    probs_BK = logprobs_BV.exp()
    candidates_BK = None  # token id of each kept column; None while columns are the vocabulary itself
    vocab_size = logits_BV.shape[-1]
    if 0 < sampling.top_k < vocab_size:
        probs_BK, candidates_BK = probs_BK.topk(sampling.top_k, dim=-1)  # sorted, most likely first
    if sampling.top_p < 1:
        if candidates_BK is None:
            probs_BK, candidates_BK = probs_BK.sort(dim=-1, descending=True)
        probs_BK = probs_BK / probs_BK.sum(dim=-1, keepdim=True)
        mass_before_BK = probs_BK.cumsum(dim=-1) - probs_BK
        probs_BK = probs_BK.masked_fill(mass_before_BK >= sampling.top_p, 0.0)  # the first token always stays
    cdf_BK = probs_BK.double().cumsum(dim=-1)
    # the draws come from per-completion CPU generators wherever the logits live: the same streams on any device
    threshold_B1 = draw_uniforms(generators).to(cdf_BK.device)[:, None] * cdf_BK[:, -1:]
    # first column whose cdf exceeds the threshold: a zero-probability column never does
    choice_B = torch.searchsorted(cdf_BK, threshold_B1, right=True).squeeze(-1).clamp_(max=cdf_BK.shape[-1] - 1)
    tokens_B = choice_B if candidates_BK is None else candidates_BK.gather(-1, choice_B[:, None]).squeeze(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


class StopStringWatcher:
    """Decodes one completion incrementally and tells when its text first contains a stop string.

    Only occurrences that end in newly decoded text count (a stop string inside a resumed prefix does not), and
    only the last few tokens are decoded at each step, so the cost per token does not grow with the length.
    A token that decodes to an incomplete character (U+FFFD) waits for the next one.
    """

    _CONTEXT_TOKENS = 5  # tokens decoded again for context: merges across token boundaries decode right

    def __init__(self, tokenizer, stops: Sequence[str], token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.token_ids = list(token_ids)
        self.text = self._decode(self.token_ids)
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - self._CONTEXT_TOKENS)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> bool:
        """Append a token; True if the completion now contains a stop string it did not contain before."""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.token_ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        old_length = len(self.text)
        self.text += after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        # an occurrence counts only if it ends in the new text (one inside a resumed prefix does not)
        return any(self.text.find(stop, max(0, old_length - len(stop) + 1)) >= 0 for stop in self.stops)
