"""exp(a) for a <= 0 as a kernel helper, for the kernels that need an exp in a loop that
should vectorize (GELU's slope in engine/kernels/gelu.py, softmax in
engine/kernels/softmax.py).

The C library's exp, which numba's math.exp calls, does not vectorize: a float64 loop
over it measured 2.3x NumPy's float32 gelu_slope. So: a = k ln 2 + r with k = round(a /
ln 2) (by adding and subtracting 1.5 2^52, whose last bits then hold k, so 2^k is those
bits moved into the exponent field) and |r| <= ln 2 / 2 (ln 2 in two parts: k ln2_hi is
exact), exp(r) by its Taylor polynomial of degree 10 in Estrin's form (a short
dependency chain: the loops are latency-bound). Relative error 3.0e-13 (measured against
long double exp on 4e6 points of [-708, 0]), where a float32 answer needs 2^-24. Below
-120 it is 0, as float32's exp is (e^-120 is below its smallest subnormal; the callers'
terms there round to nothing), and 2^k is kept away from the subnormals.

Its callers live in other files: the loader keys their cached code by this file's
contents too (engine/kernels/__init__.py), so a change here recompiles them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.kernels import helper

EXP_FLOOR = -120.0
LOG2_E = 1.4426950408889634
LN2_HI = 0.6931471803691238  # ln 2's first 32 bits: k LN2_HI is exact for |k| < 2^20
LN2_LO = 1.9082149292705877e-10
ROUNDER = 6755399441055744.0  # 1.5 2^52
E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10 = (1.0 / math.factorial(k) for k in range(11))


@helper
def exp_nonpositive(a: Any) -> Any:
    """exp(a) for a float64 a <= 0 within 3e-13 relative, 0 below -120, NaN for NaN."""
    ac = max(a, EXP_FLOOR)  # (a ternary here stops GELU's slope loop vectorizing: 2x slower)
    t = ac * LOG2_E + ROUNDER
    k = t - ROUNDER
    r = ac - k * LN2_HI
    r = r - k * LN2_LO
    r2 = r * r
    r4 = r2 * r2
    low = (E0 + E1 * r) + r2 * (E2 + E3 * r)
    high = (E4 + E5 * r) + r2 * (E6 + E7 * r) + r4 * ((E8 + E9 * r) + r2 * E10)
    two_to_k = np.int64((np.float64(t).view(np.int64) + 1023) << 52).view(np.float64)
    e: float = (low + r4 * high) * two_to_k
    if a < EXP_FLOOR:  # (NaN: false, and max kept it: NaN)
        e = 0.0
    return e
