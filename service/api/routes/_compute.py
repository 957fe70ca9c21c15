"""What the compute routes share: find the stored model a request names, prepare the
payload, run it on the pool (or start it as a job), write the answer. Failures
propagate to the handlers in service.api.errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.responses import Response

from service.api.errors import explainer
from service.api.negotiation import Negotiated, answer
from service.api.schemas import Definition, DefinitionRequest
from service.domain.jobs import JobRegistry
from service.domain.requests import Prepared
from service.domain.sessions import ModelCatalog
from service.pool import Reply


async def stored_definition(body: DefinitionRequest, owner: str, models: ModelCatalog
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
            model.onnx = await models.onnx_file(owner, model.stored,
                                                f"definition.models.{name}.stored")


def prefers_async(request: Request) -> bool:
    """`Prefer: respond-async` (RFC 7240) among the request's preferences."""
    return any(part.split(";", 1)[0].strip().lower() == "respond-async"
               for value in request.headers.getlist("prefer") for part in value.split(","))


async def respond(request: Request, body: Any, negotiated: Negotiated, prepared: Prepared,
                  call: Callable[[], Awaitable[Reply]], owner: str,
                  tape_id: str | None = None) -> Response:
    """Run `call` and answer its result; or, when the request asks for a job (`"async":
    true` or `Prefer: respond-async`), start it as one and answer 202 with its
    Location and document."""
    preferred = prefers_async(request)
    if not (preferred or getattr(body, "run_async", False)):
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
    job = jobs.start(owner, operation, run_job, explainer(request), prepared.encoding, tape_id)
    response = answer(job.info(jobs.settings.job_ttl), negotiated, prepared.encoding)
    response.status_code = 202
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if preferred:
        response.headers["Preference-Applied"] = "respond-async"
    return response
