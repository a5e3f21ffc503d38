"""The rollout producer and its buffer (asynchronous RL) with stand-ins for the engines and the trainer.

The engines are a fake (`FakeEngines`): generation at a fixed time per token, abortable from another thread, every
token stamped with the engines' weight version, its log-prob set to minus that version so the batch's
`rollout_logprobs` show which version made each token. The trainer is a loop that sleeps for its update and bumps
the version in its sync, through the same `RolloutProducer.sync` as the real loop. Timings are chosen so that what
must happen (staleness, drops, interruptions) does not depend on the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.data.prompts import PromptSample, PromptSampler
from megarl.rollout.config import SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest, sample_seed
from megarl.trainer.loops.async_loop import staleness_metrics
from megarl.trainer.loops.dynamic_sampling import DynamicSampling
from megarl.trainer.rollout_side.rollout_buffer import OLDEST_VERSION, RolloutBuffer
from megarl.trainer.rollout_side.rollout_producer import RolloutProducer
from megarl.trainer.rollout_side.rollout_step import draw_key, request_seed

NUM_PROMPTS = 4
N = 2


class FakeEngines:
    """Stand-in for the rollout engine group (no model): one token per `token_s` for all samples at once."""

    def __init__(self, token_s: float = 0.0):
        self.token_s = token_s
        self.version = 0
        self.calls: list[list[GenerateRequest]] = []
        self._abort = threading.Event()
        self._generating = threading.Event()

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        self.calls.append(list(requests))
        self._generating.set()
        try:
            rows = [
                (i, j, list(r.prefix_ids), list(r.prefix_logprobs), list(r.prefix_versions))
                for i, r in enumerate(requests)
                for j in range(sampling.n)
            ]
            finished = [False] * len(rows)
            while not all(finished):
                if self._abort.is_set():
                    break
                if self.token_s:
                    time.sleep(self.token_s)
                for k, (i, j, ids, logprobs, versions) in enumerate(rows):
                    if finished[k]:
                        continue
                    ids.append(48 + (requests[i].seed + j + len(ids)) % 10)  # a digit, from the seed and position
                    logprobs.append(-float(self.version))
                    versions.append(self.version)
                    finished[k] = len(ids) >= sampling.max_new_tokens
        finally:
            self._generating.clear()
            self._abort.clear()
        out: list[list[Completion]] = [[] for _ in requests]
        for k, (i, _, ids, logprobs, versions) in enumerate(rows):
            reason = "length" if finished[k] else "abort"
            out[i].append(Completion(ids, logprobs, reason, self.version, versions))
        return out

    def abort(self) -> None:
        if self._generating.is_set():
            self._abort.set()


class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def sampler(num: int = 32) -> PromptSampler:
    samples = [PromptSample(i, f"Q{i}:", [1, 10 + i % 50, 11], label=str(i % 10)) for i in range(num)]
    return PromptSampler(samples, NUM_PROMPTS, seed=0, shuffle=True)


def score(batch):
    """Stand-in reward: the fraction of the response that is the digit '7' (any deterministic function will do)."""
    scores = torch.tensor([r.count("7") / max(len(r), 1) for r in batch.meta["response"]])
    return batch.with_tensors(scores=scores), {"reward/mean": scores.mean().item()}


def make_producer(engines, max_staleness, policy="wait", *, max_new_tokens=4, partial="resume", **kwargs):
    sampling = SamplingParams(n=N, temperature=1.0, max_new_tokens=max_new_tokens)
    buffer = RolloutBuffer(max_staleness, policy)
    return RolloutProducer(
        engines, sampler(), score, FakeTokenizer(), sampling, buffer, run_seed=5, partial_rollout=partial, **kwargs
    )


def train(producer, engines, num_steps: int, train_s: float, first_version: int = 0):
    """Stand-in trainer: take a batch, 'train' for train_s, sync (the engines' version goes up by one)."""
    version, taken = first_version, []
    for _ in range(num_steps):
        batch = producer.next_batch(version)
        time.sleep(train_s)

        producer.sync(lambda new=version + 1: setattr(engines, "version", new))
        version += 1
        taken.append((version - 1, batch))
    return taken


def token_versions(batch) -> list[list[int]]:
    """Per sample, the version of each response token (the fake engine's log-prob is minus the version)."""
    mask = batch["response_mask"].bool()
    return [[int(-x) for x in batch["rollout_logprobs"][i][mask[i]].tolist()] for i in range(len(batch))]


def test_max_staleness_0_is_the_synchronous_loop():
    engines = FakeEngines(token_s=0.001)
    with make_producer(engines, 0, "drop") as producer:  # k=0 waits whatever the policy
        taken = train(producer, engines, 5, train_s=0.02)
    for step, (actor_version, t) in enumerate(taken):
        assert actor_version == step
        assert t.staleness == [0] * NUM_PROMPTS * N and t.dropped == []
        assert t.item.batch.meta[OLDEST_VERSION] == [step] * NUM_PROMPTS * N
        assert all(v == [step] * 4 for v in token_versions(t.item.batch))
    assert t.item.metrics["async/interrupted"] == 0
    # the synchronous loop's seeds: request i of step b has request_seed(run seed, draw_key(b, 0), i)
    for b, requests in enumerate(engines.calls):
        assert [r.seed for r in requests] == [request_seed(5, draw_key(b, 0), i) for i in range(NUM_PROMPTS)]


def test_wait_keeps_a_fast_rollout_one_step_ahead_of_a_slow_trainer():
    engines = FakeEngines(token_s=0.0)
    with make_producer(engines, 1, "wait", max_batches=6) as producer:
        taken = train(producer, engines, 6, train_s=0.1)
        times = producer.take_times()
    staleness = [t.staleness for _, t in taken]
    assert staleness[0] == [0] * 8
    assert all(s == [1] * 8 for s in staleness[1:]), staleness  # generated during the previous step, never older
    assert all(t.dropped == [] for _, t in taken)
    assert len(engines.calls) == 6
    assert times["async/rollout_idle_s"] > 0.3  # a fast rollout mostly waits for its turn


def test_drop_counts_the_batches_a_free_running_rollout_makes_too_old():
    """k=1, buffer of one batch plus one in hand, instant rollout, slow trainer. At step s (actor version s) the
    buffer holds the batch made while step s-2 trained (version s-2) or a fresh one, alternately: steps 2, 4, 6
    each drop one whole batch (staleness 2) and take the next (staleness 1)."""
    engines = FakeEngines(token_s=0.0)
    with make_producer(engines, 1, "drop") as producer:
        taken = train(producer, engines, 8, train_s=0.15)
    dropped_batches = [t.num_dropped_batches for _, t in taken]
    assert dropped_batches == [0, 0, 1, 0, 1, 0, 1, 0]
    assert [len(t.dropped) for _, t in taken] == [b * NUM_PROMPTS * N for b in dropped_batches]
    assert all(s == 2 for _, t in taken for s in t.dropped)
    assert all(max(t.staleness) <= 1 for _, t in taken)
    metrics = staleness_metrics(taken[2][1], 1)
    assert metrics["async/dropped"] == 8 and metrics["async/staleness_1"] == 1.0


def test_a_sync_interrupts_generation_and_resumes_it_with_the_prefix():
    """A slow rollout (12 tokens x 20 ms) and a fast trainer: every sync lands in the middle of a generation."""
    engines = FakeEngines(token_s=0.02)
    with make_producer(engines, 1, "wait", max_new_tokens=12) as producer:
        taken = train(producer, engines, 4, train_s=0.1)
    mixed = 0
    for _, t in taken:
        batch = t.item.batch
        assert max(t.staleness) <= 1
        for versions, oldest in zip(token_versions(batch), batch.meta[OLDEST_VERSION]):
            assert len(versions) == 12  # resumed where it stopped: the same length as an uninterrupted one
            assert versions == sorted(versions) and versions[0] == oldest
            mixed += versions[0] != versions[-1]
        assert batch.meta["finish_reason"] == ["length"] * 8
    assert mixed > 0 and sum(t.item.metrics["async/interrupted"] for _, t in taken) > 0
    resumed = [r for call in engines.calls for r in call if r.prefix_ids]
    assert resumed and all(len(r.prefix_versions) == len(r.prefix_ids) for r in resumed)
    # an interrupted sample j of a request with seed s goes on as a one-sample request with seed sample_seed(s, j)
    first = {r.request_id: r.seed for call in engines.calls for r in call if "/" not in r.request_id}
    for r in resumed:
        parent, j = r.request_id.split("/")
        assert r.seed == sample_seed(first[parent], int(j))


def test_partial_rollout_abort_regenerates_interrupted_samples_from_scratch():
    engines = FakeEngines(token_s=0.02)
    with make_producer(engines, 1, "wait", max_new_tokens=12, partial="abort") as producer:
        taken = train(producer, engines, 4, train_s=0.1)
    assert sum(t.item.metrics["async/interrupted"] for _, t in taken) > 0
    for _, t in taken:
        for versions in token_versions(t.item.batch):
            assert len(versions) == 12 and len(set(versions)) == 1  # one version per sample: nothing kept
    assert not any(r.prefix_ids for call in engines.calls for r in call)


def test_consumed_batches_carry_their_data_position():
    engines = FakeEngines()
    with make_producer(engines, 1, "wait") as producer:
        taken = train(producer, engines, 3, train_s=0.0)
    assert [t.item.data_state["position"] for _, t in taken] == [4, 8, 12]
    assert [t.item.number for _, t in taken] == [0, 1, 2]


def test_dynamic_sampling_refills_the_batch_from_more_draws():
    """DAPO in the producer: groups whose samples all scored the same are dropped and more prompts drawn."""
    engines = FakeEngines()
    dynamic = DynamicSampling(max_rounds=3, num_groups=NUM_PROMPTS)
    with make_producer(engines, 0, "wait", dynamic_sampling=dynamic) as producer:
        taken = train(producer, engines, 2, train_s=0.0)
    for _, t in taken:
        batch = t.item.batch
        groups = batch["group_ids"].tolist()
        assert groups == sorted(groups) and set(groups) <= set(range(NUM_PROMPTS))
        for g in set(groups):  # every kept group has at least two different scores
            assert len({s for s, gid in zip(batch["scores"].tolist(), groups) if gid == g}) > 1
        assert 1 <= t.item.metrics["dapo/draws"] <= 3
    # draw d of batch b has the synchronous loop's seeds for (b, d)
    draws = [(b, d) for b, t in enumerate(taken) for d in range(int(t[1].item.metrics["dapo/draws"]))]
    for (b, d), requests in zip(draws, engines.calls):
        assert [r.seed for r in requests] == [request_seed(5, draw_key(b, d), i) for i in range(NUM_PROMPTS)]


def test_a_producer_failure_reaches_the_trainer():
    def broken(batch):
        raise ValueError("the reward function broke")

    engines = FakeEngines()
    buffer = RolloutBuffer(1, "wait")
    sampling = SamplingParams(n=N, max_new_tokens=4)
    producer = RolloutProducer(engines, sampler(), broken, FakeTokenizer(), sampling, buffer, run_seed=1)
    with producer, pytest.raises(ValueError, match="the reward function broke"):
        producer.next_batch(0)
    assert producer.stopped


def test_close_aborts_a_generation_in_flight():
    engines = FakeEngines(token_s=0.05)
    producer = make_producer(engines, 1, "wait", max_new_tokens=1000)
    with producer:
        time.sleep(0.2)
        start = time.perf_counter()
    assert producer.stopped and time.perf_counter() - start < 5


def test_the_config_names_what_async_mode_needs(tmp_path):
    from megarl.config.loader import load_config
    from megarl.errors import UserError
    from megarl.job import JobConfig

    (tmp_path / "p.jsonl").write_text('{"prompt": "Q"}\n')
    base = [f"model.path={tmp_path}", f"data.train_files=[{tmp_path / 'p.jsonl'}]"]
    split = ["placement.mode=split", "placement.rollout_gpus=1"]
    config = load_config(JobConfig, overrides=[*base, *split, "rl.mode=async", "rl.max_staleness=2"])
    assert config.rl.mode == "async" and config.rl.max_staleness == 2
    with pytest.raises(UserError, match="rl.mode=async .* needs placement.mode=split"):
        load_config(JobConfig, overrides=[*base, "rl.mode=async"])
    with pytest.raises(UserError, match=r"rl.max_staleness=1 needs rl.mode=async"):
        load_config(JobConfig, overrides=[*base, *split, "rl.max_staleness=1"])
    with pytest.warns(UserWarning, match="rl.stale_policy='wait' has no effect with rl.mode=sync"):
        load_config(JobConfig, overrides=[*base, "rl.stale_policy=wait"])


def test_rollout_idle_and_busy_time_add_up_to_the_step():
    """max_staleness=0: the rollout (30 ms a batch) waits while the trainer trains (100 ms a step)."""
    engines = FakeEngines(token_s=0.0075)
    times = []
    with make_producer(engines, 0) as producer:
        producer.take_times()
        for version in range(4):
            start = time.perf_counter()
            producer.next_batch(version)
            time.sleep(0.1)
            producer.sync(lambda new=version + 1: setattr(engines, "version", new))
            times.append((producer.take_times(), time.perf_counter() - start))
    for t, wall in times[1:]:
        assert t["async/rollout_idle_s"] + t["async/rollout_busy_s"] == pytest.approx(wall, abs=0.01)
        assert t["async/rollout_idle_s"] >= 0.09 and 0.02 <= t["async/rollout_busy_s"] < 0.1


class CharTokenizer(FakeTokenizer):
    def encode(self, text, add_special_tokens=False):
        return [60 + ord(c) % 40 for c in text]


def test_agent_episodes_resume_interrupted_turns_and_keep_each_tokens_version():
    import sys
    from pathlib import Path

    from megarl.agents.config import AgentConfig
    from megarl.trainer.rollout_side.rollout_producer import AgentEpisodes

    sys.path.insert(0, str(Path(__file__).parent / "agent_fixtures"))
    from envs import Scripted

    engines = FakeEngines(token_s=0.02)
    config = AgentConfig(env="x", max_turns=3, max_total_tokens=100, observation_template="[{content}]")
    sampling = SamplingParams(n=N, temperature=1.0, max_new_tokens=6)
    producer = RolloutProducer(
        engines, sampler(), score, CharTokenizer(), sampling, RolloutBuffer(1, "wait"), run_seed=5,
        agent=AgentEpisodes(config, lambda: Scripted(turns=1)),
    )  # fmt: skip
    with producer:
        taken = train(producer, engines, 4, train_s=0.1)
    mixed = 0
    for _, t in taken:
        batch = t.item.batch
        assert max(t.staleness) <= 1
        for i in range(len(batch)):
            versions = batch["token_versions"][i][batch["response_mask"][i].bool()].tolist()
            assert len(versions) == 12  # two model turns of 6 tokens, each resumed to its full length
            assert versions == sorted(versions) and versions[0] == batch.meta[OLDEST_VERSION][i]
            observation = batch["token_versions"][i][(batch["attention_mask"][i] - batch["response_mask"][i]).bool()]
            assert (observation[-7:] == -1).all()  # "[obs 1]": tokenized once, sampled by no version
            mixed += versions[0] != versions[-1]
    assert mixed > 0 and sum(t.item.metrics["async/interrupted"] for _, t in taken) > 0
