"""`megarl convert`: HF -> mcore -> HF is bit-exact, and the Megatron checkpoint loads at any layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    LAYOUTS,
    exported_weights,
    hf_logits,
    layout_id,
    megatron_logits,
    one_result,
    sample_ids,
    save_at_layout,
)

from megarl.bridge.safetensors_io import INDEX_FILE, HFCheckpoint
from megarl.conversion.hf_to_mcore import convert_hf_to_mcore
from megarl.conversion.mcore_to_hf import convert_mcore_to_hf
from megarl.runtime.parallel import ParallelConfig

ARCHITECTURES = ["tiny-llama", "tiny-llama-bias", "tiny-qwen2", "tiny-qwen3"]


def assert_same_checkpoint(original_dir, converted_dir) -> None:
    original, converted = HFCheckpoint(original_dir), HFCheckpoint(converted_dir)
    assert sorted(original.names) == sorted(converted.names)
    for name in original.names:
        a, b = original.get(name), converted.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def round_trip(ranks1, src, tmp_path, parallel, **to_hf):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), parallel, show_progress=False)
    ranks1.run(convert_mcore_to_hf, str(mcore), str(back), show_progress=False, **to_hf)
    return mcore, back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_round_trip_is_bit_exact(ranks1, hf_checkpoint, tmp_path, name, dtype):
    src = hf_checkpoint(name, dtype, max_shard_size="100KB")
    # small read groups: each holds a few layers' slices of Megatron's stacked per-layer tensors
    mcore, back = round_trip(ranks1, src, tmp_path, ParallelConfig(tp=2, pp=2), read_group_bytes=40_000)

    assert_same_checkpoint(src, back)
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for side_file in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / side_file).read_bytes() == (src / side_file).read_bytes()
    info = json.loads((mcore / "megarl.json").read_text())
    assert info["padded_vocab_size"] == 1024 and info["layout"] == {"tp": 2, "pp": 2, "vpp": 1}
    assert not list(tmp_path.glob(".*partial*")), "staging folders left behind"


def test_round_trip_output_loads_in_transformers(ranks1, hf_checkpoint, tmp_path):
    src = hf_checkpoint("tiny-qwen3")
    _, back = round_trip(ranks1, src, tmp_path, ParallelConfig(), max_shard_bytes=200_000)
    index = json.loads((back / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected a sharded checkpoint"
    ids = sample_ids(1000)
    assert torch.equal(hf_logits(back, ids), hf_logits(src, ids))


def test_dtype_change_on_import(ranks1, hf_checkpoint, tmp_path):
    """fp32 weights stored as a bf16 Megatron checkpoint come back in fp32, rounded to bf16 once. (Megatron's local
    RMSNorm keeps its weight in fp32 whatever params_dtype says, so 1-D weights may come back unrounded.)"""
    src = hf_checkpoint("tiny-llama")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), ParallelConfig(), torch.bfloat16, show_progress=False)
    ranks1.run(convert_mcore_to_hf, str(mcore), str(back), show_progress=False)
    original, converted = HFCheckpoint(src), HFCheckpoint(back)
    for name in original.names:
        assert converted.spec(name).dtype == torch.float32
        value, rounded = converted.get(name), original.get(name).to(torch.bfloat16).float()
        assert torch.equal(value, rounded) or (value.dim() == 1 and torch.equal(value, original.get(name))), name
    assert not torch.equal(converted.get("lm_head.weight"), original.get("lm_head.weight"))


def test_derived_rope_buffers_are_skipped_and_reported(ranks1, hf_checkpoint, tmp_path):
    """Older checkpoints carry `rotary_emb.inv_freq` buffers; they are recomputed, not converted."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(hf_checkpoint("tiny-qwen2"), src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    mcore = tmp_path / "mcore"
    (report,) = ranks1.run(convert_hf_to_mcore, str(src), str(mcore), show_progress=False)
    assert report.notes == (
        "skipped 1 tensors recomputed from config.json (e.g. model.layers.0.self_attn.rotary_emb.inv_freq)",
    )
    back = tmp_path / "back"
    ranks1.run(convert_mcore_to_hf, str(mcore), str(back), show_progress=False)
    assert_same_checkpoint(hf_checkpoint("tiny-qwen2"), back)


@pytest.fixture(scope="module")
def converted(ranks1, hf_checkpoint, tmp_path_factory):
    """name -> (HF folder, Megatron checkpoint written for TP=2 x PP=2)."""
    cache = {}

    def get(name):
        if name not in cache:
            src = hf_checkpoint(name)
            dst = tmp_path_factory.mktemp("mcore") / name
            ranks1.run(convert_hf_to_mcore, str(src), str(dst), ParallelConfig(tp=2, pp=2), show_progress=False)
            cache[name] = (src, dst)
        return cache[name]

    return get


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_converted_checkpoint_loads_at_any_layout(ranks4, converted, name, layout):
    src, mcore = converted(name)
    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(mcore), layout, ids))
    assert (logits - hf_logits(src, ids)).abs().max().item() < 1e-4


def test_checkpoint_saved_by_a_sharded_model_loads_at_another_layout(ranks4, ranks1, converted, tmp_path):
    src, mcore = converted("tiny-qwen2")
    saved = tmp_path / "saved-at-tp2-pp2-vpp2"
    ranks4.run(save_at_layout, str(mcore), (2, 2, 2), str(saved))
    assert json.loads((saved / "megarl.json").read_text())["layout"] == {"tp": 2, "pp": 2, "vpp": 2}

    for layout in [(1, 1, 1), (1, 2, 1)]:
        results = ranks4.run(exported_weights, str(saved), layout, 2**20)
        sent = dict(item for tensors, _ in results for item in tensors)
        original = HFCheckpoint(src)
        assert set(sent) == set(original.names)
        assert all(torch.equal(sent[name], original.get(name)) for name in original.names)

    back = tmp_path / "back"  # small read groups: partial reads of the TP-sharded chunks a live model wrote
    ranks1.run(convert_mcore_to_hf, str(saved), str(back), read_group_bytes=40_000, show_progress=False)
    assert_same_checkpoint(src, back)
