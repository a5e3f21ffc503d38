"""Hub model ids (`org/name[@revision]`) wherever megarl takes a model path, resolved offline from a cache folder
the test builds in the Hub's own layout (`models--org--name/refs/main`, `snapshots/<commit>/`): the setting of a
cluster without network (`HF_HUB_OFFLINE=1`). The online download is huggingface_hub's own `snapshot_download`;
this machine cannot reach huggingface.co, so only the offline road runs here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from megarl.checkpoint.hub import is_hub_id, localize_model_paths, resolve_model_path
from megarl.config.job import JobConfig
from megarl.config.loader import load_config
from megarl.errors import UserError

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, hf_checkpoint, monkeypatch):
    """A Hugging Face cache holding `megarl-test/tiny-qwen3` at COMMIT (as `refs/main`), used offline."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--megarl-test--tiny-qwen3" / "snapshots" / COMMIT
    shutil.copytree(hf_checkpoint("tiny-qwen3"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, snapshot


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("deepseek-ai/DeepSeek-V3@main")
    assert not is_hub_id("/models/qwen") and not is_hub_id("./qwen/7b") and not is_hub_id("qwen")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")  # an existing local folder wins


def test_an_id_resolves_from_the_cache_offline(hub_cache):
    _, snapshot = hub_cache
    assert resolve_model_path("megarl-test/tiny-qwen3", "model.path") == str(snapshot)
    assert resolve_model_path(f"megarl-test/tiny-qwen3@{COMMIT}", "model.path") == str(snapshot)
    assert resolve_model_path(str(snapshot), "model.path") == str(snapshot)  # a folder stays a folder


def test_an_id_missing_from_the_cache_offline_names_the_id_and_the_cache(hub_cache, tmp_path, monkeypatch):
    cache, _ = hub_cache
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as error:
        resolve_model_path("Qwen/Qwen2.5-7B", "model.path")
    assert str(error.value).startswith(
        f"model.path='Qwen/Qwen2.5-7B' is not a local folder ({tmp_path / 'Qwen/Qwen2.5-7B'} does not exist), so it "
        f"was read as a Hub id: Qwen/Qwen2.5-7B is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 is "
        "set. Download it where there is network (`huggingface-cli download Qwen/Qwen2.5-7B`) with the same "
        "HF_HOME, or give a local folder"
    )
    with pytest.raises(UserError, match="megarl-test/tiny-qwen3@v9 is not in the Hugging Face cache"):
        resolve_model_path("megarl-test/tiny-qwen3@v9", "model.path")


def test_every_model_path_of_a_job_config_resolves(hub_cache, monkeypatch):
    _, snapshot = hub_cache
    monkeypatch.chdir(REPO)  # the quickstart's data paths are relative to the repository
    config = load_config(
        JobConfig,
        REPO / "configs" / "quickstart.yaml",
        ["model.path=megarl-test/tiny-qwen3", "model.init=null", "ref.model.path=megarl-test/tiny-qwen3@main"],
    )
    localize_model_paths(config)
    paths = [config.model.path] + [getattr(config, role).model.path for role in ("actor", "critic", "ref")]
    assert paths == [str(snapshot)] * 4


def test_a_path_model_init_builds_is_never_looked_up(hub_cache, monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart's data paths are relative to the repository
    config = load_config(JobConfig, REPO / "configs" / "quickstart.yaml", ["model.path=not-built/yet"])
    assert config.model.init is not None and is_hub_id("not-built/yet")  # reads like an id
    localize_model_paths(config)
    assert config.model.path == config.actor.model.path == "not-built/yet"


@pytest.mark.slow
def test_megarl_convert_takes_a_hub_id(hub_cache, tmp_path):
    """`megarl convert --from hf --to mcore org/name DST` as a user runs it, offline, with HF_HUB_CACHE set."""
    cache, _ = hub_cache
    env = os.environ | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "megarl.cli", "convert", "--from", "hf", "--to", "mcore", "--no-progress"]
    done = subprocess.run(
        [*command, "megarl-test/tiny-qwen3", str(tmp_path / "mcore")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"wrote {tmp_path / 'mcore'}:")
    missing = subprocess.run(
        [*command, "megarl-test/absent", str(tmp_path / "x")], env=env, capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("megarl: error: SRC='megarl-test/absent' is not a local folder")
