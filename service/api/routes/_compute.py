"""What the four compute routes share: prepare the payload, run it on the pool, write
the answer. Failures propagate to the handlers in service.api.errors."""

from __future__ import annotations

from starlette.responses import Response

from service.api.negotiation import Negotiated, answer
from service.api.payloads import Prepared
from service.workers import WorkerPool


async def run(pool: WorkerPool, kind: str, prepared: Prepared, negotiated: Negotiated
              ) -> Response:
    reply = await pool.submit(kind, prepared.payload, time_limit=prepared.time_limit)
    return answer(reply.result, negotiated, prepared.encoding)
