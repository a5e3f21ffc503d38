"""Every policy loss and advantage estimator that megarl has under verl's names trains a step of a real run: rollout
on the embedded engine, rewards, the actor's and ref's log-prob passes, the estimator, the loss in the Megatron
actor's update, the weight sync. One run trains one step per variant (tests/scripts/train_variants.py), with the
adaptive KL controller on throughout, whose coefficient the test follows step by step.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time

import pytest
from job_helpers import REPO, metrics, write_config

from megarl.algorithms.kl import adaptive_kl_coef

VARIANTS = [
    "advantage.estimator=remax",  # first: the run starts its greedy baseline generator from the first variant
    "policy_loss.name=sapo",
    "policy_loss.name=gpg,advantage.estimator=gpg",
    "policy_loss.name=clip_cov,policy_loss.clip_cov_ratio=0.05,policy_loss.clip_cov_lb=0.0",
    "policy_loss.name=kl_cov,policy_loss.kl_cov_ratio=0.05",
    "policy_loss.name=geo_mean",
    "policy_loss.name=cispo",
    "policy_loss.name=dppo_tv",
    "policy_loss.name=dppo_kl",
    "policy_loss.name=dro",
    "advantage.estimator=grpo_passk",
    "advantage.estimator=opo",
    "advantage.estimator=reinforce_plus_plus_baseline",
    "advantage.estimator=optimal_token_baseline",
]
KL = "algorithm: {kl: {coef: 0.05, target_kl: 0.01, horizon: 100}, kl_ctrl: adaptive}"
SAMPLES_PER_STEP = 8 * 4  # write_config: 8 prompts x 4 samples


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory):
    """(metrics by step, wall seconds) of the one run that trains every variant."""
    folder = tmp_path_factory.mktemp("variants")
    config = write_config(folder, "[grpo]", len(VARIANTS), KL, tp=1)
    start = time.monotonic()
    cmd = [sys.executable, str(REPO / "tests/scripts/train_variants.py"), str(config), *VARIANTS]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, f"the variant run failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    wall = time.monotonic() - start
    records = metrics(folder / "run")
    print(f"{len(VARIANTS)} variants, one step each, in one run: {wall:.0f} s")
    return records, wall


def _step(records: list[dict], index: int) -> dict:
    (record,) = [r for r in records if r.get("test/variant") == index]
    return record


@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=VARIANTS)
def test_each_variant_trains_a_step(variant_run, index):
    records, _ = variant_run
    record = _step(records, index)
    assert record["step"] == index + 1
    for name in ("actor/pg_loss", "actor/grad_norm", "advantages/abs_mean", "kl/coef"):
        assert math.isfinite(record[name]), name
    variant = VARIANTS[index]
    # metrics only the variant's own code writes
    assert ("actor/kl_cov_frac" in record) == ("kl_cov" in variant)
    if "remax" in variant:
        assert "reward/greedy_baseline" in record


def test_the_adaptive_kl_coefficient_follows_the_controller_at_every_step(variant_run):
    records, wall = variant_run
    steps = [_step(records, i) for i in range(len(VARIANTS))]
    assert steps[0]["kl/coef"] == 0.05
    for before, after in itertools.pairwise(steps):
        expected = adaptive_kl_coef(before["kl/coef"], before["kl/sequence_mean"], 0.01, 100, SAMPLES_PER_STEP)
        assert after["kl/coef"] == pytest.approx(expected, rel=1e-12)
    print(f"kl/coef over the run: {[round(s['kl/coef'], 6) for s in steps]}; wall {wall:.0f} s")
