"""Hub model ids (`org/name[@revision]`) wherever megarl takes a model path, resolved offline from a cache folder
the test builds in the Hub's own layout (`models--org--name/refs/main`, `snapshots/<commit>/`): the setting of a
cluster without network (`HF_HUB_OFFLINE=1`); and online, downloaded by the real huggingface_hub client from a
stand-in of the Hub's HTTP API on this machine (tests/hub_stand_in.py: huggingface.co cannot be reached here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from megarl.checkpoint.hub import is_hub_id, localize_model_paths, resolve_model_path
from megarl.config.loader import load_config
from megarl.errors import UserError
from megarl.job import JobConfig

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


@pytest.mark.slow
def test_a_hub_id_downloads_what_megarl_reads_and_converts(hf_checkpoint, tmp_path):
    """Online, as on a machine with network: `megarl convert ... org/name DST` fetches the model into HF_HOME with
    the real huggingface_hub client (pointed by HF_ENDPOINT at tests/hub_stand_in.py, as huggingface.co cannot be
    reached here), only config, tokenizer and safetensors files (not a .bin copy), then converts it; a second run
    takes it from the cache. A model or revision that does not exist is a clear error."""
    from hub_stand_in import COMMIT as SERVED
    from hub_stand_in import HubStandIn

    model = tmp_path / "served"
    shutil.copytree(hf_checkpoint("tiny-qwen3"), model)
    (model / "pytorch_model.bin").write_bytes(b"a PyTorch copy megarl never reads")
    home = tmp_path / "hf_home"
    command = [sys.executable, "-m", "megarl.cli", "convert", "--from", "hf", "--to", "mcore", "--no-progress"]
    with HubStandIn({"megarl-test/tiny-qwen3": model}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env |= {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
        run = lambda src, dst: subprocess.run([*command, src, str(dst)], env=env, capture_output=True, text=True)  # noqa: E731
        done = run("megarl-test/tiny-qwen3", tmp_path / "mcore")
        assert done.returncode == 0, done.stderr[-3000:]
        snapshot = home / "hub" / "models--megarl-test--tiny-qwen3" / "snapshots" / SERVED
        fetched = sorted(p.name for p in snapshot.iterdir())
        assert fetched == sorted(p.name for p in model.iterdir() if p.suffix != ".bin")
        downloads = [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]
        assert len(downloads) == len(fetched)
        assert done.stdout.startswith(f"wrote {tmp_path / 'mcore'}:")
        again = run(f"megarl-test/tiny-qwen3@{SERVED}", tmp_path / "mcore2")  # from the cache: nothing downloaded
        assert again.returncode == 0, again.stderr[-3000:]
        assert [p for m, p in hub.requests if m == "GET" and "/resolve/" in p] == downloads
        absent = run("megarl-test/absent", tmp_path / "x")
        assert absent.returncode == 2
        assert "there is no model 'megarl-test/absent' on the Hub (or it is private: set HF_TOKEN)" in absent.stderr
        revision = run("megarl-test/tiny-qwen3@v9", tmp_path / "y")
        assert revision.returncode == 2 and "megarl-test/tiny-qwen3 has no revision 'v9'" in revision.stderr
