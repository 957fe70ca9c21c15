"""What the four compute routes share: find the stored model a request names, prepare
the payload, run it on the pool, write the answer. Failures propagate to the handlers
in service.api.errors."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from service.api.negotiation import Negotiated, answer
from service.api.payloads import Prepared
from service.schemas import Definition, DefinitionRequest
from service.sessions import ModelCatalog
from service.workers import WorkerPool


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


async def run(pool: WorkerPool, kind: str, prepared: Prepared, negotiated: Negotiated
              ) -> Response:
    reply = await pool.submit(kind, prepared.payload, time_limit=prepared.time_limit)
    return answer(reply.result, negotiated, prepared.encoding, reply.seconds)
