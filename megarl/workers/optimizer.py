"""One optimizer interface for the trained roles: Megatron's optimizer on GPU, a torch AdamW on CPU.

Megatron-Core's optimizers assert CUDA tensor types (distributed optimizer, gradient clipping), so on a CPU machine
the same interface is backed by `torch.optim.AdamW` with fp32 main parameters, global-norm clipping across the
model-parallel ranks (each weight counted once), and the same learning-rate schedule. Both read gradients from
Megatron DDP's buffers (`param.main_grad`), after `finalize_model_grads` has summed them over data parallelism.

Both check the global gradient norm before stepping (Megatron's optimizer alone would step on NaN gradients in
bf16, where no grad scaler looks for them): a non-finite norm on any rank skips the step on every rank of the role
(agreed by an all-reduce), zeroes the gradients and is reported; after `max_consecutive_skips` skips in a row the
step raises `NonFiniteGradients`, naming the step and the first parameter whose gradient is non-finite.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.runtime import cpu_compat
from megarl.runtime.device import collective_device
from megarl.runtime.distributed import all_reduce
from megarl.workers.config import OptimizerSettings


class NonFiniteGradients(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite gradient norm: the run stops (a restart would not help)."""


@dataclass
class StepResult:
    updated: bool
    """False when the step was skipped (non-finite gradients)."""
    grad_norm: float
    """Global gradient norm before clipping (over every model-parallel rank)."""
    lr: float


def lr_at(step: int, settings: OptimizerSettings, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then constant, linear or cosine decay
    from lr to min_lr over `decay_steps` (or the rest of `total_steps`)."""
    if settings.warmup_steps and step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    decay_steps = settings.decay_steps or max(total_steps - settings.warmup_steps, 1)
    progress = min(max(step - settings.warmup_steps, 0) / decay_steps, 1.0)
    if settings.decay_style == "constant":
        return settings.lr
    if settings.decay_style == "linear":
        scale = 1.0 - progress
    else:
        scale = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.min_lr + (settings.lr - settings.min_lr) * scale


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 1 or name.endswith(".bias")


class RoleOptimizer(ABC):
    """What a trained role needs from its optimizer."""

    def __init__(self, settings: OptimizerSettings, chunks: list[torch.nn.Module], total_steps: int):
        self.settings = settings
        self.total_steps = total_steps
        self.num_steps = 0
        """Optimizer steps taken (skipped steps included: the schedule does not stall on a bad batch)."""
        self.consecutive_skips = 0
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self._names = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}

    @property
    def lr(self) -> float:
        return lr_at(self.num_steps, self.settings, self.total_steps)

    @torch.no_grad()
    def step(self) -> StepResult:
        """Check the global gradient norm; skip (every rank) if it is non-finite, else clip and apply the gradients
        in the DDP buffers. The LR schedule advances either way."""
        # plain torch on the role's own device: without the CPU compatibility mode's Python call on each of its
        # ~300 tensor calls and attribute reads (0.7 ms a step at the quickstart size; nothing when CUDA is present)
        with cpu_compat.paused():
            return self._step()

    def _step(self) -> StepResult:
        lr, grads = self.lr, [_grad_of(p) for p in self.params]
        grad_norm = global_grad_norm(self.params, grads)
        self.num_steps += 1
        if not _finite_on_every_rank(grad_norm):
            self.consecutive_skips += 1
            first_bad = next((self._names.get(id(p), "?") for p, g in zip(self.params, grads) if _nonfinite(g)), None)
            for grad in grads:
                if grad is not None:
                    grad.zero_()
            limit = self.settings.max_consecutive_skips
            if limit and self.consecutive_skips >= limit:
                where = f"first non-finite gradient: {first_bad}" if first_bad else "this rank's gradients are finite"
                raise NonFiniteGradients(
                    f"{self.consecutive_skips} optimizer steps in a row had a non-finite gradient norm (the last: "
                    f"optimizer step {self.num_steps}, norm {grad_norm}; {where}); stopping "
                    f"(optim.max_consecutive_skips={limit}). Each was skipped, so no weight is non-finite."
                )
            return StepResult(False, grad_norm, lr)
        self.consecutive_skips = 0
        self._apply(lr, grad_norm)
        return StepResult(True, grad_norm, lr)

    @abstractmethod
    def _apply(self, lr: float, grad_norm: float) -> None:
        """Clip and apply finite gradients at learning rate `lr`."""

    @abstractmethod
    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The optimizer state as Megatron sharded tensors keyed after the model's (any layout can load it)."""

    @abstractmethod
    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Restore from what `dist_checkpointing.load(self.sharded_state_dict(...))` returned."""

    def offload(self) -> None:
        """Move optimizer state off the accelerator (colocated roles take turns on the GPUs)."""
        return None

    def onload(self) -> None:
        return None


class TorchRoleOptimizer(RoleOptimizer):
    """AdamW over fp32 main parameters (the model's own parameters when they are fp32)."""

    def __init__(self, settings: OptimizerSettings, chunks: list[torch.nn.Module], total_steps: int):
        super().__init__(settings, chunks, total_steps)
        names = self._names
        # fp32 masters only for low-precision parameters; fp32 parameters are their own masters.
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        decay, no_decay = [], []
        for param, master in zip(self.params, self.masters):
            (no_decay if _no_weight_decay(names.get(id(param), ""), param) else decay).append(master)
        groups = [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=self.lr,
            betas=(settings.beta1, settings.beta2),
            eps=settings.eps,
            foreach=True,  # torch picks the per-tensor loop on a CPU: one op per tensor and state, slower
        )

    def _apply(self, lr: float, grad_norm: float) -> None:
        for param, master in zip(self.params, self.masters):
            grad = _grad_of(param)
            grad = torch.zeros_like(master) if grad is None else grad
            master.grad = grad.float() if grad.dtype != torch.float32 else grad
        if self.settings.clip_grad > 0 and grad_norm > self.settings.clip_grad:
            scale = self.settings.clip_grad / (grad_norm + 1e-6)
            torch._foreach_mul_([master.grad for master in self.masters], scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for param, master in zip(self.params, self.masters):
            if param is not master:
                param.copy_(master)
        for master in self.masters:
            master.grad = None  # the DDP buffer owns the gradient memory; do not keep views of it

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        # Sharded tensors reference the model's parameters; the optimizer holds the masters in the same order.
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(self._params_in_group_order()))
        step = _common_step(state)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return {"optimizer": state, "num_steps": self.num_steps, "adam_step": step}

    def _params_in_group_order(self) -> list[torch.Tensor]:
        model_param_of = {id(m): p for p, m in zip(self.params, self.masters)}
        return [model_param_of[id(m)] for g in self.optimizer.param_groups for m in g["params"]]

    def _init_state(self) -> None:
        """Create zero Adam states so a checkpoint has shapes to load into."""
        for group in self.optimizer.param_groups:
            for master in group["params"]:
                state = self.optimizer.state[master]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(master)
                    state["exp_avg_sq"] = torch.zeros_like(master)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        state = state_dict["optimizer"]
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(state_dict["adam_step"]))
        # Hyperparameters come from the current settings, not the checkpoint.
        state["param_groups"] = [
            {**saved, **{k: v for k, v in live.items() if k != "params"}}
            for saved, live in zip(state["param_groups"], self.optimizer.state_dict()["param_groups"])
        ]
        self.optimizer.load_state_dict(state)
        self.num_steps = int(state_dict["num_steps"])


def _common_step(state: dict) -> float:
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer steps differ between parameters: {sorted(steps)}")
    return steps.pop() if steps else 0.0


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient Megatron DDP accumulated for `param` (its fp32 `main_grad` buffer view), else `.grad`."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _nonfinite(grad: torch.Tensor | None) -> bool:
    return grad is not None and not bool(torch.isfinite(grad).all())


def _finite_on_every_rank(grad_norm: float) -> bool:
    """All ranks of the role agree to step or to skip (with a distributed optimizer each DP rank holds only its
    shard of the gradients, so ranks could see different norms)."""
    flag = torch.tensor([0.0 if math.isfinite(grad_norm) else 1.0], device=collective_device())
    all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


def global_grad_norm(params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """L2 norm of the gradients of the whole model: every weight counted once (tensor-parallel replicas and the
    copy of a tied embedding on the last pipeline stage excluded), summed over the model-parallel ranks; experts
    over the expert-parallel ranks. Gradients are already reduced over data parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    etp_rank = ps.get_expert_tensor_parallel_rank()
    counted: tuple[list, list] = ([], [])  # [dense, expert] gradients
    for param, grad in zip(params, grads):
        if grad is None or not param_is_not_shared(param):
            continue
        expert = not getattr(param, "allreduce", True)  # Megatron marks expert weights allreduce=False
        split = getattr(param, "tensor_model_parallel", False)
        duplicate = not split and etp_rank > 0 if expert else not param_is_not_tensor_parallel_duplicate(param)
        if not duplicate:
            counted[int(expert)].append(grad)
    device = collective_device()
    # one multi-tensor norm per kind (not four ops per tensor); the squares summed in float64
    dense, expert = (
        torch.stack(torch._foreach_norm(grads)).double().pow(2).sum().reshape(1).to(device)
        if grads
        else torch.zeros(1, dtype=torch.float64, device=device)
        for grads in counted
    )
    all_reduce(dense, group=ps.get_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1:
        all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    else:
        all_reduce(expert, group=ps.get_pipeline_model_parallel_group())
    return math.sqrt(float(dense + expert))  # one deliberate host sync per step: the skip decision needs it


class MegatronRoleOptimizer(RoleOptimizer):
    """Megatron-Core's optimizer (GPU): mixed precision with fp32 main weights, optional distributed optimizer."""

    def __init__(self, settings: OptimizerSettings, chunks: list[torch.nn.Module], total_steps: int):
        super().__init__(settings, chunks, total_steps)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = chunks[0].config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=settings.lr,
                min_lr=settings.min_lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.beta1,
                adam_beta2=settings.beta2,
                adam_eps=settings.eps,
                clip_grad=settings.clip_grad,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=settings.use_distributed_optimizer,
                # Megatron moves nothing unless told what fraction to offload, and keeps fp32 masters on the GPU
                # unless the optimizer is precision-aware.
                optimizer_cpu_offload=settings.offload_optimizer,
                optimizer_offload_fraction=1.0 if settings.offload_optimizer else 0.0,
                use_precision_aware_optimizer=settings.offload_optimizer,
                overlap_cpu_optimizer_d2h_h2d=settings.offload_optimizer,
            ),
            chunks,
        )

    def _apply(self, lr: float, grad_norm: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()  # clips by its own norm, the same one (fp32 main gradients, every weight once)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        return {
            "optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading),
            "num_steps": self.num_steps,
        }

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.num_steps = int(state_dict["num_steps"])

    def offload(self) -> None:
        self.optimizer.offload_to_cpu()

    def onload(self) -> None:
        self.optimizer.restore_from_cpu()


def build_optimizer(settings: OptimizerSettings, chunks: list[torch.nn.Module], total_steps: int) -> RoleOptimizer:
    """Megatron's optimizer where CUDA is present, the torch one elsewhere; `chunks` are DDP-wrapped."""
    cls = MegatronRoleOptimizer if torch.cuda.is_available() else TorchRoleOptimizer
    return cls(settings, chunks, total_steps)
