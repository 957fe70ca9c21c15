"""The float32 erf of engine/backend.py (`erf_float32`): its coefficients' fit, its error
over every float32, and its speed against SciPy's.

    PYTHONPATH=. python bench/erf32.py fit      # refit: prints P, Q (monic) and the error
    PYTHONPATH=. python bench/erf32.py check    # every float32 (2^32 inputs, ~2 minutes)
    PYTHONPATH=. python bench/erf32.py speed    # ms per call on a GELU-sized input

The fit: erf(x)/x = P(t)/Q(t), t = x^2 on [0, 16], the maximum relative error minimised
by Sanathanan-Koerner iterations (a linear least-squares problem weighted by the last Q)
with Lawson's reweighting towards the minimax solution, in a Chebyshev basis over 4000
Chebyshev nodes, then converted to monomials in t and scaled so that Q is monic.

The check measures |erf_float32(x) - erf(x)| in float32 ulps of the reference (SciPy's
float64 erf; an ulp of r is 2^(floor(log2 |r|) - 23), at least 2^-149), over all 2^31
non-negative float32 bit patterns (finite ones measured, the rest checked for their
special values) and over the negative ones by symmetry, which it also checks bit for
bit on every 97th input.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numpy.polynomial import chebyshev, polynomial
from scipy.special import erf as scipy_erf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.backend import erf_float32


def fit(p: int = 6, q: int = 5, t_max: float = 16.0, nodes: int = 4000) -> None:
    u: np.ndarray = np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    t = (u + 1) / 2 * t_max
    x = np.sqrt(t)
    f = scipy_erf(x) / x
    vp, vq = chebyshev.chebvander(u, p), chebyshev.chebvander(u, q)
    w, q_prev = np.ones(nodes), np.ones(nodes)
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for _ in range(200):
        scale = (f * q_prev)[:, None]
        a_mat = np.hstack([vp, -(f[:, None] * vq[:, 1:])]) / scale
        rhs = f * vq[:, 0] / scale[:, 0]
        sol = np.linalg.lstsq(a_mat * np.sqrt(w)[:, None], rhs * np.sqrt(w), rcond=None)[0]
        a, b = sol[: p + 1], np.concatenate([[1.0], sol[p + 1 :]])
        q_prev = vq @ b
        err = (vp @ a / q_prev - f) / f
        if best is None or np.abs(err).max() < best[0]:
            best = (float(np.abs(err).max()), a, b)
        w = w * np.abs(err)
        w /= w.sum()
    assert best is not None

    def monomial_in_t(c: np.ndarray) -> np.ndarray:  # u = 2 t / t_max - 1
        out: np.ndarray = np.zeros(1)
        power: np.ndarray = np.ones(1)
        for ci in chebyshev.cheb2poly(c):
            out = polynomial.polyadd(out, ci * power)
            power = polynomial.polymul(power, [-1.0, 2.0 / t_max])
        return out

    num, den = monomial_in_t(best[1]), monomial_in_t(best[2])
    num, den = num / den[-1], den / den[-1]
    print(f"max relative error of the fit: {best[0]:.3g}")
    print("P (t^0 up):", [float(v) for v in num])
    print("Q (t^0 up, monic):", [float(v) for v in den])


def ulps(result: np.ndarray, reference: np.ndarray) -> np.ndarray:
    exponent = np.frexp(np.abs(reference))[1]  # |r| = m 2^e, m in [0.5, 1)
    ulp = np.ldexp(1.0, np.maximum(exponent - 24, -149))
    return np.abs(result.astype(np.float64) - reference) / ulp


def check(chunk: int = 1 << 24) -> None:
    worst, worst_x, counted, above_half = 0.0, 0.0, 0, 0
    start = time.perf_counter()
    for lo in range(0, 1 << 31, chunk):
        bits = np.arange(lo, lo + chunk, dtype=np.uint32)
        x = bits.view(np.float32)
        finite = np.isfinite(x)
        y = erf_float32(np, x)
        if not finite.all():  # +inf and the NaNs
            special = x[~finite]
            got = y[~finite]
            assert np.all(np.isnan(got) == np.isnan(special)), "NaN must stay NaN"
            assert np.all(got[np.isinf(special)] == 1.0), "erf(inf) must be 1"
        xs, ys = x[finite], y[finite]
        e = ulps(ys, scipy_erf(xs.astype(np.float64)))
        k = int(np.argmax(e))
        if e[k] > worst:
            worst, worst_x = float(e[k]), float(xs[k])
        above_half += int(np.count_nonzero(e > 0.5))
        counted += xs.size
        sample = xs[::97]  # odd symmetry, bit for bit
        assert np.array_equal(erf_float32(np, -sample), -erf_float32(np, sample))
    print(
        f"{counted:,} finite non-negative float32 inputs (and their negatives): max error "
        f"{worst:.4f} ulp at x = {worst_x!r}; {above_half:,} results above 0.5 ulp "
        f"(not correctly rounded); {time.perf_counter() - start:.0f} s"
    )
    assert erf_float32(np, np.array([-0.0], np.float32)).view(np.uint32)[0] == 0x80000000, (
        "-0 stays -0"
    )


def speed() -> None:
    x = np.random.default_rng(0).standard_normal((64, 16, 256)).astype(np.float32)

    def per_call(fn, n: int = 50) -> float:
        fn()
        t = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - t) / n * 1e3

    for _ in range(3):  # interleaved
        ours, theirs = per_call(lambda: erf_float32(np, x)), per_call(lambda: scipy_erf(x))
        print(f"erf_float32 {ours:.3f} ms, scipy.special.erf {theirs:.3f} ms (float32, 262,144)")


if __name__ == "__main__":
    modes: dict[str, Callable[[], None]] = {"fit": fit, "check": check, "speed": speed}
    modes[sys.argv[1] if len(sys.argv) > 1 else "check"]()
