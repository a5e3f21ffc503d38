"""Rollout engines across nodes on a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`, logical GPUs).

One engine of 4 GPUs over two nodes of 2: the worker on its first node starts node-rank 0 and an EngineNode actor on
the other node starts node-rank 1, each on its own node's GPUs, meeting at the first node's address. SGLang cannot
run here (CUDA only): `rollout.sglang.python` points at tests/scripts/fake_sglang_server.py, which records the
command it was given (checked by SGLang's own parser) and answers health on node-rank 0. A node's SGLang process
exiting, or the node itself leaving the cluster, stops the engine with an error naming the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from megarl.cluster import GroupTimeouts, ResourcePool, WorkerGroup
from megarl.cluster.errors import WorkerError
from megarl.rollout.config import RolloutConfig, SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest
from megarl.trainer.lifecycle.roles import assign_engine_gpus
from megarl.workers.engine_nodes import NOSET_CUDA_VISIBLE_DEVICES, EngineNodeSlot
from megarl.workers.rollout_worker import RolloutWorker

FAKE_SERVER = Path(__file__).parent / "scripts" / "fake_sglang_server.py"
FAST = GroupTimeouts(init_s=120.0, call_s=60.0, failure_grace_s=2.0)

pytestmark = pytest.mark.slow  # about 30 s: a three-raylet cluster and its workers


KEEP_CHILDREN = {
    "kill_child_processes_on_worker_exit": False,
    "kill_child_processes_on_worker_exit_with_raylet_subreaper": False,
}
"""Ray's settings that stop it from killing what a dead worker started (on by default: Ray kills a worker's
processes with it; off, or for a process that escapes it, only megarl's reaping stops them)."""


@pytest.fixture()
def cluster(request):
    """A head without GPUs and two nodes of 2 logical GPUs each; removed after each test (one test removes a node).
    Parametrized indirectly with KEEP_CHILDREN: Ray leaves a dead worker's processes running."""
    assert not ray.is_initialized(), "another test module left Ray running"
    head = {"num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
    if getattr(request, "param", None):
        head["_system_config"] = request.param
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=4, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def start_engine(tmp_path, hf_checkpoint, port: int, startup_timeout_s: float = 60, **fake_env: str):
    """One 4-GPU engine over both nodes, as start_roles places it; returns (group, records folder, pool, setup):
    `setup(**extra)` sets the engine up again the same way (`extra`: more of setup's keywords), `setup.first` is
    what the first setup answered."""
    records = tmp_path / "records"
    records.mkdir()
    pool = ResourcePool("rollout", num_nodes=2, gpus_per_node=2)
    (engine,) = assign_engine_gpus(pool.bundle_gpu_ids(), 4)
    assert [first for first, _ in engine] == [0, 2]
    slots = [EngineNodeSlot(1, *pool.bundles[engine[1][0]], tuple(engine[1][1]))]
    env = {NOSET_CUDA_VISIBLE_DEVICES: "1", "MEGARL_FAKE_SGLANG_DIR": str(records), **fake_env}
    group = WorkerGroup(RolloutWorker, pool, "rollout", world_size=1, bundle_stride=4, env=env, timeouts=FAST)
    sglang = SGLangEngineConfig(tp=4, python=str(FAKE_SERVER), port=port, startup_timeout_s=startup_timeout_s)
    config = RolloutConfig(backend="sglang", gpus_per_engine=4, sglang=sglang)
    config.check("rollout")
    path = str(hf_checkpoint("tiny-llama"))

    def setup(**extra):
        more = {key: [value] for key, value in extra.items()}  # one engine: rank 0's arguments
        return group.call("setup", [path], [config], gpu_ids=[engine[0][1]], nodes=[slots], dispatch="per_rank", **more)

    setup.first = setup()[0]
    return group, records, pool, setup


def wait_for(path: Path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.2)
    return json.loads(path.read_text())


def test_an_engine_over_two_nodes_starts_one_process_per_node_and_stops_when_one_exits(
    cluster, tmp_path, hf_checkpoint
):
    group, records, pool, _ = start_engine(tmp_path, hf_checkpoint, port=31200)
    try:
        node0, node1 = wait_for(records / "node0.json"), wait_for(records / "node1.json")
        host = ray.util.get_node_ip_address()
        for rank, record in enumerate((node0, node1)):
            argv = record["argv"]
            value = {flag: argv[argv.index(flag) + 1] for flag in ("--nnodes", "--node-rank", "--dist-init-addr")}
            assert value == {"--nnodes": "2", "--node-rank": str(rank), "--dist-init-addr": f"{host}:31300"}
            assert argv[argv.index("--tp-size") + 1] == "4" and argv[argv.index("--port") + 1] == "31200"
            assert record["cuda_visible_devices"] == "0,1"  # each node's own two GPUs
        _parsed_by_sglang(node1["argv"])
        assert group.call("health", collect="rank0")["ok"]

        os.kill(node1["pid"], signal.SIGKILL)  # node-rank 1's SGLang dies
        time.sleep(0.5)
        health = group.call("health", collect="rank0")
        assert (
            not health["ok"] and "rollout engine 0: node-rank 1 of the engine stopped: SGLang server" in health["error"]
        )
        assert "was killed by signal 9" in health["error"]
        with pytest.raises(WorkerError, match=r"node-rank 1 of the engine stopped"):
            group.call("generate", [GenerateRequest([1, 2])], SamplingParams(max_new_tokens=1))
    finally:
        stop(group, records, pool)


def test_a_node_leaving_the_cluster_is_named(cluster, tmp_path, hf_checkpoint):
    ray_cluster, nodes = cluster
    group, records, pool, _ = start_engine(tmp_path, hf_checkpoint, port=31400)
    try:
        wait_for(records / "node1.json")
        second = next(node for node in nodes if node.node_id == pool.node_ids[2])
        ray_cluster.remove_node(second)
        health = group.call("health", collect="rank0")
        assert not health["ok"] and "node-rank 1 of the engine stopped: its Ray actor is unreachable" in health["error"]
    finally:
        stop(group, records, pool)


@pytest.mark.parametrize("cluster", [KEEP_CHILDREN], indirect=True, ids=["ray keeps a dead worker's processes"])
def test_an_engine_started_again_reaps_what_it_left_on_every_node(cluster, tmp_path, hf_checkpoint):
    """The fleet starts a failed engine again on the same bundles (engine_fleet.py): SIGKILL of its worker, whose
    EngineNode actor dies with it. Ray kills what they started by default; where it does not (KEEP_CHILDREN), the
    SGLang processes of both nodes (sessions of their own) live on, holding the GPUs and the port. The new worker
    reaps those of its first node, its node actor those of the other node, before their servers start."""
    group, records, pool, setup = start_engine(tmp_path, hf_checkpoint, port=31800)
    try:
        old = [wait_for(records / f"node{rank}.json")["pid"] for rank in (0, 1)]
        assert setup.first["process_groups"] == [old[0]] and setup.first["node_process_groups"] == [[old[1]]]
        group.relaunch_rank(0)  # as the fleet does with a failed engine
        time.sleep(1.0)
        assert [_alive(pid) for pid in old] == [True, True]  # what a restart must not leave behind
        for rank in (0, 1):
            (records / f"node{rank}.json").unlink()
        (again,) = setup(reap=setup.first["process_groups"], reap_nodes=setup.first["node_process_groups"])
        new = [wait_for(records / f"node{rank}.json")["pid"] for rank in (0, 1)]
        assert [_alive(pid) for pid in old] == [False, False] and [_alive(pid) for pid in new] == [True, True]
        assert again["node_process_groups"] == [[new[1]]]
        assert group.call("health", collect="rank0")["ok"]
    finally:
        stop(group, records, pool)


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan killed here may wait a while for its reaper)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_node_failing_at_start_up_is_named_at_once(cluster, tmp_path, hf_checkpoint):
    """Node-rank 1's SGLang exits while node 0 waits for its engine to become healthy: the start fails naming the
    node and its log, long before the start-up timeout (600 s here, an hour in the 671B config) and before node 0's
    engine would be healthy (300 s)."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        start_engine(
            tmp_path,
            hf_checkpoint,
            port=31600,
            startup_timeout_s=600,
            MEGARL_FAKE_SGLANG_FAIL_RANK="1",
            MEGARL_FAKE_SGLANG_READY_AFTER_S="300",
        )
    message = str(info.value)
    assert "node-rank 1 of the engine stopped: SGLang server node-rank 1" in message and "exited with code 3" in message
    assert "NCCL error: unhandled system error" in message  # the node's log tail
    assert time.monotonic() - start < 150  # not the time-out: Ray's start alone takes seconds on a loaded machine
    for record in (tmp_path / "records").glob("node*.json"):  # the setup failed: nothing is left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)


def stop(group, records: Path, pool) -> None:
    """Stop the engine; after a failed call the group is down, so its processes are stopped by pid."""
    try:
        group.call("shutdown_engine")
    except WorkerError:
        for record in records.glob("node*.json"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
    group.shutdown()
    pool.remove()


def _parsed_by_sglang(argv: list[str]) -> None:
    import sglang_contract

    if not sglang_contract.installed():
        return
    from test_sglang_contract import parse_server_args

    parsed, _ = parse_server_args(argv)
    assert (parsed.nnodes, parsed.node_rank, parsed.tp_size) == (2, 1, 4)
