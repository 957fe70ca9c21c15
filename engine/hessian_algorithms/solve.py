"""Solving (A + damping I) x = b by conjugate gradient on a symmetric operator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.hessian_algorithms.budget import Budget, Callback, Matvec


@dataclass
class SolveResult:
    """x with (H + damping I) x ~ b; `residuals` is ||b - (H + damping I) x|| / ||b||
    after each iteration (the first entry is for x = 0)."""

    x: np.ndarray
    converged: bool
    stopped: str  # converged, max_iterations, max_hvps, time_limit, negative_curvature
    iterations: int
    hvps: int
    residuals: list[float]
    seconds: float


def conjugate_gradient(
    matvec: Matvec,
    b: np.ndarray,
    damping: float = 0.0,
    tol: float = 1e-6,
    max_iterations: int | None = None,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    callback: Callback | None = None,
    preconditioner: Callable[[np.ndarray], np.ndarray] | None = None,
) -> SolveResult:
    """Solve (H + damping I) x = b by conjugate gradient from x = 0, one HVP per
    iteration. Converged when ||residual|| <= tol * ||b||. `preconditioner`: z = M^-1 r
    for a symmetric positive definite M close to H + damping I (a damped KFAC inverse):
    preconditioned CG, the same stopping rule on the unpreconditioned residual.

    CG needs H + damping I positive definite along the directions it explores: when a
    direction of non-positive curvature appears (a non-convex loss, too little damping)
    it stops with `stopped = "negative_curvature"` and the iterate so far (zero if it
    was the first direction); raise the damping.
    """
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    n = b.size
    if damping < 0:
        raise ValueError(f"damping must be non-negative, got {damping}")
    budget = Budget(max_hvps, max_seconds)
    limit = max_iterations if max_iterations is not None else max(n, 1) * 2
    x = np.zeros(n)
    b_norm = float(np.linalg.norm(b))
    residuals = [1.0 if b_norm > 0 else 0.0]
    if b_norm == 0.0:
        return SolveResult(x, True, "converged", 0, 0, residuals, budget.seconds)

    def precondition(v: np.ndarray) -> np.ndarray:
        return v if preconditioner is None else np.asarray(preconditioner(v), np.float64)

    r = b.copy()
    z = precondition(r)
    p = z.copy()
    rs = float(r @ z)
    stopped = "max_iterations"
    iterations = 0
    while iterations < limit:
        left = budget.left()
        if left is not None and left < 1:
            stopped = "max_hvps"
            break
        if budget.out_of_time():
            stopped = "time_limit"
            break
        ap = budget.apply(matvec, p[None, :])[0] + damping * p
        curvature = float(p @ ap)
        if curvature <= 1e-14 * float(p @ p) * max(1.0, damping):
            stopped = "negative_curvature"
            break
        step = rs / curvature
        x = x + step * p
        r = r - step * ap
        iterations += 1
        r_norm = float(np.linalg.norm(r))
        residuals.append(r_norm / b_norm)
        budget.report(callback, "conjugate_gradient", None, residuals[-1])
        if r_norm <= tol * b_norm:
            stopped = "converged"
            break
        z = precondition(r)
        rs_new = float(r @ z)
        p = z + (rs_new / rs) * p
        rs = rs_new
    return SolveResult(
        x=x,
        converged=stopped == "converged",
        stopped=stopped,
        iterations=iterations,
        hvps=budget.hvps,
        residuals=residuals,
        seconds=budget.seconds,
    )
