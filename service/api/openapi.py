"""The OpenAPI document's shared pieces: problem responses, the msgpack alternatives of
request and response bodies, stable operation ids, and the final touch that files error
responses under application/problem+json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from service.api import examples
from service.api.negotiation import MSGPACK
from service.api.problems import PROBLEM_JSON, PROBLEM_TYPES
from service.api.schemas import Problem
from service.api.schemas.definitions import DATASET_UPLOAD_SCHEMA
from service.api.schemas.tensors import NESTED_NUMBERS_COMPONENTS

# The statuses a compute route may answer besides 200 (each a Problem).
COMPUTE_ERRORS = (400, 401, 404, 406, 413, 415, 422, 500, 502, 503, 504, 507)


def _titles(status: int) -> str:
    titles = sorted({p.title for p in PROBLEM_TYPES.values() if p.status == status})
    return "; ".join(titles) or "Error"


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": Problem, "description": _titles(s)} for s in statuses}


def compute_responses(response_schema: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """`status` in JSON or msgpack, and every problem a compute route can answer."""
    ref = {"$ref": f"#/components/schemas/{response_schema}"}
    return {
        status: {"content": {MSGPACK: {"schema": ref}}},
        **problem_responses(*COMPUTE_ERRORS),
    }


def job_responses(response_schema: str) -> dict[int | str, dict[str, Any]]:
    """compute_responses of a route that may run as a job: 202 with the job's document
    (`"async": true` or `Prefer: respond-async`), 429 past the key's job quota."""
    ref = {"$ref": "#/components/schemas/JobInfo"}
    return {
        **compute_responses(response_schema),
        202: {
            "description": 'Started as a job (`"async": true` or `Prefer: respond-async`): '
            "follow it at the Location, GET /v1/jobs/{job_id}",
            "headers": {
                "Location": {"description": "/v1/jobs/{job_id}", "schema": {"type": "string"}}
            },
            "content": {"application/json": {"schema": ref}, MSGPACK: {"schema": ref}},
        },
        **problem_responses(429),
    }


def msgpack_body(request_schema: str) -> dict[str, Any]:
    """openapi_extra adding the msgpack form of a JSON request body."""
    ref = {"$ref": f"#/components/schemas/{request_schema}"}
    return {"requestBody": {"content": {MSGPACK: {"schema": ref}}}}


def operation_id(route: APIRoute) -> str:
    """The endpoint function's name: compute_gradient, list_ops, check_readiness..."""
    return route.name


def _optional_security(schema: dict[str, Any]) -> None:
    """API keys are required only where the server enables them: `{}` (no key) is
    listed as an alternative on every operation that takes one."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            security = operation.get("security")
            if security is not None and {} not in security:
                security.append({})


def _file_problems_as_problem_json(schema: dict[str, Any]) -> None:
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            for status, response in operation.get("responses", {}).items():
                content = response.get("content", {})
                if status[:1] in "45" and "application/json" in content:
                    content[PROBLEM_JSON] = content.pop("application/json")


def install(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """Replace app.openapi with the finished document (cached like FastAPI's)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
                separate_input_output_schemas=app.separate_input_output_schemas,
            )
            _file_problems_as_problem_json(schema)
            # schemas pydantic does not emit: the levels of a tensor's data lists, and a
            # body declared by hand
            schema["components"]["schemas"].update(NESTED_NUMBERS_COMPONENTS)
            schema["components"]["schemas"]["DatasetUpload"] = DATASET_UPLOAD_SCHEMA
            _optional_security(schema)
            examples.add_to(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
