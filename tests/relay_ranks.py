"""Rank-side functions of the weight-sync relay tests (tests/test_ipc_relay.py; they run in the gloo rank pool).

The actor stand-in: 4 ranks as pp=2 x ep=2 (stage = rank // 2, expert rank = rank % 2), two decoder layers per stage,
four experts per layer (two per expert rank). Dense tensors of a stage are owned by its expert rank 0; each expert
tensor is owned by its expert rank and built from two shards, one from each rank of the stage, sent point to point
inside the export stream as Megatron's TP gathers are (megarl/bridge/exporter.py), so the stream's collectives
interleave with the relay's broadcasts exactly where the real export's do.
"""

from __future__ import annotations

import zlib

import torch

LAYERS_PER_STAGE = 2
EXPERTS_PER_RANK = 2


def full_tensor(name: str) -> torch.Tensor:
    """Every tensor of the stand-in model, from its name alone (the test process computes the same)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if ".experts." in name:
        return torch.randn(8, 6, generator=g).to(torch.bfloat16)
    if name.endswith("layernorm.weight"):
        return torch.randn(6, generator=g)  # fp32: two dtypes in one bucket
    return torch.randn(6, 6, generator=g).to(torch.bfloat16)


def stage_names(stage: int) -> tuple[list[str], list[list[str]]]:
    """(dense names, expert names per expert rank) of a stage."""
    dense, experts = [], [[], []]
    for layer in range(stage * LAYERS_PER_STAGE, (stage + 1) * LAYERS_PER_STAGE):
        prefix = f"model.layers.{layer}"
        dense += [f"{prefix}.self_attn.q_proj.weight", f"{prefix}.input_layernorm.weight"]
        for ep in (0, 1):
            for e in range(ep * EXPERTS_PER_RANK, (ep + 1) * EXPERTS_PER_RANK):
                experts[ep].append(f"{prefix}.mlp.experts.{e}.down_proj.weight")
    return dense, experts


def all_names() -> list[str]:
    names = []
    for stage in (0, 1):
        dense, experts = stage_names(stage)
        names += dense + experts[0] + experts[1]
    return names


def export_stand_in(rank: int, stage_group, fail: bool = False):
    """This rank's export stream: one bucket per layer's owned tensors; expert tensors gathered from the stage's two
    ranks (half each) by point-to-point sends, in the same order on both."""
    import torch.distributed as dist

    stage, ep = divmod(rank, 2)
    peer = stage * 2 + (1 - ep)
    dense, experts = stage_names(stage)
    for layer_index in range(LAYERS_PER_STAGE):
        bucket = []
        if ep == 0:
            bucket += [(name, full_tensor(name)) for name in dense[2 * layer_index : 2 * layer_index + 2]]
        for owner in (0, 1):
            per_layer = len(experts[owner]) // LAYERS_PER_STAGE
            for name in experts[owner][layer_index * per_layer : (layer_index + 1) * per_layer]:
                halves = full_tensor(name).chunk(2)
                if owner == ep:
                    other = torch.empty_like(halves[1 - ep])
                    dist.recv(other, src=peer, group=stage_group)
                    bucket.append((name, torch.cat([halves[0], other] if ep == 0 else [other, halves[1]])))
                else:
                    dist.send(halves[ep].contiguous(), dst=peer, group=stage_group)
        yield bucket
    if fail:
        raise ValueError("injected export failure")


def relay_into_engines(urls: list[str], fail_rank: int | None = None) -> dict:
    """ipc_relay into two engines of 2 GPUs each (engine e on ranks 2e, 2e + 1), from the stand-in export."""
    import torch.distributed as dist

    from megarl.rollout.sglang_weights import SGLangEndpoint
    from megarl.workers.ipc_relay import relay_weights
    from megarl.workers.sync_route import EngineTarget, SyncRoute
    from megarl.workers.weight_sync import SenderState

    rank = dist.get_rank()
    stage_groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    engines = tuple(EngineTarget(None, (), SGLangEndpoint(url, 2)) for url in urls)
    route = SyncRoute("ipc_relay", engines, gpus_per_engine=2, timeout_s=60.0)
    buckets = export_stand_in(rank, stage_groups[rank // 2], fail=rank == fail_rank)
    sent = relay_weights(buckets, route, SenderState(), keep_samples=True)
    return {key: value for key, value in sent.items() if key != "samples"} | {
        "samples": [name for name, _ in sent["samples"]]
    }
