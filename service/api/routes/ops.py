from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api.bodies import GatedRoute
from service.api.deps import PoolDep
from service.api.negotiation import JSON
from service.api.openapi import problem_responses
from service.api.schemas import OpCatalogue

router = APIRouter(tags=["definitions"], route_class=GatedRoute)


@router.get(
    "/v1/ops",
    response_model=OpCatalogue,
    responses=problem_responses(502, 503, 504),
    summary="The op catalogue",
)
async def list_ops(request: Request, pool: PoolDep) -> Response:
    """Every op, built-in and operator a program can call, with its signature, its
    parameters (tensor or constant, with defaults) and a one-line doc. Generated from the
    engine's registry, so it lists exactly what the workers run."""
    body: bytes | None = getattr(request.app.state, "catalogue", None)
    if body is None:
        reply = await pool.submit("ops", None, time_limit=30.0)
        body = orjson.dumps({"ops": reply.result})
        request.app.state.catalogue = body
    return Response(body, media_type=JSON)
