"""Stride-1 3 x 3 convolutions by Winograd's F(2 x 2, 3 x 3) on the host (issue 28, item
2): the transforms in compiled loops (engine/kernels/winograd.py, which states the
algorithm), the 16 GEMMs in BLAS. Two uses in engine/ops/conv.py:

- `conv3x3`: the stride-1 input cotangent (conv_input_p: a convolution of the output
  cotangents with the flipped kernels, one or two pairs), a few images at a time so that
  the transformed tiles stay in cache between the transform, the GEMM and the inverse
  transform;
- `transform_input`, `conv_transformed`, `weight_transformed`: a convolution's input
  transformed once (gather_p's result, in place of its windows) and shared by the
  convolution (conv_p) and its kernel's cotangent (conv_weight_p), as the windows are.

Where they run, and why there (bench/RESULTS.md, "Winograd F(2x2, 3x3) for the stride-1
3x3 convolutions"): the windows' GEMM stays the reference and the route of GPUs,
GRADTAPE_KERNELS=numpy, no numba, other kernels, strides, dilations and groups.

At the edges of the floating-point range it is not the windows' GEMM (review r13;
docs/guides/engine.md): an infinite input gives NaN in some outputs where a direct
convolution gives an infinity (inf - inf in the transforms), and the input transform's
signed sums of four can overflow float32 about 4x sooner. Not guarded: a finiteness
check of every result would cost a pass over it.
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
    """U = G k G^T of kernels k (*lead, O, C, 3, 3) as (*lead, 16, O, C), C-contiguous, in
    k's dtype (G's entries are exact in binary: the products round as any float op's)."""
    g = _G.astype(k.dtype)
    u = g @ k @ g.T  # (*lead, O, C, 4, 4)
    return np.ascontiguousarray(np.moveaxis(u.reshape(u.shape[:-2] + (16,)), -1, -3))


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
    per_chunk = builtins.min(per_chunk, m_all)
    v_flat = np.empty(16 * inner * per_chunk * n_q, dtype)
    m_flat = np.empty(16 * o * per_chunk * n_q, dtype)
    images = [conv_kernels.flat(x) or conv_kernels.flat(np.ascontiguousarray(x)) for x in xs]
    yf = y.swapaxes(1, 2).reshape(-1)
    forward = kernels.winograd_input.compiled()
    backward = kernels.winograd_output.compiled()
    assert forward is not None and backward is not None  # applies() chose this route
    block = o * batch * oh * ow  # one block of the layout
    m0 = 0
    while m0 < m_all:
        b, i = divmod(m0, batch)
        if i == 0 and per_chunk >= batch:  # whole blocks at once (small batches of many
            mc = builtins.min(per_chunk // batch, blocks - b) * batch  # leading rows)
        else:  # a chunk within one block
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
        for j in range(0, mc, batch - i):  # the output transform, block by block
            n_j = builtins.min(batch - i, mc - j)
            o_at = (b * block + (j // batch) * block + i * oh * ow, oh * ow, batch * oh * ow, ow)
            backward(m_flat, (j * n_q, o * t, t), yf, o_at, (n_j, o, oh, ow), (th, tw))
        m0 += mc
    return y


# ---- a convolution's input transformed once, for the convolution and its kernel's
# cotangent (engine/ops/conv.py's gather_p: V instead of the windows) ----
def _tiles(out: tuple) -> tuple[int, int, int]:
    """(th, tw, tiles per image in the transforms' layout: a spare one per row)."""
    th, tw = (out[0] + 1) // 2, (out[1] + 1) // 2
    return th, tw, th * (tw + 1)


def _output(spatial: tuple, pads: Pads) -> tuple[int, int]:
    (pt, pb), (pl, pr) = pads
    return spatial[0] + pt + pb - 2, spatial[1] + pl + pr - 2


def transformed_shape(x_shape: tuple, pads: Pads) -> tuple:
    """V's shape for x (*lead, N, C, H, W): (*lead, 16, C, N * tiles per image)."""
    *lead, n, c, h, w = x_shape
    return (*lead, 16, c, n * _tiles(_output((h, w), pads))[2])


def transform_input(x: Any, pads: Pads, out: Any = None) -> Any:
    """V = B^T d B of every tile of x (*lead, N, C, H, W): (*lead, 16, C, N * tiles) (into
    `out` when given, C-contiguous)."""
    n, c, h, w = x.shape[-4:]
    th, tw, n_q = _tiles(_output((h, w), pads))
    if out is None:
        out = np.empty(transformed_shape(x.shape, pads), x.dtype)
    elif out.shape != transformed_shape(x.shape, pads) or not out.flags.c_contiguous:
        raise ValueError(f"winograd: a buffer of {out.shape} for the transform of {x.shape}")
    vf = out.reshape(-1)
    forward = kernels.winograd_input.compiled()
    assert forward is not None  # applies() chose this route
    # (the leading axes' count spelled out: NumPy cannot infer -1 beside an N of 0)
    blocks = x.reshape((int(np.prod(x.shape[:-4])), n, c, h, w))
    for i in range(blocks.shape[0]):
        found = conv_kernels.flat(blocks[i])
        xf, (sm, sc, sh, sw) = found or conv_kernels.flat(np.ascontiguousarray(blocks[i]))  # type: ignore[misc]
        v_at = (i * 16 * c * n * n_q, c * n * n_q, n * n_q)
        forward(xf, (0, sm, sc, sh, sw), (n, c, h, w), vf, v_at, (th, tw), (pads[0][0], pads[1][0]))
    return out


def _pick(a: Any, core: int, index: tuple) -> Any:
    """a's block (its last `core` axes) at the leading index `index` of the broadcast of
    the operands' leading axes (a's own leading axes: fewer, or of size 1)."""
    own = a.shape[: a.ndim - core]
    at = index[len(index) - len(own) :]
    return a[tuple(0 if s == 1 else i for s, i in zip(own, at))]


def conv_transformed(v: Any, w: Any, n: int, out: tuple) -> Any:
    """The stride-1 3 x 3 convolution of the images whose transform is v (*lx, 16, C, N *
    tiles) with kernels w (*lw, O, C, 3, 3): (*L, N, O, *out) over (*L, O, N, *out)
    memory, a convolution's own order (engine/ops/conv.py, _CONV_LAYOUT)."""
    u = kernel_transform(w)  # (*lw, 16, O, C)
    o = u.shape[-2]
    lead = np.broadcast_shapes(u.shape[:-3], v.shape[:-3])
    th, tw, n_q = _tiles(out)
    dtype = np.result_type(u, v)
    y = np.empty(lead + (o, n) + tuple(out), dtype)
    yf = y.reshape(-1)
    plane = out[0] * out[1]
    per_chunk = builtins.max(1, CHUNK_BYTES // builtins.max(1, 16 * o * n_q * dtype.itemsize))
    per_chunk = builtins.min(per_chunk, builtins.max(n, 1))
    m_flat = np.empty(16 * o * per_chunk * n_q, dtype)
    backward = kernels.winograd_output.compiled()
    assert backward is not None  # applies() chose this route
    for k, index in enumerate(np.ndindex(*lead)):
        uk, vk = _pick(u, 3, index), _pick(v, 3, index)
        for m0 in range(0, n, per_chunk):
            mc = builtins.min(per_chunk, n - m0)
            t = mc * n_q
            mm = m_flat[: 16 * o * t].reshape(16, o, t)
            np.matmul(uk, vk[:, :, m0 * n_q : m0 * n_q + t], out=mm)
            o_at = (k * o * n * plane + m0 * plane, plane, n * plane, out[1])
            backward(m_flat, (0, o * t, t), yf, o_at, (mc, o, *out), (th, tw))
    return y.swapaxes(-4, -3)


def weight_transformed(v: Any, g: Any) -> Any:
    """The kernel's cotangent of the stride-1 3 x 3 convolution of the images whose
    transform is v (*lx, 16, C, N * tiles), for the output cotangent g (*lg, N, O, OH,
    OW): (*L, O, C, 3, 3) = G^T [sum over tiles of (A g A^T) V] G per cell pair."""
    lead = np.broadcast_shapes(g.shape[:-4], v.shape[:-3])
    n, o, oh, ow = g.shape[-4:]
    c = v.shape[-2]
    th, tw, n_q = _tiles((oh, ow))
    dtype = np.result_type(g, v)
    per_chunk = builtins.max(1, CHUNK_BYTES // builtins.max(1, 16 * o * n_q * dtype.itemsize))
    per_chunk = builtins.min(per_chunk, builtins.max(n, 1))
    gg_flat = np.empty(16 * o * per_chunk * n_q, g.dtype)
    d = np.zeros(lead + (16, o, c), dtype)
    part = np.empty((16, o, c), dtype)
    transpose = kernels.winograd_cotangent.compiled()
    assert transpose is not None  # applies() chose this route
    for index in np.ndindex(*lead):
        vk, gk = _pick(v, 3, index), _pick(g, 4, index)
        found = conv_kernels.flat(gk)
        gf, (sm, so, sh, sw) = found or conv_kernels.flat(np.ascontiguousarray(gk))  # type: ignore[misc]
        dk = d[index]
        for m0 in range(0, n, per_chunk):
            mc = builtins.min(per_chunk, n - m0)
            t = mc * n_q
            transpose(
                gf, (m0 * sm, sm, so, sh, sw), (mc, o, oh, ow), gg_flat, (0, o * t, t), (th, tw)
            )
            gg = gg_flat[: 16 * o * t].reshape(16, o, t)
            cols = vk[:, :, m0 * n_q : m0 * n_q + t].swapaxes(-1, -2)
            if m0 == 0:
                np.matmul(gg, cols, out=dk)
            else:
                np.matmul(gg, cols, out=part)
                dk += part
    # G^T D G per (o, c): D's 16 cells as a 4 x 4 matrix
    gm = _G.astype(dtype)
    cells = np.moveaxis(d.reshape(lead + (4, 4, o, c)), (-4, -3), (-2, -1))  # (*L, O, C, 4, 4)
    return gm.T @ cells @ gm
