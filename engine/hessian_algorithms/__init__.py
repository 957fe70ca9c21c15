"""Algorithms made of curvature-matrix-vector products: what PyHessian, hessian-eigenthings,
curvlinops, scipy's trust-ncg and influence-function code do with HVPs, run next to the
recorded tape.

    op = gt.hessian_operator(loss_fn, w, b)           # forward + gradient recorded once
    flat = FlatOperator(op)                           # (K, n) float64 <-> the primals
    top = lanczos(flat.matvec, flat.n, k=3)           # top-3 eigenvalues of H
    tr = estimate_trace(flat.matvec, flat.n)          # exact, or Hutch++ with a std error
    d = estimate_diagonal(flat.matvec, flat.n)        # exact, or Hutchinson's
    rho = spectral_density(flat.matvec, flat.n)       # SLQ: density, Ritz nodes, weights
    step = conjugate_gradient(flat.matvec, flat.flatten(op.grad), damping=1e-3)

Each algorithm takes `matvec(V) -> A @ V` for a batch V of shape (K, n) (host NumPy,
float64) and `n`: the shape of `HessianOperator.hvp_many` on flattened vectors, so K
vectors cost one batched pass. Nothing else about the operator is assumed beyond its
symmetry: a Gauss-Newton or Fisher operator with the same flat matvec works unchanged.
The bookkeeping (orthogonalization, tridiagonal eigenproblems, recurrences) runs in
float64 on the host; only the products run on the operator's device and dtype.

Every algorithm stops at a limit on HVPs (`max_hvps`, counted as vectors) and on seconds
(`max_seconds`), says why it stopped (`stopped`), reports how many HVPs it used and an
error estimate where one exists (residuals, standard errors), and may report its
progress to a `callback(Progress)` after every pass: a host relays it (the service's
jobs) or stops the run by raising from it.

Modules: budget (the shared bookkeeping), hutchinson (the one loop of the Hutchinson
estimators: trace, diagonal, Frobenius norm), flat (FlatOperator), eigen (lanczos,
power_iteration), trace, diagonal, density (spectral_density), solve
(conjugate_gradient).
"""

from engine.hessian_algorithms.budget import Callback, Matvec, Progress
from engine.hessian_algorithms.density import DensityResult, spectral_density
from engine.hessian_algorithms.diagonal import (
    DIAGONAL_METHODS,
    DiagonalResult,
    choose_diagonal_method,
    estimate_diagonal,
    exact_diagonal,
    hutchinson_diagonal,
)
from engine.hessian_algorithms.eigen import WHICH, EigenResult, lanczos, power_iteration
from engine.hessian_algorithms.flat import FlatOperator
from engine.hessian_algorithms.solve import SolveResult, conjugate_gradient
from engine.hessian_algorithms.trace import (
    TRACE_METHODS,
    TraceResult,
    choose_trace_method,
    estimate_trace,
    exact_pass_size,
    exact_trace,
    hutchinson_trace,
    hutchpp_trace,
)

__all__ = [
    "DIAGONAL_METHODS",
    "TRACE_METHODS",
    "WHICH",
    "Callback",
    "DensityResult",
    "DiagonalResult",
    "EigenResult",
    "FlatOperator",
    "Matvec",
    "Progress",
    "SolveResult",
    "TraceResult",
    "choose_diagonal_method",
    "choose_trace_method",
    "conjugate_gradient",
    "estimate_diagonal",
    "estimate_trace",
    "exact_diagonal",
    "exact_pass_size",
    "exact_trace",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos",
    "power_iteration",
    "spectral_density",
]
