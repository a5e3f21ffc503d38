"""Megatron role groups on Ray placement: colocated and split placement give the same numbers; a role that fails
at start-up fails the call with its traceback, role and rank; offloading between phases changes nothing."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import PolicyLossConfig
from megarl.algorithms.losses import PolicyLoss
from megarl.cluster.config import ClusterConfig
from megarl.cluster.errors import WorkerError
from megarl.cluster.ray_runtime import start_ray, stop_ray
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.data.collate import make_rl_batch
from megarl.runtime.parallel import ParallelConfig
from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings
from megarl.workers.megatron_worker import MegatronWorker

PROMPTS = [[1, 17, 25, 33, 9], [1, 40, 41], [1, 8, 77, 12], [1, 2, 3]]
RESPONSES = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


@pytest.fixture(scope="module")
def ray_local():
    start_ray(ClusterConfig(logical_gpus=4, num_cpus=8, object_store_memory_mb=256, log_to_driver=False))
    yield
    stop_ray()


def setup(group: WorkerGroup, folder, trainable: bool) -> None:
    settings = ModelSettings(path=str(folder), dtype="float32", parallel=ParallelConfig(tp=2))
    optim = OptimizerSettings(lr=1e-3, eps=1e-6) if trainable else None
    group.call("setup", settings, MicroBatchSettings(max_tokens=64), "lm", optim, 10)


def logprobs(group: WorkerGroup):
    batch = make_rl_batch(PROMPTS, RESPONSES, pad_id=0)
    return group.call("compute_logprobs", batch, dispatch="dp_split", collect="dp_leaders")["logprobs"]


def test_colocated_and_split_placement_give_the_same_numbers(ray_local, hf_checkpoint):
    folder = hf_checkpoint("tiny-qwen3")
    shared = ResourcePool("shared", num_nodes=1, gpus_per_node=2)
    actor = WorkerGroup(MegatronWorker, shared, "actor", num_gpus_per_worker=0.5)
    ref = WorkerGroup(MegatronWorker, shared, "ref", num_gpus_per_worker=0.5)
    try:
        setup(actor, folder, trainable=True), setup(ref, folder, trainable=False)
        assert [w.gpu_ids for w in actor.worker_info] == [w.gpu_ids for w in ref.worker_info]  # the same GPUs
        colocated = (logprobs(actor), logprobs(ref))
    finally:
        actor.shutdown(), ref.shutdown(), shared.remove()
    pools = [ResourcePool(name, num_nodes=1, gpus_per_node=2) for name in ("actor", "ref")]
    actor = WorkerGroup(MegatronWorker, pools[0], "actor")
    ref = WorkerGroup(MegatronWorker, pools[1], "ref")
    try:
        setup(actor, folder, trainable=True), setup(ref, folder, trainable=False)
        actor_gpus = {gpu for w in actor.worker_info for gpu in w.gpu_ids}
        assert not actor_gpus & {gpu for w in ref.worker_info for gpu in w.gpu_ids}
        split = (logprobs(actor), logprobs(ref))
    finally:
        actor.shutdown(), ref.shutdown()
        for pool in pools:
            pool.remove()
    assert torch.equal(colocated[0], split[0]) and torch.equal(colocated[1], split[1])


def test_offload_between_phases_leaves_training_unchanged(ray_local, hf_checkpoint):
    folder = hf_checkpoint("tiny-qwen3")
    pool = ResourcePool("offload", num_nodes=1, gpus_per_node=2)
    batch = make_rl_batch(PROMPTS, RESPONSES, pad_id=0)
    mask = batch["response_mask"]
    batch = batch.with_tensors(
        advantages=mask.float(),
        old_logprobs=torch.full(mask.shape, -7.0),
        loss_weights=loss_weights("token-mean", mask),
    )
    results = []
    try:
        for offload in (False, True):
            actor = WorkerGroup(MegatronWorker, pool, "actor")
            setup(actor, folder, trainable=True)
            for _ in range(2):
                if offload:  # as a colocated trainer does around rollout
                    actor.call("offload"), actor.call("onload")
                actor.call("update_policy", batch, PolicyLoss(PolicyLossConfig(clip_high=100.0)), dispatch="dp_split")
            results.append(logprobs(actor))
            actor.shutdown()
    finally:
        pool.remove()
    assert torch.equal(results[0], results[1])


def test_a_role_that_fails_at_setup_reports_role_rank_and_traceback(ray_local, tmp_path):
    pool = ResourcePool("broken", num_nodes=1, gpus_per_node=2)
    group = WorkerGroup(MegatronWorker, pool, "critic")
    try:
        settings = ModelSettings(path=str(tmp_path / "missing"), dtype="float32", parallel=ParallelConfig(tp=2))
        with pytest.raises(WorkerError) as info:
            group.call("setup", settings, MicroBatchSettings(), "value", None, 1, timeout_s=120)
        text = str(info.value)
        assert "critic call 'setup' failed" in text and "rank 0" in text and "missing" in text
        assert 'File "' in text  # the worker's own traceback
        assert not group.healthy
    finally:
        group.shutdown(), pool.remove()
