"""Algorithm math, part 1: registries, configs, advantage estimators, KL estimators, aggregation weights, DAPO.

Numbers are checked against hand computations (shown in comments) or naive per-element Python loops.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from megarl.algorithms import advantages as adv
from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import (
    OFF_POLICY_LEVELS,
    AdvantageConfig,
    AlgorithmConfig,
    DapoConfig,
    KLConfig,
    OffPolicyConfig,
    PolicyLossConfig,
    ValueLossConfig,
)
from megarl.algorithms.dapo import add_to_last_token, apply_overlong_penalty, keep_groups, overlong_penalty
from megarl.algorithms.kl import kl_estimate
from megarl.algorithms.off_policy import LEVELS
from megarl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    Builtin,
    Registry,
)
from megarl.errors import UserError

F64 = torch.float64


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask_BS, attention_mask_BS) of 5 rows, 9 columns: different prompt lengths, right padding, a masked
    hole inside a response (multi-turn tool output), a row without response tokens."""
    attention = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    response = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0, 1, 1, 1, 0],  # tokens 3, 4 are tool output inside the response
            [0, 0, 0, 0, 0, 0, 0, 0, 0],  # no response
            [0, 0, 0, 0, 0, 0, 0, 0, 1],
        ]
    )
    return response, attention


def random_rewards(mask_BS: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(mask_BS.shape, generator=g, dtype=F64) * mask_BS


# ---- registries -------------------------------------------------------------------------------------------------


def test_registry_unknown_name_lists_valid_ones_and_the_closest():
    with pytest.raises(UserError) as error:
        ADVANTAGE_ESTIMATORS.get("grpoo", "algorithm.advantage.estimator")
    message = str(error.value)
    assert "algorithm.advantage.estimator='grpoo'" in message
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert name in message
    assert "did you mean 'grpo'?" in message
    with pytest.raises(UserError, match="did you mean 'k3'"):
        KL_ESTIMATORS.get("K3", "algorithm.kl.estimator")
    verl_losses = "sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl, dro"
    with pytest.raises(UserError, match=f"valid: ppo_clip, gspo, {verl_losses}$"):
        POLICY_LOSSES.get("something_else", "algorithm.policy_loss.name")


def test_registry_contents_and_registration():
    assert AGGREGATIONS.names() == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert OFF_POLICY_CORRECTIONS.names() == ["none", "tis", "mis", "decoupled"]
    assert ADVANTAGE_ESTIMATORS.traits("gae")["needs_values"] is True
    assert ADVANTAGE_ESTIMATORS.traits("grpo")["needs_groups"] is True
    assert set(OFF_POLICY_LEVELS) == set(LEVELS)

    registry = Registry("widget")

    @registry.register("a", color="red")
    def a():
        return 1

    assert registry.get("a")() == 1 and registry.traits("a") == {"color": "red"} and "a" in registry
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(lambda: 2)
    with pytest.raises(UserError, match="x.kind='b' is not a known widget; valid: a$"):
        registry.get("b", "x.kind")


# ---- configs ----------------------------------------------------------------------------------------------------


def test_config_module_imports_no_torch():
    code = "import sys, megarl.algorithms.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_listed_variant_is_implemented_where_the_list_says():
    """The torch-free list of built-in names and traits (megarl/algorithms/registry.py) and the modules that
    implement them agree: each built-in name is registered by its module, and a built-in cannot be registered with
    traits of its own or from another module."""
    registries = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, OFF_POLICY_CORRECTIONS)
    for registry in registries:
        for name in registry.names():
            fn = registry.get(name)
            assert fn.__module__ == registry._builtins[name].module, (registry.kind, name)
    widgets = Registry("widget", {"a": Builtin("megarl.widgets", {"color": "red"})})
    assert widgets.names() == ["a"] and widgets.traits("a") == {"color": "red"}  # known before it is imported
    with pytest.raises(ValueError, match="widget 'a' is built in \\(megarl.widgets, traits listed in"):
        widgets.register("a")(lambda: 1)  # implemented elsewhere than its listed module
    assert ADVANTAGE_ESTIMATORS.traits("dr_grpo") == {
        "needs_values": False,
        "needs_groups": True,
        "options": frozenset(),
        "aggregation": "seq-mean-token-sum-norm",
    }


def test_default_configs_pass_and_work_with_omegaconf():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = AlgorithmConfig()
        for key, section in vars(config).items():
            if dataclasses.is_dataclass(section):  # sections; the routing-replay settings are plain values
                section.check(f"algorithm.{key}")
        config.check("algorithm")
    merged = OmegaConf.merge(
        OmegaConf.structured(AlgorithmConfig),
        OmegaConf.from_dotlist(["advantage.estimator=gae", "policy_loss.dual_clip=3.0", "value_loss.clip=null"]),
    )
    built = OmegaConf.to_object(merged)
    assert isinstance(built, AlgorithmConfig) and built.advantage.estimator == "gae"
    assert built.policy_loss.dual_clip == 3.0 and built.value_loss.clip is None
    assert built.needs_critic() and not built.needs_ref() and not built.needs_rollout_logprobs()
    assert pickle.loads(pickle.dumps(built)) == built


@pytest.mark.parametrize(
    "config, key, match",
    [
        (AdvantageConfig(gamma=1.5), "a", r"a.gamma=1.5 must be in \[0.0, 1.0\]"),
        (AdvantageConfig(estimator="ppo"), "a", "a.estimator='ppo' is not a known advantage estimator"),
        (PolicyLossConfig(clip_low=1.0), "p", r"p.clip_low=1.0 must be in \[0.0, 1.0\)"),
        (PolicyLossConfig(dual_clip=0.5), "p", "p.dual_clip=0.5 must be > 1"),
        (PolicyLossConfig(aggregation="token_mean"), "p", "did you mean 'token-mean'"),
        (PolicyLossConfig(kl_estimator="k4"), "p", "p.kl_estimator='k4' is not a known KL estimator"),
        (KLConfig(coef=-1.0), "k", r"k.coef=-1.0 must be in \[0.0, inf\)"),
        (ValueLossConfig(clip=0.0), "v", r"v.clip=0.0 must be in \(0.0, inf\)"),
        (DapoConfig(overlong_buffer_len=8, max_response_len=8), "d", "d.max_response_len=8 must be greater"),
        (DapoConfig(max_sampling_rounds=0), "d", "d.max_sampling_rounds=0 must be >= 1"),
        (OffPolicyConfig(mode="tiss"), "o", "did you mean 'tis'"),
        (OffPolicyConfig(level="seq"), "o", "o.level='seq' is not a known off-policy level; valid: token, sequence"),
        (OffPolicyConfig(mode="mis", low=2.0, high=1.0), "o", "o.high=1.0 must be greater than o.low=2.0"),
    ],
)
def test_config_errors_name_the_key_and_valid_values(config, key, match):
    with pytest.raises(UserError, match=match):
        config.check(key)


def test_the_loader_walk_names_nested_keys():
    from megarl.config.schema import run_checks  # what the config loader runs on the built tree

    config = AlgorithmConfig(policy_loss=PolicyLossConfig(name="ppo"))
    with pytest.raises(UserError, match="algorithm.policy_loss.name='ppo' is not a known policy loss"):
        run_checks(config, "algorithm")
    with pytest.raises(UserError, match="^policy_loss.name='ppo'"):  # at the top level the key is ""
        run_checks(config, "")


def test_cross_section_checks_and_warnings():
    config = AlgorithmConfig(advantage=AdvantageConfig(estimator="gae"), dapo=DapoConfig(dynamic_sampling=True))
    with pytest.raises(UserError, match="algorithm.dapo.dynamic_sampling=true .* use one of: grpo, dr_grpo, rloo"):
        config.check("algorithm")
    with pytest.warns(UserWarning, match="seq-mean-token-sum-norm"):
        AlgorithmConfig(advantage=AdvantageConfig(estimator="dr_grpo")).check("algorithm")
    with pytest.warns(UserWarning, match=r"a.gamma=0.9 has no effect with a.estimator='grpo'"):
        AdvantageConfig(gamma=0.9).check("a")
    with pytest.warns(UserWarning, match="p.dual_clip=3.0 has no effect with p.name='gspo'"):
        PolicyLossConfig(name="gspo", dual_clip=3.0).check("p")
    with pytest.warns(UserWarning, match="o.clip=3.0 has no effect with o.mode='mis'"):
        OffPolicyConfig(mode="mis", clip=3.0).check("o")
    assert AlgorithmConfig(off_policy=OffPolicyConfig(mode="tis")).needs_rollout_logprobs()
    assert AlgorithmConfig(policy_loss=PolicyLossConfig(kl_loss_coef=0.001)).needs_ref()


# ---- advantages -------------------------------------------------------------------------------------------------


def test_gae_hand_example():
    # rewards [0,0,0,1], values [.5,.6,.7,.8], gamma .99, lam .95, V after the last token = 0:
    # A3 = 1 - .8 = .2; A2 = (.99*.8 - .7) + .9405*.2 = .2801; A1 = (.99*.7 - .6) + .9405*.2801 = .35643405;
    # A0 = (.99*.6 - .5) + .9405*.35643405 = .42922622
    inputs = adv.AdvantageInputs(
        token_rewards_BS=torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64),
        response_mask_BS=torch.ones(1, 4, dtype=torch.bool),
        values_BS=torch.tensor([[0.5, 0.6, 0.7, 0.8]], dtype=F64),
    )
    config = AdvantageConfig(estimator="gae", gamma=0.99, lam=0.95, gae_whiten=False)
    advantages, returns = adv.compute_advantages(inputs, config)
    expected = torch.tensor([[0.42922622, 0.35643405, 0.2801, 0.2]], dtype=F64)
    torch.testing.assert_close(advantages, expected, atol=1e-8, rtol=0)
    assert advantages.round(decimals=4).tolist() == [[0.4292, 0.3564, 0.2801, 0.2]]
    torch.testing.assert_close(returns, expected + inputs.values_BS)


def naive_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the response positions right to left with Python floats."""
    out = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for b in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_adv = delta + gamma * lam * next_adv
            out[b][t] = next_adv
            next_value = float(values[b, t])
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_a_naive_loop_with_padding_and_holes(gamma, lam):
    mask, _ = padded_batch()
    rewards = random_rewards(mask, seed=1)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=F64)  # garbage off-mask
    inputs = adv.AdvantageInputs(rewards, mask, values_BS=values)
    config = AdvantageConfig(estimator="gae", gamma=gamma, lam=lam, gae_whiten=False)
    advantages, returns = adv.gae(inputs, config)
    torch.testing.assert_close(advantages, naive_gae(rewards, values * mask, mask, gamma, lam))
    torch.testing.assert_close(returns, (advantages + values) * mask)
    if lam == 1.0:  # Monte-Carlo: A_t = discounted return from t - V_t
        row, positions = 2, [1, 2, 5, 6, 7]
        for i, t in enumerate(positions):
            ret = sum(gamma**k * float(rewards[row, p]) for k, p in enumerate(positions[i:]))
            assert math.isclose(float(advantages[row, t]), ret - float(values[row, t]), abs_tol=1e-12)


def test_gae_whitening_is_over_the_batch_and_leaves_returns():
    mask, _ = padded_batch()
    inputs = adv.AdvantageInputs(random_rewards(mask, 3), mask, values_BS=random_rewards(mask, 4))
    raw, raw_returns = adv.gae(inputs, AdvantageConfig(estimator="gae", gae_whiten=False))
    white, returns = adv.gae(inputs, AdvantageConfig(estimator="gae", gae_whiten=True, eps=0.0))
    torch.testing.assert_close(returns, raw_returns)
    selected = raw[mask.bool()]
    torch.testing.assert_close(white[mask.bool()], (selected - selected.mean()) / selected.std())
    assert (white[~mask.bool()] == 0).all()


def group_inputs():
    # 7 samples, one reward on the last response token; groups named 7 (size 4), 3 (size 2), 9 (size 1)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 0], [0, 1, 1]])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 5.0], dtype=F64)
    rewards = add_to_last_token(torch.zeros(mask.shape, dtype=F64), mask, scores)
    group_ids = torch.tensor([7, 7, 7, 3, 7, 3, 9])
    return adv.AdvantageInputs(rewards, mask, group_ids_B=group_ids), scores


def per_sample(advantages, mask):
    """The one value each row holds on its response tokens (checking that it is constant there and 0 elsewhere)."""
    values = []
    for row, row_mask in zip(advantages, mask.bool()):
        assert (row[~row_mask] == 0).all()
        assert torch.allclose(row[row_mask], row[row_mask][0].expand(int(row_mask.sum())))
        values.append(float(row[row_mask][0]))
    return values


def test_grpo_hand_values_unbiased_std_and_group_of_one():
    inputs, _ = group_inputs()
    advantages, returns = adv.grpo(inputs, AdvantageConfig(eps=0.0))
    # group 7: scores 1, 0, 0, 2 -> mean 0.75, unbiased var (0.0625 + 0.5625 * 2 + 1.5625) / 3 = 0.91667
    s7 = math.sqrt(2.75 / 3)
    # group 3: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5); group 9: one sample -> 0
    s3 = math.sqrt(0.5)
    expected = [0.25 / s7, -0.75 / s7, -0.75 / s7, 0.5 / s3, 1.25 / s7, -0.5 / s3, 0.0]
    assert per_sample(advantages, inputs.response_mask_BS) == pytest.approx(expected)
    torch.testing.assert_close(returns, advantages)
    # all-equal group: 0, not NaN, with the default eps
    same = adv.AdvantageInputs(torch.ones(3, 2, dtype=F64), torch.ones(3, 2), group_ids_B=torch.zeros(3).long())
    assert (adv.grpo(same, AdvantageConfig())[0] == 0).all()


def test_dr_grpo_and_grpo_without_std_are_mean_centered():
    inputs, _ = group_inputs()
    advantages, _ = adv.dr_grpo(inputs, AdvantageConfig())
    expected = [0.25, -0.75, -0.75, 0.5, 1.25, -0.5, 0.0]
    assert per_sample(advantages, inputs.response_mask_BS) == pytest.approx(expected)
    torch.testing.assert_close(adv.grpo(inputs, AdvantageConfig(norm_by_std=False))[0], advantages)


def test_rloo_leave_one_out_baseline():
    inputs, _ = group_inputs()
    advantages, _ = adv.rloo(inputs, AdvantageConfig())
    # group 7 (1, 0, 0, 2): 1 - 2/3, 0 - 1, 0 - 1, 2 - 1/3; group 3 (1, 0): 1 - 0, 0 - 1; group 9: 0
    expected = [1 / 3, -1.0, -1.0, 1.0, 5 / 3, -1.0, 0.0]
    assert per_sample(advantages, inputs.response_mask_BS) == pytest.approx(expected)


def naive_whiten(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / std for v in values]


def test_reinforce_pp_returns_match_a_naive_loop_and_are_whitened_over_the_batch():
    mask, _ = padded_batch()
    rewards = random_rewards(mask, 5)
    advantages, returns = adv.reinforce_pp(adv.AdvantageInputs(rewards, mask), AdvantageConfig(gamma=0.9, eps=0.0))
    torch.testing.assert_close(returns, naive_gae(rewards, torch.zeros_like(rewards), mask, 0.9, 1.0))
    # row 2 by hand: positions 1, 2, 5, 6, 7 (3, 4 are a hole: one discount step across it)
    r = rewards[2]
    assert math.isclose(float(returns[2, 2]), r[2] + 0.9 * r[5] + 0.81 * r[6] + 0.729 * r[7], abs_tol=1e-12)
    flat = [float(returns[b, t]) for b in range(5) for t in range(9) if mask[b, t]]
    whitened = naive_whiten(flat)
    assert [float(advantages[b, t]) for b in range(5) for t in range(9) if mask[b, t]] == pytest.approx(whitened)
    assert (advantages[~mask.bool()] == 0).all()


def test_reinforce_pp_baseline_centers_per_group_then_whitens_per_token():
    inputs, _ = group_inputs()
    advantages, returns = adv.reinforce_pp_baseline(inputs, AdvantageConfig(eps=0.0))
    centered = [0.25, -0.75, -0.75, 0.5, 1.25, -0.5, 0.0]
    assert per_sample(returns, inputs.response_mask_BS) == pytest.approx(centered)
    lengths = inputs.response_mask_BS.sum(dim=1).tolist()
    tokens = [c for c, n in zip(centered, lengths) for _ in range(n)]  # whitening counts every response token
    white = naive_whiten(tokens)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    assert per_sample(advantages, inputs.response_mask_BS) == pytest.approx([white[s] for s in starts])


def test_estimators_say_what_they_miss():
    mask = torch.ones(2, 3)
    with pytest.raises(UserError, match="'grpo' needs group_ids"):
        adv.compute_advantages(adv.AdvantageInputs(torch.zeros(2, 3), mask), AdvantageConfig())
    with pytest.raises(UserError, match="'gae' needs critic values"):
        adv.compute_advantages(adv.AdvantageInputs(torch.zeros(2, 3), mask), AdvantageConfig(estimator="gae"))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_all_masked_rows_give_zeros_not_nan(estimator):
    mask = torch.zeros(3, 4)
    inputs = adv.AdvantageInputs(torch.zeros(3, 4), mask, group_ids_B=torch.tensor([0, 0, 1]), values_BS=mask + 1)
    advantages, returns = adv.compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    assert (advantages == 0).all() and (returns == 0).all()
    assert advantages.dtype == torch.float32  # at least float32 whatever the inputs


def test_kl_penalty_in_the_reward():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, -2.0, -9.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    shaped, kl = adv.apply_kl_penalty(rewards, old, ref, mask, KLConfig(coef=0.1, estimator="k1"))
    # k1 = old - ref = 0.5, -1.0 on the response
    torch.testing.assert_close(kl, torch.tensor([[0.0, 0.5, -1.0, 0.0]]))
    torch.testing.assert_close(shaped, torch.tensor([[0.0, -0.05, 1.1, 0.0]]))


# ---- KL estimators ----------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values_and_clamp():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    ref = torch.tensor([-1.0, -1.0, -2.5], dtype=F64)
    d = logp - ref  # 0, -1, 2
    torch.testing.assert_close(kl_estimate("k1", logp, ref), d)
    torch.testing.assert_close(kl_estimate("k2", logp, ref), torch.tensor([0.0, 0.5, 2.0], dtype=F64))
    # k3 = r - 1 - log r, r = exp(ref - logp): (1 - 1 - 0, e - 1 - 1, e^-2 - 1 + 2)
    expected = torch.tensor([0.0, math.e - 2, math.exp(-2) + 1], dtype=F64)
    torch.testing.assert_close(kl_estimate("k3", logp, ref), expected)
    torch.testing.assert_close(kl_estimate("k1", logp, ref, clamp=0.5), torch.tensor([0.0, -0.5, 0.5], dtype=F64))
    assert torch.isfinite(kl_estimate("k3", torch.tensor([0.0]), torch.tensor([-1e4]))).all()


def test_k1_and_k3_estimate_the_true_kl_on_samples():
    g = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(6, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    logp_all, ref_all = logits.log_softmax(0), ref_logits.log_softmax(0)
    true_kl = float((logp_all.exp() * (logp_all - ref_all)).sum())
    tokens = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=g)
    for name in ("k1", "k3"):
        estimate = float(kl_estimate(name, logp_all[tokens], ref_all[tokens]).mean())
        assert estimate == pytest.approx(true_kl, rel=0.05), name


# ---- aggregation ------------------------------------------------------------------------------------------------


def naive_aggregate(mode, loss, mask, norm_len=None):
    rows = [[float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]] for b in range(loss.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * norm_len)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_weights_give_the_aggregate_and_are_split_invariant(mode):
    mask, _ = padded_batch()
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    weights = loss_weights(mode, mask.to(F64), norm_len=16)
    assert weights.dtype == F64 and (weights[~mask.bool()] == 0).all()
    total = float((weights * loss).sum())
    assert total == pytest.approx(naive_aggregate(mode, loss, mask, 16))
    # the controller computes weights on the mini-batch; micro-batches (any split) only sum
    for splits in ([2, 3], [1, 1, 1, 1, 1], [4, 1]):
        parts = zip(weights.split(splits), loss.split(splits))
        assert sum(float((w * x).sum()) for w, x in parts) == pytest.approx(total)


def test_loss_weights_hand_values_and_empty_rows():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # the empty row is not a sequence
    torch.testing.assert_close(loss_weights("token-mean", mask)[0], torch.tensor([1 / 6, 1 / 6, 0, 0]))
    torch.testing.assert_close(loss_weights("seq-mean-token-sum", mask)[1], torch.full((4,), 0.5))
    torch.testing.assert_close(loss_weights("seq-mean-token-mean", mask)[0], torch.tensor([0.25, 0.25, 0, 0]))
    torch.testing.assert_close(loss_weights("seq-mean-token-mean", mask)[1], torch.full((4,), 0.125))
    torch.testing.assert_close(loss_weights("seq-mean-token-sum-norm", mask, norm_len=8)[1], torch.full((4,), 1 / 16))
    for mode in AGGREGATIONS.names():
        weights = loss_weights(mode, torch.zeros(3, 4, dtype=torch.bool), norm_len=8)
        assert (weights == 0).all(), mode
    with pytest.raises(ValueError, match="needs a constant norm_len"):
        loss_weights("seq-mean-token-sum-norm", mask)
    with pytest.raises(UserError, match="did you mean 'token-mean'"):
        loss_weights("token_mean", mask, key="algorithm.policy_loss.aggregation")


# ---- DAPO -------------------------------------------------------------------------------------------------------


def test_keep_groups_drops_groups_with_equal_scores():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 2.0])
    group_ids = torch.tensor([4, 4, 8, 8, 1, 1, 6, 6, 2])  # 4: all 1; 8: mixed; 1: all 0; 6: all .5; 2: one sample
    keep, num_kept = keep_groups(scores, group_ids)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False] and num_kept == 1
    keep, num_kept = keep_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert keep.numel() == 0 and num_kept == 0


def test_overlong_penalty_hand_values():
    # L_max 20, L_cache 4: free up to 16, then -1/4 per token, -1 from 20 on; times penalty 0.5
    lengths = torch.tensor([5, 16, 17, 18, 20, 25])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 0.5)[2:4], torch.tensor([-0.125, -0.25]))
    assert (overlong_penalty(lengths, 20, 0) == 0).all()


def test_overlong_penalty_goes_on_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    rewards = add_to_last_token(torch.zeros(3, 5), mask, torch.tensor([1.0, 1.0, 1.0]))
    shaped, penalty = apply_overlong_penalty(rewards, mask, DapoConfig(overlong_buffer_len=2), max_response_len=5)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -1.0, 0.0]))  # lengths 3, 5, 0 with free length 3
    expected = torch.tensor([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0.0], [0, 0, 0, 0, 0]])
    torch.testing.assert_close(shaped, expected)
    _, penalty = apply_overlong_penalty(rewards, mask, DapoConfig(overlong_buffer_len=2, max_response_len=4), 99)
    torch.testing.assert_close(penalty, torch.tensor([-0.5, -1.0, 0.0]))


def test_dynamic_sampling_keeps_informative_groups_over_draws():
    """trainer/loops/dynamic_sampling.py, used by the synchronous and the asynchronous loop: groups whose scores all
    agree are dropped, the rest renumbered across draws, and the batch is cut at num_groups."""
    from megarl.data.batch import Batch
    from megarl.trainer.loops.dynamic_sampling import KeptGroups

    def draw(scores, group_ids):
        return Batch({"scores": torch.tensor(scores), "group_ids": torch.tensor(group_ids)})

    kept = KeptGroups(num_groups=3)
    assert not kept.add(draw([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1, 2, 2]))  # groups 0 and 2 kept
    assert kept.add(draw([0.0, 0.0, 1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1, 2, 2]))  # 1 and 2 kept: 4 >= 3
    batch, metrics = kept.result()
    assert batch["scores"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert batch["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]  # the fourth kept group is cut
    assert metrics == {"dapo/kept_groups": 3.0, "dapo/draws": 2.0}
    short = KeptGroups(num_groups=2)
    assert not short.add(draw([1.0, 1.0], [0, 0]))
    batch, metrics = short.result()
    assert len(batch) == 0 and metrics == {"dapo/kept_groups": 0.0, "dapo/draws": 1.0}
