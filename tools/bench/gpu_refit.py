"""GPU benchmark: weight sync (refit) from a Megatron actor into the colocated hf engine on the same GPU, as the
trainer does it (Ray workers, placement colocated), next to the device's own copy bandwidth.

    python tools/bench/gpu_refit.py [--reps 5] [--bucket-mb 512] [--jsonl out.jsonl]

The model is the ~0.5B Qwen2-class one of gpu_train_step.py (bf16). Transports: CUDA IPC (the engine maps the
actor's flattened bucket and copies device to device) and, for comparison, the Ray object store (host copies).
Reports GB/s of each sync and of a device-to-device copy of the same bytes (target: IPC sync >= 40% of it). Then the
delta road over CUDA IPC (`delta_road`): a full sync, `--delta-steps` real updates at lr 1e-6 each followed by a
delta sync, bytes and seconds per sync, and the engine compared with the actor's export bit for bit at the end.

Where `sglang` is installed, the same checkpoint's tensors (on this process's GPU) are then loaded into a real
SGLang server by SGLang's two roads as megarl drives them: `update_weights_from_tensor` with SGLang's
flattened-bucket IPC payload (the colocated `ipc` transport) and a flattened broadcast through
`update_weights_from_distributed` (the split `nccl` transport; over gloo here, as one GPU cannot hold two NCCL ranks),
then by the per-node relay (`relay_syncs`: the `ipc_relay` transport's own code with one actor rank).
Each measurement is appended to --jsonl as one JSON line the moment it is taken.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch


def device_copy_gbps(worker, num_bytes: int, reps: int) -> float:
    """Inside a worker: GB/s of copying `num_bytes` from one CUDA buffer to another."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def delta_road(actor, rollout, route, first_version: int, steps: int, bucket_bytes: int) -> dict:
    """The delta road (rollout.weight_sync_delta) as the trainer runs it, on `route`: a full sync, then `steps`
    times one real update of the actor (at its learning rate) and a delta sync (changed elements only, each bucket's
    checksum verified by the engine). Seconds and bytes per sync, `bytes_ratio` (median of full / delta bytes), and
    the engine compared with the actor's whole export at the end, bit for bit (`verified`)."""
    import dataclasses

    from megarl.testing.updates import one_update

    prompts = [[1, 17, 25, 33, 9], [1, 40, 41, 42]]
    syncs = []
    for step in range(steps + 1):
        version, mode = first_version + step, "delta" if step else "full"
        if step:
            one_update(actor, prompts)
        start = time.perf_counter()
        rollout.call("begin_weight_update", version, mode == "full")
        sent = actor.call("sync_weights", dataclasses.replace(route, delta=mode), version, bucket_bytes, collect="all")
        rollout.call("finish_weight_update", version)
        seconds = time.perf_counter() - start
        syncs.append({"mode": mode, "seconds": seconds, "bytes": sum(s["bytes"] for s in sent),
                      "full_bytes": sum(s["full_bytes"] for s in sent)})  # fmt: skip
    exported = [(name, t) for share in actor.call("export_weights", collect="all") for name, t in share]
    problems = rollout.call("verify_weights", exported, collect="rank0")
    deltas = syncs[1:]
    return {
        "full_seconds": syncs[0]["seconds"],
        "delta_seconds": statistics.median(s["seconds"] for s in deltas) if deltas else None,
        "bytes_ratio": statistics.median(s["full_bytes"] / max(s["bytes"], 1) for s in deltas) if deltas else None,
        "syncs": syncs,
        "verified": problems == [],
        "problems": problems[:3],
    }


def relay_syncs(engine, buckets: list, versions: range) -> list[float]:
    """Seconds of each sync into `engine` (an SGLangEngine on this process's GPU) by the per-node relay
    (rollout.weight_sync ipc_relay, megarl/workers/ipc_relay.py) as an actor rank runs it, with one rank: the
    relay's broadcast over a process group of one, the CUDA IPC handle serialized for SGLang, gathered over the
    engine's gloo group and posted. On one GPU nothing crosses a node; what runs is the relay's own code, end to end,
    into a real server."""
    import torch.distributed as dist

    from megarl.runtime.ports import find_free_port
    from megarl.workers.bucket_transport import device_uuid
    from megarl.workers.ipc_relay import relay_weights
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState

    address = f"tcp://127.0.0.1:{find_free_port()}"
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=address, rank=0, world_size=1)
    try:
        devices = (device_uuid(torch.device("cuda", torch.cuda.current_device())),)
        route = SyncRoute("ipc_relay", (EngineTarget(None, devices, engine.endpoint),), gpus_per_engine=1)
        state, seconds = SenderState(), []
        for version in versions:
            start = time.perf_counter()
            engine.begin_weight_update(version)
            relay_weights(iter(buckets), route, state, keep_samples=False)
            engine.finish_weight_update(version)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        dist.destroy_process_group()


def sglang_roads(folder: Path, reps: int, bucket_bytes: int) -> dict:
    """Median seconds and GB/s of loading the checkpoint into a real SGLang server by each of megarl's SGLang roads."""
    from safetensors.torch import load_file

    from megarl.bridge.buckets import BucketBuilder
    from megarl.rollout.config import SGLangEngineConfig
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.rollout.sglang_weights import SGLangWeightSender

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= {name: t.cuda() for name, t in load_file(str(file)).items()}
    builder = BucketBuilder(bucket_bytes)
    buckets = [b for name, t in tensors.items() if (b := builder.add(name, t))] + [builder.flush()]
    num_bytes = sum(t.nbytes for t in tensors.values())
    engine = SGLangEngine(folder, SGLangEngineConfig(mem_fraction_static=0.3), log_path=folder.parent / "sglang.log")
    out = {}
    try:
        for road in ("sglang_ipc", "sglang_broadcast_gloo"):
            seconds = []
            for version in range(1, reps + 2):
                start = time.perf_counter()
                if road == "sglang_ipc":
                    engine.update_weights(buckets, version)
                else:
                    with SGLangWeightSender([engine.endpoint], master_address="127.0.0.1", backend="gloo") as sender:
                        engine.begin_weight_update(version)
                        start = time.perf_counter()  # the group's set-up is once per run, not per sync
                        sender.send(buckets)
                        engine.finish_weight_update(version)
                if version > 1:
                    seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds)
            out[road] = {"seconds": median, "gb_per_s": num_bytes / median / 1e9, "bytes": num_bytes}
        seconds = relay_syncs(engine, buckets, range(reps + 2, 2 * reps + 3))[1:]  # the first maps the groups
        median = statistics.median(seconds)
        out["sglang_ipc_relay"] = {"seconds": median, "gb_per_s": num_bytes / median / 1e9, "bytes": num_bytes}
        norms = [(name, t) for name, t in tensors.items() if "norm" in name]
        out["sglang_verified"] = engine.verify_weights(norms) == []
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    import sys

    import ray

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_train_step import build_checkpoint, record

    from megarl.cluster.config import ClusterConfig
    from megarl.cluster.ray_runtime import start_ray, stop_ray
    from megarl.cluster.resource_pool import ResourcePool
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.rollout.config import HFEngineConfig, RolloutConfig
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings
    from megarl.workers.megatron_worker import MegatronWorker
    from megarl.workers.rollout_worker import RolloutWorker
    from megarl.workers.weight_sync import SyncRoute

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--delta-steps", type=int, default=3, help="updates at lr 1e-6, each followed by a delta sync")
    parser.add_argument("--jsonl", default=None, help="append each measurement to this file as it is taken")
    args = parser.parse_args(argv)
    result: dict = {"device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2-0.5b"
        build_checkpoint(folder)
        start_ray(ClusterConfig(num_cpus=8, log_to_driver=False))
        pool = ResourcePool("train", num_nodes=1, gpus_per_node=1)
        try:
            actor = WorkerGroup(MegatronWorker, pool, "actor", num_gpus_per_worker=0.5)
            rollout = WorkerGroup(RolloutWorker, pool, "rollout", world_size=1, num_gpus_per_worker=0.5)
            settings = ModelSettings(path=str(folder), dtype="bfloat16", parallel=ParallelConfig())
            actor.call("setup", settings, MicroBatchSettings(), "lm", OptimizerSettings(lr=1e-6), 10)
            rollout.call("setup", str(folder), RolloutConfig(hf=HFEngineConfig(dtype="bfloat16")))
            devices = rollout.call("device_uuids")
            for transport, route in (
                ("cuda_ipc", SyncRoute.to_workers(rollout.workers, "ipc", devices)),
                ("object_store", SyncRoute.to_workers(rollout.workers)),
            ):
                seconds, num_bytes = [], 0.0
                for version in range(1, args.reps + 2):
                    start = time.perf_counter()
                    rollout.call("begin_weight_update", version)
                    (sent,) = actor.call("sync_weights", route, version, args.bucket_mb << 20, collect="all")
                    rollout.call("finish_weight_update", version)
                    if version > 1:  # the first sync warms up allocations and the IPC mappings
                        seconds.append(time.perf_counter() - start)
                    num_bytes = sent["bytes"]
                median = statistics.median(seconds)
                result[transport] = {"seconds": median, "gb_per_s": num_bytes / median / 1e9, "bytes": num_bytes}
                record(args.jsonl, "refit", transport, result[transport])
            copy = actor.workers[0].__ray_call__.remote(device_copy_gbps, int(result["cuda_ipc"]["bytes"]), 5)
            result["device_copy_gb_per_s"] = ray.get(copy)
            result["ipc_fraction_of_copy"] = result["cuda_ipc"]["gb_per_s"] / result["device_copy_gb_per_s"]
            record(args.jsonl, "refit", "device_copy", {"gb_per_s": result["device_copy_gb_per_s"],
                   "ipc_fraction_of_copy": result["ipc_fraction_of_copy"], "target": 0.4})  # fmt: skip
            # last: a step cut by the kit's limit keeps the measurements above
            ipc_route = SyncRoute.to_workers(rollout.workers, "ipc", devices)
            first = args.reps + 2  # the versions after the loop's
            delta = delta_road(actor, rollout, ipc_route, first, args.delta_steps, args.bucket_mb << 20)
            result["cuda_ipc_delta"] = delta
            record(args.jsonl, "refit", "cuda_ipc_delta", delta)
        finally:
            pool.remove()
            stop_ray()
        if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("sgl_kernel") is not None:
            result |= sglang_roads(folder, args.reps, args.bucket_mb << 20)
            for road in ("sglang_ipc", "sglang_broadcast_gloo", "sglang_ipc_relay"):
                record(args.jsonl, "refit", road, {**result[road], "verified": result["sglang_verified"]})
    delta = result["cuda_ipc_delta"]
    print(
        f"delta road (CUDA IPC): full {delta['full_seconds']:.3f} s, delta {delta['delta_seconds']:.3f} s, bytes ratio "
        f"{delta['bytes_ratio']:.1f}, engine equals the actor: {delta['verified']}"
    )
    print(
        f"refit {result['cuda_ipc']['bytes'] / 1e9:.2f} GB: CUDA IPC {result['cuda_ipc']['seconds']:.3f} s "
        f"({result['cuda_ipc']['gb_per_s']:.1f} GB/s, {result['ipc_fraction_of_copy']:.0%} of the device copy "
        f"{result['device_copy_gb_per_s']:.0f} GB/s; target 40%), "
        f"object store {result['object_store']['seconds']:.3f} s"
    )
    for road in ("sglang_ipc", "sglang_broadcast_gloo", "sglang_ipc_relay"):
        if road in result:
            print(f"SGLang {road}: {result[road]['seconds']:.3f} s ({result[road]['gb_per_s']:.1f} GB/s)")
    return result


if __name__ == "__main__":
    main()
