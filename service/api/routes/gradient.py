from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import BoundedRoute
from service.api.deps import DatasetsDep, ModelsDep, NegotiatedDep, OwnerDep, PoolDep, SettingsDep
from service.api.openapi import compute_responses, msgpack_body
from service.api.routes._compute import run, stored_definition
from service.api.schemas import GradientRequest, GradientResponse

router = APIRouter(tags=["derivatives"], route_class=BoundedRoute)


@router.post(
    "/v1/gradient",
    response_model=GradientResponse,
    responses=compute_responses("GradientResponse"),
    openapi_extra=msgpack_body("GradientRequest"),
    summary="Value and gradients",
)
async def compute_gradient(
    body: GradientRequest, negotiated: NegotiatedDep, pool: PoolDep, settings: SettingsDep,
    owner: OwnerDep, models: ModelsDep, datasets: DatasetsDep,
) -> Response:
    """Run the definition and answer the target's value and its gradient with respect to
    each source (a non-scalar target is differentiated as its sum, as tf.GradientTape
    does).

    `sources` is a list of names (answers keyed by name), a mapping alias -> name
    (answers keyed by alias), a single name, or absent (every trainable variable). A
    source the target does not depend on answers `null`, or zeros with
    `"unconnected": "zero"`.
    """
    stored = await stored_definition(body, owner, models)
    return await run(pool, "gradient", payloads.gradient(body, settings, stored), negotiated,
                     owner, datasets)
