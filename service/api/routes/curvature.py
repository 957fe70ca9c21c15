"""Curvature beyond products on a tape recorded with `output` (issue 30): per-example
gradients and their statistics, Kronecker factors (KFAC, EKFAC), and Laplace
approximations fitted once and kept with the tape under an id. Table rows as
routes/tapes.py declares its questions; each builds its worker payload here and the
worker's curvature_ops.py does the rest."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import GatedRoute
from service.api.deps import ComputeDep, TapeDep
from service.api.routes._compute import Operation, register, respond, stored_definition
from service.api.schemas.curvature import (
    KFACRequest,
    KFACResponse,
    LaplaceEvidenceRequest,
    LaplacePredictiveRequest,
    LaplacePredictiveResponse,
    LaplaceRequest,
    LaplaceResponse,
    LaplaceSamplesRequest,
    LaplaceSamplesResponse,
    PerExampleDefinitionRequest,
    PerExampleRequest,
    PerExampleResponse,
)
from service.core.config import Settings
from service.domain.requests import Prepared
from service.pool import Reply

router = APIRouter(tags=["tapes"], route_class=GatedRoute)

TAPE_ERRORS = (401, 404)
LAPLACE_ID = r"^[0-9a-f]{16}$"


# Payloads ---------------------------------------------------------------------------------


def _simple(body: Any, settings: Settings, fields: dict[str, Any]) -> Prepared:
    limit = payloads._time_limit(body.time_limit, settings)
    return payloads._prepared(body, payloads._decoder(body, settings), fields, limit)


def per_example(body: PerExampleRequest, settings: Settings) -> Prepared:
    return _simple(body, settings, {"gradients": body.gradients})


def per_example_definition(
    body: PerExampleDefinitionRequest, settings: Settings, stored: dict[str, Any] | None
) -> Prepared:
    decoder, payload, limit = payloads._common(body, settings, stored)
    del payload["allow_unused"]  # recorded as a tape is: lines the target skips are fine
    payload.update(output=body.output, gradients=body.gradients)
    return payloads._prepared(body, decoder, payload, limit)


def kfac(body: KFACRequest, settings: Settings) -> Prepared:
    limit = payloads._time_limit(body.time_limit, settings)
    decoder = payloads._decoder(body, settings)
    vectors = None
    if body.vectors is not None:
        vectors = [decoder.tensors(v, f"vectors.{i}") for i, v in enumerate(body.vectors)]
    fields = {
        "curvature": body.curvature.value,
        "samples": body.samples,
        "fisher_seed": body.fisher_seed,
        "sharing": body.sharing,
        "ekfac": body.ekfac,
        "others": body.others,
        "separate_bias": body.separate_bias,
        "factors": body.factors,
        "damping": body.damping,
        "vectors": vectors,
        "inverse": body.inverse,
    }
    return payloads._prepared(body, decoder, fields, limit)


def laplace(body: LaplaceRequest, settings: Settings) -> Prepared:
    return _simple(
        body,
        settings,
        {
            "subset": body.subset,
            "structure": body.structure,
            "curvature": body.curvature.value,
            "prior_precision": body.prior_precision,
            "sigma_noise": body.sigma_noise,
            "sharing": body.sharing,
        },
    )


def laplace_evidence(body: LaplaceEvidenceRequest, settings: Settings) -> Prepared:
    return _simple(body, settings, {"prior_precision": body.prior_precision})


def laplace_predictive(body: LaplacePredictiveRequest, settings: Settings) -> Prepared:
    limit = payloads._time_limit(body.time_limit, settings)
    decoder = payloads._decoder(body, settings)
    fields = {
        "test_inputs": decoder.inputs(body.test_inputs, "float32", field="test_inputs"),
        "link": body.link,
        "samples": body.samples,
        "seed": body.seed,
    }
    return payloads._prepared(body, decoder, fields, limit)


def laplace_samples(body: LaplaceSamplesRequest, settings: Settings) -> Prepared:
    return _simple(body, settings, {"count": body.count, "seed": body.seed})


# Routes -----------------------------------------------------------------------------------


def _add(op: Operation, with_laplace: bool = False) -> None:
    async def run(
        request: Request, body: Any, tape: Any, compute: Any, extra: dict[str, Any]
    ) -> Response:
        owner, services = compute.owner, compute.services
        prepared = await services.datasets.bind_prepared(owner, op.build(body, services.settings))
        prepared.payload.update(extra)

        def call() -> Awaitable[Reply]:
            return services.tapes.call(tape, op.kind, prepared.payload, prepared.time_limit)

        return await respond(
            request,
            body,
            compute.negotiated,
            prepared,
            owner=owner,
            tape_id=tape.id,
            call=call,
            job=op.job,
        )

    endpoint: Callable[..., Awaitable[Response]]
    if with_laplace:

        async def endpoint(
            request: Request,
            body: Any,
            tape: TapeDep,
            compute: ComputeDep,
            laplace_id: str = Path(pattern=LAPLACE_ID, description="The fit's id."),
        ) -> Response:
            return await run(request, body, tape, compute, {"laplace_id": laplace_id})

    else:

        async def endpoint(
            request: Request, body: Any, tape: TapeDep, compute: ComputeDep
        ) -> Response:
            return await run(request, body, tape, compute, {})

    register(router, op, endpoint, TAPE_ERRORS)


def _add_stateless(op: Operation) -> None:
    async def endpoint(request: Request, body: Any, compute: ComputeDep) -> Response:
        owner, services = compute.owner, compute.services
        stored = await stored_definition(body, owner, services.models)
        prepared = op.build(body, services.settings, stored)
        await services.datasets.bind_prepared(owner, prepared)

        def call() -> Awaitable[Reply]:
            return services.pool.submit(op.kind, prepared.payload, time_limit=prepared.time_limit)

        return await respond(
            request, body, compute.negotiated, prepared, owner=owner, call=call, job=op.job
        )

    register(router, op, endpoint)


def _row(name: str, path: str, *rest: Any, **options: Any) -> Operation:
    return Operation(name, f"/v1/tapes/{{tape_id}}/{path}", *rest, **options)


_add(
    _row(
        "compute_tape_per_example",
        "per-example",
        "tape_per_example",
        PerExampleRequest,
        PerExampleResponse,
        per_example,
        "Per-example gradients and their statistics on a tape",
        """On a tape recorded with `output` (its examples along the output's first axis,
        a loss that sums or averages per-example terms): every example's gradient g_i in
        one batched pass (the cost of a few gradients, not N), their L2 norms (overall
        and per source), mean, variance and sum of squares, as BackPACK's BatchGrad,
        BatchL2Grad, Variance and SumGradSquared. The gradients themselves with
        `gradients: true`. A model that mixes examples (a batch mean, batch norm in
        training mode) is refused (422 batch-dependence) naming the line.""",
        job=True,
    )
)
_add_stateless(
    Operation(
        "compute_per_example",
        "/v1/per-example",
        "per_example",
        PerExampleDefinitionRequest,
        PerExampleResponse,
        per_example_definition,
        "Per-example gradients and their statistics of a definition",
        """As /v1/tapes/{tape_id}/per-example, for a definition or a stored model sent
        with its `output` line, recorded in a worker for this request only (nothing is
        kept). Runs as a job with `"async": true`: many examples take a while.""",
        job=True,
    )
)
_add(
    _row(
        "compute_tape_kfac",
        "kfac",
        "tape_kfac",
        KFACRequest,
        KFACResponse,
        kfac,
        "Kronecker-factored curvature (KFAC, EKFAC) on a tape",
        """On a tape recorded with `output`: KFAC (or EKFAC) of the GGN, the Fisher
        (exact, or Monte-Carlo with `samples`) or the empirical Fisher, on every matmul
        (x @ W, W @ x) and convolution layer found in the program, with its bias, as
        curvlinops' KFACLinearOperator scales it; weight sharing by `sharing`. Answers
        each block's eigenvalues (and factors), the trace, the log-determinant, and the
        products of `vectors` with KFAC or its damped inverse. The fit is kept with the
        tape; `curvature: kfac` (or `ekfac`) on /eigenvalues, /trace, /diagonal, /solve
        and /influence runs those estimators on it (expand, sources outside layers as
        their exact block).""",
        job=True,
    )
)
_add(
    _row(
        "fit_tape_laplace",
        "laplace",
        "tape_laplace",
        LaplaceRequest,
        LaplaceResponse,
        laplace,
        "Fit a Laplace approximation at a tape's point",
        """On a tape recorded with `output` at a trained point: the Laplace
        approximation of the posterior over all sources or the last layer, with the
        curvature's diagonal, KFAC or full matrix (GGN or empirical Fisher) and a scalar
        prior precision given or tuned to the marginal likelihood's exact maximiser.
        Kept with the tape (until it is updated, dropped or rebuilt) under the
        `laplace_id` answered, with its log marginal likelihood.""",
        job=True,
    )
)
_add(
    _row(
        "compute_laplace_evidence",
        "laplace/{laplace_id}/log-marginal-likelihood",
        "tape_laplace_evidence",
        LaplaceEvidenceRequest,
        LaplaceResponse,
        laplace_evidence,
        "Log marginal likelihood of a Laplace fit",
        """The fit's log marginal likelihood, at a new `prior_precision` (kept for its
        predictive and samples from then on) or tuned ('tune').""",
    ),
    with_laplace=True,
)
_add(
    _row(
        "compute_laplace_predictive",
        "laplace/{laplace_id}/predictive",
        "tape_laplace_predictive",
        LaplacePredictiveRequest,
        LaplacePredictiveResponse,
        laplace_predictive,
        "GLM predictive of a Laplace fit at new inputs",
        """The linearised (GLM) predictive at `test_inputs`: the output and its
        functional covariance J Sigma J^T per input; for regression the noise variance
        beside it, for classification the probabilities by the probit approximation or
        Monte-Carlo.""",
        job=True,
    ),
    with_laplace=True,
)
_add(
    _row(
        "sample_laplace_posterior",
        "laplace/{laplace_id}/samples",
        "tape_laplace_samples",
        LaplaceSamplesRequest,
        LaplaceSamplesResponse,
        laplace_samples,
        "Posterior samples of a Laplace fit",
        """`count` parameter vectors drawn from the fitted posterior N(theta, P^-1), per
        source of its subset.""",
    ),
    with_laplace=True,
)
