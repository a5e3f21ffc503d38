"""Folders megarl will write (a run folder, a conversion's destination), checked before any work starts."""

from __future__ import annotations

import os
from pathlib import Path

from megarl.errors import UserError


def check_writable_folder(path: str | Path, key: str) -> None:
    """`path` is a folder megarl can create or write into, or a UserError naming `key`: not an existing file, and
    its nearest existing ancestor a writable folder (not on a read-only file system, not without permission)."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={str(path)!r} is an existing file, not a folder; give a folder path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key}={str(path)!r} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK) or _read_only_mount(existing):
        raise UserError(
            f"{key}={str(path)!r} cannot be written: {existing} is read-only (a read-only file system or no write "
            "permission); give a folder on a writable file system"
        )


def _read_only_mount(path: Path) -> bool:
    """Whether `path` lives on a file system mounted read-only (os.access answers yes for root there)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
