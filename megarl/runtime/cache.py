"""Where megarl keeps what it can recompute (passed checks, import indexes): never needed, only faster."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """MEGARL_CACHE_DIR, else $XDG_CACHE_HOME/megarl (~/.cache/megarl)."""
    if os.environ.get("MEGARL_CACHE_DIR"):
        return Path(os.environ["MEGARL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megarl"
