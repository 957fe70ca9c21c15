"""Issue 28, item 3: curvature products through the flat-vector path that SciPy uses,
against the same products asked directly, and K vectors in one pass against K single
products.

The medium MLP of bench_engine (B=256, d=256, hidden 3 x 512 tanh, 10 outputs: 662,026
float32 parameters), softmax cross-entropy on integer labels. Rows:

- direct: `op.hvp(*v)` with v in the parameters' structure (float32 tensors);
- flat float64: `FlatOperator(op).matvec` on (1, n) float64 rows (what an estimator or a
  float64 `scipy.sparse.linalg.LinearOperator` hands it: a cast in, a cast out);
- flat (primals' dtype): `FlatOperator(op).linear_operator()` as scipy's eigsh calls it,
  (n,) float32 vectors, the blocks views of the vector, one copy out;
- eigsh: `scipy.sparse.linalg.eigsh(FlatOperator(op).linear_operator(), k=4)`: the time
  inside its matvec calls per call, and its whole time per product (ARPACK's own work
  included);
- x16: `op.hvp_many` of 16 vectors in one call against 16 single products, for the
  Hessian, the GGN and the Fisher (engine.curvature operators).

Every case once as a warm-up (compiled passes replay from their third call), then
--rounds interleaved rounds; minimum of process time per product, ms. One BLAS thread:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. /work/venv/bin/python bench/bench_flat.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine as gt
from engine.curvature import Curvature
from engine.hessian_algorithms import FlatOperator

K = 16


def problem(batch=256, d=256, hidden=(512, 512, 512), out=10, seed=0):
    rng = np.random.default_rng(seed)
    dims = (d, *hidden, out)
    params = []
    for a, b in itertools.pairwise(dims):
        params.append(gt.constant((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)))
        params.append(gt.constant((0.1 * rng.standard_normal(b)).astype(np.float32)))
    x = gt.constant(rng.standard_normal((batch, d)).astype(np.float32))
    y = gt.constant(rng.integers(0, out, batch))

    def model(ps, x):
        h = x
        for i in range(len(ps) // 2):
            h = h @ ps[2 * i] + ps[2 * i + 1]
            if i < len(ps) // 2 - 1:
                h = gt.tanh(h)
        return h

    return params, x, y, model, rng


def cpu_ms(fn, inner):
    start = time.process_time()
    for _ in range(inner):
        fn()
    return (time.process_time() - start) / inner * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=3)
    args = parser.parse_args()
    params, x, y, model, rng = problem()
    curvature = Curvature(model, lambda o, y: gt.softmax_cross_entropy(o, y), params, x, y)
    ops = {kind: curvature.operator(kind) for kind in ("hessian", "ggn", "fisher")}
    op = ops["hessian"]
    flat = FlatOperator(op)
    n = flat.n
    v = [gt.constant(rng.standard_normal(p.shape).astype(np.float32)) for p in params]
    v64 = flat.flatten(v)[None]
    v32 = v64[0].astype(np.float32)
    lin = flat.linear_operator()
    cases = {
        "hessian: direct": lambda: op.hvp(v),
        "hessian: flat float64 (1, n)": lambda: flat.matvec(v64),
        "hessian: flat primals' dtype (n,)": lambda: lin.matvec(v32),
    }
    many = {}
    for kind, o in ops.items():
        vs = [gt.constant(rng.standard_normal((K, *p.shape)).astype(np.float32)) for p in params]
        one = [gt.constant(a.value[0]) for a in vs]
        cases[f"{kind}: 1 vector"] = lambda o=o, one=one: o.hvp(one)
        many[kind] = f"{kind}: {K} vectors in one call"
        cases[many[kind]] = lambda o=o, vs=vs: o.hvp_many(vs)
    answers = {k: f() for k, f in cases.items() for _ in range(3)}  # warm: replays from 3
    direct = np.concatenate(
        [a.numpy().ravel() for a in gt.tree.flatten(answers["hessian: direct"])[0]]
    )
    for key in ("hessian: flat float64 (1, n)", "hessian: flat primals' dtype (n,)"):
        got = np.asarray(answers[key]).ravel()
        assert np.array_equal(got.astype(np.float32), direct), key
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, f in cases.items():
            times[k].append(cpu_ms(f, args.inner))
    best = {k: min(v) for k, v in times.items()}

    # eigsh: the time spent in its matvec calls, and its whole time, per product
    from scipy.sparse.linalg import LinearOperator, eigsh

    inside = []

    def timed_matvec(z):
        start = time.process_time()
        out = lin.matvec(z)
        inside.append(time.process_time() - start)
        return out

    timed = LinearOperator((n, n), matvec=timed_matvec, dtype=lin.dtype)
    start = time.process_time()
    values = eigsh(timed, k=4, which="LA", tol=1e-3, v0=np.ones(n, np.float32))[0]
    whole = (time.process_time() - start) * 1e3 / len(inside)
    per_call = np.median(inside) * 1e3
    fastest = min(inside) * 1e3
    # the direct product's calls measured the same way (each call timed alone, ARPACK's
    # vectors' memory in between: a median against a median, a minimum against a minimum)
    direct_calls = []
    for _ in range(len(inside)):
        blocks = [gt.constant(b) for b in flat.unflatten(v32 + np.float32(0))]  # fresh
        start = time.process_time()
        op.hvp(blocks)
        direct_calls.append(time.process_time() - start)
    direct_median = np.median(direct_calls) * 1e3

    print(f"- n = {n:,} parameters (float32), batch 256; ms of process time, min of rounds\n")
    print("| case | ms per call | vs direct / vs 1 vector |")
    print("|---|---|---|")
    d = best["hessian: direct"]
    for k in (
        "hessian: direct",
        "hessian: flat float64 (1, n)",
        "hessian: flat primals' dtype (n,)",
    ):
        print(f"| {k} | {best[k]:.2f} | {best[k] / d:.3f}x |")
    print(
        f"| eigsh (k=4, LA): median matvec call, {len(inside)} calls | {per_call:.2f} | "
        f"{per_call / d:.3f}x |"
    )
    print(
        f"| eigsh: fastest matvec call | {fastest:.2f} | {fastest / d:.3f}x (vs the direct "
        "minimum) |"
    )
    print(
        f"| direct: median of {len(direct_calls)} single calls | {direct_median:.2f} | "
        f"eigsh's median matvec {per_call / direct_median:.3f}x of it |"
    )
    print(f"| eigsh: its whole time per product | {whole:.2f} | {whole / d:.3f}x |")
    for kind in ops:
        one, k16 = best[f"{kind}: 1 vector"], best[many[kind]]
        print(f"| {kind}: 1 vector | {one:.2f} | |")
        print(f"| {kind}: {K} vectors in one call | {k16:.2f} | {k16 / one:.2f}x one |")
    print(f"\ntop eigenvalues (eigsh, float32): {np.sort(values)[::-1]}")


if __name__ == "__main__":
    main()
