"""The controller's weight sync as a transaction: begin, send, finish, verify (first / every / never), and what
happens to the engines when the sending side fails. Worker groups are stood in for by recorders (the real groups
run in tests/test_weight_sync.py and every `megarl train` test); the engines' own checks run for real below."""

from __future__ import annotations

import pytest
import torch

from megarl.errors import RunFailure
from megarl.rollout.config import HFEngineConfig, RolloutConfig
from megarl.rollout.engine import SyncStats
from megarl.trainer.lifecycle.run_checkpoint import TrainerState
from megarl.trainer.rollout_side.engine_sync import WeightSync


class Group:
    """Records calls; answers from `answers[method]` (a value, or an exception to raise)."""

    def __init__(self, answers: dict, workers: int = 2):
        self.answers = answers
        self.calls: list[tuple] = []
        self.workers = [f"worker{i}" for i in range(workers)]

    def call(self, method: str, *args, **kwargs):
        self.calls.append((method, *args))
        answer = self.answers.get(method)
        if isinstance(answer, BaseException):
            raise answer
        return answer(*args) if callable(answer) else answer


class Roles:
    colocated = False

    def __init__(self, actor: Group, rollout: Group):
        self.actor, self.rollout = actor, rollout


def sent(samples):
    return {"bytes": 8.0, "seconds": 0.1, "ipc_engines": 0.0, "in_process_engines": 0.0, "samples": samples}


def make(verify: str, problems=None, send=None):
    norm = [("model.norm.weight", torch.ones(4))]
    rollout = Group({
        "device_uuids": [[], []], "sglang_endpoint": [None, None], "shared_weights": [None, None],
        "finish_weight_update": [SyncStats(1, 1, 8, 0.1)] * 2,
        "verify_weights": problems if problems is not None else [[], []],
    })  # fmt: skip
    actor = Group({"sync_weights": send if send is not None else [sent(norm), sent([])]})
    sync = WeightSync(Roles(actor, rollout), TrainerState(), RolloutConfig(verify_sync=verify), "object_store")
    return sync, actor, rollout


def methods(group: Group) -> list[str]:
    return [call[0] for call in group.calls]


@pytest.mark.parametrize(("verify", "verified"), [("first", [True, False, False]), ("every", [True, True, True]),
                                                  ("never", [False, False, False])])  # fmt: skip
def test_verification_runs_after_the_syncs_it_is_asked_for(verify, verified):
    sync, actor, rollout = make(verify)
    for _ in range(3):
        rollout.calls.clear()
        actor.calls.clear()
        metrics = sync()
        steps = [m for m in methods(rollout) if m in ("begin_weight_update", "finish_weight_update", "verify_weights")]
        checked = verified.pop(0)
        assert steps == ["begin_weight_update", "finish_weight_update"] + ["verify_weights"] * checked
        assert actor.calls[0][-1] == checked  # the senders keep the sampled tensors only for a verified sync
        assert metrics["sync/verified_tensors"] == (1.0 if checked else 0.0)
    assert metrics["sync/weight_version"] == 3.0


def test_verification_gets_every_sampled_tensor_the_senders_kept():
    sync, _, rollout = make("first")
    sync()
    (call,) = [c for c in rollout.calls if c[0] == "verify_weights"]
    assert [name for name, _ in call[1]] == ["model.norm.weight"]


def test_a_mismatch_stops_the_run_naming_engine_and_tensor():
    problems = [[], ["model.layers.3.input_layernorm.weight: SGLang http://n1:30000 rank 1 holds checksum ab"]]
    sync, _, _ = make("first", problems=problems)
    with pytest.raises(RunFailure, match=r"engine 1: model\.layers\.3\.input_layernorm\.weight: SGLang .* rank 1"):
        sync()
    assert sync.state.weight_version == 0  # the version was not published


def test_a_failed_send_quarantines_every_engine_and_is_raised():
    sync, _, rollout = make("first", send=RuntimeError("SGLang http://n1:30000 refused weight bucket model.x: boom"))
    with pytest.raises(RuntimeError, match="boom"):
        sync()
    assert methods(rollout)[-2:] == ["begin_weight_update", "abandon_weight_update"]
    assert "refused weight bucket model.x" in rollout.calls[-1][1]
    assert sync.state.weight_version == 0


def test_delta_syncs_follow_a_full_one_and_a_failure_or_restart_forces_full():
    from megarl.workers.weight_delta import DeltaMismatch

    sync, actor, rollout = make("never")
    assert sync.delta  # rollout.weight_sync_delta=auto: on for the hf engine
    roads = []
    for new_version in (True, True, True, False, True):
        sync(new_version=new_version)
        roads.append(actor.calls[-1][1].delta)
    assert roads == ["full", "delta", "delta", "full", "delta"]  # a restarted engine gets whole tensors
    actor.answers["sync_weights"] = DeltaMismatch("delta weight sync: checksum 0x1 ... differs from the sender's 0x2")
    with pytest.raises(DeltaMismatch):
        sync()
    assert methods(rollout)[-2:] == ["begin_weight_update", "abandon_weight_update"]  # the engines are quarantined
    actor.answers["sync_weights"] = [sent([]), sent([])]
    sync()
    assert actor.calls[-1][1].delta == "full"  # the next sync after a failed delta is full
    off = WeightSync(sync.roles, TrainerState(), RolloutConfig(weight_sync_delta="off"), "object_store")
    off()
    assert actor.calls[-1][1].delta == "off" and not RolloutConfig(backend="sglang").sync_delta("ipc")


def test_the_hf_engine_verifies_its_own_weights(hf_checkpoint):
    from megarl.rollout.hf_engine import HFEngine

    engine = HFEngine(hf_checkpoint("tiny-qwen2"), HFEngineConfig())
    norm = engine.model.get_parameter("model.norm.weight").detach().clone()
    assert engine.verify_weights([("model.norm.weight", norm)]) == []
    problems = engine.verify_weights([("model.norm.weight", norm + 1), ("model.nope.weight", norm)])
    assert problems == ["model.norm.weight: the engine holds other values than the trainer sent",
                        "model.nope.weight: not a parameter of the engine's model"]  # fmt: skip


# ---- the sending side's roads --------------------------------------------------------------------------------------


class RecordingSender:
    def __init__(self, fail_at: int | None = None):
        self.buckets, self.closed, self.fail_at = [], False, fail_at

    def send_bucket(self, bucket):
        if self.fail_at is not None and len(self.buckets) == self.fail_at:
            raise RuntimeError(f"SGLang refused weight bucket {bucket[0][0]}")
        self.buckets.append([name for name, _ in bucket])

    def close(self):
        self.closed = True


def export_stub(buckets):
    def export(bridge, dtypes, bucket_bytes, parts=False):
        assert not parts  # whole tensors on these roads: SGLang, disk, engines that take no parts
        yield from buckets

    return export


BUCKETS = [
    [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.layers.0.input_layernorm.weight", torch.ones(2))],
    [("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2)), ("model.norm.weight", torch.full((2,), 3.0))],
]


def test_nccl_road_sends_every_bucket_through_one_sender_kept_between_syncs(monkeypatch):
    from megarl.rollout.sglang_weights import SGLangEndpoint
    from megarl.workers import weight_sync
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState, send_weights

    sender = RecordingSender()
    connects = []
    monkeypatch.setattr(weight_sync, "export_hf_weights", export_stub(BUCKETS))
    monkeypatch.setattr(weight_sync, "_connect_sender", lambda route: connects.append(route) or sender)
    engines = (EngineTarget("w0", (), SGLangEndpoint("http://a:30000", 2)), EngineTarget("w1", (), None))
    route, state = SyncRoute("nccl", engines), SenderState()
    model = type("Model", (), {"bridge": None, "hf_dtypes": torch.float32})()
    for _ in range(2):
        stats = send_weights(model, route, 1, 1 << 20, state)
    assert len(connects) == 1 and state.nccl is sender  # one group for the whole run
    assert sender.buckets == [[n for n, _ in b] for b in BUCKETS] * 2
    assert [name for name, _ in stats["samples"]] == ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    assert stats["tensors"] == 4 and stats["ipc_engines"] == 0


def test_a_failed_broadcast_closes_the_group_so_the_next_sync_starts_clean(monkeypatch):
    from megarl.rollout.sglang_weights import SGLangEndpoint
    from megarl.workers import weight_sync
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState, send_weights

    sender = RecordingSender(fail_at=1)
    monkeypatch.setattr(weight_sync, "export_hf_weights", export_stub(BUCKETS))
    monkeypatch.setattr(weight_sync, "_connect_sender", lambda route: sender)
    route, state = SyncRoute("nccl", (EngineTarget("w0", (), SGLangEndpoint("http://a:1", 1)),)), SenderState()
    model = type("Model", (), {"bridge": None, "hf_dtypes": torch.float32})()
    with pytest.raises(RuntimeError, match="refused weight bucket model.layers.0.self_attn.q_proj.weight"):
        send_weights(model, route, 1, 1 << 20, state)
    assert sender.closed and state.nccl is None


def test_ipc_road_needs_the_engine_on_this_ranks_gpu():
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState, _roads

    engines = (EngineTarget("w0", ("GPU-a",)), EngineTarget("w1", ()))
    assert _roads(SyncRoute("object_store", engines), SenderState()) == ["object_store", "object_store"]
    # no GPU here: no engine shares this rank's GPU, both take the object store
    assert _roads(SyncRoute("ipc", engines), SenderState()) == ["object_store", "object_store"]


def test_the_sending_side_starts_no_ray_of_its_own():
    import ray

    assert not ray.is_initialized()  # the tests above sent over nccl only: no Ray call, no Ray instance


class Pending:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class AsyncGroup(Group):
    def async_call(self, method: str, *args, **kwargs):
        return Pending(self.call(method, *args, **kwargs))


def test_a_hybrid_sync_started_behind_the_update_is_waited_for_not_sent_again():
    received = SyncStats(1, 1, 8, 0.1)
    norm = [("model.norm.weight", torch.ones(4))]
    actor = AsyncGroup({"sync_into_engine": [{"sent": sent(norm), "received": received}]}, workers=1)
    rollout = Group({"device_uuids": [[]], "sglang_endpoint": [None], "verify_weights": [[]]}, workers=1)
    state = TrainerState()
    sync = WeightSync(Roles(actor, rollout), state, RolloutConfig(verify_sync="first"), "in_process")
    sync.start()
    sync.start()  # once per version
    assert [c[0] for c in actor.calls] == ["sync_into_engine"] and actor.calls[0][2:] == (1, 2**29, True)
    assert state.weight_version == 0  # the new version is the engines' once the sync is waited for and verified
    metrics = sync()
    assert [c[0] for c in actor.calls] == ["sync_into_engine"]  # not sent twice
    assert state.weight_version == 1 and metrics["sync/verified_tensors"] == 1.0
    sync()  # not started: sent at the call, verify_sync=first keeps no samples now
    assert [c[2:] for c in actor.calls] == [(1, 2**29, True), (2, 2**29, False)]


def test_other_transports_start_nothing_ahead():
    sync, actor, rollout = make("never")
    sync.start()
    assert actor.calls == [] and rollout.calls == []


# ---- the disk road (engines across nodes) ----------------------------------------------------------------------------


def test_disk_sync_writes_a_fresh_folder_has_engines_read_it_and_removes_it(tmp_path):
    seen = {}

    def sync_weights(route, version, bucket_bytes, keep_samples):
        folder = seen["folder"] = route.disk_dir
        assert (
            route.transport == "disk" and folder == str(tmp_path / "v1") and not any(tmp_path.joinpath("v1").iterdir())
        )
        (tmp_path / "v1" / "rank00000-000000.safetensors").write_bytes(b"x")
        return [sent([]), sent([])]

    rollout = Group({
        "device_uuids": [[], []], "sglang_endpoint": [None, None], "shared_weights": [None, None],
        "finish_weight_update": [SyncStats(1, 1, 8, 0.1)] * 2,
        "load_weights_from_disk": lambda folder: seen.setdefault("read", folder),
    })  # fmt: skip
    actor = Group({"sync_weights": sync_weights})
    sync = WeightSync(Roles(actor, rollout), TrainerState(), RolloutConfig(verify_sync="never"), "disk",
                      disk_root=tmp_path)  # fmt: skip
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "stale.safetensors").write_bytes(b"left by a crashed sync")
    sync()
    assert seen["read"] == seen["folder"] and not (tmp_path / "v1").exists()
    assert methods(rollout)[-3:] == ["begin_weight_update", "load_weights_from_disk", "finish_weight_update"]


def test_a_failed_disk_sync_quarantines_and_removes_its_folder(tmp_path):
    rollout = Group({"device_uuids": [[], []], "sglang_endpoint": [None, None],
                     "load_weights_from_disk": RuntimeError("SGLang refused the folder")})  # fmt: skip
    actor = Group({"sync_weights": [sent([]), sent([])]})
    sync = WeightSync(Roles(actor, rollout), TrainerState(), RolloutConfig(), "disk", disk_root=tmp_path)
    with pytest.raises(RuntimeError, match="SGLang refused the folder"):
        sync()
    assert methods(rollout)[-1] == "abandon_weight_update" and not (tmp_path / "v1").exists()


def test_host_roads_send_each_bucket_on_a_thread_while_the_next_is_exported(monkeypatch, tmp_path):
    """The disk road's real file writes run on the sender thread: bucket 0's write starts only once bucket 1 is being
    exported (it would wait forever if the two ran one after the other), and the files and samples are as before."""
    import threading

    from safetensors.torch import load_file

    from megarl.workers import weight_sync
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState, send_weights

    second_exported, writers = threading.Event(), []
    write = weight_sync._write_bucket

    def export(bridge, dtypes, bucket_bytes, parts=False):
        yield BUCKETS[0]
        second_exported.set()
        yield BUCKETS[1]

    def slow_write(bucket, folder, state):
        writers.append(threading.current_thread().name)
        if bucket is BUCKETS[0]:
            assert second_exported.wait(timeout=30), "the export of bucket 1 did not overlap the write of bucket 0"
        write(bucket, folder, state)

    monkeypatch.setattr(weight_sync, "export_hf_weights", export)
    monkeypatch.setattr(weight_sync, "_write_bucket", slow_write)
    route = SyncRoute("disk", (EngineTarget("w0", ()),), disk_dir=str(tmp_path))
    model = type("Model", (), {"bridge": None, "hf_dtypes": torch.float32})()
    stats = send_weights(model, route, 1, 1 << 20, SenderState())
    assert all(name.startswith("megarl-weight-sender") for name in writers) and len(writers) == 2
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["rank00000-000000.safetensors", "rank00000-000001.safetensors"]
    for file, bucket in zip(files, BUCKETS):
        assert {n: t.tolist() for n, t in load_file(file).items()} == {n: t.tolist() for n, t in bucket}
    assert [name for name, _ in stats["samples"]] == ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    assert (stats["tensors"], stats["buckets"]) == (4, 2)


def test_a_failure_on_the_sender_thread_fails_the_sync_and_stops_sending(monkeypatch, tmp_path):
    from megarl.workers import weight_sync
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState, send_weights

    attempts = []

    def failing_write(bucket, folder, state):
        attempts.append(bucket[0][0])
        if len(attempts) == 2:
            raise OSError("No space left on device")

    monkeypatch.setattr(weight_sync, "export_hf_weights", export_stub(BUCKETS * 3))
    monkeypatch.setattr(weight_sync, "_write_bucket", failing_write)
    route = SyncRoute("disk", (EngineTarget("w0", ()),), disk_dir=str(tmp_path))
    model = type("Model", (), {"bridge": None, "hf_dtypes": torch.float32})()
    with pytest.raises(OSError, match="No space left on device"):
        send_weights(model, route, 1, 1 << 20, SenderState())
    # of the six buckets, the export stops at the failure: at most the one queued behind it was tried as well
    assert attempts[:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert len(attempts) <= 3


@pytest.mark.parametrize(
    ("choice", "mode", "nodes", "expected"),
    [
        ("auto", "colocated", 1, "ipc"),
        ("auto", "colocated", 4, "ipc_relay"),  # the 671B layout
        ("auto", "split", 1, "nccl"),  # every sender broadcasts, in turns, to every rank of every engine
        ("auto", "split", 2, "nccl"),
        ("disk", "split", 1, "disk"),
    ],
)
def test_transport_for_engines_across_nodes(choice, mode, nodes, expected):
    from megarl.rollout.transports import resolve_weight_sync

    assert resolve_weight_sync(choice, "sglang", mode, engine_nodes=nodes) == expected


def test_roads_that_reach_one_node_are_refused_for_engines_across_nodes():
    from megarl.errors import UserError
    from megarl.rollout.transports import resolve_weight_sync

    with pytest.raises(UserError, match=r"^rollout.weight_sync=object_store reaches only the GPUs of one node, and "
                       r"each rollout engine spans 4 nodes; use disk, ipc"):  # fmt: skip
        resolve_weight_sync("object_store", "sglang", "colocated", engine_nodes=4)
    with pytest.raises(UserError, match=r"^rollout.weight_sync=ipc across nodes is the per-node relay into SGLang"):
        resolve_weight_sync("ipc", "hf", "colocated", engine_nodes=2)
    assert resolve_weight_sync("ipc", "sglang", "colocated", engine_nodes=4) == "ipc_relay"
    with pytest.raises(UserError, match=r"valid are auto, ipc, nccl, object_store, disk$"):
        resolve_weight_sync("rdma", "sglang", "colocated")
