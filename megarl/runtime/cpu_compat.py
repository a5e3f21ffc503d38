"""Run Megatron-Core on machines without CUDA.

Megatron-Core assumes a GPU in a handful of places. Each entry below redirects one of them to the CPU; nothing
else in megarl knows about it. `activate()` does nothing when CUDA is present, and is idempotent.

What is redirected, and why:
- tensor factories, `torch.device(...)` and `.to()` / `.cuda()` with a CUDA device (causal masks, pipeline-schedule
  counters, rotary frequencies): one `TorchFunctionMode` maps every CUDA device argument to the CPU.
- `torch.cuda.current_device()` answers 0 (instead of raising), which the mode above then maps to the CPU.
- the CUDA RNG (`torch.cuda.manual_seed`, `get/set_rng_state`, Megatron's `tensor_parallel.random` helpers) becomes
  the CPU generator, so Megatron's RNG tracker forks CPU states the way it forks CUDA states on a GPU.
- `torch.cuda.synchronize()` is a no-op.
- custom autograd functions' backward (run by the autograd engine without the caller's modes) runs under the mode.
- flags that claim Transformer Engine where it is absent: `moe_utils.te_general_gemm` must be None and
  `multi_latent_attention.HAVE_TE` must be False.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_active_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare int names a CUDA ordinal
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device argument of a torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device and args and _is_cuda_device(args[0]):
            return torch.device("cpu")  # e.g. `with torch.device(torch.cuda.current_device()):`
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


# These act on the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.default_generator.set_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = _cpu_get_rng_state
        module.set_rng_state = _cpu_set_rng_state
        module.manual_seed = _cpu_manual_seed


def _patch_megatron() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_get_rng_state
    random._set_cuda_rng_state = _cpu_set_rng_state

    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm") or not _have_transformer_engine():
        moe_utils.te_general_gemm = None

    if not _have_transformer_engine():
        mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
        mla.HAVE_TE = False


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def is_active() -> bool:
    return _active_mode is not None


def activate() -> bool:
    """Redirect Megatron-Core's CUDA uses to the CPU when CUDA is absent. Returns whether the layer is active.

    The function mode is entered for the calling thread and stays for the life of the process: call this from the
    main thread of a worker process before building models.
    """
    global _active_mode
    if torch.cuda.is_available():
        return False
    if _active_mode is None:
        # GPU tuning advice that cannot apply here.
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
        _patch_torch_cuda()
        _patch_megatron()
        _active_mode = CudaToCpuMode()
        _active_mode.__enter__()
        _patch_custom_backward()
    return True


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Torch calls inside run without the mode: code that never names CUDA (a transformers model on the CPU, e.g.
    the hybrid engine's generation) does not pay the mode's Python call on every op."""
    from torch.overrides import _get_current_function_mode

    if _active_mode is None or _get_current_function_mode() is not _active_mode:
        yield
        return
    _active_mode.__exit__(None, None, None)
    try:
        yield
    finally:
        _active_mode.__enter__()


def _patch_custom_backward() -> None:
    """The autograd engine runs backward without the caller's torch function modes, and Megatron's custom autograd
    functions create CUDA tensors in their backward too (the expert-parallel all-gather, activation recomputation):
    their backward runs under the mode as well."""
    from torch.autograd.function import BackwardCFunction

    run_backward = BackwardCFunction.apply

    def apply(self, *args):
        with CudaToCpuMode():
            return run_backward(self, *args)

    BackwardCFunction.apply = apply
