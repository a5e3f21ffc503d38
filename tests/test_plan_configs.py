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
        "grpo_glm4.5_air.yaml",
        "grpo_gpt_oss_120b.yaml",
        "grpo_qwen2.5_7b_gsm8k.yaml",
        "grpo_qwen3_30b_a3b_64k.yaml",
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


def test_gpt_oss_stacked_experts_travel_whole_from_one_rank_per_stage(data_dir):
    """gpt-oss stores a layer's experts as stacked tensors, sent whole by the first expert rank of each stage after it
    gathers the other ranks' rows (megarl/bridge/exporter.py): 2 senders (one per stage), and the busiest sends its
    stage's 18 layers in full. GLM-4.5-Air's experts are separate tensors: each expert rank sends its own."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    oss = run_plan(load_for_planning(configs / "grpo_gpt_oss_120b.yaml")[0], "gpt-oss")
    glm = run_plan(load_for_planning(configs / "grpo_glm4.5_air.yaml")[0], "glm")
    assert oss.fits and glm.fits
    assert (oss.sync.num_senders, glm.sync.num_senders) == (2, 16)
    # By hand, gpt-oss-120b per layer: experts 128 x (2880 x 5760 + 5760 + 5760 x 2880 / 2 + 2880) = 3,186,155,520;
    # attention q/k/v/o with biases 11,800,576 + 2 x 1,475,072 + 11,799,360, sinks 64, two norms 5,760, router with
    # bias 368,768 = 26,924,672. A stage: 18 layers + half of embedding, output layer and final norm (579,134,880).
    stage = 18 * (3_186_155_520 + 26_924_672) + 579_134_880
    assert oss.sync.max_sender_bytes == 2 * stage and oss.sync.total_bytes == 2 * 2 * stage  # bf16, two stages
    assert any("one whole 3.96 GB tensor on the first expert-parallel rank" in note for note in oss.notes)


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


# ---- the 64k-episode config: context parallelism and the KV cache, by hand ------------------------------------------

LONG = Path(__file__).resolve().parents[1] / "configs" / "grpo_qwen3_30b_a3b_64k.yaml"


def test_the_64k_plan_by_hand():
    """Qwen3-30B-A3B (h 2048, 32 heads, 4 KV heads of 128, qk-norm, 48 MoE layers of 128 experts, top 8, expert
    width 768, vocabulary 151936) with 2048 + 63488 = 65536-token episodes, at tp 2 (sequence parallel), cp 4,
    ep 8, full recomputation, log-probs in 4096-token chunks (megarl/plan/activations.py's formula)."""
    planned, _ = load_for_planning(LONG)
    report = run_plan(planned)
    assert report.fits, report.render()
    actor, ref, rollout = (report.role(name).detail for name in ("actor", "ref", "rollout"))
    assert actor.train_tokens == actor.forward_tokens == ref.forward_tokens == 65536  # one episode, whole
    tokens = 65536 // 4  # per CP rank
    attention = 2 * 2048 / 2 + (2 * 32 + 2 * 4) * 128 / 2 + (32 + 4) * 128 / 2  # 8960 elements per token
    moe = 2 * 2048 / 2 + 4 * 128 + 8 * (2 * 2048 + 3 * 768) / 2  # 28160
    layer = (attention + moe) * tokens * 2  # bf16
    kept = 48 * 2048 / 2 * tokens * 2  # recomputation keeps each layer's input
    logits = 4096 * 152064 / 2 * 16  # one chunk of the vocabulary padded to 128 x tp, over tp
    assert actor.activation_bytes == kept + 2 * layer + logits  # 8.4 GB
    assert ref.activation_bytes == layer + logits  # 5.8 GB: forward only
    # the same episode at cp 1: every per-token term 4 times larger, the chunked head unchanged
    cp1, _ = load_for_planning(LONG, ["actor.model.parallel.cp=1", "ref.model.parallel.cp=1"])
    whole = run_plan(cp1).role("actor").detail
    assert whole.activation_bytes == 4 * (kept + 2 * layer) + logits
    # unchunked, the head's logits of all 16k tokens of a rank
    unchunked, _ = load_for_planning(LONG, ["actor.micro_batch.logprob_chunk_tokens=0"])
    assert run_plan(unchunked).role("actor").detail.activation_bytes == kept + 2 * layer + tokens * 152064 / 2 * 16
    # rollout: tp 4 engines, one of the 4 KV heads per GPU: 2 x 48 layers x 128 x 2 bytes = 24 KB per token
    assert rollout.kv_bytes_per_token == 2 * 48 * 1 * 128 * 2
    assert rollout.kv_bytes == 0.7 * 80 * 2**30 - rollout.weight_bytes
    assert rollout.token_capacity == int(rollout.kv_bytes // 24576)
    assert rollout.token_capacity // 65536 == 27  # 64k episodes held at once per engine
    assert not [note for note in report.notes if "context window" in note]  # YaRN: a 131072-token window


def test_a_64k_episode_past_the_context_window_is_noted(tmp_path):
    """The published config.json (40960 positions, no YaRN): SGLang would end the episodes at 40960 tokens."""
    import json

    published = json.loads((LONG.parent / "models" / "qwen3-30b-a3b-yarn131k.json").read_text())
    published.update(max_position_embeddings=40960, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(published))
    planned, _ = load_for_planning(LONG, [f"plan.model_config={tmp_path / 'config.json'}"])
    notes = [note for note in run_plan(planned).notes if "context window" in note]
    assert notes == [
        "the longest sample (65536 tokens: data.max_prompt_tokens + agent.max_total_tokens) is longer than the "
        "engines' context window (40960 tokens): SGLang ends such samples at 40960; extend the model with YaRN "
        "(rope_scaling and max_position_embeddings in config.json: docs/long_context.md)"
    ]
    planned, _ = load_for_planning(
        LONG, [f"plan.model_config={tmp_path / 'config.json'}", "rollout.sglang.context_length=65536"]
    )
    assert [note for note in run_plan(planned).notes if "context" in note] == [
        "rollout.sglang.context_length=65536 is above the model's context window (40960 tokens from config.json): "
        "SGLang refuses to start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1; extend the model with YaRN "
        "instead (docs/long_context.md)"
    ]


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn-131k", "published"])
def test_the_planned_context_window_is_sglangs(tmp_path, yarn):
    """The window the plan reads from the 64k config's model (megarl/rollout/sglang_model.py) is SGLang's own:
    131072 with YaRN and max_position_embeddings raised, 40960 for the published config.json."""
    import json

    import sglang_contract
    from transformers import AutoConfig

    from megarl.rollout.sglang_model import context_window

    common = sglang_contract.sglang_module("sglang.srt.utils.hf_transformers.common")
    raw = json.loads((LONG.parent / "models" / "qwen3-30b-a3b-yarn131k.json").read_text())
    if not yarn:
        raw.update(max_position_embeddings=40960, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    expected = common.get_context_length(AutoConfig.from_pretrained(tmp_path))
    assert context_window(raw) == expected == (131072 if yarn else 40960)
