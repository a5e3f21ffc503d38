"""Test helpers, including the rank-side functions that run inside the gloo rank pools."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.models.hf_config import load_hf_config

# (tp, pp, vpp) layouts every architecture is checked at on four ranks.
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]


def as_parallel(layout):
    """(tp, pp, vpp) tuples for dense layouts, ParallelConfig for anything else."""
    from megarl.runtime.parallel import ParallelConfig

    return layout if isinstance(layout, ParallelConfig) else ParallelConfig(*layout)


def layout_id(layout) -> str:
    p = as_parallel(layout)
    text = f"tp{p.tp}-pp{p.pp}" + (f"-vpp{p.vpp}" if p.vpp > 1 else "") + (f"-ep{p.ep}" if p.ep > 1 else "")
    text += f"-etp{p.etp}" if p.etp is not None else ""
    return text + ("-sp" if p.sequence_parallel else "")


def sample_ids(vocab_size: int, batch: int = 2, seq: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference logits of the HF model, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, config=load_hf_config(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits


def one_result(results: list):
    """The single non-None result of a pool call (e.g. logits from the last stage's first TP rank)."""
    found = [r for r in results if r is not None]
    assert len(found) == 1, f"expected one rank to answer, got {len(found)}"
    return found[0]


# ---- rank side ---------------------------------------------------------------------------------------------------


def _is_reporting_rank() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def megatron_logits(path: str, layout: tuple[int, int, int], input_ids: torch.Tensor):
    """Load `path` (HF or megarl checkpoint) at `layout` in fp32; full logits from one last-stage rank (what
    `megarl convert --verify` compares)."""
    from megarl.conversion.verify_parity import megatron_logits

    return megatron_logits(path, as_parallel(layout), input_ids)


def exported_weights(path: str, layout: tuple[int, int, int], bucket_bytes: int, dtype: str = "float32"):
    """Load at `layout` and export: (list of (name, tensor) this rank sent, sizes of its buckets)."""
    sent, bucket_sizes, _ = exported_weights_and_parts(path, layout, bucket_bytes, dtype, with_parts=False)
    return sent, bucket_sizes


def exported_weights_and_parts(
    path: str, layout, bucket_bytes: int, dtype: str = "float32", with_parts: bool = True
) -> tuple[list, list, list]:
    """`exported_weights`, and what this rank sends of the same model to an engine that takes parts of tensors
    (export_hf_weights(parts=True): each TP rank its own parts, no gather)."""
    from megarl.bridge.exporter import export_hf_weights
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel

    parallel = as_parallel(layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, getattr(torch, dtype))
    sent, bucket_sizes, parts = [], [], []
    for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes=bucket_bytes):
        sent += [(name, tensor.clone()) for name, tensor in bucket]
        bucket_sizes.append([tensor.nbytes for _, tensor in bucket])
    if with_parts:
        for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes=bucket_bytes, parts=True):
            parts += [(name, tensor.clone()) for name, tensor in bucket]
    return sent, bucket_sizes, parts


def assert_parts_rebuild(parts: list, expected: dict[str, torch.Tensor]) -> set[str]:
    """Every rank's whole tensors and parts (`part_name`), written into their slices, cover each expected tensor
    exactly once and give it bit for bit. Returns the names of the tensors that came in parts."""
    from megarl.bridge.buckets import split_part_name

    rebuilt = {name: torch.zeros_like(t) for name, t in expected.items()}
    writes = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in expected.items()}
    in_parts = set()
    for entry, tensor in parts:
        name, (dim, start, stop) = split_part_name(entry) or (entry, (0, 0, expected[entry].shape[0]))
        in_parts.update([name] if entry != name else [])
        assert tensor.dtype == expected[name].dtype, entry
        rebuilt[name].narrow(dim, start, stop - start).copy_(tensor)
        writes[name].narrow(dim, start, stop - start).add_(1)
    for name, tensor in expected.items():
        assert bool((writes[name] == 1).all()), f"{name}: not covered exactly once"
        assert torch.equal(rebuilt[name], tensor), name
    return in_parts


def assert_export_is_the_checkpoint(ranks, folder, layout) -> None:
    """What a weight sync from `layout` sends (every rank's buckets, bf16): each HF tensor of the checkpoint at
    `folder` exactly once, equal to it; and so do the parts each TP rank sends of its own shards (no gather)."""
    from megarl.bridge.safetensors_io import HFCheckpoint

    results = ranks.run(exported_weights_and_parts, str(folder), layout, 64 * 1024, "bfloat16")
    sent = [item for tensors, _, _ in results for item in tensors]
    names = [name for name, _ in sent]
    original = HFCheckpoint(folder)
    assert len(names) == len(set(names)) and set(names) == set(original.names)
    assert all(torch.equal(tensor, original.get(name)) for name, tensor in sent)
    in_parts = assert_parts_rebuild([item for _, _, parts in results for item in parts], dict(sent))
    assert bool(in_parts) == (as_parallel(layout).tp > 1)


def exported_bucket_names(path: str, layout: tuple[int, int, int], bucket_bytes: int) -> list[list[str]]:
    """Load at `layout` and export: the names in each bucket this rank sent."""
    return [[name for name, _ in bucket] for bucket in _export(path, layout, bucket_bytes)]


def _export(path: str, layout: tuple[int, int, int], bucket_bytes: int):
    from megarl.bridge.exporter import export_hf_weights
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel

    init_model_parallel(as_parallel(layout))
    model = load_model(path, as_parallel(layout), torch.float32)
    yield from export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes=bucket_bytes)


def save_at_layout(path: str, layout: tuple[int, int, int], dst: str) -> None:
    """Load `path` at `layout` and save it as a megarl checkpoint from the live, sharded model."""
    from megarl.checkpoint.model_io import load_model, save_model
    from megarl.runtime.distributed import init_model_parallel

    parallel = as_parallel(layout)
    init_model_parallel(parallel)
    save_model(load_model(path, parallel, torch.float32), dst)


def save_after_deleting_the_source(path: str, dst: str) -> None:
    """Load a megarl checkpoint, delete its folder (as checkpoint rotation does while a resumed run lives on), save."""
    import shutil

    import torch.distributed as dist

    from megarl.checkpoint.model_io import load_model, save_model
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    init_model_parallel(ParallelConfig())
    model = load_model(path, ParallelConfig(), torch.float32)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    dist.barrier()
    save_model(model, dst)


def megatron_routing(path: str, layout, input_ids: torch.Tensor):
    """Load at `layout` and run forward; {global layer id: bool [tokens, experts]} of the experts each token was
    routed to (tokens batch-major, as HF flattens them), from one TP/DP rank per pipeline stage."""
    from megarl.checkpoint.model_io import load_model
    from megarl.models.pipeline import forward_logits
    from megarl.runtime.distributed import init_model_parallel

    parallel = as_parallel(layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.float32)
    maps: dict[int, list[torch.Tensor]] = {}
    for chunk in model.chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                layer_id = layer.layer_number - 1
                # forward_logits feeds one sequence per micro-batch, in order: [seq, experts] each
                router.register_forward_hook(lambda m, i, out, lid=layer_id: maps.setdefault(lid, []).append(out[1]))
    forward_logits(model.chunks, input_ids, model.vocab.size)
    if not _is_reporting_rank():
        return None
    return {layer_id: torch.cat(parts).bool() for layer_id, parts in maps.items()}


def hf_routing(folder: Path, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer id: bool [tokens, experts]} of the experts the HF model routes each token to."""
    import functools
    import re

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, config=load_hf_config(folder), dtype=torch.float32)
    maps: dict[int, torch.Tensor] = {}

    def record(layer_id, module, inputs, output):
        indices = output[-1]  # [tokens, k] chosen experts
        routing = torch.zeros(indices.shape[0], module.weight.shape[0], dtype=torch.bool)
        maps[layer_id] = routing.scatter_(1, indices, True)

    for name, module in model.named_modules():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|router)", name)  # gpt-oss: router
        if match:
            module.register_forward_hook(functools.partial(record, int(match.group(1))))
    with torch.no_grad():
        model(input_ids)
    return maps


def buckets_a_sync_sends(path: str, layout, quantization: dict | None):
    """Load at `layout` in bf16 and run this rank's side of a weight sync (send_weights) with `quantization`,
    recording the buckets instead of sending them: (buckets, send_weights' stats)."""
    import megarl.workers.weight_sync as weight_sync
    from megarl.checkpoint.model_io import load_model
    from megarl.runtime.distributed import init_model_parallel

    parallel = as_parallel(layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.bfloat16)
    sent = []

    def record(bucket, route, roads, state):
        sent.append([(name, tensor.clone()) for name, tensor in bucket])
        return [], None

    weight_sync._send_bucket = record  # this rank process only: the sending side up to the transport
    route = weight_sync.SyncRoute("object_store", (), quantization=quantization)
    stats = weight_sync.send_weights(model, route, 1, 2**16, weight_sync.SenderState())
    stats.pop("samples")
    return sent, stats
