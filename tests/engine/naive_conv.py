"""Loop-by-loop references for convolution and pooling (small sizes only): every output
cell computed from its definition, independent of the engine's im2col and GEMM."""

from __future__ import annotations

import itertools
import math

import numpy as np


def _out(n: int, k: int, s: int, lo: int, hi: int, d: int, ceil: bool = False) -> int:
    span = n + lo + hi - d * (k - 1) - 1
    if not ceil:
        return span // s + 1
    o = -(-span // s) + 1
    return o - 1 if (o - 1) * s >= n + lo else o  # PyTorch: no window starts in end padding


def conv(x, w, b=None, strides=None, pads=None, dilations=None, groups=1):
    nd = w.ndim - 2
    s = strides or (1,) * nd
    p = pads or ((0, 0),) * nd
    d = dilations or (1,) * nd
    n_, _ = x.shape[:2]
    o_, cg = w.shape[:2]
    k = w.shape[2:]
    out = tuple(_out(x.shape[2 + i], k[i], s[i], *p[i], d[i]) for i in range(nd))
    y = np.zeros((n_, o_) + out)
    for n, o in itertools.product(range(n_), range(o_)):
        group = o // (o_ // groups)
        for pos in itertools.product(*map(range, out)):
            acc = 0.0 if b is None else b[o]
            for c in range(cg):
                for kk in itertools.product(*map(range, k)):
                    idx = tuple(pos[i] * s[i] + kk[i] * d[i] - p[i][0] for i in range(nd))
                    if all(0 <= idx[i] < x.shape[2 + i] for i in range(nd)):
                        acc += x[(n, group * cg + c) + idx] * w[(o, c) + kk]
            y[(n, o) + pos] = acc
    return y


def pool(
    x,
    kind,
    kernel,
    strides=None,
    pads=None,
    dilations=None,
    ceil_mode=False,
    count_include_pad=False,
):
    """kind 'max' or 'avg' over the last len(kernel) axes (PyTorch's ceil_mode rule; with
    count_include_pad the divisor counts the explicit pads but never the ceil extension)."""
    nd = len(kernel)
    s = strides or (1,) * nd
    p = pads or ((0, 0),) * nd
    d = dilations or (1,) * nd
    spatial = x.shape[x.ndim - nd :]
    out = tuple(_out(spatial[i], kernel[i], s[i], *p[i], d[i], ceil_mode) for i in range(nd))
    lead = x.shape[: x.ndim - nd]
    y = np.zeros(lead + out)
    for li in itertools.product(*map(range, lead)):
        for pos in itertools.product(*map(range, out)):
            vals, counted = [], 0
            for kk in itertools.product(*map(range, kernel)):
                idx = tuple(pos[i] * s[i] + kk[i] * d[i] - p[i][0] for i in range(nd))
                inside = all(0 <= idx[i] < spatial[i] for i in range(nd))
                in_pads = all(-p[i][0] <= idx[i] < spatial[i] + p[i][1] for i in range(nd))
                if inside:
                    vals.append(x[li + idx])
                counted += inside if not count_include_pad else in_pads
            y[li + pos] = max(vals) if kind == "max" else sum(vals) / counted
    return y


def attention(q, k, v, causal=False):
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((lq, lk), bool)), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return weights @ v
