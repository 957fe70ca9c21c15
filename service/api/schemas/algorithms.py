"""Algorithms on a tape's curvature (eigenvalues, trace, diagonal, spectral density,
solve, influence): requests and answers."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from service.api.schemas.base import CallOptions, async_field, nonfinite_flag
from service.api.schemas.definitions import Inputs, Tensors, Vector
from service.api.schemas.tapes import CurvatureKind, CurvatureOptions
from service.api.schemas.tensors import Tensor
from service.core import defaults


class Which(StrEnum):
    """Which eigenvalues: largest algebraic (LA), largest magnitude (LM), smallest
    algebraic (SA)."""

    LA = "LA"
    LM = "LM"
    SA = "SA"


MAX_HVPS_DESCRIPTION = (
    "Most HVPs (vectors) the algorithm may use (at most the server's algorithm_max_hvps)."
)
MAX_SECONDS_DESCRIPTION = (
    "Seconds the algorithm may run; it then stops and answers what it has "
    "(default and maximum: 90% of the request's time limit; at least "
    f"{defaults.ALGORITHM_MIN_SECONDS}, smaller values are refused; after a tape rebuild "
    f"the algorithm still gets at least {defaults.ALGORITHM_MIN_SECONDS} s)."
)


class EigenMethod(StrEnum):
    """How eigenvalues are found: Lanczos with full reorthogonalization, or deflated
    (block) power iteration."""

    lanczos = "lanczos"
    power = "power"


class EigenvaluesRequest(CurvatureOptions, CallOptions):
    """Extreme eigenvalues (and optionally eigenvectors) of the tape's Hessian (or of the
    `curvature` asked): by Lanczos with full reorthogonalization (one HVP per iteration),
    or by deflated power iteration (k HVPs per step in one batched pass; largest
    magnitude only)."""

    k: StrictInt = Field(1, ge=1, le=1024, description="How many eigenvalues.")
    method: EigenMethod = Field(
        EigenMethod.lanczos,
        description="lanczos (fewest HVPs; any `which`) or power "
        "(deflated power iteration, as hessian-eigenthings and PyHessian run it: the k "
        "largest in magnitude, which = LM).",
    )
    which: Which | None = Field(
        None,
        description="LA: largest algebraic, LM: largest "
        "magnitude, SA: smallest algebraic. Default: LA for lanczos, "
        "LM for power (the only one it finds).",
    )
    tol: StrictFloat = Field(
        1e-6,
        gt=0,
        lt=1,
        description="Converged when each Ritz residual ||H y - theta y|| <= tol * max |theta|.",
    )
    max_hvps: StrictInt = Field(200, ge=1, description=MAX_HVPS_DESCRIPTION)
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    eigenvectors: StrictBool = Field(
        False,
        description="Also answer the eigenvectors, as "
        "tensors per source (unit norm over all sources).",
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random start vector (null: a fresh one)."
    )
    run_async: StrictBool = async_field()


class TraceMethod(StrEnum):
    """How the trace is taken: exact (n unit vectors), Hutch++, Hutchinson, or auto."""

    auto = "auto"
    exact = "exact"
    hutchpp = "hutchpp"
    hutchinson = "hutchinson"


class DiagonalMethod(StrEnum):
    """How the diagonal is taken: exact (n unit vectors), Hutchinson, or auto; backprop:
    the GGN's, Fisher's or empirical Fisher's exactly (Monte-Carlo for the Fisher with
    `samples`) from per-example passes of the loss Hessian's square-root columns
    (BackPACK's DiagGGNExact and DiagGGNMC), as many as the output has entries per
    example, with no probe and no HVP."""

    auto = "auto"
    exact = "exact"
    hutchinson = "hutchinson"
    backprop = "backprop"


TOLERANCE_DESCRIPTION = (
    "Stop early once the standard error is at most rtol * |estimate| + atol (from 30 "
    "samples on, whatever the batch size: fewer give no standard error; stochastic "
    "methods only)."
)


class TraceRequest(CurvatureOptions, CallOptions):
    """The trace of the tape's Hessian (or of the `curvature` asked): exact from the n
    unit vectors (in batched passes of up to 64), or estimated by Hutch++ (the top of the
    spectrum taken exactly from a sketch, Hutchinson on the rest) or Hutchinson (the mean
    of z^T H z over Rademacher vectors z), with its standard error."""

    method: TraceMethod = Field(
        TraceMethod.auto,
        description="auto: exact when max_hvps covers the n HVPs it "
        "takes (n = the tape's parameters), else hutchpp; exact; hutchpp; hutchinson.",
    )
    batch_size: StrictInt = Field(
        16,
        ge=1,
        description="Random vectors per batched HVP pass "
        "(at most the server's hvp_max_vectors); exact passes take "
        "up to 64 unit vectors (fewer when hvp_max_vectors or the "
        "memory budget is tighter).",
    )
    max_hvps: StrictInt = Field(
        256, ge=2, description="Most HVPs to use (at most the server's algorithm_max_hvps)."
    )
    rtol: StrictFloat | None = Field(None, gt=0, description=TOLERANCE_DESCRIPTION)
    atol: StrictFloat = Field(
        0.0, ge=0, allow_inf_nan=False, description="Absolute part of the stopping tolerance."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random vectors (null: fresh ones)."
    )
    run_async: StrictBool = async_field()


class DiagonalRequest(CurvatureOptions, CallOptions):
    """The diagonal of the tape's Hessian, as tensors per source: exact from the n unit
    vectors (in batched passes of up to 64), or Hutchinson's estimate (the
    mean of z * Hz over Rademacher vectors z) with a standard error per entry."""

    method: DiagonalMethod = Field(
        DiagonalMethod.auto,
        description="auto: exact when max_hvps covers the n HVPs it "
        "takes (n = the tape's parameters), else hutchinson; exact; hutchinson.",
    )
    batch_size: StrictInt = Field(
        16,
        ge=1,
        description="Random vectors per batched HVP pass "
        "(at most the server's hvp_max_vectors); exact passes take "
        "up to 64 unit vectors (fewer when hvp_max_vectors or the "
        "memory budget is tighter).",
    )
    max_hvps: StrictInt = Field(
        256, ge=2, description="Most HVPs to use (at most the server's algorithm_max_hvps)."
    )
    rtol: StrictFloat | None = Field(
        None,
        gt=0,
        description="Stop early once the root-mean-square standard error is at "
        "most rtol * rms(diagonal) + atol (from 30 probes on, whatever the batch size: "
        "fewer give no standard error; hutchinson only).",
    )
    atol: StrictFloat = Field(
        0.0, ge=0, allow_inf_nan=False, description="Absolute part of the stopping tolerance."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random vectors (null: fresh ones)."
    )
    run_async: StrictBool = async_field()


class SpectralDensityRequest(CurvatureOptions, CallOptions):
    """The eigenvalue density of the tape's Hessian by stochastic Lanczos quadrature:
    `steps` Lanczos steps from each of `probes` random vectors (run side by side, one
    batched pass per step) give Ritz nodes and weights; smoothed by a Gaussian of width
    `sigma`, they are a density to plot."""

    probes: StrictInt = Field(
        8,
        ge=1,
        le=1024,
        description="Random start vectors (more: a smaller standard error of the density).",
    )
    steps: StrictInt = Field(
        64,
        ge=1,
        le=4096,
        description="Lanczos steps per probe (capped "
        "at the tape's parameter count): the nodes per probe, i.e. the "
        "resolution.",
    )
    sigma: StrictFloat | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Width (standard deviation) of the "
        "Gaussian that smooths the nodes into a density, in eigenvalue units. Default: the "
        "span of the nodes / steps.",
    )
    points: StrictInt = Field(
        256,
        ge=2,
        le=10_000,
        description="Grid points spanning the nodes +- 3 sigma (ignored when `grid` is given).",
    )
    grid: list[Annotated[StrictFloat, Field(allow_inf_nan=False)]] | None = Field(
        None,
        min_length=1,
        max_length=10_000,
        description="Where to evaluate the density "
        "(eigenvalues, finite); default: `points` points spanning the nodes +- 3 sigma.",
    )
    max_hvps: StrictInt | None = Field(
        None,
        ge=1,
        description=MAX_HVPS_DESCRIPTION + " Default: probes x steps, within algorithm_max_hvps.",
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(0, ge=0, description="Seed of the probes (null: fresh ones).")
    run_async: StrictBool = async_field()


class SolveRequest(CurvatureOptions, CallOptions):
    """Solve (H + damping I) x = b by conjugate gradient on the tape's Hessian. b
    defaults to the recorded gradient: x is then the damped Newton step (subtract it
    from the sources)."""

    vector: Vector | None = Field(
        None,
        description="b, a tensor per source (keyed like the gradients); default: the gradient.",
    )
    damping: StrictFloat = Field(1e-3, ge=0, description="Added to the Hessian's diagonal.")
    tol: StrictFloat = Field(
        1e-6, gt=0, lt=1, description="Converged when ||b - (H + damping I) x|| <= tol * ||b||."
    )
    max_iterations: StrictInt = Field(100, ge=1, description="Most CG iterations.")
    max_hvps: StrictInt | None = Field(
        None, ge=1, description=MAX_HVPS_DESCRIPTION + " Default: max_iterations."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    run_async: StrictBool = async_field()


class InfluenceRequest(CurvatureOptions, CallOptions):
    """Influence functions (Koh and Liang, 2017) on a tape recorded with `output`: the
    effect of every training example (a row along the output's first axis) on the loss
    at test points."""

    test_inputs: Inputs | None = Field(
        None,
        description="The test points: new values for the inputs the model and the loss "
        "read along the examples axis (the data and the targets; same trailing shapes, any "
        "number of rows), as tensors, stored dataset arrays ({dataset, array, rows}) or a "
        "whole dataset ({dataset, rows}: each array the input of its name). The test loss "
        "is the tape's loss on them.",
    )
    rows: list[StrictInt] | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="Or: training rows (indices "
        "along the examples axis) whose loss is the test loss.",
    )
    preconditioner: Literal["none", "kfac", "ekfac"] = Field(
        "none",
        description="Precondition the CG solve with the damped inverse of the GGN's KFAC "
        "(or EKFAC): fewer iterations where the curvature is ill-conditioned; the solve, "
        "and so the answer, is still on `curvature`.",
    )
    damping: StrictFloat = Field(
        1e-3,
        ge=0,
        description="Added to the curvature's diagonal "
        "(an L2 term (lam/2)|w|^2 of the training loss is damping "
        "lam).",
    )
    top_k: StrictInt = Field(
        10,
        ge=0,
        le=10_000,
        description="At most how many helpful "
        "(negative score) and harmful (positive score) examples to list "
        "each; fewer when fewer examples have that sign.",
    )
    tol: StrictFloat = Field(
        1e-6, gt=0, lt=1, description="CG converged when ||b - (C + damping I) s|| <= tol * ||b||."
    )
    max_iterations: StrictInt = Field(100, ge=1, description="Most CG iterations.")
    max_hvps: StrictInt | None = Field(
        None,
        ge=1,
        description=MAX_HVPS_DESCRIPTION + " "
        "Default: max_iterations. It bounds the CG solve's "
        "curvature products only; the passes around it are "
        "fixed (see the answer's `hvps`).",
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    run_async: StrictBool = async_field()

    @model_validator(mode="after")
    def _test_points(self) -> InfluenceRequest:
        if (self.test_inputs is None) == (self.rows is None):
            raise ValueError(
                "give the test points as 'test_inputs' or as training 'rows' (exactly one of them)"
            )
        return self


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
    nonfinite: list[str] | None = nonfinite_flag()


class TraceResponse(BaseModel):
    """The trace and its standard error, with what it cost and why it stopped."""

    trace: float
    stderr: float | None = Field(
        description="Standard error of the estimate: 0 when exact; "
        "hutchinson: sample std / sqrt(samples); hutchpp: that of the "
        "probes of the remainder; exact stopped by max_seconds: that "
        "of n x the mean diagonal entry seen (they are visited in a "
        "random order); null (unknown) from fewer than 30 samples, "
        "which are too few for one."
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
    hvps: int
    seconds: float
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
    hvps: int
    seconds: float
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
    curvature: CurvatureKind
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
    nonfinite: list[str] | None = nonfinite_flag()
