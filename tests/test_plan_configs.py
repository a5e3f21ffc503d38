"""The shipped GPU job configs (configs/*.yaml, the CPU quickstart aside) load with the real loader and their plans
fit the clusters they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.job import JobConfig
from megarl.config.loader import load_config
from megarl.plan import run_plan
from megarl.plan.planner import load_for_planning

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml") if p.stem != "quickstart")


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """The configs read their data under $MEGARL_DATA (the cluster's mount); empty stand-ins are enough to load."""
    monkeypatch.setenv("MEGARL_DATA", str(tmp_path))
    return tmp_path


def test_the_gpu_configs_are_shipped():
    assert {p.name for p in CONFIGS} >= {
        "grpo_deepseek_v3_671b.yaml",
        "grpo_qwen2.5_7b_gsm8k.yaml",
        "ppo_llama3_8b.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_fits(path, data_dir):
    planned, _ = load_for_planning(path)
    for name in planned.data.train_files + planned.data.eval_files:
        assert Path(name).is_relative_to(data_dir), f"{name}: data must live under ${{MEGARL_DATA}}"
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).touch()
    config = load_config(JobConfig, path)  # strict: every check, the data files included
    assert config.cluster.address == "auto" and config.rollout.backend == "sglang"
    assert config.plan.model_config and Path(config.plan.model_config).name.endswith(".json")
    report = run_plan(config, str(path))
    assert report.fits, report.render()
    gpus = config.cluster.num_nodes * config.cluster.gpus_per_node
    assert config.placement.train_gpus + config.placement.rollout_gpus == gpus  # the whole cluster is used
