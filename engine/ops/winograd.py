"""Stride-1 3 x 3 convolutions by Winograd's F(2 x 2, 3 x 3) on the host (issue 28, item
2): the transforms in compiled loops (engine/kernels/winograd.py, which states the
algorithm), the 16 GEMMs in BLAS, a few images at a time so that the transformed
tiles stay in cache between the transform, the GEMM and the inverse transform.

Used by engine/ops/conv.py where it measured faster than the windows' GEMM (the ResNet's
16-64 channels; bench/RESULTS.md, "Winograd F(2x2, 3x3) for the stride-1 input
cotangents"); the im2col GEMM stays the reference (GPUs, GRADTAPE_KERNELS=numpy, no
numba, other kernels, strides, dilations, groups).
"""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np

from engine.kernels import conv as conv_kernels
from engine.kernels import winograd as kernels

Pads = tuple[tuple[int, int], ...]

# G of F(2 x 2, 3 x 3): U = G k G^T (exact binary fractions).
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])

#: The transformed input tiles of one chunk of images, in bytes (V; M is O / C of it).
CHUNK_BYTES = 2 << 20


def applies(xp: Any, kernel: tuple, dilations: tuple, groups: int, dtype: Any) -> bool:
    """Whether a stride-1 convolution with this kernel runs by Winograd here: on the host
    with the compiled transforms, a 3 x 3 kernel, no dilation, one group, float32 or
    float64."""
    return (
        xp is np
        and tuple(kernel) == (3, 3)
        and tuple(dilations) == (1, 1)
        and groups == 1
        and dtype.char in "fd"
        and dtype.isnative
        and kernels.winograd_input.compiled() is not None
    )


def kernel_transform(k: Any) -> Any:
    """U = G k G^T of kernels k (O, C, 3, 3) as (16, O, C), C-contiguous, in k's dtype
    (G's entries are exact in binary: the products round as any float op's)."""
    g = _G.astype(k.dtype)
    u = g @ k @ g.T  # (O, C, 4, 4)
    return np.ascontiguousarray(u.reshape(u.shape[:2] + (16,)).transpose(2, 0, 1))


def conv3x3(xs: list, ks: list, pads: Pads, batch: int) -> Any:
    """sum_i of the stride-1 3 x 3 cross-correlations of images xs[i] (M, C_i, H, W), all
    of one M, H, W and dtype, with kernels ks[i] (O, C_i, 3, 3), padded by pads
    ((top, bottom), (left, right)); negative: a crop), as (M / batch, batch, O, OH, OW)
    over (M / batch, O, batch, OH, OW) memory: the M images are blocks of `batch`, each
    laid out as a convolution's result (engine/ops/conv.py, _CONV_LAYOUT)."""
    m_all, h, w = xs[0].shape[0], xs[0].shape[2], xs[0].shape[3]
    (pt, pb), (pl, pr) = pads
    oh, ow = h + pt + pb - 2, w + pl + pr - 2
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    n_q = th * (tw + 1)  # tiles per image in the transforms' layout (a spare one per row)
    dtype = xs[0].dtype
    u = kernel_transform(ks[0]) if len(ks) == 1 else None
    if u is None:  # the pairs' channels side by side along the GEMM's inner dimension
        u = np.ascontiguousarray(np.concatenate([kernel_transform(k) for k in ks], axis=-1))
    o, inner = u.shape[1], u.shape[2]
    blocks = m_all // batch if batch else 0
    y = np.empty((blocks, o, batch, oh, ow), dtype=dtype).swapaxes(1, 2)
    if m_all == 0 or o == 0:
        return y
    if inner == 0:  # no input channels: an empty sum
        y[...] = 0
        return y
    per_tile = 16 * inner * dtype.itemsize
    per_chunk = builtins.max(1, CHUNK_BYTES // builtins.max(1, per_tile * n_q))
    per_chunk = builtins.min(per_chunk, batch)
    v_flat = np.empty(16 * inner * per_chunk * n_q, dtype)
    m_flat = np.empty(16 * o * per_chunk * n_q, dtype)
    images = [conv_kernels.flat(x) or conv_kernels.flat(np.ascontiguousarray(x)) for x in xs]
    yf = y.swapaxes(1, 2).reshape(-1)
    forward = kernels.winograd_input.compiled()
    backward = kernels.winograd_output.compiled()
    assert forward is not None and backward is not None  # applies() chose this route
    m0 = 0
    while m0 < m_all:  # chunks within one batch (one block of the layout)
        b, i = divmod(m0, batch)
        mc = builtins.min(per_chunk, batch - i)
        t = mc * n_q
        v = v_flat[: 16 * inner * t].reshape(16, inner, t)
        row = 0
        for (xf, (sm, sc, sh, sw)), x in zip(images, xs, strict=True):  # type: ignore[misc]
            c = x.shape[1]
            x_at = (m0 * sm, sm, sc, sh, sw)
            forward(xf, x_at, (mc, c, h, w), v_flat, (row * t, inner * t, t), (th, tw), (pt, pl))
            row += c
        mm = m_flat[: 16 * o * t].reshape(16, o, t)
        np.matmul(u, v, out=mm)
        o_at = ((b * o * batch + i) * oh * ow, oh * ow, batch * oh * ow, ow)
        backward(m_flat, (0, o * t, t), yf, o_at, (mc, o, oh, ow), (th, tw))
        m0 += mc
    return y
