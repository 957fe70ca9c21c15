"""softmax over the last axis as one compiled loop (issue 28): one pass over each row
where NumPy takes a tree of maximums, a subtraction, an exp, a row sum and a division
(0.35 ms for attention's 65,536 float32 in rows of 16; the kernel ~0.1 ms).

The NumPy reference is `_softmax_into` in engine/ops/nn.py. `softmax` below answers
None where the kernel does not run (numba absent or switched off, not float32, an axis
other than the last, a layout other than C-contiguous) and the caller runs NumPy's;
no size threshold (the dispatcher's ~0.3 us is below NumPy's cost at any size).

Numerics (tests/engine/test_kernels_softmax.py): float32 in and out, everything between
in float64 (x - max exact, exp as in engine/kernels/gelu.py's gelu_slope, within 3e-13,
the row's sum, the division), rounded once: within 0.5 ulp + 2^-40 of the exact softmax
of the float32 input, where NumPy's float32 path rounds x - max, exp, the sum and the
quotient (a few ulps). So it is not bit-identical to the NumPy path: the two agree to
that path's error. A NaN anywhere in a row makes the row NaN, and a row whose maximum
is +-inf is NaN, as NumPy's (inf - inf).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.kernels import In, Out, kernel

# exp(a) for a <= 0, as gelu_slope_float32_kernel's (see engine/kernels/gelu.py: k =
# round(a / ln 2) by the 1.5 2^52 trick, Taylor degree 10 in Estrin's form), 0 below
# -120 (e^-120 / sum, sum >= 1, is below float32's smallest subnormal).
EXP_FLOOR = -120.0
LOG2_E = 1.4426950408889634
LN2_HI = 0.6931471803691238
LN2_LO = 1.9082149292705877e-10
ROUNDER = 6755399441055744.0
E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10 = (1.0 / math.factorial(k) for k in range(11))


@kernel
def softmax_rows_float32_kernel(x: Any, out: Any, scratch: Any) -> None:
    """out[r] = softmax(x[r]) for each row r of the 2-D float32 x (C-contiguous); scratch
    holds one row of float64 exps."""
    rows, k = x.shape
    for row in range(rows):
        m = np.float64(x[row, 0])
        for j in range(1, k):
            v = np.float64(x[row, j])
            if v > m or v != v:  # NaN wins, as np.maximum's
                m = v
        for j in range(k):  # (vectorizes: the sum is a loop of its own)
            a = np.float64(x[row, j]) - m
            ac = EXP_FLOOR if a < EXP_FLOOR else a  # (NaN stays NaN)
            t = ac * LOG2_E + ROUNDER
            n = t - ROUNDER
            r = ac - n * LN2_HI
            r = r - n * LN2_LO
            r2 = r * r
            r4 = r2 * r2
            low = (E0 + E1 * r) + r2 * (E2 + E3 * r)
            high = (E4 + E5 * r) + r2 * (E6 + E7 * r) + r4 * ((E8 + E9 * r) + r2 * E10)
            two_to_n = np.int64((np.float64(t).view(np.int64) + 1023) << 52).view(np.float64)
            e: float = (low + r4 * high) * two_to_n
            if a < EXP_FLOOR:
                e = 0.0
            scratch[j] = e
        total = 0.0
        for j in range(k):
            total += scratch[j]
        for j in range(k):
            out[row, j] = scratch[j] / total


def softmax(x: Any, axis: int, out: Any = None) -> Any:
    """softmax of a float32 NumPy array over its last axis, into `out` when given, or
    None where the kernel does not run."""
    if x.dtype != np.float32 or x.ndim == 0 or axis not in (-1, x.ndim - 1):
        return None
    run = softmax_rows_float32_kernel.compiled()
    if run is None or not x.flags.c_contiguous or x.shape[-1] == 0:
        return None
    if out is None:
        out = np.empty(x.shape, x.dtype)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        return None
    k = x.shape[-1]
    run(x.reshape(-1, k), out.reshape(-1, k), np.empty(k, np.float64))
    return out


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

softmax_rows_float32_kernel.declare((In("float32", 2), Out("float32", 2), Out("float64", 1)))
