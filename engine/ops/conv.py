"""Convolution and pooling, N-d, in ONNX's (and PyTorch's) channels-first layout.

Two linear primitives carry everything: `im2col` gathers the sliding windows of the
last axes into new axes (a strided view, copied once), and `col2im` adds windows back
into place (its transpose). Each is the other's VJP, so derivatives of any order are
plain engine ops. Convolution is then one GEMM per group (`matmul`), average pooling a
sum, max pooling a `max`, all composites whose rules come from their parts. Every
leading axis is left alone by both primitives, so batched cotangents and tangents
(jacobians, K-vector HVPs) go through in one pass.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from engine import backend
from engine.ops._util import coerce_pair
from engine.ops.elementwise import add, divide
from engine.ops.linalg import matmul_p
from engine.ops.reduce import max_p, sum_p
from engine.ops.shape import reshape, transpose
from engine.registry import defjvp, defvjp, primitive, public
from engine.tensor import Tensor, as_tensor, bind

Pads = tuple[tuple[int, int], ...]


def _out_size(size: int, k: int, s: int, lo: int, hi: int, d: int) -> int:
    return (size + lo + hi - d * (k - 1) - 1) // s + 1


# ---- im2col: windows of the last len(kernel) axes, as new axes ----
# x (..., *spatial) -> (..., *kernel, *out): out[..., k, o] = xpad[..., o * s + k * d].
def _im2col_impl(
    xp: Any, x: Any, *, kernel: tuple, strides: tuple, pads: Pads, dilations: tuple, value: float
) -> Any:
    nd = len(kernel)
    lead = x.shape[: x.ndim - nd]
    if any(lo or hi for lo, hi in pads):
        x = xp.pad(x, ((0, 0),) * len(lead) + pads, constant_values=value)
    else:
        x = xp.ascontiguousarray(x)
    spatial = x.shape[len(lead) :]
    out = tuple(
        (n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(spatial, kernel, strides, dilations)
    )
    st = x.strides[len(lead) :]
    view = xp.lib.stride_tricks.as_strided(
        x,
        lead + kernel + out,
        x.strides[: len(lead)]
        + tuple(t * d for t, d in zip(st, dilations))
        + tuple(t * s for t, s in zip(st, strides)),
    )
    return xp.ascontiguousarray(view)  # a copy: the result never aliases x


# col2im: the transpose, (..., *kernel, *out) -> (..., *spatial); windows that overlap add.
# One strided slice-add per kernel offset (the loop is over the kernel, never the output).
def _col2im_impl(
    xp: Any, p: Any, *, spatial: tuple, kernel: tuple, strides: tuple, pads: Pads, dilations: tuple
) -> Any:
    nd = len(kernel)
    lead = p.shape[: p.ndim - 2 * nd]
    out = p.shape[p.ndim - nd :]
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(spatial, pads))
    buf = xp.zeros(lead + padded, dtype=p.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        window = tuple(
            slice(o * d, o * d + s * (m - 1) + 1, s)
            for o, d, s, m in zip(offset, dilations, strides, out)
        )
        buf[(Ellipsis, *window)] += p[(Ellipsis, *offset) + (slice(None),) * nd]
    crop = tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, spatial))
    return buf[(Ellipsis, *crop)]


im2col_p = primitive("im2col", _im2col_impl)
col2im_p = primitive("col2im", _col2im_impl)


def _im2col(x: Tensor, kernel: tuple, strides: tuple, pads: Pads, dilations: tuple, value: float):
    return bind(
        im2col_p, x, kernel=kernel, strides=strides, pads=pads, dilations=dilations, value=value
    )


def im2col_vjp(ans: Tensor, x: Tensor, *, value: float, **window: Any) -> Any:
    spatial = x.shape[x.ndim - len(window["kernel"]) :]
    return lambda g: bind(col2im_p, g, spatial=spatial, **window)


def col2im_vjp(ans: Tensor, p: Tensor, *, spatial: tuple, **window: Any) -> Any:
    return lambda g: bind(im2col_p, g, value=0.0, **window)


defvjp(im2col_p, im2col_vjp)
# The padding value is a constant: a tangent is padded with zeros.
defjvp(im2col_p, lambda t, ans, x, *, value, **window: bind(im2col_p, t[0], value=0.0, **window))
defvjp(col2im_p, col2im_vjp)
defjvp(col2im_p, lambda t, ans, p, **params: bind(col2im_p, t[0], **params))


# ---- argument normalization (ONNX spellings and PyTorch's shorthands) ----
def _tuple(value: Any, nd: int, name: str, opname: str, default: int, low: int) -> tuple:
    if value is None:
        return (default,) * nd
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * nd
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{opname}: {name} must be an int or {nd} ints, got {value!r}") from None
    if len(out) != nd or any(v < low for v in out):
        raise ValueError(f"{opname}: {name} must be {nd} ints >= {low}, got {value!r}")
    return out


def normalize_pads(pads: Any, nd: int, opname: str) -> Pads:
    """Pads as ((begin, end), ...) per spatial axis, from an int (every side), nd ints
    (both sides of each axis), nd (begin, end) pairs, or ONNX's flat
    [x1_begin, x2_begin, ..., x1_end, x2_end]."""
    if pads is None:
        return ((0, 0),) * nd
    if isinstance(pads, int) and not isinstance(pads, bool):
        pads = (pads,) * nd
    try:
        items = list(pads)
        if items and all(isinstance(p, (list, tuple)) for p in items):
            out = tuple((int(lo), int(hi)) for lo, hi in items)
        else:
            flat = [int(p) for p in items]
            if len(flat) == nd:
                out = tuple((p, p) for p in flat)
            elif len(flat) == 2 * nd:
                out = tuple(zip(flat[:nd], flat[nd:]))
            else:
                out = ()
    except (TypeError, ValueError):
        raise TypeError(
            f"{opname}: pads must be ints or (begin, end) pairs, got {pads!r}"
        ) from None
    if len(out) != nd or any(lo < 0 or hi < 0 for lo, hi in out):
        raise ValueError(
            f"{opname}: pads must give a non-negative (begin, end) for each of {nd} spatial "
            f"axes, got {pads!r}"
        )
    return out


def _window(
    opname: str, spatial: tuple, kernel: tuple, strides: Any, pads: Any, dilations: Any
) -> tuple[tuple, Pads, tuple, tuple]:
    """(strides, pads, dilations, output spatial shape), checked."""
    nd = len(kernel)
    strides = _tuple(strides, nd, "strides", opname, 1, 1)
    dilations = _tuple(dilations, nd, "dilations", opname, 1, 1)
    pads = normalize_pads(pads, nd, opname)
    out = tuple(
        _out_size(n, k, s, lo, hi, d)
        for n, k, s, (lo, hi), d in zip(spatial, kernel, strides, pads, dilations)
    )
    if any(o < 1 for o in out):
        raise ValueError(
            f"{opname}: a window of {kernel} (dilations {dilations}) does not fit the spatial "
            f"shape {spatial} padded by {pads}"
        )
    return strides, pads, dilations, out


# ---- conv: im2col, then one GEMM per group ----
@public("nn")
def conv(
    x: Any,
    w: Any,
    b: Any = None,
    strides: Sequence[int] | int | None = None,
    pads: Any = None,
    dilations: Sequence[int] | int | None = None,
    groups: int = 1,
) -> Tensor:
    """N-d cross-correlation (ONNX Conv): x [N, C, *spatial], w [O, C/groups, *kernel]."""
    x, w = coerce_pair("conv", x, w)
    nd = w.ndim - 2
    if nd < 1 or x.ndim != nd + 2:
        raise ValueError(
            f"conv: input {x.shape} and weight {w.shape} must be [N, C, *spatial] and "
            "[C_out, C_in/groups, *kernel] with as many spatial axes"
        )
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    kernel = w.shape[2:]
    if not isinstance(groups, int) or groups < 1 or c % groups or o % groups:
        raise ValueError(
            f"conv: groups={groups!r} must divide the input channels ({c}) and the output "
            f"channels ({o})"
        )
    if cg != c // groups:
        raise ValueError(
            f"conv: weight {w.shape} must have C_in/groups = {c // groups} channels for input "
            f"{x.shape} with groups={groups}"
        )
    strides, pads, dilations, out = _window("conv", x.shape[2:], kernel, strides, pads, dilations)
    g, og, p, ck = groups, o // groups, math.prod(out), cg * math.prod(kernel)
    patches = _im2col(x, kernel, strides, pads, dilations, 0.0)  # [N, C, *kernel, *out]
    cols = reshape(transpose(reshape(patches, (n, g, ck, p)), (1, 2, 0, 3)), (g, ck, n * p))
    y = bind(matmul_p, reshape(w, (g, og, ck)), cols)  # [G, Og, N*P]: a GEMM per group
    y = reshape(transpose(reshape(y, (g, og, n, p)), (2, 0, 1, 3)), (n, o) + out)
    if b is not None:
        b = as_tensor(b, like=y)
        if b.shape != (o,):
            raise ValueError(f"conv: bias {b.shape} must have shape ({o},) for weight {w.shape}")
        y = add(y, reshape(b, (o,) + (1,) * nd))
    return y


# ---- pooling over the last len(kernel_shape) axes ----
def _pool_setup(
    opname: str, x: Tensor, kernel_shape: Any, strides: Any, pads: Any, dilations: Any, ceil: bool
) -> tuple:
    """(kernel, strides, pads as given, pads grown for ceil_mode, dilations, spatial)."""
    try:
        kernel = tuple(int(k) for k in kernel_shape)
    except (TypeError, ValueError):
        kernel = ()
    nd = len(kernel)
    if nd < 1 or x.ndim < nd or any(k < 1 for k in kernel):
        raise ValueError(f"{opname}: kernel_shape {kernel_shape!r} for an input of shape {x.shape}")
    spatial = x.shape[x.ndim - nd :]
    strides, pads, dilations, out = _window(opname, spatial, kernel, strides, pads, dilations)
    given = pads
    if ceil:  # extra end padding, counted nowhere, so the last partial window is kept
        grown = []
        for n, k, s, (lo, hi), d, o in zip(spatial, kernel, strides, pads, dilations, out):
            o_ceil = -(-(n + lo + hi - d * (k - 1) - 1) // s) + 1
            if (o_ceil - 1) * s >= n + lo:  # a window may not start in the end padding
                o_ceil -= 1
            grown.append((lo, hi + (o_ceil - o) * s))
        pads = tuple(grown)
    return kernel, strides, given, pads, dilations, spatial


@public("nn")
def max_pool(
    x: Any,
    kernel_shape: Sequence[int] = (),
    strides: Sequence[int] | int | None = None,
    pads: Any = None,
    dilations: Sequence[int] | int | None = None,
    ceil_mode: bool = False,
) -> Tensor:
    """Largest element of each window of the last len(kernel_shape) axes (ONNX MaxPool);
    ties share the gradient."""
    x = as_tensor(x)
    kernel, strides, _, pads, dilations, _ = _pool_setup(
        "max_pool", x, kernel_shape, strides, pads, dilations, ceil_mode
    )
    patches = _im2col(x, kernel, strides, pads, dilations, -math.inf)
    nd = len(kernel)
    axes = tuple(range(-2 * nd, -nd))
    return bind(max_p, patches, axes=axes, keepdims=False)


@public("nn")
def avg_pool(
    x: Any,
    kernel_shape: Sequence[int] = (),
    strides: Sequence[int] | int | None = None,
    pads: Any = None,
    count_include_pad: bool = False,
    ceil_mode: bool = False,
) -> Tensor:
    """Mean of each window of the last len(kernel_shape) axes (ONNX AveragePool); padding
    counts in the divisor only with count_include_pad (ceil_mode's extra end never does)."""
    x = as_tensor(x)
    kernel, strides, given, pads, dilations, spatial = _pool_setup(
        "avg_pool", x, kernel_shape, strides, pads, None, ceil_mode
    )
    nd = len(kernel)
    axes = tuple(range(-2 * nd, -nd))
    total = bind(
        sum_p, _im2col(x, kernel, strides, pads, dilations, 0.0), axes=axes, keepdims=False
    )
    # The divisor: how many counted cells each window covers, a constant of the shapes.
    xp = backend.array_module(x.value)
    counted = xp.ones(spatial, dtype=x.dtype)
    if count_include_pad:
        counted = xp.pad(counted, given, constant_values=1)
        window_pads = tuple((0, hi - g_hi) for (_, hi), (_, g_hi) in zip(pads, given))
    else:
        window_pads = pads
    count = _im2col_impl(
        xp,
        counted,
        kernel=kernel,
        strides=strides,
        pads=window_pads,
        dilations=dilations,
        value=0.0,
    ).sum(axis=tuple(range(nd)))
    return divide(total, Tensor(count))
