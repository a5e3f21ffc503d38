"""Delta weight sync (megarl/workers/weight_delta.py): lossless encoding, in-place application with the checksum
verified, a corrupted delta refused, the forced full sync after a reset; into the hf engine's weight loader."""

from __future__ import annotations

import pytest
import torch

from megarl.workers.weight_delta import DeltaEncoder, DeltaMismatch, apply_delta


def _bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(64, 32, generator=g).to(torch.bfloat16)),
        ("b.bias", torch.randn(32, generator=g)),
    ]


def _step(bucket, changes: int, seed: int = 1):
    """A copy of the bucket with `changes` elements of each tensor moved."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in bucket:
        new = tensor.clone()
        flat = new.view(-1)
        where = torch.randperm(flat.numel(), generator=g)[:changes]
        flat[where] = flat[where] + 1
        out.append((name, new))
    return out


def test_first_encode_is_full_then_only_changed_elements_travel():
    encoder, engine = DeltaEncoder(), {}
    first = _bucket()
    delta = encoder.encode(first)
    assert all(entry.full is not None for entry in delta.entries) and delta.nbytes == delta.full_bytes
    engine = {name: torch.zeros_like(t) for name, t in first}
    apply_delta(delta, engine.__getitem__)
    second = _step(first, changes=5)
    delta = encoder.encode(second)
    moved = [torch.nonzero(new.view(-1) != old.view(-1)).view(-1).tolist() for (_, new), (_, old) in zip(second, first)]
    assert [entry.indices.tolist() for entry in delta.entries] == moved
    assert delta.changed_elements == 10
    assert delta.nbytes == 5 * (4 + 2) + 5 * (4 + 4)  # int32 indices + bf16 / fp32 values
    apply_delta(delta, engine.__getitem__)
    for name, tensor in second:
        assert torch.equal(engine[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))


def test_a_tensor_mostly_changed_travels_whole():
    encoder = DeltaEncoder()
    first = _bucket()
    encoder.encode(first)
    delta = encoder.encode(_step(first, changes=24))  # b.bias: 24 of 32 fp32 elements = 192 bytes of delta > 128
    assert [entry.full is not None for entry in delta.entries] == [False, True]
    assert delta.nbytes == 24 * (4 + 2) + 32 * 4


def test_a_sign_of_zero_counts_as_a_change():
    encoder = DeltaEncoder()
    encoder.encode([("z", torch.zeros(16))])  # large enough that a delta (+ its hash record) is smaller
    delta = encoder.encode([("z", torch.tensor([0.0, -0.0] + [0.0] * 14))])
    assert delta.entries[0].indices.tolist() == [1]  # integer view: -0.0 != 0.0 bitwise


def test_a_corrupted_delta_fails_its_checksum_and_the_next_sync_is_full():
    encoder = DeltaEncoder()
    first = _bucket()
    engine = {name: t.clone() for name, t in first}
    encoder.encode(first)
    delta = encoder.encode(_step(first, changes=3))
    delta.entries[0].values[0] += 1  # lost in transit
    with pytest.raises(DeltaMismatch, match=r"checksum 0x[0-9a-f]{8} of the engine's tensors after the delta differs"):
        apply_delta(delta, engine.__getitem__)
    encoder.reset()  # what the sender does after a failed delta
    again = encoder.encode(_step(first, changes=3))
    assert all(entry.full is not None for entry in again.entries)
    apply_delta(again, engine.__getitem__)


def test_a_bf16_delta_into_an_fp32_engine_and_a_strided_region():
    encoder = DeltaEncoder()
    first = [("w", torch.randn(6, 4).to(torch.bfloat16))]
    fused = torch.zeros(6, 8)  # the engine keeps w as columns 4:8 of a fused fp32 tensor
    region = fused[:, 4:]
    apply_delta(encoder.encode(first), lambda name: region)
    second = _step(first, changes=4)
    apply_delta(encoder.encode(second), lambda name: region)
    assert torch.equal(region.to(torch.bfloat16), second[0][1]) and fused[:, :4].eq(0).all()


def test_hf_weight_loader_applies_deltas_in_place():
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.rollout.hf_weights import WeightLoader

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = LlamaForCausalLM(config)
    engine = LlamaForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    loader, encoder = WeightLoader(engine), DeltaEncoder()
    for step in range(3):
        with torch.no_grad():
            for param in trainer.parameters():
                # a step changes a few elements (a dense change is sent whole, tested above)
                param.add_(torch.randn_like(param) * 1e-2 * step * (torch.rand_like(param) < 0.05))
        bucket = [(name, t.detach().to(torch.bfloat16)) for name, t in trainer.state_dict().items()]
        delta = encoder.encode(bucket)
        assert (step == 0) == all(entry.full is not None for entry in delta.entries)
        loader.apply_delta(delta)
        state = engine.state_dict()
        assert all(torch.equal(state[name].view(torch.int16), t.view(torch.int16)) for name, t in bucket)


def test_the_switch_is_checked_when_the_config_is_built():
    from megarl.errors import UserError
    from megarl.rollout.config import RolloutConfig

    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta='sometimes': valid are auto, on, off$"):
        RolloutConfig(weight_sync_delta="sometimes").check("rollout")
    # SGLang takes deltas on the colocated road only (tests/test_sglang_delta.py has every combination)
    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta=on with rollout.weight_sync=nccl: "):
        RolloutConfig(weight_sync_delta="on", backend="sglang", weight_sync="nccl").check("rollout")
    assert RolloutConfig().sync_delta("object_store") and not RolloutConfig().sync_delta("in_process")
