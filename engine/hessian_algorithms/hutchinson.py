"""The Hutchinson family, one loop: Rademacher probes z drawn `batch_size` at a time (one
batched matvec each), a quadratic form turning each (z, A z) into its sample, the running
mean and standard error, and the stopping rules (a tolerance on the standard error, the
HVP budget, the time limit) written once.

A `QuadraticForm` is what differs: tr(A) is the mean of z^T A z, diag(A) of z * (A z)
(elementwise), ||A||_F^2 = tr(A^2) of ||A z||^2. Hutch++ (trace.py) runs beside it: it
deflates a sketch first and shares the stopping rule (`tolerance_met`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.hessian_algorithms.budget import (
    Budget,
    Callback,
    Matvec,
    check_batch_size,
    check_operator,
    check_tolerance,
    rademacher,
)

# Samples a standard error needs before it is trusted, whatever the batch size. The
# sample std of a few probes is itself very noisy (from 3 samples it is off by a factor of
# 2 one time in five) and stopping on it picks the runs where it happened to come out
# small: with the old "two batches" rule and batch_size 1, 14.5% of runs stopped ~3 samples
# in, more than 4 (true) standard errors off, and two equal probes answered stderr 0,
# converged. From 30 samples the std is within ~25% nine times in ten and the rule's
# coverage is near nominal (tests/engine/test_estimators.py). Fewer samples: the standard
# error is unknown (inf), and no tolerance is met.
MIN_STDERR_SAMPLES = 30


def tolerance_met(stderr: float, estimate: float, rtol: float | None, atol: float) -> bool:
    """The stopping rule every stochastic estimator shares: stderr <= rtol |estimate| +
    atol, when a tolerance was given at all (and the stderr is known: finite)."""
    if rtol is None and atol == 0:
        return False
    return math.isfinite(stderr) and stderr <= (rtol or 0.0) * abs(estimate) + atol


def sample_stderr(values: np.ndarray) -> float:
    """The standard error of the mean of i.i.d. samples; inf (unknown) from fewer than
    MIN_STDERR_SAMPLES."""
    if len(values) < MIN_STDERR_SAMPLES:
        return math.inf
    return float(values.std(ddof=1) / math.sqrt(len(values)))


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


@dataclass(frozen=True)
class QuadraticForm:
    """What one probe contributes: `sample(z, az)` maps a batch of probes (K, n) and their
    products to the samples (K, m) whose mean is the estimate (m = 1: a number; m = n: a
    vector, whose error is the root-mean-square of its entries' standard errors,
    measured against the root-mean-square of the estimate)."""

    name: str  # the Progress's algorithm
    sample: Callable[[np.ndarray, np.ndarray], np.ndarray]
    scalar: bool  # m = 1: the samples are kept (a few floats each) and reported


TRACE = QuadraticForm(
    "hutchinson_trace", lambda z, az: np.einsum("kn,kn->k", z, az)[:, None], scalar=True
)
DIAGONAL = QuadraticForm("hutchinson_diagonal", lambda z, az: z * az, scalar=False)
# ||A||_F^2 = tr(A^T A) = E ||A z||^2: Hutchinson on A^2, from the same one product per probe.
FROBENIUS = QuadraticForm(
    "hutchinson_frobenius", lambda z, az: np.einsum("kn,kn->k", az, az)[:, None], scalar=True
)


@dataclass
class HutchinsonRun:
    """One run of the loop: the estimate (m entries) and each entry's standard error
    (inf until MIN_STDERR_SAMPLES probes), the error the tolerance was held to, and why
    it stopped (tolerance, max_hvps, time_limit)."""

    mean: np.ndarray
    stderr: np.ndarray
    error: float
    samples: int
    batches: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    values: np.ndarray  # a scalar form's samples, in order (empty for a vector form)


def hutchinson(
    matvec: Matvec,
    n: int,
    form: QuadraticForm,
    batch_size: int = 16,
    max_hvps: int = 1024,
    rtol: float | None = None,
    atol: float = 0.0,
    max_seconds: float | None = None,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> HutchinsonRun:
    """The mean of `form`'s samples over Rademacher probes, drawn `batch_size` at a time.

    Stops when the error (the standard error; a vector's rms standard error) is at most
    rtol * |estimate| (a vector's rms) + atol (when rtol or atol is given; from
    MIN_STDERR_SAMPLES probes on), at max_hvps probes or at max_seconds. `converged`
    says the tolerance was met (or, without one, that every probe asked for was drawn
    and a standard error is known). A vector form holds three running m-vectors
    (Welford's mean and sum of squares), whatever the number of probes.
    """
    check_operator(n, form.name)
    check_batch_size(batch_size)
    check_tolerance(rtol, atol)
    if max_hvps < 2:
        raise ValueError(
            f"max_hvps must be at least 2 (a standard error needs two samples), got {max_hvps}"
        )
    budget = Budget(max_hvps, max_seconds)
    rng = np.random.default_rng(seed)
    kept: list[np.ndarray] = []
    mean = np.zeros(0)
    squares = np.zeros(0)
    stderr = np.full(1, math.inf)
    error = math.inf
    count = batches = 0
    stopped = "max_hvps"
    tolerance = rtol is not None or atol > 0
    while count < max_hvps:
        size = min(batch_size, max_hvps - count)
        z = rademacher(rng, size, n)
        samples = form.sample(z, budget.apply(matvec, z))
        batches += 1
        if form.scalar:  # all samples kept: the mean and std as numpy takes them
            kept.append(samples[:, 0])
            count += size
            values = np.concatenate(kept)
            mean = np.array([values.mean()])
            stderr = np.array([sample_stderr(values)])
            error, scale = float(stderr[0]), abs(float(mean[0]))
            reported: object = float(mean[0])
        else:  # Welford's running mean and sum of squared deviations, per entry
            if not mean.size:
                mean, squares = np.zeros(samples.shape[1]), np.zeros(samples.shape[1])
                stderr = np.full(samples.shape[1], math.inf)
            batch_mean = samples.mean(axis=0)
            total = count + size
            delta = batch_mean - mean
            mean = mean + delta * (size / total)
            squares = squares + np.sum((samples - batch_mean) ** 2, axis=0)
            squares = squares + delta**2 * (count * size / total)
            count = total
            if count >= MIN_STDERR_SAMPLES:  # fewer: unknown (see MIN_STDERR_SAMPLES)
                stderr = np.sqrt(squares / (count - 1) / count)
                error = _rms(stderr)
            scale = _rms(mean)
            reported = None  # a whole vector: progress carries the relative error
        relative = error / scale if not form.scalar and scale > 0 else error
        budget.report(callback, form.name, reported, relative)
        if tolerance and tolerance_met(error, scale, rtol, atol):
            stopped = "tolerance"
            break
        if budget.out_of_time() and count < max_hvps:
            stopped = "time_limit"
            break
    return HutchinsonRun(
        mean=mean,
        stderr=stderr,
        error=error,
        samples=count,
        batches=batches,
        # without a tolerance: every sample asked for, and enough for a standard error
        converged=stopped == "tolerance"
        or (not tolerance and stopped == "max_hvps" and math.isfinite(error)),
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
        values=np.concatenate(kept) if kept else np.zeros(0),
    )
