"""Worker groups on a real local Ray instance with 8 logical GPUs (no GPU needed): placement, the gloo world,
dispatch/collect modes, colocation and failures.

Starting Ray and worker processes is slow on this machine (each worker imports torch and Megatron-Core), so one
group of four workers serves every test that does not break its group; failure tests use groups of one or two.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from megarl.cluster import (
    ClusterConfig,
    GroupTimeouts,
    ResourcePool,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    start_groups,
    start_ray,
    stop_ray,
)
from megarl.data.batch import Batch
from megarl.errors import UserError
from megarl.testing.cluster_workers import DataTensorToyWorker, ToyWorker

GRACE_S = 2.0
FAST = GroupTimeouts(init_s=120.0, call_s=60.0, failure_grace_s=GRACE_S)
# How much longer than the grace period a failing call may take here: Ray's own bookkeeping on a loaded 2-core box.
SLACK_S = 40.0


@pytest.fixture(scope="module")
def ray_info():
    config = ClusterConfig(logical_gpus=8, num_cpus=16, object_store_memory_mb=256, log_to_driver=False)
    config.check("cluster")
    info = start_ray(config)
    yield info
    stop_ray()


@pytest.fixture(scope="module")
def pool4(ray_info):
    pool = ResourcePool("actor", num_nodes=1, gpus_per_node=4)
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def actor(pool4):
    """Four workers in a DP=2 x "TP"=2 layout, taking half of each GPU of the pool (the other half: colocation)."""
    with WorkerGroup(DataTensorToyWorker, pool4, "actor", num_gpus_per_worker=0.5, timeouts=FAST) as group:
        yield group


@pytest.fixture(scope="module")
def fault_pool(ray_info):
    pool = ResourcePool("faults", num_nodes=1, gpus_per_node=2)
    yield pool
    pool.remove()


def bundle_gpu_free(pool: ResourcePool) -> list[float]:
    """Unused GPU share of each bundle of the pool, from Ray's per-bundle resources (GPU_group_<i>_<pg id>)."""
    free = ray.available_resources()
    placement_group = pool.placement_groups[0]
    return [free.get(f"GPU_group_{i}_{placement_group.id.hex()}", 0.0) for i in range(pool.world_size)]


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Ray's view of free resources lags behind what happened by up to a second or so."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_group_forms_a_gloo_world_on_its_bundles_in_order(ray_info, pool4, actor):
    assert ray_info.started_locally and ray_info.num_gpus == 8
    assert actor.call("all_reduce_sum", 1.5) == [6.0] * 4
    places = actor.call("placement")
    assert [p["dist_rank"] for p in places] == [0, 1, 2, 3] and {p["dist_world_size"] for p in places} == {4}
    assert [p["env"]["LOCAL_RANK"] for p in places] == ["0", "1", "2", "3"]
    assert {p["env"]["MASTER_PORT"] for p in places} == {places[0]["env"]["MASTER_PORT"]}
    assert {p["placement_group_id"] for p in places} == {pool4.placement_groups[0].id.hex()}
    # Ray gave each worker one GPU of its own, and CUDA_VISIBLE_DEVICES says so
    gpu_ids = [p["gpu_ids"] for p in places]
    assert all(len(ids) == 1 for ids in gpu_ids) and len({ids[0] for ids in gpu_ids}) == 4
    assert [p["cuda_visible_devices"] for p in places] == [ids[0] for ids in gpu_ids]
    assert [info.gpu_ids for info in actor.worker_info] == gpu_ids
    assert {info.backend for info in actor.worker_info} == {"gloo"}
    assert places[0]["env"]["OMP_NUM_THREADS"] == "1"
    # one worker per bundle: each bundle has half of its GPU taken (by this group alone, at this point)
    assert wait_for(lambda: bundle_gpu_free(pool4) == [0.5] * 4)
    # handles for direct worker-to-worker (or driver-to-worker) calls
    assert ray.get(actor.workers[3].ping.remote()) == 3


def test_dispatch_and_collect_modes(actor):
    batch = Batch({"x": torch.arange(6)}, {"id": list("abcdef")})
    merged = actor.call("tag_batch", batch, dispatch="dp_split", collect="dp_leaders")
    assert isinstance(merged, Batch) and merged.meta["id"] == list("abcdef")
    assert merged["x2"].tolist() == [0, 2, 4, 6, 8, 10]
    assert merged["by_rank"].tolist() == [0, 0, 0, 2, 2, 2]  # the DP leaders: ranks 0 and 2
    assert merged["by_dp_rank"].tolist() == [0, 0, 0, 1, 1, 1]
    # every "TP" peer received its DP rank's part; non-leaders send nothing back under dp_leaders
    everyone = actor.call("tag_batch", batch, dispatch="dp_split")
    assert [part["x"].tolist() for part in everyone] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert actor.call("echo", 1, collect="dp_leaders") == [
        {"rank": 0, "tag": "", "args": (1,), "kwargs": {}},
        {"rank": 2, "tag": "", "args": (1,), "kwargs": {}},
    ]

    echoes = actor.call("echo", [10, 11, 12, 13], key=list("wxyz"), dispatch="per_rank")
    assert [(e["args"], e["kwargs"]) for e in echoes] == [((10 + r,), {"key": "wxyz"[r]}) for r in range(4)]
    assert actor.call("echo", "hi", collect="rank0") == {"rank": 0, "tag": "", "args": ("hi",), "kwargs": {}}
    assert [e["args"] for e in actor.call("echo", "same", n=2)] == [("same",)] * 4
    # keywords named like the worker-side dispatcher's own parameters reach the method untouched
    assert actor.call("echo", method="m", keep_result=0, collect="rank0")["kwargs"] == {"method": "m", "keep_result": 0}

    pending = actor.async_call("sleep", 0.2)
    assert len(pending.refs) == 4
    assert pending.result() == [0, 1, 2, 3] and pending.done()

    with pytest.raises(ValueError, match=r"dispatch='scatter' is not known; valid: broadcast, dp_split, per_rank"):
        actor.call("echo", dispatch="scatter")
    with pytest.raises(AttributeError, match=r"actor: DataTensorToyWorker has no method 'missing'"):
        actor.call("missing")
    assert actor.healthy


def test_colocated_groups_share_the_gpus_of_a_pool(pool4, actor):
    with WorkerGroup(ToyWorker, pool4, "ref", world_size=2, num_gpus_per_worker=0.5, timeouts=FAST) as ref:
        assert ref.call("all_reduce_sum", 2.0) == [4.0, 4.0]
        assert actor.call("all_reduce_sum", 1.0) == [4.0] * 4  # both worlds work side by side
        assert [info.gpu_ids for info in ref.worker_info] == [info.gpu_ids for info in actor.worker_info[:2]]
        assert wait_for(lambda: bundle_gpu_free(pool4) == [0.0, 0.0, 0.5, 0.5])  # ref took the first two bundles
        with pytest.raises(UserError, match=r"role critic asks for 0.6 GPU .* already held by role actor \(0.5 GPU"):
            WorkerGroup(ToyWorker, pool4, "critic", num_gpus_per_worker=0.6, timeouts=FAST)
    assert wait_for(lambda: bundle_gpu_free(pool4) == [0.5] * 4)  # the ref group's share is free again


def test_pool_larger_than_the_cluster_fails_at_once(ray_info):
    start = time.monotonic()
    with pytest.raises(UserError, match=r"resource pool 'rollout' asks for 16 GPUs \(2 nodes x 8, .*the cluster has 8"):
        ResourcePool("rollout", num_nodes=2, gpus_per_node=8)
    with pytest.raises(UserError, match=r"asks for 4 GPUs .* 8 CPUs per GPU.* the cluster has 8 GPUs and 16 CPUs"):
        ResourcePool("rollout", num_nodes=1, gpus_per_node=4, cpus_per_bundle=8)
    assert time.monotonic() - start < 5


def test_pool_that_does_not_fit_now_gives_up_after_its_timeout(pool4, fault_pool):
    with pytest.raises(UserError, match=r"could not be placed within 1 s: 2 GPUs .* are free now"):
        ResourcePool("critic", num_nodes=1, gpus_per_node=3, timeout_s=1)
    ResourcePool("critic", num_nodes=1, gpus_per_node=2, strategy="pack", timeout_s=30).remove()  # nothing leaked


def test_worker_raising_in_init_names_role_rank_and_traceback(fault_pool):
    init = {"fail_in_init_on_rank": 1}
    with pytest.raises(WorkerError, match=r"reward start-up \(__init__\) failed: rank 1 raised") as caught:
        WorkerGroup(ToyWorker, fault_pool, "reward", init_kwargs=init, timeouts=FAST)
    message = str(caught.value)
    assert "--- reward rank 1 (raised) ---" in message
    assert "cluster_workers.py" in message and "RuntimeError: toy worker reward rank 1 refuses to start" in message
    assert caught.value.ranks == [1]


def test_groups_started_side_by_side_each_form_their_world_or_all_stop(fault_pool):
    """start_groups (how the trainer starts its roles): every group's workers start together; a group that fails
    to start takes the others down with it and frees the pool."""
    ref, critic = (WorkerGroup(ToyWorker, fault_pool, role, num_gpus_per_worker=0.5, start=False) for role in "ab")
    start_groups([ref, critic])
    assert ref.healthy and critic.healthy
    assert ref.call("all_reduce_sum", 1.0) == critic.call("all_reduce_sum", 1.0) == [2.0, 2.0]
    ref.shutdown()
    critic.shutdown()
    good = WorkerGroup(ToyWorker, fault_pool, "ref", num_gpus_per_worker=0.5, start=False, timeouts=FAST)
    init = {"fail_in_init_on_rank": 0}
    bad = WorkerGroup(ToyWorker, fault_pool, "critic", num_gpus_per_worker=0.5, init_kwargs=init, start=False)
    with pytest.raises(WorkerError, match=r"critic start-up \(__init__\) failed: rank 0 raised"):
        start_groups([good, bad])
    assert not good.healthy and not bad.healthy
    assert wait_for(lambda: bundle_gpu_free(fault_pool) == [1.0, 1.0])  # both shares are free again


def test_rank_raising_while_others_wait_in_a_collective_ends_within_the_grace(fault_pool):
    group = WorkerGroup(ToyWorker, fault_pool, "critic", timeouts=FAST)
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.call("raise_on_rank", 1)
    elapsed = time.monotonic() - start
    assert elapsed < GRACE_S + SLACK_S
    message = str(caught.value)
    assert message.startswith("critic call 'raise_on_rank' failed:")
    assert caught.value.failures[1].kind == "raised"
    assert "ValueError: toy failure on rank 1" in message and "in raise_on_rank" in message
    assert caught.value.ranks == [0, 1]  # rank 0 either gave up on gloo or was still waiting after the grace
    assert not group.healthy and group.workers == []
    with pytest.raises(WorkerError, match=r"critic call 'ping' failed. The group is down"):
        group.call("ping")


def test_killed_worker_is_detected_and_named(fault_pool):
    group = WorkerGroup(ToyWorker, fault_pool, "rollout", world_size=1, timeouts=FAST)  # one: workers are slow to start
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.call("exit_on_rank", 0)
    assert time.monotonic() - start < GRACE_S + SLACK_S
    assert caught.value.failures[0].kind == "died"
    assert "rollout rank 0 (died)" in str(caught.value)
    assert not group.healthy


def test_call_timeout_names_the_silent_ranks_and_restart_recovers(fault_pool):
    group = WorkerGroup(ToyWorker, fault_pool, "ref", world_size=1, timeouts=FAST)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"ref call 'sleep' failed: rank 0 no answer. No answer within 1 s"):
        group.call("sleep", 60, timeout_s=1)
    assert time.monotonic() - start < 1 + SLACK_S
    assert not group.healthy
    group.restart()  # the driver goes on: a fresh process, a fresh world
    assert group.healthy and group.call("all_reduce_sum", 2.5) == [2.5]
    group.shutdown()
