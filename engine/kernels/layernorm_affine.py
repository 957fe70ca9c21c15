"""Layer normalization with its affine over the last axis, y = xhat * scale + shift with
xhat = (x - mean) / sqrt(var + eps) per row, and its VJPs as compiled loops (engine/ops/
nn.py's layer_norm_affine, layer_norm_affine_grad, layer_norm_scale_grad; issue 28).

Each kernel takes a row at a time from x alone: the row's mean and 1/sigma summed in its
loop, xhat recomputed where it is needed (nothing but y is kept between forward and
backward; PyTorch's kernels keep the two statistics). LLVM vectorizes a sum in a loop
only when it may reassociate it, so these kernels ask for it (`@kernel(reassoc=True)`,
with contraction; NaN and inf kept): their bits are not the NumPy path's (GEMV row sums,
separate passes: normalize's kernels in layernorm.py, which are) but the same formula,
within rounding of it and of PyTorch's layer_norm (tests/engine/test_layer_norm_affine.py).
They live apart from layernorm.py's bit-exact kernels so that a worker readying these
on demand (exact=False: engine/kernels/__init__.py) compiles only these.

1,024 rows of 64 float32, each call alone: forward 0.022 ms against the NumPy-and-
kernels path's 0.090 (normalize, * scale, + shift); x's VJP 0.044 against 0.118 + 0.012
(normalize_grad of g * scale); scale's 0.021 against ~0.033 (g * xhat and its GEMV).

Each entry point answers False where its kernel does not run (numba absent or switched
off, a dtype other than float32/float64, operands of other shapes or not C-contiguous),
and the caller runs the NumPy operations. `consts` holds (1 / k, eps, 1) in x's dtype
(there is no scalar argument type to declare).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.kernels import In, Out, kernel


@kernel(reassoc=True)
def affine_forward_kernel(x: Any, scale: Any, shift: Any, consts: Any, out: Any) -> None:
    """out = (x - mean) * r * scale + shift per row, r = 1 / sqrt(var + eps)."""
    rows, k = x.shape
    inv_n, eps, one = consts[0], consts[1], consts[2]
    for row in range(rows):
        total = inv_n * 0
        for j in range(k):
            total += x[row, j]
        m = total * inv_n
        squares = total * 0
        for j in range(k):
            d = x[row, j] - m
            squares += d * d
        r = one / np.sqrt(squares * inv_n + eps)
        for j in range(k):
            out[row, j] = (x[row, j] - m) * r * scale[j] + shift[j]


@kernel(reassoc=True)
def affine_grad_kernel(g: Any, x: Any, scale: Any, consts: Any, out: Any) -> None:
    """out = r (a - mean(a) - xhat mean(a xhat)) per row, a = g * scale (x's VJP)."""
    rows, k = x.shape
    inv_n, eps, one = consts[0], consts[1], consts[2]
    for row in range(rows):
        total = inv_n * 0
        for j in range(k):
            total += x[row, j]
        m = total * inv_n
        squares = total * 0
        for j in range(k):
            d = x[row, j] - m
            squares += d * d
        r = one / np.sqrt(squares * inv_n + eps)
        sum_a = total * 0
        sum_a_xhat = total * 0
        for j in range(k):
            a = g[row, j] * scale[j]
            sum_a += a
            sum_a_xhat += a * ((x[row, j] - m) * r)
        mean_a = sum_a * inv_n
        mean_a_xhat = sum_a_xhat * inv_n
        for j in range(k):
            xhat = (x[row, j] - m) * r
            out[row, j] = ((g[row, j] * scale[j] - xhat * mean_a_xhat) - mean_a) * r


@kernel(reassoc=True)
def scale_grad_kernel(g: Any, x: Any, consts: Any, out: Any) -> None:
    """out[j] = sum over rows of g * xhat (scale's VJP); out 1-D of x's row length."""
    rows, k = x.shape
    inv_n, eps, one = consts[0], consts[1], consts[2]
    for j in range(k):
        out[j] = inv_n * 0
    for row in range(rows):
        total = inv_n * 0
        for j in range(k):
            total += x[row, j]
        m = total * inv_n
        squares = total * 0
        for j in range(k):
            d = x[row, j] - m
            squares += d * d
        r = one / np.sqrt(squares * inv_n + eps)
        for j in range(k):
            out[j] += g[row, j] * ((x[row, j] - m) * r)


def _consts(x: Any, eps: float) -> Any:
    return np.array([1 / x.shape[-1], eps, 1], x.dtype)


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1])


def _same(x: Any, *others: Any) -> bool:
    return all(o.shape == x.shape and o.dtype == x.dtype and o.flags.c_contiguous for o in others)


def _affine_takes(x: Any, *rows: Any) -> bool:
    """x (..., k) float32/float64 C-contiguous, non-empty, each of `rows` (k,) of its dtype."""
    return (
        (x.dtype == np.float32 or x.dtype == np.float64)
        and x.ndim > 0
        and x.size > 0
        and x.flags.c_contiguous
        and all(
            r.shape == x.shape[-1:] and r.dtype == x.dtype and r.flags.c_contiguous for r in rows
        )
    )


def affine_forward(x: Any, scale: Any, shift: Any, eps: float, out: Any) -> bool:
    """out = normalize(x) * scale + shift over the last axis (scale, shift: (k,))."""
    run = affine_forward_kernel.compiled()
    if run is None or not _affine_takes(x, scale, shift) or not _same(x, out):
        return False
    run(_rows(x), scale, shift, _consts(x, eps), _rows(out))
    return True


def affine_grad(g: Any, x: Any, scale: Any, eps: float, out: Any) -> bool:
    """out = normalize_grad(g * scale, x): x's cotangent (g, out: x's shape)."""
    run = affine_grad_kernel.compiled()
    if run is None or not _affine_takes(x, scale) or not _same(x, g, out):
        return False
    run(_rows(g), _rows(x), scale, _consts(x, eps), _rows(out))
    return True


def scale_grad(g: Any, x: Any, eps: float, out: Any) -> bool:
    """out = the sum of g * normalize(x) over all axes but the last (out: (k,))."""
    run = scale_grad_kernel.compiled()
    if run is None or not _affine_takes(x, out) or not _same(x, g):
        return False
    run(_rows(g), _rows(x), _consts(x, eps), out)
    return True


for _dtype in ("float32", "float64"):
    affine_forward_kernel.declare(
        (In(_dtype, 2), In(_dtype, 1), In(_dtype, 1), In(_dtype, 1), Out(_dtype, 2))
    )
    affine_grad_kernel.declare(
        (In(_dtype, 2), In(_dtype, 2), In(_dtype, 1), In(_dtype, 1), Out(_dtype, 2))
    )
    scale_grad_kernel.declare((In(_dtype, 2), In(_dtype, 2), In(_dtype, 1), Out(_dtype, 1)))
