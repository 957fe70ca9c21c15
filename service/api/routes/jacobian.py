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
from service.api.schemas import JacobianRequest, JacobianResponse

router = APIRouter(tags=["derivatives"], route_class=BoundedRoute)


@router.post(
    "/v1/jacobian",
    response_model=JacobianResponse,
    responses=job_responses("JacobianResponse"),
    openapi_extra=msgpack_body("JacobianRequest"),
    summary="Jacobians, full or per example",
)
async def compute_jacobian(
    request: Request, body: JacobianRequest, negotiated: NegotiatedDep, pool: PoolDep,
    settings: SettingsDep, owner: OwnerDep, models: ModelsDep, datasets: DatasetsDep,
) -> Response:
    """The jacobian of the target with respect to each source, shape
    `target.shape + source.shape`, computed in batched backward passes of the server's
    chunk size.

    With `"batch": true`, per-example jacobians of shape
    `target.shape + source.shape[1:]` (tf.GradientTape.batch_jacobian). The server checks
    that the examples are independent and answers 422 (batch-dependence) when they are
    not, e.g. with batch normalization between the layers.
    """
    stored = await stored_definition(body, owner, models)
    prepared = payloads.jacobian(body, settings, stored)
    await datasets.bind_prepared(owner, prepared)
    return await respond(
        request, body, negotiated, prepared, owner=owner,
        call=lambda: pool.submit("jacobian", prepared.payload, time_limit=prepared.time_limit),
    )
