"""Compiled kernels for the convolutions' memory passes (engine/ops/conv.py calls them).

A convolution's GEMMs run at BLAS speed; around them NumPy spends whole passes over
memory moving windows: the gather pads its input into a zeros buffer and copies a strided
view of that (two passes, one of them into freshly touched memory), and col2im fills a
zeros buffer and adds each kernel offset's windows into it with one strided
read-modify-write pass per offset (9 for 3 x 3). The kernels below do each in one pass,
reading and writing the GEMM's own layout directly (bench/RESULTS.md, "Compiled kernels
for the convolutions' memory passes"). Two spatial dimensions (a 1-d convolution is a 2-d
one of height 1); 3-d convolutions keep the NumPy paths.

Both are exact: the gather copies (bit-identical to NumPy's), and col2im adds each cell's
windows in NumPy's order (the kernel offsets lexicographically, starting from zero), so
its sums are bit-identical too.

Arrays travel as their flat memory (a 1-d array), an offset and strides in elements
(`flat`): the loops index that memory with unsigned integers, which lets LLVM drop
numba's negative-index wraparound and vectorize the row copies (signed, shifted indices
ran the same copy 3x slower). The innermost axis of every window row (the output's
columns) is contiguous in the GEMM's layout; x's may be strided.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.kernels import In, Ints, Out, kernel


def flat(a: Any) -> tuple[Any, tuple[int, ...]] | None:
    """(a 1-d view of a's memory, a's strides in elements), or None when a's elements do
    not fill its memory exactly in some axis order (a slice, a broadcast): copy first."""
    order = sorted(range(a.ndim), key=lambda i: -a.strides[i])
    dense = a.transpose(order)
    if not dense.flags.c_contiguous:
        return None
    return dense.reshape(-1), tuple(s // a.itemsize for s in a.strides)


@kernel
def gather2d(xf, x_at, x_shape, of, o_at, o_shape, window):  # pragma: no cover - numba
    """Windows of x into the GEMM's layout: for every channel c, kernel cell (kh, kw),
    image n and output cell (oh, ow),

        out[c, kh, kw, n, oh, ow] = x[n, c, oh * sh + kh * dh - ph, ow * sw + kw * dw - pw]

    and zero where that falls outside x (a pad; a negative pad crops).
    x: flat memory xf, x_at = (offset, stride n, c, h, w), x_shape = (N, C, H, W);
    out: flat memory of, o_at = (offset, stride c, kh, kw, n, oh) (ow's is 1),
    o_shape = (KH, KW, OH, OW); window = (sh, sw, ph, pw, dh, dw)."""
    xo, sxn, sxc, sxh, sxw = x_at
    n_img, chans, height, width = x_shape
    oo, soc, sokh, sokw, son, soh = o_at
    kh_n, kw_n, oh_n, ow_n = o_shape
    sh, sw, ph, pw, dh, dw = window
    zero = of.dtype.type(0)
    step = sw * sxw
    # Stride 1 with "same" widths and whole planes in memory (the ResNet's 3 x 3 pad-1
    # layers): a window plane is its image plane shifted, so it is copied as one run
    # (rows of 8-32 elements one by one cost 2x more) and its edge columns zeroed.
    planes = sh == 1 and step == 1 and ow_n == width and sxh == width and soh == ow_n
    for c in range(chans):
        for kh in range(kh_n):
            for kw in range(kw_n):
                # the output columns whose input column is inside x: lo <= ow < hi
                off = kw * dw - pw
                lo = 0 if off >= 0 else (-off + sw - 1) // sw
                hi = 0 if width - 1 - off < 0 else (width - 1 - off) // sw + 1
                hi = min(max(hi, lo), ow_n)
                lo = min(lo, hi)
                if planes:
                    # rows r0 <= oh < r1 read inside x; out[i] = x[i + shift] on them
                    offh = kh * dh - ph
                    r0 = min(max(0, -offh), oh_n)
                    r1 = min(max(r0, height - offh), oh_n)
                    shift = offh * width + off
                    # the run's ends inside x's plane and inside the window plane (a
                    # pad past the output's rows puts -shift beyond its end: review r11)
                    run0 = min(max(r0 * width, -shift), oh_n * ow_n)
                    run1 = max(run0, min(r1 * width, height * width - shift))
                    for n in range(n_img):
                        o = oo + c * soc + kh * sokh + kw * sokw + n * son
                        src = xo + n * sxn + c * sxc + shift
                        for i in range(run0):  # rows above x, then the run's first edge
                            of[np.uintp(o + i)] = zero
                        for i in range(run0, run1):
                            of[np.uintp(o + i)] = xf[np.uintp(src + i)]
                        for i in range(run1, oh_n * ow_n):  # the run's last edge, rows below
                            of[np.uintp(o + i)] = zero
                        for oh in range(r0, r1):  # the edge columns the run filled
                            for ow in range(lo):
                                of[np.uintp(o + oh * ow_n + ow)] = zero
                            for ow in range(hi, ow_n):
                                of[np.uintp(o + oh * ow_n + ow)] = zero
                    continue
                for n in range(n_img):
                    base = oo + c * soc + kh * sokh + kw * sokw + n * son
                    for oh in range(oh_n):
                        o = base + oh * soh
                        ih = oh * sh + kh * dh - ph
                        if ih < 0 or ih >= height:
                            for ow in range(ow_n):
                                of[np.uintp(o + ow)] = zero
                            continue
                        src = xo + n * sxn + c * sxc + ih * sxh + off * sxw
                        for ow in range(lo):
                            of[np.uintp(o + ow)] = zero
                        if step == 1:  # a contiguous run: LLVM vectorizes this copy
                            for ow in range(lo, hi):
                                of[np.uintp(o + ow)] = xf[np.uintp(src + ow)]
                        else:
                            for ow in range(lo, hi):
                                of[np.uintp(o + ow)] = xf[np.uintp(src + ow * step)]
                        for ow in range(hi, ow_n):
                            of[np.uintp(o + ow)] = zero


@kernel
def col2im2d(wf, w_at, w_shape, of, o_at, o_shape, window):  # pragma: no cover - numba
    """gather2d's transpose: every x cell the sum of the windows that read it,

        out[n, c, i, j] = sum over (kh, kw, oh, ow) with i = oh * sh + kh * dh - ph and
                          j = ow * sw + kw * dw - pw of windows[c, kh, kw, n, oh, ow],

    each cell's terms added from zero in the order of (kh, kw), as NumPy's col2im adds
    its offsets' strided slices (so the sums are the same, bit for bit).
    windows: flat memory wf, w_at = (offset, stride c, kh, kw, n, oh) (ow's is 1),
    w_shape = (KH, KW, OH, OW); out: flat memory of, o_at = (offset, stride n, c, h) (w's
    is 1), o_shape = (N, C, H, W); window = (sh, sw, ph, pw, dh, dw)."""
    wo, swc, swkh, swkw, swn, swoh = w_at
    kh_n, kw_n, oh_n, ow_n = w_shape
    oo, son, soc, soh = o_at
    n_img, chans, height, width = o_shape
    sh, sw, ph, pw, dh, dw = window
    zero = of.dtype.type(0)
    for n in range(n_img):
        for c in range(chans):
            plane = oo + n * son + c * soc
            for i in range(height):
                for j in range(width):
                    of[np.uintp(plane + i * soh + j)] = zero
            for kh in range(kh_n):
                for kw in range(kw_n):
                    off = kw * dw - pw
                    lo = 0 if off >= 0 else (-off + sw - 1) // sw
                    hi = 0 if width - 1 - off < 0 else (width - 1 - off) // sw + 1
                    hi = min(max(hi, lo), ow_n)
                    lo = min(lo, hi)
                    base = wo + c * swc + kh * swkh + kw * swkw + n * swn
                    for oh in range(oh_n):
                        ih = oh * sh + kh * dh - ph
                        if ih < 0 or ih >= height:
                            continue
                        dst = plane + ih * soh + off
                        src = base + oh * swoh
                        for ow in range(lo, hi):
                            of[np.uintp(dst + ow * sw)] += wf[np.uintp(src + ow)]


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

# (offsets, strides, shapes and windows are tuples of Python ints)
for _dtype in ("float32", "float64"):
    gather2d.declare((In(_dtype, 1), Ints(5), Ints(4), Out(_dtype, 1), Ints(6), Ints(4), Ints(6)))
    col2im2d.declare((In(_dtype, 1), Ints(6), Ints(4), Out(_dtype, 1), Ints(4), Ints(4), Ints(6)))
