"""Atomic output folders: write under a hidden temporary name, rename into place only when complete.

A crash or an error leaves the destination as it was (absent, or the previous version), never half-written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megarl.errors import UserError
from megarl.runtime.folders import check_writable_folder


def check_destination(dst: str | Path, overwrite: bool, sources: tuple[str | Path, ...] = ()) -> Path:
    """Refuse an existing destination (unless overwrite), a missing parent, or a destination inside a source."""
    dst = Path(dst).resolve()
    if dst.exists() and not overwrite:
        raise UserError(f"{dst} already exists; pass --overwrite to replace it, or choose another destination")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} exists and is not a folder; remove it or choose another destination")
    if not dst.parent.is_dir():
        raise UserError(f"{dst.parent} does not exist: create it first, or choose another destination")
    check_writable_folder(dst.parent, "the destination's folder")  # the staged copy is written beside dst
    for src in sources:
        src = Path(src).resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise UserError(f"destination {dst} overlaps the source {src}; choose a separate folder")
    return dst


@contextmanager
def staged_folder(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dst`; on success it replaces `dst`, on any error it is removed."""
    dst = check_destination(dst, overwrite)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dst)
