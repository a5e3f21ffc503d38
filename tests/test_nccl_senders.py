"""The nccl road at any actor layout (megarl/workers/nccl_senders.py): every sending rank of a Megatron actor
broadcasts its own buckets into split SGLang engines, the senders taking turns in one global order.

Real parts: the actor is tiny-qwen3-moe loaded by Megatron on 4 gloo ranks (pp=2 x ep=2, and uneven stages 1|3 at
tp=2 x pp=2 x ep=2), its export stream and `send_weights` as the actor's workers run them; each sending rank sets up
its own weight-update group with the engines through the HTTP requests SGLang serves, every body checked against
SGLang's own request types.

Stand-ins, on CPU: gloo replaces NCCL in every group (the actor's and the weight-update groups: SGLang's
`init_custom_process_group` takes the backend from the request, and the senders ask for gloo without CUDA). The
engines are two fake SGLang servers, of 2 and 1 GPUs: an HTTP front here (SGLang's tokenizer manager: it validates
each body and hands it to every rank, one request at a time, as SGLang's scheduler serves them) and one process per
engine TP rank (SGLang's scheduler), which joins each group and receives each bucket with SGLang's own code, taken
from the installed package: `init_custom_process_group` (srt/utils/common.py; read from its source, since importing
the sglang package costs 12 s per process here) at rank `rank_offset + tp_rank`, and `FlattenedTensorBucket.empty`
+ `broadcast(src=0)` + `reconstruct_tensors` (srt/weight_sync/tensor_bucket.py), as WeightUpdater does for
load_format "flattened_bucket". The engine's model is stood in by a dict of the tensors it received.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import multiprocessing as mp
import re
import threading
from pathlib import Path

import pytest
import sglang_contract
import torch
from fake_sglang import QuietHandler, serve

from megarl.rollout.engine import VERIFY_PATTERN
from megarl.runtime.parallel import ParallelConfig as P
from megarl.runtime.rank_pool import RankFailure

ENGINE_RANKS = (2, 1)
"""GPUs (TP ranks) of the two engines."""
BUCKET_BYTES = 48 * 1024


# ---- the engines: SGLang's receiving side ---------------------------------------------------------------------------
def _sglang_source() -> Path:
    return Path(importlib.util.find_spec("sglang").origin).parent


def _sglang_receiving_code():
    """SGLang's `init_custom_process_group` and `FlattenedTensorBucket`, from the installed package's files."""
    from packaging.version import Version

    root = _sglang_source()
    common = root / "srt/utils/common.py"
    tree = ast.parse(common.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    namespace = {"torch": torch, "torch_release": Version(torch.__version__).release}
    exec(compile(ast.Module([node], []), str(common), "exec"), namespace)
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", root / "srt/weight_sync/tensor_bucket.py")
    tensor_bucket = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tensor_bucket)
    return namespace["init_custom_process_group"], tensor_bucket.FlattenedTensorBucket


def engine_rank_main(tp_rank: int, commands, replies) -> None:
    """One TP rank of an engine (SGLang's scheduler and its WeightUpdater): requests in order, one at a time."""
    torch.set_num_threads(1)
    init_custom_process_group, bucket_class = _sglang_receiving_code()
    groups: dict[str, object] = {}
    weights: dict[str, torch.Tensor] = {}
    log: list[tuple[str, list[str]]] = []
    refuse: set[str] = set()
    while (request := commands.get()) is not None:
        path, body = request
        try:
            if path == "/init_weights_update_group":  # WeightUpdater.init_weights_update_group
                groups[body["group_name"]] = init_custom_process_group(
                    backend=body["backend"],
                    init_method=f"tcp://{body['master_address']}:{body['master_port']}",
                    world_size=body["world_size"],
                    rank=body["rank_offset"] + tp_rank,
                    group_name=body["group_name"],
                )
                answer = (True, "Succeeded to initialize custom process group.")
            elif path == "/update_weights_from_distributed":  # _receive_bucketed_weights_from_distributed
                assert body["load_format"] == "flattened_bucket"
                bucket = bucket_class.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
                torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=groups[body["group_name"]])
                log.append((body["group_name"], body["names"]))
                refused = sorted(refuse.intersection(body["names"]))
                if refused:  # as the model's load_weights failing, after the broadcast
                    answer = (False, f"Failed to update parameter online: no parameter {refused[0]}")
                else:
                    weights.update((name, t.clone()) for name, t in bucket.reconstruct_tensors())
                    answer = (True, "Succeeded to update parameter online.")
            elif path == "/destroy_weights_update_group":
                torch.distributed.destroy_process_group(groups.pop(body["group_name"]))
                answer = (True, "Succeeded to destroy custom process group.")
            elif path == "refuse":
                refuse = set(body)
                answer = (True, "")
            elif path == "reset":  # a fresh engine for the next test
                weights.clear(), log.clear(), refuse.clear()
                answer = (True, "")
            else:  # "state": what the test reads back
                answer = (True, {"weights": weights, "log": log, "groups": sorted(groups)})
        except Exception as err:  # SGLang answers failures as success=False
            answer = (False, f"{type(err).__name__}: {err}")
        replies.put(answer)


class FakeEngine:
    """An SGLang server of `num_ranks` GPUs: the HTTP front here, one process per TP rank."""

    def __init__(self, num_ranks: int):
        ctx = mp.get_context("spawn")
        self.channels = [(ctx.Queue(), ctx.Queue()) for _ in range(num_ranks)]
        self.ranks = [
            ctx.Process(target=engine_rank_main, args=(r, *self.channels[r]), daemon=True) for r in range(num_ranks)
        ]
        for process in self.ranks:
            process.start()
        self.lock = threading.Lock()  # SGLang's scheduler serves one request at a time
        self.rejected: list[tuple[str, str]] = []
        engine = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    sglang_contract.validate_request(self.path, body)
                    ok, message = engine.ask(self.path, body)
                except Exception as err:  # SGLang's HTTP layer refuses a body its types do not read
                    engine.rejected.append((self.path, str(err)))
                    ok, message = False, str(err)
                self.reply(200 if ok else 400, {"success": ok, "message": message})

        self.httpd, self.url, _ = serve(Handler)

    def ask(self, path: str, body) -> tuple[bool, object]:
        """Every rank serves the request; (all succeeded, the first failure's message or rank 0's answer)."""
        with self.lock:
            for commands, _ in self.channels:
                commands.put((path, body))
            answers = [replies.get(timeout=120) for _, replies in self.channels]
        failed = [message for ok, message in answers if not ok]
        return (False, failed[0]) if failed else (True, answers[0][1])

    def state(self) -> list[dict]:
        """Per TP rank: {"weights", "log": [(group, names)] per bucket, "groups": still joined}."""
        with self.lock:
            for commands, _ in self.channels:
                commands.put(("state", None))
            return [replies.get(timeout=120)[1] for _, replies in self.channels]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for commands, _ in self.channels:
            commands.put(None)
        for process in self.ranks:
            process.join(3)
            if process.is_alive():  # still exiting (or left inside a broadcast): nothing of it is needed now
                process.terminate()
                process.join(5)


@pytest.fixture(scope="module")
def engine_pair():
    if not sglang_contract.installed():
        pytest.skip(sglang_contract.INSTALL_HINT)
    fakes = [FakeEngine(n) for n in ENGINE_RANKS]
    yield fakes
    for fake in fakes:
        fake.close()


@pytest.fixture
def engines(engine_pair):
    """The two engines, holding nothing yet (their processes are started once per module: seconds each)."""
    for fake in engine_pair:
        assert fake.ask("reset", None) == (True, "")
        fake.rejected.clear()
    return engine_pair


# ---- the actor's ranks (they run in the gloo rank pool) ------------------------------------------------------------
def _route(urls: list[str]):
    from megarl.rollout.sglang_weights import SGLangEndpoint
    from megarl.workers.sync_route import EngineTarget, SyncRoute

    engines = tuple(EngineTarget(None, (), SGLangEndpoint(url, n)) for url, n in zip(urls, ENGINE_RANKS))
    return SyncRoute("nccl", engines, timeout_s=120.0)


def sync_twice(folder: str, layout: P, urls: list[str]) -> dict:
    """Load the actor, move its weights, sync; move them again, sync again (the groups kept between the syncs); then
    export what the trainer now holds. Returns what this rank sent and exported."""
    from megarl.bridge.exporter import export_hf_weights
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel
    from megarl.workers.weight_sync import SenderState, close_sender, send_weights

    init_model_parallel(layout)
    model = load_model(folder, layout, torch.float32)
    route, state, sent = _route(urls), SenderState(), []
    for version in (1, 2):
        with torch.no_grad():  # as an update would: every parameter moves, differently on every rank
            for chunk in model.chunks:
                for param in chunk.parameters():
                    param.mul_(1.25).add_(0.01 * version * (torch.distributed.get_rank() + 1))
        stats = send_weights(model, route, version, BUCKET_BYTES, state, keep_samples=True)
        sent.append({key: stats[key] for key in ("tensors", "bytes", "buckets")} | {"group": state.nccl is not None})
    close_sender(state)
    exported = [(n, t.clone()) for bucket in export_hf_weights(model.bridge, model.hf_dtypes, BUCKET_BYTES)
                for n, t in bucket]  # fmt: skip
    return {"sent": sent, "exported": exported, "samples": [name for name, _ in stats["samples"]]}


def refused_turn(urls: list[str]) -> dict:
    """The stand-in pp=2 x ep=2 export (tests/relay_ranks.py, no Megatron) in turns, one engine refusing a bucket of
    rank 2."""
    import relay_ranks
    import torch.distributed as dist

    from megarl.workers.nccl_senders import send_in_turns
    from megarl.workers.weight_sync import SenderState, close_sender

    rank = dist.get_rank()
    stage_groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    state = SenderState()
    try:
        send_in_turns(relay_ranks.export_stand_in(rank, stage_groups[rank // 2]), _route(urls), state)
    finally:
        close_sender(state)


# ---- the tests ----------------------------------------------------------------------------------------------------
def _check_engines(engines: list[FakeEngine], results: list[dict], syncs: int) -> list[list[str]]:
    """Every engine GPU holds exactly the trainer's exported tensors, received from the senders in rank order
    within each sync; returns the senders' group order (the same on every GPU)."""
    exported = {name: t for r in results for name, t in r["exported"]}
    orders = []
    for engine in engines:
        assert engine.rejected == []  # SGLang's own request types read every body
        for rank_state in engine.state():
            assert sorted(rank_state["weights"]) == sorted(exported)
            for name, tensor in exported.items():
                got = rank_state["weights"][name]
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
                assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
            groups = [group for group, _ in rank_state["log"]]
            per_sync = len(groups) // syncs
            assert groups == groups[:per_sync] * syncs
            assert groups[:per_sync] == sorted(groups[:per_sync], key=lambda g: int(g.rsplit("_r", 1)[1]))
            assert rank_state["groups"] == []  # every sender left its group at the end
            orders.append(list(dict.fromkeys(groups[:per_sync])))
    assert all(order == orders[0] for order in orders)
    return orders[0]


def test_every_stage_and_expert_rank_broadcasts_its_own_buckets_in_turns(ranks4, engines, hf_checkpoint):
    folder = hf_checkpoint("tiny-qwen3-moe", torch.bfloat16)
    results = ranks4.run(sync_twice, str(folder), P(pp=2, ep=2), [e.url for e in engines])
    # stage s, expert rank e on actor rank 2s + e: each stage's dense tensors from its expert rank 0, experts from
    # both: four senders, each rank 0 of a group of its own with the 3 engine GPUs, set up once for both syncs
    assert _check_engines(engines, results, syncs=2) == [f"megarl_weights_r{rank}" for rank in range(4)]
    assert all(s["group"] for r in results for s in r["sent"])
    from megarl.bridge.safetensors_io import HFCheckpoint

    names = HFCheckpoint(folder).names
    for version in (0, 1):  # each tensor sent once, by its owner
        assert sum(r["sent"][version]["tensors"] for r in results) == len(names)
        nbytes = sum(r["sent"][version]["bytes"] for r in results)
        assert nbytes == sum(t.nbytes for r in results for _, t in r["exported"])
    verified = sorted(n for n in names if re.search(VERIFY_PATTERN, n))
    assert sorted(n for r in results for n in r["samples"]) == verified  # kept for the controller's check


def test_uneven_stages_with_tensor_parallel_gathers(ranks4, engines, hf_checkpoint):
    """Stages of 1 and 3 layers; the dense tensors gathered over TP before sending, while the TP group's second
    rank sends its own experts (etp=1): its export stream feeds the first rank's gathers before and after its turn."""
    folder = hf_checkpoint("tiny-qwen3-moe")
    layout = P(tp=2, pp=2, ep=2, etp=1, pp_first_stage_layers=1)
    results = ranks4.run(sync_twice, str(folder), layout, [e.url for e in engines])
    assert _check_engines(engines, results, syncs=2) == [f"megarl_weights_r{rank}" for rank in range(4)]


def test_a_refused_bucket_stops_every_rank_and_later_senders_send_nothing(ranks4, engines):
    import relay_ranks

    bad = "model.layers.2.self_attn.q_proj.weight"  # stage 1's dense tensors: actor rank 2 sends them
    assert engines[1].ask("refuse", [bad]) == (True, "")
    with pytest.raises(RankFailure) as failure:
        ranks4.run(refused_turn, [e.url for e in engines])
    text = str(failure.value)
    assert f"no parameter {bad}" in text and engines[1].url in text  # on rank 2, naming the engine
    assert text.count("RuntimeError: weight sync (nccl): the sender failed on rank 2: SGLangError") == 3
    dense, experts = relay_ranks.stage_names(0)
    for rank_state in engines[0].state():  # ranks 0 and 1 had their turns, rank 3 (stage 1, expert rank 1) none
        assert set(dense + experts[0] + experts[1]) <= set(rank_state["weights"])
        assert not set(relay_ranks.stage_names(1)[1][1]) & set(rank_state["weights"])
        assert rank_state["groups"] == []  # every group was left, the failed one too


def test_a_split_671b_job_takes_nccl_and_plans_its_turns():
    """DeepSeek-V3 at pp=16 x ep=8 (128 senders) into 4 split engines of 32 GPUs: auto picks nccl, and `megarl plan`
    estimates it as the senders' turns: all 640.9 GB through one sender's 50 GB/s link at a time."""
    from megarl.plan import run_plan
    from megarl.plan_command import load_for_planning

    split = ["placement.mode=split", "placement.rollout_gpus=128", "cluster.num_nodes=32"]
    config, _ = load_for_planning(Path(__file__).parents[1] / "configs" / "grpo_deepseek_v3_671b.yaml", split)
    assert config.weight_sync_transport() == "nccl"
    sync = run_plan(config).sync
    assert (sync.transport, sync.num_senders) == ("nccl", 128)
    assert sync.transfer_s == sync.total_bytes / 50e9
    assert round(sync.seconds, 1) == 15.4  # transfer 13.8 s + per-bucket calls 1.6 s (docs/weight_sync.md)


def test_a_sync_to_other_engines_or_under_another_name_sets_up_a_new_group():
    """An engine started again gets a sync of its own under a new group name (trainer/rollout_side/engine_sync.py):
    the group kept from earlier syncs is left first, and the next sync to every engine sets one up again."""
    import dataclasses

    from megarl.workers.nccl_senders import kept_sender
    from megarl.workers.weight_sync import SenderState

    class Group:
        closed = False

        def close(self):
            self.closed = True

    route, state = _route(["http://a:1", "http://b:1"]), SenderState()
    first = kept_sender(state, route, "megarl_weights_r0", Group)
    assert kept_sender(state, route, "megarl_weights_r0", Group) is first  # kept between syncs
    alone = dataclasses.replace(route, engines=route.engines[1:])
    second = kept_sender(state, alone, "megarl_weights_1_r0", Group)
    assert first.closed and not second.closed
    third = kept_sender(state, route, "megarl_weights_1_r0", Group)
    assert second.closed and state.nccl is third
