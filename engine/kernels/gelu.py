"""erf and the exact GELU as compiled loops (issue 28): one pass where NumPy takes ~25
(erf_float32's float64 blocks) or ~10 (gelu_slope).

The NumPy references sit beside their call sites: `engine.backend.erf_float32`, and
`_gelu_impl` / `_gelu_slope_into` in engine/ops/elementwise.py. Each function below
answers None where a kernel does not run (numba absent or switched off, a dtype or
layout it does not take), and the caller runs its NumPy path; CuPy arrays never come
here. There is no size threshold: numba's dispatcher costs ~0.3 us a call, the NumPy
paths ~5-25 us at one element (measured: bench/RESULTS.md, "erf and GELU as compiled
kernels"), so a kernel is faster at every size.

Numerics (tests/engine/test_kernels_gelu.py checks each):
- erf (float32) and gelu (float32): the same operations in the same order as the NumPy
  path, so bit-identical: the rational in float64 from the float32 argument, rounded to
  float32 once; GELU's x / sqrt 2, + 1, * 0.5 and * x in float32 around it.
- gelu_slope: (x^2 phi(x) + y) / x evaluated in float64 in the NumPy path's order and
  rounded once. On float32 this is more accurate than the NumPy path (its seven float32
  roundings and float32 exp become one rounding): within 0.5 ulp plus 2^-50 of the
  terms' size of the formula on the same float32 x and y, where the NumPy path is within
  ~4 eps of it; the two agree to that bound, not bit for bit. On float64 it is the NumPy
  path's own sequence (bit-identical where NumPy's exp is the C library's, as on this
  project's machines; within an ulp of exp otherwise).
- float64 erf and GELU stay with SciPy's erf: a loop over the C library's erf measured
  5.3 ms against SciPy's 5.9 ms on 262,144 float64 and answers different last bits on a
  fifth of them, so it is not used.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.kernels import In, Out, kernel

# Module constants are frozen into the compiled code, and numba's disk cache knows only
# this file: so they are written here, not imported (a constant changed in another
# file would be served stale from the cache: review r11). erf_float32's rational
# (engine/backend.py's _ERF_P, _ERF_Q, _ERF_CLAMP; tests/engine/test_kernels.py checks
# they are equal). The float32 ones keep GELU's arithmetic in float32 where the NumPy
# path's is (a Python float would widen it).
P0, P1, P2, P3, P4, P5, P6 = (
    17879.449918622027,
    2934.5919228229263,
    860.6648790236565,
    60.9980508133799,
    6.014986486270723,
    0.07423116260725267,
    -0.00020919107566610734,
)
Q0, Q1, Q2, Q3, Q4 = (
    15845.24989811159,
    7882.4656190258065,
    1805.6996191802834,
    245.00062865199556,
    20.718755556246933,
)
CLAMP = 4.0
ROOT_TWO_F32 = np.float32(1.4142135623730951)
ONE_F32 = np.float32(1.0)
HALF_F32 = np.float32(0.5)
ONE_OVER_ROOT_TWO_PI = 0.3989422804014327
TINY_F32 = float(np.finfo(np.float32).eps / 2)  # below it, gelu' = 1/2 to half an ulp
TINY_F64 = float(np.finfo(np.float64).eps / 2)


@kernel
def erf_float32_kernel(x: Any, out: Any) -> None:
    """out = erf(x), both float32 and 1-D: erf_float32's rational, its operations in its
    order (clip, Horner for P and Q in float64, x P / Q rounded to float32)."""
    for i in range(x.size):
        z: float = np.float64(x[i])
        if z > CLAMP:  # (NaN compares false both ways and stays NaN, as np.clip's)
            z = CLAMP
        elif z < -CLAMP:
            z = -CLAMP
        t = z * z
        num = t * P6 + P5
        num = num * t + P4
        num = num * t + P3
        num = num * t + P2
        num = num * t + P1
        num = num * t + P0
        den = t + Q4
        den = den * t + Q3
        den = den * t + Q2
        den = den * t + Q1
        den = den * t + Q0
        out[i] = (num * z) / den


@kernel
def gelu_float32_kernel(x: Any, out: Any) -> None:
    """out = x (0.5 (1 + erf(x / sqrt 2))), both float32 and 1-D: _gelu_impl's steps (the
    erf as in erf_float32_kernel above), so bit-identical; out may be x itself."""
    for i in range(x.size):
        xi = x[i]
        z: float = np.float64(xi / ROOT_TWO_F32)  # the division in float32, as NumPy's
        if z > CLAMP:
            z = CLAMP
        elif z < -CLAMP:
            z = -CLAMP
        t = z * z
        num = t * P6 + P5
        num = num * t + P4
        num = num * t + P3
        num = num * t + P2
        num = num * t + P1
        num = num * t + P0
        den = t + Q4
        den = den * t + Q3
        den = den * t + Q2
        den = den * t + Q1
        den = den * t + Q0
        e = np.float32((num * z) / den)
        out[i] = (e + ONE_F32) * HALF_F32 * xi  # halved before the product: no overflow


# exp(a) for a in [-120, 0] without a call to the C library's exp (which does not
# vectorize: a float64 loop over it measured 2.3x NumPy's float32 gelu_slope): a = k ln 2
# + r with k = round(a / ln 2) (by adding and subtracting 1.5 2^52, whose last bits then
# hold k, so 2^k is those bits moved into the exponent field) and |r| <= ln 2 / 2 (ln 2
# in two parts: k ln2_hi is exact), exp(r) by its Taylor polynomial of degree 10 in
# Estrin's form (a short dependency chain: the loop is latency-bound). Relative error
# 3.0e-13 (measured against long double exp on 4e6 points of [-708, 0]), where a float32
# slope needs 2^-24. Below -120 (|x| > 15.4) it is 0, as float32's exp is (e^-120 is
# below its smallest subnormal), and 2^k is kept away from the subnormals: the slope's
# exp term there, |x| phi(x) < 1e-50, is 0 after rounding anyway.
EXP_FLOOR = -120.0
LOG2_E = 1.4426950408889634
LN2_HI = 0.6931471803691238  # ln 2's first 32 bits: k LN2_HI is exact for |k| < 2^20
LN2_LO = 1.9082149292705877e-10
ROUNDER = 6755399441055744.0  # 1.5 2^52
E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10 = (1.0 / math.factorial(k) for k in range(11))


@kernel
def gelu_slope_float32_kernel(x: Any, y: Any, out: Any) -> None:
    """out = gelu'(x) = (x^2 phi(x) + y) / x, 1/2 where |x| < eps / 2; x, y, out float32
    and 1-D. _gelu_slope_into's formula in float64 (exp as above), rounded once."""
    for i in range(x.size):
        xi = np.float64(x[i])
        a = xi * -0.5 * xi
        ac = max(a, EXP_FLOOR)  # (a select here stops the loop vectorizing: 2x slower)
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
        if a < EXP_FLOOR:  # (NaN: false; the slope is NaN from x anyway)
            e = 0.0
        s = (xi * xi * e * ONE_OVER_ROOT_TWO_PI + np.float64(y[i])) / xi
        out[i] = 0.5 if abs(xi) < TINY_F32 else s  # (a select: the loop vectorizes)


@kernel
def gelu_slope_float64_kernel(x: Any, y: Any, out: Any) -> None:
    """out = gelu'(x) on float64 x, y, out (1-D): _gelu_slope_into's sequence of
    operations, exp the C library's (as NumPy's float64 exp on CPUs without AVX-512)."""
    for i in range(x.size):
        xi = x[i]
        s = xi * -0.5
        s = s * xi
        s = math.exp(s)
        s = s * xi
        s = s * xi
        s = s * ONE_OVER_ROOT_TWO_PI
        s = s + y[i]
        s = s / xi
        out[i] = 0.5 if abs(xi) < TINY_F64 else s


# ---- the callers' entry points: an answer, or None for the NumPy path ----


def _flat_out(out: Any, shape: tuple, dtype: Any) -> Any:
    """`out`, or a fresh C-ordered array (the NumPy paths' results are C-ordered too),
    None where out is not C-contiguous (the caller's NumPy path writes it). The inputs
    are read through C-contiguous copies where they are not: erf_float32 copies too."""
    if out is None:
        out = np.empty(shape, dtype)
    elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        return None
    return out


def erf_float32(x: Any, out: Any = None) -> Any:
    """erf of a float32 NumPy array (bit-identical to engine.backend.erf_float32), into
    `out` when given, or None where the kernel does not run."""
    run = erf_float32_kernel.compiled()
    if run is None or x.dtype != np.float32:
        return None
    out = _flat_out(out, x.shape, x.dtype)
    if out is None:
        return None
    run(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
    return out


def gelu(x: Any, out: Any = None) -> Any:
    """The exact GELU of a float32 NumPy array, into `out` when given (it may be x), or
    None where the kernel does not run (float64: SciPy's erf, on the NumPy path)."""
    run = gelu_float32_kernel.compiled()
    if run is None or x.dtype != np.float32:
        return None
    out = _flat_out(out, x.shape, x.dtype)
    if out is None:
        return None
    run(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
    return out


def gelu_slope(x: Any, y: Any, out: Any = None) -> Any:
    """gelu'(x) given y = gelu(x), float32 or float64 NumPy arrays of one shape, into
    `out` when given, or None where the kernel does not run."""
    dtype = x.dtype
    if dtype == np.float32:
        run = gelu_slope_float32_kernel.compiled()
    elif dtype == np.float64:
        run = gelu_slope_float64_kernel.compiled()
    else:
        return None
    if run is None or y.dtype != dtype or y.shape != x.shape:
        return None
    out = _flat_out(out, x.shape, dtype)
    if out is None:
        return None
    flat = [np.ascontiguousarray(a).reshape(-1) for a in (x, y)]
    run(flat[0], flat[1], out.reshape(-1))
    return out


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

erf_float32_kernel.declare((In("float32", 1), Out("float32", 1)))
gelu_float32_kernel.declare((In("float32", 1), Out("float32", 1)))
gelu_slope_float32_kernel.declare((In("float32", 1), In("float32", 1), Out("float32", 1)))
gelu_slope_float64_kernel.declare((In("float64", 1), In("float64", 1), Out("float64", 1)))
