"""Tapes: record a definition once in a worker, then ask it many questions (HVPs,
gradients and jacobians of other targets, eigenvalues and eigenvectors, the trace, the
diagonal, the spectral density, Newton steps, influence functions; on the Hessian or,
with a named output, the Gauss-Newton and Fisher curvatures) without running the
forward pass again."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import payloads, schemas
from service.api.bodies import GatedRoute
from service.api.deps import (
    DatasetsDep,
    JobsDep,
    ModelsDep,
    NegotiatedDep,
    OwnerDep,
    SettingsDep,
    TapeComputeDep,
    TapeDep,
    TapesDep,
)
from service.api.negotiation import answer
from service.api.openapi import (
    compute_responses,
    msgpack_body,
    problem_responses,
)
from service.api.routes._compute import (
    Operation,
    as_job,
    register,
    respond,
    stored_definition,
)
from service.api.schemas import (
    GradientResponse,
    JacobianResponse,
    TapeCreateRequest,
    TapeCreateResponse,
    TapeGradientRequest,
    TapeHVPRequest,
    TapeHVPResponse,
    TapeInfo,
    TapeJacobianRequest,
    TapeList,
    TapeUpdateRequest,
)
from service.api.schemas.operations import REQUEST_MODELS, RESPONSE_MODELS, OperationRequest
from service.core.operations import (
    BY_KIND,
    CURVATURE_FIELDS,
    OPERATIONS,
    curvature_choice,
    curvature_used,
    on_parts,
)
from service.pool import Reply

router = APIRouter(tags=["tapes"], route_class=GatedRoute)

TAPE_ERRORS = (401, 404)


def _created(tape_id: str, info: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    return {
        "tape_id": tape_id,
        "value": result["value"],
        "gradients": result["gradients"],
        "bytes": info["bytes"],
        "ttl": info["ttl"],
        "expires_at": info["expires_at"],
        "device": info["device"],
        "worker": info["worker"],
        **({"flat": result["flat"]} if "flat" in result else {}),
        **({"nonfinite": result["nonfinite"]} if "nonfinite" in result else {}),
    }


@router.post(
    "/v1/tapes",
    status_code=201,
    response_model=TapeCreateResponse,
    responses={
        **compute_responses("TapeCreateResponse", status=201),
        **problem_responses(401, 404, 429),
    },
    openapi_extra=msgpack_body("TapeCreateRequest"),
    summary="Record a tape",
)
async def create_tape(
    body: TapeCreateRequest,
    negotiated: NegotiatedDep,
    settings: SettingsDep,
    owner: OwnerDep,
    tapes: TapesDep,
    models: ModelsDep,
    datasets: DatasetsDep,
) -> Response:
    """Record the definition's forward pass and the gradient of its scalar `target` over
    the `sources` (as /v1/gradient takes them; or name a stored `model`), and keep the
    recording in one worker. Answers the value, the gradients and the new `tape_id`
    (201, with `Location: /v1/tapes/{tape_id}`).

    Every later request on the tape goes to that worker and reuses the recording: an
    HVP costs only the second-order pass. The tape expires `ttl` seconds after its last
    use, and may be evicted when its worker needs the memory for more recently used
    tapes; its definition is stored, so a restarted worker or service records it again
    transparently. Quotas per API key: 429 past them.

    With `shards`, the batch (the inputs `shard_by` names) is split over that many
    workers, each recording its part as a tape of its own; every later request asks the
    parts and combines their answers (`shard_reduction`), so the answers equal the
    unsharded tape's. A part whose worker is lost is recorded again alone.
    """
    stored = await stored_definition(body, owner, models)
    prepared, ttl = payloads.tape_create(body, settings, stored)
    sharding = payloads.sharding(body, settings)
    await datasets.bind_prepared(owner, prepared)
    if sharding is None:
        tape, result = await tapes.create(
            owner, prepared.payload, ttl, body.model, prepared.time_limit
        )
    else:
        tape, result = await tapes.create_sharded(
            owner, prepared.payload, ttl, body.model, prepared.time_limit, sharding
        )
    response = answer(_created(tape.id, tape.info(True), result), negotiated, prepared.encoding)
    response.status_code = 201
    response.headers["Location"] = f"/v1/tapes/{tape.id}"
    return response


@router.get(
    "/v1/tapes",
    response_model=TapeList,
    responses=problem_responses(401),
    summary="List your tapes",
)
async def list_tapes(owner: OwnerDep, tapes: TapesDep) -> TapeList:
    """The caller's live tapes (those of its API key), oldest first."""
    return TapeList.model_validate(
        {"tapes": [t.info(tapes.loaded(t)) for t in await tapes.live(owner)]}
    )


@router.get(
    "/v1/tapes/{tape_id}",
    response_model=TapeInfo,
    responses=problem_responses(*TAPE_ERRORS),
    summary="A tape's metadata",
)
async def read_tape(tape: TapeDep, tapes: TapesDep) -> TapeInfo:
    """Created, last used, hits, bytes held, device, worker, expiry. An expired or
    evicted tape answers 404 with a detail that says which (type tape-expired or
    tape-evicted); another API key's tape answers 404 as if it did not exist."""
    return TapeInfo.model_validate(tape.info(tapes.loaded(tape)))


@router.delete(
    "/v1/tapes/{tape_id}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(*TAPE_ERRORS),
    summary="Delete a tape",
)
async def delete_tape(tape: TapeDep, tapes: TapesDep, jobs: JobsDep) -> Response:
    """Drop the recording from its worker and the definition from the store. The tape's
    queued and running jobs are cancelled (their worker stops at its next op and is
    free), each job's `error` saying that its tape was deleted."""
    # The tape ends first: no request finds it after, and one that found it before and
    # starts its job later is caught either here or by the job's own check (jobs.start).
    await tapes.delete(tape)
    await jobs.cancel_tape(tape.id)
    return Response(status_code=204)


@router.patch(
    "/v1/tapes/{tape_id}",
    response_model=TapeCreateResponse,
    responses={**compute_responses("TapeCreateResponse"), **problem_responses(*TAPE_ERRORS)},
    openapi_extra=msgpack_body("TapeUpdateRequest"),
    summary="New variable values: record again",
)
async def update_tape(
    body: TapeUpdateRequest,
    tape: TapeDep,
    tapes: TapesDep,
    negotiated: NegotiatedDep,
    settings: SettingsDep,
    owner: OwnerDep,
    datasets: DatasetsDep,
) -> Response:
    """Give some variables and inputs new values (same names and shapes; values are
    cast to the recorded dtype), or all sources one flat `point`, and record the tape
    again at them, keeping its id (the step of an optimizer: one request instead of
    delete + create). An input may be bound to (other rows of) a stored dataset, or a
    bound one replaced by sent data: the next mini-batch without resending anything.
    Answers the new value and gradients. A failed recording keeps the tape as it was."""
    variables, inputs, bare, prepared = payloads.tape_update(body, settings)
    await datasets.bind(owner, inputs, prepared.bindings)
    result = await tapes.update(
        tape,
        variables,
        inputs,
        prepared.time_limit,
        point=prepared.payload.get("point"),
        flat=prepared.payload["flat"],
        bare=bare,
    )
    return answer(_created(tape.id, tape.info(True), result), negotiated, prepared.encoding)


# ----------------------------------------------------------------------------------------
# Questions to a tape: one table row each. Every one takes its request body, builds the
# worker payload with `build`, and runs the worker's `kind` handler on the tape's worker;
# `job` ones may run as jobs ("async": true or Prefer: respond-async).
# ----------------------------------------------------------------------------------------


def _on_tape(name: str, path: str, *rest: Any, **options: Any) -> Operation:
    return Operation(name, f"/v1/tapes/{{tape_id}}/{path}", *rest, **options)


def _curvature_used(body: Any, parts: int) -> dict[str, Any] | None:
    """The `curvature_used` of the answer to this request: a table row's as its options
    declare it (None for a row that answers no curvature), an HVP's from its curvature
    fields; None for the questions that take no curvature (gradient, jacobian). On a
    tape of several `parts`, a Monte-Carlo Fisher says that each part drew its own."""
    if isinstance(body, OperationRequest):
        used = body.options().curvature_used()
    elif isinstance(body, TapeHVPRequest):
        used = curvature_used(curvature_choice({k: getattr(body, k) for k in CURVATURE_FIELDS}))
    else:
        return None
    return None if used is None else msgspec.to_builtins(on_parts(used, parts))


def _add(op: Operation) -> None:
    async def endpoint(request: Request, body: Any, compute: TapeComputeDep) -> Response:
        owner, services, tape = compute.owner, compute.services, compute.tape
        as_job(request, body, op)
        prepared = await services.datasets.bind_prepared(owner, op.build(body, services.settings))
        used = _curvature_used(body, len(tape.shards.parts) if tape.shards is not None else 1)

        async def call() -> Reply:
            reply = await services.tapes.call(tape, op.kind, prepared.payload, prepared.time_limit)
            if used is not None:  # the matrix the answer is of, on the answer (jobs' too)
                reply.result["curvature_used"] = used
            return reply

        return await respond(
            request,
            body,
            compute.negotiated,
            prepared,
            owner=owner,
            tape_id=tape.id,
            call=call,
            job=op.job,
            figures=row.progress if (row := BY_KIND.get(op.kind)) is not None else None,
        )

    register(router, op, endpoint, TAPE_ERRORS)


TAPE_OPERATIONS = (
    _on_tape(
        "compute_tape_hvp",
        "hvp",
        "tape_hvp",
        TapeHVPRequest,
        TapeHVPResponse,
        payloads.tape_hvp,
        "Hessian- (or curvature-) vector products on a tape",
        """H @ v of the tape's target over its sources, with `vector` (a tensor per source)
        or `vectors` (a list: one batched pass). Only the second-order pass over the
        recording runs: no forward pass, no gradient, nothing recorded (the worker's memory
        does not grow however many HVPs are asked).

        With `curvature` (on a tape recorded with `output`), the product of another
        curvature matrix: `ggn` J^T H_L J v (a JVP through the model, the loss's Hessian on
        the output, a VJP back; J is never formed), `fisher` (exact for softmax or sigmoid
        cross-entropy and squared error, where it is the GGN; Monte-Carlo with `samples`),
        `empirical_fisher` (c sum_i g_i g_i^T v with c = 1/N for a mean loss, 1 for a sum),
        or `empirical_fisher_terms` (curvlinops' convention: one gradient per loss term).
        The first such request records the model and loss once more, cut at the output;
        later ones reuse it.""",
    ),
    _on_tape(
        "compute_tape_gradient",
        "gradient",
        "tape_gradient",
        TapeGradientRequest,
        GradientResponse,
        payloads.tape_gradient,
        "Gradient of any target on a tape",
        """The value and gradient of any name of the tape's program (default: its target)
        over any variables or inputs (default: its sources), from the recording: one
        backward pass, the program does not run again.

        On a sharded tape, as the jacobian: its target's gradient combines the parts'
        (over a split input, their rows in order); a name along the split batch axis has
        the parts' gradients added; a name that mixes the examples otherwise is refused
        (422, `target`).""",
    ),
    _on_tape(
        "compute_tape_jacobian",
        "jacobian",
        "tape_jacobian",
        TapeJacobianRequest,
        JacobianResponse,
        payloads.tape_gradient,
        "Jacobian of any target on a tape",
        """The jacobian (full, or per example with `batch`) of any name of the tape's
        program over variables or inputs, from the recording.

        On a sharded tape, the parts' jacobians make the unsharded one: of its target
        (the loss), combined as its gradient; of a name along the split batch axis (the
        output, a per-example loss), the parts' rows in order (block diagonal over a
        split input; per-example blocks with `batch`); of a name that reads no split
        input, any part's. A name that mixes the examples otherwise is refused (422,
        `target`).""",
        job=True,
    ),
) + tuple(
    # The table's operations (service/core/operations.py): request models made from
    # their options, one generic payload (payloads.operation), the row's worker handler.
    _on_tape(
        op.name,
        op.path,
        op.kind,
        REQUEST_MODELS[op.kind],
        RESPONSE_MODELS.get(op.kind) or getattr(schemas, op.result_name),
        payloads.operation,
        op.summary,
        op.description,
        job=op.job,
    )
    for op in OPERATIONS
)
for _operation in TAPE_OPERATIONS:
    _add(_operation)
