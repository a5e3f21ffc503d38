"""The lazy safetensors reader and the streaming sharded writer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge.safetensors_io import (
    INDEX_FILE,
    HFCheckpoint,
    ShardedSafetensorsWriter,
    TensorSpec,
    plan_shards,
)
from megarl.errors import UserError


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, generator=g),
        "b.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(5, generator=g).to(torch.float16),
        "d.ids": torch.arange(7, dtype=torch.int64),
        "e.mask": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(3.5),
        "g.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
    }


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # exact comparison for every dtype, fp8 and NaNs included


def write(folder, tensors, max_shard_bytes):
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    writer = ShardedSafetensorsWriter(folder, specs, max_shard_bytes)
    writer.write_all(tensors.items())
    writer.close()
    return writer


def test_written_shards_are_standard_safetensors(tmp_path):
    tensors = sample_tensors()
    writer = write(tmp_path, tensors, max_shard_bytes=600)
    assert len(writer.file_names) > 1
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    loaded = {}
    for file_name in writer.file_names:
        loaded.update(load_file(tmp_path / file_name))
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(as_bytes(loaded[name]), as_bytes(tensor))


def test_single_shard_has_no_index_and_reads_back(tmp_path):
    tensors = sample_tensors()
    write(tmp_path, tensors, max_shard_bytes=10**9)
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / INDEX_FILE).exists()
    checkpoint = HFCheckpoint(tmp_path)
    assert sorted(checkpoint.names) == sorted(tensors)
    for name, tensor in tensors.items():
        assert checkpoint.spec(name) == TensorSpec(name, tensor.dtype, tuple(tensor.shape))
        assert torch.equal(as_bytes(checkpoint.get(name)), as_bytes(tensor))


def test_plan_shards_keeps_order_and_bounds_size():
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    shards = plan_shards(specs, max_shard_bytes=80)
    assert [[s.name for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_writer_refuses_surprises(tmp_path):
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (2,))]
    writer = ShardedSafetensorsWriter(tmp_path, specs, 10**6)
    with pytest.raises(RuntimeError, match="expected a"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="expected a"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="1 planned tensors were never written"):
        writer.close()


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder, sample_tensors(), max_shard_bytes=600)
    return folder


def test_truncated_file_is_named(saved):
    victim = sorted(saved.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
    with pytest.raises(UserError, match=f"{victim.name} is not a valid safetensors file.*truncated or corrupted"):
        HFCheckpoint(saved)


def test_corrupted_header_is_named(saved):
    victim = sorted(saved.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"not json at!"
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match=f"{victim.name} is not a valid safetensors file"):
        HFCheckpoint(saved)


def test_missing_shard_is_named(saved):
    victim = sorted(saved.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(UserError, match=f"{victim.name} does not exist"):
        HFCheckpoint(saved)


def test_index_listing_a_tensor_that_is_not_there(saved):
    index = json.loads((saved / INDEX_FILE).read_text())
    index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
    (saved / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UserError, match="lists tensors missing from their files: \\['ghost.weight'\\]"):
        HFCheckpoint(saved)


def test_folder_without_weights(tmp_path):
    shutil.copy(__file__, tmp_path / "config.json")
    with pytest.raises(UserError, match="holds no safetensors weights: expected model.safetensors or"):
        HFCheckpoint(tmp_path)
