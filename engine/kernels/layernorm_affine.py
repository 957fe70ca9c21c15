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

from engine.kernels import In, Out, helper, kernel


@helper
def row_moments(x: Any, row: Any, k: Any, inv_n: Any, eps: Any, one: Any) -> Any:
    """(mean, r = 1 / sqrt(var + eps)) of x's row `row` (k entries), in x's dtype: the
    statistics every kernel below recomputes from x alone."""
    total = one - one  # (zero in x's dtype: a Python 0 times a float32 makes a float64)
    for j in range(k):
        total += x[row, j]
    m = total * inv_n
    squares = one - one
    for j in range(k):
        d = x[row, j] - m
        squares += d * d
    return m, one / np.sqrt(squares * inv_n + eps)


@kernel(reassoc=True)
def affine_forward_kernel(x: Any, scale: Any, shift: Any, consts: Any, out: Any) -> None:
    """out = (x - mean) * r * scale + shift per row, r = 1 / sqrt(var + eps)."""
    rows, k = x.shape
    inv_n, eps, one = consts[0], consts[1], consts[2]
    for row in range(rows):
        m, r = row_moments(x, row, k, inv_n, eps, one)
        for j in range(k):
            out[row, j] = (x[row, j] - m) * r * scale[j] + shift[j]


@kernel(reassoc=True)
def affine_grad_kernel(g: Any, x: Any, scale: Any, consts: Any, out: Any) -> None:
    """out = r (a - mean(a) - xhat mean(a xhat)) per row, a = g * scale (x's VJP)."""
    rows, k = x.shape
    inv_n, eps, one = consts[0], consts[1], consts[2]
    zero = one - one  # (in x's dtype: a Python 0 times a float32 makes a float64)
    for row in range(rows):
        m, r = row_moments(x, row, k, inv_n, eps, one)
        sum_a = zero
        sum_a_xhat = zero
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
    zero = one - one  # (in x's dtype: a Python 0 times a float32 makes a float64)
    for j in range(k):
        out[j] = zero
    for row in range(rows):
        m, r = row_moments(x, row, k, inv_n, eps, one)
        for j in range(k):
            out[j] += g[row, j] * ((x[row, j] - m) * r)


_CONSTS: dict[tuple[str, int, float], Any] = {}


def _consts(x: Any, eps: float) -> Any:
    """(1 / k, eps, 1) in x's dtype, made once per dtype, k and eps (read-only)."""
    key = (x.dtype.str, x.shape[-1], eps)
    consts = _CONSTS.get(key)
    if consts is None:
        consts = np.array([1 / x.shape[-1], eps, 1], x.dtype)
        consts.setflags(write=False)
        if len(_CONSTS) < 256:  # (a bound: the keys are the models' layer widths)
            _CONSTS[key] = consts
    return consts


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1])


def _same(x: Any, *others: Any) -> bool:
    return all(o.shape == x.shape and o.dtype == x.dtype and o.flags.c_contiguous for o in others)


def _affine_takes(x: Any, *rows: Any) -> bool:
    """x (..., k) float32/float64 C-contiguous, non-empty; each of `rows` (k,), its dtype."""
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


def _contiguous(g: Any) -> Any:
    # A cotangent broadcast along an axis (mean pooling's, strides (256, 0, 4)) copied
    # into one run: a pass, against the NumPy path's ten.
    return g if g.flags.c_contiguous else np.ascontiguousarray(g)


def _batches(x: Any, out: Any, *operands: Any) -> list[tuple[Any, ...]] | None:
    """out (*lead, *x.shape) as len(lead) + 1 blocks: each operand's block (one of x's
    shape; a row (k,), or a (*lead, 1, .., 1, k) row per block, for a scale), or None
    where the layouts are not these. A batch of tangents or cotangents against one x
    (the fresh HVP's vectors, jacobians) runs the kernel block by block."""
    lead = out.shape[: out.ndim - x.ndim]
    if out.shape[len(lead) :] != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        return None
    count = int(np.prod(lead)) if lead else 1
    blocks: list[list[Any]] = [[] for _ in range(count)]
    k = x.shape[-1]
    for a in operands:
        if a.dtype != x.dtype:
            return None
        if a.shape[-1:] == (k,) and a.size == k and a.ndim <= x.ndim:
            a = _contiguous(a).reshape(k)  # one row, (1, .., 1, k) as well
            for block in blocks:
                block.append(a)
        elif a.shape == x.shape:
            a = _contiguous(a)
            for block in blocks:
                block.append(a)
        elif lead and a.shape[: len(lead)] == lead:
            inner = a.shape[len(lead) :]
            if inner == x.shape:
                parts = _contiguous(a).reshape((count,) + x.shape)
            elif inner[-1:] == (k,) and all(d == 1 for d in inner[:-1]):
                parts = _contiguous(a).reshape(count, k)
            else:
                return None
            for block, part in zip(blocks, parts, strict=True):
                block.append(part)
        else:
            return None
    flat = out.reshape((count,) + x.shape)
    return [(*block, flat[b]) for b, block in enumerate(blocks)]


def affine_grad(g: Any, x: Any, scale: Any, eps: float, out: Any) -> bool:
    """out = normalize_grad(g * scale, x): x's cotangent (out (*lead, *x.shape); g of
    x's shape or out's; scale (k,) or one (k,) row per block of lead)."""
    run = affine_grad_kernel.compiled()
    if run is None or not _affine_takes(x):
        return False
    if g.shape == x.shape and _affine_takes(x, scale) and _same(x, out):  # the usual case
        g = _contiguous(g)
        if g.dtype == x.dtype:
            run(_rows(g), _rows(x), scale, _consts(x, eps), _rows(out))
            return True
    blocks = _batches(x, out, g, scale)
    if blocks is None:
        return False
    consts, x_rows = _consts(x, eps), _rows(x)
    for g_b, scale_b, out_b in blocks:
        run(_rows(g_b), x_rows, scale_b, consts, _rows(out_b))
    return True


def scale_grad(g: Any, x: Any, eps: float, out: Any) -> bool:
    """out = the sum of g * normalize(x) over x's axes but the last (g (*lead, *x.shape),
    out (*lead, k))."""
    run = scale_grad_kernel.compiled()
    if run is None or not _affine_takes(x):
        return False
    lead = g.shape[: g.ndim - x.ndim]
    if (
        g.shape[len(lead) :] != x.shape
        or g.dtype != x.dtype
        or out.shape != lead + x.shape[-1:]
        or out.dtype != x.dtype
        or not out.flags.c_contiguous
    ):
        return False
    count = int(np.prod(lead)) if lead else 1
    g_blocks = _contiguous(g).reshape((count,) + x.shape)
    out_blocks = out.reshape(count, x.shape[-1])
    consts, x_rows = _consts(x, eps), _rows(x)
    for b in range(count):
        run(_rows(g_blocks[b]), x_rows, consts, out_blocks[b])
    return True


for _dtype in ("float32", "float64"):
    affine_forward_kernel.declare(
        (In(_dtype, 2), In(_dtype, 1), In(_dtype, 1), In(_dtype, 1), Out(_dtype, 2))
    )
    affine_grad_kernel.declare(
        (In(_dtype, 2), In(_dtype, 2), In(_dtype, 1), In(_dtype, 1), Out(_dtype, 2))
    )
    scale_grad_kernel.declare((In(_dtype, 2), In(_dtype, 2), In(_dtype, 1), Out(_dtype, 1)))
