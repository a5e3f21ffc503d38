"""Benchmark weight sync (refit): a TP=2 Megatron actor streams its weights as HF-named buckets into an hf rollout
engine, on CPU, at several bucket sizes, next to the memcpy bandwidth of the same bytes measured in the same run.

    python tools/bench/refit.py [--bucket-mb 64,128,256,512,1024] [--reps 3] [--history] [--json results.json]

--json writes every number, headed by `fraction_of_memcpy` (the fastest trainer sync's bandwidth over memcpy's, on
one thread; memcpy is measured before and after the syncs and the median taken: the machine's memory bandwidth
moves between minutes).

The path is the trainer's own: Ray worker groups built as megarl/trainer/lifecycle/roles.py builds them in colocated
mode (an actor `MegatronWorker` group of 2 ranks at TP=2, trainable, and one `RolloutWorker` with the hf engine, sharing
two logical GPUs), and a sync is `begin_weight_update` / `sync_weights` / `finish_weight_update`, exactly as the
trainer calls them. Three roads, in turns (A B C A B C, so that all share the machine's moments):
- `sync`, the trainer's road into a CPU hf engine on the actor's node (since 2026-11-28, late): the engine's weights
  are in shared memory (megarl/rollout/shared_weights.py) and each TP rank copies its own parts of the tensors (q/k/v
  per query group, gate/up halves, vocabulary rows) straight from its shards into them: one copy per byte;
- `sync_parts`, the same parts through Ray's object store (the road of an hf engine on another node; the trainer's
  road on 2026-11-28): each part as a NumPy view of its bytes (megarl/workers/bucket_transport.py), `ray.put` and
  `apply_packed_bucket.remote` on a sender thread while the next bucket is exported, two buckets in flight per rank;
  the engine copies each part into its slice of the parameter: two copies per byte;
- `sync_gathered`, the engine marked as taking whole tensors only: the road until 2026-11-28 (the TP shards gathered
  to rank 0 over gloo, converted and sent from there alone).

For the profile, an instrumented copy of that loop (timers around the TP gathers, the rest of the export, `ray.put`,
the waits, and on the engine the deserialization and `apply_bucket`), sending on the exporting thread so that its
parts add up, on each rank: `parts` (the object store road) and `gathered` (the road until 2026-11-28); with
`--history` also `before` (each bucket pickled as torch tensors, every TP rank all-gathering every parameter: the
road until 2026-11-22) and `fix 1 alone` (NumPy transport, all-gather). And:
- `export only`: the export stream on the actor ranks, buckets dropped (TP gather or parts, HF layout, bucketing);
- `engine apply only`: the engine's `apply_bucket` on buckets already in its process (the copy into the model).

Memory: the RSS of the two actor ranks and the engine process, sampled every 2 ms by the driver (psutil), peak
minus the value just before the sync (each process trims its heap first), both including and excluding shared
pages (the object store, and on the `sync` road the engine's weights, are shared memory mapped into the processes;
`private` counts the rest).

Model (generated, no hub): Qwen3-shaped, 16 layers, hidden 1024, vocab 32000, 254 M parameters, 1.02 GB in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

MODEL = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
"""Overrides of --tiny (the smoke test)."""

MB = 2**20
MAX_BUCKETS_IN_FLIGHT = 2  # as megarl/workers/weight_sync.py


# ---- functions run inside the workers (through Ray's __ray_call__) ------------------------------------------------


def worker_pid(worker) -> int:
    return os.getpid()


def trim_heap(worker) -> None:
    """Give freed heap memory back to the OS, so the next RSS baseline holds the model and nothing left over."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def memcpy_seconds(worker, num_bytes: int, reps: int, num_threads: int) -> list[float]:
    """torch copy of `num_bytes` between two pre-touched tensors, in this process with `num_threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    seconds = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    del src, dst
    trim_heap(worker)
    return seconds[1:]


def export_only(worker, bucket_bytes: int, parts: bool) -> dict:
    """Iterate the export stream on this actor rank (a collective), dropping the buckets; `parts`: each rank its own
    parts (the hf engine's road), else gathered to rank 0."""
    import torch

    from megarl.bridge.exporter import export_hf_weights
    from megarl.runtime import cpu_compat

    loaded = worker.model.loaded
    start = time.perf_counter()
    num_bytes = 0
    with torch.no_grad(), cpu_compat.paused():  # as send_weights
        for bucket in export_hf_weights(loaded.bridge, loaded.hf_dtypes, bucket_bytes, parts=parts):
            num_bytes += sum(t.nbytes for _, t in bucket)
    return {"seconds": time.perf_counter() - start, "bytes": num_bytes}


def engine_apply_only(worker, bucket_bytes: int) -> dict:
    """`apply_bucket` on buckets made in this process (clones of the engine's own tensors): the copy alone."""

    from megarl.bridge.buckets import BucketBuilder

    engine = worker.engine
    weights = engine.weights
    state = engine.model.state_dict()
    builder = BucketBuilder(bucket_bytes)
    seconds = 0.0
    num_bytes = 0

    def apply(bucket) -> None:
        nonlocal seconds, num_bytes
        start = time.perf_counter()
        engine.apply_bucket(bucket)
        seconds += time.perf_counter() - start
        num_bytes += sum(t.nbytes for _, t in bucket)

    engine.begin_weight_update(-1)
    for name, dest in weights.plan.items():
        region = state[dest.target][dest.index] if dest.index else state[dest.target]
        if (bucket := builder.add(name, region.clone())) is not None:
            apply(bucket)
    if (bucket := builder.flush()) is not None:
        apply(bucket)
    engine.finish_weight_update(-1)
    return {"seconds": seconds, "bytes": num_bytes}


def engine_take(worker, boxed_ref: list, transport: str) -> tuple[float, float]:
    """Engine side of the instrumented loop: (seconds to deserialize the bucket, seconds in apply_bucket)."""
    import ray

    from megarl.workers.bucket_transport import unpack_bucket

    start = time.perf_counter()
    payload = ray.get(boxed_ref[0])
    got = time.perf_counter()
    worker.apply_bucket(unpack_bucket(payload) if transport == "numpy" else payload)
    return got - start, time.perf_counter() - got


def all_gather_shards(binding, size: int, group) -> list:
    """The exporter's gather before the fix (the "before" rows): every TP rank all-gathers every parameter's shards,
    although only the group's rank 0 sends them."""
    import torch
    import torch.distributed as dist

    param = binding.param.detach()
    if binding.mapping.tp_dim is None or size == 1:
        return [param]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    return shards


def instrumented_send(
    worker, engines: list, bucket_bytes: int, transport: str, gather_mode: str, parts: bool = False
) -> dict:
    """The loop of `send_weights` with timers; `transport` "torch" (before 2026-11-22) or "numpy" (now),
    `gather_mode` "all_gather" (before) or "gather" (the exporter's own), `parts`: each TP rank exports and sends
    its own parts (the trainer's road into the hf engine since 2026-11-28)."""
    import ray
    import torch

    from megarl.bridge import exporter
    from megarl.runtime import cpu_compat
    from megarl.workers.bucket_transport import pack_bucket

    original_gather = exporter._gather_shards
    gather = all_gather_shards if gather_mode == "all_gather" else original_gather
    times = dict(gather=0.0, export_rest=0.0, encode_put=0.0, wait=0.0, engine_get=0.0, engine_apply=0.0)

    def timed_gather(*args, **kwargs):
        start = time.perf_counter()
        out = gather(*args, **kwargs)
        times["gather"] += time.perf_counter() - start
        return out

    def settle(calls: list) -> None:
        for get_s, apply_s in ray.get(calls):
            times["engine_get"] += get_s
            times["engine_apply"] += apply_s

    loaded = worker.model.loaded
    exporter._gather_shards = timed_gather
    start = time.perf_counter()
    in_flight: deque[list] = deque()
    num_buckets = 0
    try:
        with torch.no_grad(), cpu_compat.paused():  # as send_weights
            stream = exporter.export_hf_weights(loaded.bridge, loaded.hf_dtypes, bucket_bytes, parts=parts)
            while True:
                t0 = time.perf_counter()
                bucket = next(stream, None)
                times["export_rest"] += time.perf_counter() - t0
                if bucket is None:
                    break
                t0 = time.perf_counter()
                while len(in_flight) >= MAX_BUCKETS_IN_FLIGHT:
                    settle(in_flight.popleft())
                t1 = time.perf_counter()
                ref = ray.put(pack_bucket(bucket) if transport == "numpy" else bucket)
                del bucket
                t2 = time.perf_counter()
                in_flight.append([engine.__ray_call__.remote(engine_take, [ref], transport) for engine in engines])
                times["wait"] += t1 - t0
                times["encode_put"] += t2 - t1
                num_buckets += 1
            t0 = time.perf_counter()
            while in_flight:
                settle(in_flight.popleft())
            times["wait"] += time.perf_counter() - t0
    finally:
        exporter._gather_shards = original_gather
    times["export_rest"] -= times["gather"]
    times["total"] = time.perf_counter() - start
    times["buckets"] = num_buckets
    return times


# ---- driver side --------------------------------------------------------------------------------------------------


class RSSSampler:
    """Samples the RSS of some processes every `interval_s` in a thread; peak above the value at `start`."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.002):
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, proc in self.procs.items():
            info = proc.memory_info()
            out[name] = (info.rss, info.rss - info.shared)
        return out

    def start(self) -> None:
        self.base = self._read()
        self.peak = dict(self.base)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name, (rss, private) in self._read().items():
                peak_rss, peak_private = self.peak[name]
                self.peak[name] = (max(rss, peak_rss), max(private, peak_private))
            time.sleep(self.interval_s)

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join()
        return {
            name: {"rss": self.peak[name][0] - self.base[name][0], "private": self.peak[name][1] - self.base[name][1]}
            for name in self.procs
        }


class Bench:
    def __init__(self, folder: Path, args):
        import ray

        from megarl.cluster.resource_pool import ResourcePool
        from megarl.cluster.worker_group import WorkerGroup
        from megarl.rollout.config import RolloutConfig
        from megarl.runtime.parallel import ParallelConfig
        from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings
        from megarl.workers.megatron_worker import MegatronWorker
        from megarl.workers.rollout_worker import RolloutWorker

        self.ray = ray
        self.args = args
        self.pool = ResourcePool("train", num_nodes=1, gpus_per_node=2)
        self.actor = WorkerGroup(MegatronWorker, self.pool, "actor", num_gpus_per_worker=0.5)
        self.rollout = WorkerGroup(RolloutWorker, self.pool, "rollout", world_size=1, num_gpus_per_worker=0.5)
        settings = ModelSettings(path=str(folder), dtype="float32", parallel=ParallelConfig(tp=2))
        setups = [
            self.actor.async_call("setup", settings, MicroBatchSettings(), "lm", OptimizerSettings(), 1),
            self.rollout.async_call("setup", str(folder), RolloutConfig()),
        ]
        for call in setups:
            call.result()
        self.shared = self.rollout.call("shared_weights")  # the engine's weights move into shared memory
        self.processes = [*self.actor.workers, *self.rollout.workers]
        names = ["actor rank 0", "actor rank 1", "engine"]
        pids = ray.get([w.__ray_call__.remote(worker_pid) for w in self.processes])
        self.sampler = RSSSampler(dict(zip(names, pids)))
        self.version = 0

    def on_all(self, workers, fn, *args) -> list:
        return self.ray.get([w.__ray_call__.remote(fn, *args) for w in workers])

    def measured(self, run) -> tuple[float, dict, object]:
        """(seconds, peak extra memory per process, what `run` returned) of one weight update."""
        self.on_all(self.processes, trim_heap)
        self.version += 1
        self.rollout.call("begin_weight_update", self.version)
        self.sampler.start()
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
        memory = self.sampler.stop()
        self.rollout.call("finish_weight_update", self.version)  # strict: fails unless every tensor arrived
        return seconds, memory, out

    def sync(self, bucket_bytes: int, road: str = "shared_memory"):
        """The trainer's call, as in megarl/trainer: every actor rank runs `send_weights` to every engine, by
        `road`: shared_memory (the trainer's road into a CPU hf engine since 2026-11-28: each rank writes its parts
        into the engine's shared weights), parts (each rank its parts through the object store, 2026-11-28) or
        gathered (the engine marked as taking whole tensors only: gathered to TP rank 0, until 2026-11-28)."""
        import dataclasses

        from megarl.workers.weight_sync import SyncRoute

        shared = self.shared if road == "shared_memory" else None
        route = SyncRoute.to_workers(self.rollout.workers, shared=shared)
        if road == "gathered":
            engines = tuple(dataclasses.replace(e, takes_parts=False) for e in route.engines)
            route = dataclasses.replace(route, engines=engines)
        return self.actor.call("sync_weights", route, self.version, bucket_bytes, collect="all")

    def instrumented(self, bucket_bytes: int, transport: str, gather_mode: str, parts: bool = False):
        workers = self.actor.workers
        engines = self.rollout.workers
        return self.on_all(workers, instrumented_send, engines, bucket_bytes, transport, gather_mode, parts)

    def repeated(self, runs: dict) -> dict:
        """Each of `runs` (name -> a weight update) warmup + reps times, taking turns (A B A B ...), so that
        variants compared with each other share the machine's moments (it is shared with other work)."""
        measured = {name: [] for name in runs}
        for _ in range(self.args.warmup + self.args.reps):
            for name, run in runs.items():
                measured[name].append(self.measured(run))
        out = {}
        for name, taken in measured.items():
            taken = taken[self.args.warmup :]
            seconds = [s for s, _, _ in taken]
            memory = {
                proc: {kind: max(m[proc][kind] for _, m, _ in taken) for kind in ("rss", "private")}
                for proc in taken[0][1]
            }
            out[name] = {
                "seconds": statistics.median(seconds),
                "all_seconds": seconds,
                "extra_memory": memory,
                "returned": taken[-1][2],
            }
        return out

    def bucket_size(self, bucket_bytes: int) -> dict:
        row = {"bucket_bytes": bucket_bytes}
        size = f"  bucket {bucket_bytes / MB:g} MB"
        print(f"{size}: trainer path (sync_weights): shared memory, parts by object store, gathered ...", flush=True)
        row |= self.repeated(
            {
                "sync": lambda: self.sync(bucket_bytes),
                "sync_parts": lambda: self.sync(bucket_bytes, "parts"),
                "sync_gathered": lambda: self.sync(bucket_bytes, "gathered"),
            }
        )
        print(f"{size}: instrumented, export only, engine apply only ...", flush=True)
        variants = {
            "parts": lambda: self.instrumented(bucket_bytes, "numpy", "gather", parts=True),
            "now": lambda: self.instrumented(bucket_bytes, "numpy", "gather"),
        }
        if self.args.history:
            variants["before"] = lambda: self.instrumented(bucket_bytes, "torch", "all_gather")
            variants["numpy"] = lambda: self.instrumented(bucket_bytes, "numpy", "all_gather")
        row |= self.repeated(variants)
        for key, parts in (("export_only_s", False), ("export_parts_only_s", True)):
            exports = [self.on_all(self.actor.workers, export_only, bucket_bytes, parts) for _ in range(self.args.reps)]
            row[key] = statistics.median(max(r["seconds"] for r in ranks) for ranks in exports)
        applies = [self.on_all(self.rollout.workers, engine_apply_only, bucket_bytes)[0] for _ in range(self.args.reps)]
        row["apply_only_s"] = statistics.median(a["seconds"] for a in applies)
        self.on_all(self.processes, trim_heap)
        return row

    def shutdown(self) -> None:
        self.rollout.shutdown()
        self.actor.shutdown()
        self.pool.remove()


def generate(folder: Path, config: dict) -> None:
    code = (
        "import torch, sys; from megarl.testing.tiny_checkpoint import make_hf_checkpoint; "
        f"make_hf_checkpoint({config!r}, sys.argv[1], dtype=torch.float32)"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)


def run(args) -> dict:
    from ray import cloudpickle

    from megarl.cluster.config import ClusterConfig
    from megarl.cluster.ray_runtime import start_ray, stop_ray

    if __name__ != "__main__":  # imported (the smoke test): the workers cannot import this file by name
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    load_at_start = os.getloadavg()
    config = dict(MODEL, **(TINY if args.tiny else {}))
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        folder = work / "model"
        print(f"generating the model in {folder} ...", flush=True)
        generate(folder, config)
        model_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        start_ray(ClusterConfig(logical_gpus=2, object_store_memory_mb=args.object_store_mb, log_to_driver=False))
        try:
            print("starting the actor (TP=2) and the hf engine ...", flush=True)
            bench = Bench(folder, args)
            try:
                engine = bench.rollout.workers

                def copies() -> dict[int, list[float]]:
                    return {t: bench.on_all(engine, memcpy_seconds, model_bytes, args.reps, t)[0] for t in (1, 2)}

                memcpy_start = copies()
                rows = [bench.bucket_size(int(mb * MB)) for mb in args.bucket_mb]
                memcpy_end = copies()  # the machine's memory bandwidth moves between minutes: both ends
                memcpy = {t: statistics.median(memcpy_start[t] + memcpy_end[t]) for t in (1, 2)}
            finally:
                bench.shutdown()
        finally:
            stop_ray()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sent = rows[0]["sync"]["returned"]
    return {
        # the headline: the trainer's fastest sync over memcpy of the same bytes on one thread (the table's %)
        "fraction_of_memcpy": round(memcpy[1] / min(row["sync"]["seconds"] for row in rows), 4),
        "model_bytes": model_bytes,
        "sent_bytes": sum(s["bytes"] for s in sent),
        "memcpy_s": memcpy,
        "memcpy_s_start_end": {t: [statistics.median(run[t]) for run in (memcpy_start, memcpy_end)] for t in memcpy},
        "rows": rows,
        "load_average_start": load_at_start,
        "load_average_end": os.getloadavg(),
    }


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / MB:.0f}"


def tables(result: dict) -> list[str]:
    total = result["sent_bytes"]
    memcpy = result["memcpy_s"]
    limit = gbps(total, memcpy[1])
    load = " -> ".join(", ".join(f"{x:.2f}" for x in result[f"load_average_{when}"]) for when in ("start", "end"))
    ends = " -> ".join(f"{gbps(total, s):.2f}" for s in result["memcpy_s_start_end"][1])
    lines = [
        f"\nModel: {result['model_bytes'] / 1e9:.2f} GB of fp32 safetensors; a sync sends {total / 1e9:.2f} GB. "
        f"memcpy of the same bytes (engine process, median of the runs before and after): {limit:.2f} GB/s with 1 "
        f"thread (start -> end: {ends}), {gbps(total, memcpy[2]):.2f} GB/s with 2. Load average (1, 5, 15 min) at "
        f"start -> end: {load}. Targets: 40% of memcpy, extra memory under 3 buckets.",
        "",
        "| path | bucket MB | s | GB/s | % of memcpy | extra RSS MB: rank 0 / rank 1 / engine | "
        "private MB: rank 0 / rank 1 / engine | largest private / bucket |",
        "|---|---|---|---|---|---|---|---|",
    ]
    paths = [
        ("sync", "trainer (`sync_weights`): both TP ranks write into the engine's shared memory"),
        ("sync_parts", "trainer, parts from both TP ranks by the object store (2026-11-28)"),
        ("sync_gathered", "trainer, gathered to TP rank 0 (until 2026-11-28)"),
        ("before", "before: torch pickling, all-gather"),
        ("numpy", "fix 1 alone: NumPy transport, all-gather"),
    ]
    names = ("actor rank 0", "actor rank 1", "engine")
    for key, label in paths:
        for row in result["rows"]:
            if key not in row:
                continue
            run = row[key]
            mem = run["extra_memory"]
            rate = gbps(total, run["seconds"])
            worst = max(mem[name]["private"] for name in names) / row["bucket_bytes"]
            lines.append(
                f"| {label} | {row['bucket_bytes'] / MB:g} | {run['seconds']:.2f} | {rate:.2f} | {rate / limit:.0%} | "
                + " / ".join(_mb(mem[name]["rss"]) for name in names)
                + " | "
                + " / ".join(_mb(mem[name]["private"]) for name in names)
                + f" | {worst:.1f} |"
            )
    lines += [
        "",
        "Where the time goes: seconds per sync on each sending rank, from an instrumented copy of `send_weights` that "
        "sends on the exporting thread (so that its parts add up); `export only` and `engine apply only` are each "
        "measured alone (export: the slower rank).",
        "",
        "| path | bucket MB | export only | engine apply only | TP gathers | rest of export | ray.put | "
        "waiting for the engine | engine: ray.get | engine: apply_bucket | total |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    profiles = [
        ("parts", 0, "parts, rank 0", "export_parts_only_s"),
        ("parts", 1, "parts, rank 1", "export_parts_only_s"),
        ("now", 0, "gathered, rank 0 (fixes 1 + 2)", "export_only_s"),
        ("before", 0, "before", None),
        ("numpy", 0, "fix 1 alone", None),
    ]
    for key, rank, label, export_key in profiles:
        for row in result["rows"]:
            if key not in row:
                continue
            t = row[key]["returned"][rank]
            alone = f"{row[export_key]:.2f} | {row['apply_only_s']:.2f}" if export_key else " | "
            lines.append(
                f"| {label} | {row['bucket_bytes'] / MB:g} | {alone} | {t['gather']:.2f} | {t['export_rest']:.2f} | "
                f"{t['encode_put']:.2f} | {t['wait']:.2f} | {t['engine_get']:.2f} | {t['engine_apply']:.2f} | "
                f"{t['total']:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", default="64,128,256,512,1024", help="comma-separated bucket sizes in MiB")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--object-store-mb", type=int, default=4096, help="Ray object store size")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument(
        "--history", action="store_true", help="also the profiles of the roads before 2026-11-22 (slow)"
    )
    parser.add_argument("--workdir", default=None, help="where the generated model goes (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.bucket_mb = [float(mb) for mb in args.bucket_mb.split(",")]
    result = run(args)
    print("\n".join(tables(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
