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
thresholds if wanted; `release()` hands the free memory back at once, and
`release_if_above()` does when the resident set exceeds GRADTAPE_RELEASE_ABOVE_MB (1024
by default): the service's workers call it after every request, so a pass far above the
usual size does not keep its peak resident.
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


def release() -> bool:
    """Hand the heap's free memory back to the system now (glibc's malloc_trim(0)): what
    a process that tuned the allocator calls after a pass far above its usual size, so
    that it does not keep that pass's peak resident. False where there is no malloc_trim.
    Costs about a millisecond per GiB freed; the next large pass faults its pages in
    again."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


RELEASE_ABOVE = "GRADTAPE_RELEASE_ABOVE_MB"
RELEASE_ABOVE_DEFAULT_MB = 1024


def resident_bytes() -> int:
    """This process's resident set size now (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_if_above(limit: int | None = None) -> bool:
    """release() when the resident set exceeds `limit` bytes (default: the environment's
    GRADTAPE_RELEASE_ABOVE_MB, 1024 MiB; 0 or less never releases): what a long-lived
    process (the service's worker) calls after each request, so that one pass far above
    the usual size does not leave its peak resident. A read of /proc/self/statm when
    below the limit."""
    if limit is None:
        try:
            limit = int(os.environ.get(RELEASE_ABOVE, RELEASE_ABOVE_DEFAULT_MB)) << 20
        except ValueError:
            limit = RELEASE_ABOVE_DEFAULT_MB << 20
    if limit <= 0 or resident_bytes() <= limit:
        return False
    return release()


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")


def tune_by_default() -> bool:
    """What `import engine` runs once: tune_allocator() unless GRADTAPE_TUNE_ALLOCATOR
    opts out (then mallopt is never called)."""
    global tuned_at_import
    tuned_at_import = not opted_out() and tune_allocator()
    return tuned_at_import
