"""The stride-1 input cotangent (conv_input's impl, host chunks) of many leading rows
beside a small batch (a jacobian's rows, a K-vector pass, at batch 1 to 64), against
PyTorch's conv2d_input on the same K * N images (one call), in the same process.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/bench_conv_input_rows.py

Per shape (K rows, N images, C = O channels, H = W, 3 x 3, pad 1, float32): process
time, the minimum over ROUNDS rounds of INNER calls, gradtape and PyTorch alternating, ms
per call, and their ratio. NumPy's OpenBLAS and PyTorch's MKL/oneDNN, one thread each.
(Review r12: kern-pool's layout cut the chunks at each batch, one GEMM call per image
at N = 1; bench/RESULTS.md, "Review r12".)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.ops import conv as conv_ops
from engine.registry import impl_rules

ROUNDS, INNER = 7, 5
SHAPES = [(256, 1, 8, 8), (64, 1, 16, 32), (32, 2, 16, 16), (8, 8, 16, 16), (1, 64, 16, 32)]


def _ms(fn) -> float:
    t = time.process_time()
    for _ in range(INNER):
        fn()
    return (time.process_time() - t) / INNER * 1e3


def main() -> None:
    import torch

    torch.set_num_threads(1)
    conv_input = impl_rules[conv_ops.conv_input_p]
    params = {
        "spatial": None,
        "strides": (1, 1),
        "pads": ((1, 1), (1, 1)),
        "dilations": (1, 1),
        "groups": 1,
    }
    rng = np.random.default_rng(0)
    print("K, N, C, H: gradtape ms, torch ms, ratio")
    for k, n, c, h in SHAPES:
        g = rng.standard_normal((k, n, c, h, h)).astype(np.float32)
        w = rng.standard_normal((c, c, 3, 3)).astype(np.float32)
        p = {**params, "spatial": (h, h)}
        tg = torch.from_numpy(g.reshape(k * n, c, h, h))
        tw = torch.from_numpy(w)

        def gt_call(g=g, w=w, p=p):
            return conv_input(np, g, w, **p)

        def torch_call(tg=tg, tw=tw):
            return torch.nn.grad.conv2d_input(tg.shape, tw, tg, padding=1)

        got = gt_call().reshape(k * n, c, h, h)
        np.testing.assert_allclose(got, torch_call().numpy(), rtol=1e-4, atol=1e-4)
        best = [float("inf"), float("inf")]
        for _ in range(ROUNDS):
            best[0] = min(best[0], _ms(gt_call))
            best[1] = min(best[1], _ms(torch_call))
        print(f"{k}, {n}, {c}, {h}: {best[0]:.3f}, {best[1]:.3f}, {best[0] / best[1]:.2f}x")


if __name__ == "__main__":
    main()
