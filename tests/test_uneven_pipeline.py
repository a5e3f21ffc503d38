"""Uneven pipeline stages end to end (parallel.pp_first_stage_layers / pp_last_stage_layers): a checkpoint converted
for an uneven layout loads there with the HF model's logits, a model saved from uneven stages loads and exports at
another layout bit for bit, and DeepSeek-V3's multi-token-prediction layer survives the trip."""

from __future__ import annotations

import json

import pytest
from helpers import exported_weights, hf_logits, layout_id, megatron_logits, one_result, sample_ids, save_at_layout
from test_convert import assert_same_checkpoint
from test_convert_moe import add_mtp_layer, edit_weights

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.cli import main
from megarl.conversion.hf_to_mcore import convert_hf_to_mcore
from megarl.conversion.mcore_to_hf import convert_mcore_to_hf
from megarl.runtime.parallel import ParallelConfig as P
from megarl.testing.tiny_checkpoint import make_hf_checkpoint, tiny_config

# Eight decoder layers, so that stages can differ: (1, 7), (1, 3, 3, 1), (2 | 6 over two virtual chunks), ...
DENSE_UNEVEN = [
    P(pp=2, pp_first_stage_layers=1),
    P(pp=4, pp_first_stage_layers=1, pp_last_stage_layers=1),
    P(pp=2, vpp=2, pp_first_stage_layers=2),
    P(tp=2, pp=2, pp_last_stage_layers=3),
    P(pp=4, vpp=2, pp_first_stage_layers=2, pp_last_stage_layers=2),
]


def _id(layout: P) -> str:
    return f"{layout_id(layout)}-first{layout.pp_first_stage_layers}-last{layout.pp_last_stage_layers}"


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    config = dict(tiny_config("tiny-llama"), num_hidden_layers=8)
    return make_hf_checkpoint(config, tmp_path_factory.mktemp("llama8") / "hf")


@pytest.fixture(scope="module")
def llama8_uneven(ranks1, llama8, tmp_path_factory):
    """The 8-layer model converted with the convert CLI for pp=4 with one layer on the first and last stage."""
    dst = tmp_path_factory.mktemp("llama8-mcore") / "mcore"
    stages = ["--pp", "4", "--pp-first-stage-layers", "1", "--pp-last-stage-layers", "1"]
    ranks1.run(main, ["convert", "--from", "hf", "--to", "mcore", str(llama8), str(dst), *stages, "--no-progress"])
    return dst


def test_convert_records_the_uneven_layout(llama8_uneven):
    layout = json.loads((llama8_uneven / "megarl.json").read_text())["layout"]
    assert layout == {"tp": 1, "pp": 4, "vpp": 1, "pp_first_stage_layers": 1, "pp_last_stage_layers": 1}


def test_convert_refuses_impossible_stages_naming_the_flags(ranks1, llama8, tmp_path, capsys):
    argv = ["convert", "--from", "hf", "--to", "mcore", str(llama8), str(tmp_path / "x"), "--pp", "4"]
    assert main([*argv, "--pp-first-stage-layers", "3", "--no-progress"]) == 2
    assert "--pp-first-stage-layers=3 and --pp-last-stage-layers=None leave 5 of num_hidden_layers=8 for 3 middle" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layout", DENSE_UNEVEN, ids=_id)
def test_uneven_stages_give_the_hf_logits(ranks4, llama8, llama8_uneven, layout):
    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(llama8_uneven), layout, ids))
    assert (logits - hf_logits(llama8, ids)).abs().max().item() < 1e-4


def test_a_model_saved_from_uneven_stages_loads_anywhere_bit_exact(ranks4, ranks1, llama8, llama8_uneven, tmp_path):
    saved = tmp_path / "saved"
    ranks4.run(save_at_layout, str(llama8_uneven), DENSE_UNEVEN[-1], str(saved))  # pp=4 x vpp=2, stages 2|2|2|2
    original = HFCheckpoint(llama8)
    for layout in [P(), P(pp=2, pp_first_stage_layers=1), P(tp=2, pp=2)]:
        sent = dict(item for tensors, _ in ranks4.run(exported_weights, str(saved), layout, 2**20) for item in tensors)
        assert set(sent) == set(original.names)
        assert all(sent[name].equal(original.get(name)) for name in original.names), layout
    back = tmp_path / "back"
    ranks1.run(convert_mcore_to_hf, str(saved), str(back), read_group_bytes=40_000, show_progress=False)
    assert_same_checkpoint(llama8, back)


MOE_UNEVEN = [P(pp=2, ep=2, pp_first_stage_layers=1), P(pp=4, pp_first_stage_layers=1, pp_last_stage_layers=1)]


@pytest.mark.parametrize(
    "name, layout",
    [pytest.param("tiny-deepseek-v3", layout, id=f"deepseek-v3-{_id(layout)}") for layout in MOE_UNEVEN]
    + [pytest.param("tiny-glm4-moe", MOE_UNEVEN[0], id=f"glm4-moe-{_id(MOE_UNEVEN[0])}")],
)
def test_moe_at_uneven_stages_with_its_mtp_layer(ranks4, ranks1, hf_checkpoint, tmp_path, name, layout):
    """DeepSeek-V3 and GLM-4.5 (dense first layer, MoE after it, a multi-token-prediction layer after the last):
    logits at uneven stages, and a model saved from them converts back to the original checkpoint, MTP tensors
    included."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_checkpoint(name), src)
    edit_weights(src, add_mtp_layer)
    mcore, saved, back = tmp_path / "mcore", tmp_path / "saved", tmp_path / "back"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), layout, show_progress=False)

    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(mcore), layout, ids))
    assert (logits - hf_logits(hf_checkpoint(name), ids)).abs().max().item() < 1e-4

    ranks4.run(save_at_layout, str(mcore), layout, str(saved))
    assert json.loads((saved / "megarl.json").read_text())["layout"] == layout.layout_dict()
    ranks1.run(convert_mcore_to_hf, str(saved), str(back), read_group_bytes=40_000, show_progress=False)
    assert_same_checkpoint(src, back)
