"""Delta weight sync into SGLang's own model classes on CPU (megarl/rollout/sglang_delta.py), one model per child
process (SGLang sets process-wide state), SGLang imported once:

    python tests/sglang_delta_check.py MODEL_DIR [MODEL_DIR ...]

Per model: W1 = the checkpoint's tensors W0 with about 2% of the elements of most tensors changed (a few left alone,
a few mostly changed: they travel whole inside the delta buckets); buckets as megarl's sender forms them
(BucketBuilder, 64 KiB); a DeltaEncoder sends W0 whole, then W1 as deltas. The model loads W0 fully, then each
delta bucket through SGLang's own `WeightUpdater.update_weights_from_tensor` with load_format = megarl's loader (as
the server runs it: the loader imported by its path, on the payload megarl's serializer makes), then the sender's
empty verdict request, which SGLang refuses with the verdict where there is one. Every parameter must equal, bit for
bit, the model loaded fully with W1. Then the same deltas onto a wrong base (W0 with one element of one tensor
moved) must be refused naming that tensor, once; a delta for a name the model's loaders do not know is refused
naming it; every parameter's weight_loader is the original afterwards. Prints one JSON line per model.

    python tests/sglang_delta_check.py --tp2 MODEL_DIR

checks the model as two tensor-parallel ranks (two processes over gloo: every rank holds a shard, the hash sums
go over SGLang's own TP group); the wrong base differs on one rank only and both refuse.

    python tests/sglang_delta_check.py --time MODEL_DIR

times a full load_weights against applying deltas of 1% of the elements (`timing`).

    python tests/sglang_delta_check.py --parse

prints the custom weight loaders SGLang's own parser reads from megarl's launch command.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import sglang_contract


def changed_copy(tensors: dict, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, tensor) in enumerate(sorted(tensors.items())):
        new = tensor.clone()
        if i % 7 != 3:  # every seventh tensor unchanged: an empty delta; every seventh else mostly moved: whole
            flat = new.view(-1)
            share = 0.9 if i % 7 == 5 else 0.02
            where = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * share))]
            flat[where] = flat[where] + torch.randn(where.numel(), generator=g).to(flat.dtype)
        out[name] = new
    return out


def check(model_dir: str, tp: int = 1, rank: int = 0) -> dict:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang_load_check import build_sglang_model

    from megarl.bridge.buckets import BucketBuilder
    from megarl.rollout.config import DELTA_LOADER
    from megarl.rollout.sglang_weights import FlatBucket, flatten_bucket, named_payload
    from megarl.workers.weight_delta import DeltaEncoder, delta_to_bucket

    model = build_sglang_model(model_dir, tp=tp, rank=rank)
    params = dict(model.named_parameters())
    loaders = {n: p.__dict__.get("weight_loader") for n, p in params.items()}
    w0 = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        w0.update(load_file(file))
    w1 = changed_copy(w0, 1)

    def buckets(tensors: dict) -> list:
        builder = BucketBuilder(64 * 1024)
        out = [b for name in sorted(tensors) if (b := builder.add(name, tensors[name]))]
        return [b for b in [*out, builder.flush()] if b]

    def bits() -> dict:
        return {n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in params.items()}

    model.load_weights(list(w1.items()))
    expected = bits()
    encoder = DeltaEncoder()
    for bucket in buckets(w0):
        encoder.encode(bucket)
    deltas = [encoder.encode(bucket) for bucket in buckets(w1)]
    counts = {
        "delta": sum(e.full is None for d in deltas for e in d.entries),
        "whole": sum(e.full is not None for d in deltas for e in d.entries),
        "changed": sum(e.indices.numel() for d in deltas for e in d.entries if e.full is None),
    }
    payloads = []
    for delta in deltas:
        part = flatten_bucket(delta_to_bucket(delta))
        part = FlatBucket(part.flat, part.entries, DELTA_LOADER)
        payloads.append(named_payload(part))

    # SGLang's own update_weights_from_tensor (its model runner's part): the refusal check, the tensors unwrapped,
    # the custom loader imported by its path and called
    updater = WeightUpdater(
        tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[DELTA_LOADER],
        get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )  # fmt: skip

    def verdict() -> str | None:
        """The sender's verdict request: nothing to apply, refused with the verdict where there is one."""
        success, message = updater.update_weights_from_tensor([], load_format=DELTA_LOADER)
        return None if success else message

    def apply_all() -> list:
        verdicts = []
        for payload in payloads:
            assert updater.update_weights_from_tensor(payload, load_format=DELTA_LOADER) == (True, "Success")
            verdicts.append(verdict())
        return verdicts

    model.load_weights(list(w0.items()))
    verdicts = apply_all()
    after = bits()
    mismatched = sorted(n for n in params if not torch.equal(after[n], expected[n]))
    # a wrong base: one element of a tensor the deltas change, moved where no delta writes
    # k_proj (replicated over the ranks where the model has fewer KV heads than ranks), else layer 0's first
    changing = [e for d in deltas for e in d.entries if e.full is None and ".layers.0." in e.name]
    target = next((e for e in changing if e.name.endswith("self_attn.k_proj.weight")), changing[0])
    wrong = dict(w0)
    wrong[target.name] = w0[target.name].clone()
    flat = wrong[target.name].view(-1)
    spot = next(i for i in range(flat.numel()) if i not in set(target.indices.tolist()))
    flat[spot] += 1.0
    model.load_weights(list(wrong.items()))
    wrong_verdicts = [v for v in apply_all() if v is not None]
    # a name no loader knows, as a delta
    unknown = DeltaEncoder()
    extra = [("model.layers.0.mlp.unknown.weight", torch.zeros(64))]
    unknown.encode(extra)
    extra[0][1][3] = 1.0
    part = flatten_bucket(delta_to_bucket(unknown.encode(extra)))
    updater.update_weights_from_tensor(named_payload(FlatBucket(part.flat, part.entries, DELTA_LOADER)), DELTA_LOADER)
    return {
        "unknown_name": verdict(),
        "loaders_restored": all(p.__dict__.get("weight_loader") is loaders[n] for n, p in params.items()),
        "params": len(params),
        "elements": sum(p.numel() for p in params.values()),
        "counts": counts,
        "verdicts": [v for v in verdicts if v is not None],
        "mismatched": mismatched,
        "wrong_target": target.name,
        "wrong_numel": w0[target.name].numel(),
        "wrong_verdicts": wrong_verdicts,
        "after_refusal": verdict(),
    }


def timing(model_dir: str) -> dict:
    """Seconds for a full load_weights of the checkpoint against applying deltas of 1% of every tensor's elements
    (64 MiB buckets), on this CPU."""
    import time

    import torch
    from safetensors.torch import load_file
    from sglang_load_check import build_sglang_model

    from megarl.bridge.buckets import BucketBuilder
    from megarl.rollout.config import DELTA_LOADER
    from megarl.rollout.sglang_delta import load_delta_bucket
    from megarl.rollout.sglang_weights import FlatBucket, flatten_bucket, named_payload
    from megarl.workers.weight_delta import DeltaEncoder, delta_to_bucket

    model = build_sglang_model(model_dir)
    w0 = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        w0.update(load_file(file))
    g, w1 = torch.Generator().manual_seed(1), {}
    for name, tensor in w0.items():
        moved = tensor.clone()
        where = torch.randperm(moved.numel(), generator=g)[: max(1, moved.numel() // 100)]
        moved.view(-1)[where] += 0.5
        w1[name] = moved

    def buckets(tensors: dict) -> list:
        builder = BucketBuilder(64 * 2**20)
        out = [b for name in sorted(tensors) if (b := builder.add(name, tensors[name]))]
        return [b for b in [*out, builder.flush()] if b]

    start = time.perf_counter()
    model.load_weights(list(w0.items()))
    full = time.perf_counter() - start
    encoder = DeltaEncoder()
    for bucket in buckets(w0):
        encoder.encode(bucket)
    start = time.perf_counter()
    deltas = [delta_to_bucket(encoder.encode(bucket)) for bucket in buckets(w1)]
    encode = time.perf_counter() - start
    payloads = []
    for bucket in deltas:
        part = flatten_bucket(bucket)
        payloads.append(named_payload(FlatBucket(part.flat, part.entries, DELTA_LOADER)))
    start = time.perf_counter()
    for payload in payloads:
        load_delta_bucket(model, payload)
    apply = time.perf_counter() - start
    verdict = getattr(model, "_megarl_delta_verdict", None)
    return {
        "parameters": sum(t.numel() for t in w0.values()),
        "full_load_s": round(full, 3),
        "encode_s": round(encode, 3),
        "delta_apply_s": round(apply, 3),
        "verdict": verdict.message if verdict is not None else None,
    }


def parse() -> dict:
    from sglang.srt.server_args import prepare_server_args

    from megarl.rollout.config import SGLangEngineConfig
    from megarl.rollout.sglang_server import build_server_args

    args = build_server_args(SGLangEngineConfig(), "/ckpt/hf", host="127.0.0.1", port=30001, load_format="dummy")
    return {"custom_weight_loader": prepare_server_args(args).custom_weight_loader}


def main() -> None:
    sglang_contract.install_stand_ins()
    import safetensors.torch  # noqa: F401
    import sglang.srt.distributed.parallel_state
    import sglang.srt.model_loader.loader
    import sglang.srt.models.registry  # noqa: F401  every model class: most of the import time
    import transformers  # noqa: F401

    import megarl.bridge.buckets  # noqa: F401

    jobs, args = [], sys.argv[1:]
    while args:
        arg = args.pop(0)
        if arg == "--tp2":  # the next model, as two tensor-parallel ranks (two processes, gloo)
            jobs.append((args.pop(0), 2))
        elif arg == "--time":  # the next model, timed (tp 0 marks it)
            jobs.append((args.pop(0), 0))
        else:
            jobs.append((arg, 1))
    for port, (model_dir, tp) in enumerate(jobs, start=29500 + os.getpid() % 1000):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        children = [fork_check(model_dir, tp, rank) for rank in range(max(tp, 1))]
        for rank, (pid, read) in enumerate(children):
            with os.fdopen(read, "rb") as pipe:
                data = pipe.read()
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
            result = {"model": model_dir, "tp": tp, "rank": rank, "rc": rc}
            print(json.dumps(result | (json.loads(data) if rc == 0 else {})), flush=True)


def fork_check(model_dir: str, tp: int, rank: int) -> tuple[int, int]:
    """A child doing one check (its JSON through the returned pipe): (pid, the pipe's read end)."""
    read, write = os.pipe()

    def work() -> None:
        os.close(read)
        if model_dir == "--parse":
            result = parse()
        else:
            result = timing(model_dir) if tp == 0 else check(model_dir, tp, rank)
        os.write(write, json.dumps(result).encode())

    pid = sglang_contract.fork_child(work)
    os.close(write)
    return pid, read


if __name__ == "__main__":
    main()
