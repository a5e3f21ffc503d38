"""One rank's share of a role's Megatron model: built from a HF folder or a megarl checkpoint, wrapped in Megatron
DDP and given an optimizer when the role trains.

Parallel state must already be initialized at the role's layout. Trained roles are built with
`calculate_per_token_loss` (the schedule neither averages over micro-batches nor DDP over data-parallel ranks: the
loss functions weight every token by its share of the global mini-batch; see workers/schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.checkpoint.model_io import LoadedModel, load_model
from megarl.data.batch import Batch
from megarl.models.heads import Head
from megarl.models.hf_config import parse_dtype
from megarl.models.moe import RoutingLayout
from megarl.workers.config import ModelSettings, OptimizerSettings
from megarl.workers.optimizer import RoleOptimizer, build_optimizer
from megarl.workers.routing_replay import ReplayRouter, RoutingReplay, attach_replay_routers


@dataclass
class RoleModel:
    loaded: LoadedModel
    """The bare model chunks, their weight table (bridge) and the HF config / vocabulary."""
    chunks: list[torch.nn.Module]
    """What runs forward: the DDP-wrapped chunks when trained, the bare ones otherwise."""
    optimizer: RoleOptimizer | None
    settings: ModelSettings
    _offloaded: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(("params", "grads", "optimizer"), False))
    """What `offload` moved off the accelerator and `onload` must bring back."""
    replay_routers: list[list[ReplayRouter]] = field(default_factory=list)
    """MoE models: the routing-replay hook of every router, per chunk (workers/routing_replay.py); [] if dense."""

    @property
    def routing_layout(self) -> RoutingLayout | None:
        moe = self.loaded.arch.moe
        return moe.routing_layout(self.loaded.hf_config) if moe is not None else None

    def routing_pass(self, mode: str, batch: Batch) -> RoutingReplay | None:
        """The routers set up for one pass: `observe` / `replay` the batch's routed_experts (None when it has none),
        `record` the live choice; None for a dense model or mode `off`."""
        if not self.replay_routers or mode == "off" or (mode != "record" and "routed_experts" not in batch):
            return None
        return RoutingReplay(self.chunks, self.replay_routers, mode)

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @property
    def vocab(self):
        return self.loaded.vocab

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Hand accelerator memory to a colocated rollout engine: gradient buffers freed, parameters and optimizer
        state moved to host memory (each as asked; what is offloaded already stays so). On a CPU-only machine
        parameters already live in host memory and stay put. Frozen roles (ref) offload their weights only."""
        cuda = torch.cuda.is_available()
        if not self.trainable:
            if params and cuda and not self._offloaded["params"]:
                for chunk in self.chunks:
                    chunk.to("cpu")
            self._offloaded["params"] |= params and cuda
            return
        for chunk in self.chunks:
            if grads and not self._offloaded["grads"]:
                chunk.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
            if params and cuda and not self._offloaded["params"]:
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    buffer.offload_to_cpu(move_params=True, move_grads=False)
        if optimizer and not self._offloaded["optimizer"]:
            self.optimizer.offload()
        self._offloaded["grads"] |= grads
        self._offloaded["params"] |= params and cuda
        self._offloaded["optimizer"] |= optimizer
        if cuda:
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back everything `offload` moved (a no-op when nothing is offloaded)."""
        cuda, offloaded = torch.cuda.is_available(), self._offloaded
        if not self.trainable:
            if offloaded["params"]:
                device = torch.device("cuda", torch.cuda.current_device())
                for chunk in self.chunks:
                    chunk.to(device)
        else:
            for chunk in self.chunks:
                if offloaded["params"]:
                    for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                        buffer.reload_from_cpu(move_params=True, move_grads=False)
                if offloaded["grads"]:
                    chunk.restore_grad_buffers(synchronize=cuda)
            if offloaded["optimizer"]:
                self.optimizer.onload()
        self._offloaded = dict.fromkeys(self._offloaded, False)


def role_config_overrides(settings: ModelSettings, trainable: bool, moe: bool) -> dict:
    """TransformerConfig fields a role sets on top of the architecture's."""
    overrides: dict = {"calculate_per_token_loss": trainable}
    # Pipeline stages exchange micro-batches trimmed to their own longest row, except where Megatron cannot:
    # its allgather token dispatcher (MoE without CUDA) refuses, and its interleaved schedule hangs in training
    # (shape messages mismatched, mcore 0.16.1). There micro-batches keep one shape (workers/schedule.py).
    parallel = settings.parallel
    if parallel.pp > 1 and parallel.vpp == 1 and not (moe and not torch.cuda.is_available()):
        overrides["variable_seq_lengths"] = True
        if not moe:
            overrides["moe_token_dispatcher_type"] = "alltoall"  # unused by dense models; Megatron checks it
    if settings.recompute and trainable:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return overrides


def build_role_model(
    settings: ModelSettings,
    head: Head = "lm",
    optimizer: OptimizerSettings | None = None,
    total_steps: int = 1,
    path: str | None = None,
) -> RoleModel:
    """Load the role's model at the current parallel layout; with `optimizer` settings it is trainable (DDP +
    optimizer). `path` overrides settings.path (e.g. resuming from a run checkpoint)."""
    parallel = settings.parallel
    trainable = optimizer is not None
    loaded = load_model(
        path or settings.path,
        parallel,
        parse_dtype(settings.dtype, key="model.dtype"),
        vocab_multiple=settings.vocab_multiple,
        head=head,
        config_overrides=role_config_overrides(settings, trainable, is_moe(settings.path if path is None else path)),
        spec_backend=settings.spec_backend,
    )
    routers = []
    if loaded.arch.moe is not None:
        routers = attach_replay_routers(loaded.chunks, loaded.arch.moe.routing_layout(loaded.hf_config))
    if not trainable:
        for chunk in loaded.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        return RoleModel(loaded, loaded.chunks, None, settings, replay_routers=routers)
    chunks = wrap_ddp(loaded.chunks, use_distributed_optimizer=optimizer.use_distributed_optimizer)
    return RoleModel(loaded, chunks, build_optimizer(optimizer, chunks, total_steps), settings, replay_routers=routers)


def is_moe(path: str) -> bool:
    from megarl.checkpoint.model_dir import hf_config_dir
    from megarl.models.hf_config import read_config_json
    from megarl.models.registry import get_architecture

    return get_architecture(read_config_json(hf_config_dir(path)).get("model_type")).moe is not None


def wrap_ddp(chunks: list[torch.nn.Module], use_distributed_optimizer: bool) -> list[torch.nn.Module]:
    """Megatron DDP: gradients accumulate in fp32 buffers (`param.main_grad`) and are summed over data-parallel
    ranks by `finalize_model_grads` after the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer and torch.cuda.is_available(),
    )
    return [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=index > 0,  # as Megatron-LM: only the first virtual chunk overlaps communication
        )
        for index, chunk in enumerate(chunks)
    ]
