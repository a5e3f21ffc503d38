"""Rollout engines of several GPUs: which GPUs each engine gets, where its worker sits, and what reaches the engine.

The assignment (`assign_engine_gpus`) and the device numbering (`visible_device_index`) are pure and checked by
hand. Placement runs on a real local Ray instance with 4 logical GPUs (no GPU needed): Ray assigns logical GPU ids
and sets CUDA_VISIBLE_DEVICES exactly as on a GPU node. SGLang cannot run here (CUDA only), so the engine is
followed up to its server launch: `SGLangServer.start` is replaced in-process by a no-op and the test reads the
command and environment the server would have been started with; for the same reason the driver's wiring
(`start_roles`) is checked with recording stand-ins for the worker groups and the pool.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from megarl.cluster import ClusterConfig, GroupTimeouts, ResourcePool, WorkerGroup, start_ray, stop_ray
from megarl.cluster.resource_pool import BundleGPUs
from megarl.errors import UserError
from megarl.rollout.config import RolloutConfig, SGLangEngineConfig
from megarl.rollout.sglang_engine import SGLangEngine, visible_device_index
from megarl.rollout.sglang_server import SGLangServer
from megarl.rollout.sglang_weights import send_flattened_bucket
from megarl.runtime import cpu_compat
from megarl.testing.cluster_workers import ToyWorker
from megarl.trainer.lifecycle.roles import NOSET_CUDA_VISIBLE_DEVICES, assign_engine_gpus
from megarl.workers.rollout_worker import RolloutWorker, build_engine

FAST = GroupTimeouts(init_s=120.0, call_s=60.0, failure_grace_s=2.0)


@pytest.fixture(autouse=True)
def real_cuda_devices():
    """An earlier in-process Megatron test may have left the CPU-compat mode on (it maps `torch.device("cuda", i)`
    to the CPU for the life of the process); these tests compare CUDA devices as a rollout worker sees them."""
    with cpu_compat.paused():
        yield


def two_nodes(gpus_per_node: int) -> list[BundleGPUs]:
    """Bundles of a pool over nodes a and b, each numbering its own GPUs from 0 (rank order: node a first)."""
    return [BundleGPUs(node, (str(i),)) for node in "ab" for i in range(gpus_per_node)]


# ---- which GPUs each engine gets (pure) ----------------------------------------------------------------------------


def gpus(engines):
    """Per engine, its GPU ids on each of its nodes."""
    return [[ids for _, ids in nodes] for nodes in engines]


def test_engines_take_consecutive_bundles_of_one_node():
    bundles = two_nodes(4)
    assert gpus(assign_engine_gpus(bundles, 2)) == [[["0", "1"]], [["2", "3"]], [["0", "1"]], [["2", "3"]]]
    assert gpus(assign_engine_gpus(bundles, 4)) == [[["0", "1", "2", "3"]], [["0", "1", "2", "3"]]]
    assert gpus(assign_engine_gpus(bundles, 1)) == [[["0"]], [["1"]], [["2"]], [["3"]]] * 2 and len(bundles) == 8
    # ids as Ray gives them on a node started with CUDA_VISIBLE_DEVICES set: kept as they are
    named = [BundleGPUs("a", ("GPU-x",)), BundleGPUs("a", ("GPU-y",))]
    assert gpus(assign_engine_gpus(named, 2)) == [[["GPU-x", "GPU-y"]]]


def test_an_engine_larger_than_a_node_takes_whole_nodes():
    # the 671B layout in small: one engine over two nodes; its node-rank 1 starts at bundle 4
    assert assign_engine_gpus(two_nodes(4), 8) == [[(0, ["0", "1", "2", "3"]), (4, ["0", "1", "2", "3"])]]


def test_an_engine_taking_parts_of_several_nodes_is_refused_with_the_fix():
    # 3 GPUs per node, 2 per engine: engine 1 (bundles 2 and 3) straddles the nodes
    with pytest.raises(UserError) as info:
        assign_engine_gpus(two_nodes(3), 2)
    message = str(info.value)
    assert "engine 1 would take parts of several nodes (its GPUs are bundles 2..3" in message
    assert "nodes hold 3, 3 GPUs" in message and message.endswith("valid: 1, 3, or a multiple of the node size")


def test_engine_size_must_divide_the_rollout_gpus():
    with pytest.raises(UserError, match=r"gpus_per_engine=3 does not divide the 8 rollout GPUs; valid: 1, 2, 4, 8"):
        assign_engine_gpus(two_nodes(4), 3)


# ---- the engine's GPUs as its worker numbers them (pure) ------------------------------------------------------------


def test_visible_device_index():
    assert visible_device_index("2", None) == 2  # nothing hides GPUs: the id is the index
    assert visible_device_index(5, None) == 5
    assert visible_device_index("2", "0,1,2,3") == 2
    assert visible_device_index("6", "4,5,6,7") == 2  # a node whose Ray was started on GPUs 4-7
    assert visible_device_index(3, "1, 3") == 1
    assert visible_device_index("GPU-b", "GPU-a,GPU-b") == 1
    with pytest.raises(ValueError, match=r"GPU 4 is not visible to this process \(CUDA_VISIBLE_DEVICES='0,1'\).*NOSET"):
        visible_device_index("4", "0,1")
    with pytest.raises(ValueError, match=r"'GPU-a' is not a device index and CUDA_VISIBLE_DEVICES is unset"):
        visible_device_index("GPU-a", None)


# ---- the colocated transport with one copy per tensor-parallel rank -------------------------------------------------


class RecordingClient:
    def __init__(self):
        self.calls = []

    def update_weights_from_tensor(self, payloads, *, load_format, flush_cache):
        self.calls.append((payloads, load_format, flush_cache))


def describe(part) -> str:
    """A stand-in serializer: where the payload's tensor lies, and its size."""
    return f"{part.flat.device.type}:{part.flat.numel()}"


def test_each_rank_gets_a_payload_on_its_own_device():
    """SGLang rank r loads serialized_named_tensors[r]: with rank_devices, payload r describes a copy on device r
    ("meta" stands in for a second GPU here)."""
    bucket = [("w", torch.ones(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    client = RecordingClient()
    send_flattened_bucket(client, bucket, num_ranks=2, serializer=describe, rank_devices=["cpu", "meta"])
    # one request per bucket, its bytes flattened: 6 float32 (24 bytes) + 4 bfloat16 (8 bytes)
    assert [payloads for payloads, *_ in client.calls] == [["cpu:32", "meta:32"]]
    assert {(load_format, flush) for _, load_format, flush in client.calls} == {("flattened_bucket", False)}
    client = RecordingClient()  # without: every rank reads the one copy
    send_flattened_bucket(client, bucket, num_ranks=3, serializer=describe)
    assert [payloads for payloads, *_ in client.calls] == [["cpu:32"] * 3]
    with pytest.raises(ValueError, match=r"one device per rank \(2\)"):
        send_flattened_bucket(client, bucket, num_ranks=2, serializer=describe, rank_devices=["cpu"])


def test_engine_with_gpu_ids_sends_from_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    url = "http://127.0.0.1:1"  # never contacted
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(tp=2), url=url, gpu_ids=["2", "3"])
    assert engine.ipc_device == torch.device("cuda", 2)
    assert engine.ipc_rank_devices == [torch.device("cuda", 2), torch.device("cuda", 3)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(tp=2), url=url, gpu_ids=["4", "5"])
    assert engine.ipc_rank_devices == [torch.device("cuda", 2), torch.device("cuda", 3)]
    # an explicit ipc_device, or the split transport, keeps today's single source
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(tp=2), url=url, gpu_ids=["4", "5"], ipc_device="cuda:1")
    assert engine.ipc_device == "cuda:1" and engine.ipc_rank_devices is None
    engine = SGLangEngine("/ckpt", SGLangEngineConfig(tp=2), url=url, gpu_ids=["9"], weight_sync="distributed")
    assert engine.ipc_rank_devices is None


# ---- the rollout worker passes its engine's GPUs on ----------------------------------------------------------------


def test_rollout_worker_starts_sglang_on_its_engines_gpus(monkeypatch, tmp_path):
    """In-process RolloutWorker.setup with backend sglang, up to the server launch (SGLangServer.start is a no-op
    here: SGLang needs CUDA)."""
    monkeypatch.setattr(SGLangServer, "start", lambda self: self)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = RolloutConfig(backend="sglang", gpus_per_engine=2, sglang=SGLangEngineConfig(tp=2))
    config.check("rollout")
    worker = RolloutWorker()
    worker.setup(str(tmp_path), config, gpu_ids=["2", "3"])
    try:
        server = worker.engine.server
        assert server.env["CUDA_VISIBLE_DEVICES"] == "2,3"
        command = " ".join(server.command)
        assert f"--model-path {tmp_path}" in command and "--base-gpu-id 0 --tp-size 2" in command
        assert worker.engine.ipc_rank_devices == [torch.device("cuda", 2), torch.device("cuda", 3)]
    finally:
        worker.engine.shutdown()


def test_engines_without_gpu_ids_refuse_them(tmp_path):
    with pytest.raises(UserError, match=r"rollout.backend='hf' runs on the one GPU of its worker.*must be 1"):
        build_engine("hf", str(tmp_path), RolloutConfig(), ["0", "1"])


# ---- the driver's wiring (start_roles) -----------------------------------------------------------------------------


class FakeGroup:
    """Records how start_roles builds and sets up a group (a real rollout group would start SGLang: CUDA only)."""

    def __init__(self, worker_cls, pool, role, **kwargs):
        self.role, self.pool, self.kwargs, self.calls = role, pool, kwargs, []
        pool.events.append(f"group {role}")

    def async_call(self, method, *args, **kwargs):
        self.calls.append((method, args, kwargs))
        return types.SimpleNamespace(result=lambda: None)

    def _launch(self):  # start_groups: built with start=False, the workers start side by side
        assert self.kwargs["start"] is False

    def _join(self):
        pass

    def keep_setup(self, *args):  # EngineFleet: what each engine's setup got, to start one again
        pass

    def started(self, results):
        pass

    def shutdown(self):
        pass


def start_fake_roles(monkeypatch, tmp_path, gpus_per_engine: int):
    from megarl.config.loader import load_config
    from megarl.job import JobConfig
    from megarl.trainer.lifecycle import roles as roles_module

    (tmp_path / "p.jsonl").write_text('{"prompt": "Q"}\n')
    overrides = [f"model.path={tmp_path}", f"data.train_files=[{tmp_path / 'p.jsonl'}]", "placement.train_gpus=4"]
    overrides += ["rollout.backend=sglang", f"rollout.gpus_per_engine={gpus_per_engine}"]
    config = load_config(JobConfig, overrides=[*overrides, f"rollout.sglang.tp={gpus_per_engine}"])
    pool = types.SimpleNamespace(world_size=4, events=[])

    def bundle_gpu_ids():
        pool.events.append("probe")
        return [BundleGPUs("a", (str(i),)) for i in range(4)]

    pool.bundle_gpu_ids = bundle_gpu_ids
    monkeypatch.setattr(roles_module, "_pool", lambda *args: pool)
    monkeypatch.setattr(roles_module, "WorkerGroup", FakeGroup)
    monkeypatch.setattr(roles_module, "EngineFleet", lambda pool, role, **kwargs: FakeGroup(None, pool, role, **kwargs))
    return roles_module.start_roles(config, rl_optimizer_steps=1), pool, config


def test_start_roles_places_multi_gpu_engines_and_hands_them_their_gpus(monkeypatch, tmp_path):
    roles, pool, config = start_fake_roles(monkeypatch, tmp_path, gpus_per_engine=2)
    assert pool.events == ["probe", "group actor", "group rollout"]  # asked before any group holds the GPUs
    rollout = roles.rollout
    assert rollout.kwargs["world_size"] == 2 and rollout.kwargs["bundle_stride"] == 2
    assert rollout.kwargs["env"] == {NOSET_CUDA_VISIBLE_DEVICES: "1"}
    assert roles.actor.kwargs["env"] == {}  # training workers keep one GPU each
    assert roles.engine_gpu_ids == [["0", "1"], ["2", "3"]]
    (method, args, kwargs), *_ = rollout.calls
    assert method == "setup" and args == ([config.model.path] * 2, [config.rollout] * 2)
    assert kwargs == {"gpu_ids": [["0", "1"], ["2", "3"]], "dispatch": "per_rank"}


def test_start_roles_with_one_gpu_engines_is_unchanged(monkeypatch, tmp_path):
    roles, pool, config = start_fake_roles(monkeypatch, tmp_path, gpus_per_engine=1)
    assert pool.events == ["group actor", "group rollout"] and roles.engine_gpu_ids is None
    assert roles.rollout.kwargs["world_size"] == 4 and roles.rollout.kwargs["bundle_stride"] == 1
    assert roles.rollout.kwargs["env"] == {}
    assert roles.rollout.calls == [("setup", (config.model.path, config.rollout), {})]


# ---- placement on a real Ray instance ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance with 4 logical GPUs (one is kept if a driver is already connected), like the other Ray
    test modules."""
    start_ray(ClusterConfig(logical_gpus=4, num_cpus=8, object_store_memory_mb=256, log_to_driver=False))
    yield
    stop_ray()


@pytest.fixture(scope="module")
def pool4(ray_local):
    pool = ResourcePool("rollout", num_nodes=1, gpus_per_node=4)
    yield pool
    pool.remove()


@pytest.mark.slow  # about 20 s here: four worker processes
def test_strided_group_sits_on_every_gth_bundle_and_sees_its_gpus(pool4):
    bundles = pool4.bundle_gpu_ids()
    assert pool4.bundle_gpu_ids() is bundles  # asked once
    assert len(bundles) == 4 and len({b.node_id for b in bundles}) == 1
    assert all(len(b.gpu_ids) == 1 for b in bundles) and len({b.gpu_ids for b in bundles}) == 4
    engines = [nodes[0][1] for nodes in assign_engine_gpus(bundles, 2)]
    driver_visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # what the node (this machine's raylet) has

    sees_all = {NOSET_CUDA_VISIBLE_DEVICES: "1"}
    with (
        WorkerGroup(
            ToyWorker, pool4, "rollout", num_gpus_per_worker=0.5, timeouts=FAST, bundle_stride=2, env=sees_all
        ) as rollout,
        WorkerGroup(ToyWorker, pool4, "pinned", num_gpus_per_worker=0.5, timeouts=FAST, bundle_stride=2) as pinned,
    ):
        assert rollout.world_size == 2 and rollout.bundle_indices == [0, 2]
        for group in (rollout, pinned):
            places = group.call("placement")
            # worker k on bundle 2k: each bundle holds a GPU of its own, and the worker has that bundle's
            assert [tuple(p["gpu_ids"]) for p in places] == [bundles[0].gpu_ids, bundles[2].gpu_ids]
            assert [p["env"]["LOCAL_RANK"] for p in places] == ["0", "1"]
            assert {p["env"]["LOCAL_WORLD_SIZE"] for p in places} == {"2"}
            # engine k's first GPU is its worker's own
            assert [p["gpu_ids"][0] for p in places] == [engines[0][0], engines[1][0]]
        # Ray pins a worker to its bundle's GPU unless told not to: then it sees what the node sees
        assert [p["cuda_visible_devices"] for p in pinned.call("placement")] == [engines[0][0], engines[1][0]]
        assert [p["cuda_visible_devices"] for p in rollout.call("placement")] == [driver_visible] * 2
        # both groups booked the span of three bundles: a third one would overfill the GPUs of bundles 0..2
        with pytest.raises(UserError, match=r"role extra \(bundle_stride=2\) asks for 0.5 GPU .* already held by"):
            WorkerGroup(ToyWorker, pool4, "extra", num_gpus_per_worker=0.5, timeouts=FAST, bundle_stride=2)


def test_strided_group_must_fit_its_pool(pool4):
    with pytest.raises(UserError, match=r"role rollout \(bundle_stride=2\) needs the first 5 bundles of .* has 4"):
        WorkerGroup(ToyWorker, pool4, "rollout", world_size=3, num_gpus_per_worker=0.5, bundle_stride=2)
    with pytest.raises(ValueError, match=r"bundle_stride=8 exceeds the 4 bundles of the pool"):
        WorkerGroup(ToyWorker, pool4, "rollout", bundle_stride=8)
    with pytest.raises(ValueError, match=r"bundle_stride=0 must be >= 1"):
        WorkerGroup(ToyWorker, pool4, "rollout", bundle_stride=0)
