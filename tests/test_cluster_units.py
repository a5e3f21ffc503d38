"""Cluster logic that needs no Ray processes: config checks, dispatch/collect modes, bundle ordering, messages.

Multi-node placement is not run here (several raylets on this 2-core machine cost more than the whole suite):
the ordering of bundles by node is tested on made-up placements instead.
"""

from __future__ import annotations

import pytest
import torch

from megarl.cluster.config import ClusterConfig
from megarl.cluster.dispatch import COLLECT_MODES, DISPATCH_MODES, check_parallel_infos
from megarl.cluster.errors import RankFailure, WorkerError, clean_traceback
from megarl.cluster.ray_runtime import check_address_reachable, ip_sort_key, thread_env
from megarl.cluster.resource_pool import local_ranks, order_bundles
from megarl.cluster.worker import ParallelInfo
from megarl.data.batch import Batch
from megarl.errors import UserError


def dp2_tp2() -> list[ParallelInfo]:
    return [ParallelInfo(dp_rank=rank // 2, dp_size=2, is_dp_leader=rank % 2 == 0) for rank in range(4)]


# -- config -----------------------------------------------------------------------------------------------------


def test_config_defaults_pass_and_bad_values_name_the_key():
    ClusterConfig().check("cluster")
    ClusterConfig(address="ray://head:10001").check("cluster")
    ClusterConfig(address="10.0.0.1:6379", num_nodes=4, gpus_per_node=8).check("cluster")
    with pytest.raises(UserError, match=r"cluster.address='head' is not a Ray address; valid: null"):
        ClusterConfig(address="head").check("cluster")
    with pytest.raises(UserError, match=r"cluster.num_nodes=2 needs a Ray cluster"):
        ClusterConfig(num_nodes=2).check("cluster")
    with pytest.raises(UserError, match=r"cluster.cpus_per_worker=0 must be > 0"):
        ClusterConfig(cpus_per_worker=0).check("cluster")
    with pytest.raises(UserError, match=r"cluster.placement='spread' is not known; valid: per_node, pack"):
        ClusterConfig(placement="spread").check("cluster")
    with pytest.warns(UserWarning, match=r"cluster.logical_gpus only apply to a local Ray instance"):
        ClusterConfig(address="auto", logical_gpus=4).check("cluster")
    timeouts = ClusterConfig(call_timeout_s=None, failure_grace_s=3).timeouts()
    assert (timeouts.call_s, timeouts.failure_grace_s) == (None, 3)


def test_config_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = "import sys, megarl.cluster.config; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unreachable_address_fails_fast_with_a_user_error():
    with pytest.raises(UserError, match=r"cluster.address='127.0.0.1:1': nothing answers at 127.0.0.1:1"):
        check_address_reachable("127.0.0.1:1", timeout_s=2)
    with pytest.raises(UserError, match=r"ray://127.0.0.1:1"):
        check_address_reachable("ray://127.0.0.1:1", timeout_s=2)


def test_thread_env_caps_threads_at_the_cpu_share():
    assert thread_env(4)["OMP_NUM_THREADS"] == "4"
    assert thread_env(0.5)["MKL_NUM_THREADS"] == "1"


# -- bundle ordering ----------------------------------------------------------------------------------------------


def test_bundles_are_ordered_by_node_ip_so_a_node_holds_consecutive_ranks():
    ips = {"n-a": "10.0.0.10", "n-b": "10.0.0.9", "n-c": "10.0.1.1"}
    # one PACK group whose bundles Ray spread over three nodes in no particular order
    placements = [(0, 0, "n-a"), (0, 1, "n-c"), (0, 2, "n-b"), (0, 3, "n-a"), (0, 4, "n-b"), (0, 5, "n-c")]
    order = order_bundles(placements, ips)
    assert order == [(0, 2), (0, 4), (0, 0), (0, 3), (0, 1), (0, 5)]  # 10.0.0.9 < 10.0.0.10 < 10.0.1.1
    # per-node groups: group 0 landed on the higher IP, so group 1 comes first
    placements = [(0, 0, "n-a"), (0, 1, "n-a"), (1, 0, "n-b"), (1, 1, "n-b")]
    assert order_bundles(placements, ips) == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert local_ranks(["x", "x", "y", "y", "y"]) == [0, 1, 0, 1, 2]
    assert ip_sort_key("10.0.0.9") < ip_sort_key("10.0.0.10") < ip_sort_key("hostname")


# -- dispatch and collect -----------------------------------------------------------------------------------------


def test_dp_split_sends_each_part_to_every_rank_of_its_dp_rank_and_collects_from_leaders():
    batch = Batch({"x": torch.arange(5)})
    rank_args = DISPATCH_MODES["dp_split"]((batch, "shared"), {"k": 1}, 4, dp2_tp2(), lambda value: value)
    parts = [args[0]["x"].tolist() for args, _ in rank_args]
    assert parts == [[0, 1], [0, 1], [2, 3, 4], [2, 3, 4]]
    assert all(args[1:] == ("shared",) and kwargs == {"k": 1} for args, kwargs in rank_args)

    collect = COLLECT_MODES["dp_leaders"]
    assert collect.keep(4, dp2_tp2()) == [True, False, True, False]
    results = [Batch({"x": torch.tensor([0, 1])}), None, Batch({"x": torch.tensor([2, 3, 4])}), None]
    assert collect.combine(results, dp2_tp2())["x"].tolist() == [0, 1, 2, 3, 4]
    assert collect.combine(["a", None, "b", None], dp2_tp2()) == ["a", "b"]  # no concat: a list


def test_per_rank_needs_one_item_per_rank():
    rank_args = DISPATCH_MODES["per_rank"](([1, 2],), {"name": ["a", "b"]}, 2, None, lambda value: value)
    assert rank_args == [((1,), {"name": "a"}), ((2,), {"name": "b"})]
    with pytest.raises(ValueError, match=r"list of 2 items \(one per rank\); argument 'name' is 3"):
        DISPATCH_MODES["per_rank"](([1, 2],), {"name": ["a", "b", "c"]}, 2, None, lambda value: value)
    with pytest.raises(TypeError, match=r"needs a split\(num_parts\) method"):
        DISPATCH_MODES["dp_split"]((3,), {}, 4, dp2_tp2(), lambda value: value)


def test_inconsistent_parallel_info_is_refused():
    check_parallel_infos("actor", dp2_tp2())
    two_leaders = [ParallelInfo(rank // 2, 2, True) for rank in range(4)]
    with pytest.raises(RuntimeError, match=r"actor: .* dp_rank 0 has ranks \[0, 1\] with leaders \[0, 1\]"):
        check_parallel_infos("actor", two_leaders)


def test_worker_error_message_names_role_ranks_and_tracebacks():
    ansi = '\x1b[36mray::ToyWorker.step()\x1b[39m (pid=1)\n           ^^^^^^^^\n  File "w.py", line 3\nValueError: x'
    assert clean_traceback(ansi) == 'ray::ToyWorker.step() (pid=1)\n  File "w.py", line 3\nValueError: x'
    failures = {
        2: RankFailure(2, "no answer", ""),
        1: RankFailure(1, "raised", 'File "w.py", line 3\nValueError: x'),
        3: RankFailure(3, "died", "worker process died"),
    }
    message = str(WorkerError("critic", "call 'update'", failures, "First failure: rank 1."))
    assert message.splitlines()[0] == (
        "critic call 'update' failed: rank 1 raised, rank 3 died, rank 2 no answer. First failure: rank 1."
    )
    assert '--- critic rank 1 (raised) ---\nFile "w.py", line 3\nValueError: x' in message
    assert "--- critic rank 3 (died) ---" in message and "rank 2 (no answer) ---" not in message


def test_train_refuses_a_node_count_the_slurm_job_did_not_start():
    """tools/slurm/megarl.sbatch exports MEGARL_RAY_NODES (one Ray node per task): a config asking for another
    number of nodes is refused before any worker starts, naming both numbers and both fixes."""
    from megarl.cluster.config import ClusterConfig
    from megarl.trainer.lifecycle.preflight import check_ray_nodes

    cluster = ClusterConfig(address="auto", num_nodes=16, gpus_per_node=8)
    check_ray_nodes(cluster, {"MEGARL_RAY_NODES": "16"})
    check_ray_nodes(cluster, {})  # not inside the template: nothing to compare with
    check_ray_nodes(ClusterConfig(), {"MEGARL_RAY_NODES": "2"})  # a local Ray instance is its own cluster
    with pytest.raises(UserError) as error:
        check_ray_nodes(cluster, {"MEGARL_RAY_NODES": "2"})
    assert str(error.value) == (
        "cluster.num_nodes=16 but this Slurm job started 2 Ray node(s) (one per task, MEGARL_RAY_NODES=2); submit "
        "with sbatch --nodes=16 (one task per node) or set cluster.num_nodes=2"
    )
