"""What the compute routes share: the table row that declares one (`Operation`) and its
registration, finding the stored model a request names, running a prepared payload (or
starting it as a job), writing the answer. Failures propagate to the handlers in
service.api.errors."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from service.api.bodies import prefers_async
from service.api.errors import explainer
from service.api.negotiation import Negotiated, answer
from service.api.openapi import compute_responses, job_responses, msgpack_body, problem_responses
from service.api.problems import ProblemError
from service.api.schemas import Definition, DefinitionRequest
from service.core.errors import ServiceError
from service.core.operations import FinalProgress
from service.domain.jobs import JobRegistry
from service.domain.requests import Prepared
from service.domain.sessions import ModelCatalog
from service.pool import Reply

# Seconds a client over its job quota is told to wait (Retry-After): jobs run for
# seconds to minutes, and GET /v1/jobs says which of its jobs are still active.
JOB_QUOTA_RETRY_AFTER = 5


@dataclass(frozen=True)
class Operation:
    """One compute route, declared as a table row."""

    name: str  # the route's name, and so its OpenAPI operationId
    path: str
    kind: str  # the worker handler (service/worker/compute.py or tapes.py)
    request: type[BaseModel]
    response: type[BaseModel]
    build: Callable[..., Prepared]  # the request's worker payload (service/api/payloads.py)
    summary: str
    description: str
    job: bool = False  # may run as a job ("async": true or Prefer: respond-async)


def register(
    router: APIRouter,
    op: Operation,
    endpoint: Callable[..., Awaitable[Response]],
    problems: tuple[int, ...] = (),
) -> None:
    """Add `endpoint` (whose `body` parameter is typed Any) as op's POST route, with op's
    request model as its body and op's documentation."""
    endpoint.__annotations__["body"] = op.request  # the body FastAPI validates and documents
    endpoint.__name__ = endpoint.__qualname__ = op.name  # for tracebacks and logs
    endpoint.may_run_jobs = op.job  # type: ignore[attr-defined]  # read by bodies.GatedRoute
    responses = job_responses if op.job else compute_responses
    router.post(
        op.path,
        name=op.name,
        response_model=op.response,
        responses={**responses(op.response.__name__), **problem_responses(*problems)},
        openapi_extra=msgpack_body(op.request.__name__),
        summary=op.summary,
        description=inspect.cleandoc(op.description),
    )(endpoint)


async def stored_definition(
    body: DefinitionRequest, owner: str, models: ModelCatalog
) -> dict[str, Any] | None:
    """The definition of the stored model the request names (None: it sent one). The
    ONNX models the sent definition names as `stored` get their files from the store."""
    if body.model is None:
        await resolve_onnx(body.definition, owner, models)
        return None
    return await models.definition(owner, body.model)


async def resolve_onnx(definition: Definition | None, owner: str, models: ModelCatalog) -> None:
    """Fill each `{"stored": name}` model of the definition with that stored ONNX file
    (PUT /v1/models/{name}), which this key must own."""
    for name, model in (definition.models if definition is not None else {}).items():
        if model.stored is not None:
            model.onnx = await models.onnx_file(
                owner, model.stored, f"definition.models.{name}.stored"
            )


def as_job(request: Request, body: Any, op: Operation) -> None:
    """Mark a body that will run as a job (`Prefer: respond-async` asks as `"async":
    true` does) before its payload is built: a job's time limit is its own budget."""
    if op.job and prefers_async(request) and hasattr(body, "run_async"):
        body.run_async = True


async def respond(
    request: Request,
    body: Any,
    negotiated: Negotiated,
    prepared: Prepared,
    call: Callable[[], Awaitable[Reply]],
    owner: str,
    tape_id: str | None = None,
    *,
    job: bool,
    figures: FinalProgress | None = None,
) -> Response:
    """Run `call` and answer its result; or, when the route may run jobs (`job`) and the
    request asks for one (`"async": true` or `Prefer: respond-async`), start it as one
    and answer 202 with its Location and document (`figures`: what the job's progress
    takes from its answer when it ends, as its table row declares)."""
    preferred = job and prefers_async(request)
    if not (preferred or (job and getattr(body, "run_async", False))):
        reply = await call()
        return answer(reply.result, negotiated, prepared.encoding, reply.seconds)

    fairness = request.app.state.fairness

    async def run_job() -> tuple[dict[str, Any], float]:
        async with fairness.slot(owner):  # a job computes within its key's fair share
            reply = await call()
        return reply.result, reply.seconds

    jobs: JobRegistry = request.app.state.jobs
    route = request.scope.get("route")
    operation = f"{request.method} {getattr(route, 'path', request.url.path)}"
    try:
        started = await jobs.start(
            owner, operation, run_job, explainer(request), prepared.encoding, tape_id, figures
        )
    except ServiceError as exc:
        if exc.slug != "quota-exceeded":
            raise
        # At once, never a wait (the request took no slot): when to look again.
        raise ProblemError(
            exc.slug,
            exc.detail,
            errors=exc.errors,
            headers={"Retry-After": str(JOB_QUOTA_RETRY_AFTER)},
            **exc.extensions,
        ) from None
    response = answer(started.info(jobs.settings.job_ttl), negotiated, prepared.encoding)
    response.status_code = 202
    response.headers["Location"] = f"/v1/jobs/{started.id}"
    if preferred:
        response.headers["Preference-Applied"] = "respond-async"
    return response
