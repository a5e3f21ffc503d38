"""The policy losses, advantage estimators and KL controller that verl registers, under verl's names: hand-computed
values, gradients where their form is the point of the loss, and every aggregation mode.

The expected numbers were worked out from each paper's formula token by token, with scalar arithmetic (Python's
math module, never the tensor code under test), and are written out below; none is recomputed here.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.advantages import AdvantageInputs, apply_kl_penalty, compute_advantages
from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import AdvantageConfig, AlgorithmConfig, KLConfig, PolicyLossConfig
from megarl.algorithms.kl import adaptive_kl_coef
from megarl.algorithms.losses import PolicyLoss
from megarl.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from megarl.errors import UserError

F64 = torch.float64
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NORM_LEN = 4


def batch():
    """Two rows (2 and 3 response tokens, a padded slot whose log-probs are nonsense) of (old log-prob, ratio,
    advantage): row 0: p_old 0.5, 0.5; ratios 1.5, 0.9; A 1, -0.5. Row 1: p_old 0.25, 0.8, 0.5; ratios 0.7, 1.1,
    1.3; A 0.5, 0.5, -2. So p_new = 0.75, 0.45 / 0.175, 0.88, 0.65."""
    old = torch.tensor([[0.5, 0.5, 1.0], [0.25, 0.8, 0.5]], dtype=F64).log()
    ratio = torch.tensor([[1.5, 0.9, 1.0], [0.7, 1.1, 1.3]], dtype=F64)
    new = (old + ratio.log()).clone()
    new[0, 2] = -1e4  # padding: must not reach the loss or the gradient
    advantages = torch.tensor([[1.0, -0.5, 7.0], [0.5, 0.5, -2.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return old, new.requires_grad_(), advantages, mask


# name, config changes, per-token loss (row 0: 2 tokens, row 1: 3), gradient d loss / d logp (None: not checked),
# aggregates in MODES order (token-mean: sum / 5; seq-mean-token-sum: sum / 2; seq-mean-token-mean: row means
# averaged; seq-mean-token-sum-norm with norm_len 4: sum / 8)
CASES = [
    (
        # gate 4/tau * sigmoid(tau (r - 1)); tau 1 for A > 0, 1.05 for A <= 0; grad -A * r * 4 s (1 - s)
        "sapo",
        {},
        [[-2.4898373248, 0.9024268393], [-0.8511149664, -1.049958375, 4.4046112982]],
        [[-1.4100222732, 0.448761963], [-0.3422416364, -0.5486272884, 2.536555555]],
        [0.1832254943, 0.4580637357, 0.0204037048, 0.1145159339],
    ),
    (
        # -A * logp; grad -A
        "gpg",
        {},
        [[0.2876820725, -0.3992538481], [0.8714846525, 0.0639166858, -0.8615658322]],
        [[-1.0, 0.5], [-0.5, -0.5, 2.0]],
        [-0.0075472539, -0.0188681348, -0.0155870262, -0.0047170337],
    ),
    (
        # -clip(r, .8, 1.2) * A * logp: weights 1.2, 0.9, 0.8 (0.7 clipped up), 1.1, 1.2 (1.3 clipped down)
        "cispo",
        {},
        [[0.3452184869, -0.3593284633], [0.697187722, 0.0703083543, -1.0338789986]],
        [[-1.2, 0.45], [-0.4, -0.55, 2.4]],
        [-0.0560985797, -0.1402464493, -0.0479246478, -0.0350616123],
    ),
    (
        # -(A logp - beta / 2 (log r)^2), beta 2; grad -(A - beta log r)
        "dro",
        {"dro_beta": 2.0},
        [[0.4520840263, -0.3881530098], [0.9987016682, 0.0730007161, -0.7927308249]],
        [[-0.1890697838, 0.2892789687], [-1.2133498879, -0.3093796404, 2.5247285289]],
        [0.0685805152, 0.1714512879, 0.062478014, 0.042862822],
    ),
    (
        "dro",
        {},  # the default beta 0.1
        [[0.2959021701, -0.3986988062], [0.8778455033, 0.0643708873, -0.8581240818]],
        [[-0.9594534892, 0.4894639484], [-0.5356674944, -0.490468982, 2.0262364264]],
        [-0.0037408655, -0.0093521636, -0.0116837742, -0.0023380409],
    ),
    (
        # p - p_old: +.25 (A > 0, above .2: untrusted), -.05, -.075, +.08, +.15 (A < 0, above -.2: trusted);
        # weight min(r, 1.25): the 1.3 is truncated
        "dppo_tv",
        {"clip_ratio_c": 1.25},
        [[0.0, -0.3593284633], [0.6100392568, 0.0703083543, -1.0769572902]],
        [[0.0, 0.45], [-0.35, -0.55, 2.5]],
        [-0.1511876285, -0.3779690712, -0.155933729, -0.0944922678],
    ),
    (
        # binary KL .1438 (A > 0, p up, above .1: untrusted), .0050 (A < 0, p down, above .004: untrusted),
        # .0177 (p down against A > 0: always trusted), .0259 (<= .1), .0472 (p up against A < 0: trusted)
        "dppo_kl",
        {"clip_ratio_c": 1.25, "clip_high": 0.1, "clip_low": 0.004},
        [[0.0, 0.0], [0.6100392568, 0.0703083543, -1.0769572902]],
        [[0.0, 0.0], [-0.35, -0.55, 2.5]],
        [-0.0793219358, -0.1983048396, -0.0661016132, -0.0495762099],
    ),
    (
        # row 0: log r .405 -> .2 (A > 0), -.105; R = exp(.0473) = 1.04846, A = .25 -> -.26211 on both tokens
        # row 1: -.357, .0953, .262 (A < 0: not clipped upwards); R = 1.00033, A = -1/3 -> .33344 on all three
        "geo_mean",
        {},
        [[-0.2621142979, -0.2621142979], [0.3334444074, 0.3334444074, 0.3334444074]],
        None,
        [0.0952209253, 0.2380523133, 0.0356650548, 0.0595130783],
    ),
    (
        # PPO: -1.2 (clipped), .45, -.35, -.55, 2.6; covariances (A - (-.1)) (logp - (-.67756)):
        # .4289 (PPO-clipped: not a candidate), .0484, -.6392, .3298, -.4689 -> only .3298 in (.2, 5): loss 0
        "clip_cov",
        {"clip_cov_lb": 0.2, "clip_cov_ratio": 0.2},
        [[-1.2, 0.45], [-0.35, 0.0, 2.6]],
        None,
        [0.3, 0.75, 0.1875, 0.1875],
    ),
    (
        # -A r; the 2 = int(.4 * 5) largest covariances (.4289, .3298) get + 1.0 * |log r| (.405, .0953)
        "kl_cov",
        {"kl_cov_ratio": 0.4, "ppo_kl_coef": 1.0},
        [[-1.0945348919, 0.45], [-0.35, -0.4546898202, 2.6]],
        None,
        [0.2301550576, 0.575387644, 0.1380846403, 0.143846911],
    ),
]


def _padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([[*rows[0], 0.0], rows[1]], dtype=F64)


@pytest.mark.parametrize(
    "name, changes, expected, grad, aggregates", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_policy_loss_hand_values_at_every_aggregation_mode(name, changes, expected, grad, aggregates):
    old, new, advantages, mask = batch()
    config = PolicyLossConfig(name=name, **changes)
    loss, metrics = POLICY_LOSSES.get(name)(new, old, advantages, mask, config)
    torch.testing.assert_close(loss, _padded(expected), rtol=0, atol=1e-9)
    for mode, value in zip(MODES, aggregates):
        weights = loss_weights(mode, mask.to(F64), NORM_LEN)
        assert float((weights * loss).sum().detach()) == pytest.approx(value, abs=1e-9), mode
    (gradient,) = torch.autograd.grad(loss.sum(), new)
    assert torch.isfinite(gradient).all() and gradient[0, 2] == 0  # the padded slot
    if grad is not None:
        torch.testing.assert_close(gradient, _padded(grad), rtol=0, atol=1e-9)
    for value in metrics.values():
        assert value.shape == mask.shape and not value.requires_grad and float(value[0, 2]) == 0


def test_loss_specific_metrics_and_geo_mean_gradient():
    old, new, advantages, mask = batch()
    _, cispo = POLICY_LOSSES.get("cispo")(new, old, advantages, mask, PolicyLossConfig())
    assert cispo["clip_frac"].tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    _, tv = POLICY_LOSSES.get("dppo_tv")(new, old, advantages, mask, PolicyLossConfig())
    assert tv["clip_frac"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    _, kl = POLICY_LOSSES.get("kl_cov")(new, old, advantages, mask, PolicyLossConfig(kl_cov_ratio=0.4))
    assert kl["kl_cov_frac"].tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    loss, geo = POLICY_LOSSES.get("geo_mean")(new, old, advantages, mask, PolicyLossConfig())
    assert geo["clip_frac"].tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    # the gradient of -A_i R_i w.r.t. a token's logp is -A_i R_i / L_i where the min kept the token's own log-ratio,
    # 0 where it took the bound (row 0 token 0 only: its 0.405 became 0.2; row 1's 0.262 has A < 0, so the min
    # keeps it). seq-mean-token-mean counts each sequence's loss once, halved (two sequences).
    weights = loss_weights("seq-mean-token-mean", mask.to(F64))
    (gradient,) = torch.autograd.grad((weights * loss).sum(), new)
    row0 = -0.25 * 1.0484571915 / 2 / 2
    row1 = 1 / 3 * 1.0003332223 / 3 / 2
    expected = torch.tensor([[0.0, row0, 0.0], [row1, row1, row1]], dtype=F64)
    torch.testing.assert_close(gradient, expected, rtol=0, atol=1e-9)


def test_every_verl_loss_runs_through_the_worker_loss_object_without_nan():
    old, new, advantages, mask = batch()
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": advantages, "ref_logprobs": old}
    for name in ("sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro"):
        config = PolicyLossConfig(name=name, kl_loss_coef=0.1, entropy_coef=0.01)
        loss, metrics = PolicyLoss(config)(new, torch.ones_like(old), mb)
        (gradient,) = torch.autograd.grad(loss.sum(), new)
        assert torch.isfinite(loss).all() and torch.isfinite(gradient).all(), name
        assert "pg_loss" in metrics and "kl_loss" in metrics


def test_options_of_another_loss_warn_and_bad_values_name_the_key():
    with pytest.warns(UserWarning, match="tau_pos=2.0 has no effect"):
        PolicyLossConfig(name="cispo", tau_pos=2.0).check("algorithm.policy_loss")
    with pytest.raises(UserError, match=r"algorithm.policy_loss.dro_beta=0.0 must be in \(0.0"):
        PolicyLossConfig(name="dro", dro_beta=0.0).check("algorithm.policy_loss")
    with pytest.raises(UserError, match="clip_cov_ub=1.0 must be greater than algorithm.policy_loss.clip_cov_lb=1.0"):
        PolicyLossConfig(name="clip_cov", clip_cov_ub=1.0).check("algorithm.policy_loss")
    with pytest.raises(UserError, match="clip_ratio_c=1.0 must be in"):
        PolicyLossConfig(name="dppo_tv", clip_ratio_c=1.0).check("algorithm.policy_loss")


# ---- advantage estimators ----------------------------------------------------------------------------------------


def outcome_inputs() -> AdvantageInputs:
    """Three prompts: scores 1, 0, 1 (a tie for best) / 0.5, 0 / 0, 2, 1; response lengths 2, 3, 1 / 2, 2 / 3, 1, 2;
    the score is the last response token's reward."""
    lengths = [2, 3, 1, 2, 2, 3, 1, 2]
    scores = [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 2.0, 1.0]
    mask = torch.zeros(8, 3)
    rewards = torch.zeros(8, 3)
    for row, (length, score) in enumerate(zip(lengths, scores)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    return AdvantageInputs(rewards, mask, torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]))


def per_sample(advantages: torch.Tensor, inputs: AdvantageInputs) -> list[float]:
    """The one advantage each sample has on all its response tokens (checked to be one)."""
    mask = inputs.response_mask_BS.bool()
    values = []
    for row in range(len(mask)):
        tokens = advantages[row][mask[row]]
        assert (tokens == tokens[0]).all() and (advantages[row][~mask[row]] == 0).all()
        values.append(float(tokens[0]))
    return values


@pytest.mark.parametrize(
    "estimator, changes, expected",
    [
        # only each group's first best learns: group 0 ties (1 - 1 = 0); group 1: .5 / (std .35355 + 1e-6);
        # group 2: (2 - 1) / (std 1 + 1e-6)
        ("grpo_passk", {}, [0.0] * 3 + [0.5 / (0.5 / math.sqrt(2) + 1e-6), 0.0, 0.0, 1 / (1 + 1e-6), 0.0]),
        ("grpo_passk", {"norm_by_std": False}, [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0]),
        # length-weighted baselines: (2 + 0 + 1) / 6 = .5; (1 + 0) / 4 = .25; (0 + 2 + 2) / 6 = 2 / 3
        ("opo", {}, [0.5, -0.5, 0.5, 0.25, -0.25, -2 / 3, 4 / 3, 1 / 3]),
        # alpha = 8 samples / 5 non-zero scores = 1.6; group means 2 / 3, .25, 1
        ("gpg", {}, [1.6 / 3, -3.2 / 3, 1.6 / 3, 0.4, -0.4, -1.6, 1.6, 0.0]),
    ],
)
def test_outcome_estimators_hand_values(estimator, changes, expected):
    inputs = outcome_inputs()
    advantages, returns = compute_advantages(inputs, AdvantageConfig(estimator=estimator, **changes))
    assert per_sample(advantages, inputs) == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(returns, advantages)


def test_grpo_passk_needs_two_samples_per_prompt():
    inputs = outcome_inputs()
    inputs.group_ids_B = torch.arange(8)
    with pytest.raises(UserError, match="at least 2 samples per prompt, got 1"):
        compute_advantages(inputs, AdvantageConfig(estimator="grpo_passk"))


def test_remax_subtracts_the_greedy_score_from_the_reward_to_go():
    # row 0: rewards .2, -.1, 1 -> reward-to-go 1.1, .9, 1; greedy score .5 -> .6, .4, .5
    # row 1: a hole at column 1 (its reward 9 is not the response's); rewards .3, 1 -> 1.3, 1; greedy 1 -> .3, 0
    inputs = AdvantageInputs(
        torch.tensor([[0.2, -0.1, 1.0], [0.3, 9.0, 1.0]]),
        torch.tensor([[1, 1, 1], [1, 0, 1]]),
        reward_baselines_B=torch.tensor([0.5, 1.0]),
    )
    advantages, returns = compute_advantages(inputs, AdvantageConfig(estimator="remax"))
    torch.testing.assert_close(advantages, torch.tensor([[0.6, 0.4, 0.5], [0.3, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.1, 0.9, 1.0], [1.3, 0.0, 1.0]]))
    inputs.reward_baselines_B = None
    with pytest.raises(UserError, match="'remax' needs reward_baselines"):
        compute_advantages(inputs, AdvantageConfig(estimator="remax"))


def test_optimal_token_baseline_hand_values():
    # group 0: sample 0 (2 tokens): p = .5, .25, sum p^2 = .5, .3 -> w = 1 - 2p + sum p^2 = .5, .8, W = .5, 1.3;
    # rewards 0, 1 -> G = 1, 1. Sample 1 (1 token): p .8, sum p^2 .7 -> w = W = .1; reward .5 -> G = .5.
    # b_0 = (1 * .5 + .5 * .1) / (.5 + .1) = .91667; b_1 = 1 * 1.3 / 1.3 = 1 (only sample 0 has a 2nd token).
    # group 1: sample 2 alone: baseline 0, advantage = G = 2, 2.
    inputs = AdvantageInputs(
        torch.tensor([[0.0, 1.0], [0.5, 0.0], [0.0, 2.0]]),
        torch.tensor([[1, 1], [1, 0], [1, 1]]),
        torch.tensor([4, 4, 9]),
        old_logprobs_BS=torch.tensor([[0.5, 0.25], [0.8, 0.3], [0.5, 0.5]]).log(),
        sum_pi_squared_BS=torch.tensor([[0.5, 0.3], [0.7, 0.9], [0.5, 0.5]]),
    )
    advantages, returns = compute_advantages(inputs, AdvantageConfig(estimator="optimal_token_baseline"))
    expected = torch.tensor([[1 - 0.55 / 0.6, 0.0], [0.5 - 0.55 / 0.6, 0.0], [2.0, 2.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.5, 0.0], [2.0, 2.0]]))


def test_verl_names_of_reinforce_plus_plus_are_the_same_estimators():
    inputs = outcome_inputs()
    for verl_name, megarl_name in (
        ("reinforce_plus_plus", "reinforce_pp"),
        ("reinforce_plus_plus_baseline", "reinforce_pp_baseline"),
    ):
        assert ADVANTAGE_ESTIMATORS.get(verl_name) is ADVANTAGE_ESTIMATORS.get(megarl_name)
        got = compute_advantages(inputs, AdvantageConfig(estimator=verl_name))
        torch.testing.assert_close(got, compute_advantages(inputs, AdvantageConfig(estimator=megarl_name)))


@pytest.mark.parametrize("estimator", ["grpo_passk", "opo", "gpg", "remax", "optimal_token_baseline"])
def test_all_masked_rows_give_zeros_not_nan(estimator):
    inputs = AdvantageInputs(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([0, 0]),
        reward_baselines_B=torch.zeros(2),
        old_logprobs_BS=torch.zeros(2, 3),
        sum_pi_squared_BS=torch.ones(2, 3),
    )
    advantages, returns = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    assert advantages.tolist() == [[0.0] * 3] * 2 and returns.tolist() == [[0.0] * 3] * 2


# ---- adaptive KL controller --------------------------------------------------------------------------------------


def test_adaptive_kl_update_rule_by_hand():
    # KL .15 vs target .1: error .5 clipped to .2; 64 samples over horizon 1000: 1 + .2 * .064 = 1.0128
    assert adaptive_kl_coef(0.05, 0.15, 0.1, 1000, 64) == pytest.approx(0.05 * 1.0128)
    # KL .09: error -.1 -> 1 - .1 * .064 = .9936
    assert adaptive_kl_coef(0.05, 0.09, 0.1, 1000, 64) == pytest.approx(0.05 * 0.9936)
    # KL 0: error -1 clipped to -.2 -> 1 - .2 * .064 = .9872; on target: unchanged
    assert adaptive_kl_coef(0.05, 0.0, 0.1, 1000, 64) == pytest.approx(0.05 * 0.9872)
    assert adaptive_kl_coef(0.05, 0.1, 0.1, 1000, 64) == pytest.approx(0.05)


def test_the_kl_penalty_uses_the_controllers_coefficient():
    rewards = torch.tensor([[0.0, 1.0]])
    old, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])  # k1 = .5, -1
    shaped, kl = apply_kl_penalty(rewards, old, ref, torch.ones(1, 2), KLConfig(coef=0.1), coef=0.4)
    torch.testing.assert_close(shaped, torch.tensor([[-0.2, 1.4]]))
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0]]))


def test_kl_ctrl_config_checks():
    with pytest.raises(UserError, match="algorithm.kl_ctrl='pid' is not a known KL controller"):
        AlgorithmConfig(kl_ctrl="pid").check("algorithm")
    with pytest.raises(UserError, match=r"kl_ctrl=adaptive scales algorithm.kl.coef, which is 0.0"):
        AlgorithmConfig(kl_ctrl="adaptive").check("algorithm")
    with pytest.raises(UserError, match="algorithm.kl.horizon=0 must be >= 1"):
        KLConfig(horizon=0).check("algorithm.kl")


def test_the_adaptive_coefficient_goes_to_the_metrics_and_the_run_checkpoint(tmp_path):
    """The RL loops' advantage step with kl_ctrl=adaptive: the coefficient it used is logged as kl/coef, the next one
    is kept in the trainer state's `extra`, which run checkpoints save; a resumed run (the state loaded back)
    continues from it, not from algorithm.kl.coef."""
    from megarl.data.batch import Batch
    from megarl.trainer.lifecycle.run_checkpoint import TrainerState
    from megarl.trainer.loops.rl_steps import KL_COEF, add_advantages

    # 2 samples of one prompt, 2 tokens each; k1 KL per token: .2, .2 / .1, .3 -> sequence means .2, .2: KL .2
    batch = Batch(
        {
            "token_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
            "response_mask": torch.ones(2, 2),
            "group_ids": torch.tensor([0, 0]),
            "old_logprobs": torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
            "ref_logprobs": torch.tensor([[-1.2, -1.2], [-1.1, -1.3]]),
        }
    )
    algorithm = AlgorithmConfig(kl=KLConfig(coef=0.05, target_kl=0.1, horizon=10), kl_ctrl="adaptive")
    state = TrainerState()
    _, metrics = add_advantages(batch, algorithm, state.extra)
    assert metrics["kl/coef"] == 0.05 and metrics["kl/sequence_mean"] == pytest.approx(0.2)
    # error clip(.2 / .1 - 1) = .2; 2 samples / horizon 10: 1 + .2 * .2 = 1.04
    assert state.extra[KL_COEF] == pytest.approx(0.052)
    state.save(tmp_path)
    resumed = TrainerState.load(tmp_path)
    _, metrics = add_advantages(batch, algorithm, resumed.extra)
    assert metrics["kl/coef"] == pytest.approx(0.052)
    assert resumed.extra[KL_COEF] == pytest.approx(0.052 * 1.04)
    # fixed: the configured coefficient every step, nothing kept
    fixed = AlgorithmConfig(kl=KLConfig(coef=0.05))
    extra: dict = {}
    assert add_advantages(batch, fixed, extra)[1]["kl/coef"] == 0.05 and extra == {}
