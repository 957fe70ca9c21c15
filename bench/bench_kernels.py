"""The compiled kernels against their NumPy paths, call by call (issue 28; bench/RESULTS.md
"erf, GELU and softmax as compiled kernels").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/bench_kernels.py

Each row: the NumPy path (the reference beside the call site) and the kernel's entry
point (engine/kernels/), on the transformer's shapes (GELU: 64 x 16 x 256 float32;
softmax: 64 x 4 x 16 x 16) and at small sizes (where the dispatcher's call cost would
show), interleaved, ms per call, the minimum over rounds of perf_counter (process time
cannot resolve microseconds). The kernels are compiled (or loaded from numba's cache)
before timing.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scipy.special import erf as scipy_erf

from engine import kernels
from engine.backend import erf_float32
from engine.kernels import gelu as gelu_kernels
from engine.kernels import layernorm as layernorm_kernels
from engine.kernels import scatter as scatter_kernel
from engine.kernels import softmax as softmax_kernel
from engine.ops import nn
from engine.ops.elementwise import _gelu_numpy, _gelu_slope_numpy
from engine.ops.nn import _softmax_numpy

ROUNDS = 30


def best_ms(fns: dict, rounds: int, repeat: int) -> dict:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(repeat):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / repeat)
    return {k: v * 1e3 for k, v in best.items()}


def rows() -> list[tuple[str, int, object, object]]:
    rng = np.random.default_rng(0)
    out = []
    for n in (262_144, 4_096, 16, 1):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        y = _gelu_numpy(np, x)
        o = np.empty_like(x)
        x64, y64, o64 = x.astype(np.float64), y.astype(np.float64), np.empty(n)
        out += [
            (
                "erf float32",
                n,
                lambda x=x: erf_float32(np, x),
                lambda x=x: gelu_kernels.erf_float32(x),
            ),
            (
                "gelu float32",
                n,
                lambda x=x: _gelu_numpy(np, x),
                lambda x=x, o=o: gelu_kernels.gelu(x, o),
            ),
            (
                "gelu_slope float32",
                n,
                lambda x=x, y=y, o=o: _gelu_slope_numpy(np, x, y, o),
                lambda x=x, y=y, o=o: gelu_kernels.gelu_slope(x, y, o),
            ),
            (
                "gelu_slope float64",
                n,
                lambda x=x64, y=y64, o=o64: _gelu_slope_numpy(np, x, y, o),
                lambda x=x64, y=y64, o=o64: gelu_kernels.gelu_slope(x, y, o),
            ),
        ]
    for shape in ((64, 4, 16, 16), (1, 16)):
        s = (rng.standard_normal(shape) * 3).astype(np.float32)
        o = np.empty_like(s)
        out.append(
            (
                f"softmax float32 {shape}",
                s.size,
                lambda s=s, o=o: _softmax_numpy(np, s, -1, o),
                lambda s=s, o=o: softmax_kernel.softmax(s, -1, o),
            )
        )
    tokens = rng.integers(0, 100, (64, 16))
    g = rng.standard_normal((64, 16, 64)).astype(np.float32)
    table = np.zeros((100, 64), np.float32)

    def scatter_numpy():  # engine/backend.py's _scatter_rows without the kernel
        flat = tokens.reshape(-1)
        order = np.argsort(flat, kind="stable")
        rows = flat[order]
        starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
        table[rows[starts]] += np.add.reduceat(g.reshape(-1, 64)[order], starts, axis=0)

    out.append(
        (
            "embedding rows scatter (100, 64)",
            g.size,
            scatter_numpy,
            lambda: scatter_kernel.add_rows(tokens, g, table),
        )
    )
    x = (rng.standard_normal((64, 16, 64)) * 2 + 1).astype(np.float32)
    y = nn._normalize_impl(np, x, eps=1e-5)
    ln_out = np.empty_like(x)

    def numpy_ops(fn):  # the NumPy operations the layer-norm kernels replace
        def run():
            saved = (
                layernorm_kernels.center,
                layernorm_kernels.scale_rows,
                layernorm_kernels.combine,
            )
            layernorm_kernels.center = layernorm_kernels.scale_rows = layernorm_kernels.combine = (
                lambda *args: False
            )
            try:
                fn()
            finally:
                (
                    layernorm_kernels.center,
                    layernorm_kernels.scale_rows,
                    layernorm_kernels.combine,
                ) = saved

        return run

    forward = lambda: nn._normalize_into(np, x, 1e-5, ln_out)
    backward = lambda: nn._normalize_grad_into(np, g, x, y, 1e-5, ln_out)
    out.append(("normalize (layer norm) float32", x.size, numpy_ops(forward), forward))
    out.append(("normalize_grad float32", x.size, numpy_ops(backward), backward))
    return out


def main() -> None:
    if not kernels.enabled():
        sys.exit("numba is not installed (or GRADTAPE_KERNELS switches it off)")
    table = rows()
    for _, _, _, kernel in table:
        kernel()  # compile, or load from the cache
    print("| call | elements | NumPy path ms | kernel ms | NumPy / kernel |\n|---|---|---|---|---|")
    for name, n, numpy_path, kernel in table:
        repeat = 1 if n > 10_000 else 200
        t = best_ms({"numpy": numpy_path, "kernel": kernel}, ROUNDS, repeat)
        ratio = t["numpy"] / t["kernel"]
        print(f"| {name} | {n:,} | {t['numpy']:.4f} | {t['kernel']:.4f} | {ratio:.1f}x |")
    # float64 erf: a loop over the C library's erf, measured and not kept (engine/kernels/gelu.py)
    from engine.kernels import numba_module

    numba = numba_module()

    @numba.njit(nogil=True, error_model="numpy")
    def libm_erf(x, out):  # (compiled here: not a kernel of the engine)
        for i in range(x.size):
            out[i] = math.erf(x[i])

    x = np.random.default_rng(1).standard_normal(262_144) * 3
    o = np.empty_like(x)
    libm_erf(x, o)
    t = best_ms({"scipy": lambda: scipy_erf(x), "libm": lambda: libm_erf(x, o)}, ROUNDS, 1)
    print(
        f"\nfloat64 erf, 262,144: SciPy {t['scipy']:.3f} ms, a numba loop over the C "
        f"library's erf {t['libm']:.3f} ms (not used: its last bits differ from SciPy's "
        f"on {np.mean(o != scipy_erf(x)):.0%} of the inputs)"
    )


if __name__ == "__main__":
    main()
