"""Algorithms made of Hessian-vector products: what PyHessian, scipy's trust-ncg and
influence-function code do with HVPs, run next to the recorded tape.

    op = gt.hessian_operator(loss_fn, w, b)           # forward + gradient recorded once
    flat = FlatOperator(op)                           # (K, n) float64 <-> the primals
    top = lanczos(flat.matvec, flat.n, k=3)           # top-3 eigenvalues of H
    tr = hutchinson_trace(flat.matvec, flat.n)        # tr(H) with a standard error
    step = conjugate_gradient(flat.matvec, flat.flatten(op.grad), damping=1e-3)

Each algorithm may report its progress to a `callback(Progress)` after every HVP pass
(HVPs used of the budget, the current estimate and its error, elapsed seconds): a host
relays it (the service's jobs) or stops the run by raising from it.

Each algorithm takes `matvec(V) -> H @ V` for a batch `V` of shape (K, n) (host NumPy,
float64): the shape of `HessianOperator.hvp_many` on flattened vectors, so K vectors
cost one batched second-order pass. Each stops at a limit on HVPs (`max_hvps`, counted
as vectors) and on seconds (`max_seconds`), says why it stopped (`stopped`), and
reports how many HVPs it used. The bookkeeping (orthogonalization, tridiagonal
eigenproblems, CG recurrences) runs in float64 on the host; only the HVPs run on the
operator's device and dtype.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import backend, tree
from engine.tensor import Tensor
from engine.transforms import HessianOperator

Matvec = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Progress:
    """Where a running algorithm stands: `hvps` used of at most `max_hvps` (None: no
    HVP limit), `estimate` (Ritz values, the trace, the relative residual: what the
    algorithm would answer now, None before there is one), its `error` (residuals, the
    standard error, the relative residual), and the seconds elapsed of `max_seconds`."""

    algorithm: str  # lanczos, hutchinson_trace, conjugate_gradient
    hvps: int
    max_hvps: int | None
    estimate: Any
    error: Any
    seconds: float
    max_seconds: float | None


Callback = Callable[[Progress], None]

WHICH = ("LA", "LM", "SA")  # largest algebraic, largest magnitude, smallest algebraic


# ----------------------------------------------------------------------------------------
# Flat vectors <-> a HessianOperator's primals
# ----------------------------------------------------------------------------------------


class FlatOperator:
    """A HessianOperator seen as an n x n matrix on flat float64 vectors.

    `matvec(V)` with V of shape (K, n) splits each row into the primals' shapes, casts
    to their dtype and device, runs one `hvp_many` pass and returns H @ V as (K, n)
    float64 on the host. `flatten` and `unflatten` convert single vectors.
    """

    def __init__(self, operator: HessianOperator):
        self.operator = operator
        self.primals: list[Tensor] = tree.flatten(operator.primals)[0]
        self._treedef = tree.flatten(operator.primals)[1]
        self.shapes = [tuple(p.shape) for p in self.primals]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes])
        self.n = int(self.offsets[-1])

    def matvec(self, vectors: np.ndarray) -> np.ndarray:
        """H @ V for V of shape (K, n), in one batched HVP pass."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.n:
            raise ValueError(f"matvec: expected shape (K, {self.n}), got {vectors.shape}")
        k = vectors.shape[0]
        parts = []
        for p, shape, lo, size in zip(
            self.primals, self.shapes, self.offsets[:-1], self.sizes, strict=True
        ):
            block = vectors[:, lo : lo + size].reshape((k, *shape))
            parts.append(Tensor(backend.asarray(block, p.dtype, p.device)))
        products = tree.flatten(self.operator.hvp_many(*tree.unflatten(self._treedef, parts)))[0]
        out = np.empty((k, self.n), dtype=np.float64)
        for product, lo, size in zip(products, self.offsets[:-1], self.sizes, strict=True):
            out[:, lo : lo + size] = product.numpy().reshape(k, size)
        return out

    def flatten(self, tensors: Any) -> np.ndarray:
        """One vector in the primals' structure (tensors or arrays) -> (n,) float64."""
        leaves = tree.flatten(tensors)[0]
        if len(leaves) != len(self.primals):
            raise ValueError(f"flatten: {len(leaves)} leaves for {len(self.primals)} primals")
        return np.concatenate(
            [np.asarray(backend.to_host(_raw(x)), np.float64).reshape(-1) for x in leaves]
        ) if leaves else np.zeros(0)

    def unflatten(self, x: np.ndarray) -> list[np.ndarray]:
        """(n,) -> one host array per primal, in the primal's shape and dtype."""
        x = np.asarray(x)
        return [
            x[lo : lo + size].reshape(shape).astype(p.dtype)
            for p, shape, lo, size in zip(
                self.primals, self.shapes, self.offsets[:-1], self.sizes, strict=True
            )
        ]


def _raw(x: Any) -> Any:
    return x.value if isinstance(x, Tensor) else x


class _Budget:
    """Counts HVPs and seconds against the limits."""

    def __init__(self, max_hvps: int | None, max_seconds: float | None):
        if max_hvps is not None and max_hvps < 1:
            raise ValueError(f"max_hvps must be at least 1, got {max_hvps}")
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds}")
        self.max_hvps = max_hvps
        self.max_seconds = max_seconds
        self.hvps = 0
        self.started = time.perf_counter()

    def left(self) -> int | None:
        return None if self.max_hvps is None else self.max_hvps - self.hvps

    def out_of_time(self) -> bool:
        return self.max_seconds is not None and self.seconds > self.max_seconds

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def report(self, callback: Callback | None, algorithm: str, estimate: Any, error: Any
               ) -> None:
        if callback is not None:
            callback(Progress(algorithm, self.hvps, self.max_hvps, estimate, error,
                              self.seconds, self.max_seconds))

    def apply(self, matvec: Matvec, vectors: np.ndarray) -> np.ndarray:
        out = np.asarray(matvec(vectors), dtype=np.float64)
        if out.shape != vectors.shape:
            raise ValueError(f"matvec returned shape {out.shape} for vectors of {vectors.shape}")
        self.hvps += vectors.shape[0]
        return out


# ----------------------------------------------------------------------------------------
# Lanczos: extreme eigenvalues
# ----------------------------------------------------------------------------------------


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


def _tridiagonal(alpha: list[float], beta: list[float]) -> np.ndarray:
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


def _orthogonalize(w: np.ndarray, basis: np.ndarray) -> np.ndarray:
    # Classical Gram-Schmidt, twice ("twice is enough", Giraud et al. 2005): full
    # reorthogonalization keeps the Lanczos vectors orthogonal to working precision, so
    # no spurious copies of converged eigenvalues appear.
    for _ in range(2):
        w = w - basis.T @ (basis @ w)
    return w


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
    if n < 1:
        raise ValueError("lanczos: the operator has no parameters")
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and n = {n}, got {k}")
    budget = _Budget(max_hvps, max_seconds)
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
        w = _orthogonalize(w, basis[: j + 1])
        b = float(np.linalg.norm(w))
        alpha.append(a)
        m = j + 1
        scale = max(scale, abs(a) + b + (beta[j - 1] if j else 0.0))
        breakdown = b <= 1e-10 * max(scale, np.finfo(float).tiny)
        last_b = 0.0 if breakdown else b
        exhausted = m == n
        out_of_time = budget.out_of_time()
        if m >= k and (exhausted or m == steps or out_of_time or breakdown or m <= 64
                       or m % max(1, m // 16) == 0):
            # The Ritz values: eigenvalues of the tridiagonal T_m (checked every step
            # while m is small, then every m/16 steps, as eigh costs O(m^3)).
            theta, s = np.linalg.eigh(_tridiagonal(alpha, beta))
            picked = _pick(theta, k, which)
            top = max(float(np.max(np.abs(theta))), np.finfo(float).tiny)
            budget.report(callback, "lanczos", theta[picked], last_b * np.abs(s[-1, picked]))
            if not exhausted and np.all(last_b * np.abs(s[-1, picked]) <= tol * top):
                stopped = "converged"
                break
        elif callback is not None:
            budget.report(callback, "lanczos", None if picked is None else theta[picked],
                          None)
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
            r = _orthogonalize(rng.standard_normal(n), basis[:m])
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
        theta, s = np.linalg.eigh(_tridiagonal(alpha, beta))
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
# Hutchinson: the trace
# ----------------------------------------------------------------------------------------


@dataclass
class TraceResult:
    """The Hutchinson estimate of tr(H), its standard error (sample std / sqrt(N)) and
    the per-sample values z^T H z."""

    trace: float
    stderr: float
    samples: int
    batches: int
    converged: bool
    stopped: str  # tolerance, max_hvps, time_limit
    hvps: int
    seconds: float
    values: np.ndarray = field(repr=False)


def hutchinson_trace(
    matvec: Matvec,
    n: int,
    batch_size: int = 16,
    max_hvps: int = 1024,
    rtol: float | None = None,
    atol: float = 0.0,
    max_seconds: float | None = None,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> TraceResult:
    """tr(H) ~ mean of z^T H z over Rademacher vectors z (entries +-1), drawn
    `batch_size` at a time (one batched HVP pass each).

    Stops when the standard error is at most rtol * |estimate| + atol (when rtol is
    given; at least two batches are taken), at max_hvps samples, or at max_seconds.
    `converged` says the tolerance was met (or, without rtol, that every sample asked
    for was taken).
    """
    if n < 1:
        raise ValueError("hutchinson_trace: the operator has no parameters")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if max_hvps < 2:
        raise ValueError(f"max_hvps must be at least 2 (a standard error needs two samples), "
                         f"got {max_hvps}")
    budget = _Budget(max_hvps, max_seconds)
    rng = np.random.default_rng(seed)
    values: list[np.ndarray] = []
    count = batches = 0
    mean, stderr = 0.0, math.inf
    stopped = "max_hvps"
    while count < max_hvps:
        size = min(batch_size, max_hvps - count)
        z = rng.integers(0, 2, size=(size, n)).astype(np.float64) * 2.0 - 1.0
        hz = budget.apply(matvec, z)
        values.append(np.einsum("kn,kn->k", z, hz))
        count += size
        batches += 1
        samples = np.concatenate(values)
        mean = float(samples.mean())
        stderr = float(samples.std(ddof=1) / math.sqrt(count)) if count > 1 else math.inf
        budget.report(callback, "hutchinson_trace", mean, stderr)
        if rtol is not None and batches >= 2 and stderr <= rtol * abs(mean) + atol:
            stopped = "tolerance"
            break
        if budget.out_of_time() and count < max_hvps:
            stopped = "time_limit"
            break
    converged = stopped == "tolerance" or (rtol is None and stopped == "max_hvps")
    return TraceResult(
        trace=mean,
        stderr=stderr,
        samples=count,
        batches=batches,
        converged=converged,
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
        values=np.concatenate(values) if values else np.zeros(0),
    )


# ----------------------------------------------------------------------------------------
# Conjugate gradient: (H + damping I) x = b
# ----------------------------------------------------------------------------------------


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
) -> SolveResult:
    """Solve (H + damping I) x = b by conjugate gradient from x = 0, one HVP per
    iteration. Converged when ||residual|| <= tol * ||b||.

    CG needs H + damping I positive definite along the directions it explores: when a
    direction of non-positive curvature appears (a non-convex loss, too little damping)
    it stops with `stopped = "negative_curvature"` and the iterate so far (zero if it
    was the first direction); raise the damping.
    """
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    n = b.size
    if damping < 0:
        raise ValueError(f"damping must be non-negative, got {damping}")
    budget = _Budget(max_hvps, max_seconds)
    limit = max_iterations if max_iterations is not None else max(n, 1) * 2
    x = np.zeros(n)
    b_norm = float(np.linalg.norm(b))
    residuals = [1.0 if b_norm > 0 else 0.0]
    if b_norm == 0.0:
        return SolveResult(x, True, "converged", 0, 0, residuals, budget.seconds)
    r = b.copy()
    p = r.copy()
    rs = float(r @ r)
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
        rs_new = float(r @ r)
        residuals.append(math.sqrt(rs_new) / b_norm)
        budget.report(callback, "conjugate_gradient", None, residuals[-1])
        if math.sqrt(rs_new) <= tol * b_norm:
            stopped = "converged"
            break
        p = r + (rs_new / rs) * p
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


__all__ = [
    "WHICH",
    "Callback",
    "EigenResult",
    "FlatOperator",
    "Progress",
    "SolveResult",
    "TraceResult",
    "conjugate_gradient",
    "hutchinson_trace",
    "lanczos",
]
