"""The elementwise steps of layer normalization over the last axis (`normalize` and its
VJP `normalize_grad` in engine/ops/nn.py) as compiled loops (issue 28): NumPy runs each
broadcast against a row's statistic ((rows, k) with (rows, 1)) with an inner loop of k
elements, ~2x a plain pass at k = 64; a loop per row runs them as one pass each.

The row sums stay NumPy's (matrix-vector products with ones, engine/ops/nn.py's
_row_sum): without fastmath's reassociation, which the kernels' loader does not allow,
LLVM does not vectorize a sum inside a loop, and a whole-row kernel measured no faster
than NumPy (0.085 against 0.072 ms for 1,024 rows of 64 float32). So each kernel here
performs exactly the operations of the NumPy path it replaces, in its order and dtype,
and the results are bit-identical to it (tests/engine/test_kernels_layernorm.py).

Each entry point answers False where its kernel does not run (numba absent or switched
off, a dtype other than float32/float64, operands of different shapes or not
C-contiguous), and the caller runs the NumPy operations.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.kernels import In, Out, kernel


@kernel
def center_kernel(x: Any, mean: Any, centered: Any, squares: Any) -> None:
    """centered = x - mean[row], squares = centered * centered; x, centered, squares
    2-D, mean 1-D (one per row), all of one dtype."""
    rows, k = x.shape
    for row in range(rows):
        m = mean[row]
        for j in range(k):
            d = x[row, j] - m
            centered[row, j] = d
            squares[row, j] = d * d


@kernel
def scale_rows_kernel(x: Any, r: Any) -> None:
    """x *= r[row], in place (one array: a separate output that may alias the input
    would stop LLVM vectorizing the loop, 0.026 against 0.008 ms)."""
    rows, k = x.shape
    for row in range(rows):
        s = r[row]
        for j in range(k):
            x[row, j] = x[row, j] * s


@kernel
def combine_kernel(a: Any, xhat: Any, m: Any, mean_a: Any, r: Any, out: Any) -> None:
    """out = ((a - xhat * m[row]) - mean_a[row]) * r[row], normalize_grad's last steps."""
    rows, k = a.shape
    for row in range(rows):
        mr, ar, rr = m[row], mean_a[row], r[row]
        for j in range(k):
            out[row, j] = ((a[row, j] - xhat[row, j] * mr) - ar) * rr


def _takes(*arrays: Any) -> bool:
    first = arrays[0]
    return (
        (first.dtype == np.float32 or first.dtype == np.float64)
        and first.ndim > 0
        and all(
            a.shape == first.shape and a.dtype == first.dtype and a.flags.c_contiguous
            for a in arrays
        )
    )


def _one_per_row(a: Any, *stats: Any) -> bool:
    """Whether each statistic has one value per row of `a` (not one to broadcast against
    a batch of rows, which NumPy's path does: review r11)."""
    rows = a.size // a.shape[-1] if a.shape[-1] else 0
    return all(stat.size == rows for stat in stats)


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1])


def _per_row(stat: Any) -> Any:
    # (rows..., 1) keepdims statistics -> one per row, in one run (copied when strided:
    # the one layout warm-up compiles, declared below)
    return np.ascontiguousarray(stat.reshape(-1))


def center(x: Any, mean: Any, centered: Any, squares: Any) -> bool:
    """centered = x - mean, squares = centered ** 2 (mean: keepdims, one per row)."""
    run = center_kernel.compiled()
    if run is None or not _takes(x, centered, squares) or mean.dtype != x.dtype:
        return False
    if not _one_per_row(x, mean):
        return False
    run(_rows(x), _per_row(mean), _rows(centered), _rows(squares))
    return True


def scale_rows(x: Any, r: Any) -> bool:
    """x *= r in place (r: keepdims, one per row)."""
    run = scale_rows_kernel.compiled()
    if run is None or not _takes(x) or r.dtype != x.dtype or not _one_per_row(x, r):
        return False
    run(_rows(x), _per_row(r))
    return True


def combine(a: Any, xhat: Any, m: Any, mean_a: Any, r: Any, out: Any) -> bool:
    """out = ((a - xhat * m) - mean_a) * r (m, mean_a, r: keepdims, one per row)."""
    run = combine_kernel.compiled()
    if run is None or not _takes(a, xhat, out) or not m.dtype == mean_a.dtype == r.dtype == a.dtype:
        return False
    if not _one_per_row(a, m, mean_a, r):
        return False
    run(_rows(a), _rows(xhat), _per_row(m), _per_row(mean_a), _per_row(r), _rows(out))
    return True


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

# (the per-row statistics go in C-contiguous: _per_row copies a strided one)
for _dtype in ("float32", "float64"):
    center_kernel.declare((In(_dtype, 2), In(_dtype, 1), Out(_dtype, 2), Out(_dtype, 2)))
    scale_rows_kernel.declare((Out(_dtype, 2), In(_dtype, 1)))
    combine_kernel.declare(
        (In(_dtype, 2), In(_dtype, 2), In(_dtype, 1), In(_dtype, 1), In(_dtype, 1), Out(_dtype, 2))
    )
