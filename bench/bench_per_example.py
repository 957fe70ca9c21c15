"""Per-example gradients: gradtape's engine (engine/per_example.py) against PyTorch's
torch.func.vmap(torch.func.grad(...)), issue 30.

The digits-like MLP 64-32-10 (tanh), 1,500 examples, float64, softmax cross-entropy
averaged over the batch; seeded NumPy inputs converted for each framework. Both
frameworks in ONE process, one thread each.

Rows (seconds per call; medians over --repeat interleaved rounds, wall and CPU time):

    gradtape  per-example, from scratch   Curvature(...) (forward + gradient recorded)
                                          then per_example(...): g_i and their norms,
                                          mean, variance, sum of squares
              gradients only, from scratch the same with statistics=False: the
                                          per-example gradients alone (what
                                          vmap(grad) answers)
              per-example, on a recording per_example(...) on a Curvature kept from
                                          before (a tape on the server, its forward
                                          already walked for the examples): one
                                          backward pass, the per-example outer
                                          products, the statistics
              per-example, gradients only the same with statistics=False (what
                                          vmap(grad) answers)
              batch gradient              Curvature(...).grad (for scale)
    torch     vmap(grad)                  torch.func.vmap(grad(loss of one example))
              batch gradient              autograd on the mean loss (for scale)

Every case once as a warm-up, then --repeat rounds that time each case once in turn.
Run single-threaded from the repository root (the BLAS variables unset, as the other
bench scripts do; PyTorch uses MKL here, NumPy OpenBLAS):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \\
        OPENBLAS_NUM_THREADS=1 /work/venv/bin/python bench/bench_per_example.py

The per-example gradients are checked against each other first (max difference printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

N, DIMS = 1500, (64, 32, 10)


def problem(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((N, DIMS[0])),
        "y": rng.integers(0, DIMS[2], N),
        "w1": rng.standard_normal(DIMS[:2]) / 8,
        "b1": 0.1 * rng.standard_normal(DIMS[1]),
        "w2": rng.standard_normal(DIMS[1:]) / 6,
        "b2": 0.1 * rng.standard_normal(DIMS[2]),
    }


def gradtape_cases(p: dict) -> dict:
    import engine as gt
    from engine.curvature import Curvature
    from engine.per_example import per_example

    params = {k: gt.Tensor(p[k]) for k in ("w1", "b1", "w2", "b2")}
    x, y = gt.Tensor(p["x"]), gt.Tensor(p["y"])

    def model(q, x):
        return gt.tanh(x @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]

    def loss(o, t):
        return gt.mean(gt.softmax_cross_entropy(o, t))

    kept = Curvature(model, loss, params, x, y, hessian=False)

    def scratch():
        return per_example(Curvature(model, loss, params, x, y, hessian=False)).gradients

    def scratch_gradients():
        curv = Curvature(model, loss, params, x, y, hessian=False)
        return per_example(curv, statistics=False).gradients

    def recorded():
        return per_example(kept).gradients

    def gradients_only():
        return per_example(kept, statistics=False).gradients

    def batch():
        return Curvature(model, loss, params, x, y, hessian=False).grad

    return {
        "gradtape per-example, from scratch": scratch,
        "gradtape gradients only, from scratch": scratch_gradients,
        "gradtape per-example, on a recording": recorded,
        "gradtape per-example, gradients only": gradients_only,
        "gradtape batch gradient": batch,
    }


def torch_cases(p: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    params = {k: torch.tensor(p[k]) for k in ("w1", "b1", "w2", "b2")}
    x, y = torch.tensor(p["x"]), torch.tensor(p["y"])

    def forward(q, x):
        return torch.tanh(x @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]

    def one(q, xi, yi):
        return torch.nn.functional.cross_entropy(forward(q, xi[None]), yi[None])

    per = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))

    def vmap_grad():
        return {k: v.numpy() for k, v in per(params, x, y).items()}

    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}

    def batch():
        loss = torch.nn.functional.cross_entropy(forward(leaves, x), y)
        return torch.autograd.grad(loss, list(leaves.values()))

    return {"torch vmap(grad)": vmap_grad, "torch batch gradient": batch}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    p = problem()
    cases = {**gradtape_cases(p), **torch_cases(p)}
    ours = cases["gradtape per-example, from scratch"]()
    theirs = cases["torch vmap(grad)"]()
    diff = max(float(np.abs(ours[k] - theirs[k]).max()) for k in ours)
    print(f"per-example gradients, max |gradtape - torch| = {diff:.1e}")
    for fn in cases.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, fn in cases.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"N={N}, MLP {'-'.join(map(str, DIMS))} tanh, float64, {args.repeat} rounds, {threads}")
    base = statistics.median(cpu["torch vmap(grad)"])
    print(f"{'case':40s} {'wall ms':>9s} {'CPU ms':>9s} {'CPU / torch vmap':>17s}")
    for name in cases:
        w, c = statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3
        print(f"{name:40s} {w:9.2f} {c:9.2f} {c / 1e3 / base:17.2f}")


if __name__ == "__main__":
    main()
