"""Algorithm math, part 2: policy and value losses, off-policy corrections, the loss objects handed to workers.

Values are checked against hand computations; gradients where their form matters (GSPO's token form, decoupled PPO)
against naive autograd references written from the papers' formulas.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import OffPolicyConfig, PolicyLossConfig, ValueLossConfig
from megarl.algorithms.kl import kl_estimate
from megarl.algorithms.losses import PolicyLoss, ValueLoss
from megarl.algorithms.off_policy import off_policy_weights
from megarl.algorithms.policy_loss import gspo, ppo_clip
from megarl.algorithms.value_loss import clipped_value_loss

F64 = torch.float64


def ppo_tokens():
    """Four tokens in one row: (old, new, advantage) chosen to hit each branch of the clipped surrogate."""
    old = torch.tensor([[-2.0, -1.0, -1.0, -1.0]], dtype=F64)
    new = torch.tensor([[-1.5, -1.1, -1.0 + math.log(0.5), 1.0]], dtype=F64, requires_grad=True)
    advantages = torch.tensor([[0.8, 0.5, -1.0, -1.0]], dtype=F64)
    return old, new, advantages, torch.ones(1, 4, dtype=torch.bool)


def test_ppo_clip_hand_values_and_gradient():
    old, new, advantages, mask = ppo_tokens()
    loss, metrics = ppo_clip(new, old, advantages, mask, PolicyLossConfig())
    r1 = math.exp(-0.1)
    # 0: r = e^.5 = 1.6487, A .8: max(-1.3190, -.8 * 1.2) = -0.96 (clipped)
    # 1: r = e^-.1 = .9048 inside [.8, 1.2]: -.5 * .9048
    # 2: r = .5, A -1: max(.5, .8) = .8 (clipped);  3: r = e^2 = 7.389, A -1: max(7.389, 1.2) = 7.389
    expected = torch.tensor([[-0.96, -0.5 * r1, 0.8, math.exp(2)]], dtype=F64)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_frac"].tolist() == [[1.0, 0.0, 1.0, 0.0]]
    torch.testing.assert_close(metrics["ratio"], torch.tensor([[math.exp(0.5), r1, 0.5, math.exp(2)]], dtype=F64))
    torch.testing.assert_close(metrics["approx_kl"], metrics["ratio"] - 1 - (new - old).detach())
    # d loss / d logp = -A * r where unclipped, 0 where clipped
    (grad,) = torch.autograd.grad(loss.sum(), new)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5 * r1, 0.0, math.exp(2)]], dtype=F64))


def test_ppo_clip_higher_and_dual_clip():
    old, new, advantages, mask = ppo_tokens()
    loss, _ = ppo_clip(new, old, advantages, mask, PolicyLossConfig(clip_high=0.28))
    assert float(loss[0, 0].detach()) == pytest.approx(-0.8 * 1.28)  # DAPO clip-higher
    loss, metrics = ppo_clip(new, old, advantages, mask, PolicyLossConfig(dual_clip=3.0))
    # token 3: min(7.389, -A * 3) = 3; token 2 (.8 < 3) unchanged; positive advantages are never dual-clipped
    torch.testing.assert_close(loss[0, 2:], torch.tensor([0.8, 3.0], dtype=F64))
    assert metrics["dual_clip_frac"].tolist() == [[0.0, 0.0, 0.0, 1.0]]
    (grad,) = torch.autograd.grad(loss.sum(), new)
    assert float(grad[0, 3]) == 0.0


def test_padding_cannot_make_nan():
    mask = torch.tensor([[1, 1, 0, 0]])
    logp = torch.tensor([[-1.0, -2.0, -math.inf, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -math.inf, 0.0]])
    mb = {
        "response_mask": mask,
        "old_logprobs": old,
        "advantages": torch.tensor([[1.0, -1.0, math.nan, 0.0]]),
        "ref_logprobs": torch.tensor([[-1.0, -1.0, 0.0, -math.inf]]),
        "rollout_logprobs": torch.tensor([[-1.0, -2.0, math.inf, -math.inf]]),
    }
    for name in ("ppo_clip", "gspo"):
        for mode in ("tis", "mis", "decoupled"):
            config = PolicyLossConfig(name=name, kl_loss_coef=0.1, kl_estimator="k2")
            loss, metrics = PolicyLoss(config, OffPolicyConfig(mode=mode, level="sequence"))(logp, None, mb)
            (grad,) = torch.autograd.grad(loss.sum(), logp)
            assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), (name, mode)
            assert (loss[0, 2:] == 0).all() and (grad[0, 2:] == 0).all()
            assert all(torch.isfinite(m).all() and (m[0, 2:] == 0).all() for m in metrics.values()), (name, mode)


def gspo_case():
    """3 sequences with different lengths, a hole and padding; per-sequence shifts of the log-ratio put sequence 0
    inside the clip range, 1 above it (clipped, A > 0) and 2 below it (not clipped for A > 0)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 1, 1]], dtype=torch.bool)
    old = torch.randn(3, 6, generator=g, dtype=F64) - 2
    shift = torch.tensor([[0.01], [0.3], [-0.3]], dtype=F64)
    new = (old + shift + 0.05 * torch.randn(3, 6, generator=g, dtype=F64)).where(mask, 5.0).requires_grad_()
    advantages = torch.tensor([[1.5], [1.0], [0.7]], dtype=F64) * mask
    return new, old, advantages, mask


def naive_gspo(new, old, advantages, mask, clip_low, clip_high):
    """Sequence-level GSPO: mean over sequences of max(-A s, -A clip(s)), s = exp(mean log-ratio), no detach tricks."""
    total = 0.0
    for b in range(new.shape[0]):
        positions = mask[b].nonzero().flatten()
        s = torch.exp((new[b, positions] - old[b, positions]).mean())
        a = advantages[b, positions[0]]
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
    return total / new.shape[0]


def test_gspo_matches_the_sequence_level_objective_and_its_gradient():
    new, old, advantages, mask = gspo_case()
    config = PolicyLossConfig(name="gspo", clip_low=0.1, clip_high=0.1)
    loss, metrics = gspo(new, old, advantages, mask, config)
    seq_ratio = [math.exp(float((new.detach()[b] - old[b])[mask[b]].mean())) for b in range(3)]
    for b in range(3):  # every token of a sequence carries its sequence ratio and clip decision
        assert metrics["ratio"][b][mask[b]].tolist() == pytest.approx([seq_ratio[b]] * int(mask[b].sum()))
    assert [float(metrics["clip_frac"][b][mask[b]][0]) for b in range(3)] == [0.0, 1.0, 0.0]
    weights = loss_weights("seq-mean-token-mean", mask.to(F64))
    total = (loss * weights).sum()
    reference = naive_gspo(new, old, advantages, mask, 0.1, 0.1)
    torch.testing.assert_close(total, reference)
    (grad,) = torch.autograd.grad(total, new, retain_graph=True)
    (reference_grad,) = torch.autograd.grad(reference, new)
    torch.testing.assert_close(grad, reference_grad)
    assert (grad[1] == 0).all() and (grad[~mask] == 0).all()
    # token form: d loss_t / d logp_t = -A * s_i on unclipped sequences, whatever the token's own ratio
    (token_grad,) = torch.autograd.grad(loss.sum(), new)
    torch.testing.assert_close(token_grad[0][mask[0]], torch.full((4,), -1.5 * seq_ratio[0], dtype=F64))


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.6, 3.0, 9.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old_values, returns, mask, clip=0.2)
    # 0: max((1-2)^2, (.7-2)^2) = 1.69 -> .845 (clipped branch); 1: |.6-.5| < .2 -> .5 * .36; 2: max(4, 1.44) -> 2
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.18, 2.0, 0.0]]))
    assert metrics["vf_clip_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    (grad,) = torch.autograd.grad(loss.sum(), values)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.6, 2.0, 0.0]]))  # clipped branch: no gradient
    loss, _ = clipped_value_loss(values, old_values, returns, mask, clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.18, 2.0, 0.0]]))
    loss, metrics = ValueLoss(ValueLossConfig(coef=0.5))(
        values, {"old_values": old_values, "returns": returns, "response_mask": mask}
    )
    torch.testing.assert_close(loss, torch.tensor([[0.4225, 0.09, 1.0, 0.0]]))
    torch.testing.assert_close(metrics["vf_loss"], loss.detach())


# ---- off-policy corrections ---------------------------------------------------------------------------------------


def mismatch_case():
    """Token ratios rho = pi_old / pi_rollout of 0.5, 3, 1.2 and 0.3 (row 0), 1.0 (row 1), padding at the end."""
    rho = torch.tensor([[0.5, 3.0, 1.2, 0.3], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    rollout = torch.full((2, 4), -1.0, dtype=F64)
    return rollout + rho.log(), rollout, mask


def test_truncated_is_token_and_sequence_level():
    old, rollout, mask = mismatch_case()
    weights, metrics = off_policy_weights(old, rollout, mask, OffPolicyConfig(mode="tis", clip=2.0))
    torch.testing.assert_close(weights, torch.tensor([[0.5, 2.0, 1.2, 0.3], [1.0, 0, 0, 0]], dtype=F64))
    assert metrics["is_clipped"].tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0] * 4]
    assert (metrics["rollout_kl"] >= 0).all() and float(metrics["rollout_kl"][0, 0]) == pytest.approx(
        0.5 - 1 + math.log(2)
    )
    # sequence: rho = .5 * 3 * 1.2 * .3 = .54 for row 0 (not capped), 1 for row 1
    weights, metrics = off_policy_weights(old, rollout, mask, OffPolicyConfig(mode="tis", level="sequence", clip=0.5))
    torch.testing.assert_close(weights, torch.tensor([[0.5] * 4, [0.5, 0, 0, 0]], dtype=F64))
    assert metrics["is_clipped"].tolist() == [[1.0] * 4, [1.0, 0.0, 0.0, 0.0]]
    weights, _ = off_policy_weights(old, rollout, mask, OffPolicyConfig(mode="tis", level="sequence"))
    torch.testing.assert_close(weights[0], torch.full((4,), 0.54, dtype=F64))


def test_masked_is_drops_tokens_or_sequences_outside_the_range():
    old, rollout, mask = mismatch_case()
    weights, metrics = off_policy_weights(old, rollout, mask, OffPolicyConfig(mode="mis", low=0.4, high=2.0))
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.0, 1.2, 0.0], [1.0, 0, 0, 0]], dtype=F64))
    assert metrics["is_masked"].tolist() == [[0.0, 1.0, 0.0, 1.0], [0.0] * 4]
    config = OffPolicyConfig(mode="mis", level="sequence", low=0.6, high=2.0)  # row 0 has rho .54: dropped whole
    weights, metrics = off_policy_weights(old, rollout, mask, config)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 4, [1.0, 0, 0, 0]], dtype=F64))
    assert metrics["is_masked"].tolist() == [[1.0] * 4, [0.0] * 4]


def test_off_policy_none_needs_no_rollout_logprobs():
    loss_fn = PolicyLoss(PolicyLossConfig())
    assert not loss_fn.needs_rollout_logprobs and not loss_fn.needs_ref and not loss_fn.needs_entropy
    old = torch.zeros(1, 2)
    mb = {"old_logprobs": old, "advantages": torch.ones(1, 2), "response_mask": torch.ones(1, 2)}
    loss, metrics = loss_fn(old.clone().requires_grad_(), None, mb)
    torch.testing.assert_close(loss, torch.full((1, 2), -1.0))
    assert "is_weight" not in metrics and "entropy" not in metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_ppo_matches_the_formula_and_its_gradient(level):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    behav = torch.randn(2, 5, generator=g, dtype=F64) - 2  # rollout engine
    prox = behav + 0.3 * torch.randn(2, 5, generator=g, dtype=F64)  # trainer before the update
    theta = (prox + 0.3 * torch.randn(2, 5, generator=g, dtype=F64)).requires_grad_()
    advantages = torch.randn(2, 5, generator=g, dtype=F64) * mask
    mb = {"old_logprobs": prox, "rollout_logprobs": behav, "advantages": advantages, "response_mask": mask}
    loss_fn = PolicyLoss(PolicyLossConfig(), OffPolicyConfig(mode="decoupled", level=level))
    assert loss_fn.needs_rollout_logprobs
    loss, metrics = loss_fn(theta, None, mb)

    # the formula, with probabilities: -sg(pi_prox / pi_behav) * min(r A, clip(r) A), r = pi_theta / pi_prox
    pi_theta, pi_prox, pi_behav = theta.exp(), prox.exp(), behav.exp()
    behav_weight = pi_prox / pi_behav
    if level == "sequence":
        behav_weight = torch.where(mask, behav_weight, 1.0).prod(dim=1, keepdim=True).expand(2, 5)
    r = pi_theta / pi_prox
    reference = -behav_weight.detach() * torch.minimum(r * advantages, r.clamp(0.8, 1.2) * advantages) * mask
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(metrics["is_weight"], behav_weight * mask)
    weights = loss_weights("token-mean", mask)
    (grad,) = torch.autograd.grad((loss * weights).sum(), theta)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), theta)
    torch.testing.assert_close(grad, reference_grad)
    # and by hand: -w * A * r / num_tokens where r is inside the clip range (or clipping would not bind), else 0
    binds = ((r > 1.2) & (advantages > 0)) | ((r < 0.8) & (advantages < 0))
    by_hand = torch.where(binds, 0.0, -behav_weight * advantages * r) * mask / mask.sum()
    torch.testing.assert_close(grad, by_hand.detach())


# ---- the loss objects -------------------------------------------------------------------------------------------


def full_micro_batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]], dtype=torch.int8
    )  # row 3: no response tokens
    old = torch.randn(5, 5, generator=g) - 2
    mb = {
        "response_mask": mask,
        "old_logprobs": old,
        "rollout_logprobs": old + 0.2 * torch.randn(5, 5, generator=g),
        "ref_logprobs": old + 0.5 * torch.randn(5, 5, generator=g),
        "advantages": torch.randn(5, 5, generator=g) * mask,
    }
    logprobs = (old + 0.2 * torch.randn(5, 5, generator=g)).requires_grad_()
    entropy = (torch.rand(5, 5, generator=g) + 0.5).requires_grad_()
    return logprobs, entropy, mb


def test_policy_loss_is_weighted_surrogate_plus_kl_minus_entropy():
    logprobs, entropy, mb = full_micro_batch()
    config = PolicyLossConfig(kl_loss_coef=0.1, kl_estimator="k2", kl_clamp=None, entropy_coef=0.01)
    off_policy = OffPolicyConfig(mode="tis", clip=1.1)
    loss_fn = PolicyLoss(config, off_policy)
    assert loss_fn.needs_ref and loss_fn.needs_entropy and loss_fn.needs_rollout_logprobs
    loss, metrics = loss_fn(logprobs, entropy, mb)

    mask = mb["response_mask"].bool()
    surrogate, _ = ppo_clip(logprobs, mb["old_logprobs"], mb["advantages"], mask, config)
    is_weight, _ = off_policy_weights(mb["old_logprobs"], mb["rollout_logprobs"], mask, off_policy)
    kl = kl_estimate("k2", logprobs, mb["ref_logprobs"])
    expected = (is_weight * surrogate + 0.1 * kl - 0.01 * entropy) * mask
    torch.testing.assert_close(loss, expected)
    assert set(metrics) == {
        "clip_frac",
        "ratio",
        "approx_kl",
        "is_weight",
        "is_clipped",
        "rollout_kl",
        "pg_loss",
        "kl_loss",
        "entropy",
    }
    torch.testing.assert_close(metrics["pg_loss"], (is_weight * surrogate * mask).detach())
    assert all(not m.requires_grad and m.shape == (5, 5) and (m[~mask] == 0).all() for m in metrics.values())
    (grad_entropy,) = torch.autograd.grad(loss.sum(), entropy)
    torch.testing.assert_close(grad_entropy, -0.01 * mask.float())


def test_policy_loss_says_what_the_micro_batch_lacks():
    logprobs, entropy, mb = full_micro_batch()
    del mb["ref_logprobs"]
    with pytest.raises(KeyError, match="no 'ref_logprobs', needed by algorithm.policy_loss.kl_loss_coef > 0"):
        PolicyLoss(PolicyLossConfig(kl_loss_coef=0.1))(logprobs, entropy, mb)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs the entropy"):
        PolicyLoss(PolicyLossConfig(entropy_coef=0.01))(logprobs, None, mb)


@pytest.mark.parametrize("name, aggregation", [("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean")])
def test_micro_batch_gradients_sum_to_the_mini_batch_gradient(name, aggregation):
    logprobs, entropy, mb = full_micro_batch(seed=3)
    loss_fn = PolicyLoss(PolicyLossConfig(name=name, kl_loss_coef=0.05, entropy_coef=0.01), OffPolicyConfig("mis"))
    mb["loss_weights"] = loss_weights(aggregation, mb["response_mask"])  # the controller, once per mini-batch
    loss, _ = loss_fn(logprobs, entropy, mb)
    (full_grad,) = torch.autograd.grad((loss * mb["loss_weights"]).sum(), logprobs)
    assert torch.isfinite(full_grad).all() and (loss[3] == 0).all() and (full_grad[3] == 0).all()  # empty row
    split_grad = torch.zeros_like(full_grad)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 5)):  # the worker: micro-batches, gradients accumulate
        micro = {k: v[rows] for k, v in mb.items()}
        lp = logprobs.detach()[rows].clone().requires_grad_()
        micro_loss, _ = loss_fn(lp, entropy.detach()[rows], micro)
        (grad,) = torch.autograd.grad((micro_loss * micro["loss_weights"]).sum(), lp)
        split_grad[rows] = grad
    torch.testing.assert_close(split_grad, full_grad)


def test_loss_objects_pickle():
    logprobs, entropy, mb = full_micro_batch()
    loss_fn = PolicyLoss(PolicyLossConfig(name="gspo", entropy_coef=0.01), OffPolicyConfig(mode="tis"))
    clone = pickle.loads(pickle.dumps(loss_fn))
    torch.testing.assert_close(clone(logprobs, entropy, mb)[0], loss_fn(logprobs, entropy, mb)[0])
    assert clone.needs_entropy and clone.off_policy == loss_fn.off_policy
    value_fn = pickle.loads(pickle.dumps(ValueLoss(ValueLossConfig(clip=None))))
    assert value_fn.config.clip is None
