"""Algorithms on a tape's curvature (eigenvalues, trace, diagonal, spectral density,
solve, influence, Frobenius norm): their answers, and their requests, which are made
from the operation table (service/core/operations.py; schemas/operations.py)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    Field,
)

from service.api.schemas.base import nonfinite_flag
from service.api.schemas.definitions import Tensors
from service.api.schemas.operations import (
    REQUEST_MODELS,
    CurvatureUsedModel,
    curvature_used_field,
    deprecated_curvature_field,
)
from service.api.schemas.tensors import Tensor
from service.core.operations import CurvatureKind, DiagonalMethod, EigenMethod, TraceMethod


class Stopped(StrEnum):
    """Why an algorithm stopped."""

    converged = "converged"
    exhausted = "exhausted"
    complete = "complete"
    tolerance = "tolerance"
    max_hvps = "max_hvps"
    max_iterations = "max_iterations"
    time_limit = "time_limit"
    negative_curvature = "negative_curvature"


class EigenvaluesResponse(BaseModel):
    """Ritz values sorted as asked (LA: descending; SA: ascending; LM: by magnitude)."""

    eigenvalues: list[float]
    residuals: list[float] = Field(
        description="||H y - theta y|| per Ritz pair (lanczos: "
        "estimates from the recurrence; power: computed)."
    )
    eigenvectors: list[Tensors] | None = None
    method: EigenMethod
    converged: bool
    stopped: Stopped = Field(
        description="converged; exhausted (every direction was spanned: "
        "exact); max_hvps; time_limit."
    )
    iterations: int = Field(description="Lanczos iterations, or power steps (batched passes).")
    hvps: int = Field(description="HVPs used.")
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


def auto_estimated_field() -> Any:
    """A trace's or diagonal's `auto_estimated` (the SDK warns from it)."""
    return Field(
        False,
        description="True when method `auto` (the default) answered a stochastic estimate "
        "(hutchpp, hutchinson) because max_hvps is below the parameter count: an estimate "
        "with a standard error, not the exact value, which the request did not name. Ask "
        "method `exact` with max_hvps at least the parameter count for the exact value.",
    )


class TraceResponse(BaseModel):
    """The trace and its standard error, with what it cost and why it stopped."""

    trace: float
    stderr: float | None = Field(
        description="Standard error of the estimate: 0 when exact; "
        "hutchinson: sample std / sqrt(samples); hutchpp: that of the "
        "probes of the remainder; exact stopped by max_seconds: that "
        "of n x the mean diagonal entry seen (they are visited in a "
        "random order); null (unknown) from fewer than 30 samples, "
        "which are too few for one. Of the estimator over the matrix `curvature_used` "
        "names: on a Monte-Carlo Fisher, the sampled matrix (its sampling is not in it)."
    )
    method: TraceMethod = Field(
        description="The method that ran (auto resolved; hutchpp "
        "hands over to exact once its sketch would span a third of "
        "the parameters with n HVPs still in the budget: then exact, "
        "and hvps count both)."
    )
    samples: int = Field(description="Random probes averaged, or unit vectors visited (exact).")
    sketch: int = Field(0, description="hutchpp: the rank of the part taken exactly.")
    batches: int = Field(description="Batched passes (exact, hutchinson) or rounds (hutchpp).")
    batch_size: int = Field(description="Vectors per batched pass.")
    converged: bool = Field(
        description="Exact, or the tolerance was met (without one: every "
        "sample asked for was drawn, and a standard error is known). "
        "The tolerance is checked from 30 samples on, whatever the "
        "batch size."
    )
    stopped: Stopped = Field(
        description="exhausted (exact: every direction was taken), "
        "tolerance, max_hvps or time_limit."
    )
    partial: bool = Field(
        False,
        description="True when method exact stopped before taking every direction "
        "(time_limit): `trace` is then n x the mean diagonal entry seen, with its stderr, "
        "not the exact trace.",
    )
    auto_estimated: bool = auto_estimated_field()
    hvps: int
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


class DiagonalResponse(BaseModel):
    """The diagonal, as tensors per source, and its standard error."""

    diagonal: Tensors | None = Field(
        description="The diagonal per source; null when an "
        "exact run was stopped by max_seconds before reaching "
        "every entry (see `partial`)."
    )
    partial: Tensor | None = Field(
        None,
        description="Only when an exact run was stopped by "
        "max_seconds: the `reached` entries computed, flat, in the "
        "order of the sources (as the tape lists them), each "
        "row-major; the entries past them are unknown.",
    )
    stderr: Tensors | None = Field(
        description="Standard error per entry (hutchinson); null "
        "when exact, and when it is unknown (fewer than 30 probes)."
    )
    error: float | None = Field(
        description="Root-mean-square standard error over the "
        "entries (what rtol is compared with); 0 when exact; null "
        "when unknown."
    )
    method: DiagonalMethod = Field(description="The method that ran (auto resolved).")
    reached: int = Field(
        description="Entries computed, counted over the sources in their "
        "order, each row-major: all n unless an exact run was stopped by "
        "max_seconds (then `diagonal` is null and `partial` holds them)."
    )
    samples: int = Field(description="Random probes averaged, or unit vectors visited (exact).")
    batches: int
    batch_size: int = Field(description="Vectors per batched pass.")
    converged: bool
    stopped: Stopped = Field(description="exhausted (exact), tolerance, max_hvps or time_limit.")
    auto_estimated: bool = auto_estimated_field()
    hvps: int
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


class SpectralDensityResponse(BaseModel):
    """The smoothed eigenvalue density on a grid, and the raw quadrature it comes from."""

    grid: list[float] = Field(description="Eigenvalues where the density is given.")
    density: list[float] = Field(
        description="The density of eigenvalues, normalized to "
        "integrate to 1 (times the parameter count: eigenvalues per "
        "unit)."
    )
    stderr: list[float] | None = Field(
        description="Pointwise standard error of the density across probes (null with one probe)."
    )
    nodes: list[list[float]] = Field(
        description="Per probe, its Ritz values (the quadrature's nodes)."
    )
    weights: list[list[float]] = Field(
        description="Per probe, its nodes' weights (squared first components; they sum to 1)."
    )
    sigma: float = Field(description="The smoothing width used.")
    probes: int = Field(description="Probes that ran.")
    steps: int = Field(
        description="Lanczos steps per probe asked (capped at the parameter "
        "count); a probe whose Krylov space closes sooner has fewer nodes, "
        "and its quadrature is then exact."
    )
    parameters: int = Field(description="n, the tape's parameter count.")
    converged: bool = Field(description="Every probe ran its steps.")
    stopped: Stopped = Field(
        description="complete, max_hvps or time_limit (the probes run "
        "so far, each with the steps it reached)."
    )
    hvps: int
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


class SolveResponse(BaseModel):
    solution: Tensors = Field(description="x, per source.")
    rhs: str = Field(description="gradient (x is the damped Newton step) or vector.")
    converged: bool
    stopped: Stopped = Field(
        description="converged, max_iterations, max_hvps, time_limit, "
        "or negative_curvature (H + damping I is not positive definite "
        "along a direction CG met: raise the damping)."
    )
    iterations: int
    hvps: int
    residuals: list[float] = Field(
        description="||b - (H + damping I) x|| / ||b|| from x = 0 and after each iteration."
    )
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


class InfluenceResponse(BaseModel):
    """Per training example i: `scores[i]` = I_up,loss(z_i, z_test) = -g_i . s_test with
    s_test = (C + damping I)^-1 grad L_test (positive: harmful, up-weighting it raises the
    test loss; negative: helpful), and `removal[i]`, the predicted change of the test
    loss if example i were left out of the training loss (-c * scores[i], c = 1/N for a
    mean loss, 1 for a sum)."""

    scores: list[float]
    removal: list[float]
    helpful: list[int] = Field(
        description="Examples with a negative score, most negative "
        "first: at most top_k, fewer (even none) when fewer are "
        "negative."
    )
    harmful: list[int] = Field(
        description="Examples with a positive score, largest first: "
        "at most top_k, fewer (even none) when fewer are positive; "
        "never one of `helpful`."
    )
    test_loss: float
    s_test: Tensors = Field(description="(C + damping I)^-1 grad L_test, per source.")
    curvature: CurvatureKind = deprecated_curvature_field()
    converged: bool
    stopped: Stopped = Field(
        description="Of the CG solve: converged, max_iterations, "
        "max_hvps, time_limit or negative_curvature (raise the damping)."
    )
    iterations: int
    hvps: int = Field(
        description="Curvature-vector products of the CG solve (what max_hvps "
        "bounds). Besides them every request takes a fixed few passes, not "
        "counted here: the test loss's gradient (one forward and backward pass "
        "over the model at the test points), the scores (one JVP through the "
        "model at the training data), the per-example scale (two loss gradients "
        "on the output, no pass over the model), and for the Monte-Carlo Fisher "
        "`samples` loss gradients on the output (no pass over the model)."
    )
    residuals: list[float]
    seconds: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()


# The requests, by their table rows (named here too, for imports and the jobs' schema).
EigenvaluesRequest = REQUEST_MODELS["tape_eigenvalues"]
TraceRequest = REQUEST_MODELS["tape_trace"]
DiagonalRequest = REQUEST_MODELS["tape_diagonal"]
SpectralDensityRequest = REQUEST_MODELS["tape_spectral_density"]
SolveRequest = REQUEST_MODELS["tape_solve"]
InfluenceRequest = REQUEST_MODELS["tape_influence"]
