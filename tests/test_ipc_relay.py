"""The per-node CUDA-IPC relay (megarl/workers/ipc_relay.py) with real process groups: 4 gloo ranks as an actor at
pp=2 x ep=2 (tests/relay_ranks.py) into two SGLang engines of 2 GPUs each (fake servers that check every request
against SGLang's own request types: tests/fake_sglang.py).

Stand-in, on CPU: the CUDA IPC handle of each rank's copy is replaced by the same bytes over the host
(sglang_weights.pickle_serializer, which relay_weights picks where CUDA is absent); everything else is the real
road: the global-order broadcasts, the export's point-to-point gathers on a producer thread, the gloo gather of the
payloads per engine, one update_weights_from_tensor per bucket and engine with one payload per TP rank.
"""

from __future__ import annotations

import pytest
import relay_ranks
import torch
from fake_sglang import FakeSGLang

from megarl.rollout.sglang_client import SGLangClient
from megarl.runtime.rank_pool import RankFailure


@pytest.fixture
def engines():
    fakes = [FakeSGLang(), FakeSGLang()]
    for fake in fakes:
        SGLangClient(fake.url).begin_weight_update()
    yield fakes
    for fake in fakes:
        fake.close()


def test_relay_puts_every_bucket_into_every_engine_bit_exact(ranks4, engines):
    results = ranks4.run(relay_ranks.relay_into_engines, [fake.url for fake in engines])
    names = relay_ranks.all_names()
    for fake in engines:
        assert sorted(fake.weights) == sorted(names)
        for name in names:
            expected = relay_ranks.full_tensor(name)
            got = fake.weights[name]
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
        posts = [body for path, body in fake.calls if path == "/update_weights_from_tensor"]
        # one request per bucket (2 layers x 2 stages x 2 expert ranks = 8), one payload per TP rank of the engine
        assert len(posts) == 8 and all(len(body["serialized_named_tensors"]) == 2 for body in posts)
        assert all(body["load_format"] == "flattened_bucket" for body in posts)
        assert fake.rejected == []  # SGLang's own request types accepted every body
    # each tensor counted once, on its owner: stage owners of dense tensors and both expert ranks
    assert [r["tensors"] for r in results] == [8.0, 4.0, 8.0, 4.0]
    total = sum(relay_ranks.full_tensor(n).nbytes for n in names)
    assert sum(r["bytes"] for r in results) == total
    assert sorted(n for r in results for n in r["samples"]) == sorted(n for n in names if "layernorm" in n)


def test_a_failed_export_stops_every_rank(ranks4, engines):
    with pytest.raises(RankFailure) as failure:
        ranks4.run(relay_ranks.relay_into_engines, [fake.url for fake in engines], fail_rank=1)
    text = str(failure.value)
    assert "ValueError: injected export failure" in text  # on rank 1
    assert text.count("the export failed on rank 1: ValueError: injected export failure") == 3  # the others


def test_a_refused_post_stops_every_rank(ranks4, engines):
    engines[1].fail_update = "out of memory while loading"
    with pytest.raises(RankFailure) as failure:
        ranks4.run(relay_ranks.relay_into_engines, [fake.url for fake in engines])
    text = str(failure.value)
    assert text.count("RuntimeError: weight sync (IPC relay) into engine 1 failed: SGLangError") == 2
    assert "HTTP 400: out of memory while loading" in text
    assert text.count("RuntimeError: weight sync (IPC relay): the post into another engine failed") == 2
