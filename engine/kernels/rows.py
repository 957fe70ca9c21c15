"""A row vector added to or multiplying every row of a matrix as one loop (a linear
layer's bias, layer norm's scale and shift), for the compiled replay's add and multiply
(engine/replay.py): NumPy's ufunc loop over a broadcast row vector ran 2.3-2.8x slower
than a plain pass over the same elements ((1024, 64), (1024, 192), (1024, 256) float32:
0.019 / 0.051 / 0.066 ms against 0.007 / 0.023 / 0.029).

The same float operation per element as NumPy's (x + b, x * b, no contraction): the
same bits (a NaN's payload aside, where the row vector was the ufunc's first operand).
"""

from __future__ import annotations

from typing import Any

from engine.kernels import In, Out, kernel


@kernel
def add_rows(x: Any, b: Any, out: Any) -> None:
    """out[r, j] = x[r, j] + b[j]; x and out 2-D and C-contiguous, not one array."""
    rows, k = x.shape
    for r in range(rows):
        for j in range(k):
            out[r, j] = x[r, j] + b[j]


@kernel
def multiply_rows(x: Any, b: Any, out: Any) -> None:
    """out[r, j] = x[r, j] * b[j]; x and out 2-D and C-contiguous, not one array."""
    rows, k = x.shape
    for r in range(rows):
        for j in range(k):
            out[r, j] = x[r, j] * b[j]


# In place (out is x) as loops of their own: given out and x as two arrays, LLVM checks
# at run time whether they overlap before it takes the vectorized loop, and when they
# are one array runs the scalar one (2x slower than NumPy's add).
@kernel
def add_rows_into(x: Any, b: Any) -> None:
    """x[r, j] += b[j]; x 2-D and C-contiguous."""
    rows, k = x.shape
    for r in range(rows):
        for j in range(k):
            x[r, j] = x[r, j] + b[j]


@kernel
def multiply_rows_into(x: Any, b: Any) -> None:
    """x[r, j] *= b[j]; x 2-D and C-contiguous."""
    rows, k = x.shape
    for r in range(rows):
        for j in range(k):
            x[r, j] = x[r, j] * b[j]


KERNELS = {"add": (add_rows, add_rows_into), "multiply": (multiply_rows, multiply_rows_into)}

# The replay's call sites (engine/replay.py, _row_vector_form), for warm-up: float32 and
# float64 matrices (as (rows, k)) and their row (k,).
for _dtype in ("float32", "float64"):
    add_rows.declare((In(_dtype, 2), In(_dtype, 1), Out(_dtype, 2)))
    multiply_rows.declare((In(_dtype, 2), In(_dtype, 1), Out(_dtype, 2)))
    add_rows_into.declare((Out(_dtype, 2), In(_dtype, 1)))
    multiply_rows_into.declare((Out(_dtype, 2), In(_dtype, 1)))
