"""Winograd F(2x2, 3x3) against the windows' GEMM, per op, on the ResNet's stride-1 3x3
layers (issue 28; bench/RESULTS.md "Winograd F(2x2, 3x3) for the stride-1 3x3
convolutions").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/bench_winograd.py

Batch 64, 3x3, pad 1, operands in a convolution's memory order (the ResNet's three
stride-1 layers, then other shapes that set engine/ops/conv.py's _winograd_pays): the input
cotangent (conv_input, one pair as in a gradient, two as in a second-order pass) and the
windows' three ops (gather, conv on them, conv_weight on them), each by the windows and
by Winograd (engine/ops/conv.py's switches), alternating, ms of process time, the
minimum of ROUNDS rounds of 3 calls. The relative error of each Winograd result against
the windows' is printed beside it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.ops import conv as conv_ops
from engine.registry import impl_rules

ROUNDS = 5
LAYERS = ((16, 32), (32, 16), (64, 8), (16, 16), (8, 32), (8, 16), (32, 32))  # (channels, H = W)
conv_input = impl_rules[conv_ops.conv_input_p]
gather = impl_rules[conv_ops.gather_p]
conv = impl_rules[conv_ops.conv_p]
conv_weight = impl_rules[conv_ops.conv_weight_p]


def _route(winograd: bool) -> None:
    conv_ops.WINOGRAD = winograd
    conv_ops._winograd_pays = lambda width, channels: True  # every layer, to measure it


def _best(fn, winograd: bool) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        _route(winograd)
        t = time.process_time()
        for _ in range(3):
            fn()
        best = min(best, (time.process_time() - t) / 3)
    return best * 1e3


def _pair(fn) -> tuple[float, float, float]:
    """(windows ms, Winograd ms, relative difference of the results), alternating."""
    _route(False)
    want = fn()
    _route(True)
    got = fn()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    a, b = [], []
    for _ in range(2):
        a.append(_best(fn, False))
        b.append(_best(fn, True))
    return min(a), min(b), err


def _layer(dtype, ch: int, hw: int, rng) -> list:
    def conv_order(shape):
        a = rng.standard_normal(shape).astype(dtype)
        return np.ascontiguousarray(a.swapaxes(0, 1)).swapaxes(0, 1)

    x, g1, g2 = (conv_order((64, ch, hw, hw)) for _ in range(3))
    w1, w2 = (rng.standard_normal((ch, ch, 3, 3)).astype(dtype) for _ in range(2))
    window = {"strides": (1, 1), "pads": ((1, 1), (1, 1)), "dilations": (1, 1), "groups": 1}
    cells = []
    for operands in ((g1, w1), (g1, w1, g2, w2)):
        cells.append(_pair(lambda ops=operands: conv_input(np, *ops, spatial=(hw, hw), **window)))

    def three():
        cols = gather(np, x, kernel=(3, 3), **window)
        y = conv(np, x, w1, cols, **window)
        dw = conv_weight(np, x, g1, cols, kernel=(3, 3), **window)
        return np.concatenate([y.ravel(), dw.ravel()])

    cells.append(_pair(three))
    return cells


def main() -> None:
    rng = np.random.default_rng(0)
    print(
        "| layer | dtype | conv_input, 1 pair | conv_input, 2 pairs | gather + conv + conv_weight |"
    )
    print("|---|---|---|---|---|")
    for dtype in (np.float32, np.float64):
        for ch, hw in LAYERS:
            cells = _layer(dtype, ch, hw, rng)
            text = [f"{a:.2f} / {b:.2f} ({b / a:.2f}x, {e:.0e})" for a, b, e in cells]
            name = f"{ch} -> {ch}, {hw}x{hw}"
            print(f"| {name} | {np.dtype(dtype).name} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
