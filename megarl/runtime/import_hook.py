"""Patch a module right after it runs, before anything imports from it: the one mechanism behind megarl's import-time
fixes of other packages (megarl/runtime/lazy_compile.py, megarl/runtime/transformers_index.py)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self.loader = loader
        self.patch = patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[ModuleType], None]):
        self.target = target
        self.patch = patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.patch)
        return spec


def after_import(target: str, patch: Callable[[ModuleType], None]) -> None:
    """Run `patch(module)` once module `target` has run, when it is first imported. A no-op when it is loaded
    already or a hook for it is in place."""
    if target in sys.modules or any(isinstance(f, _Finder) and f.target == target for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(target, patch))
