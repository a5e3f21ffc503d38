"""Placement over several nodes, simulated by several raylets on this machine (`ray.cluster_utils.Cluster`).

The raylets share one IP, so bundles are ordered by node id here (by IP first on a real cluster, which
tests/test_cluster_units.py checks on made-up placements).
"""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from megarl.cluster import GroupTimeouts, ResourcePool, WorkerGroup
from megarl.errors import UserError
from megarl.testing.cluster_workers import ToyWorker


@pytest.fixture(scope="module")
def two_gpu_nodes():
    """A head without GPUs (where the driver's own tasks go) and two nodes of 2 logical GPUs and 4 CPUs each."""
    assert not ray.is_initialized(), "another test module left Ray running"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=4, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_per_node_pool_keeps_each_nodes_bundles_together(two_gpu_nodes):
    with ResourcePool("actor", num_nodes=2, gpus_per_node=2) as pool:
        assert len(pool.placement_groups) == 2 and pool.world_size == 4
        assert pool.node_ids[0] == pool.node_ids[1] != pool.node_ids[2] == pool.node_ids[3]
        assert pool.local_ranks == [0, 1, 0, 1]


@pytest.mark.slow  # about 10 s: two more worker processes
def test_group_spans_nodes_in_one_world(two_gpu_nodes):
    # whole nodes, one worker on each (bundles 0 and 2): two 1-GPU placement groups could share a 2-GPU node
    with ResourcePool("critic", num_nodes=2, gpus_per_node=2) as pool:
        timeouts = GroupTimeouts(init_s=120, failure_grace_s=2)
        with WorkerGroup(ToyWorker, pool, "critic", timeouts=timeouts, bundle_stride=2) as group:
            assert group.call("all_reduce_sum", 1.0) == [2.0, 2.0]  # one gloo world over both nodes
            places = group.call("placement")
            assert [p["env"]["LOCAL_RANK"] for p in places] == ["0", "0"]
            assert [p["env"]["LOCAL_WORLD_SIZE"] for p in places] == ["1", "1"]
            assert [info.local_rank for info in group.worker_info] == [0, 0]


def test_pack_pool_spreads_as_needed_and_orders_bundles_by_node(two_gpu_nodes):
    with ResourcePool("rollout", num_nodes=1, gpus_per_node=4, strategy="pack") as pool:
        assert len(pool.placement_groups) == 1
        assert pool.node_ids[0] == pool.node_ids[1] != pool.node_ids[2] == pool.node_ids[3]
        assert pool.local_ranks == [0, 1, 0, 1]


def test_per_node_pool_needs_a_node_big_enough(two_gpu_nodes):
    with pytest.raises(UserError, match=r"per_node placement needs 1 node\(s\) each holding 3 GPUs .* room for 0"):
        ResourcePool("ref", num_nodes=1, gpus_per_node=3)
