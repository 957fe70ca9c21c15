"""The diagonal of a symmetric operator: exact (unit vectors, in batched passes) or
Hutchinson's estimate (the mean of z * A z over Rademacher z) with a standard error per
entry and a stopping rule on it.

`estimate_diagonal(..., method="auto")` is the entry point: exact when the HVP budget
covers the n HVPs it needs, else Hutchinson.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.hessian_algorithms.budget import (
    Budget,
    Callback,
    Matvec,
    check_batch_size,
    check_operator,
    diagonal_entries,
)
from engine.hessian_algorithms.hutchinson import DIAGONAL, hutchinson
from engine.hessian_algorithms.trace import exact_pass_size

DIAGONAL_METHODS = ("auto", "exact", "hutchinson")


@dataclass
class DiagonalResult:
    """diag(A) (n,) and its standard error per entry (zeros when exact).

    `samples`: probes drawn (hutchinson) or unit vectors visited (exact). `error` is the
    root-mean-square standard error over the entries (what the stopping rule compares).
    An exact run stopped by max_seconds leaves the entries it did not reach NaN, and
    `stderr` infinite there. `stopped`: exhausted (exact), tolerance, max_hvps,
    time_limit."""

    diagonal: np.ndarray
    stderr: np.ndarray
    error: float
    samples: int
    batches: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    method: str


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def exact_diagonal(
    matvec: Matvec,
    n: int,
    batch_size: int | None = None,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    callback: Callback | None = None,
) -> DiagonalResult:
    """diag(A)_i = (A e_i)_i from the n unit vectors, `batch_size` per pass (default:
    exact_pass_size(n): one pass up to 64 parameters): n HVPs, no error. max_hvps below
    n is an error; a run stopped by max_seconds answers the entries it reached (NaN
    elsewhere). Progress carries the fraction of entries done as its estimate."""
    check_operator(n, "exact_diagonal")
    batch_size = exact_pass_size(n) if batch_size is None else batch_size
    check_batch_size(batch_size)
    if max_hvps is not None and max_hvps < n:
        raise ValueError(
            f"exact_diagonal: the exact diagonal takes n = {n} HVPs; max_hvps "
            f"is {max_hvps} (raise it, or use hutchinson)"
        )
    budget = Budget(n if max_hvps is None else max_hvps, max_seconds)
    diagonal = np.full(n, np.nan)
    done = batches = 0
    stopped = "exhausted"
    while done < n:
        rows = np.arange(done, min(n, done + batch_size))
        diagonal[rows] = diagonal_entries(matvec, n, rows, budget)
        done += len(rows)
        batches += 1
        budget.report(callback, "exact_diagonal", done / n, None)
        if done < n and budget.out_of_time():
            stopped = "time_limit"
            break
    stderr = np.zeros(n)
    stderr[done:] = np.inf
    return DiagonalResult(
        diagonal=diagonal,
        stderr=stderr,
        error=0.0 if done == n else math.inf,
        samples=done,
        batches=batches,
        converged=done == n,
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
        method="exact",
    )


def hutchinson_diagonal(
    matvec: Matvec,
    n: int,
    batch_size: int = 16,
    max_hvps: int = 1024,
    rtol: float | None = None,
    atol: float = 0.0,
    max_seconds: float | None = None,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> DiagonalResult:
    """diag(A) ~ mean of z * (A z) (elementwise) over Rademacher z, drawn `batch_size` at a
    time; each entry's standard error is its samples' std / sqrt(N) (the variance of
    entry i is sum_{j != i} A_ij^2: a diagonal A is exact from one probe).

    Stops when the root-mean-square standard error is at most rtol * rms(diagonal) + atol
    (when rtol or atol is given; from MIN_STDERR_SAMPLES probes on: before that the
    standard errors are unknown, inf), at max_hvps probes or at max_seconds. Holds three
    n-vectors (running sums), whatever the number of probes.
    Progress carries the relative error rms(stderr) / rms(diagonal).
    """
    run = hutchinson(
        matvec, n, DIAGONAL, batch_size, max_hvps, rtol, atol, max_seconds, seed, callback
    )
    return DiagonalResult(
        diagonal=run.mean if run.mean.size else np.zeros(n),
        stderr=run.stderr if run.stderr.size == n else np.full(n, np.inf),
        error=run.error,
        samples=run.samples,
        batches=run.batches,
        converged=run.converged,
        stopped=run.stopped,
        hvps=run.hvps,
        seconds=run.seconds,
        method="hutchinson",
    )


def choose_diagonal_method(method: str, n: int, max_hvps: int) -> str:
    """auto -> exact when the budget covers its n HVPs, else hutchinson."""
    if method not in DIAGONAL_METHODS:
        raise ValueError(f"method must be one of {', '.join(DIAGONAL_METHODS)}, got {method!r}")
    if method == "auto":
        return "exact" if n <= max_hvps else "hutchinson"
    return method


def estimate_diagonal(
    matvec: Matvec,
    n: int,
    method: str = "auto",
    batch_size: int = 16,
    max_hvps: int = 1024,
    rtol: float | None = None,
    atol: float = 0.0,
    max_seconds: float | None = None,
    seed: int | None = 0,
    exact_batch_size: int | None = None,
    callback: Callback | None = None,
) -> DiagonalResult:
    """diag(A) by `method`: exact (n HVPs, `exact_batch_size` unit vectors a pass),
    hutchinson, or auto (exact when n <= max_hvps, else hutchinson)."""
    if choose_diagonal_method(method, n, max_hvps) == "exact":
        return exact_diagonal(
            matvec,
            n,
            batch_size=exact_batch_size,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            callback=callback,
        )
    return hutchinson_diagonal(
        matvec,
        n,
        batch_size=batch_size,
        max_hvps=max_hvps,
        rtol=rtol,
        atol=atol,
        max_seconds=max_seconds,
        seed=seed,
        callback=callback,
    )
