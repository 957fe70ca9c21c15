"""`import engine` tunes glibc's allocator by default (engine/allocator.py): measured in
fresh processes, a loop that allocates and frees large arrays faults its pages in every
time without it and not with it; GRADTAPE_TUNE_ALLOCATOR=0 leaves the allocator as
glibc's defaults have it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt tuning is for glibc",
)

# Four 20 MB arrays made (and written) and freed, 20 times, after a warm-up round: the
# minor page faults of the measured rounds.
LOOP = """
import resource, sys
import numpy as np
if sys.argv[1] == "engine":
    import engine
    from engine import allocator
    print(int(allocator.tuned_at_import))
else:
    print(-1)
def rounds():
    for _ in range(20):
        arrays = [np.ones(2_500_000) for _ in range(4)]
        del arrays
rounds()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(what: str, **env: str) -> tuple[int, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.pop("GRADTAPE_TUNE_ALLOCATOR", None)
    out = subprocess.run(
        [sys.executable, "-c", LOOP, what],
        capture_output=True,
        text=True,
        check=True,
        env={**environ, **env},
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_import_engine_tunes_the_allocator_and_the_opt_out_leaves_it_alone() -> None:
    _, untouched = _faults("numpy")  # glibc's defaults: no engine in the process
    tuned_flag, tuned = _faults("engine")
    opted_flag, opted_out = _faults("engine", GRADTAPE_TUNE_ALLOCATOR="0")
    assert tuned_flag == 1 and opted_flag == 0
    # 80 arrays of 20 MB are ~390,000 pages: glibc's defaults fault most of them in again
    assert untouched > 10_000, untouched
    assert tuned < untouched / 20, (tuned, untouched)
    # the opt-out never calls mallopt: it faults like a process without the engine
    assert opted_out > untouched / 2, (opted_out, untouched)


RELEASE = """
import numpy as np
from engine import allocator
assert allocator.tuned_at_import
held = allocator.resident_bytes()
arrays = [np.ones(2_500_000) for _ in range(16)]  # 16 x 20 MB: heap blocks once tuned
del arrays
kept = allocator.resident_bytes()
assert not allocator.release_if_above(kept * 4)  # below the limit: nothing done
assert allocator.release_if_above(held + (64 << 20))
print(held, kept, allocator.resident_bytes())
"""


def test_release_hands_the_heap_back_after_a_large_pass() -> None:
    """The tuned allocator keeps freed blocks (under 32 MiB) resident; release_if_above()
    hands them back once the resident set exceeds its limit, and only then."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.pop("GRADTAPE_TUNE_ALLOCATOR", None)
    out = subprocess.run(
        [sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True, env=environ
    )
    held, kept, released = map(int, out.stdout.split())
    assert kept - held > 200 << 20, (held, kept)  # the freed arrays stayed resident
    assert released - held < 64 << 20, (held, kept, released)  # and went back
