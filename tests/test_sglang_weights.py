"""Weight sync into SGLang: bucket flattening per dtype, its payload, and the split transport over a process group.

SGLang itself cannot be installed or run on this CPU machine. What stands in for it:
- for the colocated payload, SGLang's reconstruction (`FlattenedTensorBucket.reconstruct_tensors`: slice by offsets,
  view as the dtype, reshape; older SGLang: slice, reshape, cast) is restated here and must give back every tensor
  bit for bit. (While writing these tests the same payloads were also decoded with sglang 0.5.23's own
  `MultiprocessingSerializer` and `FlattenedTensorBucket`.) The CUDA IPC serializer itself needs a GPU;
- for the split transport, a stand-in receiver process runs a small HTTP server with SGLang's
  /init_weights_update_group, /update_weights_from_distributed and /destroy_weights_update_group, joins the group
  the way SGLang's worker does (`init_custom_process_group`: TCP rendezvous, a PrefixStore named after the group,
  `_new_process_group_helper`) and receives each tensor by a broadcast from rank 0, over gloo on CPU instead of NCCL.
"""

from __future__ import annotations

import base64
import datetime
import json
import multiprocessing as mp
import pickle
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megarl.rollout.sglang_client import SGLangError
from megarl.rollout.sglang_weights import (
    FlatBucket,
    SGLangEndpoint,
    SGLangWeightSender,
    flatten_bucket,
    pickle_serializer,
    send_flattened_bucket,
    sglang_serializer,
    unflatten,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparisons (NaN payloads and -0.0 included)."""
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor, name: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), name


def mixed_bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.0])
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)  # non-default NaNs
    base = torch.randn(8, 6, generator=g)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 4, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", base.t()),  # transposed: not contiguous
        ("model.layers.0.mlp.up_proj.weight", base[::2, 1::2]),  # strided slice
        ("model.layers.0.input_layernorm.weight", torch.cat([special, nan_payload])),
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(3, generator=g).to(torch.float16)),
        ("model.layers.0.self_attn.k_norm.weight", torch.randn(4, generator=g).to(torch.bfloat16).expand(2, 4)),
        ("model.norm.weight", torch.tensor(1.5, dtype=torch.bfloat16)),  # 0-dim
        ("empty", torch.empty(0, 3)),
        ("step", torch.tensor([7, -(2**40)], dtype=torch.int64)),
        ("mask", torch.tensor([1, 0, 2], dtype=torch.uint8)),
    ]


# ---- flattening --------------------------------------------------------------------------------------------------


def test_flatten_lays_bytes_out_back_to_back_with_aligned_offsets():
    bucket = mixed_bucket()
    part = flatten_bucket(bucket)
    assert part.flat.dtype == torch.uint8 and part.flat.dim() == 1 and part.flat.is_contiguous()
    sizes = [e.dtype.itemsize for e in part.entries]
    assert sizes == sorted(sizes, reverse=True)  # 8-byte, then 4, 2, 1: every offset a multiple of its itemsize
    assert all(e.start % e.dtype.itemsize == 0 for e in part.entries)
    assert part.entries[0].start == 0 and part.entries[-1].end == part.flat.numel() == part.nbytes
    assert all(a.end == b.start for a, b in zip(part.entries, part.entries[1:]))
    assert part.names[:2] == ["step", "model.layers.0.self_attn.q_proj.weight"]  # stable within an itemsize
    assert part.dtypes[0] == "int64" and part.shapes[1] == [6, 8]


def test_flatten_round_trip_is_bit_exact():
    bucket = mixed_bucket()
    rebuilt = dict(unflatten(flatten_bucket(bucket)))
    assert set(rebuilt) == {n for n, _ in bucket}
    for name, tensor in bucket:
        assert_same(rebuilt[name], tensor, name)


def sglang_reconstruct(flat: torch.Tensor, metadata) -> dict[str, torch.Tensor]:
    """SGLang 0.5.23's receiver (FlattenedTensorBucket.reconstruct_tensors): flat[start:end].view(dtype).reshape(shape);
    the contract tests run SGLang's own."""
    return {m.name: flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape) for m in metadata}


def test_payload_decodes_in_sglang_receiver():
    bucket = mixed_bucket(1)
    data = pickle.loads(base64.b64decode(pickle_serializer(flatten_bucket(bucket))))
    assert set(data) == {"flattened_tensor", "metadata"}
    for m in data["metadata"]:
        assert m.numel == m.end_idx - m.start_idx and isinstance(m.shape, torch.Size)
    received = sglang_reconstruct(data["flattened_tensor"], data["metadata"])
    for name, tensor in bucket:
        assert_same(received[name], tensor, name)


def test_sglang_serializer_needs_gpu_tensors():
    part = flatten_bucket([("w", torch.ones(2))])
    with pytest.raises(SGLangError, match="must be on a GPU; got cpu"):
        sglang_serializer(part)


# ---- delta buckets (megarl/rollout/sglang_delta.py) ------------------------------------------------------------------


class RecordingClient:
    """SGLangClient's update_weights_from_tensor, recorded; `refuse_verdict`: the loader's verdict, answered to the
    request after the delta as SGLang answers a refused update (success false: SGLangClient raises)."""

    def __init__(self, refuse_verdict: str | None = None) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.refuse_verdict = refuse_verdict

    def update_weights_from_tensor(self, payloads, *, load_format, flush_cache=False):
        self.calls.append((payloads, load_format))
        if self.refuse_verdict is not None and len(self.calls) == 2:
            url = "http://engine:1/update_weights_from_tensor"
            raise SGLangError(f"SGLang POST {url} failed: {self.refuse_verdict}", url=url)


def _delta_bucket():
    from megarl.workers.weight_delta import DeltaEncoder, delta_to_bucket

    encoder, base = DeltaEncoder(), mixed_bucket(4)
    encoder.encode(base)
    new = [(name, t.clone(memory_format=torch.contiguous_format)) for name, t in base]
    new[1][1].view(-1)[5] += 1  # a delta for q_proj; the other tensors: empty deltas
    return delta_to_bucket(encoder.encode(new))


def test_delta_bucket_goes_to_the_delta_loader_then_asks_for_its_verdict():
    from megarl.rollout.config import DELTA_LOADER
    from megarl.rollout.sglang_delta import unpack

    bucket = _delta_bucket()
    client = RecordingClient()
    send_flattened_bucket(client, bucket, num_ranks=2, serializer=pickle_serializer)
    assert [load_format for _, load_format in client.calls] == [DELTA_LOADER, DELTA_LOADER]
    sent, verdict = client.calls[0][0], client.calls[1][0]
    assert len(sent) == 2 and [pickle.loads(base64.b64decode(p)) for p in verdict] == [[], []]
    for payload in sent:  # each rank: one named tensor, the records in its name
        named = pickle.loads(base64.b64decode(payload))
        assert len(named) == 1 and named[0][0].startswith("megarl.delta:")
        received = dict(unpack(named))
        assert sorted(received) == sorted(name for name, _ in bucket)
        for name, tensor in bucket:
            assert_same(received[name], tensor, name)
    plain = RecordingClient()
    send_flattened_bucket(plain, mixed_bucket(4), num_ranks=2, serializer=pickle_serializer)
    assert [load_format for _, load_format in plain.calls] == ["flattened_bucket"]  # whole tensors: as before


def test_a_refused_delta_raises_delta_mismatch():
    from megarl.workers.weight_delta import DeltaMismatch

    verdict = "megarl delta weight sync: model.layers.0.self_attn.q_proj.weight: the engine's elements after the delta"
    client = RecordingClient(refuse_verdict=verdict)
    with pytest.raises(DeltaMismatch, match="failed: megarl delta weight sync: model.layers.0.self_attn.q_proj.weight"):
        send_flattened_bucket(client, _delta_bucket(), num_ranks=1, serializer=pickle_serializer)
    other = RecordingClient(refuse_verdict="update_weights_from_tensor must run between begin_weight_update() and")
    with pytest.raises(SGLangError, match="must run between") as caught:
        send_flattened_bucket(other, _delta_bucket(), num_ranks=1, serializer=pickle_serializer)
    assert not isinstance(caught.value, DeltaMismatch)


def test_flatten_to_device_and_empty_bucket():
    assert flatten_bucket([]) is None
    part = flatten_bucket([("w", torch.arange(4.0))], device="cpu")
    assert isinstance(part, FlatBucket) and part.flat.device.type == "cpu"


# ---- the split transport -----------------------------------------------------------------------------------------

GROUP = "megarl_test_weights"


def refused_bucket():
    return [("refuse.this", torch.ones(3))]


def receiver_main(port_queue, result_queue) -> None:
    """A stand-in SGLang server with one GPU (rank 1 of the group): joins and receives like SGLang's worker."""
    from torch.distributed import distributed_c10d as c10d

    groups: dict[str, object] = {}
    expected_buckets = [dict(mixed_bucket(2)), dict(mixed_bucket(3))]  # what the sender sends, in order

    def init_group(body):
        timeout = datetime.timedelta(seconds=30)
        rank = body["rank_offset"] + 0  # this server's tp rank 0
        url = f"tcp://{body['master_address']}:{body['master_port']}"
        store, rank, world = next(c10d.rendezvous(url, rank, body["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(body["group_name"], store)
        pg, _ = c10d._new_process_group_helper(
            world, rank, [], c10d.Backend(body["backend"]), store, group_name=body["group_name"], timeout=timeout
        )
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
        groups[body["group_name"]] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update(body):
        if any(name.startswith("refuse.") for name in body["names"]):
            return {"success": False, "message": "update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()"}  # fmt: skip
        assert body["load_format"] == "flattened_bucket"
        pg = groups[body["group_name"]]
        received, offset = [], 0  # FlattenedTensorBucket.empty: byte offsets, each aligned to its itemsize
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            dtype = getattr(torch, dtype)
            assert offset % dtype.itemsize == 0, (name, offset)
            size = torch.Size(shape).numel() * dtype.itemsize
            received.append((name, dtype, shape, offset, offset + size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=pg)
        received = [(n, flat[a:b].view(d).reshape(shape)) for n, d, shape, a, b in received]
        expected = expected_buckets.pop(0)
        ok = sorted(n for n, _ in received) == sorted(expected) and all(
            t.dtype == expected[n].dtype and t.shape == expected[n].shape and torch.equal(bits(t), bits(expected[n]))
            for n, t in received
        )
        result_queue.put(("bucket", ok, [(n, t.clone()) for n, t in received]))
        return {"success": True, "message": "Succeeded to update parameter online."}

    def destroy(body):
        torch.distributed.destroy_process_group(groups.pop(body["group_name"]))
        result_queue.put(("destroyed", body["group_name"]))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    routes = {
        "/init_weights_update_group": init_group,
        "/update_weights_from_distributed": update,
        "/destroy_weights_update_group": destroy,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = routes[self.path](body)
            data = json.dumps(answer).encode()
            self.send_response(200 if answer["success"] else 400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_queue.put(httpd.server_address[1])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    time.sleep(120)  # the test ends this process


def sender_main(url: str, result_queue) -> None:
    """The trainer's sending rank: connect, send two buckets, have one refused, close."""
    import os

    try:
        sender = SGLangWeightSender(
            [SGLangEndpoint(url, num_ranks=1)], master_address="127.0.0.1", backend="gloo", group_name=GROUP,
            timeout_s=30, device="cpu",
        )  # fmt: skip
        sender.connect()
        result_queue.put(("sent", sender.send([mixed_bucket(2), mixed_bucket(3)])))
        sender.close()
        sender = SGLangWeightSender(
            [SGLangEndpoint(url, num_ranks=1)], master_address="127.0.0.1", backend="gloo", group_name=GROUP,
            timeout_s=30, device="cpu",
        )  # fmt: skip
        sender.connect()  # the same group name again after close()
        start = time.monotonic()
        try:
            sender.send_bucket(refused_bucket())
            result_queue.put(("refused", None, 0.0))
        except SGLangError as e:
            result_queue.put(("refused", str(e), time.monotonic() - start))
    except Exception as e:  # reported to the test, which fails with it
        result_queue.put(("error", repr(e)))
    finally:
        result_queue.put(("sender done",))
        result_queue.close()
        result_queue.join_thread()  # flushed before the hard exit below
        os._exit(0)  # a refused bucket leaves its broadcast pending: do not wait for it at exit


def _get(q, timeout=60.0):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no message from the weight-sync processes within {timeout:g} s")


def test_sender_rank_offsets():
    endpoints = [SGLangEndpoint("http://a:1", 2), SGLangEndpoint("http://b:1", 4), SGLangEndpoint("http://c:1", 1)]
    sender = SGLangWeightSender(endpoints, master_address="127.0.0.1", backend="gloo")
    assert sender.rank_offsets() == [1, 3, 7] and sender.world_size == 8
    with pytest.raises(RuntimeError, match="before connect"):
        sender.send_bucket([("w", torch.ones(1))])
    sender.close()
    with pytest.raises(ValueError, match="at least one engine"):
        SGLangWeightSender([], master_address="127.0.0.1")


def test_split_transport_over_gloo():
    ctx = mp.get_context("spawn")
    port_queue, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=receiver_main, args=(port_queue, results), daemon=True)
    receiver.start()
    sender = None
    try:
        url = f"http://127.0.0.1:{_get(port_queue)}"
        sender = ctx.Process(target=sender_main, args=(url, results), daemon=True)
        sender.start()
        messages = []
        while not messages or messages[-1] != ("sender done",):
            messages.append(_get(results))
        errors = [m for m in messages if m[0] == "error"]
        assert not errors, errors
        buckets = [m for m in messages if m[0] == "bucket"]
        assert [ok for _, ok, _ in buckets] == [True, True]  # the receiver checked names, dtypes, shapes, values
        for (_, _, received), expected in zip(buckets, [mixed_bucket(2), mixed_bucket(3)]):
            assert sorted(n for n, _ in received) == sorted(n for n, _ in expected)
            for name, want in expected:
                assert_same(dict(received)[name], want, name)
        (sent,) = [m for m in messages if m[0] == "sent"]
        assert sent[1] == (20, sum(t.nbytes for _, t in mixed_bucket(2) + mixed_bucket(3)))
        assert ("destroyed", GROUP) in messages
        (refused,) = [m for m in messages if m[0] == "refused"]
        assert refused[1] is not None and "must run between begin_weight_update()" in refused[1]
        assert "is now unusable" in refused[1] and url in refused[1]
        assert refused[2] < 10  # failed at once, not after the group's 30 s timeout
    finally:
        for process in (sender, receiver):
            if process is not None:
                process.terminate()
                process.join(10)
