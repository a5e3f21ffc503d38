"""Per-GPU memory of a Megatron role (actor, critic, ref, reward model) at its parallel layout.

Per parameter a rank holds (P_dense non-expert, P_expert routed-expert parameters of its busiest pipeline stage):
- parameters: P x dtype bytes (bf16: 2);
- gradients (trained roles): P x 4: Megatron DDP accumulates into fp32 `main_grad` buffers (megarl sets
  grad_reduce_in_fp32), the full buffer on every rank even with the distributed optimizer;
- Adam states (trained roles): fp32 m and v (8 bytes) plus an fp32 master copy for bf16/fp16 parameters (4): 12
  bytes (8 for fp32 parameters). The distributed optimizer shards them over the data-parallel ranks: dense
  parameters over dp x cp = world / (tp pp), expert parameters over the expert-DP ranks = world / (ep etp pp).
  With optimizer CPU offload they live in host memory (as 16 bytes per sharded parameter: master, m, v and the
  gradient copy the CPU optimizer steps on);
- activations: megarl/plan/activations.py.

Frozen roles (ref, a reward model during RL) hold parameters only and run forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError
from megarl.plan.activations import ActivationLayout, forward_activation_bytes, train_activation_bytes
from megarl.plan.model_size import ModelShape, StageParams, dtype_bytes, stage_params
from megarl.runtime.stages import StageLayout
from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings

GRAD_BYTES = 4
ADAM_MOMENTS_BYTES = 8
MASTER_WEIGHT_BYTES = 4
HOST_OPTIMIZER_BYTES = 16
GB = 2**30
"""Sizes in the report are GB of 2^30 bytes, as torch.cuda and nvidia-smi (MiB / 1024) count them."""


@dataclass(frozen=True)
class RoleLayout:
    """A role's parallel layout over its `world` GPUs, data parallelism included."""

    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    cp: int
    sequence_parallel: bool
    world: int
    first: int | None = None
    """Layers of an uneven first pipeline stage (None: even stages)."""
    last: int | None = None
    """Layers of an uneven last pipeline stage."""

    @property
    def stages(self) -> StageLayout:
        return StageLayout(self.pp, self.vpp, self.first, self.last)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp * self.pp)

    def describe(self, moe: bool) -> str:
        axes = [f"tp {self.tp}", f"pp {self.pp}", f"vpp {self.vpp}"]
        if self.first is not None or self.last is not None:
            axes[1] += f" (first {self.first or 'even'}, last {self.last or 'even'} layers)"
        if moe:
            axes += [f"ep {self.ep}", f"etp {self.etp}"]
        axes += [f"cp {self.cp}", f"dp {self.dp}"]
        if moe:
            axes.append(f"expert-dp {self.expert_dp}")
        if self.sequence_parallel:
            axes.append("sp")
        return " | ".join(axes)


def resolve_layout(settings: ModelSettings, world: int, key: str, shape: ModelShape, hf_config) -> RoleLayout:
    """The role's layout at `world` GPUs; UserError naming `{key}.parallel.<axis>` when it cannot be built."""
    from megarl.models.layout import check_parallel_layout
    from megarl.models.registry import get_architecture

    par = settings.parallel
    prefix = f"{key}.parallel."
    check_parallel_layout(get_architecture(hf_config.model_type), hf_config, par, prefix=prefix)
    etp = par.etp if par.etp is not None else par.tp
    if world % (par.tp * par.pp * par.cp):
        raise UserError(
            f"{prefix}tp x pp x cp = {par.tp} x {par.pp} x {par.cp} = {par.tp * par.pp * par.cp} does not divide the "
            f"role's {world} GPUs (placement.train_gpus)"
        )
    if shape.moe and world % (par.ep * etp * par.pp):
        raise UserError(
            f"{prefix}ep x etp x pp = {par.ep} x {etp} x {par.pp} = {par.ep * etp * par.pp} does not divide the "
            f"role's {world} GPUs (placement.train_gpus): the expert layout must tile them"
        )
    return RoleLayout(
        par.tp,
        par.pp,
        par.vpp,
        par.ep,
        etp,
        par.cp,
        par.sequence_parallel,
        world,
        par.pp_first_stage_layers,
        par.pp_last_stage_layers,
    )


@dataclass(frozen=True)
class RoleMemory:
    """One GPU of a role, at its busiest pipeline stage."""

    role: str
    layout: RoleLayout
    trainable: bool
    stage: int
    params: StageParams
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    """On the GPU (0 when offloaded)."""
    optimizer_host_bytes: float
    """In host memory (optimizer CPU offload)."""
    activation_bytes: float
    train_tokens: int
    forward_tokens: int
    recompute: bool
    dtype: str
    distributed_optimizer: bool
    offload_optimizer: bool

    @property
    def states_bytes(self) -> float:
        """What the role holds on the GPU while it is loaded, activations aside."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def active_bytes(self) -> float:
        return self.states_bytes + self.activation_bytes

    def host_bytes_when_offloaded(self) -> float:
        """Host memory of this GPU's share while the role is offloaded (colocated turns) plus CPU optimizer."""
        moved = self.param_bytes + (0 if self.offload_optimizer else self.optimizer_bytes)
        return (moved if self.trainable else 0.0) + self.optimizer_host_bytes


def role_memory(
    role: str,
    shape: ModelShape,
    layout: RoleLayout,
    settings: ModelSettings,
    micro_batch: MicroBatchSettings,
    optimizer: OptimizerSettings | None,
    longest_sample: int,
    head: str = "lm",
) -> RoleMemory:
    """The memory of one GPU of the role at its busiest pipeline stage.

    optimizer: None for a frozen role. longest_sample: tokens of the longest sample (prompt + response); a
    micro-batch holds at least one sample, whatever its token budget.
    """
    trainable = optimizer is not None
    train_tokens = max(micro_batch.max_tokens, longest_sample)
    forward_tokens = max(micro_batch.forward_budget, longest_sample)
    act_layout = ActivationLayout(
        layout.tp,
        layout.pp,
        layout.vpp,
        layout.etp,
        layout.cp,
        layout.sequence_parallel,
        recompute=settings.recompute and trainable,
        first=layout.first,
        last=layout.last,
        logit_chunk=micro_batch.logprob_chunk_tokens if head == "lm" else 0,
    )
    padded = shape.padded_vocab(settings.vocab_multiple, layout.tp)
    lm = head == "lm"
    p_bytes = dtype_bytes(settings.dtype)
    best: RoleMemory | None = None
    for stage in range(layout.pp):
        params = stage_params(
            shape,
            tp=layout.tp,
            pp=layout.pp,
            vpp=layout.vpp,
            ep=layout.ep,
            etp=layout.etp,
            stage=stage,
            first=layout.first,
            last=layout.last,
            vocab_multiple=settings.vocab_multiple,
            head=head,
        )
        forward = forward_activation_bytes(shape, act_layout, forward_tokens, stage, padded, lm)
        grads = opt_gpu = opt_host = 0.0
        activations = forward
        if trainable:
            grads = params.total * GRAD_BYTES
            per_param = ADAM_MOMENTS_BYTES + (MASTER_WEIGHT_BYTES if p_bytes < 4 else 0)
            dense_shards = layout.world // (layout.tp * layout.pp) if optimizer.use_distributed_optimizer else 1
            expert_shards = layout.expert_dp if optimizer.use_distributed_optimizer else 1
            sharded = params.dense / dense_shards + params.expert / expert_shards
            if optimizer.offload_optimizer:
                opt_host = sharded * HOST_OPTIMIZER_BYTES
            else:
                opt_gpu = sharded * per_param
            train = train_activation_bytes(shape, act_layout, train_tokens, stage, padded, lm)
            activations = max(train, forward)
        memory = RoleMemory(
            role=role,
            layout=layout,
            trainable=trainable,
            stage=stage,
            params=params,
            param_bytes=params.total * p_bytes,
            grad_bytes=grads,
            optimizer_bytes=opt_gpu,
            optimizer_host_bytes=opt_host,
            activation_bytes=activations,
            train_tokens=train_tokens,
            forward_tokens=forward_tokens,
            recompute=act_layout.recompute,
            dtype=settings.dtype,
            distributed_optimizer=bool(optimizer and optimizer.use_distributed_optimizer),
            offload_optimizer=bool(optimizer and optimizer.offload_optimizer),
        )
        if best is None or memory.active_bytes > best.active_bytes:
            best = memory
    assert best is not None
    return best
