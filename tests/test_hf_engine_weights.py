"""hf engine weight loading: checkpoint-named tensors written into a live transformers model.

The reference is transformers itself: a model loaded from one random checkpoint and then updated with every tensor
of another must equal `from_pretrained` of that other checkpoint bit for bit, whatever the bucketing and order.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.bridge.buckets import part_name
from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.errors import UserError
from megarl.rollout.hf_weights import WeightLoader

ARCHITECTURES = [
    "tiny-llama",
    "tiny-llama-bias",  # tied embeddings, biases
    "tiny-qwen2",  # tied embeddings, qkv bias
    "tiny-qwen3",
    "tiny-mixtral",  # block_sparse_moe.experts.E.w1/w2/w3 -> mlp.experts.gate_up_proj / down_proj
    "tiny-qwen3-moe",  # mlp.experts.E.gate/up/down_proj -> fused, with a dense layer
    "tiny-deepseek-v3",  # MLA, shared experts, first dense layer, expert-selection bias
    "tiny-deepseek-v3-lite",
    "tiny-glm4-moe",  # DeepSeek-V3's MoE behind q/k/v biases and qk-norm
    "tiny-gpt-oss",  # experts stacked in the checkpoint (mlp.experts.gate_up_proj [experts, ...]), sinks, biases
    "tiny-qwen3-next",  # Gated DeltaNet layers (linear_attn.*), gated q_proj, shared expert with its gate
    "tiny-qwen3.5-moe",  # the GDN's in_proj_qkv/z/b/a; experts.E.* -> fused (transformers' own conversion)
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load(folder, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()


def assert_same_state(model, reference) -> None:
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def shuffled_buckets(checkpoint: HFCheckpoint, bucket_size: int, seed: int = 0):
    names = list(checkpoint.names)
    random.Random(seed).shuffle(names)
    for start in range(0, len(names), bucket_size):
        yield [(name, checkpoint.get(name)) for name in names[start : start + bucket_size]]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_update_equals_from_pretrained(name, hf_checkpoint, other_checkpoint):
    target = hf_checkpoint(name)
    model, reference = load(other_checkpoint(name)), load(target)
    checkpoint = HFCheckpoint(target)
    loader = WeightLoader(model)
    assert sorted(loader.names) == sorted(checkpoint.names)  # the plan's names are what save_pretrained wrote
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))

    for bucket in shuffled_buckets(checkpoint, bucket_size=7):  # experts of one fused tensor land in many buckets
        loader.load(bucket)
    assert loader.missing() == []
    assert loader.counts.num_tensors == len(checkpoint.names)
    assert_same_state(model, reference)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_cast_to_model_dtype_matches_from_pretrained(hf_checkpoint, other_checkpoint):
    """fp32 tensors into a bf16 model round exactly as from_pretrained(dtype=bf16) does."""
    target = hf_checkpoint("tiny-qwen3-moe")
    model = load(other_checkpoint("tiny-qwen3-moe"), torch.bfloat16)
    loader = WeightLoader(model)
    for bucket in shuffled_buckets(HFCheckpoint(target), bucket_size=50, seed=1):
        loader.load(bucket)
    assert_same_state(model, load(target, torch.bfloat16))


def test_partial_update_writes_only_its_expert(hf_checkpoint, other_checkpoint):
    target = hf_checkpoint("tiny-mixtral")
    model = load(other_checkpoint("tiny-mixtral"))
    before = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    w3 = HFCheckpoint(target).get("model.layers.1.block_sparse_moe.experts.3.w3.weight")  # up projection [I, H]
    loader = WeightLoader(model)
    loader.load([("model.layers.1.block_sparse_moe.experts.3.w3.weight", w3)])
    after = model.model.layers[1].mlp.experts.gate_up_proj
    intermediate = w3.shape[0]
    assert torch.equal(after[3, intermediate:], w3)
    changed = (after != before).any(dim=-1)  # [E, 2I]
    assert changed[3, intermediate:].all() and changed.sum() == intermediate
    assert len(loader.missing()) == len(loader.names) - 1


def test_parts_of_tensors_equal_from_pretrained(hf_checkpoint, other_checkpoint):
    """Tensors sent in parts (`NAME@DIM:START:STOP`, as each TP rank of the trainer sends its own: uneven, along
    either dim, into fused expert tensors too), in any order, give from_pretrained's model bit for bit; a tensor
    counts as loaded once its parts cover it; parts that overlap or lie outside it fail naming it."""
    target = hf_checkpoint("tiny-qwen3-moe")
    model, reference = load(other_checkpoint("tiny-qwen3-moe")), load(target)
    checkpoint = HFCheckpoint(target)
    rng = random.Random(0)
    entries = []
    for name in checkpoint.names:
        tensor = checkpoint.get(name)
        dim = rng.randrange(tensor.dim())
        cut = rng.randrange(1, tensor.shape[dim])  # two uneven parts
        for start, stop in ((0, cut), (cut, tensor.shape[dim])):
            entries.append((part_name(name, (dim, start, stop)), tensor.narrow(dim, start, stop - start)))
    rng.shuffle(entries)
    loader = WeightLoader(model)
    half = len(entries) // 2
    loader.load(entries[:half])
    assert 0 < len(loader.missing()) < len(loader.names)  # tensors with one part of two in are not loaded yet
    loader.load(entries[half:])
    assert loader.missing() == [] and loader.counts.num_tensors == len(entries)
    assert_same_state(model, reference)
    norm = checkpoint.get("model.norm.weight")
    with pytest.raises(UserError, match=r"parts sent of 'model\.norm\.weight' overlap"):
        loader.load([(part_name("model.norm.weight", (0, 0, 40)), norm[:40])])
    with pytest.raises(UserError, match=r"'model\.norm\.weight@0:60:65' lies outside 'model\.norm\.weight'"):
        loader.load([(part_name("model.norm.weight", (0, 60, 65)), torch.zeros(5))])
    loader.reset()  # two parts whose sizes add up to the tensor's, overlapping: refused, nothing counted as loaded
    overlapping = [
        (part_name("model.norm.weight", (0, 0, 40)), norm[:40]),
        (part_name("model.norm.weight", (0, 16, 40)), norm[16:40]),
    ]
    with pytest.raises(UserError, match=r"parts sent of 'model\.norm\.weight' overlap .*@0:16:40 and .*@0:0:40"):
        loader.load(overlapping)
    assert "model.norm.weight" in loader.missing()


def test_unknown_and_misshaped_names_fail_naming_the_tensor(hf_checkpoint):
    model = load(hf_checkpoint("tiny-qwen3"))
    loader = WeightLoader(model)
    good = ("model.norm.weight", torch.ones(64))
    with pytest.raises(UserError, match=r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'"):
        loader.load([good, ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(UserError, match=r"'model\.norm\.weight' has shape \(65,\); the model expects \(64,\)"):
        loader.load([("model.norm.weight", torch.zeros(65))])
    assert loader.counts.num_tensors == 0  # a bad bucket changes nothing


def test_derived_buffers_and_extra_layers_are_skipped_and_counted(hf_checkpoint):
    model = load(hf_checkpoint("tiny-deepseek-v3"))  # 4 layers + 1 multi-token-prediction layer on disk
    loader = WeightLoader(model)
    loader.load(
        [
            ("model.rotary_emb.inv_freq", torch.zeros(4)),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(4)),  # old checkpoints kept one per layer
            ("model.layers.4.eh_proj.weight", torch.zeros(64, 128)),
            ("model.layers.4.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64)),
        ]
    )
    assert loader.counts.num_skipped == 4 and loader.counts.num_tensors == 0
