"""What the client's methods answer: NumPy arrays, keyed like the request's sources.

`sources` shapes the answers: None (every trainable variable) or a list of names gives a
dict keyed by name, a mapping alias -> name a dict keyed by alias, a single name (a str)
the array itself. Each result unpacks like a tuple of its main fields:
`value, gradients = client.gradient(...)`.
"""

from __future__ import annotations

import contextvars
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np


def shaped(answer: Mapping[str, Any] | None, sources: Any) -> Any:
    """An answer keyed by source (name or alias), in the structure of `sources`."""
    if answer is None:
        return None
    if isinstance(sources, str):
        if sources in answer:
            return answer[sources]
        if len(answer) == 1:
            return next(iter(answer.values()))
    return dict(answer)


def flat_matrix(blocks: Mapping[str, Mapping[str, np.ndarray]], order: list[str]) -> np.ndarray:
    """Hessian blocks hessian[a][b] (shape a.shape + b.shape) as one dense float64 matrix
    over the flattened sources in `order`."""
    sizes = {a: int(np.prod(blocks[a][a].shape[: blocks[a][a].ndim // 2])) for a in order}
    rows = [
        np.concatenate(
            [np.asarray(blocks[a][b], dtype=np.float64).reshape(sizes[a], sizes[b]) for b in order],
            axis=1,
        )
        for a in order
    ]
    return np.concatenate(rows, axis=0)


class _Unpack:
    _unpack: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[Any]:
        return iter(getattr(self, name) for name in self._unpack)


# Unconverged answers ---------------------------------------------------------------------
# An answer whose `converged` is false looks like any other; so building one warns (an
# UnconvergedWarning naming why it stopped), or under `Client(strict=True)` raises
# Unconverged. The client sets STRICT around each call it runs (a context variable, so
# that an AsyncClient's concurrent tasks each see their own client's setting).
STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("gradtape_strict", default=False)

_PACKAGE = __name__.rsplit(".", 1)[0]


class UnconvergedWarning(UserWarning):
    """An answer stopped before it converged (`result.stopped` says why); its numbers are
    partial. `warnings.simplefilter("error", UnconvergedWarning)` or `Client(strict=True)`
    makes it an error."""


class Unconverged(RuntimeError):
    """Raised instead of UnconvergedWarning under `Client(strict=True)`; `result` is the
    partial answer."""

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result


_ADVICE = {
    "negative_curvature": "the curvature plus damping is not positive definite along a "
    "direction CG met: raise `damping`, or use curvature='ggn'",
    "time_limit": "raise `time_limit` (or `max_seconds`), or run it as a job (progress=True)",
    "max_hvps": "raise `max_hvps`",
    "max_iterations": "raise `max_iterations`",
}


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside this package (the user's call)."""
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class _Converges(_Unpack):
    converged: bool
    stopped: str
    if TYPE_CHECKING:  # every subclass has it (not a field here: it would move theirs)
        hvps: int

    def __post_init__(self) -> None:
        if self.converged:
            return
        name = type(self).__name__
        what = f"{name} (method {self.method!r})" if hasattr(self, "method") else name
        if getattr(self, "partial", None) is True or (
            name == "Diagonal" and getattr(self, "diagonal", 0) is None
        ):
            what += ", a partial run"
        message = (
            f"{what} did not converge: stopped {self.stopped!r} after {self.hvps} HVPs; "
            f"the answer is partial. {_ADVICE.get(self.stopped, '')}".rstrip()
        )
        if STRICT.get():
            raise Unconverged(message, self)
        warnings.warn(UnconvergedWarning(message), stacklevel=_caller_stacklevel())


def check_converged(what: str, answer: Any) -> None:
    """An answer kept as the server's dict (`RemoteTape.call`, `frobenius_norm`): warns
    as a typed result does when its `converged` is false (raises under strict)."""
    if not isinstance(answer, dict) or answer.get("converged") is not False:
        return
    stopped = answer.get("stopped")
    message = (
        f"{what} did not converge: stopped {stopped!r} after {answer.get('hvps')} HVPs; "
        f"the answer is partial. {_ADVICE.get(str(stopped), '')}".rstrip()
    )
    if STRICT.get():
        raise Unconverged(message, answer)
    warnings.warn(UnconvergedWarning(message), stacklevel=_caller_stacklevel())


# Approximate answers ----------------------------------------------------------------------
# Every curvature answer states the matrix it is of (`curvature_used`). One of an
# approximation (a Monte-Carlo Fisher; a Kronecker-factored or diagonal curvature) looks
# like any other: an exact trace of a Monte-Carlo Fisher answers method 'exact', stderr 0.
# So it warns (ApproximateWarning, with the server's reason). Not raised under strict:
# the approximation was asked for by name (`samples`, `curvature="kfac"`), not a failure.


class ApproximateWarning(UserWarning):
    """An answer is of an approximation of the curvature asked (`result.curvature_used`
    says which and why: a Monte-Carlo Fisher's samples and seed, a Kronecker-factored or
    diagonal structure); an exact method on it is exact for that approximation only.
    `warnings.simplefilter("ignore", ApproximateWarning)` silences it, "error" makes it
    one."""


@dataclass(frozen=True)
class CurvatureUsed:
    """The matrix a curvature answer is of: `kind` (hessian, ggn, fisher, ...), for a
    Monte-Carlo Fisher its `samples` per example and `seed`, `structure` (None: the
    matrix itself; "kfac", "ekfac": its Kronecker-factored approximation; "diagonal":
    its diagonal alone), and whether it is `approximate`, with the `reason`."""

    kind: str
    samples: int | None = None
    seed: int | None = None
    structure: str | None = None
    approximate: bool = False
    reason: str | None = None

    @classmethod
    def of(cls, answer: Mapping[str, Any]) -> CurvatureUsed | None:
        found = answer.get("curvature_used") if isinstance(answer, Mapping) else None
        if found is None:
            return None
        return cls(
            kind=found["kind"],
            samples=found.get("samples"),
            seed=found.get("seed"),
            structure=found.get("structure"),
            approximate=bool(found.get("approximate")),
            reason=found.get("reason"),
        )

    def __str__(self) -> str:
        """The matrix in a few words: "ggn", "KFAC of the ggn", "fisher, Monte-Carlo
        (4 samples, seed 2)"."""
        text = self.kind
        if self.structure:
            named = self.structure.upper() if "kfac" in self.structure else self.structure
            text = f"{named} of the {text}"
        if self.samples is not None:
            text += f", Monte-Carlo ({self.samples} samples, seed {self.seed})"
        return text


def check_approximate(what: str, answer: Any) -> None:
    """Warn (ApproximateWarning) when the answer is of an approximate curvature that the
    request did not name as such. A structure (kfac, ekfac, diagonal) is always the
    request's own choice (tape.kfac(), curvature="kfac", a Laplace fit's structure):
    stated on the result, not warned. A Monte-Carlo Fisher's sampling, under any
    structure, warns. One rule for every path (the typed methods, tape.call(), a job
    followed by id), so that the same answer warns, or not, however it was fetched."""
    used = CurvatureUsed.of(answer)
    if used is None or not used.approximate:
        return
    if used.samples is None and used.structure is not None:
        return
    warnings.warn(
        ApproximateWarning(f"{what} is approximate: {used.reason}"),
        stacklevel=_caller_stacklevel(),
    )


# A trace or diagonal asked with method "auto" (the default) is exact when max_hvps covers
# the n unit vectors it needs, and otherwise a stochastic estimate (Hutch++, Hutchinson)
# with a standard error: an estimate the request did not ask for by name, so it warns. One
# asked for by name ("hutchpp", "hutchinson") is the request's own choice: stated on the
# result (method, stderr), not warned, as a structure asked for is not (above). The
# server says which (`auto_estimated`), so that a job followed by id warns alike.


def check_estimated(what: str, answer: Any) -> None:
    """Warn (ApproximateWarning) when the server says (`auto_estimated`) that method
    "auto" answered a stochastic estimate the request did not name."""
    if not isinstance(answer, dict) or not answer.get("auto_estimated"):
        return
    method = answer.get("method")
    stderr = answer.get("stderr")
    error = answer.get("error", stderr)  # (a diagonal's: the entries' RMS standard error)
    spread = "no standard error yet" if error is None else f"standard error {error:.3g}"
    warnings.warn(
        ApproximateWarning(
            f"{what} is a {method} estimate ({spread}, {answer.get('samples')} samples), "
            "not exact: method 'auto' estimates when max_hvps is below the number of "
            "parameters. Pass method='exact' with max_hvps at least that number for the "
            f"exact value, or method={method!r} to take the estimate without this warning"
        ),
        stacklevel=_caller_stacklevel(),
    )


# Deprecated attributes --------------------------------------------------------------------
# The server's plain `curvature` string (influence, a Laplace fit) said less than
# `curvature_used` says; it is deprecated in the API (gradtape 0.1.0, gone in 0.2.0), and
# so is the attribute that carries it here: reading it warns, once per place it is read
# (Python's default for a DeprecationWarning shown from the caller's own module).

CURVATURE_DEPRECATED = (
    "{what} is deprecated since gradtape 0.1.0 and goes in 0.2.0, as the API's "
    "`curvature` field does: read .curvature_used (its kind; for curvature 'kfac' or "
    "'ekfac' its structure, and whether the matrix is approximate, and why)"
)


def warn_deprecated(message: str) -> None:
    """A DeprecationWarning pointed at the user's line (the first frame outside this
    package), so that Python shows it there by default."""
    warnings.warn(DeprecationWarning(message), stacklevel=_caller_stacklevel())


@dataclass(frozen=True)
class Execution:
    """How the server ran an answer's passes: `compiled` when every pass replayed its
    compiled form (a definition's passes are compiled per request layout: the first
    request of a layout runs dynamically, the second is captured, later ones replay);
    otherwise `reason`, the engine's, says why a pass ran dynamically."""

    compiled: bool
    reason: str | None = None

    @classmethod
    def of(cls, answer: Mapping[str, Any]) -> Execution | None:
        """The answer's `execution`; None when it has none: a sharded request's, or a
        tape's gradient or jacobian (read from its recording, no compiled pass)."""
        found = answer.get("execution")
        if found is None:
            return None
        return cls(bool(found["compiled"]), found.get("reason"))


def _per_source(cls: Any, answer: Mapping[str, Any], sources: Any, many: str, one: str) -> Any:
    """A Gradient or Jacobian from its answer: the value and a tensor per source
    (`many`), or with flat=True the one matrix `flat[one]` and its column `order`."""
    flat, how = answer.get("flat"), Execution.of(answer)
    if flat:
        return cls(answer["value"], flat[one], answer.get("nonfinite"), flat["order"], how)
    return cls(
        answer["value"], shaped(answer[many], sources), answer.get("nonfinite"), execution=how
    )


@dataclass(frozen=True)
class Gradient(_Unpack):
    """The target's value and its gradients; with flat=True, `gradients` is one float64
    vector over the sources and `order` lists them ({source, shape, offset, size})."""

    value: np.ndarray
    gradients: Any
    nonfinite: list[str] | None = None
    order: list[dict[str, Any]] | None = None
    execution: Execution | None = None
    _unpack = ("value", "gradients")

    @classmethod
    def of(cls, answer: Mapping[str, Any], sources: Any) -> Gradient:
        return _per_source(cls, answer, sources, "gradients", "gradient")


@dataclass(frozen=True)
class Jacobian(_Unpack):
    """The target's value and its jacobians (target.shape + source.shape, or per example
    with batch=True); with flat=True, `jacobians` is one float64 matrix [target size, n]
    (per example: [B, target size per example, n per example]) whose columns are the
    sources in `order` (SciPy's least_squares `jac`)."""

    value: np.ndarray
    jacobians: Any
    nonfinite: list[str] | None = None
    order: list[dict[str, Any]] | None = None
    execution: Execution | None = None
    _unpack = ("value", "jacobians")

    @classmethod
    def of(cls, answer: Mapping[str, Any], sources: Any) -> Jacobian:
        return _per_source(cls, answer, sources, "jacobians", "jacobian")


@dataclass(frozen=True)
class Hessian(_Unpack):
    """Value, gradients and the Hessian as blocks `hessian[a][b]` of shape
    a.shape + b.shape (a single source: the one block itself); `matrix()` is the dense
    float64 matrix over the flattened sources."""

    value: np.ndarray
    gradients: Any
    hessian: Any
    newton_step: Any = None
    nonfinite: list[str] | None = None
    blocks: dict[str, dict[str, np.ndarray]] = field(default_factory=dict, repr=False)
    _unpack = ("value", "gradients", "hessian")

    def plot(self, ax: Any = None, **style: Any) -> Any:
        """The dense Hessian as a heatmap (plots.hessian): (figure, axes)."""
        from . import plots

        return plots.hessian(self, ax, **style)

    def matrix(self) -> np.ndarray:
        return flat_matrix(self.blocks, list(self.blocks))


@dataclass(frozen=True)
class HVP(_Unpack):
    """Value, gradients and H v (`hvp`, for one vector) or [H v_i] (`hvps`)."""

    value: np.ndarray | None
    gradients: Any
    hvp: Any = None
    hvps: list[Any] | None = None
    nonfinite: list[str] | None = None
    execution: Execution | None = None
    _unpack = ("value", "gradients", "hvp")


@dataclass(frozen=True)
class Eigenvalues(_Converges):
    """Extreme eigenvalues of a tape's Hessian (Lanczos, or deflated power iteration):
    sorted as asked (LA descending, SA ascending, LM by magnitude), with residuals,
    eigenvectors when asked (one per eigenvalue, in the tape's source structure), and
    how it stopped."""

    eigenvalues: np.ndarray
    residuals: np.ndarray
    eigenvectors: list[Any] | None
    converged: bool
    stopped: str
    iterations: int
    hvps: int
    seconds: float
    method: str = "lanczos"
    curvature_used: CurvatureUsed | None = None
    _unpack = ("eigenvalues", "eigenvectors")

    def plot(self, ax: Any = None) -> Any:
        """The eigenvalues with their residuals (plots.eigenvalues): (figure, axes)."""
        from . import plots

        return plots.eigenvalues(self, ax)


@dataclass(frozen=True)
class Trace(_Converges):
    """A tape's Hessian trace (exact, or estimated by Hutch++ or Hutchinson) and its
    standard error (0 when exact); `method` is the one that ran. `partial`: method exact
    stopped before every direction (time_limit), so `trace` is an estimate from the
    directions seen (and the result warns, as every unconverged one does)."""

    trace: float
    stderr: float | None
    samples: int
    batches: int
    batch_size: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    method: str = "hutchinson"
    sketch: int = 0
    partial: bool = False
    curvature_used: CurvatureUsed | None = None
    _unpack = ("trace", "stderr")


@dataclass(frozen=True)
class Diagonal(_Converges):
    """A tape's Hessian diagonal in the tape's source structure (exact, or Hutchinson's
    estimate with a standard error per entry: `stderr`, None when exact or unknown);
    `error` is the root-mean-square standard error. An exact run stopped by max_seconds
    has `diagonal` None and the `reached` entries it computed, flat in the sources'
    order (each row-major), in `partial`."""

    diagonal: Any
    stderr: Any
    error: float | None
    method: str
    reached: int
    samples: int
    batches: int
    batch_size: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    partial: np.ndarray | None = None
    curvature_used: CurvatureUsed | None = None
    _unpack = ("diagonal", "stderr")

    def plot(self, sources: list[str] | None = None, **style: Any) -> Any:
        """A heatmap per source (plots.diagonal): (figure, [axes])."""
        from . import plots

        return plots.diagonal(self, sources, **style)


@dataclass(frozen=True)
class SpectralDensity(_Converges):
    """The eigenvalue density of a tape's Hessian by stochastic Lanczos quadrature: the
    Gaussian-smoothed `density` on `grid` (integrating to 1) with its pointwise `stderr`,
    and per probe the Ritz `nodes` and their `weights` (each probe's sum to 1)."""

    grid: np.ndarray
    density: np.ndarray
    stderr: np.ndarray | None
    nodes: list[np.ndarray]
    weights: list[np.ndarray]
    sigma: float
    probes: int
    steps: int
    parameters: int
    converged: bool
    stopped: str
    hvps: int
    seconds: float
    curvature_used: CurvatureUsed | None = None
    _unpack = ("grid", "density")

    def plot(self, ax: Any = None, **style: Any) -> Any:
        """The density with its band of +-2 standard errors (plots.spectral_density):
        (figure, axes)."""
        from . import plots

        return plots.spectral_density(self, ax, **style)

    def smoothed(self, grid: Any, sigma: float) -> np.ndarray:
        """The density re-smoothed with another `sigma` on another `grid`, from the raw
        nodes and weights (no request)."""
        grid = np.asarray(grid, dtype=np.float64)
        total = np.zeros_like(grid)
        for theta, tau in zip(self.nodes, self.weights, strict=True):
            z = (grid[:, None] - theta[None, :]) / sigma
            total += np.exp(-0.5 * z * z) @ tau
        return total / (len(self.nodes) * sigma * np.sqrt(2 * np.pi))


@dataclass(frozen=True)
class Solve(_Converges):
    """x of (H + damping I) x = b by conjugate gradient, in the tape's source structure;
    `residuals` the relative residual from x = 0 and after each iteration."""

    solution: Any
    rhs: str
    converged: bool
    stopped: str
    iterations: int
    hvps: int
    residuals: np.ndarray
    seconds: float
    curvature_used: CurvatureUsed | None = None
    _unpack = ("solution", "converged")

    def plot(self, ax: Any = None) -> Any:
        """The relative residual per CG iteration (plots.solve): (figure, axes)."""
        from . import plots

        return plots.solve(self, ax)


@dataclass(frozen=True)
class Influence(_Converges):
    """Influence functions (Koh and Liang) on a tape recorded with an output: per training
    example i, `scores[i]` = -g_i . s_test (positive: harmful, up-weighting example i
    raises the test loss; negative: helpful) and `removal[i]`, the predicted change of
    the test loss if it were left out; `helpful` (negative scores, most negative
    first) and `harmful` (positive scores, largest first), at most top_k each, fewer
    when fewer examples have that sign; s_test = (C + damping I)^-1 grad L_test per source, and the CG solve's report."""

    scores: np.ndarray
    removal: np.ndarray
    helpful: np.ndarray
    harmful: np.ndarray
    test_loss: float
    s_test: Any
    converged: bool
    stopped: str
    iterations: int
    hvps: int
    residuals: np.ndarray
    seconds: float
    curvature_used: CurvatureUsed | None = None
    # The server's deprecated `curvature` string (the `curvature` property reads it).
    _curvature: str | None = field(default=None, repr=False, compare=False)
    _unpack = ("scores", "helpful", "harmful")

    @property
    def curvature(self) -> str | None:
        """Deprecated: read `curvature_used` (CURVATURE_DEPRECATED)."""
        warn_deprecated(CURVATURE_DEPRECATED.format(what="Influence.curvature"))
        return self._curvature

    def plot(self, ax: Any = None, **style: Any) -> Any:
        """The scores as bars, harmful red, helpful blue (plots.influence):
        (figure, axes)."""
        from . import plots

        return plots.influence(self, ax, **style)
