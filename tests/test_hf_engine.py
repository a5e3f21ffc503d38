"""hf engine generation, checked against a naive reference: a full forward pass per token, no cache, no padding."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.errors import UserError
from megarl.rollout.config import HFEngineConfig, SamplingParams
from megarl.rollout.engine import GenerateRequest
from megarl.rollout.hf_engine import HFEngine
from megarl.rollout.hf_sampling import StopStringWatcher, sample_tokens

PROMPTS = [[10, 11, 12, 13, 14, 15, 16], [40, 41, 42], [70] * 11 + [71]]  # different lengths: left padding


def greedy(max_new_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, **kwargs})


def requests(prompts=PROMPTS, seed: int | None = None) -> list[GenerateRequest]:
    return [GenerateRequest(p, seed=None if seed is None else seed + i) for i, p in enumerate(prompts)]


@torch.no_grad()
def naive_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(num_tokens):
        logits_V = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits_V.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits_V, -1)[token]))
        ids.append(token)
    return tokens, logprobs


@torch.no_grad()
def naive_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    logits_SV = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits_SV / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def assert_close(actual: list[float], expected: list[float], tol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    assert max((abs(a - b) for a, b in zip(actual, expected)), default=0.0) <= tol


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    return HFEngine(hf_checkpoint("tiny-qwen3"))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2", "tiny-mixtral", "tiny-deepseek-v3"])
def test_greedy_matches_naive_reference_batched_or_alone(name, hf_checkpoint):
    engine = HFEngine(hf_checkpoint(name))
    batched = engine.generate(requests(), greedy())
    for prompt, [completion] in zip(PROMPTS, batched):
        tokens, logprobs = naive_greedy(engine.model, prompt, 12)
        assert completion.token_ids == tokens
        assert_close(completion.logprobs, logprobs)
        [[alone]] = engine.generate(requests([prompt]), greedy())
        assert alone.token_ids == completion.token_ids
        assert_close(alone.logprobs, completion.logprobs)
        assert completion.finish_reason == "length"


def test_sampled_logprobs_are_those_of_the_tempered_distribution(engine):
    """Before top-k/top-p truncation, at the request's temperature."""
    sampling = sampled(temperature=0.7, top_k=20, top_p=0.9)
    for prompt, [completion] in zip(PROMPTS, engine.generate(requests(seed=3), sampling)):
        assert_close(completion.logprobs, naive_logprobs(engine.model, prompt, completion.token_ids, 0.7))


def test_seeded_sampling_is_reproducible_whatever_the_batch(hf_checkpoint, engine):
    sampling = sampled(n=4)
    first = engine.generate(requests(seed=7), sampling)
    small_rounds = HFEngine(hf_checkpoint("tiny-qwen3"), HFEngineConfig(max_batch_size=3))
    mixed = small_rounds.generate([GenerateRequest([99, 98]), *requests(seed=7)], sampling)[1:]
    assert [[c.token_ids for c in group] for group in first] == [[c.token_ids for c in group] for group in mixed]
    for group in first:
        assert len({tuple(c.token_ids) for c in group}) == 4  # the n samples differ
    reordered = engine.generate(list(reversed(requests(seed=7))), sampling)[::-1]
    for group, other in zip(first, reordered):
        for completion, again in zip(group, other):
            assert again.token_ids == completion.token_ids
            assert_close(again.logprobs, completion.logprobs)


def test_top_k_top_p_truncate_the_sampling_not_the_logprobs():
    probs_V = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits_BV = probs_V.log().repeat(4000, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    for params, kept, first_share in [
        (sampled(top_p=0.7), {0, 1}, 0.5 / 0.8),  # 0.5 < 0.7 so token 1 is needed; 0.8 reaches it
        (sampled(top_k=3), {0, 1, 2}, 0.5 / 0.95),
        (sampled(top_k=3, top_p=0.51), {0}, 1.0),  # top-p on the renormalized top-k: 0.5 / 0.95 > 0.51
        (sampled(), {0, 1, 2, 3}, 0.5),
    ]:
        tokens_B, logprobs_B = sample_tokens(logits_BV, params, generators)
        assert set(tokens_B.tolist()) == kept
        assert (tokens_B == 0).float().mean().item() == pytest.approx(first_share, abs=0.03)
        assert torch.allclose(logprobs_B, probs_V.log()[tokens_B])


def test_top_k_1_equals_greedy(engine):
    greedy_out = engine.generate(requests(), greedy())
    top1_out = engine.generate(requests(seed=1), sampled(top_k=1))
    for [g], [t] in zip(greedy_out, top1_out):
        assert t.token_ids == g.token_ids
        assert_close(t.logprobs, g.logprobs)


def test_stop_token_stop_string_and_length(engine):
    prompt = PROMPTS[0]
    [[free]] = engine.generate(requests([prompt]), greedy(16))
    stop_token = free.token_ids[5]
    cut = free.token_ids.index(stop_token) + 1
    [[by_token]] = engine.generate(requests([prompt]), greedy(16, stop_token_ids=[stop_token]))
    assert (by_token.token_ids, by_token.finish_reason) == (free.token_ids[:cut], "stop")
    assert by_token.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)

    # the random model rarely picks one of the tokenizer's ~100 characters: sample so that the text has a few
    decode, sampling = engine.tokenizer.decode, sampled(max_new_tokens=60)
    [[free_sample]] = engine.generate(requests([prompt], seed=2), sampling)
    text = decode(free_sample.token_ids, skip_special_tokens=True)
    assert len(text) >= 6
    stop = text[3:5]
    cut = next(k for k in range(1, 61) if stop in decode(free_sample.token_ids[:k], skip_special_tokens=True))
    sampling.stop = ["@@never@@", stop]
    [[by_string]] = engine.generate(requests([prompt], seed=2), sampling)
    assert (by_string.token_ids, by_string.finish_reason) == (free_sample.token_ids[:cut], "stop")

    [[short]] = engine.generate(requests([prompt]), greedy(4))
    assert (short.token_ids, short.finish_reason) == (free.token_ids[:4], "length")
    assert engine.eos_token_ids == {engine.tokenizer.eos_token_id}


def test_stop_string_watcher_spans_tokens_and_ignores_the_prefix(engine):
    ids = engine.tokenizer.convert_tokens_to_ids
    watcher = StopStringWatcher(engine.tokenizer, ["o w", "zz"], ids(list("hell")))
    assert [watcher.add(i) for i in ids(list("o wo"))] == [False, False, True, False]
    resumed = StopStringWatcher(engine.tokenizer, ["zz"], ids(list("azz")))
    assert [resumed.add(i) for i in ids(list("bz"))] == [False, False]
    assert resumed.add(ids("z")) and resumed.text == "azzbzz"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_continuation_equals_uninterrupted(engine, temperature):
    sampling = sampled(temperature=temperature, max_new_tokens=14)
    [[full]] = engine.generate(requests([PROMPTS[1]], seed=5), sampling)
    resumed_request = GenerateRequest(
        PROMPTS[1], seed=5, prefix_ids=full.token_ids[:6], prefix_logprobs=[-1.0] * 6, prefix_versions=[-7] * 6
    )
    [[resumed]] = engine.generate([resumed_request], sampling)
    assert resumed.token_ids == full.token_ids
    assert resumed.logprobs[:6] == [-1.0] * 6
    assert_close(resumed.logprobs[6:], full.logprobs[6:])
    assert resumed.token_versions == [-7] * 6 + [engine.weight_version] * 8
    assert resumed.finish_reason == "length"


def test_abort_from_another_thread_returns_partial_completions(hf_checkpoint):
    engine = HFEngine(hf_checkpoint("tiny-qwen3"), HFEngineConfig(max_batch_size=2))
    results = []
    worker = threading.Thread(
        target=lambda: results.append(engine.generate(requests(seed=0), sampled(n=2, max_new_tokens=5000)))
    )
    worker.start()
    deadline = time.monotonic() + 30
    while engine.health()["num_decode_steps"] < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.abort()
    worker.join(timeout=30)
    assert not worker.is_alive()
    completions = [c for group in results[0] for c in group]
    assert {c.finish_reason for c in completions} == {"abort"}
    assert any(c.token_ids for c in completions)  # the first round had started
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.token_versions) < 5000 for c in completions)
    [[after]] = engine.generate(requests([PROMPTS[0]]), greedy(3))  # the abort ended with its call
    assert after.finish_reason == "length"


def test_weight_update_and_version_propagate(hf_checkpoint):
    engine = HFEngine(hf_checkpoint("tiny-qwen3"))
    [[before]] = engine.generate(requests([PROMPTS[0]]), greedy(5))
    assert before.weight_version == 0 and before.token_versions == [0] * 5

    checkpoint = HFCheckpoint(hf_checkpoint("tiny-qwen3"))
    buckets = [[(name, checkpoint.get(name) * 1.5) for name in checkpoint.names[i : i + 10]] for i in range(0, 47, 10)]
    stats = engine.update_weights(buckets, version=3)
    assert (stats.version, stats.num_tensors, engine.health()["weight_version"]) == (3, len(checkpoint.names), 3)
    assert torch.equal(engine.model.model.norm.weight, checkpoint.get("model.norm.weight") * 1.5)
    [[after]] = engine.generate(requests([PROMPTS[0]]), greedy(5))
    assert after.weight_version == 3 and after.token_versions == [3] * 5

    engine.begin_weight_update(4)
    with pytest.raises(UserError, match="model.layers.0.mlp.bogus"):
        engine.apply_bucket([("model.layers.0.mlp.bogus", torch.zeros(1))])
    engine.apply_bucket(buckets[0])
    with pytest.raises(UserError, match="left 37 of 47 checkpoint tensors unsent"):
        engine.finish_weight_update(4)
    assert engine.weight_version == 3
