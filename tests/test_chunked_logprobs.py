"""Chunked log-probs (megarl/workers/chunked_logprobs.py): the numbers and gradients of the whole micro-batch's
logits, a chunk at a time.

By hand on small tensors in this process (TP=1: one-process Megatron state), then on a real tiny Megatron model at
TP=2 on gloo ranks (the vocab-parallel head: max and sum-exp reduced over the TP group per chunk).
"""

from __future__ import annotations

import pytest
import torch
from worker_ranks import random_batch, settings_for

from megarl.bridge.mappings import VocabInfo
from megarl.errors import UserError
from megarl.workers.config import MicroBatchSettings

VOCAB = VocabInfo(size=50, padded_size=64)  # 14 padded rows: masked out of every distribution
HIDDEN = 16
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def megatron_tp1():
    from megarl.runtime.distributed import single_process_megatron

    with single_process_megatron():
        yield


def _inputs(batch: int = 2, seq: int = 13, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, HIDDEN, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(VOCAB.padded_size, HIDDEN, generator=g) * 0.5).requires_grad_()
    ids = torch.randint(0, VOCAB.size, (batch, seq), generator=g)
    return hidden, weight, ids


def _by_hand(hidden, weight, ids, positions=None):
    """log p(next token), entropy and sum p^2 from log_softmax over the real vocabulary, aligned with the tokens."""
    logits = (hidden @ weight.T)[..., : VOCAB.size] / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    token = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    sum_sq = logp.exp().square().sum(-1)[:, :-1]
    out = [torch.nn.functional.pad(v, (1, 0)) for v in (token, entropy, sum_sq)]
    if positions is not None:  # packed rows: no prediction for a sample's first token
        out = [v.masked_fill(positions == 0, 0.0) for v in out]
    return out


def _stats(hidden, weight, ids, positions, chunk_tokens, entropy="grad"):
    from megarl.workers.chunked_logprobs import chunked_token_stats, logits_token_stats

    if chunk_tokens == 0:
        logits = torch.nn.functional.linear(hidden, weight)
        return logits_token_stats(logits, ids, positions, VOCAB, TEMPERATURE, entropy, True)
    return chunked_token_stats(hidden, weight, ids, positions, VOCAB, TEMPERATURE, chunk_tokens, entropy, True)


PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]] * 2)  # three samples in each row


@pytest.mark.parametrize("chunk_tokens", [0, 1, 5, 7, 26, 100], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_chunked_stats_equal_log_softmax_by_hand(megatron_tp1, chunk_tokens, packed):
    hidden, weight, ids = _inputs()
    positions = PACKED_POSITIONS if packed else None
    with torch.no_grad():
        stats = _stats(hidden, weight, ids, positions, chunk_tokens)
        expected = _by_hand(hidden, weight, ids, positions)
    for got, want in zip((stats.logprobs, stats.entropy, stats.sum_pi_squared), expected):
        assert got.shape == (2, 13)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [3, 7, 11], ids=lambda c: f"chunk{c}")
def test_chunked_gradients_equal_unchunked_with_masked_tokens(megatron_tp1, chunk_tokens):
    """A PPO-like loss (log-probs and an entropy bonus, 0-weighted prompt and padding tokens): the same loss and
    the same gradients for the hidden states and the head weight, with chunks that do not divide the 26 tokens."""
    weights = torch.ones(2, 13)
    weights[:, :4] = 0  # prompt
    weights[1, 9:] = 0  # padding

    def loss_and_grads(chunk):
        hidden, weight, ids = _inputs(seed=3)
        stats = _stats(hidden, weight, ids, None, chunk)
        loss = -(stats.logprobs * weights).sum() - 0.01 * (stats.entropy * weights).sum()
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad

    ref_loss, ref_hidden_grad, ref_weight_grad = loss_and_grads(0)
    loss, hidden_grad, weight_grad = loss_and_grads(chunk_tokens)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden_grad, ref_hidden_grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weight_grad, ref_weight_grad, atol=1e-6, rtol=1e-6)
    assert weight_grad[VOCAB.size :].abs().max() == 0  # padded rows: no probability, no gradient
    assert hidden_grad[1, 9:].abs().max() == 0  # masked tokens: no gradient


def test_metric_entropy_carries_no_gradient(megatron_tp1):
    hidden, weight, ids = _inputs()
    stats = _stats(hidden, weight, ids, None, 5, entropy="metric")
    assert stats.logprobs.requires_grad and not stats.entropy.requires_grad
    assert _stats(hidden, weight, ids, None, 5, entropy="off").entropy is None


def test_bad_chunk_size_is_refused_naming_the_key():
    with pytest.raises(UserError, match=r"actor.micro_batch.logprob_chunk_tokens=-1 must be >= 0 \(0 = off"):
        MicroBatchSettings(logprob_chunk_tokens=-1).check("actor.micro_batch")


# ---- a real Megatron model at TP=2 -------------------------------------------------------------------------------


def chunked_and_unchunked(path: str, layout, batch, chunk_tokens: int):
    """Rank side: log-probs (with entropy and sum p^2) and an update with an entropy bonus, unchunked and chunked,
    on one model (lr = 0: the update leaves the weights as they were): {chunk: (log-prob Batch or None, update
    metrics, gradients by parameter name)}."""
    from worker_ranks import _dp_part, _init, _share_from_output_rank

    from megarl.algorithms.aggregation import loss_weights
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.workers.policy import compute_logprobs, update_policy
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model_settings, optim = settings_for(path, layout, lr=0.0)
    model = build_role_model(model_settings, optimizer=optim, total_steps=10)
    _, part = _dp_part(batch.with_tensors(loss_weights=loss_weights("token-mean", batch["response_mask"])))
    loss_fn = PolicyLoss(PolicyLossConfig(entropy_coef=0.01))
    results = {}
    for chunk in (0, chunk_tokens):
        out = compute_logprobs(model, part, 0.7, 64, with_entropy=True, packing=True, with_sum_pi_squared=True,
                               chunk_tokens=chunk)  # fmt: skip
        old = _share_from_output_rank(out, part) + 0.05  # off-policy: ratios away from 1
        metrics = update_policy(model, part.with_tensors(old_logprobs=old), loss_fn, 0.7, 64, True, chunk)
        grads = {name: p.main_grad.clone() for name, p in model.chunks[0].named_parameters()}
        results[chunk] = (out, metrics, grads)
    return results


def test_chunked_equals_unchunked_on_megatron_at_tp2(ranks4, hf_checkpoint):
    """Packed micro-batches (the product default), two data-parallel replicas. (Sequence parallelism cannot be
    built on CPU: Megatron's torch norms refuse it.)"""
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(4, vocab_size=1000, seed=5)
    results = ranks4.run(chunked_and_unchunked, folder, (2, 1, 1), batch, 13)
    answered = 0
    for rank_results in results:
        (ref_out, ref_metrics, ref_grads), (out, metrics, grads) = rank_results[0], rank_results[13]
        if ref_out is not None:
            answered += 1
            for name in ("logprobs", "entropy", "sum_pi_squared"):
                torch.testing.assert_close(out[name], ref_out[name], atol=1e-6, rtol=1e-6)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        assert metrics["entropy"] == pytest.approx(ref_metrics["entropy"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert answered == 2  # TP rank 0 of each of the two data-parallel replicas
