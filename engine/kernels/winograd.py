"""Winograd's F(2 x 2, 3 x 3) transforms for the stride-1 3 x 3 convolutions (issue 28,
item 2; engine/ops/winograd.py drives them, bench/RESULTS.md "Winograd F(2x2, 3x3)").

A 3 x 3 convolution's output, 2 x 2 cells at a time, from the 4 x 4 input tile d that
they read (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016):

    y = A^T [ (G k G^T) * (B^T d B) ] A        (* elementwise, over the 16 cells)

with, in exact binary fractions (0, +-1, +-1/2: the transforms add and subtract only),

    B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
    G   = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
    A^T = [1 1 1 0; 0 1 -1 -1]

Summed over input channels, the elementwise products are 16 GEMMs (one per cell xi of
the 4 x 4 tile): M[xi] = U[xi] @ V[xi], U = G k G^T as (16, O, C), V = B^T d B as
(16, C, tiles). 16 multiply-adds per 4 outputs per channel pair instead of 36: 2.25x
fewer, and the GEMMs' operands are 4 / 9 of the windows' size. The kernels here are
the transforms of the input (into V) and of the output (from M); U is the kernel's,
computed with NumPy (small). The GEMMs run in BLAS.

Numerics: not the im2col GEMM's bits. The input transform adds 4 values with signs per
cell (two roundings), the output transform 9 products' sums likewise; measured against
long double references the errors stay in the direct sum's class (at most 2.6 / 1.9
epsilons of the products' magnitude in float32 / float64 over tests/engine/
test_winograd.py's shapes, against the windows' GEMM's 1.7 / 1.6).

Arrays travel as their flat memory and strides in elements (kernels.conv.flat), indexed
with unsigned integers (see engine/kernels/conv.py: LLVM then drops the wraparound).
"""

from __future__ import annotations

import numpy as np

from engine.kernels import In, Ints, Out, kernel


@kernel(exact=False)  # (Winograd's rounding, not the windows' GEMM's bits)
def winograd_input(xf, x_at, x_shape, vf, v_at, tiles, pads):  # pragma: no cover - numba
    """V = B^T d B for every image m, channel c and tile (a, b):

        d[r, s] = x[m, c, 2a - ph + r, 2b - pw + s]   (zero outside x)
        vf[v0 + xi * s_xi + c * s_c + (m * th + a) * (tw + 1) + b] = (B^T d B)[xi // 4, xi % 4]

    for b < tw; b = tw is a spare tile per row of tiles, zero (the products' GEMM
    columns of the spare tiles are never read; the kernel's cotangent's are zero). x: flat memory xf, x_at = (offset,
    stride m, c, h, w), x_shape = (M, C, H, W); v_at = (v0, s_xi, s_c); tiles = (th,
    tw); pads = (ph, pw) (negative: a crop).

    Why the spare tile: a plane is first split by the parity of its rows and columns
    (zero outside x) into 4 planes of (th + 1) x (tw + 1); a tile's cell (r, s) is then
    parity plane (r % 2, s % 2) at the flat index q + (r // 2) * (tw + 1) + s // 2, with
    q = a * (tw + 1) + b. So each of V's 16 cells is one loop over q, as long as the
    whole plane, over contiguous runs (LLVM vectorizes it); loops over one row of tiles
    (16 or fewer) cost more in their overhead than in their work."""
    xo, sxm, sxc, sxh, sxw = x_at
    n_img, chans, height, width = x_shape
    v0, s_xi, s_c = v_at
    th, tw = tiles
    ph, pw = pads
    zero = vf.dtype.type(0)
    tw1 = tw + 1
    n_q = th * tw1  # tiles per image, the spare ones included
    part = (th + 1) * tw1 + 1  # one parity plane, and a spare cell read by the last q
    z = np.empty(4 * part, vf.dtype)  # parity plane (rp, cp) at (2 rp + cp) * part
    for k in range(4):
        z[np.uintp(k * part + part - 1)] = zero
    # B^T's rows (and B's columns): cell k = d[first[k]] + d[second[k]] for k = 1, else -
    first = (0, 1, 2, 1)
    second = (2, 2, 1, 3)
    for m in range(n_img):
        for c in range(chans):
            plane = xo + m * sxm + c * sxc
            for rp in range(2):
                for cp in range(2):
                    base = (2 * rp + cp) * part
                    # columns 2j + cp - pw inside x: j_lo <= j < j_hi
                    j_lo = min(max(0, (pw - cp + 1) // 2), tw1)
                    j_hi = max(j_lo, min(tw1, (width + pw - cp + 1) // 2))
                    for i in range(th + 1):
                        ih = 2 * i + rp - ph
                        row = base + i * tw1
                        lo, hi = j_lo, j_hi
                        if ih < 0 or ih >= height:
                            lo = hi = tw1
                        src = plane + ih * sxh + (cp - pw) * sxw
                        for j in range(lo):
                            z[np.uintp(row + j)] = zero
                        for j in range(lo, hi):
                            z[np.uintp(row + j)] = xf[np.uintp(src + 2 * j * sxw)]
                        for j in range(hi, tw1):
                            z[np.uintp(row + j)] = zero
            out = v0 + c * s_c + m * n_q
            for r in range(4):
                r1, r2 = first[r], second[r]
                for s in range(4):
                    s1, s2 = first[s], second[s]
                    # d[r1, s1], d[r2, s1], d[r1, s2], d[r2, s2]
                    p11 = (2 * (r1 % 2) + s1 % 2) * part + (r1 // 2) * tw1 + s1 // 2
                    p21 = (2 * (r2 % 2) + s1 % 2) * part + (r2 // 2) * tw1 + s1 // 2
                    p12 = (2 * (r1 % 2) + s2 % 2) * part + (r1 // 2) * tw1 + s2 // 2
                    p22 = (2 * (r2 % 2) + s2 % 2) * part + (r2 // 2) * tw1 + s2 // 2
                    o = out + (4 * r + s) * s_xi
                    # (B^T d) B: B^T on the rows first, then B on the columns
                    if r == 1 and s == 1:
                        for q in range(n_q):
                            vf[np.uintp(o + q)] = (z[np.uintp(p11 + q)] + z[np.uintp(p21 + q)]) + (
                                z[np.uintp(p12 + q)] + z[np.uintp(p22 + q)]
                            )
                    elif r == 1:
                        for q in range(n_q):
                            vf[np.uintp(o + q)] = (z[np.uintp(p11 + q)] + z[np.uintp(p21 + q)]) - (
                                z[np.uintp(p12 + q)] + z[np.uintp(p22 + q)]
                            )
                    elif s == 1:
                        for q in range(n_q):
                            vf[np.uintp(o + q)] = (z[np.uintp(p11 + q)] - z[np.uintp(p21 + q)]) + (
                                z[np.uintp(p12 + q)] - z[np.uintp(p22 + q)]
                            )
                    else:
                        for q in range(n_q):
                            vf[np.uintp(o + q)] = (z[np.uintp(p11 + q)] - z[np.uintp(p21 + q)]) - (
                                z[np.uintp(p12 + q)] - z[np.uintp(p22 + q)]
                            )
            for k in range(16):  # the spare tiles: zero (they may read a cropped inf)
                o = out + k * s_xi + tw
                for a in range(th):
                    vf[np.uintp(o + a * tw1)] = zero


@kernel(exact=False)  # (Winograd's rounding, not the windows' GEMM's bits)
def winograd_output(mf, m_at, of, o_at, o_shape, tiles):  # pragma: no cover - numba
    """y = A^T M A for every image m, channel o and tile (a, b < tw), into its 2 x 2
    cells that fall inside the output:

        M[xi] = mf[m0 + xi * s_xi + o * s_o + (m * th + a) * (tw + 1) + b]
        out[m, o, 2a + i, 2b + j] = (A^T M A)[i, j]

    (winograd_input's layout: a spare tile b = tw per row of tiles, not read back).
    m_at = (m0, s_xi, s_o); out: flat memory of, o_at = (offset, stride m, o, h) (w's
    is 1), o_shape = (M, O, OH, OW); tiles = (th, tw). A^T on M's rows, then A on the
    columns, each one loop over a whole plane's tiles (vectorized), into 4 planes of
    the output cells' parities, then copied into place row by row."""
    m0, s_xi, s_o = m_at
    oo, som, soo, soh = o_at
    n_img, chans, oh_n, ow_n = o_shape
    th, tw = tiles
    tw1 = tw + 1
    n_q = th * tw1
    f = np.empty(8 * n_q, of.dtype)  # A^T M: row i's column s at (4 i + s) * n_q
    y = np.empty(4 * n_q, of.dtype)  # output cells (2a + i, 2b + j) at (2 i + j) * n_q
    for m in range(n_img):
        for o in range(chans):
            src = m0 + o * s_o + m * n_q
            for s in range(4):  # A^T's rows: 0 + 1 + 2, 1 - 2 - 3
                k0 = src + s * s_xi
                k1 = k0 + 4 * s_xi
                k2 = k1 + 4 * s_xi
                k3 = k2 + 4 * s_xi
                f0 = s * n_q
                f1 = (4 + s) * n_q
                for q in range(n_q):
                    f[np.uintp(f0 + q)] = (
                        mf[np.uintp(k0 + q)] + mf[np.uintp(k1 + q)] + mf[np.uintp(k2 + q)]
                    )
                for q in range(n_q):
                    f[np.uintp(f1 + q)] = (
                        mf[np.uintp(k1 + q)] - mf[np.uintp(k2 + q)] - mf[np.uintp(k3 + q)]
                    )
            for i in range(2):  # A on the columns, the same
                g = 4 * i * n_q
                ye = 2 * i * n_q
                yo = ye + n_q
                for q in range(n_q):
                    y[np.uintp(ye + q)] = (
                        f[np.uintp(g + q)] + f[np.uintp(g + n_q + q)] + f[np.uintp(g + 2 * n_q + q)]
                    )
                for q in range(n_q):
                    y[np.uintp(yo + q)] = (
                        f[np.uintp(g + n_q + q)]
                        - f[np.uintp(g + 2 * n_q + q)]
                        - f[np.uintp(g + 3 * n_q + q)]
                    )
            plane = oo + m * som + o * soo
            for oh in range(oh_n):
                a, i = oh // 2, oh % 2
                row = plane + oh * soh
                ye = 2 * i * n_q + a * tw1
                yo = ye + n_q
                for b in range(ow_n // 2):
                    of[np.uintp(row + 2 * b)] = y[np.uintp(ye + b)]
                    of[np.uintp(row + 2 * b + 1)] = y[np.uintp(yo + b)]
                if ow_n % 2:
                    of[np.uintp(row + ow_n - 1)] = y[np.uintp(ye + ow_n // 2)]


@kernel(exact=False)  # (Winograd's rounding, not the windows' GEMM's bits)
def winograd_cotangent(gf, g_at, g_shape, vf, v_at, tiles):  # pragma: no cover - numba
    """winograd_output's transpose, for the kernel's cotangent: A g A^T of every image
    m, channel o and tile (a, b) of the output cotangent g's 2 x 2 cells,

        g_t[i, j] = g[m, o, 2a + i, 2b + j]   (zero outside g)
        vf[v0 + xi * s_xi + o * s_o + (m * th + a) * (tw + 1) + b] = (A g_t A^T)[xi // 4, xi % 4]

    and zero for the spare tiles b = tw (so that the input's spare tiles, whose values
    mean nothing, add nothing to the GEMM over tiles). g: flat memory gf, g_at =
    (offset, stride m, o, h, w), g_shape = (M, O, OH, OW); v_at = (v0, s_xi, s_o); tiles =
    (th, tw). A = [1 0; 1 1; 1 -1; 0 -1]: the rows of A g are g0, g0 + g1, g0 - g1, -g1
    (exact but for the one rounding of a sum), and the columns likewise. g is split by
    the parity of its rows and columns first, as the input is in winograd_input (loops
    over a whole plane's tiles)."""
    go, sgm, sgo, sgh, sgw = g_at
    n_img, chans, oh_n, ow_n = g_shape
    v0, s_xi, s_o = v_at
    th, tw = tiles
    zero = vf.dtype.type(0)
    tw1 = tw + 1
    n_q = th * tw1
    p = np.empty(4 * n_q, vf.dtype)  # g's cells (2a + i, 2b + j) at (2 i + j) * n_q + q
    r = np.empty(8 * n_q, vf.dtype)  # A g: row k's column j at (2 k + j) * n_q + q
    for m in range(n_img):
        for o in range(chans):
            plane = go + m * sgm + o * sgo
            for i in range(2):
                for j in range(2):
                    base = (2 * i + j) * n_q
                    b_hi = min(max(0, (ow_n - j + 1) // 2), tw1)
                    for a in range(th):
                        oh = 2 * a + i
                        row = base + a * tw1
                        hi = b_hi if oh < oh_n else 0
                        src = plane + oh * sgh + j * sgw
                        for b in range(hi):
                            p[np.uintp(row + b)] = gf[np.uintp(src + 2 * b * sgw)]
                        for b in range(hi, tw1):
                            p[np.uintp(row + b)] = zero
            for j in range(2):  # A's rows: g0, g0 + g1, g0 - g1, -g1
                g0 = j * n_q
                g1 = (2 + j) * n_q
                for q in range(n_q):
                    r[np.uintp(j * n_q + q)] = p[np.uintp(g0 + q)]
                for q in range(n_q):
                    r[np.uintp((2 + j) * n_q + q)] = p[np.uintp(g0 + q)] + p[np.uintp(g1 + q)]
                for q in range(n_q):
                    r[np.uintp((4 + j) * n_q + q)] = p[np.uintp(g0 + q)] - p[np.uintp(g1 + q)]
                for q in range(n_q):
                    r[np.uintp((6 + j) * n_q + q)] = -p[np.uintp(g1 + q)]
            out = v0 + o * s_o + m * n_q
            for k in range(4):  # the columns, the same
                c0 = 2 * k * n_q
                c1 = c0 + n_q
                dst = out + 4 * k * s_xi
                for q in range(n_q):
                    vf[np.uintp(dst + q)] = r[np.uintp(c0 + q)]
                dst += s_xi
                for q in range(n_q):
                    vf[np.uintp(dst + q)] = r[np.uintp(c0 + q)] + r[np.uintp(c1 + q)]
                dst += s_xi
                for q in range(n_q):
                    vf[np.uintp(dst + q)] = r[np.uintp(c0 + q)] - r[np.uintp(c1 + q)]
                dst += s_xi
                for q in range(n_q):
                    vf[np.uintp(dst + q)] = -r[np.uintp(c1 + q)]


# ---- warm-up (engine/kernels/warmup.py): the argument types the callers above pass ----

# (flat memory as 1-d arrays; offsets, strides, shapes, tiles and pads as tuples of ints)
for _dtype in ("float32", "float64"):
    winograd_input.declare(
        (In(_dtype, 1), Ints(5), Ints(4), Out(_dtype, 1), Ints(3), Ints(2), Ints(2))
    )
    winograd_output.declare((In(_dtype, 1), Ints(3), Out(_dtype, 1), Ints(4), Ints(4), Ints(2)))
    winograd_cotangent.declare((In(_dtype, 1), Ints(5), Ints(4), Out(_dtype, 1), Ints(3), Ints(2)))
