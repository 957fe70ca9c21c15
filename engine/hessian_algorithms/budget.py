"""What every estimator shares: the operator contract (`Matvec`), the HVP and time budget
that counts its vectors and seconds, and the `Progress` it reports after each pass."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# The seconds every budget counts. Tests put a clock of their own here, one that moves
# only when their slow operator says so: a time limit is then tested on any machine,
# loaded or not, with no wall-clock bound.
clock: Callable[[], float] = time.perf_counter

# matvec(V) -> A @ V for a batch V of shape (K, n), host float64: one batched pass over
# the operator (a Hessian, a Gauss-Newton or Fisher matrix: anything symmetric).
Matvec = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Progress:
    """Where a running algorithm stands: `hvps` used of at most `max_hvps` (None: no
    HVP limit), `estimate` (Ritz values, the trace, the relative residual: what the
    algorithm would answer now, None before there is one or when it is a whole vector),
    its `error` (residuals, the standard error, the relative residual), and the seconds
    elapsed of `max_seconds`."""

    algorithm: str  # lanczos, power_iteration, hutchinson_trace, ..., conjugate_gradient
    hvps: int
    max_hvps: int | None
    estimate: Any
    error: Any
    seconds: float
    max_seconds: float | None


Callback = Callable[[Progress], None]


class Budget:
    """Counts HVPs (vectors) and seconds against the limits; applies the matvec."""

    def __init__(self, max_hvps: int | None, max_seconds: float | None):
        if max_hvps is not None and max_hvps < 1:
            raise ValueError(f"max_hvps must be at least 1, got {max_hvps}")
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds}")
        self.max_hvps = max_hvps
        self.max_seconds = max_seconds
        self.hvps = 0
        self.started = clock()

    def left(self) -> int | None:
        return None if self.max_hvps is None else self.max_hvps - self.hvps

    def out_of_time(self) -> bool:
        return self.max_seconds is not None and self.seconds > self.max_seconds

    @property
    def seconds(self) -> float:
        return clock() - self.started

    def report(self, callback: Callback | None, algorithm: str, estimate: Any, error: Any) -> None:
        if callback is not None:
            callback(
                Progress(
                    algorithm,
                    self.hvps,
                    self.max_hvps,
                    estimate,
                    error,
                    self.seconds,
                    self.max_seconds,
                )
            )

    def apply(self, matvec: Matvec, vectors: np.ndarray) -> np.ndarray:
        out = np.asarray(matvec(vectors), dtype=np.float64)
        if out.shape != vectors.shape:
            raise ValueError(f"matvec returned shape {out.shape} for vectors of {vectors.shape}")
        self.hvps += vectors.shape[0]
        return out


def check_operator(n: int, where: str) -> None:
    if n < 1:
        raise ValueError(f"{where}: the operator has no parameters")


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


def check_tolerance(rtol: float | None, atol: float) -> None:
    if rtol is not None and not rtol > 0:
        raise ValueError(f"rtol must be positive, got {rtol}")
    if not atol >= 0:
        raise ValueError(f"atol must be non-negative, got {atol}")


def diagonal_entries(
    matvec: Callable[[np.ndarray], np.ndarray], n: int, indices: np.ndarray, budget: Budget
) -> np.ndarray:
    """A_ii for i in `indices`: one batched pass over the unit vectors e_i (what the exact
    trace and the exact diagonal are made of)."""
    rows = np.arange(len(indices))
    units = np.zeros((len(indices), n))
    units[rows, indices] = 1.0
    return budget.apply(matvec, units)[rows, indices]


def rademacher(rng: np.random.Generator, size: int, n: int) -> np.ndarray:
    """`size` random vectors of +-1 entries, (size, n) float64."""
    return rng.integers(0, 2, size=(size, n)).astype(np.float64) * 2.0 - 1.0


def orthogonalize(w: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """w (a vector, or rows) with its components along the orthonormal rows of `basis`
    removed."""
    # Classical Gram-Schmidt, twice ("twice is enough", Giraud et al. 2005): keeps the
    # vectors orthogonal to working precision, so no spurious copies of converged
    # eigenvalues appear.
    for _ in range(2):
        w = w - (w @ basis.T) @ basis
    return w
