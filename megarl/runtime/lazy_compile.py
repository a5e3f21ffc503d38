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
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

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


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = lazy(torch.compile)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Put the hook in front of the import system, once; a no-op when Megatron's jit module is already loaded."""
    if TARGET in sys.modules or any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
