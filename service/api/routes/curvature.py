"""Curvature beyond products on a tape recorded with `output` (issue 30): per-example
gradients and their statistics, Kronecker factors (KFAC, EKFAC), and Laplace
approximations fitted once and kept with the tape under an id. Table rows as
routes/tapes.py declares its questions; each builds its worker payload here and the
worker's curvature_ops.py does the rest."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import GatedRoute
from service.api.deps import ComputeDep, SettingsDep, TapeComputeDep, TapeDep, TapesDep
from service.api.openapi import problem_responses
from service.api.routes._compute import Operation, register, respond, stored_definition
from service.api.schemas.curvature import (
    LaplaceEvidenceRequest,
    LaplaceInfo,
    LaplaceList,
    LaplacePredictiveRequest,
    LaplacePredictiveResponse,
    LaplaceResponse,
    LaplaceSamplesRequest,
    LaplaceSamplesResponse,
    PerExampleDefinitionRequest,
    PerExampleResponse,
)
from service.core.config import Settings
from service.core.errors import ServiceError
from service.domain.requests import Prepared
from service.domain.sessions import Tape, TapeRegistry, iso
from service.pool import Reply

router = APIRouter(tags=["tapes"], route_class=GatedRoute)

TAPE_ERRORS = (401, 404)
LAPLACE_ID = r"^[0-9a-f]{16}$"


# Payloads ---------------------------------------------------------------------------------


def _simple(body: Any, settings: Settings, fields: dict[str, Any]) -> Prepared:
    limit = payloads._time_limit(body, settings)
    return payloads._prepared(body, payloads._decoder(body, settings), fields, limit)


def per_example_definition(
    body: PerExampleDefinitionRequest, settings: Settings, stored: dict[str, Any] | None
) -> Prepared:
    decoder, payload, limit = payloads._common(body, settings, stored)
    del payload["allow_unused"]  # recorded as a tape is: lines the target skips are fine
    payload.update(output=body.output, gradients=body.gradients)
    return payloads._prepared(body, decoder, payload, limit)


def laplace_evidence(body: LaplaceEvidenceRequest, settings: Settings) -> Prepared:
    return _simple(body, settings, {"prior_precision": body.prior_precision})


def laplace_predictive(body: LaplacePredictiveRequest, settings: Settings) -> Prepared:
    limit = payloads._time_limit(body, settings)
    decoder = payloads._decoder(body, settings)
    fields = {
        # Bare numbers read as float64, cast to the input's dtype in the worker (as influence).
        "test_inputs": decoder.inputs(body.test_inputs, "float64", field="test_inputs"),
        "link": body.link.value,
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
            compute: TapeComputeDep,
            laplace_id: str = Path(pattern=LAPLACE_ID, description="The fit's id."),
        ) -> Response:
            return await run(request, body, compute.tape, compute, {"laplace_id": laplace_id})

    else:

        async def endpoint(request: Request, body: Any, compute: TapeComputeDep) -> Response:
            return await run(request, body, compute.tape, compute, {})

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


# The fits themselves: list, read, delete ------------------------------------------------

LaplaceIdPath = Annotated[str, Path(pattern=LAPLACE_ID, description="The fit's id.")]


def _holds_fits(tape: Tape, tapes: TapeRegistry) -> bool:
    """Whether the tape's worker may hold fits of it: a sharded tape holds none, and a
    recording lost (or of older values, patched through another HTTP process) took its
    fits with it. Asking no worker then: it would record the tape only to find none."""
    return tape.shards is None and tapes.loaded(tape) and not tape.stale


def _no_fit(tape: Tape, laplace_id: str) -> ServiceError:
    why = (
        "a sharded tape holds no fit"
        if tape.shards is not None
        else "a fit lives with the tape's recording: deleted, or dropped by an update, a "
        "rebuilt worker or an evicted tape"
    )
    return ServiceError(
        "laplace-not-found",
        f"laplace_id: no Laplace fit {laplace_id!r} on tape {tape.id} ({why}); GET "
        f"/v1/tapes/{tape.id}/laplace lists its fits, POST /v1/tapes/{tape.id}/laplace "
        "makes one",
        errors=[{"field": "laplace_id", "message": f"no fit {laplace_id!r} on this tape"}],
    )


def _info(fit: dict[str, Any]) -> LaplaceInfo:
    created = fit.pop("created")
    fit.pop("curvature")  # (deprecated in the fit's answer; never in this new one)
    return LaplaceInfo.model_validate({**fit, "created_at": iso(created)})


async def _fits(
    tapes: TapeRegistry, tape: Tape, kind: str, settings: Settings, **payload: Any
) -> dict[str, Any]:
    reply = await tapes.call(tape, kind, payload, settings.time_limit)
    return reply.result


@router.get(
    "/v1/tapes/{tape_id}/laplace",
    response_model=LaplaceList,
    responses=problem_responses(*TAPE_ERRORS),
    summary="List a tape's Laplace fits",
)
async def list_laplace_fits(tape: TapeDep, tapes: TapesDep, settings: SettingsDep) -> LaplaceList:
    """The Laplace fits kept with the tape (POST /v1/tapes/{tape_id}/laplace made them),
    oldest first: each one's id, structure, subset, curvature, prior precision, log
    marginal likelihood, the bytes it holds and when it was made. Empty when there are
    none (a sharded tape, a tape whose recording was lost or updated)."""
    if not _holds_fits(tape, tapes):
        return LaplaceList(fits=[])
    found = await _fits(tapes, tape, "tape_laplace_list", settings)
    return LaplaceList(fits=[_info(fit) for fit in found["fits"]])


@router.get(
    "/v1/tapes/{tape_id}/laplace/{laplace_id}",
    response_model=LaplaceInfo,
    responses=problem_responses(*TAPE_ERRORS),
    summary="A Laplace fit's description",
)
async def read_laplace_fit(
    tape: TapeDep, laplace_id: LaplaceIdPath, tapes: TapesDep, settings: SettingsDep
) -> LaplaceInfo:
    """What the fit answered when it was made, at its prior precision now (a
    log-marginal-likelihood request may have changed it), with the bytes it holds and
    when it was made. 404 (laplace-not-found) for a fit the tape does not hold."""
    if not _holds_fits(tape, tapes):
        raise _no_fit(tape, laplace_id)
    return _info(await _fits(tapes, tape, "tape_laplace_read", settings, laplace_id=laplace_id))


@router.delete(
    "/v1/tapes/{tape_id}/laplace/{laplace_id}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(*TAPE_ERRORS),
    summary="Delete a Laplace fit",
)
async def delete_laplace_fit(
    tape: TapeDep, laplace_id: LaplaceIdPath, tapes: TapesDep, settings: SettingsDep
) -> Response:
    """Drop the fit from the tape's worker, freeing its memory (a full fit holds
    parameters^2 values); the tape's `bytes` shrink by it. 404 (laplace-not-found) for a
    fit the tape does not hold."""
    if not _holds_fits(tape, tapes):
        raise _no_fit(tape, laplace_id)
    await _fits(tapes, tape, "tape_laplace_delete", settings, laplace_id=laplace_id)
    return Response(status_code=204)
