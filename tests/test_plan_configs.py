"""The shipped GPU job configs (configs/*.yaml, the CPU quickstarts aside) load with the real loader and their plans
fit the clusters they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.job import JobConfig
from megarl.plan import run_plan
from megarl.plan_command import load_for_planning

CONFIGS = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml") if "quickstart" not in p.stem
)


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


# ---- `megarl plan` and `megarl train --dry-run` agree --------------------------------------------------------------

ALL_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    from megarl.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_plan_and_dry_run_agree_on_every_shipped_config(path, capsys):
    plan, plan_text = _exit(["plan", "--config", str(path)], capsys)
    dry, dry_text = _exit(["train", "--config", str(path), "--dry-run"], capsys)
    assert plan == dry == 0, plan_text + dry_text
    assert "nothing was started" in dry_text


def test_plan_json_of_the_671b_config(capsys):
    import json

    path = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml")
    code, out = _exit(["plan", "--config", path, "--json"], capsys)
    plan = json.loads(out)  # one JSON object, nothing else on stdout
    assert code == 0 and plan["fits"] is True and plan["problems"] == []
    assert plan["sync"]["transport"] == "ipc_relay" and plan["sync"]["seconds"] <= 5.0
    assert plan["sync"]["bytes"] == 688144067584  # 0.69 TB: FP8 experts, 16-bit rest
    assert plan["placement"]["mode"] == "colocated" and plan["placement"]["num_engines"] == 4
    assert plan["placement"]["engine_nodes"] == 4
    actor = plan["roles"]["actor"]
    assert {k: actor["parallel"][k] for k in ("tp", "pp", "ep", "etp", "dp")} == {
        "tp": 2, "pp": 16, "ep": 8, "etp": 1, "dp": 4
    }  # fmt: skip
    assert actor["memory"]["peak_bytes"] < actor["memory"]["capacity_bytes"] == 80 * 2**30
    assert plan["roles"]["rollout"]["parallel"] == {"tp": 32, "dp": 8, "ep": 32}
    figures = {row["name"]: row for row in plan["bandwidths"]}
    assert figures["infiniband"]["value"] == 50.0 and figures["nvlink"]["value"] == 450.0
    assert figures["host_copy_cpu"]["kind"] == "measured-cpu" and figures["gpu_ipc_measured"]["value"] is None


@pytest.mark.parametrize(
    ("overrides", "expected", "message"),
    [
        (["plan.gpu_memory_gb=40"], 1, "DOES NOT FIT"),  # the plan's memory verdict: train refuses to start
        (["plan.host_memory_gb=1024"], 1, "exceeds 90% of plan.host_memory_gb=1024"),
        (["actor.model.parallel.pp_last_stage_layers=4"], 2, "pp_last_stage_layers=4 leave 55"),  # pre-flight
        (["rollout.weight_sync=object_store"], 2, "rollout.weight_sync=object_store reaches only the GPUs of one node"),
    ],
)
def test_plan_and_dry_run_refuse_the_same_671b_variants(overrides, expected, message, capsys):
    path = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml")
    plan, plan_text = _exit(["plan", "--config", path, *overrides], capsys)
    dry, dry_text = _exit(["train", "--config", path, "--dry-run", *overrides], capsys)
    assert plan == dry == expected
    assert message in plan_text and message in dry_text


def test_the_671b_plan_uses_uneven_stages_fp8_rollout_and_the_ipc_relay():
    planned, _ = load_for_planning(Path(__file__).resolve().parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml")
    report = run_plan(planned)
    text = report.render()
    assert "tp 2 | pp 16 (first 2, last 3 layers) | vpp 1 | ep 8 | etp 1" in text
    assert report.fits and report.role("actor").peak_bytes < 60 * 2**30
    assert report.sync.transport == "ipc_relay" and report.sync.road.startswith("per-node relay")
    assert 3.0 < report.sync.seconds < 3.5  # within the 5 s; the disk road stays selectable below
    assert "transport   ipc_relay: per-node relay" in text
    disk, _ = load_for_planning(
        Path(__file__).resolve().parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml", ["rollout.weight_sync=disk"]
    )
    assert run_plan(disk).sync.transport == "disk" and 100 < run_plan(disk).sync.seconds < 150
    assert report.sync.total_bytes < 0.7e12  # FP8: about half of the 1.25 TB of bf16
    assert 1.1 * 2**40 < report.host_bytes_per_node < 1.2 * 2**40
    assert all("--json-model-override-args" in launch.command for launch in report.launches)
    # the layout of slime's DeepSeek-R1 example plans inside the 1.4-1.6 TB per node teams report
    slime, _ = load_for_planning(
        Path(__file__).resolve().parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml",
        [
            "actor.model.parallel.tp=8",
            "actor.model.parallel.pp=4",
            "actor.model.parallel.pp_first_stage_layers=null",
            "actor.model.parallel.pp_last_stage_layers=13",
            "actor.model.parallel.ep=32",
        ],
    )
    assert 1.4e12 < run_plan(slime).host_bytes_per_node < 1.6e12  # TB as reported: 10^12 bytes
