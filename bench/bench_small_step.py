"""Issue 28, item 4: one small training step through the dynamic tape (the TensorFlow-style
code of a user's own script: `with GradientTape()`, Variables, operators), against
PyTorch eager and a hand-written NumPy forward and backward, interleaved in one process.

bench_engine's small MLP: B=32, d=16, hidden 2 x 32, out 4, float32, mean squared
error; the gradient of every weight and bias. Minimum over --rounds of the process time
per step (µs), one BLAS thread; the minimum wall time per step beside it:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        MKL_NUM_THREADS=1 PYTHONPATH=. /work/venv/bin/python bench/bench_small_step.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine as gt


def contenders(act: str):
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shapes = [(16, 32), (32,), (32, 32), (32,), (32, 4), (4,)]
    params = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in shapes]
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.standard_normal((32, 4)).astype(np.float32)

    variables = [gt.Variable(a) for a in params]
    gx, gy, gact = gt.constant(x), gt.constant(y), getattr(gt, act)

    def gradtape():
        with gt.GradientTape() as tape:
            h = gx
            for i in range(3):
                h = h @ variables[2 * i] + variables[2 * i + 1]
                if i < 2:
                    h = gact(h)
            loss = gt.mean((h - gy) ** 2)
        return tape.gradient(loss, variables)

    tparams = [torch.from_numpy(a).clone().requires_grad_() for a in params]
    tx, ty, tact = torch.from_numpy(x), torch.from_numpy(y), getattr(torch, act)

    def pytorch():
        h = tx
        for i in range(3):
            h = h @ tparams[2 * i] + tparams[2 * i + 1]
            if i < 2:
                h = tact(h)
        return torch.autograd.grad(((h - ty) ** 2).mean(), tparams)

    def floor():
        hs, zs, h = [x], [], x
        for i in range(3):
            z = h @ params[2 * i] + params[2 * i + 1]
            zs.append(z)
            h = z if i == 2 else (np.tanh(z) if act == "tanh" else np.maximum(z, 0))
            hs.append(h)
        g, out = 2 * (h - y) / h.size, []
        for i in (2, 1, 0):
            out += [hs[i].T @ g, g.sum(0)]
            if i:
                g = g @ params[2 * i].T
                g = g * (1 - hs[i] ** 2) if act == "tanh" else g * (zs[i - 1] > 0)
        return out

    check = [a.numpy() for a in gradtape()]
    want = [a.numpy() for a in pytorch()]
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(check, want, strict=True))
    return {"gradtape": gradtape, "torch": pytorch, "floor": floor}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args()
    print(
        "| activation | gradtape µs | torch µs | floor µs | gt/torch | gt/floor "
        "| wall: gradtape µs | torch µs | gt/torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for act in ("tanh", "relu"):
        runs = contenders(act)
        best = dict.fromkeys(runs, float("inf"))
        wall = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for name, fn in runs.items():
                start, start_wall = time.process_time(), time.perf_counter()
                for _ in range(args.inner):
                    fn()
                end, end_wall = time.process_time(), time.perf_counter()
                best[name] = min(best[name], (end - start) / args.inner * 1e6)
                wall[name] = min(wall[name], (end_wall - start_wall) / args.inner * 1e6)
        print(
            f"| {act} | {best['gradtape']:.0f} | {best['torch']:.0f} | {best['floor']:.0f} | "
            f"{best['gradtape'] / best['torch']:.2f}x | {best['gradtape'] / best['floor']:.2f}x "
            f"| {wall['gradtape']:.0f} | {wall['torch']:.0f} | "
            f"{wall['gradtape'] / wall['torch']:.2f}x |"
        )


if __name__ == "__main__":
    main()
