"""Convolution and pooling, N-d, in ONNX's (and PyTorch's) channels-first layout.

Convolution is three bilinear primitives closed under differentiation (the block headed
"conv: three bilinear primitives", further down): the convolution, its transpose in the input (the
input's cotangent: for stride 1 a convolution of the cotangent with the flipped kernel,
for other strides a GEMM and a col2im) and its transpose in the kernel (the kernel's
cotangent), all GEMMs over windows gathered once into the GEMM's layout. Pooling is
built from two linear primitives: `im2col` gathers the sliding windows of the last axes
into new axes (a strided view, copied once), and `col2im` adds windows back into place
(its transpose); each is the other's VJP, so derivatives of any order are plain engine
ops; average pooling is a sum, max pooling a `max`. Every leading axis passes through
all of them (broadcast between the two operands of a convolution), so batched
cotangents and tangents (jacobians, K-vector HVPs) go through in one pass.
"""

from __future__ import annotations

import builtins
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

from engine import backend
from engine.backend import host
from engine.kernels import conv as kernels
from engine.ops import winograd
from engine.ops._util import coerce_pair
from engine.ops.elementwise import add, divide
from engine.ops.linalg import matmul_p
from engine.ops.reduce import max_p, sum_p
from engine.ops.shape import reshape, transpose
from engine.registry import (
    DEFERRED_SHAPES,
    REPEATS_SHARED,
    defform,
    defjvp,
    defnondiff,
    defvjp,
    defvjp_argnum,
    defvjp_terms,
    primitive,
    public,
)
from engine.shapes import (
    RuleError,
    TensorType,
    broadcast,
    checked,
    concrete,
    like,
    pair,
    require,
)
from engine.tensor import Tensor, as_tensor, bind, pass_constant

Pads = tuple[tuple[int, int], ...]


def _out_sizes(
    spatial: Sequence[int],
    kernel: tuple,
    strides: tuple,
    dilations: tuple,
    pads: Pads | None = None,
) -> tuple[int, ...]:
    """Windows along each axis of `spatial`, padded by `pads` (none when None)."""
    pads = pads or ((0, 0),) * len(kernel)
    return tuple(
        (n + lo + hi - d * (k - 1) - 1) // s + 1
        for n, k, s, (lo, hi), d in zip(spatial, kernel, strides, pads, dilations)
    )


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
    out = _out_sizes(spatial, kernel, strides, dilations)
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
    expected = _out_sizes(padded, kernel, strides, dilations)
    if p.shape[len(lead) :] != kernel + expected:  # the strided writes below trust the shape
        raise ValueError(f"col2im: windows {p.shape} do not fit the spatial shape {spatial}")
    buf = xp.zeros(lead + padded, dtype=p.dtype)
    if _disjoint(kernel, strides, dilations):
        # Disjoint windows (pooling with stride = kernel): every cell is written at most
        # once, so one strided assignment replaces the adds.
        st = buf.strides[len(lead) :]
        view = xp.lib.stride_tricks.as_strided(
            buf,
            p.shape,
            buf.strides[: len(lead)]
            + tuple(t * d for t, d in zip(st, dilations))
            + tuple(t * s for t, s in zip(st, strides)),
        )
        view[...] = p
        crop = tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, spatial))
        return buf[(Ellipsis, *crop)]
    for offset in itertools.product(*(range(k) for k in kernel)):
        window = tuple(
            slice(o * d, o * d + s * (m - 1) + 1, s)
            for o, d, s, m in zip(offset, dilations, strides, out)
        )
        buf[(Ellipsis, *window)] += p[(Ellipsis, *offset) + (slice(None),) * nd]
    crop = tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, spatial))
    return buf[(Ellipsis, *crop)]


def _disjoint(kernel: tuple, strides: tuple, dilations: tuple) -> bool:
    """Whether no two windows share a cell (pooling with stride = kernel)."""
    return all(s >= d * (k - 1) + 1 for k, s, d in zip(kernel, strides, dilations))


im2col_p = primitive("im2col", _im2col_impl, flow="moves", linear_form="windows")
col2im_p = primitive("col2im", _col2im_impl)


def _im2col(x: Tensor, kernel: tuple, strides: Any, pads: Pads, dilations: Any, value: float):
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


# ---- conv: three bilinear primitives, each the others' derivatives ----
# conv_p(x, w) = A_w x, the cross-correlation; conv_input_p(g, w) = A_w^T g, its
# transpose in x (x's cotangent); conv_weight_p(x, g) = B_x^T g, its transpose in w (w's
# cotangent; B_x w = A_w x). Every derivative of one is another of the three (JAX's
# conv_general_dilated transpose rules, PyTorch's convolution_backward), so rules of any
# order are these ops:
#   conv         VJP x: conv_input(g, w)   VJP w: conv_weight(x, g)   JVP: A(tx, w) + A(x, tw)
#   conv_input   VJP g: conv(h, w)         VJP w: conv_weight(h, g)   (per pair; JVPs alike)
#   conv_weight  VJP x: conv_input(g, h)   VJP g: conv(x, h)
# Why not im2col + matmul (as pooling is): the windows are gathered straight into the
# GEMM's layout (*lead, G, C/G * K, N * P) (one copy, not a copy and a transposing copy),
# and for stride 1 x's cotangent is itself a convolution, of the padded cotangent with the
# flipped, channel-swapped kernel: one window copy and the same GEMM instead of a col2im
# (a zeros buffer and one strided add per kernel cell; on the host a few images at a
# time, see _conv_in_chunks). x's windows are a separate, nondifferentiable op
# (`gather_p`) whose result conv and conv_weight take as a last operand: the forward's
# windows serve the kernel's cotangent, and the JVPs' terms reuse them (in a replayed HVP
# at a fixed point they are computed once). Leading axes of either operand
# (batched tangents and cotangents) broadcast against each other in the GEMM; results
# are views (*lead, N, C, *spatial) of GEMM-ordered memory.
# conv_input takes pairs, conv_input(g_1, w_1, g_2, w_2, ...) = sum_i A_{w_i}^T g_i, one
# GEMM over the pairs' windows stacked along its inner dimension: its own tangent (two
# pairs), and x's cotangent in a second-order pass, where conv's and conv_weight's VJPs
# each give a term (registry.vjp_term_rules: the tape makes them one call). For strides
# > 1 that is one col2im instead of two and no add: 0.58-0.67x the two calls and the add
# on the ResNet's stride-2 layers, 0.96-0.99x at stride 1 (bench/RESULTS.md, branch conv5).
def _lead(a: Any, nd: int) -> tuple:
    return a.shape[: a.ndim - nd - 2]


# _CONV_LAYOUT: on the host, the input cotangent (conv_input) is made in the memory order
# of a convolution's own result, (C, N, *spatial) viewed (N, C, *spatial), as _unrows
# leaves the GEMM's output. Cotangents and the forward values they meet in the
# elementwise steps of a backward (ReLU's mask, BatchNorm's folded scale) then share one
# layout: NumPy runs a binary op over two 4-d arrays of different memory orders 2-3x
# slower (bench/RESULTS.md, "One memory order for a convolution's values and
# cotangents"), and conv_weight reads g's rows (_rows) without a transposing copy.
# BatchNorm's channel sums of either layout give the same bits (ops/reduce.channel_sum).


# On the host, with numba, the windows move in compiled loops (engine/kernels/conv.py):
# the gather in one pass (no padded copy), straight into the GEMM's layout, and the
# strided input cotangent's col2im in one pass per image (no zeros buffer and no strided
# read-modify-write per kernel offset). Both are exact (the same numbers as the NumPy
# routes below, which run on GPUs, without numba, with GRADTAPE_KERNELS=numpy, and for
# 3-d convolutions). A kernel is chosen at every size: its call costs ~2 us against the
# NumPy route's ~10-30 us of Python (measured in bench/RESULTS.md, "Compiled kernels for
# the convolutions' memory passes").
def _compiled(xp: Any, a: Any, nd: int) -> bool:
    """Whether the compiled window kernels take this array."""
    return (
        xp is host
        and nd <= 2
        and a.dtype.char in "fd"  # float32, float64 in the machine's byte order
        and a.dtype.isnative
        and kernels.gather2d.compiled() is not None
    )


# WINOGRAD: the stride-1 3 x 3 convolutions of the host by Winograd's F(2 x 2, 3 x 3)
# (engine/ops/winograd.py): 2.25x fewer multiply-adds in the GEMMs, transformed tiles 4/9
# the windows' size (bench/RESULTS.md, "Winograd F(2x2, 3x3) for the stride-1 3x3
# convolutions"). Not the im2col GEMM's bits, but in its rounding class: at most 2.6 / 1.9
# epsilons of the products' magnitude in float32 / float64, against the GEMM's 1.7 / 1.6
# (tests/engine/test_winograd.py). False: the windows' GEMM everywhere.
# Two routes: the stride-1 input cotangent (conv_input_p) by winograd.conv3x3; and a
# convolution's windows (gather_p), for which gather_p gives the input's transform V
# (winograd.transform_input) instead, and the convolution (conv_p) and its kernel's
# cotangent (conv_weight_p), which take it as their last operand, multiply it
# (winograd.conv_transformed, weight_transformed). Both where _winograd_pays.
WINOGRAD = True


def _winograd_pays(width: int, channels: int) -> bool:
    """Whether Winograd measured faster for results with rows this wide and this many
    channels (the windows' transform: the input's; the input cotangent: the fewer of
    the cotangent's and the result's). The transforms' cost grows with the pixels and
    channels, the GEMMs' saving with the square of the channels, and the transforms'
    loops run over a plane's tiles (one spare per row of tiles): narrow rows need more
    channels. Measured (bench/bench_winograd.py, float32, batch 64; Winograd / windows
    for the input cotangent of one pair, of two, and the windows' three ops): rows 32
    wide gain from 8 channels (8: 0.92 / 0.82 / 0.83x; 16: 0.93 / 0.84 / 0.67-0.71x),
    16 wide from 32 (32: 0.93 / 0.81 / 0.82-0.85x; 16: 1.21 / 0.91 / 1.01x), 8 wide not
    at 64 (1.02 / 0.96 / 1.00-1.13x); 3 channels (the ResNet's stem) cost the reused HVP
    3-5 ms (bench/RESULTS.md)."""
    if width >= 32:
        return channels >= 8
    return width >= 16 and channels >= 32


def _winograd(
    images: list, kernels_: list, kernel: tuple, dilations: tuple, groups: int, width: int
) -> bool:
    """Whether the stride-1 input cotangent of these images (one dtype; `width`: the
    result's rows) runs by Winograd."""
    dtype = images[0].dtype
    return (
        WINOGRAD
        and len(kernel) == 2
        and _winograd_pays(width, min(images[0].shape[1], kernels_[0].shape[1]))
        and all(x.dtype == dtype for x in images + kernels_)
        and winograd.applies(host, kernel, dilations, groups, dtype)
    )


def _winograd_windows(
    xp: Any, x: Any, kernel: tuple, strides: tuple, pads: Pads, dilations: tuple, groups: int
) -> bool:
    """Whether gather_p transforms x for Winograd rather than gathering its windows:
    decided from x and the window alone, so that the gather and the two products that
    take its result agree."""
    return (
        WINOGRAD
        and len(kernel) == 2
        and tuple(strides) == (1, 1)
        and _winograd_pays(x.shape[-1] + pads[1][0] + pads[1][1] - 2, x.shape[-3])
        and winograd.applies(xp, kernel, dilations, groups, x.dtype)
    )


def _as_2d(nd: int, *params: tuple) -> list:
    """A 1-d convolution's window parameters as a 2-d one's of height 1."""
    if nd == 2:
        return list(params)
    return [((0, 0),) + p if isinstance(p[0], tuple) else (1,) + p for p in params]


def _dense(x: Any) -> tuple[Any, tuple[int, ...]]:
    """x's flat memory and strides in elements (kernels.flat), copied when x is not dense."""
    found = kernels.flat(x)
    if found is None:
        found = kernels.flat(host.ascontiguousarray(x))
    return found  # type: ignore[return-value]  # a contiguous array is always dense


def _gather_kernel(
    x: Any, out: Any, kernel: tuple, strides: tuple, pads: Pads, dilations: tuple
) -> None:
    """The gather of _gather_impl into `out`, C-contiguous (*lead, C, *kernel, N, *out)
    in memory (any shape over it), by kernels.gather2d."""
    nd = len(kernel)
    kernel, strides, pads, dilations = _as_2d(nd, kernel, strides, pads, dilations)
    lead = _lead(x, nd)
    x = x.reshape(x.shape[: len(lead) + 2] + (1,) * (2 - nd) + x.shape[len(lead) + 2 :])
    n, c, h, w = x.shape[-4:]
    oh, ow = _out_sizes((h, w), kernel, strides, dilations, pads)
    window = (strides[0], strides[1], pads[0][0], pads[1][0], dilations[0], dilations[1])
    if math.prod(lead) == 1:  # size-1 leading axes (one batched vector): dropped, a view
        xf, (sn, sc, sh, sw) = _dense(x.reshape(x.shape[-4:]))
    else:  # batched tangents and cotangents: one image block after another
        xf, (sn, sc, sh, sw) = host.ascontiguousarray(x).reshape(-1), (c * h * w, h * w, w, 1)
    of = out.reshape(-1)
    kh, kw = kernel
    o_at = (kh * kw * n * oh * ow, kw * n * oh * ow, n * oh * ow, oh * ow, ow)
    gather = kernels.gather2d.compiled()
    assert gather is not None  # _compiled chose this route
    for i in range(math.prod(lead)):
        x_at = (i * n * c * h * w, sn, sc, sh, sw)
        o_off = i * c * kh * kw * n * oh * ow
        gather(xf, x_at, (n, c, h, w), of, (o_off, *o_at), (kh, kw, oh, ow), window)


def _col2im_kernel(
    windows: Any,
    n: int,
    c: int,
    spatial: tuple,
    kernel: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
) -> Any:
    """The input cotangent (*L, N, C, *spatial) over (*L, C, N, *spatial) memory (see
    _CONV_LAYOUT) from the windows' cotangents, the GEMM's
    (*L, G, C/G * K, N * P) (C-contiguous), added into place by kernels.col2im2d."""
    nd = len(kernel)
    kernel, strides, pads, dilations = _as_2d(nd, kernel, strides, pads, dilations)
    h, w = (1,) * (2 - nd) + tuple(spatial)
    oh, ow = _out_sizes((h, w), kernel, strides, dilations, pads)
    lead = windows.shape[:-3]
    out = host.empty(lead + (c, n) + tuple(spatial), windows.dtype).swapaxes(
        len(lead), len(lead) + 1
    )
    kh, kw = kernel
    w_at = (kh * kw * n * oh * ow, kw * n * oh * ow, n * oh * ow, oh * ow, ow)
    window = (strides[0], strides[1], pads[0][0], pads[1][0], dilations[0], dilations[1])
    wf, of = windows.reshape(-1), out.swapaxes(len(lead), len(lead) + 1).reshape(-1)
    o_at = (h * w, n * h * w, w)
    col2im = kernels.col2im2d.compiled()
    assert col2im is not None  # _compiled chose this route
    for i in range(math.prod(lead)):  # one block of windows per leading index
        w_block, o_block = (i * c * kh * kw * n * oh * ow, *w_at), (i * n * c * h * w, *o_at)
        col2im(wf, w_block, (kh, kw, oh, ow), of, o_block, (n, c, h, w), window)
    return out


def _gather_impl(
    xp: Any,
    x: Any,
    *,
    kernel: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
    out: Any = None,
) -> Any:
    """x (*lead, N, C, *spatial) -> windows (*lead, G, C/G * K, N * P). A negative pad
    crops (the transposed convolution's, for pads wider than the kernel). `out`: the
    compiled replay's buffer (a compiled kernel writes into it)."""
    nd = len(kernel)
    lead = _lead(x, nd)
    n, c = x.shape[len(lead) : len(lead) + 2]
    spatial = x.shape[-nd:]
    sizes = _out_sizes(spatial, kernel, strides, dilations, pads)
    if _compiled(xp, x, nd) and builtins.min(sizes) >= 1:
        if out is None:
            out = xp.empty(lead + (c,) + kernel + (n,) + sizes, x.dtype)
        elif out.size != math.prod(lead + (c,) + kernel + (n,) + sizes):  # the kernel trusts it
            raise ValueError(f"gather: a buffer of {out.shape} for windows of {x.shape}")
        _gather_kernel(x, out, kernel, strides, pads, dilations)
        return out.reshape(lead + (groups, c // groups * math.prod(kernel), n * math.prod(sizes)))
    x = x.swapaxes(-nd - 2, -nd - 1)  # (*lead, C, N, *spatial): N beside the windows
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        x = x[
            (
                Ellipsis,
                *(slice(max(0, -lo), m - max(0, -hi)) for (lo, hi), m in zip(pads, x.shape[-nd:])),
            )
        ]
    grow = tuple((max(0, lo), max(0, hi)) for lo, hi in pads)
    if any(lo or hi for lo, hi in grow):
        inner = x.shape[-nd:]
        buf = xp.zeros(
            x.shape[:-nd] + tuple(m + lo + hi for m, (lo, hi) in zip(inner, grow)), x.dtype
        )
        buf[(Ellipsis, *(slice(lo, lo + m) for (lo, _), m in zip(grow, inner)))] = x
        x = buf
    if any(o < 1 for o in sizes):
        raise ValueError(f"gather: a window of {kernel} does not fit {x.shape[-nd:]}")
    st = x.strides
    view = xp.lib.stride_tricks.as_strided(
        x,
        lead + (c,) + kernel + (n,) + sizes,
        st[: len(lead) + 1]
        + tuple(t * d for t, d in zip(st[-nd:], dilations))
        + (st[-nd - 1],)
        + tuple(t * s for t, s in zip(st[-nd:], strides)),
    )
    cols = xp.ascontiguousarray(view)  # (*lead, C, *kernel, N, *out): the one copy
    # Every size spelled out: NumPy cannot infer a -1 of an empty array (N, C or O of 0).
    cols = cols.reshape(lead + (groups, c // groups * math.prod(kernel), n * math.prod(sizes)))
    if out is not None:  # (a replay form exists only where the kernel runs)
        xp.copyto(out, cols)
        return out
    return cols


def _gather_prim(
    xp: Any,
    x: Any,
    *,
    kernel: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
    out: Any = None,
) -> Any:
    """gather_p: x's windows (_gather_impl), or its Winograd transform where
    _winograd_windows says so."""
    if _winograd_windows(xp, x, kernel, strides, pads, dilations, groups):
        return winograd.transform_input(x, pads, out)
    return _gather_impl(
        xp,
        x,
        kernel=kernel,
        strides=strides,
        pads=pads,
        dilations=dilations,
        groups=groups,
        out=out,
    )


def _rows(g: Any, nd: int, groups: int) -> Any:
    """An output-shaped g (*lead, N, O, *out) -> (*lead, G, O/G, N * P), copied only when
    its memory is not in that order already (a conv's own result is)."""
    lead = _lead(g, nd)
    n, o = g.shape[len(lead) : len(lead) + 2]
    g = g.swapaxes(-nd - 2, -nd - 1)
    return g.reshape(lead + (groups, o // groups, n * math.prod(g.shape[-nd:])))


def _unrows(y: Any, n: int, spatial: tuple) -> Any:
    """(*lead, G, C/G, N * P) -> a view (*lead, N, C, *spatial)."""
    y = y.reshape(y.shape[:-3] + (y.shape[-3] * y.shape[-2], n) + tuple(spatial))
    return y.swapaxes(-len(spatial) - 2, -len(spatial) - 1)


def _conv_impl(
    xp: Any,
    x: Any,
    w: Any,
    cols: Any,
    *,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
) -> Any:
    nd = len(strides)
    kernel, o = w.shape[-nd:], w.shape[-nd - 2]
    out = _out_sizes(x.shape[-nd:], kernel, strides, dilations, pads)
    if _winograd_windows(xp, x, kernel, strides, pads, dilations, groups):
        return winograd.conv_transformed(cols, w, x.shape[-nd - 2], out)
    wm = w.reshape(_lead(w, nd) + (groups, o // groups, w.shape[-nd - 1] * math.prod(kernel)))
    return _unrows(xp.matmul(wm, cols), x.shape[-nd - 2], out)


def _conv_input_impl(
    xp: Any,
    *operands: Any,
    spatial: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
) -> Any:
    """sum_i A_{w_i}^T g_i over the pairs (g_1, w_1, g_2, w_2, ...): one pair is x's
    cotangent; two are what a second-order pass adds (conv_input's tangent A_w^T g' +
    A_w'^T g; the cotangent of x that reaches it from conv and from conv_weight), as one
    GEMM over the pairs' windows stacked along its inner dimension (no second GEMM, no
    full-size add; for strides > 1 one col2im instead of one per pair)."""
    nd = len(strides)
    pairs = list(zip(operands[::2], operands[1::2], strict=True))
    for g, w in pairs:
        kernel, o = w.shape[-nd:], w.shape[-nd - 2]
        expected = _out_sizes(spatial, kernel, strides, dilations, pads)
        if g.shape[-nd:] != expected or g.shape[-nd - 1] != o:
            raise ValueError(f"conv_input: cotangent {g.shape} does not fit weight {w.shape}")
    window = {"spatial": spatial, "strides": strides, "pads": pads, "dilations": dilations}
    leads = [_lead(a, nd) for a in operands]
    lead = builtins.max(leads, key=len)
    if len(pairs) > 1 and all(math.prod(each) == 1 for each in leads):
        # Leading axes of size 1 (one batched vector, beside unbatched recorded values):
        # every cotangent given them and the kernels none, by reshapes, so the pairs stack.
        pairs = [
            (g.reshape(lead + g.shape[g.ndim - nd - 2 :]), w.reshape(w.shape[w.ndim - nd - 2 :]))
            for g, w in pairs
        ]
    if any(g.shape != pairs[0][0].shape or w.shape != pairs[0][1].shape for g, w in pairs):
        # Leading axes that differ between the pairs (a batched tangent beside an unbatched
        # primal) broadcast in the sum: one GEMM per pair.
        terms = [_conv_input_stacked(xp, [p], groups=groups, **window) for p in pairs]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total
    return _conv_input_stacked(xp, pairs, groups=groups, **window)


def _stack(xp: Any, arrays: list, axis: int) -> Any:
    return arrays[0] if len(arrays) == 1 else xp.concatenate(arrays, axis=axis)


def _conv_input_stacked(
    xp: Any,
    pairs: list,
    *,
    spatial: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
) -> Any:
    """sum_i A_{w_i}^T g_i for pairs of one shape: per group, the pairs' rows of the
    GEMM's inner dimension side by side (pair-major), the weights' columns likewise."""
    nd = len(strides)
    g0, w0 = pairs[0]
    kernel, (o, cg) = w0.shape[-nd:], w0.shape[-nd - 2 : -nd]
    lw, n = _lead(w0, nd), g0.shape[-nd - 2]
    if all(s == 1 for s in strides):
        # A convolution of g, padded so that every window that read a cell of x is seen
        # (_transposed_pads), with the kernel flipped and its channel axes swapped.
        flip = (Ellipsis,) + (slice(None, None, -1),) * nd
        wts = []
        for _, w in pairs:
            wg = w.reshape(lw + (groups, o // groups, cg) + kernel)[flip]
            wt = xp.ascontiguousarray(wg.swapaxes(-nd - 2, -nd - 1))
            wts.append(wt.reshape(lw + (groups, cg, o // groups * math.prod(kernel))))
        wt = _stack(xp, wts, -1)  # (*lw, G, C/G, pairs * O/G * K)
        tpads = _transposed_pads(kernel, pads, dilations)
        if xp is host and not lw:  # on the host, a few images at a time (see _conv_in_chunks)
            lead = g0.shape[: -nd - 1]
            images = [g.reshape((math.prod(lead),) + g.shape[-nd - 1 :]) for g, _ in pairs]
            if _winograd(images, [w for _, w in pairs], kernel, dilations, groups, spatial[-1]):
                # the flipped kernels, channel axes swapped: (C, O, 3, 3)
                flipped = [w[..., ::-1, ::-1].swapaxes(0, 1) for _, w in pairs]
                dx = winograd.conv3x3(images, flipped, tpads, n)
            else:
                dx = _conv_in_chunks(xp, images, wt, kernel, tpads, dilations, groups, n)
            return dx.reshape(lead + (groups * cg,) + tuple(spatial))
        parts = []
        for g, _ in pairs:
            part = _gather_impl(  # (*lg, G, O/G * K, N * P)
                xp,
                g,
                kernel=kernel,
                strides=strides,
                pads=tpads,
                dilations=dilations,
                groups=groups,
            )
            parts.append(part.reshape(part.shape[:-2] + (1,) + part.shape[-2:]))
        cols = _stack(xp, parts, -3)  # (*lg, G, pairs, O/G * K, N * P)
        cols = cols.reshape(cols.shape[:-3] + (cols.shape[-3] * cols.shape[-2], cols.shape[-1]))
        return _unrows(xp.matmul(wt, cols), n, spatial)
    # Strided: the windows' cotangents (W^T g), added back into place.
    wm = _stack(
        xp, [w.reshape(lw + (groups, o // groups, cg * math.prod(kernel))) for _, w in pairs], -2
    )
    rows = _stack(xp, [_rows(g, nd, groups) for g, _ in pairs], -2)  # (*L, G, pairs * O/G, N*P)
    windows = xp.matmul(wm.swapaxes(-1, -2), rows)  # (*L, G, C/G*K, N*P)
    expected = g0.shape[-nd:]
    if _compiled(xp, windows, nd) and not _disjoint(kernel, strides, dilations):
        return _col2im_kernel(windows, n, groups * cg, spatial, kernel, strides, pads, dilations)
    windows = windows.reshape(windows.shape[:-3] + (groups * cg,) + kernel + (n,) + expected)
    windows = xp.moveaxis(windows, -nd - 1, -2 * nd - 2)  # (*L, N, C, *kernel, *out): a view
    return _col2im_impl(
        xp, windows, spatial=spatial, kernel=kernel, strides=strides, pads=pads, dilations=dilations
    )


# On the host, the stride-1 input cotangent gathers the windows of a few images at a time
# into a buffer the size of a cache (CHUNK_BYTES) and multiplies them there, writing each
# image's result in place: the windows never go to memory and back (for 16 channels on
# 32 x 32 that nearly halves its time; measured in bench/RESULTS.md, "Convolution as three
# primitives"). On a GPU, one gather of everything and one batched GEMM. With the
# compiled gather (no padded buffer to copy through) larger chunks pay: fewer calls and
# wider GEMMs, 0.95-0.97x the time at 1 MB for the two pairs of a second-order pass (bench/
# RESULTS.md, "Compiled kernels for the convolutions' memory passes").
CHUNK_BYTES = 1 << 20
KERNEL_CHUNK_BYTES = 4 << 20


def _conv_in_chunks(
    xp: Any,
    xs: list,
    wm: Any,
    kernel: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
    batch: int,
) -> Any:
    """sum_i of stride-1 convolutions of images xs[i] (M, C, *spatial), all of one shape,
    with wm (G, O/G, len(xs) * C/G * K) (pair-major within each group), as (M / batch,
    batch, O, *out) over (M / batch, O, batch, *out) memory (see _CONV_LAYOUT: the M
    images are batches of `batch`, each laid out as a convolution's result). A negative
    pad crops."""
    k = len(xs)
    m_all, c, inner = xs[0].shape[0], xs[0].shape[1], xs[0].shape[2:]
    out = _out_sizes(inner, kernel, (1,) * len(kernel), dilations, pads)
    p, ck, o = math.prod(out), wm.shape[-1], wm.shape[-3] * wm.shape[-2]
    dtype = xp.result_type(*xs, wm)  # pairs of two dtypes: the sum's, as the other routes
    # the kernel copies one dtype; pairs of two cast on the NumPy route
    compiled = _compiled(xp, xs[0], len(kernel)) and all(x.dtype == dtype for x in xs)
    chunk_bytes = KERNEL_CHUNK_BYTES if compiled else CHUNK_BYTES
    per_chunk = builtins.max(
        1, chunk_bytes // builtins.max(1, k * c * math.prod(kernel) * p * dtype.itemsize)
    )
    blocks = m_all // batch if batch else 0  # (an empty batch: no images at all)
    # _CONV_LAYOUT: (blocks, O, batch, P) memory; the GEMMs write (image, G, O/G, P) views
    # of it (made from the buffer's own shape: ndarray.reshape's copy=False is NumPy 2.1+)
    memory = xp.empty((blocks, groups, o // groups, batch, p), dtype=dtype)
    rows = memory.transpose(0, 3, 1, 2, 4)  # (blocks, batch, G, O/G, P)
    # the windows of a chunk of images: (images, G, pairs, C/G, *kernel, *out), each
    # group's rows of every pair side by side
    cols = xp.empty((builtins.min(per_chunk, m_all), groups, k, c // groups) + kernel + out, dtype)
    if compiled:
        fill = _chunk_gather(xs, cols, kernel, pads, dilations)
    else:
        fill = _chunk_copy(xp, xs, cols, kernel, pads, dilations)
    m0 = 0
    while m0 < m_all:
        b, i = divmod(m0, batch)
        if i == 0 and per_chunk >= batch:  # whole batches (blocks of the layout) at once:
            # small batches of many leading rows (jacobians, K-vector passes at N = 1)
            mb = builtins.min(per_chunk // batch, blocks - b)
            mc = mb * batch
            fill(m0, mc)
            chunk = cols[:mc].reshape(mb, batch, groups, ck, p)
            xp.matmul(wm, chunk, out=rows[b : b + mb])
        else:  # a chunk within one batch
            mc = builtins.min(per_chunk, batch - i)
            fill(m0, mc)
            xp.matmul(wm, cols[:mc].reshape(mc, groups, ck, p), out=rows[b, i : i + mc])
        m0 += mc
    return memory.reshape((blocks, o, batch) + out).swapaxes(1, 2)


def _chunk_copy(xp: Any, xs: list, cols: Any, kernel: tuple, pads: Pads, dilations: tuple) -> Any:
    """fill(m0, mc): images m0 .. m0 + mc of every x copied into a zero-padded buffer, and
    that buffer's windows (a strided view) into cols."""
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        crop = (slice(max(0, -lo), m - max(0, -hi)) for (lo, hi), m in zip(pads, xs[0].shape[2:]))
        window = (Ellipsis, *crop)
        xs = [x[window] for x in xs]
        pads = tuple((max(0, lo), max(0, hi)) for lo, hi in pads)
    inner = xs[0].shape[2:]
    padded = tuple(m + lo + hi for m, (lo, hi) in zip(inner, pads))
    buf = xp.zeros(cols.shape[:4] + padded, dtype=cols.dtype)  # pads stay 0
    interior = tuple(slice(lo, lo + m) for (lo, _), m in zip(pads, inner))
    st = buf.strides
    windows = xp.lib.stride_tricks.as_strided(
        buf, cols.shape, st[:4] + tuple(t * d for t, d in zip(st[4:], dilations)) + st[4:]
    )
    groups, cg = cols.shape[1], cols.shape[3]

    def fill(m0: int, mc: int) -> None:
        for i, x in enumerate(xs):
            part = x[m0 : m0 + mc].reshape((mc, groups, cg) + inner)
            buf[(slice(0, mc), slice(None), i, slice(None), *interior)] = part
        xp.copyto(cols[:mc], windows[:mc])

    return fill


def _chunk_gather(xs: list, cols: Any, kernel: tuple, pads: Pads, dilations: tuple) -> Any:
    """fill(m0, mc): the windows of images m0 .. m0 + mc of every x straight into cols, by
    kernels.gather2d (pads and crops in its index arithmetic: no buffer)."""
    nd = len(kernel)
    kernel, pads, dilations = _as_2d(nd, kernel, pads, dilations)
    groups, k, cg = cols.shape[1:4]
    h, w = (1,) * (2 - nd) + xs[0].shape[2:]
    (kh, kw), (oh, ow) = kernel, _out_sizes((h, w), kernel, (1, 1), dilations, pads)
    pair = cg * kh * kw * oh * ow  # one pair's windows of one group of one image
    window = (1, 1, pads[0][0], pads[1][0], dilations[0], dilations[1])
    of = cols.reshape(-1)
    images = [_dense(x) for x in xs]
    gather = kernels.gather2d.compiled()
    assert gather is not None  # _compiled chose this route

    def fill(m0: int, mc: int) -> None:
        for i, (xf, (sn, sc, *s_hw)) in enumerate(images):
            sh, sw = (0,) * (2 - nd) + tuple(s_hw)
            for g in range(groups):
                x_at = (m0 * sn + g * cg * sc, sn, sc, sh, sw)
                o_at = (
                    (g * k + i) * pair,
                    kh * kw * oh * ow,
                    kw * oh * ow,
                    oh * ow,
                    groups * k * pair,
                    ow,
                )
                gather(xf, x_at, (mc, cg, h, w), of, o_at, (kh, kw, oh, ow), window)

    return fill


def _conv_weight_impl(
    xp: Any,
    x: Any,
    g: Any,
    cols: Any,
    *,
    kernel: tuple,
    strides: tuple,
    pads: Pads,
    dilations: tuple,
    groups: int,
) -> Any:
    nd = len(kernel)
    if _winograd_windows(xp, x, kernel, strides, pads, dilations, groups):
        return winograd.weight_transformed(cols, g)
    dw = xp.matmul(_rows(g, nd, groups), cols.swapaxes(-1, -2))  # (*L, G, O/G, C/G * K)
    o, c = g.shape[-nd - 1], x.shape[-nd - 1]
    return dw.reshape(dw.shape[:-3] + (o, c // groups) + tuple(kernel))


gather_p = primitive("conv_gather", _gather_prim)
# The second backward of a reused HVP gathers one cotangent's windows twice, for
# conv_input's VJP in its cotangent (a convolution) and in its kernel (conv_weight): a
# compiled replay gathers them once.
REPEATS_SHARED.add(gather_p)
defnondiff(gather_p)  # a hint: every rule below differentiates the op that takes it


def _gather_form(params: dict, operands: list, value: Any) -> Any:
    """The compiled replay's form: the kernel's gather into the schedule's buffer (a
    buffer kept between passes: no fresh pages to fault in per pass)."""
    if not _compiled(host, value, len(params["kernel"])):
        return None
    return lambda x, out: _gather_prim(host, x, out=out, **params)


defform(gather_p, _gather_form)
conv_p = primitive("conv", _conv_impl)
conv_input_p = primitive("conv_input", _conv_input_impl)
conv_weight_p = primitive("conv_weight", _conv_weight_impl)


def _transposed_pads(kernel: tuple, pads: Pads, dilations: tuple) -> Pads:
    """The pads of g whose stride-1 windows are x's cells' (negative: a crop)."""
    return tuple(
        (d * (k - 1) - lo, d * (k - 1) - hi) for k, d, (lo, hi) in zip(kernel, dilations, pads)
    )


def _conv(x: Tensor, w: Tensor, cols: Tensor | None = None, **window: Any) -> Tensor:
    if cols is None:
        kernel = w.shape[w.ndim - len(window["strides"]) :]
        cols = bind(gather_p, x, kernel=kernel, **window)
    return bind(conv_p, x, w, cols, **window)


def _conv_input(g: Tensor, w: Tensor, spatial: tuple, **window: Any) -> Tensor:
    return bind(conv_input_p, g, w, spatial=spatial, **window)


def _conv_weight(
    x: Tensor, g: Tensor, kernel: tuple, cols: Tensor | None = None, **window: Any
) -> Tensor:
    if cols is None:
        cols = bind(gather_p, x, kernel=kernel, **window)
    return bind(conv_weight_p, x, g, cols, kernel=kernel, **window)


def _lifted(t: Tensor, primal: Tensor, ans: Tensor, nd: int) -> Tensor:
    """A tangent (*batch, *primal.shape) given size-1 axes after its batch axes where its
    primal has fewer leading axes than the result, so the other operand's leading axes
    line up with the result's in the GEMM."""
    extra = (ans.ndim - nd - 2) - (primal.ndim - nd - 2)
    if extra <= 0:
        return t
    return reshape(t, t.shape[: t.ndim - primal.ndim] + (1,) * extra + primal.shape)


def _spatial(a: Tensor, nd: int) -> tuple:
    return a.shape[a.ndim - nd :]


def _bind_term(term: tuple) -> Tensor:
    """A term rule's call, made (the VJP rules beside the term rules)."""
    prim, operands, params = term
    return bind(prim, *operands, **params)


# x's cotangent from conv and from conv_weight is a term of a conv_input: the tape makes
# an input's terms one conv_input (registry.vjp_term_rules; a second-order pass has two).
def conv_term_x(ans: Tensor, x: Tensor, w: Tensor, cols: Tensor, **window: Any) -> Any:
    params = {"spatial": _spatial(x, len(window["strides"])), **window}
    return lambda g: (conv_input_p, (g, w), params)


def conv_vjp_x(ans: Tensor, x: Tensor, w: Tensor, cols: Tensor, **window: Any) -> Any:
    term = conv_term_x(ans, x, w, cols, **window)
    return lambda g: _bind_term(term(g))


def conv_vjp_w(ans: Tensor, x: Tensor, w: Tensor, cols: Tensor, **window: Any) -> Any:
    kernel = _spatial(w, len(window["strides"]))
    return lambda g: _conv_weight(x, g, kernel, cols, **window)


def conv_jvp(t: list, ans: Tensor, x: Tensor, w: Tensor, cols: Tensor, **window: Any) -> Tensor:
    nd = len(window["strides"])
    terms = []
    if t[0] is not None:
        terms.append(_conv(_lifted(t[0], x, ans, nd), w, **window))
    if t[1] is not None:
        terms.append(_conv(x, _lifted(t[1], w, ans, nd), cols, **window))
    return terms[0] if len(terms) == 1 else add(terms[0], terms[1])


def _conv_input_pair(operands: tuple, argnum: int) -> tuple:
    """The (g, w) pair of conv_input's operands that argument argnum belongs to."""
    first = argnum - argnum % 2
    return operands[first], operands[first + 1]


def conv_input_vjp(argnum: int, ans: Tensor, *operands: Tensor, **params: Any) -> Any:
    window = {k: v for k, v in params.items() if k != "spatial"}
    g, w = _conv_input_pair(operands, argnum)
    if argnum % 2 == 0:
        return lambda h: _conv(h, w, **window)
    kernel = _spatial(w, len(window["strides"]))
    return lambda h: _conv_weight(h, g, kernel, **window)


def conv_input_jvp(t: list, ans: Tensor, *operands: Tensor, **params: Any) -> Tensor:
    # Bilinear in each pair: A_w^T g' + A_w'^T g per pair, all of them one conv_input.
    nd = len(params["strides"])
    pairs: list[Tensor] = []
    for i in range(0, len(operands), 2):
        g, w = operands[i], operands[i + 1]
        if t[i] is not None:
            pairs += [_lifted(t[i], g, ans, nd), w]
        if t[i + 1] is not None:
            pairs += [g, _lifted(t[i + 1], w, ans, nd)]
    return bind(conv_input_p, *pairs, **params)


def conv_weight_term_x(
    ans: Tensor, x: Tensor, g: Tensor, cols: Tensor, *, kernel: tuple, **window: Any
) -> Any:
    params = {"spatial": _spatial(x, len(kernel)), **window}
    return lambda h: (conv_input_p, (g, h), params)


def conv_weight_vjp_x(
    ans: Tensor, x: Tensor, g: Tensor, cols: Tensor, *, kernel: tuple, **window: Any
) -> Any:
    term = conv_weight_term_x(ans, x, g, cols, kernel=kernel, **window)
    return lambda h: _bind_term(term(h))


def conv_weight_vjp_g(
    ans: Tensor, x: Tensor, g: Tensor, cols: Tensor, *, kernel: tuple, **window: Any
) -> Any:
    return lambda h: _conv(x, h, cols, **window)


def conv_weight_jvp(
    t: list, ans: Tensor, x: Tensor, g: Tensor, cols: Tensor, *, kernel: tuple, **window: Any
) -> Tensor:
    nd = len(kernel)
    terms = []
    if t[0] is not None:
        terms.append(_conv_weight(_lifted(t[0], x, ans, nd), g, kernel, **window))
    if t[1] is not None:
        terms.append(_conv_weight(x, _lifted(t[1], g, ans, nd), kernel, cols, **window))
    return terms[0] if len(terms) == 1 else add(terms[0], terms[1])


defvjp(conv_p, conv_vjp_x, conv_vjp_w)
defvjp_terms(conv_p, conv_term_x)
defjvp(conv_p, conv_jvp)
defvjp_argnum(conv_input_p, conv_input_vjp)  # variadic: pairs (g_1, w_1, g_2, w_2, ...)
defjvp(conv_input_p, conv_input_jvp)
defvjp(conv_weight_p, conv_weight_vjp_x, conv_weight_vjp_g)
defvjp_terms(conv_weight_p, conv_weight_term_x)
defjvp(conv_weight_p, conv_weight_jvp)


def _conv_weight_shape(
    x: Tensor, g: Tensor, cols: Tensor, *, kernel: tuple, groups: int, **_: Any
) -> tuple:
    nd = len(kernel)
    lead = broadcast(_lead(x, nd), _lead(g, nd))
    return lead + (g.shape[-nd - 1], x.shape[-nd - 1] // groups) + tuple(kernel)


# A gradient wanted only for its tangent (a fresh HVP) leaves the kernels' products unrun.
DEFERRED_SHAPES[conv_weight_p] = _conv_weight_shape


# ---- shapes: shared by the wrappers and the shape rules ----
# The functions below raise RuleError with a message that does not name the op; the
# wrappers prefix it (`checked`), the language reports it at the call's line and column.
def _tuple(value: Any, nd: int, name: str, default: int) -> tuple:
    if value is None:
        return (default,) * nd
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * nd
    try:
        out = tuple(_int(v) for v in value)
    except (TypeError, ValueError):
        raise RuleError(f"{name} must be an int or {nd} ints, got {value!r}") from None
    if len(out) != nd or any(v < 1 for v in out):
        raise RuleError(f"{name} must be {nd} positive ints, got {value!r}")
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, host.integer)):
        raise TypeError
    return int(v)


def normalize_pads(pads: Any, nd: int) -> Pads:
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
            pairs = [tuple(p) for p in items]
            if any(len(p) != 2 for p in pairs):
                raise ValueError
            out = tuple((_int(lo), _int(hi)) for lo, hi in pairs)
        else:
            flat = [_int(p) for p in items]
            if len(flat) == nd:
                out = tuple((p, p) for p in flat)
            elif len(flat) == 2 * nd:
                out = tuple(zip(flat[:nd], flat[nd:]))
            else:
                out = ()
    except (TypeError, ValueError):
        raise RuleError(f"pads must be ints or (begin, end) pairs, got {pads!r}") from None
    if len(out) != nd or any(lo < 0 or hi < 0 for lo, hi in out):
        raise RuleError(
            f"pads must give a non-negative (begin, end) for each of {nd} spatial axes, "
            f"got {pads!r}"
        )
    return out


AUTO_PADS = ("SAME_UPPER", "SAME_LOWER", "VALID", "same", "valid")


def auto_pads(
    spatial: tuple, kernel: tuple, strides: tuple, dilations: tuple, auto_pad: str
) -> Pads:
    """ONNX's auto_pad (SAME_UPPER, SAME_LOWER: out = ceil(in / stride), the odd cell at
    the end or the beginning; VALID: none) and PyTorch's padding='same' (SAME_UPPER, for
    stride 1) / 'valid' as explicit (begin, end) pads."""
    if auto_pad not in AUTO_PADS:
        raise RuleError(f"pads must be ints, (begin, end) pairs or one of {AUTO_PADS}")
    if auto_pad.upper() == "VALID":
        return ((0, 0),) * len(kernel)
    if auto_pad == "same" and any(s != 1 for s in strides):
        raise RuleError(f"padding='same' needs strides of 1, got {strides}")
    out = []
    for n, k, s, d in zip(spatial, kernel, strides, dilations):
        total = builtins.max(0, (-(-n // s) - 1) * s + d * (k - 1) + 1 - n)
        small, large = total // 2, total - total // 2
        out.append((large, small) if auto_pad == "SAME_LOWER" else (small, large))
    return tuple(out)


def _window(
    spatial: tuple, kernel: tuple, strides: Any, pads: Any, dilations: Any
) -> tuple[tuple, Pads, tuple, tuple]:
    """(strides, pads, dilations, output spatial shape), checked."""
    nd = len(kernel)
    strides = _tuple(strides, nd, "strides", 1)
    dilations = _tuple(dilations, nd, "dilations", 1)
    if isinstance(pads, str):
        pads = auto_pads(spatial, kernel, strides, dilations, pads)
    pads = normalize_pads(pads, nd)
    out = _out_sizes(spatial, kernel, strides, dilations, pads)
    if any(o < 1 for o in out):
        raise RuleError(
            f"a window of {kernel} (dilations {dilations}) does not fit the spatial shape "
            f"{spatial} padded by {pads}"
        )
    return strides, pads, dilations, out


def conv_shape(
    x: tuple, w: tuple, b: tuple | None, strides: Any, pads: Any, dilations: Any, groups: Any
) -> tuple[tuple, tuple, Pads, tuple]:
    """(output shape, strides, pads, dilations) of conv on these shapes, or RuleError."""
    nd = len(w) - 2
    if nd < 1 or len(x) != nd + 2:
        raise RuleError(
            f"input {x} and weight {w} must be [N, C, *spatial] and "
            "[C_out, C_in/groups, *kernel] with as many spatial axes"
        )
    n, c = x[:2]
    o, cg = w[:2]
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise RuleError(f"groups must be a positive int, got {groups!r}")
    if c % groups or o % groups:
        raise RuleError(
            f"groups={groups} must divide the input channels ({c}) and the output channels ({o})"
        )
    if cg != c // groups:
        raise RuleError(
            f"weight {w} must have C_in/groups = {c // groups} channels for input {x} with "
            f"groups={groups}"
        )
    if b is not None and tuple(b) != (o,):
        raise RuleError(f"bias {b} must have shape ({o},) for weight {w}")
    if any(k < 1 for k in w[2:]):
        raise RuleError(f"weight {w} has an empty kernel")
    strides, pads, dilations, out = _window(x[2:], w[2:], strides, pads, dilations)
    return (n, o) + out, strides, pads, dilations


class PoolWindow(NamedTuple):
    out: tuple  # the output shape
    kernel: tuple
    strides: tuple
    given: Pads  # the pads asked for
    pads: Pads  # grown at the end for ceil_mode
    dilations: tuple
    spatial: tuple


def pool_shape(
    x: tuple, kernel_shape: Any, strides: Any, pads: Any, dilations: Any, ceil_mode: bool
) -> PoolWindow:
    """The window of a pool over the last len(kernel_shape) axes of x, or RuleError."""
    try:
        kernel = tuple(_int(k) for k in kernel_shape)
    except TypeError:
        kernel = ()
    nd = len(kernel)
    if nd < 1 or len(x) < nd or any(k < 1 for k in kernel):
        raise RuleError(f"kernel_shape {kernel_shape!r} for an input of shape {x}")
    spatial = tuple(x[len(x) - nd :])
    strides, given, dilations, out = _window(spatial, kernel, strides, pads, dilations)
    for k, d, (lo, hi) in zip(kernel, dilations, given):
        if max(lo, hi) >= d * (k - 1) + 1:  # a window would see padding only
            raise RuleError(f"pads {given} must be smaller than the window {kernel}")
    pads = given
    if ceil_mode:  # extra end padding, counted nowhere, so the last partial window is kept
        grown, ceil_out = [], list(out)
        for i, (n, k, s, (lo, hi), d) in enumerate(zip(spatial, kernel, strides, given, dilations)):
            o_ceil = -(-(n + lo + hi - d * (k - 1) - 1) // s) + 1
            if (o_ceil - 1) * s >= n + lo:  # no window starts in the end padding (PyTorch)
                o_ceil -= 1
            grown.append((lo, hi + (o_ceil - ceil_out[i]) * s))
            ceil_out[i] = o_ceil
        pads, out = tuple(grown), tuple(ceil_out)
    return PoolWindow(
        tuple(x[: len(x) - nd]) + out, kernel, strides, given, pads, dilations, spatial
    )


# ---- conv: the public op (the primitives above) ----
CONV = {"strides": "window?", "pads": "pads", "dilations": "window?", "groups": "int"}


def check_bias_dtype(bias: Any, x: Any) -> None:
    if bias != x:
        raise RuleError(f"bias dtype {bias} differs from the input's {x}", "dtype", TypeError)


def conv_rule(b: dict[str, Any]) -> TensorType:
    x, w = pair(b["x"], b["w"])
    require(x, "float")
    bias = b.get("b")
    if bias is not None:
        bias = like(bias, x)
        check_bias_dtype(bias.dtype, x.dtype)
    bias_shape = None if bias is None else bias.shape
    window = (b.get("strides"), b.get("pads"), b.get("dilations"), b.get("groups", 1))
    return TensorType(conv_shape(x.shape, w.shape, bias_shape, *window)[0], x.dtype)


def conv_workspace(b: dict[str, Any], out: TensorType) -> int:
    """The im2col patches: every input channel times every kernel cell, per output cell."""
    x, w = b["x"], b["w"]
    return x.shape[0] * x.shape[1] * math.prod(w.shape[2:]) * math.prod(out.shape[2:])


@public("nn", shape_rule=conv_rule, kinds=CONV, workspace=conv_workspace)
def conv(
    x: Any,
    w: Any,
    b: Any = None,
    strides: Sequence[int] | int | None = None,
    pads: Any = None,
    dilations: Sequence[int] | int | None = None,
    groups: int = 1,
) -> Tensor:
    """N-d cross-correlation (ONNX Conv): x [N, C, *spatial], w [O, C/groups, *kernel],
    optional bias b [O]; pads an int, per-axis ints, (begin, end) pairs, ONNX's flat list
    or an auto_pad name ('SAME_UPPER', 'SAME_LOWER', 'VALID'; PyTorch's 'same', 'valid')."""
    x, w = coerce_pair("conv", x, w)
    if b is not None:
        b = as_tensor(b, like=x)
        checked("conv", check_bias_dtype, b.dtype, x.dtype)
    shape, strides, pads, dilations = checked(
        "conv",
        conv_shape,
        x.shape,
        w.shape,
        None if b is None else b.shape,
        strides,
        pads,
        dilations,
        groups,
    )
    window = {"strides": strides, "pads": pads, "dilations": dilations, "groups": groups}
    if _unfused.get():
        y = _conv_unfused(x, w, shape, **window)
    else:
        y = _conv(x, w, **window)
    if b is not None:
        y = add(y, reshape(b, (shape[1],) + (1,) * (len(shape) - 2)))
    return y


# The per-example machinery (engine/per_example.py: per-example gradients, KFAC, Laplace)
# reads a recorded model's layers as matrix products of a parameter and the data; it
# records the model once more with convolutions as im2col + matmul, which it can read.
_unfused: ContextVar[bool] = ContextVar("conv_unfused", default=False)


@contextmanager
def unfused() -> Iterator[None]:
    """Within: conv records im2col, a GEMM per group and the layout moves between them
    (the same values as conv_p's, to rounding), instead of the conv primitives."""
    token = _unfused.set(True)
    try:
        yield
    finally:
        _unfused.reset(token)


def _conv_unfused(
    x: Tensor, w: Tensor, shape: tuple, *, strides: tuple, pads: Pads, dilations: tuple, groups: int
) -> Tensor:
    n, (o, cg), kernel, out = x.shape[0], w.shape[:2], w.shape[2:], shape[2:]
    g, og, p, ck = groups, o // groups, math.prod(out), cg * math.prod(kernel)
    patches = _im2col(x, kernel, strides, pads, dilations, 0.0)  # [N, C, *kernel, *out]
    cols = reshape(transpose(reshape(patches, (n, g, ck, p)), (1, 2, 0, 3)), (g, ck, n * p))
    y = bind(matmul_p, reshape(w, (g, og, ck)), cols)  # [G, Og, N*P]: a GEMM per group
    return reshape(transpose(reshape(y, (g, og, n, p)), (2, 0, 1, 3)), shape)


# ---- pooling over the last len(kernel_shape) axes ----
def _float_input(opname: str, x: Any) -> Tensor:
    x = as_tensor(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{opname}: needs a floating-point tensor, got {x.dtype}")
    return x


POOL = {"kernel_shape": "ints", "strides": "window?", "pads": "pads", "ceil_mode": "bool"}


def max_pool_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    window = (b.get("strides"), b.get("pads"), b.get("dilations"), b.get("ceil_mode", False))
    return TensorType(pool_shape(x.shape, b["kernel_shape"], *window).out, x.dtype)


def avg_pool_rule(b: dict[str, Any]) -> TensorType:
    return max_pool_rule({**b, "dilations": None})


def pool_workspace(b: dict[str, Any], out: TensorType) -> int:
    """The windows, one per output cell (im2col)."""
    kernel = b.get("kernel_shape")
    if kernel is None:
        kernel = pool2d_window(b["kernel_size"], None)[0]
    return out.size * math.prod(kernel)


@public(
    "nn",
    shape_rule=max_pool_rule,
    kinds={**POOL, "dilations": "window?"},
    workspace=pool_workspace,
)
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
    x = _float_input("max_pool", x)
    win = checked(
        "max_pool", pool_shape, x.shape, kernel_shape, strides, pads, dilations, ceil_mode
    )
    patches = _im2col(x, win.kernel, win.strides, win.pads, win.dilations, -math.inf)
    nd = len(win.kernel)
    return bind(max_p, patches, axes=tuple(range(-2 * nd, -nd)), keepdims=False)


@public(
    "nn",
    shape_rule=avg_pool_rule,
    kinds={**POOL, "count_include_pad": "bool"},
    workspace=pool_workspace,
)
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
    x = _float_input("avg_pool", x)
    win = checked("avg_pool", pool_shape, x.shape, kernel_shape, strides, pads, None, ceil_mode)
    nd = len(win.kernel)
    patches = _im2col(x, win.kernel, win.strides, win.pads, win.dilations, 0.0)
    total = bind(sum_p, patches, axes=tuple(range(-2 * nd, -nd)), keepdims=False)
    # The divisor: how many counted cells each window covers, a constant of the shapes.
    xp = backend.array_module(x.value)
    counted = xp.ones(win.spatial, dtype=x.dtype)
    window_pads = win.pads
    if count_include_pad:
        counted = xp.pad(counted, win.given, constant_values=1)
        window_pads = tuple((0, hi - g_hi) for (_, hi), (_, g_hi) in zip(win.pads, win.given))
    count = _im2col_impl(
        xp,
        counted,
        kernel=win.kernel,
        strides=win.strides,
        pads=window_pads,
        dilations=win.dilations,
        value=0.0,
    ).sum(axis=tuple(range(nd)))
    return divide(total, pass_constant(count))  # counts of the windows: shapes alone


# ---- PyTorch's spellings (torch.nn.functional), for definitions written by hand ----
def conv_rank(nd: int, w: tuple) -> None:
    if len(w) != nd + 2:
        raise RuleError(f"weight {w} must be [C_out, C_in/groups{', k' * nd}]")


def _conv_nd(
    nd: int,
    opname: str,
    x: Any,
    w: Any,
    b: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
) -> Tensor:
    w = as_tensor(w)
    checked(opname, conv_rank, nd, w.shape)
    return conv(x, w, b, strides=stride, pads=padding, dilations=dilation, groups=groups)


CONV_TORCH = {"stride": "window", "padding": "pads", "dilation": "window", "groups": "int"}


def _conv_nd_rule(nd: int) -> Any:
    """conv1d's and conv2d's: conv's with PyTorch's names, and a kernel of rank nd."""

    def rule(b: dict[str, Any]) -> TensorType:
        conv_rank(nd, concrete(b["w"]).shape)
        renamed = {"strides": b["stride"], "pads": b["padding"], "dilations": b["dilation"]}
        return conv_rule({**b, **renamed})

    return rule


@public("nn", shape_rule=_conv_nd_rule(1), kinds=CONV_TORCH, workspace=conv_workspace)
def conv1d(
    x: Any,
    w: Any,
    b: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """1-D convolution as torch.nn.functional.conv1d: x [N, C, L], w [O, C/groups, k]."""
    return _conv_nd(1, "conv1d", x, w, b, stride, padding, dilation, groups)


@public("nn", shape_rule=_conv_nd_rule(2), kinds=CONV_TORCH, workspace=conv_workspace)
def conv2d(
    x: Any,
    w: Any,
    b: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution as torch.nn.functional.conv2d: x [N, C, H, W], w [O, C/groups, kh, kw]."""
    return _conv_nd(2, "conv2d", x, w, b, stride, padding, dilation, groups)


def pool2d_window(kernel_size: Any, stride: Any) -> tuple[tuple[int, int], Any]:
    """(kernel, stride) of the 2-D pools: an int means a square; stride None means the
    kernel. RuleError otherwise."""
    if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
        kernel_size = (kernel_size, kernel_size)
    try:
        kernel = tuple(_int(v) for v in kernel_size)
    except TypeError:
        kernel = ()
    if len(kernel) != 2:
        raise RuleError(f"kernel_size must be an int or 2 ints, got {kernel_size!r}")
    return kernel, kernel if stride is None else stride


POOL_TORCH = {"kernel_size": "window", "stride": "window?", "padding": "pads", "ceil_mode": "bool"}


def pool2d_rule(b: dict[str, Any]) -> TensorType:
    """max_pool2d's and avg_pool2d's: max_pool's with PyTorch's names."""
    kernel, stride = pool2d_window(b["kernel_size"], b.get("stride"))
    window = {
        "x": b["x"],
        "kernel_shape": kernel,
        "strides": stride,
        "pads": b.get("padding", 0),
        "dilations": b.get("dilation", 1),
        "ceil_mode": b.get("ceil_mode", False),
    }
    return max_pool_rule(window)


@public(
    "nn",
    shape_rule=pool2d_rule,
    kinds={**POOL_TORCH, "dilation": "window"},
    workspace=pool_workspace,
)
def max_pool2d(
    x: Any,
    kernel_size: Any = 2,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> Tensor:
    """2-D max pooling over the last two axes, as torch.nn.functional.max_pool2d (stride
    defaults to the kernel size)."""
    kernel, stride = checked("max_pool2d", pool2d_window, kernel_size, stride)
    return max_pool(x, kernel, stride, padding, dilation, ceil_mode)


@public(
    "nn",
    shape_rule=pool2d_rule,
    kinds={**POOL_TORCH, "count_include_pad": "bool"},
    workspace=pool_workspace,
)
def avg_pool2d(
    x: Any,
    kernel_size: Any = 2,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> Tensor:
    """2-D average pooling over the last two axes, as torch.nn.functional.avg_pool2d
    (stride defaults to the kernel size; padding counts in the divisor by default)."""
    kernel, stride = checked("avg_pool2d", pool2d_window, kernel_size, stride)
    return avg_pool(x, kernel, stride, padding, count_include_pad, ceil_mode)
