"""One rule for relative paths (megarl/config/paths.py): in a config file, relative to that file's folder, for
every path key and for `extends:` alike; on the command line, relative to the working directory. Loaded here from
an unrelated working directory, through the real JobConfig schema."""

from __future__ import annotations

import pytest

from megarl.config.loader import load_config
from megarl.errors import UserError
from megarl.job import JobConfig


@pytest.fixture
def project(tmp_path, monkeypatch):
    """project/configs/job.yaml extends project/configs/base/common.yaml; the data, the reward and the model
    config live beside them; the test runs from an unrelated folder."""
    root = tmp_path / "project"
    (root / "configs" / "base").mkdir(parents=True)
    (root / "data").mkdir()
    for name in ("train.jsonl", "eval.jsonl", "sft.jsonl"):
        (root / "data" / name).write_text('{"prompt": "1+1=", "label": "2", "response": "2"}\n')
    (root / "configs" / "base" / "tiny.json").write_text("{}")
    (root / "configs" / "rewards").mkdir()
    (root / "configs" / "rewards" / "score.py").write_text("def score(samples):\n    return [0.0 for _ in samples]\n")
    (root / "configs" / "base" / "common.yaml").write_text(
        "model: {path: ../../models/tiny, init: {config: tiny.json}}\n"
        "data: {eval_files: [../../data/eval.jsonl]}\n"
        "plan: {model_config: tiny.json}\n"
    )
    (root / "configs" / "job.yaml").write_text(
        "extends: base/common.yaml\n"
        "run: {name: paths, dir: ../runs/paths, stages: [sft, grpo]}\n"
        "data: {train_files: [../data/train.jsonl]}\n"
        "sft: {data: {train_files: [../data/sft.jsonl]}}\n"
        "reward: {fn: rewards/score.py:score}\n"
        "agent: {env: envs.calculator:Calculator}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root


def test_paths_in_a_file_are_relative_to_its_folder_whatever_the_working_directory(project):
    config = load_config(JobConfig, project / "configs" / "job.yaml")
    assert config.run.dir == str(project / "runs" / "paths")
    assert config.data.train_files == [str(project / "data" / "train.jsonl")]
    assert config.sft.data.train_files == [str(project / "data" / "sft.jsonl")]
    assert config.reward.fn == f"{project / 'configs' / 'rewards' / 'score.py'}:score"
    assert config.agent.env == "envs.calculator:Calculator"  # a module path: not a file
    # the base file's paths are relative to the base file's folder, not to the file that extends it
    assert config.model.path == str(project / "models" / "tiny")
    assert config.model.init.config == str(project / "configs" / "base" / "tiny.json")
    assert config.data.eval_files == [str(project / "data" / "eval.jsonl")]
    assert config.plan.model_config == str(project / "configs" / "base" / "tiny.json")


def test_paths_on_the_command_line_are_relative_to_the_working_directory(project, tmp_path):
    (tmp_path / "elsewhere" / "mine.jsonl").write_text('{"prompt": "2+2=", "label": "4"}\n')
    config = load_config(JobConfig, project / "configs" / "job.yaml", ["data.train_files=[mine.jsonl]", "run.dir=out"])
    assert config.data.train_files == ["mine.jsonl"]  # read from the working directory, as typed
    assert config.run.dir == "out"


def test_a_hub_id_stays_a_hub_id_and_a_folder_beside_the_config_wins(project):
    job = project / "configs" / "job.yaml"
    (project / "configs" / "hub.yaml").write_text("extends: job.yaml\nmodel: {path: Qwen/Qwen2.5-0.5B, init: null}\n")
    assert load_config(JobConfig, project / "configs" / "hub.yaml").model.path == "Qwen/Qwen2.5-0.5B"
    (project / "configs" / "Qwen" / "Qwen2.5-0.5B").mkdir(parents=True)  # a folder of that name next to the file
    assert load_config(JobConfig, project / "configs" / "hub.yaml").model.path == str(
        project / "configs" / "Qwen" / "Qwen2.5-0.5B"
    )
    assert job.is_file()


def test_interpolations_and_absolute_paths_are_left_alone(project, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_DATA", str(project / "data"))
    (project / "configs" / "env.yaml").write_text(
        "extends: job.yaml\n"
        "data: {train_files: ['${oc.env:MEGARL_TEST_DATA}/train.jsonl']}\n"
        f"run: {{dir: {project / 'absolute-run'}}}\n"
    )
    config = load_config(JobConfig, project / "configs" / "env.yaml")
    assert config.data.train_files == [str(project / "data" / "train.jsonl")]
    assert config.run.dir == str(project / "absolute-run")


def test_a_missing_file_is_named_with_the_full_path_looked_at(project):
    (project / "configs" / "typo.yaml").write_text("extends: job.yaml\ndata: {train_files: [../data/trian.jsonl]}\n")
    with pytest.raises(UserError) as error:
        load_config(JobConfig, project / "configs" / "typo.yaml")
    assert f"data.train_files[0]='{project / 'data' / 'trian.jsonl'}' does not exist" in str(error.value)
    assert "typo.yaml:2" in str(error.value)  # and where it was written
