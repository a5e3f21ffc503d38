"""The behavioural check of a weight sync (megarl/trainer/rollout_side/sync_probe.py): engines and actor score the
same greedy tokens, and a sync whose weights pass the checksums but are wrong stops the run naming the engine.

The wrong weights are injected in flight by the fault switch (MEGARL_FAULTS, megarl/runtime/faults.py) on the
sending side of a real `megarl train`: layers 0 and 1 trading their MLP weights (a dense model) and one routed expert
in the wrong layout (a MoE model at EP=2). Their norm weights, which the checksums sample, are untouched. The clean
case (the probe passes with a gap of float rounding) is checked on the shared GRPO run of tests/test_trainer.py.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from job_helpers import megarl_train, metrics, write_config

from megarl.runtime import faults
from megarl.trainer.observability.metrics import read_metrics
from megarl.trainer.rollout_side.sync_probe import PROBE_TOLERANCE, default_tolerance


def job(actor: str, backend: str = "hf", hf: str = "float32", sglang: str = "auto"):
    rollout = SimpleNamespace(backend=backend, hf=SimpleNamespace(dtype=hf), sglang=SimpleNamespace(dtype=sglang))
    return SimpleNamespace(actor=SimpleNamespace(model=SimpleNamespace(dtype=actor)), rollout=rollout)


def test_the_tolerance_is_that_of_the_coarser_of_trainer_and_engine():
    assert PROBE_TOLERANCE == {"float32": 1e-4, "float16": 0.05, "bfloat16": 0.1, "fp8": 0.25}
    assert default_tolerance(job("float32"), None) == 1e-4  # the CPU quickstart: fp32 on both sides
    assert default_tolerance(job("bf16", hf="float32"), None) == 0.1  # bf16 training, fp32 engine
    assert default_tolerance(job("fp32", hf="float16"), None) == 0.05
    assert default_tolerance(job("bf16", "sglang"), None) == 0.1  # SGLang's auto dtype follows the checkpoint
    assert default_tolerance(job("fp32", "sglang", sglang="half"), None) == 0.05
    assert default_tolerance(job("bf16", "sglang"), {"quant_method": "fp8"}) == 0.25


def test_the_tampering_faults_spoil_what_checksums_do_not_sample(monkeypatch):
    names = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.up_proj.weight",
    ]
    bucket = [(name, torch.arange(6.0).reshape(3, 2) + 10 * i) for i, name in enumerate(names)]
    monkeypatch.setattr(faults, "_hits", Counter())  # passes are counted per process
    monkeypatch.setenv(faults.ENV, "swap_layers:sync.bucket:2")
    assert faults.tamper("sync.bucket", bucket) is bucket  # the 1st pass: the fault is for the 2nd
    swapped = dict(faults.tamper("sync.bucket", bucket))
    assert torch.equal(swapped[names[1]], bucket[3][1]) and torch.equal(swapped[names[3]], bucket[1][1])
    assert torch.equal(swapped[names[0]], bucket[0][1]) and torch.equal(swapped[names[2]], bucket[2][1])
    monkeypatch.setenv(faults.ENV, "corrupt_expert:sync.bucket")
    monkeypatch.setattr(faults, "_hits", Counter())
    corrupted = dict(faults.tamper("sync.bucket", bucket))
    assert corrupted[names[4]].tolist() == [[44.0, 45.0], [42.0, 43.0], [40.0, 41.0]]  # rows reversed
    assert all(torch.equal(corrupted[name], tensor) for name, tensor in bucket if name != names[4])


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, model, ep",
    [("swap_layers", "tiny-qwen3", 1), ("corrupt_expert", "tiny-qwen3-moe", 2)],
    ids=["dense: two layers' MLPs swapped", "moe: one expert in the wrong layout"],
)
def test_a_sync_with_wrong_weights_stops_the_run_naming_the_engine(tmp_path, fault, model, ep):
    """Weights wrong at every sync (a mapping bug): the probe fails, the version is synced again in full and probed
    again, fails again, and the run stops before training on a sample. The dense case's second sync is clean (a
    bucket spoiled in flight once): the probe passes the second time and the run trains."""
    once = model == "tiny-qwen3"
    config = write_config(tmp_path, "[grpo]", 1, model=model, ep=ep)
    spoiled = f"{fault}:sync.bucket:1" if once else f"{fault}:sync.bucket:1,{fault}:sync.bucket:2"
    out = megarl_train(config, env={"MEGARL_FAULTS": spoiled}, check=False)
    caught = "weight sync to version 1: engine 0 scores its own greedy tokens differently from the actor"
    assert caught in out.stderr and "weight sync: giving every engine version 1 again in full" in out.stderr
    if once:
        assert out.returncode == 0, out.stderr[-3000:]
        assert [m["sync/retries"] for m in read_metrics(tmp_path / "run") if "sync/retries" in m] == [1.0]
        assert [m["step"] for m in metrics(tmp_path / "run")] == [1]
        return
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.count(caught) == 2
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
