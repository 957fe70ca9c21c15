"""Keep freed array memory in the process instead of handing it back to the kernel.

glibc serves large allocations (>= 128 KiB by default, a threshold it moves up to the
largest block freed so far, at most 32 MiB) with fresh mmap'd pages, and returns freed
memory at the top of its heap to the system once more than twice that threshold is
free. An autodiff step allocates and frees the same large temporaries every call, so
each call pays page faults on memory it just gave back: 2,000-28,000 minor faults per
fresh HVP of the large benchmark MLP, ~10-40% of its CPU time (bench/RESULTS.md).
Raising the mmap threshold to its 32 MiB maximum and the trim threshold to 1 GiB lets
the heap reuse those blocks: the same HVP then faults ~0 times.

So `import engine` does it by default on Linux with glibc (`tuned_at_import` says
whether it did). The trade-off: the process keeps freed heap memory instead of
returning it, up to the 1 GiB trim threshold at the top of the heap (more where the
heap is fragmented), and blocks under 32 MiB come from the heap rather than from their
own mappings; its RSS after a large computation stays near its peak rather than
falling back. Blocks of 32 MiB and more are still mapped and unmapped on their own.
It changes the allocator of the whole process, NumPy's and every other library's.

Opt out with the environment variable GRADTAPE_TUNE_ALLOCATOR=0 (or false/no/off),
read once when engine is first imported; glibc's own settings are then left as they
are (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_, set before the process starts,
do the same tuning from outside). `tune_allocator()` applies it explicitly, with other
thresholds if wanted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_THRESHOLD = 1 << 30
OPT_OUT = "GRADTAPE_TUNE_ALLOCATOR"

# Whether `import engine` tuned the allocator (see tune_by_default).
tuned_at_import = False


def tune_allocator(
    mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
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


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")


def tune_by_default() -> bool:
    """What `import engine` runs once: tune_allocator() unless GRADTAPE_TUNE_ALLOCATOR
    opts out (then mallopt is never called)."""
    global tuned_at_import
    tuned_at_import = not opted_out() and tune_allocator()
    return tuned_at_import
