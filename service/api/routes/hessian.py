from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import BoundedRoute
from service.api.deps import (
    DatasetsDep,
    ModelsDep,
    NegotiatedDep,
    OwnerDep,
    PoolDep,
    SettingsDep,
)
from service.api.openapi import job_responses, msgpack_body
from service.api.routes._compute import respond, stored_definition
from service.api.schemas import HessianRequest, HessianResponse

router = APIRouter(tags=["derivatives"], route_class=BoundedRoute)


@router.post(
    "/v1/hessian",
    response_model=HessianResponse,
    responses=job_responses("HessianResponse"),
    openapi_extra=msgpack_body("HessianRequest"),
    summary="Hessian and damped Newton step",
)
async def compute_hessian(
    request: Request, body: HessianRequest, negotiated: NegotiatedDep, pool: PoolDep,
    settings: SettingsDep, owner: OwnerDep, models: ModelsDep, datasets: DatasetsDep,
) -> Response:
    """The Hessian of a scalar target over the sources, as blocks: `hessian[a][b]` has
    shape `a.shape + b.shape`. Refused (422, too-large) above the server's
    `hessian_max_size` parameters: ask /v1/hvp for Hessian-vector products instead.

    With `newton`, also the damped Newton step `(H + damping I)^-1 g` per source (subtract
    it from the sources to take the step).
    """
    stored = await stored_definition(body, owner, models)
    prepared = payloads.hessian(body, settings, stored)
    await datasets.bind_prepared(owner, prepared)
    return await respond(
        request, body, negotiated, prepared, owner=owner,
        call=lambda: pool.submit("hessian", prepared.payload, time_limit=prepared.time_limit),
    )
