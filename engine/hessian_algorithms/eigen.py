"""Extreme eigenvalues (and eigenvectors) of a symmetric operator: Lanczos with full
reorthogonalization, and deflated block power iteration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.hessian_algorithms.budget import (
    Budget,
    Callback,
    Matvec,
    check_operator,
    orthogonalize,
)

WHICH = ("LA", "LM", "SA")  # largest algebraic, largest magnitude, smallest algebraic


@dataclass
class EigenResult:
    """Ritz values (sorted as `which` asks), their residual norms ||H y - theta y||
    (estimates from the recurrence), and the Ritz vectors (k, n) when asked."""

    eigenvalues: np.ndarray
    residuals: np.ndarray
    eigenvectors: np.ndarray | None
    converged: bool
    stopped: str  # converged, exhausted (the whole space was spanned), max_hvps, time_limit
    iterations: int
    hvps: int
    seconds: float


def _pick(theta: np.ndarray, k: int, which: str) -> np.ndarray:
    if which == "LA":
        order = np.argsort(-theta, kind="stable")
    elif which == "SA":
        order = np.argsort(theta, kind="stable")
    else:
        order = np.argsort(-np.abs(theta), kind="stable")
    return order[:k]


def tridiagonal(alpha: list[float], beta: list[float]) -> np.ndarray:
    m = len(alpha)
    t = np.diag(np.asarray(alpha, dtype=np.float64))
    if m > 1:
        off = np.asarray(beta[: m - 1], dtype=np.float64)
        t[np.arange(m - 1), np.arange(1, m)] = off
        t[np.arange(1, m), np.arange(m - 1)] = off
    return t


class _Rows:
    """The Lanczos basis: rows of n float64, grown by doubling up to `limit` rows (so a
    run that converges early never holds the whole limit)."""

    def __init__(self, n: int, limit: int):
        self.limit = limit
        self.data = np.empty((min(limit, 16), n))
        self.count = 0

    def append(self, row: np.ndarray) -> None:
        if self.count == len(self.data):
            grown = np.empty((min(self.limit, 2 * len(self.data)), self.data.shape[1]))
            grown[: self.count] = self.data[: self.count]
            self.data = grown
        self.data[self.count] = row
        self.count += 1

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            return self.data[: self.count][index]
        if not 0 <= index < self.count:
            raise IndexError(index)
        return self.data[index]


def lanczos(
    matvec: Matvec,
    n: int,
    k: int = 1,
    which: str = "LA",
    tol: float = 1e-6,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    eigenvectors: bool = False,
    seed: int | None = 0,
    max_basis_bytes: int | None = None,
    callback: Callback | None = None,
) -> EigenResult:
    """The k eigenvalues of the symmetric H (n x n) that `which` asks for: "LA" largest
    algebraic, "LM" largest magnitude, "SA" smallest algebraic.

    Lanczos with full reorthogonalization from a random start (`seed`), one HVP per
    iteration. Converged when the k Ritz values' residuals are at most
    tol * max |theta|. Stops early at max_hvps (default n), max_seconds, or when the
    basis (iterations x n float64) would exceed max_basis_bytes. `callback` gets the
    current Ritz values and residuals whenever they are computed (else the HVP count). When the Krylov space
    closes (an invariant subspace) it restarts with a random vector orthogonal to it, so
    every eigenvalue can be reached; a repeated eigenvalue is found with its
    multiplicity only once such a restart reaches its other eigenvectors.
    """
    if which not in WHICH:
        raise ValueError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    check_operator(n, "lanczos")
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and n = {n}, got {k}")
    budget = Budget(max_hvps, max_seconds)
    budget.max_hvps = n if max_hvps is None else min(n, max_hvps)  # reported of these
    steps = n if max_hvps is None else min(n, max_hvps)
    if max_basis_bytes is not None:
        steps = min(steps, max(1, max_basis_bytes // (8 * n)))
    if steps < k:
        raise ValueError(
            f"lanczos: {k} eigenvalues need at least {k} HVPs; the limits allow {steps} "
            "(max_hvps, or the memory of the basis of n-vectors)"
        )
    rng = np.random.default_rng(seed)
    basis = _Rows(n, steps)
    alpha: list[float] = []
    beta: list[float] = []
    q = rng.standard_normal(n)
    basis.append(q / np.linalg.norm(q))
    scale = 0.0  # running estimate of ||H||, for the breakdown and convergence tests
    theta = s = picked = None
    stopped = "max_hvps"
    m = 0
    last_b = 0.0  # the coupling to the next Lanczos vector: residual = last_b * |s[-1]|
    for j in range(steps):
        w = budget.apply(matvec, basis[j][None, :])[0]
        a = float(basis[j] @ w)
        w = w - a * basis[j]
        if j > 0:
            w = w - beta[j - 1] * basis[j - 1]
        w = orthogonalize(w, basis[: j + 1])
        b = float(np.linalg.norm(w))
        alpha.append(a)
        m = j + 1
        scale = max(scale, abs(a) + b + (beta[j - 1] if j else 0.0))
        breakdown = b <= 1e-10 * max(scale, np.finfo(float).tiny)
        last_b = 0.0 if breakdown else b
        exhausted = m == n
        out_of_time = budget.out_of_time()
        if m >= k and (
            exhausted
            or m == steps
            or out_of_time
            or breakdown
            or m <= 64
            or m % max(1, m // 16) == 0
        ):
            # The Ritz values: eigenvalues of the tridiagonal T_m (checked every step
            # while m is small, then every m/16 steps, as eigh costs O(m^3)).
            theta, s = np.linalg.eigh(tridiagonal(alpha, beta))
            picked = _pick(theta, k, which)
            top = max(float(np.max(np.abs(theta))), np.finfo(float).tiny)
            budget.report(callback, "lanczos", theta[picked], last_b * np.abs(s[-1, picked]))
            if not exhausted and np.all(last_b * np.abs(s[-1, picked]) <= tol * top):
                stopped = "converged"
                break
        elif callback is not None:
            ritz = None if picked is None else theta[picked]  # type: ignore[index]  # set with picked
            budget.report(callback, "lanczos", ritz, None)
        if exhausted:
            stopped = "exhausted"
            break
        if out_of_time:
            stopped = "time_limit"
            break
        if m == steps:
            break
        if breakdown:
            # An invariant subspace: go on in its orthogonal complement.
            r = orthogonalize(rng.standard_normal(n), basis[:m])
            norm = float(np.linalg.norm(r))
            if norm <= 1e-10 * math.sqrt(n):
                stopped = "exhausted"
                break
            beta.append(0.0)
            basis.append(r / norm)
        else:
            beta.append(b)
            basis.append(w / b)
    if theta is None or len(theta) != m:
        theta, s = np.linalg.eigh(tridiagonal(alpha, beta))
        picked = _pick(theta, min(k, m), which)
    assert s is not None and picked is not None
    residuals = (0.0 if stopped == "exhausted" else last_b) * np.abs(s[-1, picked])
    vectors = None
    if eigenvectors:
        vectors = s[:, picked].T @ basis[:m]
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return EigenResult(
        eigenvalues=theta[picked],
        residuals=residuals,
        eigenvectors=vectors,
        converged=stopped in ("converged", "exhausted"),
        stopped=stopped,
        iterations=m,
        hvps=budget.hvps,
        seconds=budget.seconds,
    )


# ----------------------------------------------------------------------------------------
# Deflated power iteration
# ----------------------------------------------------------------------------------------


def _orthonormal_rows(w: np.ndarray, against: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Orthonormal rows spanning w's rows less their part along `against` (orthonormal
    rows); a row that vanishes there (A has fewer directions left than rows) is replaced
    by a random direction, so the block keeps its size."""
    n = w.shape[1]
    for _ in range(3):
        w = orthogonalize(w, against) if len(against) else w
        q, r = np.linalg.qr(w.T)
        scale = max(float(np.max(np.abs(np.diag(r)), initial=0.0)), np.finfo(float).tiny)
        weak = np.abs(np.diag(r)) <= 1e-10 * scale
        if not weak.any():
            return q.T
        w = q.T.copy()
        w[weak] = rng.standard_normal((int(weak.sum()), n))
        against_all = np.concatenate([against, w[~weak]]) if len(against) else w[~weak]
        w[weak] = orthogonalize(w[weak], against_all) if len(against_all) else w[weak]
    return np.linalg.qr(w.T)[0].T


def power_iteration(
    matvec: Matvec,
    n: int,
    k: int = 1,
    tol: float = 1e-6,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    eigenvectors: bool = False,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> EigenResult:
    """The k eigenvalues of largest magnitude of the symmetric A (n x n), by deflated
    power iteration (what hessian-eigenthings and PyHessian run), batched.

    The k vectors are iterated together, one batched pass of k HVPs a step (block power
    iteration with a Rayleigh-Ritz rotation: the i-th converges at the rate
    |lambda_{k+1} / lambda_i|, no slower than one at a time). A Ritz pair whose residual
    ||A y - theta y|| is at most tol * max |theta| is locked, in order of magnitude:
    it leaves the block (no more HVPs are spent on it) and the rest is kept orthogonal
    to it, i.e. iterates on A deflated by the converged eigenvectors. Stops when all k
    are locked, at max_hvps (default 1000 per eigenvalue) or at max_seconds; slower
    than Lanczos when eigenvalues cluster, but it needs no basis beyond the k vectors.
    """
    check_operator(n, "power_iteration")
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and n = {n}, got {k}")
    if max_hvps is None:
        max_hvps = 1000 * k
    if max_hvps < k:
        raise ValueError(
            f"power_iteration: {k} eigenvalues need at least {k} HVPs a step; "
            f"max_hvps is {max_hvps}"
        )
    budget = Budget(max_hvps, max_seconds)
    rng = np.random.default_rng(seed)
    block = _orthonormal_rows(rng.standard_normal((k, n)), np.zeros((0, n)), rng)
    locked_values: list[float] = []
    locked_residuals: list[float] = []
    locked_vectors = np.zeros((0, n))
    theta = residuals = ritz = np.zeros(0)
    scale = 0.0
    iterations = 0
    stopped = "max_hvps"
    while True:
        left = budget.left()
        if left is not None and left < len(block):
            break
        products = budget.apply(matvec, block)
        iterations += 1
        # Rayleigh-Ritz on the block: the best approximations the block's span holds.
        small = block @ products.T
        theta, rotation = np.linalg.eigh((small + small.T) / 2)
        order = np.argsort(-np.abs(theta), kind="stable")
        theta, rotation = theta[order], rotation[:, order]
        ritz = rotation.T @ block
        images = rotation.T @ products
        residuals = np.linalg.norm(images - theta[:, None] * ritz, axis=1)
        scale = max(
            scale,
            float(np.max(np.abs(theta), initial=0.0)),
            max((abs(v) for v in locked_values), default=0.0),
        )
        done = 0
        while done < len(theta) and residuals[done] <= tol * max(scale, np.finfo(float).tiny):
            done += 1
        if done:
            locked_values.extend(float(v) for v in theta[:done])
            locked_residuals.extend(float(r) for r in residuals[:done])
            locked_vectors = np.concatenate([locked_vectors, ritz[:done]])
            theta, residuals, ritz, images = (
                theta[done:],
                residuals[done:],
                ritz[done:],
                images[done:],
            )
        budget.report(
            callback,
            "power_iteration",
            np.asarray(locked_values + [float(v) for v in theta]),
            np.asarray(locked_residuals + [float(r) for r in residuals]),
        )
        if len(locked_values) == k:
            stopped = "converged"
            break
        if budget.out_of_time():
            stopped = "time_limit"
            break
        # The power step, deflated: A y for the unconverged Ritz vectors, less their
        # parts along the locked eigenvectors.
        block = _orthonormal_rows(images, locked_vectors, rng)
    values = np.asarray(locked_values + [float(v) for v in theta])
    errors = np.asarray(locked_residuals + [float(r) for r in residuals])
    vectors = np.concatenate([locked_vectors, ritz]) if len(ritz) else locked_vectors
    # Locked pairs came in order of magnitude per step; the final order is by magnitude.
    order = np.argsort(-np.abs(values), kind="stable")
    return EigenResult(
        eigenvalues=values[order],
        residuals=errors[order],
        eigenvectors=vectors[order] if eigenvectors else None,
        converged=stopped == "converged",
        stopped=stopped,
        iterations=iterations,
        hvps=budget.hvps,
        seconds=budget.seconds,
    )
