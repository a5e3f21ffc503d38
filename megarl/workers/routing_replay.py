"""Routing replay (R3) in the Megatron roles: force the experts the rollout engine chose, per token and MoE layer.

Megatron-Core's routers call `router_replay.get_replay_topk(scores, topk, ..., default_compute_topk)` for their
top-k choice when a `RouterReplay` is attached (`TopKRouter.router_replay`, mcore >= 0.16). `ReplayRouter`
subclasses it, one per MoE layer of a model, attached by `attach_replay_routers` (kept out of mcore's process-global
instance list: the actor and ref models of one process must not share it). For each micro-batch the step function
calls `RoutingReplay.prepare(chunk, tensors)`, which gives every router of the chunk its rows of `routed_experts`
in Megatron's token order. Then, by mode:
- `observe`: live routing; counts tokens whose live top-k set equals the engine's (routing agreement);
- `replay`: the engine's experts where `routing_mask` is 1 (live elsewhere); the weights are the live scores of the
  replayed experts (`scores.gather`), so gradients still reach the router; counts agreement too;
- `record`: live routing; keeps the chosen experts (algorithm.routing_replay=old_logprob); counts agreement with
  the batch's routed_experts when it has them.

Activation recomputation runs the forward again inside backward: there each router takes the oldest targets it was
given (mcore's `replay_backward_list`, first in first out, the order 1F1B runs backwards in) instead of the latest.

Token order: Megatron's router sees [s, b] flattened s-major (row = t * b + i); with sequence parallelism each TP
rank sees its own 1/tp of the sequence. Shapes: b rows, s columns of a micro-batch; L MoE layers, k top-k; T tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.models.context_parallel import context_split
from megarl.models.moe import RoutingLayout

MODES = ("observe", "replay", "record")


def _in_backward() -> bool:
    """True inside autograd's backward (where activation recomputation runs the forward again)."""
    return torch._C._current_graph_task_id() != -1


def _replay_base():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


class ReplayRouter(_replay_base()):
    """One MoE layer's replay: targets per micro-batch, the live choice compared and (when replaying) overridden."""

    def __init__(self, moe_index: int):
        base = _replay_base()
        super().__init__()
        base.global_router_replay_instances.remove(self)  # owned by its model, not by the process
        self.moe_index = moe_index
        self.mode: str | None = None
        self.mask: torch.Tensor | None = None
        self.backward_masks: list[torch.Tensor] = []
        self.observed: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per forward call: (tokens whose live top-k equals the target [T] bool, tokens compared [T] bool)."""
        self.recorded: list[torch.Tensor] = []
        """Per forward call (record mode): the live choice [T, k]."""
        self.scored: torch.Tensor | None = None
        """This micro-batch's tokens whose routing changes a log-prob (all but each sample's last) [T] bool."""
        self.num_replayed = 0
        self.num_scored = 0

    def set_targets(self, target_Tk: torch.Tensor | None, mask_T: torch.Tensor | None, scored_T: torch.Tensor):
        self.set_target_indices(target_Tk)
        self.mask = mask_T
        self.backward_masks.append(mask_T)
        self.scored = scored_T

    def clear(self) -> None:
        self.clear_indices()
        self.mask, self.backward_masks, self.observed, self.recorded = None, [], [], []
        self.num_replayed = self.num_scored = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode is None:
            return live
        recomputing = _in_backward()
        if recomputing:  # the targets of the micro-batch being recomputed, oldest first
            target, mask = self.replay_backward_list.pop(0), self.backward_masks.pop(0)
        else:
            target, mask = self.target_topk_idx, self.mask
        live_idx = live[1]
        if self.mode == "record" and not recomputing:
            self.recorded.append(live_idx.detach())
        if target is None:
            return live
        target = target.to(live_idx.device, torch.long)
        same = (live_idx.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
        if not recomputing:
            self.observed.append((same & mask, mask))
        if self.mode in ("observe", "record"):
            return live
        # where the live set is the target already, keep its order: the weights then sum in the same order
        chosen = torch.where((mask & ~same)[:, None], target, live_idx)
        if not recomputing:  # device counters: read once, after the step (replayed_fraction)
            self.num_replayed = self.num_replayed + (mask & self.scored).sum()
            self.num_scored = self.num_scored + self.scored.sum()
        return scores.gather(1, chosen), chosen


def _layers_with_router(chunk: torch.nn.Module):
    module = getattr(chunk, "module", chunk)  # DDP-wrapped or bare
    for layer in module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            yield layer.layer_number - 1, router


def attach_replay_routers(chunks: Sequence[torch.nn.Module], layout: RoutingLayout) -> list[list[ReplayRouter]]:
    """A ReplayRouter on every router of every chunk (in layer order); per chunk the list of them."""
    per_chunk = []
    for chunk in chunks:
        routers = []
        for layer_id, router in _layers_with_router(chunk):
            if getattr(router.config, "moe_router_fusion", False):
                raise ValueError("routing replay needs moe_router_fusion=False (the fused kernel bypasses it)")
            router.router_replay = ReplayRouter(layout.moe_layers.index(layer_id))
            routers.append(router.router_replay)
        per_chunk.append(routers)
    return per_chunk


def scored_tokens(attention_mask_bs: torch.Tensor) -> torch.Tensor:
    """Every real token but each sample's last (whose routing changes no log-prob) [b, s] bool."""
    real = attention_mask_bs.bool()
    return torch.nn.functional.pad(real[:, 1:], (0, 1))


def megatron_token_order(values_bs: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, ...] -> [T, ...] in the order this rank's routers see the tokens (s-major; this TP rank's part of the
    sequence under sequence parallelism)."""
    values_sb = values_bs.transpose(0, 1)
    if sequence_parallel:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        part = values_sb.shape[0] // tp
        values_sb = values_sb[rank * part : (rank + 1) * part]
    return values_sb.reshape(-1, *values_sb.shape[2:])


class RoutingReplay:
    """The routers of a model's chunks, set up for one pass (log-probs or an update) in `mode`."""

    def __init__(self, chunks: Sequence[torch.nn.Module], routers: list[list[ReplayRouter]], mode: str):
        assert mode in MODES, mode
        self.mode = mode
        self._routers_of = {id(chunk): routers for chunk, routers in zip(chunks, routers)}
        self.routers = [router for chunk_routers in routers for router in chunk_routers]
        config = getattr(chunks[0], "module", chunks[0]).config
        self.sequence_parallel = bool(config.sequence_parallel)
        self.token_multiple = config.tensor_model_parallel_size if self.sequence_parallel else 1
        for router in self.routers:
            router.clear()
            router.mode = mode

    def prepare(self, chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Give the routers of `chunk` this micro-batch's targets (called right before its forward)."""
        split = context_split(tensors, self.token_multiple)

        def order(values_bs: torch.Tensor) -> torch.Tensor:  # context parallelism: this rank's tokens first
            if split is not None:
                values_bs = split.local_tokens(
                    values_bs.to(torch.uint8) if values_bs.dtype == torch.bool else values_bs
                )
            return megatron_token_order(values_bs, self.sequence_parallel)

        scored = order(scored_tokens(tensors["attention_mask"])).bool()
        routed = tensors.get("routed_experts")
        mask = order(tensors["routing_mask"].bool()).bool() if routed is not None else None
        for router in self._routers_of[id(chunk)]:
            target = order(routed[:, :, router.moe_index]) if routed is not None else None
            router.set_targets(target, mask, scored)

    def finish(self) -> None:
        """Back to live routing (the counts and records stay for the caller to read)."""
        for router in self.routers:
            router.mode = None
            router.clear_indices()
            router.backward_masks = []

    # ---- results ------------------------------------------------------------------------------------------------
    def agreement(self, micro_batches, num_rows: int, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample and MoE layer: (tokens whose live top-k set was the engine's, tokens compared) [B, L] int32,
        whole over the role's pipeline stages (and sequence-parallel ranks). A collective."""
        agree = torch.zeros(num_rows, num_layers, dtype=torch.int32)
        observed = torch.zeros_like(agree)
        for router in self.routers:
            forwards = iter(router.observed)
            for micro_batch in micro_batches:
                same_T, compared_T = next(forwards)
                rows = micro_batch.rows
                if rows:
                    agree[rows, router.moe_index] += self._per_row(same_T, micro_batch)
                    observed[rows, router.moe_index] += self._per_row(compared_T, micro_batch)
        counts = self._sum_over_model(torch.stack([agree, observed]), split_by_sequence=True)
        return counts[0], counts[1]

    def recorded(self, micro_batches, num_rows: int, width: int, layout: RoutingLayout) -> torch.Tensor:
        """record mode: the experts the live routers chose [B, width, L, k] (layout.dtype), whole over the role's
        pipeline stages and sequence-parallel ranks. A collective."""
        out = torch.zeros(num_rows, width, len(layout.moe_layers), layout.topk, dtype=torch.int32)
        for router in self.routers:
            for micro_batch, chosen_Tk in zip(micro_batches, router.recorded):
                rows = micro_batch.rows
                if not rows:
                    continue
                split = context_split(micro_batch.tensors, self.token_multiple)
                b = 1 if split is not None else micro_batch.tensors["input_ids"].shape[0]
                chosen_bsk = self._whole_sequence(chosen_Tk.view(-1, b, layout.topk)).transpose(0, 1)
                if split is not None:  # this CP rank's tokens -> the micro-batch's rows (a collective over CP)
                    chosen_bsk = split.gather_tokens(chosen_bsk)
                out[rows, : chosen_bsk.shape[1], router.moe_index] = chosen_bsk[: len(rows)].to("cpu", torch.int32)
        return self._sum_over_model(out, split_by_sequence=False).sort(dim=-1).values.to(layout.dtype)

    def replayed_fraction(self) -> float:
        """The fraction of (scored token, MoE layer) selections that were replayed in this pass, over the role."""
        from megatron.core import parallel_state as ps
        from torch import distributed as dist

        from megarl.runtime.device import collective_device

        counts = torch.tensor(
            [float(sum(r.num_replayed for r in self.routers)), float(sum(r.num_scored for r in self.routers))],
            dtype=torch.float64,
        )  # the pass's one host sync of these counters
        if not self.sequence_parallel and ps.get_tensor_model_parallel_rank() != 0:
            counts.zero_()  # TP ranks see the same tokens: count them once
        counts = counts.to(collective_device())
        dist.all_reduce(counts)
        replayed, scored = counts.tolist()
        return replayed / scored if scored else 0.0

    def _per_row(self, values_T: torch.Tensor, micro_batch) -> torch.Tensor:
        """Per-token counts as this rank's routers saw them [T] -> their sums over each of the micro-batch's rows."""
        rows = micro_batch.rows
        split = context_split(micro_batch.tensors, self.token_multiple)
        if split is None:
            b = micro_batch.tensors["input_ids"].shape[0]
            return values_T.view(-1, b).sum(0)[: len(rows)].to("cpu", torch.int32)
        row_T = megatron_token_order(split.local_rows(), self.sequence_parallel)
        kept = (row_T >= 0) & (row_T < len(rows))
        counts = torch.zeros(len(rows), dtype=torch.int32)
        return counts.index_add_(0, row_T[kept], values_T.cpu()[kept].to(torch.int32))

    def _whole_sequence(self, values_sb: torch.Tensor) -> torch.Tensor:
        """[s / tp, ...] parts of the sequence-parallel ranks -> [s, ...] (as it is without sequence parallelism)."""
        if not self.sequence_parallel:
            return values_sb
        from megatron.core import parallel_state as ps
        from torch import distributed as dist

        from megarl.runtime.device import collective_device

        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(values_sb) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, values_sb.contiguous().to(collective_device(group)), group=group)
        return torch.cat(parts).to(values_sb.device)

    def _sum_over_model(self, counts: torch.Tensor, split_by_sequence: bool) -> torch.Tensor:
        """Sum over the pipeline stages (each holds its own layers) and, for counts over tokens that sequence
        parallelism split (`split_by_sequence`), over the TP ranks."""
        from megatron.core import parallel_state as ps
        from torch import distributed as dist

        from megarl.runtime.device import collective_device

        groups = [ps.get_pipeline_model_parallel_group()]
        if self.sequence_parallel and split_by_sequence:
            groups.append(ps.get_tensor_model_parallel_group())
        if split_by_sequence:  # context parallelism: each CP rank counted its own tokens
            groups.append(ps.get_context_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                moved = counts.to(collective_device(group))
                dist.all_reduce(moved, group=group)
                counts = moved.cpu()
        return counts
