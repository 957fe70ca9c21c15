"""Curvature-vector products per second: gradtape's Curvature operators against PyTorch.

The medium MLP of bench_engine.py (B=256, d=256, hidden 3 x 512 tanh, out 10; float32,
seeded NumPy inputs converted for each framework) with softmax cross-entropy on integer
labels (mean over the batch): about 660k parameters. Both frameworks in ONE process.

Rows (products at one point; whatever can be recorded once is, and is not timed):

    gradtape  hessian   Curvature(...).operator("hessian") (engine.curvature): the second-order pass over
                        the recorded forward and gradient
              ggn       operator("ggn"): J v by one backward pass over the recorded
                        (transposed) VJP, H_L on the output, J^T u by a backward pass
    torch     hessian   autograd double backward on a graph built once
                        (autograd.grad(g, params, v, retain_graph=True); K vectors with
                        is_grads_batched=True)
              hessian   torch.func.jvp(torch.func.grad(f)) (forward-over-reverse; runs
              (func)    the forward each call); K vectors by torch.func.vmap
              ggn       torch.func: jvp of the model (runs the forward), jvp of
              (func)    grad(loss) on the output for H_L, and a vjp function made once
                        (torch.func.vjp); K vectors by torch.func.vmap
              ggn       the same with torch.func.linearize of the model made once (no
              (lin.)    forward per call)

Each product is asked for one vector and for K=16 in one call (per-vector rates).
Timing: every case once as a warm-up, then --repeat rounds that time each case once in
turn (interleaved, so that a noisy spell of a shared machine hits all of them), medians
of wall time (perf_counter) and CPU time of this process (process_time). Run single-
threaded (the env below; torch.set_num_threads(1)) from the repository root in a
virtualenv with torch and numpy:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \\
        OPENBLAS_NUM_THREADS=1 /work/wt/peers-venv/bin/python bench/bench_curvature.py

The products are checked against each other first (relative difference printed).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_engine import SIZES  # the sizes shared with bench_engine

K = 16
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def problem(size_name: str, seed: int = 0) -> dict:
    size = SIZES[size_name]
    rng = np.random.default_rng(seed)
    dims = (size.d_in, *size.hidden, size.d_out)
    params = []
    for d_in, d_out in itertools.pairwise(dims):
        params.append((rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32))
        params.append((0.1 * rng.standard_normal(d_out)).astype(np.float32))
    return {
        "size": size,
        "x": rng.standard_normal((size.batch, size.d_in)).astype(np.float32),
        "y": rng.integers(0, size.d_out, size.batch),
        "params": params,
        "v": [rng.standard_normal(p.shape).astype(np.float32) for p in params],
        "vs": [rng.standard_normal((K, *p.shape)).astype(np.float32) for p in params],
    }


# ---------------------------------------------------------------------------- gradtape


def gradtape_cases(pb: dict) -> dict[str, Callable[[], object]]:
    import engine as gt
    from engine.curvature import Curvature

    def model(params, x):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = gt.tanh(h @ params[i] + params[i + 1])
        return h @ params[-2] + params[-1]

    def loss(out, y):
        return gt.softmax_cross_entropy(out, y)

    params = [gt.constant(p) for p in pb["params"]]
    curvature = Curvature(model, loss, params, gt.constant(pb["x"]), gt.constant(pb["y"]))
    v = [gt.constant(a) for a in pb["v"]]
    vs = [gt.constant(a) for a in pb["vs"]]
    cases = {}
    for kind in ("hessian", "ggn"):
        op = curvature.operator(kind)
        cases[f"gradtape {kind}"] = (lambda op=op: op.hvp(v), lambda op=op: op.hvp_many(vs))
    return cases


def gradtape_products(cases: dict) -> dict[str, list[np.ndarray]]:
    return {name: [t.numpy() for t in one()[0]] for name, (one, _) in cases.items()}


# ------------------------------------------------------------------------------- torch


def torch_cases(pb: dict) -> dict[str, tuple[Callable, Callable]]:
    import torch
    import torch.nn.functional as F
    from torch import func

    torch.set_num_threads(1)
    x = torch.from_numpy(pb["x"])
    y = torch.from_numpy(pb["y"])
    params = tuple(torch.from_numpy(p.copy()) for p in pb["params"])
    v = tuple(torch.from_numpy(a) for a in pb["v"])
    vs = tuple(torch.from_numpy(a) for a in pb["vs"])

    def model(ps):
        h = x
        for i in range(0, len(ps) - 2, 2):
            h = torch.tanh(h @ ps[i] + ps[i + 1])
        return h @ ps[-2] + ps[-1]

    def total(ps):
        return F.cross_entropy(model(ps), y)

    cases = {}
    # Double backward on a graph built once.
    leaves = tuple(p.clone().requires_grad_() for p in params)
    grads = torch.autograd.grad(total(leaves), leaves, create_graph=True)
    cases["torch hessian"] = (
        lambda: torch.autograd.grad(grads, leaves, v, retain_graph=True),
        lambda: torch.autograd.grad(grads, leaves, vs, retain_graph=True, is_grads_batched=True),
    )

    def hvp_func(w):
        return func.jvp(func.grad(total), (params,), (w,))[1]

    cases["torch hessian (func)"] = (lambda: hvp_func(v), lambda: func.vmap(hvp_func)(vs))

    out = model(params).detach()
    grad_loss = func.grad(lambda o: F.cross_entropy(o, y))
    _, vjp_fn = func.vjp(model, params)

    def ggn_func(w):
        _, jv = func.jvp(model, (params,), (w,))
        _, hjv = func.jvp(grad_loss, (out,), (jv,))
        return vjp_fn(hjv)[0]

    cases["torch ggn (func)"] = (lambda: ggn_func(v), lambda: func.vmap(ggn_func)(vs))
    try:
        _, jvp_fn = func.linearize(model, params)

        def ggn_linearized(w):
            _, hjv = func.jvp(grad_loss, (out,), (jvp_fn(w),))
            return vjp_fn(hjv)[0]

        ggn_linearized(v)
        cases["torch ggn (lin.)"] = (
            lambda: ggn_linearized(v),
            lambda: func.vmap(ggn_linearized)(vs),
        )
    except Exception as exc:  # noqa: BLE001 (a peer's missing feature is reported, not fatal)
        print(f"# torch.func.linearize unavailable here: {type(exc).__name__}: {exc}")
    return cases


# ------------------------------------------------------------------------------ timing


def relative(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    fa = np.concatenate([np.asarray(t, np.float64).ravel() for t in a])
    fb = np.concatenate([np.asarray(t, np.float64).ravel() for t in b])
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def check(gt_cases: dict, torch_cases_: dict) -> list[str]:
    ours = gradtape_products(gt_cases)
    lines = []
    for name, (one, _) in torch_cases_.items():
        kind = "ggn" if "ggn" in name else "hessian"
        theirs = [t.detach().numpy() for t in one()]
        lines.append(
            f"{name} vs gradtape {kind}: relative difference "
            f"{relative(ours[f'gradtape {kind}'], theirs):.1e}"
        )
    return lines


def measure(cases: dict, repeat: int) -> dict[str, dict[str, float]]:
    calls = [
        (name, k, fn) for name, (one, many) in cases.items() for k, fn in ((1, one), (K, many))
    ]
    for _, _, fn in calls:
        fn()  # warm-up
    wall: dict[tuple, list[float]] = {(n, k): [] for n, k, _ in calls}
    cpu: dict[tuple, list[float]] = {(n, k): [] for n, k, _ in calls}
    for _ in range(repeat):
        for name, k, fn in calls:
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[(name, k)].append(time.perf_counter() - w0)
            cpu[(name, k)].append(time.process_time() - c0)
    return {
        f"{n}|{k}": {
            "wall": statistics.median(wall[(n, k)]) / k,
            "cpu": statistics.median(cpu[(n, k)]) / k,
        }
        for n, k, _ in calls
    }


def table(results: dict, names: list[str]) -> list[str]:
    lines = [
        "| products | 1 vector: /s wall | /s CPU | x16 in one call: /s wall | /s CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        one, many = results[f"{name}|1"], results[f"{name}|{K}"]
        lines.append(
            f"| {name} | {1 / one['wall']:.1f} | {1 / one['cpu']:.1f} | "
            f"{1 / many['wall']:.1f} | {1 / many['cpu']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="medium", choices=sorted(SIZES))
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # one thread, as NumPy's BLAS under the env above

    pb = problem(args.size)
    n_params = sum(p.size for p in pb["params"])
    gt_cases, th_cases = gradtape_cases(pb), torch_cases(pb)
    env = " ".join(f"{k}={os.environ.get(k, '')}" for k in ("OPENBLAS_CORETYPE", *THREAD_ENV))
    print(
        f"# {args.size} MLP ({pb['size'].describe()}, tanh, softmax cross-entropy), "
        f"{n_params:,} parameters, float32"
    )
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, NumPy {np.__version__}, "
        f"torch {torch.__version__}; {env}"
    )
    for line in check(gt_cases, th_cases):
        print("# " + line)
    cases = {**gt_cases, **th_cases}
    results = measure(cases, args.repeat)
    print(f"# medians of {args.repeat} interleaved rounds; products per second (x16: per vector)")
    print("\n".join(table(results, list(cases))))


if __name__ == "__main__":
    main()
