"""Pre-flight checks of the starting weights (megarl/checkpoint/verify.py) raise no false alarm: every architecture's
intact checkpoint passes, with the number of tensors compared against config.json (the first four layers, the
embeddings, norms and head, under the names the transformers model shares with the checkpoint)."""

from __future__ import annotations

import pytest

from megarl.checkpoint.verify import check_hf_weights
from megarl.models.hf_config import load_hf_config

COMPARED = {
    "tiny-qwen3": 47,
    "tiny-qwen2": 50,
    "tiny-llama": 39,
    "tiny-llama-bias": 66,
    "tiny-qwen3-moe": 41,
    "tiny-mixtral": 27,
    "tiny-deepseek-v3": 57,
    "tiny-deepseek-v3-lite": 49,
}


@pytest.mark.parametrize("name", sorted(COMPARED))
def test_an_intact_checkpoint_passes(name, hf_checkpoint):
    folder = hf_checkpoint(name)
    assert check_hf_weights(folder, load_hf_config(folder)) == COMPARED[name]


def test_a_pass_is_remembered_and_a_changed_checkpoint_checked_again(hf_checkpoint, tmp_path, monkeypatch):
    """The meta-device build runs once per exact set of inputs (its import costs seconds of every start-up): the
    same folder again is answered from MEGARL_CACHE_DIR; a changed config.json is compared again and refused."""
    import json
    import shutil

    import transformers

    from megarl.errors import UserError

    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    folder = shutil.copytree(hf_checkpoint("tiny-qwen3"), tmp_path / "model")
    assert check_hf_weights(folder, load_hf_config(folder)) == COMPARED["tiny-qwen3"]
    assert len(list((tmp_path / "cache" / "verified-weights").iterdir())) == 1
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", None)  # a second build would fail
    assert check_hf_weights(folder, load_hf_config(folder)) == COMPARED["tiny-qwen3"]
    monkeypatch.undo()
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(UserError, match="mlp.*has shape .* but .*config.json gives"):
        check_hf_weights(folder, load_hf_config(folder))
