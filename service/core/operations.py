"""The operations on a tape, declared once: one `Operation` row each.

Both processes import this module (it needs msgspec only: no engine, no FastAPI). From
the table come the HTTP routes and their OpenAPI schemas (service/api/routes/tapes.py
builds each request model from the row's options), the worker's handlers and the
sharded coordinator's algorithms (service/worker/tapes.py `OPERATION_FUNCTIONS`), the
dispatch tables (service/worker/dispatch.py, service/domain/shards.py) and the SDK's
thin methods (clients/python/gradtape/client/tape.py, one per row's `sdk_method`);
tests/service/test_operations.py walks the table and fails on a row missing from any.

A row's options are one msgspec Struct: what the request body carries besides the call
options every tape request takes (time limit, non-finite inputs, answer encoding,
async) and besides its tensors (`tensors`, decoded by the HTTP side). The HTTP side
validates the body, checks the server's limits, and sends the Struct itself (msgspec
turns it into msgpack-ready builtins and back: `encode_options` / `decode_options`); the
worker receives it typed, never a dict read by string key. Checks that need only the
request live on the Struct (`__post_init__`, run when the HTTP side builds it); checks
that need the tape (its parameter count n) stay in the worker.

Why msgspec: it is made for typed msgpack/JSON messages (Structs are checked on decode,
field by field, with the path in the error), it is small and fast to import in a worker,
and its constraints (`Meta(ge=...)`) and descriptions render as JSON Schema, which the
HTTP side turns into the request model FastAPI documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from service.core import defaults
from service.core.defaults import INT_MAX

# ----------------------------------------------------------------------------------------
# Shared choices
# ----------------------------------------------------------------------------------------


class CurvatureKind(StrEnum):
    """The matrix a tape's products and algorithms use: the Hessian of the target, or,
    on a tape that names its `output`, the generalized Gauss-Newton matrix J^T H_L J,
    the Fisher (exact for softmax/sigmoid cross-entropy and squared error, where it is
    the GGN; Monte-Carlo with `samples`), or the empirical Fisher in one of two
    conventions: `empirical_fisher` (ours) c sum_i g_i g_i^T with one gradient g_i per
    example (c = 1/N for a mean loss, 1 for a sum); `empirical_fisher_terms`
    (curvlinops' EFLinearOperator) with one gradient per loss term, the rows along the
    output's last axis, each of its term's summed loss, times 1/R for a loss that is
    (1/R) x their sum. They agree where an example is one term; squared error averaged
    over C outputs gives curvlinops' C times ours, a softmax per position another
    matrix (docs/guides/curvature.md)."""

    hessian = "hessian"
    ggn = "ggn"
    fisher = "fisher"
    empirical_fisher = "empirical_fisher"
    kfac = "kfac"  # the GGN's KFAC (expand; sources outside layers as an exact block)
    ekfac = "ekfac"
    empirical_fisher_terms = "empirical_fisher_terms"


class Which(StrEnum):
    """Which eigenvalues: largest algebraic (LA), largest magnitude (LM), smallest
    algebraic (SA)."""

    LA = "LA"
    LM = "LM"
    SA = "SA"


class EigenMethod(StrEnum):
    """How eigenvalues are found: Lanczos with full reorthogonalization, or deflated
    (block) power iteration."""

    lanczos = "lanczos"
    power = "power"


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


class Preconditioner(StrEnum):
    """A preconditioner of influence's CG solve: none, or the damped inverse of the
    GGN's KFAC or EKFAC (service/worker/curvature_ops.py)."""

    none = "none"
    kfac = "kfac"
    ekfac = "ekfac"


class OptionError(ValueError):
    """A request's options contradict each other; `field` names the one to change, and
    `problem` the problem type the HTTP answer (422) takes."""

    def __init__(self, field: str, message: str, problem: str = "validation"):
        super().__init__(message)
        self.field = field
        self.problem = problem


MAX_HVPS_DESCRIPTION = (
    "Most HVPs (vectors) the algorithm may use (at most the server's algorithm_max_hvps)."
)
MAX_SECONDS_DESCRIPTION = (
    "Seconds the algorithm may run; it then stops and answers what it has "
    "(default and maximum: 90% of the request's time limit; at least "
    f"{defaults.ALGORITHM_MIN_SECONDS}, smaller values are refused; after a tape rebuild "
    f"the algorithm still gets at least {defaults.ALGORITHM_MIN_SECONDS} s)."
)
TOLERANCE_DESCRIPTION = (
    "Stop early once the standard error is at most rtol * |estimate| + atol (a diagonal: "
    "its root-mean-square standard error against rms(diagonal)); checked from 30 samples "
    "on, whatever the batch size: fewer give no standard error; stochastic methods only."
)
SEED_DESCRIPTION = "Seed of the random vectors (null: fresh ones)."


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every operation's options. `max_hvps` is the HVP budget the server's
    algorithm_max_hvps bounds (None: the operation's own default, `hvp_budget`)."""

    def hvp_budget(self, server_max: int) -> int:
        """The HVPs the request may use: its max_hvps, or the operation's default (which
        the server's algorithm_max_hvps caps where the row says so)."""
        budget: int = getattr(self, "max_hvps")  # noqa: B009 (every algorithm has one)
        return budget


class CurvatureChoice(Options, kw_only=True):
    """The curvature a tape's products and algorithms apply."""

    curvature: Annotated[
        CurvatureKind,
        Meta(
            description="Which curvature matrix (see CurvatureKind); all "
            "but hessian need a tape recorded with `output`."
        ),
    ] = CurvatureKind.hessian
    samples: (
        Annotated[
            int,
            Meta(
                ge=1,
                le=10_000,
                description="With curvature fisher: targets drawn per example "
                "from the model's predictive distribution (a Monte-Carlo Fisher, fixed by "
                "`fisher_seed`); absent: the exact Fisher.",
            ),
        ]
        | None
    ) = None
    fisher_seed: (
        Annotated[
            int,
            Meta(
                le=INT_MAX,
                ge=0,
                description="Seed of the Monte-Carlo Fisher's targets: with `samples` (absent: 0).",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        if self.samples is not None and self.curvature != CurvatureKind.fisher:
            raise OptionError(
                "samples", "'samples' draws a Monte-Carlo Fisher: it goes with curvature 'fisher'"
            )
        if self.fisher_seed is not None and self.samples is None:
            # (Dropped unread, it would promise a seeded estimate where the answer is exact.)
            raise OptionError(
                "fisher_seed",
                "'fisher_seed' seeds a Monte-Carlo Fisher's draws: it goes with 'samples' "
                "(and curvature 'fisher'); without 'samples' the Fisher is exact and takes "
                "no seed",
            )

    @property
    def draws_seed(self) -> int:
        """The seed of a Monte-Carlo Fisher's targets (0 when none was given)."""
        return 0 if self.fisher_seed is None else self.fisher_seed


# ----------------------------------------------------------------------------------------
# The curvature an answer used (every curvature answer's `curvature_used`)
# ----------------------------------------------------------------------------------------


class CurvatureUsed(msgspec.Struct, kw_only=True):
    """The matrix a curvature answer was computed on, stated on the answer itself
    (`curvature_used`): an exact method on a sampled or Kronecker-factored matrix is
    exact for that matrix only, and says so here."""

    kind: Annotated[
        str,
        Meta(
            description="The curvature (see CurvatureKind): hessian, ggn, fisher, "
            "empirical_fisher or empirical_fisher_terms; for curvature kfac/ekfac, the "
            "matrix they approximate (the GGN)."
        ),
    ]
    samples: Annotated[
        int | None,
        Meta(description="A Monte-Carlo Fisher: targets drawn per example (null: exact)."),
    ] = None
    seed: Annotated[
        int | None, Meta(description="A Monte-Carlo Fisher: the seed of its targets.")
    ] = None
    structure: Annotated[
        str | None,
        Meta(
            description="null: the matrix itself; kfac or ekfac: its Kronecker-factored "
            "approximation; diagonal: its diagonal alone."
        ),
    ] = None
    approximate: Annotated[
        bool,
        Meta(
            description="The matrix used is an approximation of `kind` (Monte-Carlo, or a "
            "structure): the answer is then of that approximation, whatever its method "
            "says (an exact trace on a Monte-Carlo Fisher is the sampled matrix's)."
        ),
    ] = False
    reason: Annotated[
        str | None, Meta(description="Why the answer is approximate, and what its stderr is.")
    ] = None


MONTE_CARLO_DRAWS_REASON = (
    "a Monte-Carlo Fisher's diagonal: the mean of {samples} draw(s) per example from the "
    "model's predictive distribution (fisher_seed {seed}), an unbiased estimate of the "
    "exact Fisher's; its stderr is the draws' (the sampling's; unknown from fewer than 30): "
    "raise `samples`, or leave it out for the exact diagonal"
)
MONTE_CARLO_REASON = (
    "a Monte-Carlo Fisher: {samples} target(s) drawn per example from the model's "
    "predictive distribution (fisher_seed {seed}), an unbiased estimate of the exact "
    "Fisher; the answer is of this sampled matrix, and its method and stderr (if any) "
    "are about the estimator over the sampled matrix, not about the sampling: raise "
    "`samples`, or leave it out for the exact Fisher"
)
# A sharded tape's parts each draw their own examples' targets, every part from the same
# fisher_seed (service/worker/shards.py: one curvature per part): not the matrix that
# seed samples on the unsharded tape, and its parts' draws share one random stream.
SHARDED_DRAWS_REASON = (
    "; on this tape's {parts} parts, each part draws its own examples' targets from "
    "fisher_seed {seed} (the same stream in every part): a different sampled matrix from "
    "the unsharded tape's with that seed"
)
KRONECKER_REASON = (
    "{what} approximation of the {kind} ({sharing}; exact only for a linear layer "
    "without weight sharing on one example)"
)


def curvature_used(
    choice: CurvatureChoice, structure: str | None = None, monte_carlo: str = MONTE_CARLO_REASON
) -> CurvatureUsed:
    """The matrix a request's curvature fields (and, for a fit, its `structure`:
    kfac, ekfac or diagonal) make an answer's; `monte_carlo`: what a Monte-Carlo
    Fisher's reason says of the answer's stderr."""
    kind = str(choice.curvature)
    reasons = []
    if kind in (CurvatureKind.kfac, CurvatureKind.ekfac):
        # curvature kfac/ekfac on the estimators: the GGN's, expand, others exact
        # (service/worker/curvature_ops.py kfac_operator)
        kind, structure = str(CurvatureKind.ggn), kind
        reasons.append(
            KRONECKER_REASON.format(what=structure.upper(), kind=kind, sharing="expand")
            + "; sources outside matmul and convolution layers as their exact block"
        )
    elif structure in ("kfac", "ekfac"):
        sharing = str(getattr(choice, "sharing", Sharing.expand))
        what = structure.upper()
        reasons.append(KRONECKER_REASON.format(what=what, kind=kind, sharing=sharing))
    elif structure == "diagonal":
        reasons.append(f"the {kind}'s diagonal alone (its off-diagonal entries dropped)")
    if choice.samples is not None:
        reasons.append(monte_carlo.format(samples=choice.samples, seed=choice.draws_seed))
    return CurvatureUsed(
        kind=kind,
        samples=choice.samples,
        seed=None if choice.samples is None else choice.draws_seed,
        structure=structure,
        approximate=bool(reasons),
        reason="; ".join(reasons) or None,
    )


def on_parts(used: CurvatureUsed, parts: int) -> CurvatureUsed:
    """`used` as a tape sharded in `parts` parts answers it: a Monte-Carlo Fisher's
    reason says that each part drew its own (SHARDED_DRAWS_REASON)."""
    if used.samples is None or parts <= 1:
        return used
    extra = SHARDED_DRAWS_REASON.format(parts=parts, seed=used.seed)
    return msgspec.structs.replace(used, reason=(used.reason or "") + extra)


# ----------------------------------------------------------------------------------------
# Deprecated answer fields
# ----------------------------------------------------------------------------------------
# An answer's field leaves in two steps. First it is marked deprecated in the contract
# (`deprecated: true`, its description naming what to read instead and the release that
# drops it) and still answered, since clients read it; then that release removes it
# (tests/service/test_openapi.py fails once the package's version reaches it).


@dataclass(frozen=True)
class Deprecation:
    """A deprecated answer field: since which release, the release that removes it, and
    what to read instead."""

    since: str
    removed_in: str
    instead: str

    def describe(self, what: str) -> str:
        """The field's description in the contract (what it says, after the notice)."""
        return (
            f"Deprecated since gradtape {self.since}, removed in {self.removed_in}: "
            f"{self.instead}. {what}"
        )


# The plain `curvature` string of the answers that had one before `curvature_used`
# (influence, Frobenius norm, a Laplace fit): the same statement, less of it.
CURVATURE_DEPRECATED = Deprecation(
    since="0.1.0",
    removed_in="0.2.0",
    instead="read `curvature_used`, which states the same and more (samples, seed, "
    "structure, approximate and why)",
)
DEPRECATED_CURVATURE_DESCRIPTION = CURVATURE_DEPRECATED.describe(
    "The curvature asked, as a string: `curvature_used.kind`; for `curvature` kfac or "
    "ekfac on an estimator, kfac or ekfac (`curvature_used.structure`, of kind ggn)."
)


class Budget(CurvatureChoice, kw_only=True):
    """The time an algorithm may run (the HVP budget is each operation's own)."""

    def curvature_used(self) -> CurvatureUsed | None:
        """What the answer's `curvature_used` states (None: the operation answers no
        curvature, and its answer has no such field)."""
        return curvature_used(self)

    max_seconds: (
        Annotated[
            float, Meta(ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION)
        ]
        | None
    ) = None


class EstimatorOptions(Budget, kw_only=True):
    """The stochastic estimators' options (trace, diagonal, Frobenius norm): batched
    random probes, an HVP budget, and a stopping rule on the standard error."""

    batch_size: Annotated[
        int,
        Meta(
            le=INT_MAX,
            ge=1,
            description="Random vectors per batched HVP pass "
            "(at most the server's hvp_max_vectors); exact passes take "
            "up to 64 unit vectors (fewer when hvp_max_vectors or the "
            "memory budget is tighter).",
        ),
    ] = 16
    max_hvps: (
        Annotated[
            int,
            Meta(
                le=INT_MAX,
                ge=2,
                description="Most HVPs to use (at most the server's algorithm_max_hvps). "
                "Default: 256; with method exact, n (the tape's parameters, within "
                "algorithm_max_hvps): the exact method never refuses its own default.",
            ),
        ]
        | None
    ) = None
    rtol: Annotated[float, Meta(gt=0, description=TOLERANCE_DESCRIPTION)] | None = None
    atol: Annotated[float, Meta(ge=0, description="Absolute part of the stopping tolerance.")] = 0.0
    seed: Annotated[int, Meta(le=INT_MAX, ge=0, description=SEED_DESCRIPTION)] | None = 0

    def hvp_budget(self, server_max: int) -> int:
        if self.max_hvps is not None:
            return self.max_hvps
        # Exact named without a budget: as many as the server allows; the worker, which
        # knows n, takes n of them (issue 27: it refused the default 256 at n = 2,410).
        return server_max if str(getattr(self, "method", "")) == "exact" else 256


# ----------------------------------------------------------------------------------------
# Each operation's options
# ----------------------------------------------------------------------------------------


class EigenvaluesOptions(Budget, kw_only=True):
    """Extreme eigenvalues (and optionally eigenvectors) of the tape's Hessian (or of the
    `curvature` asked): by Lanczos with full reorthogonalization (one HVP per iteration),
    or by deflated power iteration (k HVPs per step in one batched pass; largest
    magnitude only)."""

    k: Annotated[int, Meta(ge=1, le=1024, description="How many eigenvalues.")] = 1
    method: Annotated[
        EigenMethod,
        Meta(
            description="lanczos (fewest HVPs; any `which`) or power "
            "(deflated power iteration, as hessian-eigenthings and PyHessian run it: the k "
            "largest in magnitude, which = LM)."
        ),
    ] = EigenMethod.lanczos
    which: (
        Annotated[
            Which,
            Meta(
                description="LA: largest algebraic, LM: largest "
                "magnitude, SA: smallest algebraic. Default: LA for lanczos, "
                "LM for power (the only one it finds)."
            ),
        ]
        | None
    ) = None
    tol: Annotated[
        float,
        Meta(
            gt=0,
            lt=1,
            description="Converged when each Ritz residual ||H y - theta y|| <= tol * max |theta|.",
        ),
    ] = 1e-6
    max_hvps: Annotated[int, Meta(le=INT_MAX, ge=1, description=MAX_HVPS_DESCRIPTION)] = 200
    eigenvectors: Annotated[
        bool,
        Meta(
            description="Also answer the eigenvectors, as "
            "tensors per source (unit norm over all sources)."
        ),
    ] = False
    seed: (
        Annotated[
            int,
            Meta(
                le=INT_MAX, ge=0, description="Seed of the random start vector (null: a fresh one)."
            ),
        ]
        | None
    ) = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.which is None:
            self.which = Which.LM if self.method == EigenMethod.power else Which.LA
        if self.method == EigenMethod.power and self.which != Which.LM:
            raise OptionError(
                "which",
                "which: power iteration finds the eigenvalues of largest magnitude (LM) only; "
                f"for {self.which.value} use method lanczos",
                problem="invalid-request",
            )


class TraceOptions(EstimatorOptions, kw_only=True):
    """The trace of the tape's Hessian (or of the `curvature` asked): exact from the n
    unit vectors (in batched passes of up to 64), or estimated by Hutch++ (the top of the
    spectrum taken exactly from a sketch, Hutchinson on the rest) or Hutchinson (the mean
    of z^T H z over Rademacher vectors z), with its standard error."""

    method: Annotated[
        TraceMethod,
        Meta(
            description="auto: exact when max_hvps covers the n HVPs it "
            "takes (n = the tape's parameters), else hutchpp; exact; hutchpp; hutchinson."
        ),
    ] = TraceMethod.auto


class DiagonalOptions(EstimatorOptions, kw_only=True):
    """The diagonal of the tape's Hessian, as tensors per source: exact from the n unit
    vectors (in batched passes of up to 64), or Hutchinson's estimate (the
    mean of z * Hz over Rademacher vectors z) with a standard error per entry."""

    method: Annotated[
        DiagonalMethod,
        Meta(
            description="auto: exact when max_hvps covers the n HVPs it "
            "takes (n = the tape's parameters), else hutchinson; exact; hutchinson."
        ),
    ] = DiagonalMethod.auto

    def curvature_used(self) -> CurvatureUsed | None:
        if self.method == DiagonalMethod.backprop:  # the draws themselves: their stderr
            return curvature_used(self, monte_carlo=MONTE_CARLO_DRAWS_REASON)
        return curvature_used(self)


class SpectralDensityOptions(Budget, kw_only=True):
    """The eigenvalue density of the tape's Hessian by stochastic Lanczos quadrature:
    `steps` Lanczos steps from each of `probes` random vectors (run side by side, one
    batched pass per step) give Ritz nodes and weights; smoothed by a Gaussian of width
    `sigma`, they are a density to plot."""

    probes: Annotated[
        int,
        Meta(
            ge=1,
            le=1024,
            description="Random start vectors (more: a smaller standard error of the density).",
        ),
    ] = 8
    steps: Annotated[
        int,
        Meta(
            ge=1,
            le=4096,
            description="Lanczos steps per probe (capped "
            "at the tape's parameter count): the nodes per probe, i.e. the "
            "resolution.",
        ),
    ] = 64
    sigma: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="Width (standard deviation) of the "
                "Gaussian that smooths the nodes into a density, in eigenvalue units. "
                "Default: the span of the nodes / steps.",
            ),
        ]
        | None
    ) = None
    points: Annotated[
        int,
        Meta(
            ge=2,
            le=10_000,
            description="Grid points spanning the nodes +- 3 sigma (ignored when `grid` is given).",
        ),
    ] = 256
    grid: (
        Annotated[
            list[float],
            Meta(
                min_length=1,
                max_length=10_000,
                description="Where to evaluate the density "
                "(eigenvalues, finite); default: `points` points spanning the nodes +- 3 sigma.",
            ),
        ]
        | None
    ) = None
    max_hvps: (
        Annotated[
            int,
            Meta(
                le=INT_MAX,
                ge=1,
                description=MAX_HVPS_DESCRIPTION
                + " Default: probes x steps, within algorithm_max_hvps.",
            ),
        ]
        | None
    ) = None
    seed: (
        Annotated[int, Meta(le=INT_MAX, ge=0, description="Seed of the probes (null: fresh ones).")]
        | None
    ) = 0

    def hvp_budget(self, server_max: int) -> int:
        # By default every probe may run its steps, within the server's limit (the run
        # then stops at max_hvps, each probe with the steps it reached, and says so).
        if self.max_hvps is None:
            return min(self.probes * self.steps, server_max)
        return self.max_hvps


class SolveOptions(Budget, kw_only=True):
    """Solve (H + damping I) x = b by conjugate gradient on the tape's Hessian. b
    defaults to the recorded gradient: x is then the damped Newton step (subtract it
    from the sources)."""

    damping: Annotated[float, Meta(ge=0, description="Added to the Hessian's diagonal.")] = 1e-3
    tol: Annotated[
        float,
        Meta(gt=0, lt=1, description="Converged when ||b - (H + damping I) x|| <= tol * ||b||."),
    ] = 1e-6
    max_iterations: Annotated[int, Meta(le=INT_MAX, ge=1, description="Most CG iterations.")] = 100
    max_hvps: (
        Annotated[
            int,
            Meta(le=INT_MAX, ge=1, description=MAX_HVPS_DESCRIPTION + " Default: max_iterations."),
        ]
        | None
    ) = None

    def hvp_budget(self, server_max: int) -> int:
        return self.max_iterations if self.max_hvps is None else self.max_hvps


class InfluenceOptions(Budget, kw_only=True):
    """Influence functions (Koh and Liang, 2017) on a tape recorded with `output`: the
    effect of every training example (a row along the output's first axis) on the loss
    at test points."""

    preconditioner: Annotated[
        Preconditioner,
        Meta(
            description="Precondition the CG solve with the damped inverse of the GGN's "
            "KFAC (or EKFAC): fewer iterations where the curvature is ill-conditioned; the "
            "solve, and so the answer, is still on `curvature`."
        ),
    ] = Preconditioner.none
    # The GGN by default: the Hessian of a trained non-convex model is often indefinite,
    # and CG on it stops at negative curvature with scores that mean nothing (issue 27).
    curvature: Annotated[
        CurvatureKind,
        Meta(
            description="Which curvature matrix C (see CurvatureKind): the GGN by default, "
            "positive semi-definite for convex losses of the output (squared error, "
            "cross-entropies), so that C + damping I is positive definite; the Hessian of "
            "a trained non-convex model is often indefinite, and CG on it stops at "
            "negative_curvature (then raise the damping above minus its smallest "
            "eigenvalue)."
        ),
    ] = CurvatureKind.ggn

    damping: Annotated[
        float,
        Meta(
            ge=0,
            description="Added to the curvature's diagonal "
            "(an L2 term (lam/2)|w|^2 of the training loss is damping "
            "lam).",
        ),
    ] = 1e-3
    top_k: Annotated[
        int,
        Meta(
            ge=0,
            le=10_000,
            description="At most how many helpful "
            "(negative score) and harmful (positive score) examples to list "
            "each; fewer when fewer examples have that sign.",
        ),
    ] = 10
    tol: Annotated[
        float,
        Meta(gt=0, lt=1, description="CG converged when ||b - (C + damping I) s|| <= tol * ||b||."),
    ] = 1e-6
    max_iterations: Annotated[int, Meta(le=INT_MAX, ge=1, description="Most CG iterations.")] = 100
    max_hvps: (
        Annotated[
            int,
            Meta(
                le=INT_MAX,
                ge=1,
                description=MAX_HVPS_DESCRIPTION + " "
                "Default: max_iterations. It bounds the CG solve's "
                "curvature products only; the passes around it are "
                "fixed (see the answer's `hvps`).",
            ),
        ]
        | None
    ) = None

    def hvp_budget(self, server_max: int) -> int:
        return self.max_iterations if self.max_hvps is None else self.max_hvps


class FrobeniusNormOptions(EstimatorOptions, kw_only=True):
    """The squared Frobenius norm ||C||_F^2 = tr(C^2) of the tape's Hessian (or of the
    `curvature` asked), estimated by Hutchinson on C^2: the mean of ||C z||^2 over
    Rademacher vectors z, with its standard error."""


class FrobeniusNormResult(msgspec.Struct, kw_only=True):
    """The squared Frobenius norm of the tape's curvature and its standard error, with
    what it cost and why it stopped."""

    frobenius_norm_squared: Annotated[
        float, Meta(description="||C||_F^2, the mean of ||C z||^2 over the probes z.")
    ]
    stderr: (
        Annotated[
            float,
            Meta(
                description="Its standard error (sample std / sqrt(samples)); null (unknown) "
                "from fewer than 30 samples."
            ),
        ]
        | None
    )
    curvature: Annotated[
        str,
        Meta(
            description=DEPRECATED_CURVATURE_DESCRIPTION,
            extra_json_schema={"deprecated": True},
        ),
    ]
    samples: Annotated[int, Meta(description="Random probes averaged.")]
    batches: Annotated[int, Meta(description="Batched HVP passes.")]
    batch_size: Annotated[int, Meta(description="Vectors per batched pass.")]
    converged: Annotated[
        bool,
        Meta(
            description="The tolerance was met (without one: every sample asked for was "
            "drawn, and a standard error is known)."
        ),
    ]
    stopped: Annotated[str, Meta(description="tolerance, max_hvps or time_limit.")]
    hvps: int
    seconds: float


ONE_PASS_SECONDS_DESCRIPTION = (
    "Refused: this operation runs in one pass and has no partial answer to stop with; "
    "bound it with `time_limit` (or run it as a job)."
)


class OnePass(Budget, kw_only=True):
    """Options of an operation that runs to its end or not at all (per-example
    gradients, KFAC, a Laplace fit): nothing partial to answer at `max_seconds`, so a
    max_seconds, which the algorithms honour, is refused rather than ignored."""

    max_seconds: Annotated[float, Meta(description=ONE_PASS_SECONDS_DESCRIPTION)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_seconds is not None:
            raise OptionError("max_seconds", ONE_PASS_SECONDS_DESCRIPTION.removeprefix("Refused: "))


class PerExampleOptions(OnePass, kw_only=True):
    """Per-example gradients of a tape recorded with `output` (its examples along the
    output's first axis) and their statistics, in one batched pass (the curvature fields
    are not used)."""

    gradients: Annotated[
        bool,
        Meta(
            description="Also answer every example's gradient (N x the parameters: refused "
            "past the server's memory budget); the statistics alone run in chunks of examples."
        ),
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.curvature != CurvatureKind.hessian:
            raise OptionError("curvature", "per-example gradients take no curvature")

    def curvature_used(self) -> CurvatureUsed | None:
        return None  # gradients, not a curvature


class Sharing(StrEnum):
    """KFAC under weight sharing (a convolution's positions, a sequence's steps):
    KFAC-expand or KFAC-reduce (Eschenhagen et al. 2023)."""

    expand = "expand"
    reduce = "reduce"


KFAC_CURVATURES = (CurvatureKind.ggn, CurvatureKind.fisher, CurvatureKind.empirical_fisher)


class KFACOptions(OnePass, kw_only=True):
    """KFAC (or EKFAC) of a tape recorded with `output`, on the matmul and convolution
    layers found in its program: of the GGN (type-2), the Fisher (exact, or Monte-Carlo
    with `samples`) or the empirical Fisher."""

    curvature: Annotated[
        CurvatureKind,
        Meta(description="ggn (type-2), fisher (Monte-Carlo with samples) or empirical_fisher."),
    ] = CurvatureKind.ggn
    sharing: Annotated[Sharing, Meta(description="See Sharing.")] = Sharing.expand
    ekfac: Annotated[
        bool,
        Meta(
            description="EKFAC: the eigenvalues corrected to the curvature's diagonal in "
            "the Kronecker eigenbasis."
        ),
    ] = False
    others: Annotated[
        str,
        Meta(
            pattern="^(refuse|exact)$",
            description="Sources in no matmul or convolution layer: refused (422 naming "
            "them), or kept as their exact curvature block (at most 4,096 entries).",
        ),
    ] = "refuse"
    separate_bias: Annotated[
        bool,
        Meta(
            description="A bias as its own block (curvlinops' default, laplace-torch's), or "
            "joined to its weight's ([W; b] with a ones row in A)."
        ),
    ] = True
    factors: Annotated[bool, Meta(description="Also answer each layer's factors A and G.")] = False
    damping: Annotated[
        float,
        Meta(ge=0, description="Added to the diagonal for `inverse` and the log-determinant."),
    ] = 0.0
    inverse: Annotated[
        bool,
        Meta(description="Multiply `vector` by (KFAC + damping I)^-1 (exact, per block)."),
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.curvature not in KFAC_CURVATURES:
            raise OptionError(
                "curvature", "KFAC approximates the ggn, the fisher or the empirical_fisher"
            )

    def curvature_used(self) -> CurvatureUsed | None:
        return curvature_used(self, "ekfac" if self.ekfac else "kfac")


class LaplaceSubset(StrEnum):
    """The parameters a Laplace fit covers."""

    all = "all"
    last_layer = "last_layer"


class LaplaceStructure(StrEnum):
    """A Laplace fit's curvature structure, by laplace-torch's names (diag, kron, full).
    `diagonal` and `kfac` are the same two by the names the answers' `curvature_used`
    states them with (and /kfac, `"curvature": "kfac"`), taken as diag and kron."""

    diag = "diag"
    kron = "kron"
    full = "full"
    diagonal = "diagonal"
    kfac = "kfac"


# A structure named as curvature_used names it -> laplace-torch's name, which the fit uses.
LAPLACE_STRUCTURE_ALIASES = {
    LaplaceStructure.diagonal: LaplaceStructure.diag,
    LaplaceStructure.kfac: LaplaceStructure.kron,
}


class LaplaceOptions(OnePass, kw_only=True):
    """Fit a Laplace approximation at the tape's point (a trained model), kept with the
    tape under the `laplace_id` answered."""

    curvature: Annotated[
        CurvatureKind,
        Meta(
            description="ggn (= the Fisher of the recognised likelihood) or "
            "empirical_fisher (of the negative log-likelihood: laplace-torch's regression "
            "empirical Fisher is twice it)."
        ),
    ] = CurvatureKind.ggn
    subset: Annotated[
        LaplaceSubset,
        Meta(description="all sources, or the last matmul layer's weight and bias."),
    ] = LaplaceSubset.all
    structure: Annotated[
        LaplaceStructure,
        Meta(
            description="The curvature as its diagonal (diag), KFAC (kron), or the full "
            "matrix (small n); `diagonal` and `kfac`, as curvature_used names them, are "
            "diag and kron (the answer's `structure` says diag or kron)."
        ),
    ] = LaplaceStructure.kron
    prior_precision: Annotated[
        float, Meta(gt=0, description="The scalar prior precision (with tune: unused).")
    ] = 1.0
    tune: Annotated[
        bool,
        Meta(
            description="Tune the prior precision: the marginal likelihood's exact "
            "maximiser (the root of its derivative, found to the last bit)."
        ),
    ] = False
    sigma_noise: Annotated[
        float, Meta(gt=0, description="Regression: the observation noise's standard deviation.")
    ] = 1.0
    sharing: Annotated[Sharing, Meta(description="For structure kron.")] = Sharing.expand

    def __post_init__(self) -> None:
        super().__post_init__()
        self.structure = LAPLACE_STRUCTURE_ALIASES.get(self.structure, self.structure)
        if self.curvature not in (CurvatureKind.ggn, CurvatureKind.empirical_fisher):
            raise OptionError("curvature", "a Laplace fit takes the ggn or the empirical_fisher")

    def curvature_used(self) -> CurvatureUsed | None:
        return curvature_used(self, {"kron": "kfac", "diag": "diagonal"}.get(self.structure))


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One figure of a finished job's progress, read from the answer's `key` as `take`
    says (service/domain/jobs.py TAKES): value (as it is), last (a list's last entry),
    count (a list's length), exact_share (1.0 once an exact method answered every entry,
    `key` not null; null for a stochastic one, whose running share is no answer)."""

    key: str
    take: str = "value"


@dataclass(frozen=True)
class FinalProgress:
    """What a finished job's progress copies from its answer (`final_progress` in
    service/domain/jobs.py), so that its last event never disagrees with the result:
    `done` from the answer's HVP count, `estimate` and `error` from their figures. A
    figure left None keeps the last report's (an operation that reports none: null)."""

    done: str | None = "hvps"
    estimate: Figure | None = None
    error: Figure | None = None

    def keys(self) -> list[str]:
        """The answer keys it reads."""
        figures = (self.estimate, self.error)
        return [k for k in (self.done, *(f.key for f in figures if f)) if k is not None]


ONE_PASS_PROGRESS = FinalProgress(done=None)  # one pass: no HVPs, no running figures


class Sharded(StrEnum):
    """What an operation does on a sharded tape (its batch split over workers)."""

    algorithm = "algorithm"  # runs once, its products asked of every part and summed
    own = "own"  # a sharded path of its own (service/domain/shards.py names it)
    refused = "refused"  # answered 422 with the row's `refusal`


@dataclass(frozen=True)
class Operation:
    """One operation on a tape: everything the processes need to know of it."""

    kind: str  # the worker message kind, also the key of every table built from this one
    path: str  # POST /v1/tapes/{tape_id}/<path>
    options: type[Budget]  # every operation has a curvature choice and a time budget
    # The answer: a msgspec Struct declared beside the options (the HTTP side makes its
    # response schema from it), or the name of a response model in service/api/schemas.
    result: str | type[msgspec.Struct]
    summary: str
    description: str
    sdk_method: str  # RemoteTape.<sdk_method> in the Python SDK ("": RemoteTape.call only)
    diagnosis: str  # how a non-finite answer of a sound tape is named ("the ... overflowed")
    sharded: Sharded = Sharded.algorithm
    refusal: str = ""  # why a sharded tape refuses it (sharded == refused)
    # Request fields that are tensors, decoded by the HTTP side and handed to the worker
    # beside the options: field -> {kind: "vector" | "inputs" | "rows", description,
    # one_of: True (exactly one of the fields so marked), min_length, max_length}.
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    job: bool = True  # may run as a job ("async": true or Prefer: respond-async)
    route_name: str = ""  # the route's name and OpenAPI operationId (default: the kind)
    # What a finished job's progress copies from the answer; every row says (no default:
    # a row without it does not import), tests/service/test_operations.py checks its
    # keys against a real answer.
    progress: FinalProgress = field(kw_only=True)

    @property
    def name(self) -> str:
        return self.route_name or self.kind

    @property
    def result_name(self) -> str:
        if isinstance(self.result, str):
            return self.result
        return self.result.__name__.removesuffix("Result") + "Response"

    @property
    def request(self) -> str:
        return self.options.__name__.removesuffix("Options") + "Request"

    @property
    def answers_curvature(self) -> bool:
        """Its answer states `curvature_used` (its options say so: every row but one
        whose options' curvature_used() is None)."""
        return self.options().curvature_used() is not None


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "tape_eigenvalues",
        "eigenvalues",
        EigenvaluesOptions,
        "EigenvaluesResponse",
        "Extreme eigenvalues and eigenvectors of a tape's Hessian (Lanczos, power)",
        """The `k` largest (LA), largest-magnitude (LM) or smallest (SA) eigenvalues of the
        Hessian of the tape's target over its sources (or of the `curvature` asked), in the
        worker (no round trip per HVP): by Lanczos with full reorthogonalization, one HVP per iteration, or
        (`method: power`) by deflated power iteration, k HVPs per batched step, largest
        magnitude only. With `eigenvectors`, the eigenvectors as tensors per source. Stops
        at convergence, `max_hvps` or `max_seconds` and says which (`stopped`), with the
        HVPs used and the residuals. Lanczos may find a repeated eigenvalue once only
        unless the whole space is spanned.""",
        sdk_method="eigenvalues",
        diagnosis="eigenvalue iteration",
        route_name="compute_tape_eigenvalues",
        progress=FinalProgress(estimate=Figure("eigenvalues"), error=Figure("residuals")),
    ),
    Operation(
        "tape_trace",
        "trace",
        TraceOptions,
        "TraceResponse",
        "Trace of a tape's Hessian (exact, Hutch++, Hutchinson)",
        """tr(H) (or of the `curvature` asked): exact from the n unit vectors in batched passes of up to 64 (`method:
        auto` picks it when `max_hvps` covers n), else by Hutch++ (or Hutchinson) with its
        standard error, stopping once it is within `rtol`/`atol`, at `max_hvps` or at
        `max_seconds`.""",
        sdk_method="trace",
        diagnosis="trace estimate",
        route_name="estimate_tape_trace",
        progress=FinalProgress(estimate=Figure("trace"), error=Figure("stderr")),
    ),
    Operation(
        "tape_diagonal",
        "diagonal",
        DiagonalOptions,
        "DiagonalResponse",
        "Diagonal of a tape's Hessian (exact, Hutchinson)",
        """diag(H) (or of the `curvature` asked) as tensors per source: exact from the n unit vectors in batched passes of
        up to 64 (`method: auto` picks it when `max_hvps` covers n), else Hutchinson's
        estimate with a standard error per entry, stopping once the root-mean-square error
        is within `rtol`/`atol`, at `max_hvps` or at `max_seconds`.""",
        sdk_method="diagonal",
        diagnosis="diagonal estimate",
        route_name="estimate_tape_diagonal",
        progress=FinalProgress(estimate=Figure("diagonal", "exact_share"), error=Figure("error")),
    ),
    Operation(
        "tape_spectral_density",
        "spectral-density",
        SpectralDensityOptions,
        "SpectralDensityResponse",
        "Eigenvalue density of a tape's Hessian (stochastic Lanczos quadrature)",
        """The density of the Hessian's (or the `curvature`'s) eigenvalues by stochastic
        Lanczos quadrature, as
        PyHessian computes it: `steps` Lanczos steps from each of `probes` random vectors,
        the probes side by side (one batched pass per step). Answers the Gaussian-smoothed
        density (width `sigma`) on a grid with its pointwise standard error, and the raw
        Ritz nodes and weights of each probe, so a client can plot or re-smooth it.""",
        sdk_method="spectral_density",
        diagnosis="spectral density (Lanczos quadrature)",
        route_name="estimate_tape_spectral_density",
        progress=FinalProgress(estimate=Figure("nodes", "count")),
    ),
    Operation(
        "tape_solve",
        "solve",
        SolveOptions,
        "SolveResponse",
        "Solve (H + damping I) x = b on a tape (CG)",
        """Conjugate gradient on the tape's Hessian (or the `curvature` asked: a
        Gauss-Newton step with `ggn`) plus `damping` times the identity, one HVP per
        iteration. Without `vector`, b is the recorded gradient and x the damped
        Newton step (the update is sources - x). Answers the residual history; stops at
        `tol`, `max_iterations`, `max_hvps`, `max_seconds`, or at a direction of
        non-positive curvature (raise the damping).""",
        sdk_method="solve",
        diagnosis="conjugate-gradient solve",
        route_name="solve_tape",
        tensors={
            "vector": {
                "kind": "vector",
                "description": "b, a tensor per source (keyed like the gradients); default: "
                "the gradient.",
            }
        },
        progress=FinalProgress(error=Figure("residuals", "last")),
    ),
    Operation(
        "tape_influence",
        "influence",
        InfluenceOptions,
        "InfluenceResponse",
        "Influence of every training example on test points (Koh and Liang)",
        """On a tape recorded with `output` (its examples along the output's first axis):
        s_test = (C + damping I)^-1 grad L_test by conjugate gradient on the curvature C
        (`ggn` by default, or `hessian`, `fisher`, `empirical_fisher`), where L_test is the
        tape's loss at `test_inputs` (new rows for the inputs read along the examples axis)
        or at training `rows`; then the scores -g_i . s_test of every training example in
        one batched pass (no per-example loop), the predicted change of the test loss if
        each were left out, and the `top_k` most helpful and most harmful examples.

        On a sharded tape: the test gradient from the parts, the solve across them
        (products summed), and each part's examples scored by it, in part order (the
        unsharded tape's indices and numbers).""",
        sdk_method="influence",
        diagnosis="influence solve",
        route_name="compute_tape_influence",
        sharded=Sharded.own,
        tensors={
            "test_inputs": {
                "kind": "inputs",
                "one_of": True,
                "description": "The test points: new values for the inputs the model and the "
                "loss read along the examples axis (the data and the targets; same trailing "
                "shapes, any number of rows), as tensors, stored dataset arrays ({dataset, "
                "array, rows}) or a whole dataset ({dataset, rows}: each array the input of "
                "its name). The test loss is the tape's loss on them.",
            },
            "rows": {
                "kind": "rows",
                "one_of": True,
                "min_length": 1,
                "max_length": 100_000,
                "description": "Or: training rows (indices along the examples axis) whose "
                "loss is the test loss.",
            },
        },
        progress=FinalProgress(error=Figure("residuals", "last")),
    ),
    Operation(
        "tape_frobenius_norm",
        "frobenius-norm",
        FrobeniusNormOptions,
        FrobeniusNormResult,
        "Squared Frobenius norm of a tape's Hessian (Hutchinson on C^2)",
        """||C||_F^2 = tr(C^2) of the tape's Hessian (or of the `curvature` asked:
        `ggn`, `fisher`, `empirical_fisher`), estimated as the mean of ||C z||^2 over
        Rademacher vectors z (one HVP per vector, in batched passes of `batch_size`), with
        its standard error; stops once that is within `rtol`/`atol`, at `max_hvps` or at
        `max_seconds`. The norm itself is the square root of the answer.""",
        sdk_method="frobenius_norm",
        diagnosis="Frobenius-norm estimate",
        route_name="estimate_tape_frobenius_norm",
        progress=FinalProgress(estimate=Figure("frobenius_norm_squared"), error=Figure("stderr")),
    ),
)

WHOLE_BATCH = (
    "needs every example in one recording (the per-example walk of the model): record "
    "the tape without shards"
)
OPERATIONS += (
    Operation(
        "tape_per_example",
        "per-example",
        PerExampleOptions,
        "PerExampleResponse",
        "Per-example gradients and their statistics on a tape",
        """On a tape recorded with `output` (its examples along the output's first axis,
        a loss that sums or averages per-example terms): every example's gradient g_i in
        one batched pass (the cost of a few gradients, not N), their L2 norms (overall
        and per source), mean, variance and sum of squares, as BackPACK's BatchGrad,
        BatchL2Grad, Variance and SumGradSquared. The gradients themselves with
        `gradients: true`. A model that mixes examples (a batch mean, batch norm in
        training mode) is refused (422 batch-dependence) naming the line.""",
        sdk_method="per_example",
        diagnosis="per-example gradients",
        route_name="compute_tape_per_example",
        sharded=Sharded.refused,
        refusal=WHOLE_BATCH,
        progress=ONE_PASS_PROGRESS,
    ),
    Operation(
        "tape_kfac",
        "kfac",
        KFACOptions,
        "KFACResponse",
        "Kronecker-factored curvature (KFAC, EKFAC) on a tape",
        """On a tape recorded with `output`: KFAC (or EKFAC) of the GGN, the Fisher (exact,
        or Monte-Carlo with `samples`) or the empirical Fisher, on every matmul (x @ W,
        W @ x, ONNX's Gemm) and convolution layer found in the program, with its bias, as
        curvlinops' KFACLinearOperator scales it; weight sharing by `sharing`. Answers
        each block's eigenvalues (and factors), the trace, the log-determinant, and the
        product of `vector` with KFAC or its damped inverse. The fit is kept with the
        tape; `curvature: kfac` (or `ekfac`) on /eigenvalues, /trace, /diagonal, /solve
        and /influence runs those estimators on it (expand, sources outside layers as
        their exact block), and influence's `preconditioner` uses its inverse.""",
        sdk_method="kfac",
        diagnosis="Kronecker factorisation",
        route_name="compute_tape_kfac",
        sharded=Sharded.refused,
        refusal=WHOLE_BATCH,
        tensors={
            "vector": {
                "kind": "vector",
                "description": "A vector to multiply by KFAC (or its damped inverse), a "
                "tensor per source.",
            }
        },
        progress=ONE_PASS_PROGRESS,
    ),
    Operation(
        "tape_laplace",
        "laplace",
        LaplaceOptions,
        "LaplaceResponse",
        "Fit a Laplace approximation at a tape's point",
        """On a tape recorded with `output` at a trained point: the Laplace approximation
        of the posterior over all sources or the last layer, with the curvature's
        diagonal, KFAC or full matrix (GGN or empirical Fisher) and a scalar prior
        precision given or tuned to the marginal likelihood's exact maximiser. Kept with
        the tape (until it is updated, dropped or rebuilt) under the `laplace_id`
        answered, with its log marginal likelihood; then
        /laplace/{laplace_id}/log-marginal-likelihood, /predictive and /samples.""",
        sdk_method="laplace",
        diagnosis="Laplace fit",
        route_name="fit_tape_laplace",
        sharded=Sharded.refused,
        refusal=WHOLE_BATCH,
        progress=ONE_PASS_PROGRESS,
    ),
)
BY_KIND: dict[str, Operation] = {op.kind: op for op in OPERATIONS}


CURVATURE_FIELDS = ("curvature", "samples", "fisher_seed")


def curvature_choice(raw: Any) -> CurvatureChoice:
    """The curvature fields of any options, or of a message's `curvature` (a tape HVP's,
    an influence part's), as a CurvatureChoice."""
    if raw is None:
        return CurvatureChoice()
    if isinstance(raw, CurvatureChoice):
        raw = {k: getattr(raw, k) for k in CURVATURE_FIELDS}
    return msgspec.convert(raw, CurvatureChoice, strict=False)


def encode_options(options: Options) -> dict[str, Any]:
    """The options as msgpack-ready builtins (for the worker's message)."""
    encoded: dict[str, Any] = msgspec.to_builtins(options)
    return encoded


def decode_options(op: Operation, raw: Any) -> Budget:
    """The typed options back from a message; a malformed one raises msgspec's
    ValidationError naming the field."""
    return msgspec.convert(raw, op.options, strict=False)
