"""The curvature estimators of engine.hessian_algorithms against dense truth: exact
trace and diagonal against numpy to rounding; Hutchinson and Hutch++ within the standard
error they report (and that error calibrated over seeds), stopping early on easy
problems and reaching their tolerance on hard ones; deflated power iteration and
Lanczos eigenpairs against numpy.linalg.eigh; the SLQ spectral density against the
exact eigenvalues (quadrature moments, smoothed densities, histograms); budgets,
stopping reasons and progress for each; and all of it on a real HessianOperator and on
a Gauss-Newton operator made of JVPs and VJPs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import engine as gt
from engine.hessian_algorithms import (
    FlatOperator,
    Progress,
    estimate_diagonal,
    estimate_trace,
    exact_diagonal,
    exact_pass_size,
    exact_trace,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    lanczos,
    power_iteration,
    spectral_density,
)
from engine.hessian_algorithms.trace import MIN_STDERR_SAMPLES
from tests.engine.test_hessian_algorithms import Counting, mlp_operator, symmetric


def decaying(n: int, seed: int) -> np.ndarray:
    """A PSD matrix whose eigenvalues decay like 1/i^2: easy for Hutch++ (its top is
    taken exactly), and a Hessian's usual shape."""
    return symmetric(n, seed, spectrum=1.0 / np.arange(1, n + 1) ** 2)


def hard(n: int, seed: int) -> np.ndarray:
    """A flat spectrum of both signs whose trace is small against its Frobenius norm:
    every probe-based estimator needs many samples."""
    rng = np.random.default_rng(seed)
    return symmetric(n, seed, spectrum=rng.uniform(-1, 1.1, n))


def sign_aligned(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    signs = np.sign(np.sum(vectors * reference, axis=1))
    return vectors * signs[:, None]


# ---- Exact trace and diagonal ------------------------------------------------------------


@pytest.mark.parametrize("n,batch", [(1, 1), (37, 8), (120, 120), (120, None), (50, None)])
def test_exact_trace_and_diagonal_equal_numpy(n: int, batch: int | None) -> None:
    a = symmetric(n, seed=n)
    matvec = Counting(a)
    tr = exact_trace(matvec, n, batch_size=batch)
    assert tr.stopped == "exhausted" and tr.converged and tr.method == "exact"
    assert tr.trace == pytest.approx(np.trace(a), rel=1e-13, abs=1e-13) and tr.stderr == 0.0
    assert tr.hvps == matvec.vectors == tr.samples == n
    # Passes of `batch` vectors; by default of 64 (one pass for n <= 64).
    assert tr.batches == matvec.calls == math.ceil(n / (batch or 64))
    diag = exact_diagonal(Counting(a), n, batch_size=batch)
    np.testing.assert_array_equal(diag.diagonal, np.diag(a))  # A e_i picks column i exactly
    assert diag.stopped == "exhausted" and diag.hvps == n and not diag.stderr.any()


def test_exact_pass_size() -> None:
    # One pass up to 64 unit vectors; the operator's max_batch (its memory bound) and 64
    # MiB of host vectors bound it further.
    assert [exact_pass_size(n) for n in (1, 30, 64, 65, 10_000)] == [1, 30, 64, 64, 64]
    assert exact_pass_size(1000, max_batch=10) == 10
    assert exact_pass_size(200_000) == 41 and exact_pass_size(10**8) == 1


def test_exact_methods_refuse_a_budget_below_n_and_answer_a_partial_run(fake_clock) -> None:
    a = np.diag(np.linspace(1.0, 2.0, 200)) + 0.01 * symmetric(200, seed=1)
    with pytest.raises(ValueError, match="takes n = 200 HVPs; max_hvps is 100"):
        exact_trace(Counting(a), 200, max_hvps=100)
    with pytest.raises(ValueError, match="takes n = 200 HVPs"):
        exact_diagonal(Counting(a), 200, max_hvps=100)
    # Stopped by time, the exact trace has seen a random sample of the diagonal: n times
    # its mean is an unbiased estimate, with a (finite-population) standard error.
    slow = exact_trace(
        Counting(a, delay=0.02, clock=fake_clock), 200, batch_size=10, max_seconds=0.05
    )
    assert slow.stopped == "time_limit" and not slow.converged and 10 <= slow.samples < 200
    assert 0 < slow.stderr < 0.1 * np.trace(a) and abs(slow.trace - np.trace(a)) < 4 * slow.stderr
    part = exact_diagonal(
        Counting(a, delay=0.02, clock=fake_clock), 200, batch_size=10, max_seconds=0.05
    )
    reached = part.samples
    assert part.stopped == "time_limit" and 10 <= reached < 200
    np.testing.assert_array_equal(part.diagonal[:reached], np.diag(a)[:reached])
    assert np.isnan(part.diagonal[reached:]).all() and np.isinf(part.stderr[reached:]).all()


def test_auto_is_exact_when_the_budget_covers_n() -> None:
    a = symmetric(31, seed=2)  # the 31 parameters: 4.75% off with 256 probes
    out = estimate_trace(Counting(a), 31, max_hvps=256)
    assert out.method == "exact" and out.hvps == 31 and out.trace == pytest.approx(np.trace(a))
    big = estimate_trace(Counting(symmetric(300, seed=3)), 300, max_hvps=256, rtol=0.5)
    assert big.method == "hutchpp" and big.hvps <= 256
    assert estimate_diagonal(Counting(a), 31, max_hvps=31).method == "exact"
    assert estimate_diagonal(Counting(a), 31, max_hvps=30).method == "hutchinson"
    assert estimate_trace(Counting(a), 31, method="hutchinson").method == "hutchinson"
    with pytest.raises(ValueError, match="method must be one of auto, exact, hutchpp"):
        estimate_trace(Counting(a), 31, method="lanczos")
    with pytest.raises(ValueError, match="method must be one of auto, exact, hutchinson"):
        estimate_diagonal(Counting(a), 31, method="hutchpp")


# ---- Hutchinson and Hutch++: honest errors, stopping rules -------------------------------


@pytest.mark.parametrize("estimator", [hutchinson_trace, hutchpp_trace])
def test_stochastic_traces_are_within_the_error_they_report(estimator) -> None:
    # Over 40 seeds the z-scores (estimate - truth) / stderr behave like a standard
    # normal's: none beyond 4.5, and their spread near 1 (the error is neither hidden
    # nor inflated).
    a = decaying(150, seed=4) + 0.05 * symmetric(150, seed=5)
    truth = np.trace(a)
    z = []
    for seed in range(40):
        out = estimator(Counting(a), 150, batch_size=8, max_hvps=96, seed=seed)
        assert out.stopped == "max_hvps" and out.hvps == 96 and out.converged
        z.append((out.trace - truth) / out.stderr)
    z = np.asarray(z)
    assert np.all(np.abs(z) < 4.5)
    assert 0.6 < z.std() < 1.5


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum() -> None:
    a = decaying(300, seed=6)
    plain = hutchinson_trace(Counting(a), 300, max_hvps=300, seed=1)
    plus = hutchpp_trace(Counting(a), 300, max_hvps=300, seed=1)
    assert plus.sketch == plus.samples == 100  # the budget in thirds, 16 a pass
    assert plus.stderr < plain.stderr / 5
    assert abs(plus.trace - np.trace(a)) < 4 * plus.stderr


def test_hutchpp_is_exact_once_the_sketch_spans_the_range() -> None:
    # Rank 10: A S for 16 Gaussian vectors spans A's range; the remainder is zero and
    # tr(Q A Q^T) is the trace, after 16 + 10 HVPs.
    a = symmetric(300, seed=7, spectrum=np.concatenate([np.linspace(10, 1, 10), np.zeros(290)]))
    matvec = Counting(a)
    out = hutchpp_trace(matvec, 300, max_hvps=1000, rtol=1e-3)
    assert out.stopped == "exhausted" and out.converged and out.stderr == 0.0
    assert out.trace == pytest.approx(np.trace(a), rel=1e-12)
    assert out.hvps == matvec.vectors == 26 and out.sketch == 10


def test_stochastic_traces_stop_early_on_an_easy_problem() -> None:
    # Hutch++ on a decaying spectrum: the sketch takes the top exactly and the rest is
    # tiny, so rtol = 1% is met after two rounds (96 HVPs) of a budget of 5000.
    a = decaying(400, seed=8)
    out = hutchpp_trace(Counting(a), 400, max_hvps=5000, rtol=0.01, seed=2)
    assert out.stopped == "tolerance" and out.converged and out.hvps <= 96
    assert out.stderr <= 0.01 * abs(out.trace)
    assert abs(out.trace - np.trace(a)) < 4 * out.stderr
    # Hutchinson on a diagonally dominant matrix: z^T A z barely varies.
    d = np.diag(np.linspace(1.0, 3.0, 400)) + 0.001 * symmetric(400, seed=9)
    easy = hutchinson_trace(Counting(d), 400, max_hvps=5000, rtol=0.01)
    assert easy.stopped == "tolerance" and easy.hvps == 32  # MIN_STDERR_SAMPLES, in 16s
    assert abs(easy.trace - np.trace(d)) < 4 * easy.stderr


@pytest.mark.parametrize("estimator", [hutchinson_trace, hutchpp_trace])
def test_one_probe_a_batch_stops_no_earlier_than_the_minimum_and_covers(estimator) -> None:
    # With batch_size 1 the old rule ("two batches") stopped ~3 samples in, on a
    # standard error from 2-3 probes: one run in seven was more than 4 true standard
    # errors off. Now no run stops before MIN_STDERR_SAMPLES, and over 300 seeds the
    # truth lies within 2 reported standard errors about 95% of the time.
    a = symmetric(200, seed=1, spectrum=np.random.default_rng(1).uniform(-1.0, 3.0, 200))
    truth = np.trace(a)
    z, samples = [], []
    for seed in range(300):
        out = estimator(Counting(a), 200, batch_size=1, max_hvps=5000, rtol=0.05, seed=seed)
        assert out.stopped == "tolerance" and out.converged
        z.append((out.trace - truth) / out.stderr)
        samples.append(out.samples)
    z = np.asarray(z)
    assert min(samples) >= MIN_STDERR_SAMPLES
    assert 0.9 <= np.mean(np.abs(z) < 2) <= 0.99
    assert np.all(np.abs(z) < 4.5)


@pytest.mark.parametrize("estimator", [hutchinson_trace, hutchpp_trace])
def test_too_few_samples_give_an_unknown_error_never_zero(estimator) -> None:
    # Two (or 29) equal probe values once answered stderr 0, converged: a matrix whose
    # z^T A z is the same for every z (a diagonal one) shows it.
    d = np.diag(np.linspace(1.0, 2.0, 60))
    per_probe = 3 if estimator is hutchpp_trace else 1  # a sketch, its product, a probe
    for budget in (3, per_probe * (MIN_STDERR_SAMPLES - 1)):
        out = estimator(Counting(d), 60, batch_size=1, max_hvps=budget, rtol=0.1)
        assert out.stderr == math.inf and not out.converged and out.stopped == "max_hvps"
        no_tolerance = estimator(Counting(d), 60, batch_size=1, max_hvps=budget)
        assert no_tolerance.stderr == math.inf and not no_tolerance.converged
    few = hutchinson_diagonal(Counting(d), 60, batch_size=1, max_hvps=2)
    assert few.error == math.inf and not few.converged
    plain = hutchinson_trace(Counting(d), 60, batch_size=1, max_hvps=100, rtol=0.1)
    assert plain.stopped == "tolerance" and plain.samples == MIN_STDERR_SAMPLES
    assert plain.stderr == pytest.approx(0.0, abs=1e-12)


def test_hutchpp_switches_to_exact_before_its_sketch_fills_the_space() -> None:
    # A full-rank matrix and a budget above n: Hutch++ used to grow its sketch to the
    # whole space (3n HVPs, 888 for n = 300); once the sketch would pass n/3 it takes the
    # exact trace instead: about n for the sketch so far + n.
    a = hard(300, seed=2)
    matvec = Counting(a)
    out = hutchpp_trace(matvec, 300, max_hvps=3000, seed=0)
    assert out.method == "exact" and out.stopped == "exhausted" and out.converged
    assert out.trace == pytest.approx(np.trace(a), rel=1e-10) and out.stderr == 0.0
    assert out.hvps == matvec.vectors <= 2 * 300
    # Without n HVPs left it stays Hutch++.
    capped = hutchpp_trace(Counting(a), 300, max_hvps=350, seed=0)
    assert capped.method == "hutchpp" and capped.hvps == 350


@pytest.mark.parametrize("estimator", [hutchinson_trace, hutchpp_trace])
def test_stochastic_traces_reach_their_target_on_a_hard_problem(estimator) -> None:
    a = hard(600, seed=10)
    truth = np.trace(a)
    # (Hutch++ with n = 600 HVPs left once its sketch reaches n/3 takes the exact trace
    # instead: tested above; under 1100 it has to meet the tolerance.)
    budget = 1100 if estimator is hutchpp_trace else 40_000
    out = estimator(Counting(a), 600, max_hvps=budget, rtol=0.02, seed=3)
    assert out.stopped == "tolerance" and out.converged
    assert out.stderr <= 0.02 * abs(out.trace)
    assert abs(out.trace - truth) < 4 * out.stderr
    assert out.hvps > 500  # far more than an easy problem takes
    # An absolute tolerance alone stops it too.
    by_atol = estimator(Counting(a), 600, max_hvps=budget, atol=2.0, seed=3)
    assert by_atol.stopped == "tolerance" and by_atol.stderr <= 2.0


def test_hutchpp_limits(fake_clock) -> None:
    a = hard(120, seed=11)
    capped = hutchpp_trace(Counting(a), 120, max_hvps=50, rtol=1e-6)
    assert capped.stopped == "max_hvps" and capped.hvps == 50 and not capped.converged
    slow = hutchpp_trace(
        Counting(a, delay=0.02, clock=fake_clock), 120, max_hvps=10_000, rtol=1e-6, max_seconds=0.1
    )
    assert slow.stopped == "time_limit" and slow.hvps < 10_000
    # Q and AQ hold 16 n bytes a row, each probe n bytes: under a cap of 320 n bytes the
    # first round (16 rows, 16 probes: 272 n) fits, the second would not; the sketch
    # stops at 16 rows and the rest of the budget goes to probes.
    small = hutchpp_trace(Counting(a), 120, max_hvps=600, max_basis_bytes=320 * 120)
    assert small.sketch == 16 and small.hvps == 600 and small.samples == 600 - 32
    assert abs(small.trace - np.trace(a)) < 4 * small.stderr
    with pytest.raises(ValueError, match="at least 3"):
        hutchpp_trace(Counting(a), 120, max_hvps=2)
    with pytest.raises(ValueError, match="rtol must be positive"):
        hutchpp_trace(Counting(a), 120, rtol=0.0)


def test_hutchinson_diagonal() -> None:
    # Exact from the first probe on a diagonal matrix (z_i^2 = 1).
    # Its error is known (zero) only from MIN_STDERR_SAMPLES probes on.
    d = np.diag(np.arange(1.0, 51.0))
    few = hutchinson_diagonal(Counting(d), 50, batch_size=4, max_hvps=8, rtol=0.1)
    np.testing.assert_allclose(few.diagonal, np.arange(1.0, 51.0))
    assert few.error == math.inf and np.all(few.stderr == math.inf) and not few.converged
    out = hutchinson_diagonal(Counting(d), 50, batch_size=4, max_hvps=32)
    np.testing.assert_allclose(out.diagonal, np.arange(1.0, 51.0))
    assert out.error == pytest.approx(0.0, abs=1e-12)
    # Each entry within its own standard error; the per-entry error is what theory says:
    # Var(z_i (Az)_i) = sum_{j != i} A_ij^2.
    a = symmetric(80, seed=12)
    out = hutchinson_diagonal(Counting(a), 80, max_hvps=4000, seed=4)
    assert out.samples == out.hvps == 4000 and out.stopped == "max_hvps"
    z = (out.diagonal - np.diag(a)) / out.stderr
    assert np.all(np.abs(z) < 4.5) and 0.7 < z.std() < 1.3
    theory = np.sqrt((np.sum(a * a, axis=1) - np.diag(a) ** 2) / 4000)
    np.testing.assert_allclose(out.stderr, theory, rtol=0.15)
    assert out.error == pytest.approx(np.sqrt(np.mean(out.stderr**2)))


def test_hutchinson_diagonal_stops_early_on_an_easy_problem_and_reaches_a_hard_target(
    fake_clock,
) -> None:
    easy = np.diag(np.linspace(1.0, 2.0, 300)) + 0.002 * symmetric(300, seed=13)
    fast = hutchinson_diagonal(Counting(easy), 300, max_hvps=10_000, rtol=0.01)
    assert fast.stopped == "tolerance" and fast.hvps == 32
    a = symmetric(100, seed=14) + 2 * np.eye(100)
    out = hutchinson_diagonal(Counting(a), 100, max_hvps=100_000, rtol=0.02, seed=5)
    truth = np.diag(a)
    assert out.stopped == "tolerance" and out.hvps > 1000
    assert out.error <= 0.02 * np.sqrt(np.mean(out.diagonal**2))
    assert (
        np.sqrt(np.mean((out.diagonal - truth) ** 2)) < 2 * out.error
    )  # the reported error is the real one
    slow = hutchinson_diagonal(
        Counting(a, delay=0.02, clock=fake_clock), 100, max_hvps=10_000, rtol=1e-6, max_seconds=0.05
    )
    assert slow.stopped == "time_limit" and not slow.converged


# ---- Eigenvalues and eigenvectors --------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (6, 3), (60, 4)])
def test_power_iteration_matches_eigh(n: int, k: int) -> None:
    rng = np.random.default_rng(n)
    # Magnitudes well separated at the top (power iteration converges at |l_k+1 / l_k|),
    # signs mixed: power iteration answers by magnitude.
    spectrum = np.concatenate(
        [[12.0, -8.0, 5.0, -3.0][: min(n, 4)], rng.uniform(-1, 1, max(0, n - 4))]
    )
    a = symmetric(n, seed=n, spectrum=spectrum)
    values, vectors = np.linalg.eigh(a)
    order = np.argsort(-np.abs(values))[:k]
    matvec = Counting(a)
    out = power_iteration(matvec, n, k=k, tol=1e-10, eigenvectors=True, max_hvps=20_000)
    assert out.stopped == "converged" and out.converged
    np.testing.assert_allclose(out.eigenvalues, values[order], rtol=1e-9, atol=1e-12)
    assert out.hvps == matvec.vectors and matvec.calls == out.iterations
    reference = vectors[:, order].T
    np.testing.assert_allclose(sign_aligned(out.eigenvectors, reference), reference, atol=1e-6)
    assert np.all(out.residuals <= 1e-10 * 12)


def test_power_iteration_deflates_converged_vectors(fake_clock) -> None:
    # The top eigenvalue converges fast (|5 / 100|), the second slowly (|4.5 / 5|): once
    # the first is locked, each step costs one HVP, not two.
    spectrum = np.concatenate([[100.0, 5.0, 4.5], np.linspace(-1, 1, 97)])
    a = symmetric(100, seed=15, spectrum=spectrum)
    matvec = Counting(a)
    out = power_iteration(matvec, 100, k=2, tol=1e-8, max_hvps=5000)
    assert out.stopped == "converged"
    np.testing.assert_allclose(out.eigenvalues, [100.0, 5.0], rtol=1e-8)
    assert out.hvps < 2 * out.iterations - 20  # many steps ran with the first one locked
    capped = power_iteration(Counting(a), 100, k=2, tol=1e-14, max_hvps=30)
    assert capped.stopped == "max_hvps" and not capped.converged and capped.hvps <= 30
    assert len(capped.eigenvalues) == 2
    slow = power_iteration(
        Counting(a, delay=0.02, clock=fake_clock), 100, k=2, tol=1e-14, max_seconds=0.05
    )
    assert slow.stopped == "time_limit"
    with pytest.raises(ValueError, match="k must be between 1 and n = 100"):
        power_iteration(Counting(a), 100, k=101)


def test_lanczos_eigenvectors_match_eigh_up_to_sign() -> None:
    spectrum = np.concatenate([[9.0, 7.0, 4.0], np.linspace(-2, 2, 77)])
    a = symmetric(80, seed=16, spectrum=spectrum)
    values, vectors = np.linalg.eigh(a)
    out = lanczos(Counting(a), 80, k=3, tol=1e-12, eigenvectors=True)
    reference = vectors[:, ::-1][:, :3].T
    np.testing.assert_allclose(out.eigenvalues, values[::-1][:3], rtol=1e-10)
    np.testing.assert_allclose(sign_aligned(out.eigenvectors, reference), reference, atol=1e-7)


# ---- Spectral density ----------------------------------------------------------------------


def test_slq_quadrature_reproduces_the_moments() -> None:
    # For a diagonal A and a Rademacher probe v/sqrt(n), v^T A^p v = tr(A^p) / n, and a
    # m-step quadrature is exact for p < 2m: every probe's nodes and weights give the
    # moments of the exact eigenvalues to rounding.
    eigenvalues = np.random.default_rng(17).uniform(-2, 3, 150)
    a = np.diag(eigenvalues)
    out = spectral_density(Counting(a), 150, probes=4, steps=6)
    assert out.probes == 4 and out.stopped == "complete" and out.hvps == 24
    for theta, tau in zip(out.nodes, out.weights, strict=True):
        assert len(theta) == 6 and tau.sum() == pytest.approx(1.0)
        for p in range(12):
            assert np.sum(tau * theta**p) == pytest.approx(np.mean(eigenvalues**p), rel=1e-9)


def test_slq_ends_a_probe_in_an_invariant_subspace() -> None:
    # Three distinct eigenvalues: each probe's Krylov space closes after three steps and
    # its quadrature is the exact distribution (weights = multiplicities / n).
    a = symmetric(60, seed=18, spectrum=np.repeat([-1.0, 2.0, 5.0], [10, 20, 30]))
    out = spectral_density(Counting(a), 60, probes=3, steps=20)
    assert out.stopped == "complete" and out.hvps == 9
    for theta, tau in zip(out.nodes, out.weights, strict=True):
        np.testing.assert_allclose(theta, [-1.0, 2.0, 5.0], atol=1e-9)
        assert np.all(tau > 0)
    assert out.density.shape == out.grid.shape == (256,)


def test_slq_density_matches_the_exact_eigenvalues() -> None:
    # A spectrum with a bulk and outliers, as Hessians have.
    rng = np.random.default_rng(19)
    eigenvalues = np.concatenate(
        [rng.normal(0.0, 1.0, 280), [8.0, 9.0, 12.0], rng.uniform(-4, -3, 17)]
    )
    n = len(eigenvalues)
    a = symmetric(n, seed=19, spectrum=eigenvalues)
    sigma = 0.4
    matvec = Counting(a)
    out = spectral_density(matvec, n, probes=16, steps=50, sigma=sigma, points=400)
    assert out.hvps == matvec.vectors == 16 * 50 and matvec.calls == 50  # side by side
    assert out.sigma == sigma and np.trapezoid(out.density, out.grid) == pytest.approx(1, abs=1e-3)
    assert out.grid[0] <= eigenvalues.min() and out.grid[-1] >= eigenvalues.max()
    z = (out.grid[:, None] - eigenvalues[None, :]) / sigma
    exact = np.exp(-0.5 * z**2).sum(axis=1) / (n * sigma * math.sqrt(2 * math.pi))
    assert np.trapezoid(np.abs(out.density - exact), out.grid) < 0.08
    assert np.max(np.abs(out.density - exact)) < 5 * np.max(out.stderr) + 1e-3
    # Against the histogram of the exact eigenvalues: the mass in each unit bin.
    edges = np.arange(-5.0, 14.0)
    counts = np.histogram(eigenvalues, edges)[0] / n
    fine = np.linspace(-5.0, 13.0, 4000)
    smoothed = np.interp(fine, out.grid, out.density, left=0.0, right=0.0)
    mass = [
        np.trapezoid(smoothed[(fine >= lo) & (fine <= hi)], fine[(fine >= lo) & (fine <= hi)])
        for lo, hi in itertools.pairwise(edges)
    ]
    np.testing.assert_allclose(mass, counts, atol=0.05)
    # The mean of the weighted nodes is tr(A) / n within the probes' spread.
    means = [float(t @ w) for t, w in zip(out.nodes, out.weights, strict=True)]
    stderr = np.std(means, ddof=1) / math.sqrt(len(means))
    assert abs(np.mean(means) - eigenvalues.mean()) < 4 * stderr


def test_slq_limits(fake_clock) -> None:
    a = symmetric(100, seed=20)
    cut = spectral_density(Counting(a), 100, probes=4, steps=30, max_hvps=50)
    assert cut.stopped == "max_hvps" and cut.hvps == 50 and not cut.converged
    assert cut.probes == 4 and min(len(t) for t in cut.nodes) >= 12
    grouped = spectral_density(
        Counting(a), 100, probes=5, steps=10, max_basis_bytes=8 * 10 * 100 * 2
    )
    assert grouped.probes == 5 and grouped.hvps == 50  # two probes at a time fit
    with pytest.raises(ValueError, match="exceeds max_basis_bytes"):
        spectral_density(Counting(a), 100, steps=10, max_basis_bytes=100)
    slow = spectral_density(
        Counting(a, delay=0.02, clock=fake_clock), 100, probes=2, steps=50, max_seconds=0.05
    )
    assert slow.stopped == "time_limit" and slow.probes == 2
    grid = np.linspace(-10, 10, 11)
    np.testing.assert_array_equal(spectral_density(Counting(a), 100, grid=grid).grid, grid)


# ---- Progress and a real operator ----------------------------------------------------------


@pytest.mark.parametrize(
    "run",
    [
        lambda m, cb: exact_trace(m, 40, batch_size=8, callback=cb),
        lambda m, cb: hutchpp_trace(m, 40, batch_size=4, max_hvps=36, callback=cb),
        # ... and after Hutch++ hands over to the exact trace (3 rounds, one exact pass)
        lambda m, cb: hutchpp_trace(m, 40, batch_size=4, max_hvps=90, callback=cb),
        lambda m, cb: hutchinson_diagonal(m, 40, max_hvps=64, callback=cb),
        lambda m, cb: exact_diagonal(m, 40, batch_size=8, callback=cb),
        lambda m, cb: power_iteration(m, 40, k=2, max_hvps=40, callback=cb),
        lambda m, cb: spectral_density(m, 40, probes=3, steps=10, callback=cb),
    ],
)
def test_every_estimator_reports_progress(run) -> None:
    # A report after every pass, HVPs counted as they go, the last one the final count.
    seen: list[Progress] = []
    matvec = Counting(symmetric(40, seed=21))
    out = run(matvec, seen.append)
    assert len(seen) >= 2 and matvec.calls >= 2
    hvps = [p.hvps for p in seen]
    assert hvps == sorted(hvps) and hvps[-1] == out.hvps == matvec.vectors
    assert all(p.max_hvps is not None and p.hvps <= p.max_hvps for p in seen)
    assert all(p.seconds >= 0 for p in seen)


def test_estimators_on_a_hessian_operator() -> None:
    operator, h = mlp_operator()
    flat = FlatOperator(operator)
    tr = estimate_trace(flat.matvec, flat.n)
    assert tr.method == "exact" and tr.trace == pytest.approx(np.trace(h), rel=1e-12)
    diagonal = estimate_diagonal(flat.matvec, flat.n)
    np.testing.assert_allclose(diagonal.diagonal, np.diag(h), rtol=1e-12, atol=1e-14)
    parts = flat.structured(diagonal.diagonal)  # tensors in the primals' structure
    assert [p.shape for p in parts] == [(3, 4), (4,), (4, 2)]
    values, vectors = np.linalg.eigh(h)
    order = np.argsort(-np.abs(values))[:2]
    top = power_iteration(flat.matvec, flat.n, k=2, tol=1e-10, eigenvectors=True, max_hvps=20_000)
    np.testing.assert_allclose(top.eigenvalues, values[order], rtol=1e-8)
    reference = vectors[:, order].T
    np.testing.assert_allclose(sign_aligned(top.eigenvectors, reference), reference, atol=1e-5)
    plus = hutchpp_trace(flat.matvec, flat.n, batch_size=4, max_hvps=60, seed=1)
    assert abs(plus.trace - np.trace(h)) < 4 * plus.stderr + 1e-9
    density = spectral_density(flat.matvec, flat.n, probes=4, steps=24)
    for theta, tau in zip(density.nodes, density.weights, strict=True):
        # 24 steps span all 24 directions: the nodes are the eigenvalues themselves.
        assert theta.min() == pytest.approx(values.min(), abs=1e-8)
        assert theta.max() == pytest.approx(values.max(), abs=1e-8)
        assert tau.sum() == pytest.approx(1.0)


def test_estimators_on_a_gauss_newton_operator() -> None:
    # Nothing assumes the Hessian: G = J^T J of a small network's outputs (a JVP forward,
    # a VJP back, never forming J), with exact trace ||J||_F^2, diagonal the column norms
    # of J squared and top eigenvalue sigma_max(J)^2.
    rng = np.random.default_rng(22)
    x = gt.constant(rng.standard_normal((12, 5)))

    def outputs(w: gt.Tensor) -> gt.Tensor:
        return gt.tanh(x @ gt.reshape(w, (5, 3)))

    w = gt.constant(rng.standard_normal(15))
    _, pullback = gt.vjp(outputs, w)

    def ggn(vectors: np.ndarray) -> np.ndarray:
        rows = []
        for v in vectors:
            _, jv = gt.jvp(outputs, [w], [gt.constant(v)])
            rows.append(pullback(jv)[0].numpy())
        return np.stack(rows)

    j = gt.jacobian(outputs)(w).numpy().reshape(36, 15)
    g = j.T @ j
    assert estimate_trace(ggn, 15).trace == pytest.approx(np.sum(j * j), rel=1e-12)
    np.testing.assert_allclose(
        estimate_diagonal(ggn, 15).diagonal, np.sum(j * j, axis=0), rtol=1e-12
    )
    top = power_iteration(ggn, 15, k=1, tol=1e-10, max_hvps=5000)
    assert top.eigenvalues[0] == pytest.approx(np.linalg.svd(j, compute_uv=False)[0] ** 2, rel=1e-9)
    density = spectral_density(ggn, 15, probes=2, steps=15)
    for theta in density.nodes:
        assert theta.min() >= np.linalg.eigvalsh(g)[0] - 1e-9  # PSD: no negative nodes
