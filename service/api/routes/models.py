"""Stored models: named definitions (with their custom-gradient functions), kept in the
store across restarts; requests name them with `"model"` instead of a definition."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import GatedRoute
from service.api.deps import DatasetsDep, ModelsDep, NegotiatedDep, OwnerDep, SettingsDep
from service.api.negotiation import JSON
from service.api.openapi import msgpack_body, problem_responses
from service.api.problems import ProblemError
from service.api.routes._compute import resolve_onnx
from service.api.schemas import STORED_NAME_PATTERN, ModelCreateRequest, ModelInfo, ModelList
from service.domain.sessions import model_info

router = APIRouter(tags=["models"], route_class=GatedRoute)

NameParam = Annotated[str, Path(description="The model's name.")]


@router.post(
    "/v1/models",
    status_code=201,
    response_model=ModelInfo,
    responses={
        200: {"model": ModelInfo, "description": "Replaced (with replace: true)"},
        **problem_responses(400, 401, 404, 406, 409, 413, 415, 422, 429, 502, 503, 504),
    },
    openapi_extra=msgpack_body("ModelCreateRequest"),
    summary="Store a model",
)
async def create_model(
    body: ModelCreateRequest,
    negotiated: NegotiatedDep,
    owner: OwnerDep,
    models: ModelsDep,
    settings: SettingsDep,
    datasets: DatasetsDep,
) -> Response:
    """Check the definition (every problem at once, as a 422) and store it under `name`
    for this API key: 201, or 200 when `replace` replaced a model of that name (409
    without it). Requests (gradient, jacobian, hessian, hvp, tapes) then send
    `"model": name` instead of the definition. Models survive restarts; tapes recorded
    from a model keep the definition they were recorded with."""
    await resolve_onnx(body.definition, owner, models)  # `stored` ONNX files, by reference
    definition, bindings = payloads.model_definition(body, settings)
    await datasets.bind(owner, definition["inputs"], bindings)
    row, created = await models.put(
        owner, body.name, definition, body.description, body.replace, settings.time_limit
    )
    info = ModelInfo.model_validate(model_info(row))
    return Response(
        info.model_dump_json(),
        status_code=201 if created else 200,
        media_type=JSON,
        headers={"Location": f"/v1/models/{row.name}"},
    )


ONNX = "application/onnx"
OnnxNameParam = Annotated[
    str,
    Path(
        description="The model's name: letters, digits, '_', '.', '-' (at most 64).",
        pattern=STORED_NAME_PATTERN,
    ),
]


@router.put(
    "/v1/models/{name}",
    status_code=201,
    response_model=ModelInfo,
    responses={
        200: {"model": ModelInfo, "description": "Replaced"},
        **problem_responses(401, 404, 413, 415, 422, 429, 502, 503, 504),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {ONNX: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    summary="Store an ONNX model",
)
async def put_onnx_model(
    name: OnnxNameParam,
    request: Request,
    owner: OwnerDep,
    models: ModelsDep,
    settings: SettingsDep,
    description: Annotated[str | None, Query(max_length=1000)] = None,
) -> Response:
    """Store the body, an .onnx file (`Content-Type: application/onnx`, at most
    max_onnx_bytes), under `name` for this API key: 201, or 200 when it replaced one.
    A worker loads and checks it first: an invalid or truncated file, or unsupported
    nodes (all listed, with name, op_type, domain and opset), are a 422. Its
    initializers are the variables GET /v1/models/{name} lists. Definitions call it with
    `"models": {"net": {"stored": name}}` and `logits = net(x)` in their program."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != ONNX:
        raise ProblemError(
            "unsupported-media-type",
            f"PUT /v1/models/{{name}} takes an ONNX file with Content-Type: {ONNX}, got "
            f"{media or 'none'!r} (POST /v1/models stores a definition)",
        )
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > settings.max_onnx_bytes:
            raise ProblemError(
                "body-too-large",
                f"the ONNX file is over {settings.max_onnx_bytes:,} bytes (max_onnx_bytes)",
            )
    row, created = await models.put_onnx(owner, name, bytes(data), description, settings.time_limit)
    info = ModelInfo.model_validate(model_info(row))
    return Response(
        info.model_dump_json(),
        status_code=201 if created else 200,
        media_type=JSON,
        headers={"Location": f"/v1/models/{row.name}"},
    )


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses=problem_responses(401),
    summary="List your models",
)
async def list_models(owner: OwnerDep, models: ModelsDep) -> ModelList:
    """The caller's stored models, by name."""
    return ModelList.model_validate(
        {"models": [model_info(row) for row in await models.list(owner)]}
    )


@router.get(
    "/v1/models/{name}",
    response_model=ModelInfo,
    responses=problem_responses(401, 404),
    summary="A stored model",
)
async def read_model(name: NameParam, owner: OwnerDep, models: ModelsDep) -> ModelInfo:
    """What the model's program defines: variables, inputs, every line's shape and dtype,
    its functions and its default sources."""
    return ModelInfo.model_validate(model_info(await models.get(owner, name)))


@router.delete(
    "/v1/models/{name}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(401, 404),
    summary="Delete a stored model",
)
async def delete_model(name: NameParam, owner: OwnerDep, models: ModelsDep) -> Response:
    """Forget the model (tapes recorded from it keep their own copy)."""
    await models.delete(owner, name)
    return Response(status_code=204)
