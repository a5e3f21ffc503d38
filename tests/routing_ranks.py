"""Rank-side functions of the routing-replay tests (they run inside the gloo rank pools of tests/conftest.py)."""

from __future__ import annotations

import torch
from worker_ranks import _dp_part, _init, settings_for

from megarl.data.batch import Batch


def _check_routing_maps(model) -> dict[str, int]:
    """Hooks on every router: for each token a router replays, does its routing map (what the token dispatcher
    sends on) hold exactly the replayed experts? Counts, filled as forwards run."""
    counts = {"checked": 0, "wrong": 0}

    def check(router, inputs, output):
        replay = router.router_replay
        if replay.mode != "replay" or replay.target_topk_idx is None:
            return
        _, routing_map = output
        mask = replay.mask
        expected = torch.zeros_like(routing_map).scatter_(1, replay.target_topk_idx.long(), True)
        counts["checked"] += int(mask.sum())
        counts["wrong"] += int((routing_map[mask] != expected[mask]).any(dim=1).sum())

    for chunk in model.chunks:
        module = getattr(chunk, "module", chunk)
        for layer in module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(check)
    return counts


def routing_passes(path: str, layout, batch: Batch, random_routing: torch.Tensor, max_tokens: int = 64):
    """On one model: log-probs with live routing; a record pass; a replay of what it recorded; a replay of
    `random_routing` (ids [B, S, L, k], replayed on every scored token). From every rank: the routing-map check of
    the random replay; from output ranks also (dp rank, results)."""
    from megarl.workers.policy import compute_logprobs
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model = build_role_model(settings_for(path, layout)[0])
    dp_rank, part = _dp_part(batch)
    off = compute_logprobs(model, part, max_tokens=max_tokens, routing="off")
    recorded = compute_logprobs(model, part, max_tokens=max_tokens, routing="record")
    recorded = _share(recorded, part, model.routing_layout)
    replayed = compute_logprobs(model, part.with_tensors(**recorded), max_tokens=max_tokens, routing="replay")
    counts = _check_routing_maps(model)
    _, random_part = _dp_part(batch.with_tensors(routed_experts=random_routing, routing_mask=recorded_mask(batch)))
    compute_logprobs(model, random_part, max_tokens=max_tokens, routing="replay")
    if off is None:
        return {"map_check": counts}
    return {
        "map_check": counts,
        "dp_rank": dp_rank,
        "off": off["logprobs"],
        "recorded": recorded["routed_experts"],
        "replayed": replayed["logprobs"],
        "agree": replayed["routing_agree"],
        "observed": replayed["routing_observed"],
    }


def recorded_mask(batch: Batch) -> torch.Tensor:
    """1 on every token but each sample's last: where a recorded routing exists."""
    from megarl.workers.routing_replay import scored_tokens

    return scored_tokens(batch["attention_mask"]).to(torch.uint8)


def _share(result: Batch | None, part: Batch, layout) -> dict[str, torch.Tensor]:
    """The record pass's routing, from the output rank to every rank of the replica (the controller's job)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, (dist.get_rank(), result is not None), group=group)
    src = next(rank for rank, has in flags if has)
    rows, width = part["input_ids"].shape
    routed = torch.zeros(rows, width, len(layout.moe_layers), layout.topk, dtype=torch.int32)
    mask = torch.zeros(rows, width, dtype=torch.int32)
    if result is not None:
        routed, mask = result["routed_experts"].to(torch.int32), result["routing_mask"].to(torch.int32)
    dist.broadcast(routed, src=src, group=group)
    dist.broadcast(mask, src=src, group=group)
    return {"routed_experts": routed.to(layout.dtype), "routing_mask": mask.to(torch.uint8)}


def replay_gradients(
    path: str, layout, batch: Batch, loss_weights: torch.Tensor, max_tokens: int = 64, recompute: bool = False
):
    """One update replaying the batch's routed_experts (with activation recomputation if asked): (metrics, the
    largest |gradient| of any router weight on this rank, or None where the rank holds no router)."""
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.workers.policy import update_policy
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model_settings, optim = settings_for(path, layout)
    model_settings.recompute = recompute
    model = build_role_model(model_settings, optimizer=optim, total_steps=10)
    grads: list[float] = []

    def keep_router_grads():
        for chunk in model.chunks:
            for name, param in chunk.named_parameters():
                if name.endswith("router.weight"):
                    grads.append(float(param.main_grad.abs().max()))

    step = model.optimizer.step

    def step_and_look():
        keep_router_grads()
        return step()

    model.optimizer.step = step_and_look
    old_logprobs = torch.zeros(batch["input_ids"].shape)
    _, part = _dp_part(batch.with_tensors(loss_weights=loss_weights, old_logprobs=old_logprobs))
    metrics = update_policy(model, part, PolicyLoss(PolicyLossConfig()), max_tokens=max_tokens)
    return metrics, max(grads) if grads else None


def trainer_logprobs_against_engine(path: str, layout, batch: Batch, dtype: str = "bfloat16", max_tokens: int = 256):
    """The actor's log-probs of a rollout batch with live routing (compared with the engine's) and with the engine's
    routing replayed: from output ranks (dp rank, live, replayed, agree counts, compared counts)."""
    from megarl.workers.policy import compute_logprobs
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model = build_role_model(settings_for(path, layout, dtype=dtype)[0])
    dp_rank, part = _dp_part(batch)
    live = compute_logprobs(model, part, max_tokens=max_tokens, routing="observe")
    replayed = compute_logprobs(model, part, max_tokens=max_tokens, routing="replay")
    if live is None:
        return None
    return dp_rank, live["logprobs"], replayed["logprobs"], live["routing_agree"], live["routing_observed"]
