from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import BoundedRoute
from service.api.deps import DatasetsDep, ModelsDep, NegotiatedDep, OwnerDep, PoolDep, SettingsDep
from service.api.openapi import compute_responses, msgpack_body
from service.api.routes._compute import run, stored_definition
from service.api.schemas import HVPRequest, HVPResponse

router = APIRouter(tags=["derivatives"], route_class=BoundedRoute)


@router.post(
    "/v1/hvp",
    response_model=HVPResponse,
    responses=compute_responses("HVPResponse"),
    openapi_extra=msgpack_body("HVPRequest"),
    summary="Hessian-vector products",
)
async def compute_hvp(
    body: HVPRequest, negotiated: NegotiatedDep, pool: PoolDep, settings: SettingsDep,
    owner: OwnerDep, models: ModelsDep, datasets: DatasetsDep,
) -> Response:
    """H @ v for a scalar target, with `vector` (one tensor per source, keyed like the
    gradients) or `vectors` (a list of them). The forward pass and the gradient are
    recorded once and all vectors are answered in one batched second-order pass.
    """
    stored = await stored_definition(body, owner, models)
    return await run(pool, "hvp", payloads.hvp(body, settings, stored), negotiated,
                     owner, datasets)
