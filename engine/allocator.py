"""Keep freed array memory in the process instead of handing it back to the kernel.

glibc serves large allocations (>= 128 KiB by default) with fresh mmap'd pages and
returns freed heap memory to the system eagerly. An autodiff step allocates and frees
the same large temporaries every call, so each call pays page faults on memory it just
gave back; on the medium benchmark MLP that is ~10-20% of a gradient step. Raising the
mmap and trim thresholds lets the heap reuse those blocks. The same effect comes from
the environment variables MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ set before
the process starts; this does it from inside, for processes we own (the service's
workers, the benchmarks). It is opt-in for library users: it changes the whole
process's allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, MMAP_THRESHOLD_MAX)) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    return ok_mmap and ok_trim
