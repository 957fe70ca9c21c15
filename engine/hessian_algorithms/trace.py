"""The trace of a symmetric operator: exact (unit vectors, in batched passes), Hutchinson,
and Hutch++ (a sketch of the top of the spectrum taken exactly, Hutchinson on the rest),
each with a standard error and a stopping rule on it.

`estimate_trace(..., method="auto")` is the entry point: exact when the HVP budget covers
the n HVPs it needs, else Hutch++.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from engine.hessian_algorithms.budget import (
    Budget,
    Callback,
    Matvec,
    Progress,
    check_batch_size,
    check_operator,
    check_tolerance,
    diagonal_entries,
    orthogonalize,
    rademacher,
)
from engine.hessian_algorithms.hutchinson import (
    MIN_STDERR_SAMPLES,
    TRACE,
    hutchinson,
    sample_stderr,
    tolerance_met,
)

TRACE_METHODS = ("auto", "exact", "hutchpp", "hutchinson")

# Unit vectors per exact pass. Past a few dozen vectors a pass's temporaries (vectors x
# the largest activation) leave the caches and the pass slows down per vector: on an MLP
# of 960 parameters (256 examples, bench/bench_estimators.py) the exact trace took 0.27 s
# one vector a pass, 0.12 s at 64 a pass, 0.31 s in one pass of all 960.
EXACT_PASS_VECTORS = 64
# ... and they are held on the host: at most this many bytes of them.
EXACT_PASS_BYTES = 64 << 20


@dataclass
class TraceResult:
    """An estimate of tr(A) and its standard error.

    `samples` are what the estimate averages: random probes (hutchinson, hutchpp) or unit
    vectors visited (exact); `values` their per-sample values (z^T A z; for hutchpp those
    of the deflated remainder; for exact the diagonal entries, in the visiting order).
    `sketch` is the rank of Hutch++'s exactly-taken part. `stopped`: exhausted (exact:
    every direction was taken), tolerance, max_hvps (the budget, or without a tolerance
    every sample asked for), time_limit.
    """

    trace: float
    stderr: float
    samples: int
    batches: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    method: str = "hutchinson"
    sketch: int = 0
    values: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)


# ----------------------------------------------------------------------------------------
# Exact
# ----------------------------------------------------------------------------------------


def exact_pass_size(n: int, max_batch: int | None = None) -> int:
    """Unit vectors per exact pass: all n in one pass up to EXACT_PASS_VECTORS, else
    passes of that many, fewer when they would pass EXACT_PASS_BYTES on the host or the
    operator's max_batch (its memory bound)."""
    size = max(1, min(n, EXACT_PASS_VECTORS, EXACT_PASS_BYTES // (8 * max(n, 1))))
    return size if max_batch is None else max(1, min(size, max_batch))


def exact_trace(
    matvec: Matvec,
    n: int,
    batch_size: int | None = None,
    max_hvps: int | None = None,
    max_seconds: float | None = None,
    seed: int | None = 0,
    callback: Callback | None = None,
) -> TraceResult:
    """tr(A) = sum_i e_i^T A e_i from the n unit vectors, `batch_size` per pass (default:
    exact_pass_size(n): one pass up to 64 parameters): n HVPs, no error.

    The unit vectors are visited in a random order (`seed`), so that a run stopped by
    max_seconds still answers an unbiased estimate, n times the mean diagonal entry seen,
    with its standard error (sampling without replacement); progress reports carry the
    same. max_hvps below n is an error: the exact trace needs all n.
    """
    check_operator(n, "exact_trace")
    batch_size = exact_pass_size(n) if batch_size is None else batch_size
    check_batch_size(batch_size)
    if max_hvps is not None and max_hvps < n:
        raise ValueError(
            f"exact_trace: the exact trace takes n = {n} HVPs; max_hvps is "
            f"{max_hvps} (raise it, or use hutchpp)"
        )
    budget = Budget(n if max_hvps is None else max_hvps, max_seconds)
    order = np.random.default_rng(seed).permutation(n)
    values = np.empty(n)
    seen = batches = 0
    estimate, stderr = 0.0, math.inf
    stopped = "exhausted"
    while seen < n:
        chunk = order[seen : seen + batch_size]
        values[seen : seen + len(chunk)] = diagonal_entries(matvec, n, chunk, budget)
        seen += len(chunk)
        batches += 1
        estimate, stderr = _partial_sum(values[:seen], n)
        budget.report(callback, "exact_trace", estimate, stderr)
        if seen < n and budget.out_of_time():
            stopped = "time_limit"
            break
    if seen == n:
        estimate, stderr = float(np.sum(values[np.argsort(order)])), 0.0
    return TraceResult(
        trace=estimate,
        stderr=stderr,
        samples=seen,
        batches=batches,
        converged=seen == n,
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
        method="exact",
        values=values[:seen].copy(),
    )


def _partial_sum(seen: np.ndarray, n: int) -> tuple[float, float]:
    """n * mean of m diagonal entries drawn without replacement, and its standard error
    (with the finite-population correction: zero once all n are seen)."""
    m = len(seen)
    if m == n:
        return float(np.sum(seen)), 0.0
    if m < MIN_STDERR_SAMPLES:  # too few for a standard error (see MIN_STDERR_SAMPLES)
        return float(n * seen.mean()), math.inf
    variance = float(seen.var(ddof=1))
    return float(n * seen.mean()), n * math.sqrt((1 - m / n) * variance / m)


# ----------------------------------------------------------------------------------------
# Hutchinson
# ----------------------------------------------------------------------------------------


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
    """tr(A) ~ mean of z^T A z over Rademacher vectors z (entries +-1), drawn
    `batch_size` at a time (one batched HVP pass each); stderr = sample std / sqrt(N).

    Stops when the standard error is at most rtol * |estimate| + atol (when rtol or atol
    is given; from MIN_STDERR_SAMPLES samples on: before that the standard error is
    unknown, inf), at max_hvps samples, or at max_seconds.
    `converged` says the tolerance was met (or, without one, that every sample asked for
    was taken and they were enough for a standard error).
    """
    run = hutchinson(
        matvec, n, TRACE, batch_size, max_hvps, rtol, atol, max_seconds, seed, callback
    )
    return TraceResult(
        trace=float(run.mean[0]) if run.mean.size else 0.0,
        stderr=float(run.stderr[0]),
        samples=run.samples,
        batches=run.batches,
        converged=run.converged,
        stopped=run.stopped,
        hvps=run.hvps,
        seconds=run.seconds,
        method="hutchinson",
        values=run.values,
    )


# ----------------------------------------------------------------------------------------
# Hutch++
# ----------------------------------------------------------------------------------------


class _Deflated:
    """Hutch++'s state: Q (s orthonormal rows spanning A applied to the sketch), AQ, and
    the probes g with g^T A g, so that every probe's value on the deflated remainder
    (I - QQ^T) A (I - QQ^T) can be recomputed, for no HVP, whenever Q grows:

        g'^T A g' = g^T A g - 2 (Q g).(AQ g) + (Q g)^T (Q A Q^T) (Q g)

    (AQ g = Q A g as A is symmetric). The probes are independent of Q, so their values
    are unbiased samples of the remainder's trace given Q."""

    def __init__(self, n: int):
        self.q = np.zeros((0, n))
        self.aq = np.zeros((0, n))
        self.probes = np.zeros((0, n), dtype=np.int8)  # +-1: n bytes a probe
        self.quad = np.zeros(0)  # g^T A g
        self.c = np.zeros((0, 0))  # Q g per probe, (m, s)
        self.d = np.zeros((0, 0))  # AQ g per probe, (m, s)
        self.small = np.zeros((0, 0))  # Q A Q^T, (s, s)

    def grow_sketch(self, q: np.ndarray, aq: np.ndarray) -> None:
        g = self.probes.astype(np.float64)
        self.c = np.concatenate([self.c, g @ q.T], axis=1)
        self.d = np.concatenate([self.d, g @ aq.T], axis=1)
        self.q = np.concatenate([self.q, q])
        self.aq = np.concatenate([self.aq, aq])
        small = self.q @ self.aq.T
        self.small = (small + small.T) / 2

    def add_probes(self, g: np.ndarray, ag: np.ndarray, keep: bool) -> None:
        self.quad = np.concatenate([self.quad, np.einsum("kn,kn->k", g, ag)])
        self.c = np.concatenate([self.c, g @ self.q.T])
        self.d = np.concatenate([self.d, g @ self.aq.T])
        if keep:  # only needed while Q may still grow
            self.probes = np.concatenate([self.probes, g.astype(np.int8)])

    def freeze(self) -> None:
        """Q grows no more: the probes themselves are no longer needed, only their
        projections (kept in c and d)."""
        self.probes = np.zeros((0, self.q.shape[1]), dtype=np.int8)

    def values(self) -> np.ndarray:
        return np.asarray(
            self.quad
            - 2 * np.einsum("ms,ms->m", self.c, self.d)
            + np.einsum("ms,st,mt->m", self.c, self.small, self.c)
        )

    def estimate(self) -> tuple[float, float, np.ndarray]:
        values = self.values()
        exact = float(np.trace(self.small))
        if len(values) == 0:
            return exact, math.inf, values
        return exact + float(values.mean()), sample_stderr(values), values


def hutchpp_trace(
    matvec: Matvec,
    n: int,
    batch_size: int = 16,
    max_hvps: int = 1024,
    rtol: float | None = None,
    atol: float = 0.0,
    max_seconds: float | None = None,
    seed: int | None = 0,
    max_basis_bytes: int | None = None,
    callback: Callback | None = None,
    exact_batch_size: int | None = None,
) -> TraceResult:
    """tr(A) by Hutch++ (Meyer, Musco, Musco, Woodruff 2021), grown in rounds so that it
    can stop at a tolerance.

    Each round spends its HVPs in thirds (batch_size each, one batched pass each): A S
    for Gaussian S extends an orthonormal Q; A Q gives tr(Q A Q^T) exactly; Rademacher
    probes estimate the trace of the remainder (I - QQ^T) A (I - QQ^T) by Hutchinson.
    After each round every probe drawn so far is re-evaluated against the grown Q for no
    HVP, so the estimate is tr(Q A Q^T) + the probes' mean and its standard error is
    the probes' std / sqrt(probes) (unknown, inf, below MIN_STDERR_SAMPLES probes): when
    A's spectrum decays the remainder, and so the error, shrinks much faster than
    Hutchinson's. Stops at the tolerance (stderr <= rtol |trace| + atol, once the
    standard error is known), when Q spans A's range (exhausted: exact up to
    rounding), at max_hvps or max_seconds. Q and AQ hold 16 n bytes a row and the probes
    n bytes each: once they would pass max_basis_bytes the sketch stops growing, the
    probes are dropped (their projections are kept) and only probes follow. Once the
    sketch would pass n/3 directions with n HVPs still in the budget, the rest is the
    exact trace (`exact_trace`, `exact_batch_size` unit vectors a pass: n more HVPs,
    where Hutch++ would take up to 2n; the answer then says method "exact", its hvps
    count both parts).
    """
    check_operator(n, "hutchpp_trace")
    check_batch_size(batch_size)
    check_tolerance(rtol, atol)
    if max_hvps < 3:
        raise ValueError(
            f"max_hvps must be at least 3 for hutchpp (a sketch, its product "
            f"and a probe), got {max_hvps}"
        )
    budget = Budget(max_hvps, max_seconds)
    rng = np.random.default_rng(seed)
    state = _Deflated(n)
    growing = True
    rounds = 0
    estimate, stderr, values = 0.0, math.inf, np.zeros(0)
    stopped = "max_hvps"
    while True:
        left = budget.left()
        assert left is not None
        if left < 1:
            break
        if growing and max_basis_bytes is not None:
            # Another round holds batch_size more rows of Q and AQ and as many probes.
            rows, probes_held = len(state.q) + batch_size, len(state.probes) + batch_size
            if n * (16 * rows + probes_held) > max_basis_bytes:
                growing = False
                state.freeze()
        if growing and 3 * (len(state.q) + batch_size) > n and left >= n:
            # The sketch would span a third of the space: about n HVPs are spent, and
            # growing on towards the whole space costs up to 2n more, the exact trace n.
            exact = exact_trace(
                matvec,
                n,
                batch_size=exact_batch_size,
                max_hvps=left,
                max_seconds=None
                if max_seconds is None
                else max(max_seconds - budget.seconds, 1e-9),
                seed=seed,
                callback=_shifted(callback, budget.hvps, max_hvps, max_seconds, budget.seconds),
            )
            exact.hvps += budget.hvps
            exact.seconds = budget.seconds
            return exact
        if growing and left >= 3:
            size = min(batch_size, left // 3, n - len(state.q))
            sketch = budget.apply(matvec, rng.standard_normal((size, n)))
            q = _new_directions(sketch, state.q)
            if len(q):
                state.grow_sketch(q, budget.apply(matvec, q))
            if len(q) < size or len(state.q) == n:
                # A S adds fewer directions than it has columns: Q spans A's range (or
                # the whole space), so the remainder is zero and tr(Q A Q^T) is exact.
                estimate, stderr, values = float(np.trace(state.small)), 0.0, np.zeros(0)
                budget.report(callback, "hutchpp_trace", estimate, stderr)
                stopped = "exhausted"
                rounds += 1
                break
            probes = min(size, budget.left() or 0)
        else:
            if growing:
                growing = False
                state.freeze()
            probes = min(batch_size, left)
        if probes:
            g = rademacher(rng, probes, n)
            state.add_probes(g, budget.apply(matvec, g), keep=growing)
        rounds += 1
        estimate, stderr, values = state.estimate()
        budget.report(callback, "hutchpp_trace", estimate, stderr)
        if tolerance_met(stderr, estimate, rtol, atol):
            stopped = "tolerance"
            break
        if budget.out_of_time() and (budget.left() or 0) > 0:
            stopped = "time_limit"
            break
    tolerance = rtol is not None or atol > 0
    return TraceResult(
        trace=estimate,
        stderr=stderr,
        samples=len(values),
        batches=rounds,
        converged=stopped in ("tolerance", "exhausted")
        or (not tolerance and stopped == "max_hvps" and math.isfinite(stderr)),
        stopped=stopped,
        hvps=budget.hvps,
        seconds=budget.seconds,
        method="hutchpp",
        sketch=len(state.q),
        values=values,
    )


def _shifted(
    callback: Callback | None, hvps: int, max_hvps: int, max_seconds: float | None, seconds: float
) -> Callback | None:
    """A callback for a run that continues another: its counts start at hvps, seconds."""
    if callback is None:
        return None

    def report(p: Progress) -> None:
        callback(
            dataclasses.replace(
                p,
                hvps=p.hvps + hvps,
                max_hvps=max_hvps,
                seconds=p.seconds + seconds,
                max_seconds=max_seconds,
            )
        )

    return report


def _new_directions(sketch: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Orthonormal rows spanning what the rows of A S add to Q's span (directions whose
    singular value after the projection is above rounding)."""
    scale = max(float(np.max(np.linalg.norm(sketch, axis=1), initial=0.0)), np.finfo(float).tiny)
    rest = orthogonalize(sketch, q) if len(q) else sketch
    # The SVD of the tall n x k transpose (about twice as fast as of the wide k x n here).
    columns, singular, _ = np.linalg.svd(rest.T, full_matrices=False)
    rows = columns[:, singular > 1e-10 * scale].T
    return orthogonalize(rows, q) if len(q) and len(rows) else rows


# ----------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------


def choose_trace_method(method: str, n: int, max_hvps: int) -> str:
    """auto -> exact when the budget covers its n HVPs, else hutchpp."""
    if method not in TRACE_METHODS:
        raise ValueError(f"method must be one of {', '.join(TRACE_METHODS)}, got {method!r}")
    if method == "auto":
        return "exact" if n <= max_hvps else "hutchpp"
    return method


def estimate_trace(
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
    max_basis_bytes: int | None = None,
    callback: Callback | None = None,
) -> TraceResult:
    """tr(A) by `method`: exact (n HVPs, `exact_batch_size` unit vectors a pass), hutchpp
    (the stochastic default), hutchinson, or auto (exact when n <= max_hvps, else
    hutchpp). The tolerance applies to the stochastic methods; see each function."""
    chosen = choose_trace_method(method, n, max_hvps)
    if chosen == "exact":
        return exact_trace(
            matvec,
            n,
            batch_size=exact_batch_size,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            seed=seed,
            callback=callback,
        )
    if chosen == "hutchpp":
        return hutchpp_trace(
            matvec,
            n,
            batch_size=batch_size,
            max_hvps=max_hvps,
            rtol=rtol,
            atol=atol,
            max_seconds=max_seconds,
            seed=seed,
            max_basis_bytes=max_basis_bytes,
            callback=callback,
            exact_batch_size=exact_batch_size,
        )
    return hutchinson_trace(
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
