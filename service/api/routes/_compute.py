"""What the four compute routes share: find the stored model a request names, prepare
the payload, run it on the pool, write the answer. Failures propagate to the handlers
in service.api.errors."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from service.api.negotiation import Negotiated, answer
from service.api.payloads import Prepared
from service.datasets import DatasetCatalog
from service.schemas import DefinitionRequest
from service.sessions import ModelCatalog
from service.workers import WorkerPool


async def stored_definition(body: DefinitionRequest, owner: str, models: ModelCatalog
                            ) -> dict[str, Any] | None:
    """The definition of the stored model the request names (None: it sent one)."""
    if body.model is None:
        return None
    return await models.definition(owner, body.model)


async def run(pool: WorkerPool, kind: str, prepared: Prepared, negotiated: Negotiated,
              owner: str, datasets: DatasetCatalog) -> Response:
    await datasets.bind_prepared(owner, prepared)
    reply = await pool.submit(kind, prepared.payload, time_limit=prepared.time_limit)
    return answer(reply.result, negotiated, prepared.encoding, reply.seconds)
