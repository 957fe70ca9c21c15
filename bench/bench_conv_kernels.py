"""The convolutions' compiled window kernels against their NumPy routes, per call, on the
ResNet's shapes (bench/onnx_models.py: batch 64, 16-64 channels, 32 x 32; issue 28;
bench/RESULTS.md "Compiled kernels for the convolutions' memory passes").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/bench_conv_kernels.py

Per layer and dtype: the gather (conv_gather's impl: the windows of a convolution's
result, (N, C, H, W) over (C, N, H, W) memory, into a fresh array) and the input
cotangent (conv_input's impl, one pair and the two pairs of a second-order pass: stride 1
its chunks, stride 2 its col2im), each timed through the kernels and through the NumPy
routes (engine.ops.conv._compiled switched off), alternating, process time, the minimum
over ROUNDS rounds of INNER calls, in ms per call; the two agree bit for bit (checked).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import kernels
from engine.ops import conv as conv_ops
from engine.registry import impl_rules

ROUNDS, INNER = 7, 3
# (input channels, output channels, input height = width, stride)
LAYERS = [
    (3, 16, 32, 1),
    (16, 16, 32, 1),
    (16, 32, 32, 2),
    (32, 32, 16, 1),
    (32, 64, 16, 2),
    (64, 64, 8, 1),
]


def _ms(fn) -> float:
    t = time.process_time()
    for _ in range(INNER):
        fn()
    return (time.process_time() - t) / INNER * 1e3


def _pair(route_on, route_off) -> tuple[float, float]:
    """Minimum ms per call of each route, alternating rounds; their answers equal."""
    compiled = conv_ops._compiled
    off = lambda *args: False
    conv_ops._compiled = off
    want = route_off()
    conv_ops._compiled = compiled
    assert np.array_equal(route_on(), want)
    best = [float("inf"), float("inf")]
    for _ in range(ROUNDS):
        best[0] = min(best[0], _ms(route_on))
        conv_ops._compiled = off
        best[1] = min(best[1], _ms(route_off))
        conv_ops._compiled = compiled
    return best[0], best[1]


def main() -> None:
    if not kernels.enabled():
        sys.exit("numba is not installed (or GRADTAPE_KERNELS switches it off)")
    gather = impl_rules[conv_ops.gather_p]
    conv_input = impl_rules[conv_ops.conv_input_p]
    rng = np.random.default_rng(0)
    print("| layer | dtype | gather kernel / NumPy | conv_input 1 pair | conv_input 2 pairs |")
    print("|---|---|---|---|---|")
    for dtype in (np.float32, np.float64):
        for c_in, c_out, hw, s in LAYERS:
            pads = ((1, 1), (1, 1))
            window = {"strides": (s, s), "pads": pads, "dilations": (1, 1), "groups": 1}
            x = rng.standard_normal((c_in, 64, hw, hw)).astype(dtype).swapaxes(0, 1)
            call = lambda x=x, window=window: gather(np, x, kernel=(3, 3), **window)
            g_ms = _pair(call, call)
            cells = [f"{g_ms[0]:.2f} / {g_ms[1]:.2f} ({g_ms[0] / g_ms[1]:.2f}x)"]
            if c_in > 3:  # the data's convolution has no input cotangent
                out = hw // s
                w = rng.standard_normal((c_out, c_in, 3, 3)).astype(dtype)
                g = rng.standard_normal((c_out, 64, out, out)).astype(dtype).swapaxes(0, 1)
                for operands in [(g, w), (g, w, g.copy(), w[::-1].copy())]:
                    call = lambda ops=operands, hw=hw, window=window: conv_input(
                        np, *ops, spatial=(hw, hw), **window
                    )
                    on, off = _pair(call, call)
                    cells.append(f"{on:.2f} / {off:.2f} ({on / off:.2f}x)")
            else:
                cells += ["-", "-"]
            name = f"{c_in} -> {c_out}, {hw}x{hw}, stride {s}"
            print(f"| {name} | {np.dtype(dtype).name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
