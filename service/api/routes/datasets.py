"""Datasets: named maps of arrays kept on the server per API key, so that a definition
(or a tape) binds its inputs to them by name and a request carries only parameters."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Query, Request
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

from service.api.auth import OwnerDep
from service.api.bodies import GatedRoute, parsed_body
from service.api.deps import DatasetsDep
from service.api.negotiation import JSON, MSGPACK_ALIASES, bare_media_type
from service.api.openapi import problem_responses
from service.api.payloads import TensorDecoder
from service.api.problems import ProblemError
from service.api.schemas import DatasetInfo, DatasetList, DatasetName, DatasetUpload, Name
from service.api.schemas.tensors import MAX_NAME_CHARS
from service.domain.datasets import dataset_info, load_numpy

router = APIRouter(tags=["datasets"], route_class=GatedRoute)


NameParam = Annotated[DatasetName, Path(description="The dataset's name.")]
_ARRAYS = TypeAdapter(DatasetUpload)
OCTET = "application/octet-stream"

_UPLOAD_SCHEMA = {"$ref": "#/components/schemas/DatasetUpload"}
_BODY = {
    "requestBody": {
        "required": True,
        "description": "The arrays: a map name -> tensor (JSON or msgpack, as tensors travel "
        "in requests), or the bytes of a .npz (arrays by their names) or .npy (one array, "
        "named by the `array` query parameter) as application/octet-stream. Never unpickled.",
        "content": {
            "application/json": {"schema": _UPLOAD_SCHEMA},
            "application/msgpack": {"schema": _UPLOAD_SCHEMA},
            OCTET: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _decode(raw: Any) -> dict[str, Any]:
    """Runs in a thread: the parsed body's arrays, decoded (tensor problems as a 422)."""
    try:
        tensors = _ARRAYS.validate_python(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ProblemError(
            "validation", f"{field}: {err['msg']}", errors=[{"field": field, "message": err["msg"]}]
        ) from None
    decoder = TensorDecoder(allow_nonfinite=True)
    arrays = decoder.tensors(tensors, "body")
    decoder.check()
    return {k: v for k, v in arrays.items() if v is not None}


def _check_member_names(arrays: dict[str, Any]) -> None:
    """An .npz member's name is an array's name: held to what a JSON body's keys are."""
    for array_name in arrays:
        if not 1 <= len(array_name) <= MAX_NAME_CHARS:
            message = f"an array's name has 1 to {MAX_NAME_CHARS} characters (the member's .npy)"
            shown = array_name[:40] + ("..." if len(array_name) > 40 else "")
            raise ProblemError(
                "validation",
                f"body: {message}; got {shown!r}",
                errors=[{"field": "body", "message": message}],
            )


@router.put(
    "/v1/datasets/{name}",
    status_code=201,
    response_model=DatasetInfo,
    responses={
        200: {"model": DatasetInfo, "description": "Replaced"},
        **problem_responses(400, 401, 413, 415, 422, 429),
    },
    openapi_extra=_BODY,
    summary="Store a dataset",
)
async def put_dataset(
    name: NameParam,
    request: Request,
    owner: OwnerDep,
    datasets: DatasetsDep,
    array: Annotated[Name, Query(description="The name of a .npy body's array.")] = "x",
) -> Response:
    """Store the arrays under `name` for this API key (201), or replace them (200).
    Definitions and tapes then bind inputs to them: `"inputs": {"dataset": name}` (every
    array, by its name) or `"inputs": {"X": {"dataset": name, "array": "X"}}`, with
    `"rows": [...]` or `{"start", "stop", "step"}` for a mini-batch. Datasets survive
    restarts; workers keep recently used ones in memory. Limits: max_dataset_bytes per
    dataset, max_dataset_bytes_per_key and max_datasets_per_key (413 past them)."""
    media = bare_media_type(request.headers.get("content-type") or "")
    if media != OCTET and media != JSON and media not in MSGPACK_ALIASES:
        raise ProblemError(
            "unsupported-media-type",
            "a dataset is application/json, "
            f"application/msgpack or {OCTET} (.npy/.npz); got {media or 'none'}",
        )
    if media == OCTET:
        # Sizes are checked from the headers, before anything is decompressed.
        check_size = await datasets.size_check(owner, name)
        arrays = await anyio.to_thread.run_sync(load_numpy, await request.body(), array, check_size)
        _check_member_names(arrays)
    else:  # sized and parsed in a thread, as the route class does for body models
        arrays = await anyio.to_thread.run_sync(_decode, await parsed_body(request))
    row, created = await datasets.put(owner, name, arrays)
    info = DatasetInfo.model_validate(dataset_info(row))
    return Response(
        info.model_dump_json(),
        status_code=201 if created else 200,
        media_type=JSON,
        headers={"Location": f"/v1/datasets/{name}"},
    )


@router.get(
    "/v1/datasets",
    response_model=DatasetList,
    responses=problem_responses(401),
    summary="List your datasets",
)
async def list_datasets(owner: OwnerDep, datasets: DatasetsDep) -> DatasetList:
    """The caller's datasets, by name, with their arrays' dtypes, shapes and bytes."""
    return DatasetList.model_validate(
        {"datasets": [dataset_info(row) for row in await datasets.list(owner)]}
    )


@router.get(
    "/v1/datasets/{name}",
    response_model=DatasetInfo,
    responses=problem_responses(401, 404, 422),
    summary="A dataset's metadata",
)
async def read_dataset(name: NameParam, owner: OwnerDep, datasets: DatasetsDep) -> DatasetInfo:
    """Its arrays (name, dtype, shape, bytes), total bytes, version (changes with the
    arrays) and times; not the arrays themselves."""
    return DatasetInfo.model_validate(dataset_info(await datasets.get(owner, name)))


@router.delete(
    "/v1/datasets/{name}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(401, 404, 422),
    summary="Delete a dataset",
)
async def delete_dataset(name: NameParam, owner: OwnerDep, datasets: DatasetsDep) -> Response:
    """Forget the dataset (tapes and models bound to it keep the arrays they were bound
    to)."""
    await datasets.delete(owner, name)
    return Response(status_code=204)
