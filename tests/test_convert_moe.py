"""`megarl convert` for mixture-of-experts checkpoints: bit-exact round trips (multi-token-prediction layers carried
through), expert-parallel layouts that differ between writing and loading, and MoE-specific bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    exported_bucket_names,
    exported_weights,
    hf_logits,
    layout_id,
    megatron_logits,
    one_result,
    sample_ids,
    save_after_deleting_the_source,
    save_at_layout,
)
from safetensors.torch import load_file, save_file
from test_convert import assert_same_checkpoint, round_trip

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.cli import main
from megarl.conversion.hf_to_mcore import convert_hf_to_mcore
from megarl.runtime.parallel import ParallelConfig as P

BF16 = torch.bfloat16
MOE_ARCHITECTURES = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v3-lite"]


def edit_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def private_copy(hf_checkpoint, tmp_path, name="tiny-deepseek-v3"):
    folder = tmp_path / "src"
    shutil.copytree(hf_checkpoint(name), folder)
    return folder


@pytest.mark.parametrize(
    "name, dtype",
    [pytest.param(n, d, id=f"{n}-{i}") for n in MOE_ARCHITECTURES for d, i in ((torch.float32, "fp32"), (BF16, "bf16"))]
    # GLM-4.5 and Kimi K2 (built from the parts above) in the dtype they ship in
    + [pytest.param(n, BF16, id=f"{n}-bf16") for n in ("tiny-glm4-moe", "tiny-kimi-k2")],
)
def test_moe_round_trip_is_bit_exact(ranks1, hf_checkpoint, tmp_path, name, dtype):
    src = hf_checkpoint(name, dtype, max_shard_size="100KB")
    mcore, back = round_trip(ranks1, src, tmp_path, P(tp=2, ep=2), read_group_bytes=40_000)
    assert_same_checkpoint(src, back)
    assert json.loads((mcore / "megarl.json").read_text())["layout"] == {"tp": 2, "pp": 1, "vpp": 1, "ep": 2, "etp": 2}


def add_mtp_layer(tensors: dict, layer: int = 4) -> None:
    """A DeepSeek-V3-style multi-token-prediction layer after the 4 decoder layers."""
    prefix = f"model.layers.{layer}."
    for name, shape in {
        "enorm.weight": (64,),
        "hnorm.weight": (64,),
        "eh_proj.weight": (64, 128),
        "shared_head.norm.weight": (64,),
        "self_attn.q_a_proj.weight": (24, 64),
        "mlp.experts.0.gate_proj.weight": (32, 64),
        "mlp.gate.e_score_correction_bias": (8,),
    }.items():
        tensors[prefix + name] = torch.randn(shape).to(tensors["model.norm.weight"].dtype)


def test_multi_token_prediction_layers_are_carried_through(ranks1, ranks4, hf_checkpoint, tmp_path):
    src = private_copy(hf_checkpoint, tmp_path)
    edit_weights(src, add_mtp_layer)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    (report,) = ranks1.run(convert_hf_to_mcore, str(src), str(mcore), P(), show_progress=False)
    assert report.notes == (
        "carried 7 tensors the Megatron model does not use through unchanged (multi-token prediction: "
        "model.layers.4.*): converting back restores them",
    )
    assert sorted(HFCheckpoint(mcore / "hf_extra").names) == sorted(
        n for n in HFCheckpoint(src).names if n.startswith("model.layers.4.")
    )
    from megarl.conversion.mcore_to_hf import convert_mcore_to_hf

    ranks1.run(convert_mcore_to_hf, str(mcore), str(back), read_group_bytes=40_000, show_progress=False)
    assert_same_checkpoint(src, back)
    # The Megatron model itself is the 4-layer model.
    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(mcore), P(ep=2), ids))
    assert (logits - hf_logits(hf_checkpoint("tiny-deepseek-v3"), ids)).abs().max().item() < 1e-4


def test_a_model_saves_whole_after_the_checkpoint_it_was_loaded_from_is_deleted(ranks1, hf_checkpoint, tmp_path):
    """What a resumed run does once rotation deletes its resume checkpoint: side files and carried tensors were
    captured at load time, so the next save still holds them, byte for byte."""
    src = private_copy(hf_checkpoint, tmp_path)
    edit_weights(src, add_mtp_layer)
    mcore, doomed, saved = tmp_path / "mcore", tmp_path / "doomed", tmp_path / "saved"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), P(), show_progress=False)
    shutil.copytree(mcore, doomed)
    ranks1.run(save_after_deleting_the_source, str(doomed), str(saved))
    assert not doomed.exists()
    for sub in ("hf", "hf_extra"):
        names = sorted(p.name for p in (mcore / sub).iterdir())
        assert names and names == sorted(p.name for p in (saved / sub).iterdir())
        assert all((mcore / sub / n).read_bytes() == (saved / sub / n).read_bytes() for n in names)
    assert json.loads((saved / "megarl.json").read_text())["source"] == str(src)  # the origin, not the step folder


@pytest.fixture(scope="module")
def converted_at_ep2(ranks1, hf_checkpoint, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            dst = tmp_path_factory.mktemp("mcore-ep2") / name
            ranks1.run(convert_hf_to_mcore, str(hf_checkpoint(name)), str(dst), P(tp=2, ep=2), show_progress=False)
            cache[name] = dst
        return cache[name]

    return get


@pytest.mark.parametrize("layout", [P(), P(ep=4), P(tp=2, pp=2, ep=2, etp=1), P(pp=2, ep=2)], ids=layout_id)
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_checkpoint_written_at_ep2_loads_at_other_expert_layouts(ranks4, hf_checkpoint, converted_at_ep2, name, layout):
    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(converted_at_ep2(name)), layout, ids))
    assert (logits - hf_logits(hf_checkpoint(name), ids)).abs().max().item() < 1e-4


def test_checkpoint_saved_by_an_expert_parallel_model_reshards(ranks4, hf_checkpoint, converted_at_ep2, tmp_path):
    saved = tmp_path / "saved-at-ep4"
    ranks4.run(save_at_layout, str(converted_at_ep2("tiny-mixtral")), P(ep=4), str(saved))
    original = HFCheckpoint(hf_checkpoint("tiny-mixtral"))
    for layout in [P(), P(tp=2, ep=2)]:
        sent = dict(item for tensors, _ in ranks4.run(exported_weights, str(saved), layout, 2**20) for item in tensors)
        assert set(sent) == set(original.names)
        assert all(torch.equal(sent[name], original.get(name)) for name in original.names)


# ---- bad input --------------------------------------------------------------------------------------------------


def cli_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["convert", "--from", "hf", "--to", "mcore", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megarl: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_ep_must_divide_the_experts(capsys, hf_checkpoint, tmp_path):
    err = cli_error(capsys, str(hf_checkpoint("tiny-deepseek-v3")), str(tmp_path / "d"), "--ep", "3")
    assert "--ep=3 does not divide n_routed_experts=8; valid: 1, 2, 4, 8" in err
    assert not (tmp_path / "d").exists()


def test_ep_needs_experts(capsys, hf_checkpoint, tmp_path):
    err = cli_error(capsys, str(hf_checkpoint("tiny-llama")), str(tmp_path / "d"), "--ep", "2")
    assert "--ep=2 needs a mixture-of-experts model; llama is dense" in err


def test_topk_group_larger_than_n_group(capsys, hf_checkpoint, tmp_path):
    src = private_copy(hf_checkpoint, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "topk_group": 8}))
    err = cli_error(capsys, str(src), str(tmp_path / "d"))
    assert "topk_group=8 exceeds n_group=4; valid: 1..4" in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
            "1 missing tensors (e.g. model.layers.2.mlp.experts.5.up_proj.weight)",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.experts.8.down_proj.weight": torch.zeros(64, 32)}),
            "1 unexpected tensors (e.g. model.layers.1.mlp.experts.8.down_proj.weight)",
        ),
    ],
    ids=["missing-expert", "extra-expert"],
)
def test_expert_tensors_must_match_the_config(ranks1, hf_checkpoint, tmp_path, edit, message):
    src = private_copy(hf_checkpoint, tmp_path)
    edit_weights(src, edit)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        ranks1.run(convert_hf_to_mcore, str(src), str(tmp_path / "d"), show_progress=False)
    assert not (tmp_path / "d").exists()


def test_expert_count_differing_from_config(ranks1, hf_checkpoint, tmp_path):
    src = private_copy(hf_checkpoint, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "n_routed_experts": 16, "n_group": 8}))
    with pytest.raises(Exception, match=r"missing tensors \(e\.g\. .*mlp\.experts\.8\..*wrong shape \(e\.g\. .*gate"):
        ranks1.run(convert_hf_to_mcore, str(src), str(tmp_path / "d"), show_progress=False)


@pytest.mark.parametrize("layout", [P(pp=2, ep=2), P(tp=2, ep=2)], ids=layout_id)
def test_deepseek_fused_projections_share_a_bucket_whatever_the_bucket_size(ranks4, hf_checkpoint, layout):
    # SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa only when both
    # arrive in one load_weights call; split across buckets, both stay unloaded without an error.
    folder = hf_checkpoint("tiny-deepseek-v3")
    buckets = [b for rank in ranks4.run(exported_bucket_names, str(folder), layout, 1) for b in rank]
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for layer in range(num_layers):
        attn = f"model.layers.{layer}.self_attn"
        q_a, kv_a = f"{attn}.q_a_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight"
        holding = [b for b in buckets if q_a in b or kv_a in b]
        assert len(holding) == 1 and q_a in holding[0] and kv_a in holding[0], (layer, holding)
    # the rest still goes one tensor per bucket at a 1-byte budget
    assert sorted(len(b) for b in buckets)[-num_layers - 1] == 1
