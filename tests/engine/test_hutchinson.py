"""The one Hutchinson loop (engine/hessian_algorithms/hutchinson.py) with the Frobenius
form: ||A||_F^2 = E ||A z||^2 against the dense sum of squares, its standard error against
the samples' spread, and the loop's stopping rules as the trace and diagonal have them."""

from __future__ import annotations

import math

import numpy as np

from engine.hessian_algorithms.hutchinson import (
    DIAGONAL,
    FROBENIUS,
    MIN_STDERR_SAMPLES,
    TRACE,
    hutchinson,
)


def symmetric(n: int, seed: int) -> np.ndarray:
    m = np.random.default_rng(seed).standard_normal((n, n))
    return (m + m.T) / 2


def test_frobenius_form_against_the_dense_matrix() -> None:
    a = symmetric(40, 1)
    run = hutchinson(lambda v: v @ a.T, 40, FROBENIUS, batch_size=50, max_hvps=4000, seed=2)
    exact = float(np.sum(a**2))
    stderr = float(run.stderr[0])
    assert run.samples == run.hvps == 4000 and run.converged and run.stopped == "max_hvps"
    assert 0 < stderr < 0.05 * exact and abs(float(run.mean[0]) - exact) < 4 * stderr
    # The samples are ||A z||^2, and the standard error is their std / sqrt(N).
    assert run.values.shape == (4000,) and (run.values >= 0).all()
    assert stderr == float(run.values.std(ddof=1) / math.sqrt(4000))


def test_every_form_stops_by_the_same_rules() -> None:
    a = symmetric(30, 3)
    for form in (TRACE, DIAGONAL, FROBENIUS):
        few = hutchinson(lambda v: v @ a.T, 30, form, batch_size=4, max_hvps=8)
        assert few.samples == 8 and not few.converged and math.isinf(few.error)
        tol = hutchinson(lambda v: v @ a.T, 30, form, batch_size=10, max_hvps=10_000, rtol=0.2)
        assert tol.stopped == "tolerance" and tol.converged
        assert MIN_STDERR_SAMPLES <= tol.samples < 10_000
