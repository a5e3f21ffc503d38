"""Give freed heap memory back to the operating system.

glibc keeps freed blocks below its (self-raising) mmap threshold in the process heap. A streaming converter frees
thousands of mid-sized tensors; without a trim now and then the heap holds on to them and the resident set creeps
up towards a fraction of the model, although nothing is in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim_heap() -> None:
    """Return free heap pages to the OS (glibc); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
