"""Megatron-Core decorates its fused kernels (bias-GeLU, bias-SwiGLU, ...) with `torch.compile` at import time
(`megatron.core.jit.jit_fuser`). Applying the decorator imports TorchDynamo and TorchInductor: 1.2 of the 2.2 s
that importing Megatron takes on the development machines, paid by every process that imports it (each training
worker, each conversion), while a CPU run never calls those kernels and a GPU run compiles them on first call anyway.

`install()` (run by `import megarl`) makes Megatron's `jit_fuser` lazy: the decorated function is handed to
`torch.compile`, with the same arguments, the first time it is called. Nothing else of torch or of the user's code
changes: the hook touches only the attribute of `megatron.core.jit` right after that module runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megarl.runtime.import_hook import after_import

TARGET = "megatron.core.jit"


def lazy(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator like `compile_fn` (torch.compile: `@d`, `@d(**options)`, `d(fn, **options)`) that calls it on
    the first call of the decorated function."""

    def decorate(fn: Callable[..., Any] | None = None, **options: Any):
        if fn is None:
            return lambda f: decorate(f, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return decorate


def _make_lazy(module) -> None:
    import torch

    if getattr(module, "jit_fuser", None) is torch.compile:
        module.jit_fuser = lazy(torch.compile)


def install() -> None:
    """Put the hook in front of the import system, once; a no-op when Megatron's jit module is already loaded."""
    after_import(TARGET, _make_lazy)
