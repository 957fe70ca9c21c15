"""The spectral density of a symmetric operator by stochastic Lanczos quadrature (SLQ;
Lin, Saad and Yang 2016; what PyHessian's `density` computes).

For a random unit vector v, m Lanczos steps from v give a tridiagonal T whose eigenvalues
theta_j (Ritz nodes) with weights tau_j = (first component of T's eigenvector j)^2 form
the m-point Gauss quadrature of v's spectral measure sum_i (v . u_i)^2 delta(t - lambda_i):
sum_j tau_j theta_j^p = v^T A^p v exactly for p < 2m. Over Rademacher probes the mean of
these measures is an unbiased estimate of the eigenvalue distribution (1/n) sum_i
delta(t - lambda_i); smoothed by a Gaussian of width sigma it is a density to plot.
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
    rademacher,
)
from engine.hessian_algorithms.eigen import tridiagonal


@dataclass
class DensityResult:
    """The smoothed eigenvalue density on `grid` (it integrates to 1 over the real line:
    multiply by n for eigenvalues per unit), its pointwise standard error across probes
    (None with one probe), and the raw quadrature: per probe its Ritz `nodes` and
    `weights` (each probe's weights sum to 1). `stopped`: complete (every probe ran its
    steps, or ended early in an invariant subspace, where its quadrature is exact),
    max_hvps, time_limit (the probes run so far, each with the steps it reached)."""

    grid: np.ndarray
    density: np.ndarray
    stderr: np.ndarray | None
    nodes: list[np.ndarray]
    weights: list[np.ndarray]
    sigma: float
    probes: int
    steps: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float


def spectral_density(
    matvec: Matvec,
    n: int,
    probes: int = 8,
    steps: int = 64,
    sigma: float | None = None,
    points: int = 256,
    grid: np.ndarray | None = None,
    batch_size: int | None = None,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    max_basis_bytes: int | None = None,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> DensityResult:
    """The eigenvalue density of A by SLQ: `probes` Rademacher start vectors, `steps`
    Lanczos steps each (at most n), with full reorthogonalization.

    The probes run side by side, `batch_size` of them (default: all) per batched pass,
    so a run takes about `steps` passes of `probes` HVPs (probes x steps HVPs in all,
    the default max_hvps). Each probe holds its basis (steps x n float64): when
    max_basis_bytes is given, fewer probes run at once to stay under it. The density is
    evaluated on `grid`, or on `points` points spanning the Ritz nodes +- 3 sigma;
    `sigma` defaults to the span of the nodes / steps (the resolution of a steps-point
    quadrature). Progress carries the number of probes finished as its estimate.
    """
    check_operator(n, "spectral_density")
    if probes < 1:
        raise ValueError(f"probes must be at least 1, got {probes}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if sigma is not None and not sigma > 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    if grid is None and points < 2:
        raise ValueError(f"points must be at least 2, got {points}")
    steps = min(steps, n)
    group = probes if batch_size is None else batch_size
    check_batch_size(group)
    if max_basis_bytes is not None:
        fits = max_basis_bytes // (8 * steps * n)
        if fits < 1:
            raise ValueError(
                f"spectral_density: one probe's Lanczos basis ({steps} x {n} float64, "
                f"{8 * steps * n:,} bytes) exceeds max_basis_bytes ({max_basis_bytes:,}); "
                "ask for fewer steps"
            )
        group = min(group, fits)
    group = min(group, probes)
    budget = Budget(probes * steps if max_hvps is None else max_hvps, max_seconds)
    rng = np.random.default_rng(seed)
    nodes: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    stopped = "complete"
    started = 0
    while started < probes and stopped == "complete":
        size = min(group, probes - started)
        started += size
        alpha, beta, lengths, stopped = _lanczos_side_by_side(
            matvec,
            n,
            rademacher(rng, size, n) / math.sqrt(n),
            steps,
            budget,
            lambda: budget.report(callback, "spectral_density", len(nodes), None),
        )
        for a, b, length in zip(alpha, beta, lengths, strict=True):
            if length == 0:
                continue
            theta, vectors = np.linalg.eigh(tridiagonal(list(a[:length]), list(b[: length - 1])))
            nodes.append(theta)
            weights.append(vectors[0] ** 2)
        budget.report(callback, "spectral_density", len(nodes), None)
    if not nodes:
        raise ValueError("spectral_density: the budget ended before the first Lanczos step")
    grid, sigma = _grid(nodes, steps, sigma, points, grid)
    per_probe = np.stack([_smooth(grid, t, w, sigma) for t, w in zip(nodes, weights, strict=True)])
    return DensityResult(
        grid=grid,
        density=per_probe.mean(axis=0),
        stderr=(per_probe.std(axis=0, ddof=1) / math.sqrt(len(nodes)) if len(nodes) > 1 else None),
        nodes=nodes,
        weights=weights,
        sigma=sigma,
        probes=len(nodes),
        steps=steps,
        converged=stopped == "complete",
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
    )


def _lanczos_side_by_side(
    matvec: Matvec,
    n: int,
    starts: np.ndarray,
    steps: int,
    budget: Budget,
    report: Callable[[], None] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Independent Lanczos recurrences from each row of `starts`, one batched pass of all
    the active ones per step, each fully reorthogonalized against its own basis. A
    recurrence ends at `steps`, or early when its Krylov space closes (an invariant
    subspace: its quadrature is then exact). Returns alpha, beta (g, steps), the steps
    each made, and why the group stopped."""
    g = len(starts)
    basis = np.empty((g, steps, n))
    basis[:, 0] = starts
    alpha = np.zeros((g, steps))
    beta = np.zeros((g, steps))
    lengths = np.zeros(g, dtype=int)
    scale = np.zeros(g)
    active = np.arange(g)
    stopped = "complete"
    for j in range(steps):
        left = budget.left()
        if left is not None and left < len(active):
            stopped = "max_hvps"
            active = active[: max(left, 0)]  # the budget's last HVPs go to the first ones
        if not len(active):
            break
        current = basis[active, j]
        w = budget.apply(matvec, current)
        a = np.einsum("gn,gn->g", w, current)
        alpha[active, j] = a
        lengths[active] = j + 1
        if j == steps - 1:
            break
        w -= a[:, None] * current
        if j > 0:
            w -= beta[active, j - 1][:, None] * basis[active, j - 1]
        # (a view while every recurrence goes on; fancy indexing copies)
        held = basis[:, : j + 1] if len(active) == g else basis[active, : j + 1]
        for _ in range(2):  # full reorthogonalization, twice (see budget.orthogonalize)
            w -= np.einsum("gm,gmn->gn", np.einsum("gmn,gn->gm", held, w), held)
        b = np.linalg.norm(w, axis=1)
        previous = beta[active, j - 1] if j > 0 else 0.0
        scale[active] = np.maximum(scale[active], np.abs(a) + b + previous)
        going = b > 1e-10 * np.maximum(scale[active], np.finfo(float).tiny)
        beta[active[going], j] = b[going]
        basis[active[going], j + 1] = w[going] / b[going][:, None]
        active = active[going]
        if report is not None:
            report()
        if stopped != "complete":
            break
        if budget.out_of_time() and len(active):
            stopped = "time_limit"
            break
    return alpha, beta, lengths, stopped


def _grid(
    nodes: list[np.ndarray], steps: int, sigma: float | None, points: int, grid: np.ndarray | None
) -> tuple[np.ndarray, float]:
    low = min(float(t.min()) for t in nodes)
    high = max(float(t.max()) for t in nodes)
    if sigma is None:
        span = high - low
        sigma = span / steps if span > 0 else max(abs(high), 1.0) * 1e-2
    if grid is None:
        grid = np.linspace(low - 3 * sigma, high + 3 * sigma, points)
    return np.asarray(grid, dtype=np.float64), float(sigma)


def _smooth(grid: np.ndarray, theta: np.ndarray, tau: np.ndarray, sigma: float) -> np.ndarray:
    """sum_j tau_j N(grid; theta_j, sigma^2): a quadrature smoothed into a density."""
    out = np.empty(len(grid))
    rows = max(1, (1 << 20) // max(len(theta), 1))  # bounds the grid x nodes temporaries
    for start in range(0, len(grid), rows):
        z = (grid[start : start + rows, None] - theta[None, :]) / sigma
        out[start : start + rows] = np.exp(-0.5 * z * z) @ tau
    return out / (sigma * math.sqrt(2 * math.pi))
