"""The hf engine's weights in shared memory, written in place by a sending rank (megarl/rollout/shared_weights.py).

What a user checks: moving the weights changes nothing the engine computes (tied weights stay tied); a model
written through the file, in whole tensors and in parts, in any order, equals `from_pretrained` of the written
checkpoint bit for bit, and the engine counts it complete; bad writes are refused naming the tensor; a rank that
opened another file, or is on another node, is told so. The ranks of a real actor write it in
tests/test_weight_sync.py (TP=2, EP=2) and in the trainer's runs (tests/test_hybrid_engine.py).
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from test_hf_engine_weights import assert_same_state, load

from megarl.bridge.buckets import part_name
from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.errors import UserError
from megarl.rollout.config import HFEngineConfig, SamplingParams
from megarl.rollout.engine import GenerateRequest
from megarl.rollout.hf_engine import HFEngine
from megarl.rollout.shared_weights import SharedWeightsUnavailable, SharedWeightsWriter
from megarl.workers.sync_route import SyncRoute
from megarl.workers.weight_sync import SenderState, _roads

NODE = "node-a"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_on(folder) -> HFEngine:
    return HFEngine(folder, HFEngineConfig(device="cpu", num_threads=1))


def greedy(engine: HFEngine) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    out = engine.generate([GenerateRequest([1, 17, 25]), GenerateRequest([1, 40])], sampling)
    return [c[0].token_ids for c in out]


def in_parts(name: str, tensor: torch.Tensor, rng: random.Random) -> list[tuple[str, torch.Tensor]]:
    """The tensor whole, or cut along a random dim into two parts (as two TP ranks send it)."""
    dims = [d for d in range(tensor.dim()) if tensor.shape[d] > 1]
    if not dims or rng.random() < 0.3:
        return [(name, tensor)]
    dim = rng.choice(dims)
    cut = rng.randrange(1, tensor.shape[dim])
    return [
        (part_name(name, (dim, 0, cut)), tensor.narrow(dim, 0, cut)),
        (part_name(name, (dim, cut, tensor.shape[dim])), tensor.narrow(dim, cut, tensor.shape[dim] - cut)),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "tiny-llama-bias",  # tied embeddings
        "tiny-qwen3-moe",  # experts fused in memory: each checkpoint expert is a strided region
        "tiny-deepseek-v3",  # MLA, expert-selection bias (a buffer)
        "tiny-gpt-oss",  # experts stacked in the checkpoint, sinks
    ],
)
def test_written_in_place_equals_from_pretrained(name, hf_checkpoint, other_checkpoint):
    engine = engine_on(hf_checkpoint(name))
    before = greedy(engine)
    assert engine.shared_weights is None
    shared = engine.share_weights(NODE)
    assert greedy(engine) == before  # the weights moved, their values did not
    assert engine.share_weights(NODE) is shared is engine.shared_weights  # moved once
    model = engine.model
    if model.config.tie_word_embeddings:  # still one tensor
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    writer = SharedWeightsWriter(shared, NODE)
    checkpoint = HFCheckpoint(other_checkpoint(name))
    rng = random.Random(0)
    entries = [part for n in checkpoint.names for part in in_parts(n, checkpoint.get(n), rng)]
    rng.shuffle(entries)
    engine.begin_weight_update(1)
    for start in range(0, len(entries), 5):
        written, nbytes, rest = writer.write(entries[start : start + 5])
        assert rest == [] and nbytes == sum(t.nbytes for _, t in entries[start : start + 5])
        engine.apply_shared_writes(written)
    engine.finish_weight_update(1)  # strict: every checkpoint tensor covered exactly once
    assert engine.weights.counts.num_tensors == len(entries)
    assert_same_state(model, load(other_checkpoint(name)))
    writer.close()
    engine.shutdown()
    assert not os.path.exists(shared.path)  # the engine's memfd is closed with it


def test_bad_writes_are_refused_naming_the_tensor(hf_checkpoint):
    engine = engine_on(hf_checkpoint("tiny-qwen3"))
    shared = engine.share_weights(NODE)
    writer = SharedWeightsWriter(shared, NODE)
    q = "model.layers.0.self_attn.q_proj.weight"
    held = writer.region(q).clone()
    rows = held.shape[0]

    with pytest.raises(UserError, match=rf"'{q}' has shape \(3, 2\); the model expects \({rows}, 64\)"):
        writer.write([(q, torch.zeros(rows, 64)), (q, torch.zeros(3, 2))])
    assert torch.equal(writer.region(q), held)  # shapes are checked before the first copy
    with pytest.raises(UserError, match="lies outside"):
        writer.write([(part_name(q, (0, 0, rows + 1)), torch.zeros(rows + 1, 64))])

    # names the file does not hold are left for the object store (the engine skips or refuses them there)
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    written, _, rest = writer.write([(inv_freq, torch.zeros(8))])
    assert written == [] and [n for n, _ in rest] == [inv_freq]

    with pytest.raises(RuntimeError, match="outside a weight update"):
        engine.apply_shared_writes([q])
    engine.begin_weight_update(1)
    first, second = part_name(q, (0, 0, 8)), part_name(q, (0, 4, rows))
    written, _, _ = writer.write([(first, torch.ones(8, 64)), (second, torch.ones(rows - 4, 64))])
    with pytest.raises(UserError, match=r"the parts sent of .* overlap"):
        engine.apply_shared_writes(written)

    with pytest.raises(SharedWeightsUnavailable, match="runs on node node-a, this rank on node-b"):
        SharedWeightsWriter(shared, "node-b")
    with pytest.raises(SharedWeightsUnavailable, match="not the engine's file"):
        SharedWeightsWriter(dataclasses.replace(shared, token="0" * 32), NODE)
    assert writer.engine_alive()
    engine.shutdown()
    assert not writer.engine_alive()  # the sender unmaps it at its next sync (weight_sync._keep_shared)
    with pytest.raises(SharedWeightsUnavailable, match="cannot open"):
        SharedWeightsWriter(shared, NODE)  # the engine is gone
    writer.close()


def test_a_rank_that_cannot_write_the_file_takes_the_object_store(hf_checkpoint):
    """The road per engine, as each sending rank picks it: in place where it can map the engine's file (kept
    between syncs), the object store where it cannot (here: no Ray node, as for a rank on another node), and the
    mapping dropped once the engine is gone."""
    engine = engine_on(hf_checkpoint("tiny-qwen3"))
    shared = engine.share_weights("(no Ray node)")  # what this process, outside Ray, calls its node
    elsewhere = dataclasses.replace(shared, node_id="node-b", token="1" * 32)
    state = SenderState()
    route = SyncRoute.to_workers([None, None], shared=[shared, elsewhere])
    assert _roads(route, state) == ["shared_memory", "object_store"]
    writer = state.shared[shared.token]
    assert _roads(route, state) == ["shared_memory", "object_store"] and state.shared[shared.token] is writer
    engine.shutdown()
    _roads(SyncRoute.to_workers([None], shared=[elsewhere]), state)
    assert state.shared == {elsewhere.token: None}  # the gone engine's mapping is closed
