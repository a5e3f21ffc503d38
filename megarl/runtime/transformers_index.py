"""transformers builds the index of its lazy imports (which module defines which name, for 400+ model families) by
reading the source of every model file, on every import, in every process: 3.3 s of CPU per process on the
development machines. A megarl run imports transformers in the driver, in every training worker and in every
engine worker, so on a small machine this alone is several seconds of the start-up.

`install()` (run by `import megarl`) keeps that index on disk: `define_import_structure(path, prefix)` is answered
from `<megarl cache>/transformers-index-<version>.pkl` when the file was written by the same transformers version
from the same installation (its folder and the mtime of its `models/` folder, which changes when a model family is
added or removed), and computed by transformers itself otherwise (then written, atomically, for the next process).
The index is a pure function of the installed files; the hook touches nothing else.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from megarl.runtime.import_hook import after_import

TARGET = "transformers.utils.import_utils"


class _Index:
    """The cached answers of one process: loaded from disk at the first call, written back after a miss."""

    def __init__(self, module):
        package = Path(module.__file__).resolve().parents[1]  # .../transformers
        models = package / "models"
        version = _version(package)
        self.stamp = (version, str(package), models.stat().st_mtime_ns if models.is_dir() else 0)
        self.file = _cache_file(version)
        self.entries: dict[tuple[str, str | None], Any] | None = None

    def _load(self) -> dict:
        try:
            with self.file.open("rb") as f:
                stamp, entries = pickle.load(f)
            if stamp == self.stamp and isinstance(entries, dict):
                return entries
        except Exception:  # missing, from another installation, or damaged: recomputed
            pass
        return {}

    def _store(self) -> None:
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=self.file.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((self.stamp, self.entries), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.file)  # a reader sees the old file or the new one, never half of one
        except OSError:  # a read-only cache only costs the time it would have saved
            pass

    def wrap(self, define):
        @functools.wraps(define)
        def cached(module_path, prefix=None):
            if self.entries is None:
                self.entries = self._load()
            key = (str(module_path), prefix)
            if key not in self.entries:
                self.entries[key] = define(module_path, prefix)
                self._store()
            return self.entries[key]

        return cached


def _version(package: Path) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:  # a source checkout on sys.path
        return f"source-{package.stat().st_mtime_ns}"


def _cache_file(version: str) -> Path:
    from megarl.runtime.cache import cache_dir

    return cache_dir() / f"transformers-index-{version}.pkl"


def _cache_index(module) -> None:
    define = getattr(module, "define_import_structure", None)
    if define is not None:
        module.define_import_structure = _Index(module).wrap(define)


def install() -> None:
    """Put the hook in front of the import system, once; a no-op when transformers is already loaded or when
    MEGARL_NO_TRANSFORMERS_INDEX is set."""
    if not os.environ.get("MEGARL_NO_TRANSFORMERS_INDEX"):
        after_import(TARGET, _cache_index)
