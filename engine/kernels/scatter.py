"""Rows of a table added at integer indices (an embedding's gradient) as one compiled
loop (issue 28): 0.28 ms for the transformer's 1,024 rows of 64 into a table of 100 by
NumPy's stable argsort and add.reduceat of the sorted rows, ~0.02 ms here.

The NumPy reference is `_scatter_rows` in engine/backend.py. `add_rows` answers None
where the kernel does not run (numba absent or switched off, a dtype other than
float32/float64, operands that are not C-contiguous), and the caller runs NumPy's.

Numerics: each table row gets its values added one by one in the order of the
indices, in the operands' dtype: exactly np.add.at's sums (NumPy's own sequential
scatter, which the engine runs for every other integer index), bit for bit (tested in
tests/engine/test_kernels_scatter.py). The NumPy path it replaces here (a stable sort
and add.reduceat) may add a group's rows pairwise instead, so the two agree to the
rounding of those sums, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.kernels import In, Out, kernel


@kernel
def add_rows_kernel(picks: Any, values: Any, table: Any) -> bool:
    """table[picks[i]] += values[i] for each i in order (negative picks count from the
    end); False, with the table untouched, when a pick is out of range."""
    size = table.shape[0]
    for i in range(picks.size):
        p = picks[i]
        if p < -size or p >= size:
            return False
    n, k = values.shape
    for i in range(n):
        p = picks[i]
        if p < 0:
            p += size
        for j in range(k):
            table[p, j] += values[i, j]
    return True


def add_rows(picks: Any, values: Any, table: Any) -> bool | None:
    """table[picks] += values over the table's first axis (picks: integers, any shape;
    values: picks' shape then the table's other axes), accumulating repeats; True when
    done, False when a pick is out of range (table untouched), None where the kernel
    does not run."""
    if table.dtype not in (np.float32, np.float64) or values.dtype != table.dtype:
        return None
    if not (table.flags.c_contiguous and values.flags.c_contiguous):
        return None
    run = add_rows_kernel.compiled()
    if run is None or table.ndim == 0 or table.shape[0] == 0:
        return None
    if picks.dtype.kind == "u":
        # numba types uint64 against int64 as float64, no index: unsigned picks are
        # checked against the table here and go in as int64 (review r11)
        if picks.size and int(picks.max()) >= table.shape[0]:
            return False
        picks = picks.astype(np.int64)
    elif picks.dtype.kind != "i":
        return None
    # As declared below, the one signature warm-up compiles per dtype: int64 in one run
    # (a copy of other widths or layouts: ~1 us for a transformer's 1,024 picks).
    picks = np.ascontiguousarray(picks.reshape(-1), dtype=np.int64)
    rows = table.reshape(table.shape[0], -1)
    return bool(run(picks, values.reshape(picks.size, rows.shape[1]), rows))


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

# (picks go in as C-contiguous int64: add_rows converts others)
add_rows_kernel.declare(
    *((In("int64", 1), In(dtype, 2), Out(dtype, 2)) for dtype in ("float32", "float64"))
)
