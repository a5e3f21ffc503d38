"""The sglang engine's client path: request payloads, response parsing, weight updates, health and errors (its
launch path: test_sglang_launch.py).

SGLang itself cannot be installed or run on this CPU machine. What stands in for it:
- recorded response shapes, written from SGLang's source (sglang 0.5.23: `meta_info` built in
  `srt/managers/tokenizer_manager.py`, finish reasons from `FINISH_*.to_json` in `srt/managers/schedule_batch.py`,
  error bodies from `srt/entrypoints/http_server.py`);
- a fake SGLang HTTP server (tests/fake_sglang.py: stdlib http.server in a thread on 127.0.0.1) implementing the
  endpoints the engine uses, with SGLang's request bodies, answers and failure shapes; it rebuilds flattened weight
  buckets the way SGLang's `FlattenedTensorBucket` does. The payload of /generate was also checked against SGLang's
  own JSON contract decoder (`sglang.api.v1.api_types.GenerateRequest`) while writing these tests;
- the colocated transport's CUDA IPC serializer is SGLang's own (GPU only); a pickle stand-in with the same dict
  layout carries CPU tensors here.
"""

from __future__ import annotations

import json
import time

import pytest
import sglang_contract
import torch
from fake_sglang import FakeSGLang

from megarl.errors import UserError
from megarl.rollout.config import SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest, sample_seed
from megarl.rollout.sglang_client import SGLangClient, SGLangError
from megarl.rollout.sglang_engine import SGLangEngine, build_generate_payload, parse_completion
from megarl.rollout.sglang_server import find_free_port
from megarl.rollout.sglang_weights import pickle_serializer

# ---- recorded shapes ---------------------------------------------------------------------------------------------

STOP_ITEM = {
    "text": "ab",
    "output_ids": [11, 12, 2],
    "meta_info": {
        "id": "q1/0",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "weight_version": "4",
        "num_retractions": 0,
        "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None], [-0.125, 2, None]],
        "output_token_logprobs_length": 3,
        "reasoning_tokens": 0,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.05,
    },
}

LENGTH_ITEM = {
    "text": "xyz",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "q2/1",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 4,
        "weight_version": "default",
        "output_token_logprobs": [[-2.0, 7, None], [-0.5, 8, None]],
        "completion_tokens": 2,
        "cached_tokens": 4,
    },
}

ABORT_ITEM = {
    "text": "a",
    "output_ids": [5],
    "meta_info": {
        "id": "q3/0",
        "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        "weight_version": "4",
        "output_token_logprobs": [[-0.75, 5, None]],
        "completion_tokens": 1,
    },
}

SPANNING_ITEM = {  # a request that ran across a weight update (pause_mode retract / in_place)
    "text": "abcd",
    "output_ids": [1, 2, 3, 4],
    "meta_info": {
        "id": "q4/0",
        "finish_reason": {"type": "length", "length": 4},
        "weight_version": "6",
        "weight_versions": [{"version": "5", "start": 0, "end": 3}, {"version": "6", "start": 3, "end": 4}],
        "output_token_logprobs": [[-1.0, 1, None], [-1.0, 2, None], [-1.0, 3, None], [-1.0, 4, None]],
    },
}


def test_payload_one_item_per_sample_with_sglang_names_and_seeds():
    requests = [
        GenerateRequest([1, 2, 3], seed=5, request_id="q1"),
        GenerateRequest([4, 5], request_id="q2", prefix_ids=[6], prefix_logprobs=[-0.5], prefix_versions=[2]),
    ]
    sampling = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=8, stop=["\n\n"], stop_token_ids=[2]
    )
    payload, slots = build_generate_payload(requests, sampling, draw_seed=iter([101]).__next__)
    common = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "ignore_eos": False,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
    }
    assert payload == {
        "input_ids": [[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]],
        "sampling_params": [
            {**common, "max_new_tokens": 8, "sampling_seed": sample_seed(5, 0)},
            {**common, "max_new_tokens": 8, "sampling_seed": sample_seed(5, 1)},
            {**common, "max_new_tokens": 7, "sampling_seed": sample_seed(101, 0)},  # drawn once per request
            {**common, "max_new_tokens": 7, "sampling_seed": sample_seed(101, 1)},
        ],
        "return_logprob": True,
        "rid": ["q1/0", "q1/1", "q2/0", "q2/1"],
    }
    assert [(s.request_index, s.sample_index, s.max_new_tokens) for s in slots] == [
        (0, 0, 8), (0, 1, 8), (1, 0, 7), (1, 1, 7)
    ]  # fmt: skip
    json.dumps(payload)  # JSON as sent


def test_payload_greedy_and_minimal():
    payload, _ = build_generate_payload([GenerateRequest([9])], SamplingParams(temperature=0.0, top_k=5))
    assert payload["sampling_params"] == [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 5, "max_new_tokens": 256, "ignore_eos": False}
    ]
    assert len(payload["rid"][0]) == 32 + 2  # a fresh id when the caller gives none


def test_payload_skips_prefixes_that_fill_the_budget_and_rejects_bad_requests():
    full = GenerateRequest([1], prefix_ids=[4, 5], prefix_logprobs=[-1.0, -2.0], prefix_versions=[0, 1])
    payload, slots = build_generate_payload([full], SamplingParams(max_new_tokens=2))
    assert payload is None and [s.max_new_tokens for s in slots] == [0]
    with pytest.raises(UserError, match=r"requests\[0\].prompt_ids is empty"):
        build_generate_payload([GenerateRequest([])], SamplingParams())
    with pytest.raises(UserError, match=r"unique .* repeated: \['x'\]"):
        build_generate_payload([GenerateRequest([1], request_id="x")] * 2, SamplingParams())
    with pytest.raises(UserError, match=r"requests\[1\] has 2 prefix_ids but 1 prefix_logprobs and 0 prefix_versions"):
        build_generate_payload([GenerateRequest([1]), GenerateRequest([1], prefix_ids=[2, 3], prefix_logprobs=[-1.0])],
                               SamplingParams())  # fmt: skip


def test_parse_stop_length_abort():
    stop = parse_completion(STOP_ITEM, GenerateRequest([1, 2, 3], request_id="q1"), current_version=4)
    assert stop.token_ids == [11, 12, 2] and stop.logprobs == [-0.25, -1.5, -0.125]
    assert stop.finish_reason == "stop" and stop.weight_version == 4 and stop.token_versions == [4, 4, 4]
    assert stop.request_id == "q1"
    length = parse_completion(LENGTH_ITEM, GenerateRequest([1]), current_version=0)  # SGLang's initial "default"
    assert length.finish_reason == "length" and length.weight_version == 0 and length.token_versions == [0, 0]
    abort = parse_completion(ABORT_ITEM, GenerateRequest([1]), current_version=4)
    assert abort.finish_reason == "abort" and abort.token_ids == [5] and abort.logprobs == [-0.75]


def test_parse_prefix_and_version_spans():
    request = GenerateRequest([9], prefix_ids=[20, 21], prefix_logprobs=[-3.0, -4.0], prefix_versions=[3, 4])
    c = parse_completion(SPANNING_ITEM, request, current_version=6)
    assert c.token_ids == [20, 21, 1, 2, 3, 4]
    assert c.logprobs == [-3.0, -4.0, -1.0, -1.0, -1.0, -1.0]
    assert c.token_versions == [3, 4, 5, 5, 5, 6] and c.weight_version == 6


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"output_ids": [1]}, "missing 'meta_info'"),
        ({**STOP_ITEM, "meta_info": {**STOP_ITEM["meta_info"], "finish_reason": None}}, "unexpected finish_reason"),
        (
            {**STOP_ITEM, "meta_info": {**STOP_ITEM["meta_info"], "output_token_logprobs": [[-1.0, 11, None]]}},
            "1 output log-probs do not match its 3 output tokens",
        ),
    ],
)
def test_parse_rejects_malformed_items(item, message):
    with pytest.raises(SGLangError, match=message):
        parse_completion(item, GenerateRequest([1]), current_version=0)


# ---- through a fake SGLang server (tests/fake_sglang.py) ---------------------------------------------------


@pytest.fixture
def fake():
    if sglang_contract.installed():
        sglang_contract.install_stand_ins()  # SGLang's hash function imports its multimodal utilities
    server = FakeSGLang()
    yield server
    server.close()
    assert not server.rejected, f"SGLang's request types refused what megarl sent: {server.rejected}"


def make_engine(fake: FakeSGLang, **config) -> SGLangEngine:
    return SGLangEngine("/ckpt/tiny", SGLangEngineConfig(**config), url=fake.url, serializer=pickle_serializer)


def test_generate_through_fake_server(fake):
    engine = make_engine(fake, random_seed=3)
    requests = [GenerateRequest([1, 2, 3], seed=11, request_id="a"), GenerateRequest([4, 5, 6, 7])]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, stop_token_ids=[12])
    results = engine.generate(requests, sampling)
    assert [len(r) for r in results] == [3, 3]
    path, body = fake.calls[-1]
    assert path == "/generate" and len(body["input_ids"]) == 6 and body["return_logprob"] is True
    for j, completion in enumerate(results[0]):
        seed = sample_seed(11, j)
        expected = fake._generate_one([1, 2, 3], {"sampling_seed": seed, "max_new_tokens": 5, "stop_token_ids": [12]},
                                      f"a/{j}")  # fmt: skip
        assert completion.token_ids == expected["output_ids"]
        assert completion.logprobs == [e[0] for e in expected["meta_info"]["output_token_logprobs"]]
        assert completion.finish_reason == expected["meta_info"]["finish_reason"]["type"]
        assert completion.request_id == "a" and completion.weight_version == 0
    assert len({tuple(c.token_ids) for c in results[0]}) == 3  # each sample its own seed
    again = engine.generate(requests[:1], sampling)  # the same seeds give the same completions
    assert [c.token_ids for c in again[0]] == [c.token_ids for c in results[0]]
    stops = [c for r in results for c in r if c.finish_reason == "stop"]
    assert all(c.token_ids[-1] == 12 for c in stops)
    (first,) = engine.generate(requests[:1], SamplingParams(max_new_tokens=5, stop_token_ids=list(range(60))))[0]
    assert first.finish_reason == "stop" and len(first.token_ids) == len(first.logprobs) == 1  # stop token kept
    assert engine.generate([], sampling) == []


def test_moe_engine_asks_for_and_decodes_routed_experts(fake, hf_checkpoint):
    folder = hf_checkpoint("tiny-qwen3-moe")  # 4 layers, layer 1 dense, top-2 of 8 experts
    fake.routing = (4, [0, 2, 3], 2)
    engine = SGLangEngine(folder, SGLangEngineConfig(), url=fake.url, serializer=pickle_serializer, record_routing=True)
    request = GenerateRequest([1, 2, 3], seed=1, prefix_ids=[40], prefix_logprobs=[-0.5], prefix_versions=[0])
    (completions,) = engine.generate([request], SamplingParams(n=2, temperature=1.0, max_new_tokens=5))
    assert fake.calls[-1][1]["return_routed_experts"] is True
    for completion in completions:  # prompt, prefix and new tokens but the last: 3 + len(token_ids) - 1 rows
        assert completion.routed_experts.shape == (3 + len(completion.token_ids) - 1, 3, 2)
        assert completion.routed_experts.unique().tolist() == [1, 2]
    dense = SGLangEngine(hf_checkpoint("tiny-llama"), SGLangEngineConfig(), url=fake.url, record_routing=True)
    dense.generate([GenerateRequest([1, 2])], SamplingParams(max_new_tokens=2))
    assert "return_routed_experts" not in fake.calls[-1][1] and dense.routing is None


def test_generate_resumes_partial_rollouts(fake):
    engine = make_engine(fake)
    resumed = GenerateRequest([1, 2], seed=1, prefix_ids=[30, 31], prefix_logprobs=[-0.1, -0.2], prefix_versions=[0, 0])
    done = GenerateRequest([3], prefix_ids=[40, 41, 42], prefix_logprobs=[-1.0] * 3, prefix_versions=[0, 1, 1])
    (r1,), (r2,) = engine.generate([resumed, done], SamplingParams(max_new_tokens=3))
    assert fake.calls[-1][1]["input_ids"] == [[1, 2, 30, 31]]  # `done` needs no server call
    assert fake.calls[-1][1]["sampling_params"][0]["max_new_tokens"] == 1
    assert r1.token_ids[:2] == [30, 31] and len(r1.token_ids) == 3 and r1.logprobs[:2] == [-0.1, -0.2]
    assert r2.token_ids == [40, 41, 42] and r2.finish_reason == "length" and r2.token_versions == [0, 1, 1]


def test_colocated_weight_update_through_fake_server(fake):
    engine = make_engine(fake, tp=2)
    w = torch.randn(6, 4)
    bucket = [("w", w.t()), ("b", torch.randn(5, dtype=torch.bfloat16)), ("step", torch.tensor(3))]
    stats = engine.update_weights([bucket, [("emb", torch.randn(3, 2, dtype=torch.bfloat16))]], version=7)
    assert stats.num_tensors == 4 and engine.weight_version == 7
    assert fake.paths() == [
        "/pause_generation", "/begin_weight_update",
        "/update_weights_from_tensor",  # one request per bucket, whatever its dtypes: one load_weights call
        "/update_weights_from_tensor",
        "/end_weight_update", "/update_weight_version", "/flush_cache", "/continue_generation",
    ]  # fmt: skip
    assert fake.calls[0][1] == {"mode": "abort"}
    tensor_calls = [body for path, body in fake.calls if path == "/update_weights_from_tensor"]
    assert all(len(b["serialized_named_tensors"]) == 2 and b["flush_cache"] is False for b in tensor_calls)
    assert fake.calls[5][1] == {"new_version": "7", "abort_all_requests": False}
    for name, tensor in [*bucket, ("emb", None)]:
        if tensor is not None:
            assert fake.weights[name].dtype == tensor.dtype and torch.equal(fake.weights[name], tensor)
    (c,) = engine.generate([GenerateRequest([1])], SamplingParams(max_new_tokens=2))[0]
    assert c.weight_version == 7 and c.token_versions == [7, 7]


def test_disk_weight_update_through_fake_server(fake, tmp_path):
    """The road of engines across nodes: SGLang reads the folder the senders wrote; a refusal quarantines."""
    from safetensors.torch import save_file

    engine = make_engine(fake)
    save_file({"a": torch.ones(2), "b": torch.arange(3.0)}, tmp_path / "rank00000-000000.safetensors")
    save_file({"c": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "rank00001-000000.safetensors")
    engine.begin_weight_update(4)
    assert engine.load_weights_from_disk(str(tmp_path)) == (3, 8 + 12 + 8)
    engine.finish_weight_update(4)
    body = next(body for path, body in fake.calls if path == "/update_weights_from_disk")
    assert body == {"model_path": str(tmp_path), "load_format": "auto", "abort_all_requests": False, "keep_pause": True}
    assert torch.equal(fake.weights["b"], torch.arange(3.0)) and fake.weights["c"].dtype == torch.bfloat16
    fake.fail_update = "Failed to update weights: shape mismatch"
    engine.begin_weight_update(5)
    with pytest.raises(SGLangError, match=r"refused weight bucket a \(\+2 more\)"):
        engine.load_weights_from_disk(str(tmp_path))
    with pytest.raises(SGLangError, match="refuses to generate"):
        engine.generate([GenerateRequest([1])], SamplingParams(max_new_tokens=1))


def test_weight_update_on_sglang_without_sessions(fake):
    fake.sessions = False  # older SGLang: no /begin_weight_update
    engine = make_engine(fake, pause_mode="retract")
    engine.update_weights([[("w", torch.ones(2))]], version=1)
    assert fake.paths() == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                            "/update_weight_version", "/flush_cache", "/continue_generation"]  # fmt: skip
    assert fake.calls[0][1] == {"mode": "retract"}


def test_weight_update_failure_is_a_clear_error(fake):
    engine = make_engine(fake)
    fake.fail_update = "Failed to update parameter online: size mismatch for model.layers.0.mlp.up_proj.weight."
    engine.begin_weight_update(1)
    with pytest.raises(SGLangError) as info:
        engine.apply_bucket([("model.layers.0.mlp.up_proj.weight", torch.zeros(2, 2))])
    message = str(info.value)
    assert f"{fake.url}/update_weights_from_tensor" in message and "HTTP 400" in message
    assert "size mismatch for model.layers.0.mlp.up_proj.weight" in message
    assert info.value.status == 400


def test_a_failed_weight_update_quarantines_the_engine_until_a_complete_one(fake):
    engine = make_engine(fake)
    engine.update_weights([[("a", torch.ones(2))]], version=1)
    engine.begin_weight_update(2)
    engine.apply_bucket([("a", torch.zeros(2))])  # a first bucket lands ...
    fake.fail_update = "Failed to update parameter online: size mismatch"
    with pytest.raises(SGLangError, match=r"refused weight bucket b \(\+1 more\)"):
        engine.apply_bucket([("b", torch.zeros(2)), ("c", torch.zeros(2))])  # ... the second does not
    assert not fake.session_open  # the weight-update session was closed
    with pytest.raises(SGLangError, match="refuses to generate: a weight update failed at bucket b"):
        engine.generate([GenerateRequest([1])], SamplingParams(max_new_tokens=1))
    fake.fail_update = None
    engine.update_weights([[("a", torch.ones(2)), ("b", torch.ones(2)), ("c", torch.ones(2))]], version=3)
    (c,) = engine.generate([GenerateRequest([1])], SamplingParams(max_new_tokens=1))[0]
    assert c.weight_version == 3


@pytest.mark.skipif(not sglang_contract.installed(), reason=sglang_contract.INSTALL_HINT)
def test_verify_compares_sglangs_checksums_with_what_was_sent(fake):
    engine = make_engine(fake, dtype="float32")
    norm = ("model.norm.weight", torch.randn(8))
    layer = ("model.layers.0.input_layernorm.weight", torch.randn(8))
    engine.update_weights([[norm, layer]], version=1)
    assert engine.verify_weights([norm, layer]) == []
    fake.weights["model.norm.weight"] += 1  # the server holds something else than what was sent
    del fake.weights["model.layers.0.input_layernorm.weight"]
    problems = engine.verify_weights([norm, layer])
    assert len(problems) == 2
    assert problems[0].startswith(f"model.norm.weight: SGLang {fake.url} rank 0 holds checksum ")
    assert problems[1] == f"model.layers.0.input_layernorm.weight: not among the weights of SGLang {fake.url} (rank 0)"


def test_cache_is_flushed_after_every_update_and_in_place_pauses_are_refused():
    with pytest.raises(UserError, match="pause_mode='in_place': valid are abort, retract"):
        SGLangEngineConfig(pause_mode="in_place").check("rollout.sglang")


def test_requests_are_fitted_into_the_context_window(fake):
    engine = make_engine(fake)
    engine.context_len = 10
    requests = [GenerateRequest([1] * 4), GenerateRequest([2] * 8), GenerateRequest([3] * 10), GenerateRequest([4] * 3)]
    out = engine.generate(requests, SamplingParams(max_new_tokens=5))
    (_, body) = next(call for call in fake.calls if call[0] == "/generate")
    # 4 + 5 fits; 8 leaves room for 2; 10 fills the window: not sent (SGLang would fail the whole batch with 400)
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [5, 2, 5]
    assert [len(ids) for ids in body["input_ids"]] == [4, 8, 3]
    assert [len(c.token_ids) for (c,) in out][2] == 0 and out[2][0].finish_reason == "length"
    assert engine.num_dropped == 1


def test_distributed_engines_take_weights_from_the_sender(fake):
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(tp=4), url=fake.url, weight_sync="distributed")
    assert engine.endpoint.url == fake.url and engine.endpoint.num_ranks == 4
    with pytest.raises(RuntimeError, match="SGLangWeightSender broadcasts the buckets"):
        engine.apply_bucket([("w", torch.ones(1))])


def test_http_errors_carry_url_status_and_message(fake):
    engine = make_engine(fake)
    with pytest.raises(SGLangError, match=r"POST .*/generate failed: HTTP 400: input_ids cannot be empty"):
        engine.client.generate({"input_ids": [[]], "sampling_params": [{}], "rid": ["x"]}, timeout_s=5)
    with pytest.raises(SGLangError, match=r"/no_such_endpoint failed: HTTP 404: Not Found"):
        engine.client.control("/no_such_endpoint")
    fake.flush_refusals = 2  # SGLang refuses to flush while requests run: retried
    engine.flush_cache()
    assert fake.paths()[-3:] == ["/flush_cache"] * 3
    fake.flush_refusals = 100
    with pytest.raises(SGLangError, match="HTTP 400: Flush cache failed: requests are still running"):
        engine.client.flush_cache(timeout_s=0.6)


def test_health_and_timeouts_are_bounded(fake):
    engine = make_engine(fake, health_timeout_s=0.3, request_timeout_s=0.5)
    assert engine.health() == {"ok": True, "weight_version": 0, "url": fake.url}
    fake.delay["/health"] = 2.0
    start = time.monotonic()
    health = engine.health()
    assert time.monotonic() - start < 1.5
    assert health["ok"] is False and "timed out after 0.3 s" in health["error"]
    fake.delay["/generate"] = 2.0
    with pytest.raises(SGLangError, match=r"/generate timed out after 0.5 s"):
        engine.generate([GenerateRequest([1])], SamplingParams(max_new_tokens=1))


def test_unreachable_server():
    url = f"http://127.0.0.1:{find_free_port()}"
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(health_timeout_s=1.0), url=url)
    health = engine.health()
    assert health["ok"] is False and "cannot connect" in health["error"] and url in health["error"]
    with pytest.raises(SGLangError, match="cannot connect"):
        SGLangClient(url).flush_cache(timeout_s=1.0)


def test_abort_and_memory(fake):
    engine = make_engine(fake)
    engine.abort()
    assert fake.calls[-1] == ("/abort_request", {"abort_all": True})
    with pytest.raises(UserError, match="rollout.sglang.enable_memory_saver=true"):
        engine.release_memory()
    engine = make_engine(fake, enable_memory_saver=True)
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.resume_memory()
    assert fake.calls[-3:] == [
        ("/release_memory_occupation", {"tags": None}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": None}),
    ]
