"""Asynchronous RL against real rollout workers: Ray, the hf engine on a tiny random model, no trainer.

A rollout worker runs calls on threads (WorkerGroup `max_concurrency`), so an abort reaches it while a generate call
runs; the producer's weight syncs interrupt generation and resume it under the new version. The weight "sync" here
opens and closes an update without sending tensors (rollout.hf.strict_weight_sync=false): the version changes, the
weights do not, which is all the producer can see.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.cluster.config import ClusterConfig
from megarl.cluster.ray_runtime import start_ray, stop_ray
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.data.prompts import PromptSample, PromptSampler
from megarl.rollout.config import HFEngineConfig, RolloutConfig, SamplingParams
from megarl.rollout.engine import GenerateRequest
from megarl.trainer.rollout_side.rollout_buffer import OLDEST_VERSION, RolloutBuffer
from megarl.trainer.rollout_side.rollout_producer import EngineGroup, RolloutProducer
from megarl.workers.rollout_worker import RolloutWorker


@pytest.fixture(scope="module")
def rollout(hf_checkpoint):
    start_ray(ClusterConfig(logical_gpus=1, num_cpus=4, object_store_memory_mb=256, log_to_driver=False))
    pool = ResourcePool("rollout", num_nodes=1, gpus_per_node=1)
    group = WorkerGroup(RolloutWorker, pool, "rollout", world_size=1)
    config = RolloutConfig(hf=HFEngineConfig(strict_weight_sync=False, num_threads=1))
    group.call("setup", str(hf_checkpoint("tiny-qwen3")), config)
    yield group
    group.shutdown()
    pool.remove()
    stop_ray()


def test_an_abort_reaches_the_worker_while_it_generates(rollout):
    assert rollout.max_concurrency > 1
    requests = [GenerateRequest([1, 20 + i, 30], seed=i) for i in range(16)]
    sampling = SamplingParams(n=4, max_new_tokens=240, ignore_eos=True)
    call = rollout.async_call("generate", requests, sampling, collect="rank0")
    deadline = time.monotonic() + 60
    while not rollout.call("health", collect="rank0")["generating"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start = time.perf_counter()
    rollout.call("abort")
    completions = [c for group in call.result(timeout_s=60) for c in group]
    assert time.perf_counter() - start < 5
    assert all(c.finish_reason == "abort" and len(c.token_ids) < 240 for c in completions)
    assert rollout.call("weight_version", collect="rank0") == 0


def decoded_a_little(rollout, num_steps: int = 3) -> None:
    """Wait until the engine has run a few decode steps (whatever the machine's speed, the sync that follows lands
    in the middle of a generation)."""
    deadline = time.monotonic() + 60
    start = rollout.call("health", collect="rank0")["num_decode_steps"]
    while rollout.call("health", collect="rank0")["num_decode_steps"] < start + num_steps:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_weight_syncs_interrupt_and_resume_generation_on_the_engine(rollout):
    samples = [PromptSample(i, f"Q{i}", [1, 20 + i, 30], label=None) for i in range(16)]
    sampler = PromptSampler(samples, 4, seed=0)
    sampling = SamplingParams(n=4, max_new_tokens=48, ignore_eos=True)

    class Tokenizer:
        pad_token_id, eos_token_id = 0, None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def score(batch):
        return batch.with_tensors(scores=torch.zeros(len(batch))), {}

    version = rollout.call("weight_version", collect="rank0")
    buffer = RolloutBuffer(1, "wait")
    producer = RolloutProducer(EngineGroup(rollout), sampler, score, Tokenizer(), sampling, buffer, run_seed=1)
    taken, interrupted = [], 0
    with producer:
        for _ in range(4):
            batch = producer.next_batch(version)
            decoded_a_little(rollout)  # the "update": the next batch is being generated meanwhile

            def sync(new=version + 1):
                rollout.call("begin_weight_update", new)
                rollout.call("finish_weight_update", new)

            producer.sync(sync)
            version += 1
            taken.append(batch)
            interrupted += batch.item.metrics["async/interrupted"]
    assert interrupted > 0
    resumed = 0
    for t in taken:
        meta = t.item.batch.meta
        assert max(t.staleness) <= 1
        assert t.item.batch["response_mask"].sum(dim=1).tolist() == [48] * 16  # resumed to full length
        resumed += sum(old < new for old, new in zip(meta[OLDEST_VERSION], meta["weight_version"]))
    assert resumed > 0  # samples that began under one version and finished under the next


def test_an_evaluation_waits_for_the_generate_call_in_flight(rollout):
    """Two generate calls at once (the producer's and an evaluation's) run one after the other on the engine."""
    sampling = SamplingParams(n=2, max_new_tokens=100, ignore_eos=True)
    requests = [GenerateRequest([1, 20 + i, 30], seed=i) for i in range(8)]
    results = {}

    def run(name):
        results[name] = rollout.call("generate", requests, sampling, collect="rank0")

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [c.token_ids for g in results["a"] for c in g] == [c.token_ids for g in results["b"] for c in g]
