"""Stored models: named definitions (with their custom-gradient functions), kept in the
store across restarts; requests name them with `"model"` instead of a definition."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import BoundedRoute
from service.api.deps import DatasetsDep, ModelsDep, NegotiatedDep, OwnerDep, SettingsDep
from service.api.negotiation import JSON
from service.api.openapi import msgpack_body, problem_responses
from service.schemas import ModelCreateRequest, ModelInfo, ModelList
from service.sessions import model_info

router = APIRouter(tags=["models"], route_class=BoundedRoute)

NameParam = Annotated[str, Path(description="The model's name.")]


@router.post(
    "/v1/models",
    status_code=201,
    response_model=ModelInfo,
    responses={200: {"model": ModelInfo, "description": "Replaced (with replace: true)"},
               **problem_responses(400, 401, 404, 406, 409, 413, 415, 422, 429, 502, 503,
                                  504)},
    openapi_extra=msgpack_body("ModelCreateRequest"),
    summary="Store a model",
)
async def create_model(
    body: ModelCreateRequest, negotiated: NegotiatedDep, owner: OwnerDep, models: ModelsDep,
    settings: SettingsDep, datasets: DatasetsDep,
) -> Response:
    """Check the definition (every problem at once, as a 422) and store it under `name`
    for this API key: 201, or 200 when `replace` replaced a model of that name (409
    without it). Requests (gradient, jacobian, hessian, hvp, tapes) then send
    `"model": name` instead of the definition. Models survive restarts; tapes recorded
    from a model keep the definition they were recorded with."""
    definition, bindings = payloads.model_definition(body, settings)
    await datasets.bind(owner, definition, bindings)
    row, created = await models.put(owner, body.name, definition, body.description,
                                    body.replace, settings.time_limit)
    info = ModelInfo.model_validate(model_info(row))
    return Response(info.model_dump_json(), status_code=201 if created else 200,
                    media_type=JSON, headers={"Location": f"/v1/models/{row.name}"})


@router.get("/v1/models", response_model=ModelList, responses=problem_responses(401),
            summary="List your models")
async def list_models(owner: OwnerDep, models: ModelsDep) -> ModelList:
    """The caller's stored models, by name."""
    return ModelList.model_validate(
        {"models": [model_info(row) for row in await models.list(owner)]}
    )


@router.get("/v1/models/{name}", response_model=ModelInfo, responses=problem_responses(401, 404),
            summary="A stored model")
async def read_model(name: NameParam, owner: OwnerDep, models: ModelsDep) -> ModelInfo:
    """What the model's program defines: variables, inputs, every line's shape and dtype,
    its functions and its default sources."""
    return ModelInfo.model_validate(model_info(await models.get(owner, name)))


@router.delete("/v1/models/{name}", status_code=204, response_class=Response,
               responses=problem_responses(401, 404), summary="Delete a stored model")
async def delete_model(name: NameParam, owner: OwnerDep, models: ModelsDep) -> Response:
    """Forget the model (tapes recorded from it keep their own copy)."""
    await models.delete(owner, name)
    return Response(status_code=204)
