"""The examples work as their docstrings say: the custom reward scores through the reward runner, the custom dataset
loads through the job config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "examples"))


def test_custom_reward_through_the_runner():
    from megarl.rewards import RewardConfig, RewardRunner, RewardSample

    config = RewardConfig(
        fn=str(REPO / "examples/custom_reward.py") + ":score", kwargs={"work_bonus": 0.5}, num_workers=0
    )
    config.check("reward")
    samples = [
        RewardSample("12*7=", "12*7=84 <answer>84</answer>", "84"),
        RewardSample("12*7=", "<answer>85</answer>", "84"),
        RewardSample("12*7=", "84", "84"),
    ]
    with RewardRunner(config) as runner:
        result = runner.score(samples)
    assert result.scores == [1.5, 0.0, 0.0]
    assert result.metrics["acc"] == 1 / 3 and result.metrics["format_ok"] == 2 / 3


def test_custom_dataset_loads_through_the_job_config(tmp_path):
    from custom_dataset import overrides, write_dataset

    from megarl.config import load_config
    from megarl.data.char_tokenizer import build_char_tokenizer
    from megarl.data.prompts import PromptDataset
    from megarl.job import JobConfig

    path = write_dataset(tmp_path)
    config = load_config(JobConfig, REPO / "configs/quickstart.yaml", overrides(path))
    dataset = PromptDataset(config.data, build_char_tokenizer(), "train")
    sample = dataset.samples[0]
    assert sample.text == "Q: What is 2 * 3? A:" and sample.label == "6" and sample.meta == {"problem.source": "drill"}


def readme_quickstart_row() -> list[float]:
    """The held-out accuracies of the README's quickstart table, first row (today's code): after SFT, GRPO 10..60."""
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| held-out accuracy (seed 1"))
    return [float(cell.strip().strip("*")) for cell in row.strip("|").split("|")[1:]]


@pytest.mark.slow
def test_the_quickstart_gives_the_readmes_numbers(tmp_path):
    """The README's first command, whole (`megarl train --config configs/quickstart.yaml`, from the repository
    root): the held-out accuracy after SFT and every 10 GRPO steps is the README table's first row to the last
    digit (the run is deterministic under constraints.txt's versions on this CPU), and nothing but megarl's own
    lines (and the model build's progress bar) reaches the user's terminal: no third-party warning."""
    from job_helpers import megarl_train

    from megarl.trainer.observability.metrics import read_metrics

    run = tmp_path / "run"
    out = megarl_train(REPO / "configs/quickstart.yaml", f"run.dir={run}", f"model.path={tmp_path / 'model'}")
    evals = [round(r["eval/accuracy"], 3) for r in read_metrics(run) if "eval/accuracy" in r]
    assert evals == readme_quickstart_row()
    lines = [line for line in (out.stdout + "\n" + out.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(("step ", "megarl: ", "Writing model shards"))]
    assert foreign == []
    # the end-of-run summary (on stdout, the model build's progress bar on stderr): the held-out accuracy first ->
    # last, where everything is, the command that resumes
    printed = [line for line in out.stdout.splitlines() if line.strip()]
    summary = printed[next(i for i, line in enumerate(printed) if line.startswith("megarl: done in ")) :]
    assert summary[0].endswith("; stages sft (300 steps), grpo (60 steps)")
    assert summary[1].startswith(f"megarl: eval/accuracy {evals[0]:.3f} -> {evals[-1]:.3f} (step ")
    assert f"megarl: metrics      {run / 'metrics.jsonl'}" in summary
    assert f"megarl: tensorboard  tensorboard --logdir {run / 'tensorboard'}" in summary
    command = f"megarl train --config {REPO / 'configs/quickstart.yaml'} run.dir={run} model.path={tmp_path / 'model'}"
    assert summary[-1] == f"megarl: resume with  {command}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart_moe", "agent_quickstart"])
def test_the_shipped_quickstart_config_runs_both_stages(tmp_path, name):
    """configs/quickstart_moe.yaml and agent_quickstart.yaml as the README runs them (from the repository root),
    shortened: every stage, the model build, evaluation and a checkpoint. Their full numbers are in the README,
    measured by hand (too long for CI)."""
    from job_helpers import megarl_train

    from megarl.trainer.observability.metrics import read_metrics

    run = tmp_path / "run"
    overrides = [
        f"run.dir={run}",
        f"model.path={tmp_path / 'model'}",
        "sft.num_steps=4",
        "rl.num_steps=2",
        "checkpoint.every=2",
    ]
    megarl_train(REPO / f"configs/{name}.yaml", *overrides, "rl.eval_every=2", "data.eval_max_samples=32")
    records = read_metrics(run)
    assert [r["step"] for r in records if "sft/loss" in r] == [1, 2, 3, 4]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert evals == [0.0, 0.0]  # after 4 SFT steps and 2 GRPO steps the format is not learned yet (deterministic)
    assert (run / "checkpoints" / "latest").is_file() and (run / "plots" / "reward.png").is_file()
    if name == "quickstart_moe":  # R3: every update replays the engine's experts, which fp32 routes as the actor does
        steps = [r for r in records if "rollout/routing_replayed" in r]
        assert [(r["rollout/routing_replayed"], r["rollout/routing_agreement"]) for r in steps] == [(1.0, 1.0)] * 2
        # after an exact weight sync, the same experts for every token in every layer, no sample without routing
        assert [(r["rollout/routing_agreement_min_layer"], r["rollout/routing_fallback_samples"]) for r in steps] == [
            (1.0, 0.0)
        ] * 2
        assert all(r["mismatch/abs_logprob_diff_max"] < 1e-4 for r in steps)
        assert (run / "plots" / "routing.png").is_file()
    if name == "agent_quickstart":  # multi-turn episodes with the calculator, in training and evaluation
        assert all("agent/tool_use_rate" in r for r in records if "reward/mean" in r)
        assert all("eval/tool_use_rate" in r for r in records if "eval/accuracy" in r)
        assert (run / "plots" / "agent.png").is_file()
