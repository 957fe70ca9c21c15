"""Exception handlers: every error becomes application/problem+json, FastAPI's own
(validation, 404, 405) included, and the worker pool's failures map to HTTP here, once,
so routes only call the pool."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.api.problems import (
    PROBLEM_TYPES,
    headers_of,
    problem_response,
    slug_for_status,
    status_of,
)
from service.core.errors import ServiceError
from service.pool import (
    Cancelled,
    ComputeFailed,
    ComputeTimeout,
    PoolBusy,
    PoolError,
    PoolUnavailable,
    WorkerCrashed,
)

log = logging.getLogger("gradtape.service")

# compute.describe_error's types -> problem types
_COMPUTE_TYPES = {
    "definition": "definition",
    "execution": "execution",
    "non-finite": "non-finite",
    "batch-dependence": "batch-dependence",
    "too-large": "too-large",
    "request": "invalid-request",
    "unsupported": "unsupported",
    "out-of-memory": "out-of-memory",
    "device": "device",
    "internal": "internal",
    "cancelled": "cancelled",
    "not-found": "not-found",
    "laplace-not-found": "laplace-not-found",
}

_PROBLEM_FIELDS = ("message", "field", "kind", "section", "line", "column", "op", "shapes")


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in (loc[1:] if loc and loc[0] == "body" else loc)]
    parts = [p for p in parts if not _is_union_label(p)]
    return ".".join(_short(p) for p in _without_input_tags(parts)) or "body"


# The labels pydantic gives the arms of an untagged union in an error's location
# ("list[function-before[whole_float(), constrained-int]]"): its internals, not a field.
_UNION_LABELS = ("list[", "dict[", "function-before[", "function-after[", "function-wrap[")


def _is_union_label(part: str) -> bool:
    return part.endswith("]") and part.startswith(_UNION_LABELS)


# An error saying a value is not of one arm's type (a list, an object): where a union's
# other arm has a real complaint about the value sent, that complaint is the one to show
# first (rows {"step": 0} is "step >= 1", not "not a list").
_ARM_MISMATCHES = {"list_type", "dict_type", "model_type", "model_attributes_type"}


def _most_telling_first(errors: list[Any]) -> list[Any]:
    def other_arm_says_more(err: Any) -> bool:
        if err.get("type") not in _ARM_MISMATCHES:
            return False
        union = tuple(err.get("loc", ()))[:-1]  # the arm's label is the last part
        return any(
            other.get("type") not in _ARM_MISMATCHES
            and tuple(other.get("loc", ()))[: len(union)] == union
            for other in errors
        )

    return sorted(errors, key=other_arm_says_more)


def _without_input_tags(parts: list[str]) -> list[str]:
    """`inputs` is a map of tensors or a dataset binding, and each input a tensor or a
    dataset's array; a variable is a tensor or {value, trainable}: the tags of those
    unions ("map", "TensorValue", "VariableSpec") say nothing a client wrote, so
    `definition.inputs.x.TensorData.dtype` stays the path, and a variable's is
    `definition.variables.w.TensorData.dtype` or `definition.variables.w.value...`."""
    out: list[str] = []
    for part in parts:
        if part == "map" and out[-1:] == ["inputs"]:
            continue
        if part == "TensorValue" and out[-2:-1] in (["inputs"], ["variables"]):
            continue
        if part == "VariableSpec" and out[-2:-1] == ["variables"]:
            continue
        out.append(part)
    return out


def _short(name: str, limit: int = 64) -> str:
    """A client's key as a problem names it: never echoed at length."""
    return name if len(name) <= limit else f"{name[: limit - 3]}..."


def _validation_problem(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    for err in errors:
        kind = err.get("type")
        if kind == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            position = err["loc"][1] if len(err["loc"]) > 1 else "?"
            return problem_response(
                request.scope,
                "malformed-body",
                f"the body is not valid JSON: {reason} at character {position}",
            )
        if kind == "msgpack_invalid":
            return problem_response(request.scope, "malformed-body", err["msg"])
    # The first few problems, and how many more: a body under the size limits can still
    # hold a great many mistakes, and the answer must stay small.
    errors = _most_telling_first(errors)
    shown = errors[: request.app.state.settings.max_reported_problems]
    items = [
        {
            "field": _field(tuple(err.get("loc", ()))),
            "message": err.get("msg", "")[:500],
            "kind": err.get("type"),
        }
        for err in shown
    ]
    first = items[0] if items else {"field": "body", "message": "invalid request"}
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    extra: dict[str, Any] = (
        {"omitted": len(errors) - len(shown)} if len(errors) > len(shown) else {}
    )
    return problem_response(
        request.scope,
        "validation",
        f"{first['field']}: {first['message']}{more}",
        errors=items,
        **extra,
    )


def pool_problem(request: Request, exc: PoolError) -> Response:
    """The problem response for a failure of the pool or of the computation."""
    scope = request.scope
    settings = request.app.state.settings
    retry = {"Retry-After": str(settings.retry_after)}
    if isinstance(exc, ComputeFailed):
        error = exc.error
        slug = _COMPUTE_TYPES.get(error.get("type", ""), "internal")
        problems = error.get("problems")
        errors = None
        if problems is not None:
            errors = [{k: p.get(k) for k in _PROBLEM_FIELDS} for p in problems]
        elif error.get("field"):
            errors = [{"field": error["field"], "message": error.get("message", "")}]
        extra = {
            k: v for k, v in error.items() if k not in ("type", "message", "problems", "field")
        }
        if error.get("type") in ("shard-state-lost", "unavailable"):
            # A sharded request's coordinator lost what it kept between two steps (it
            # was replaced) twice over, or a process could not map the other's shared
            # memory (out of descriptors): nothing wrong with the request; ask again.
            return problem_response(scope, "unavailable", error.get("message", ""), headers=retry)
        if slug == "internal":
            log.error("internal error in a worker: %s", error.get("message"))
        return problem_response(scope, slug, error.get("message", ""), errors=errors, **extra)
    if isinstance(exc, ComputeTimeout):
        return problem_response(
            scope,
            "time-limit",
            f"the computation ran past its time limit of {exc.limit:g} s; worker {exc.worker} "
            "was stopped and is being replaced. Ask for less, or raise time_limit (up to "
            f"{settings.max_time_limit:g} s on this server)",
            time_limit=exc.limit,
        )
    if isinstance(exc, WorkerCrashed):
        return problem_response(
            scope,
            "worker-crashed",
            f"the worker computing this request stopped unexpectedly "
            f"({exc.how}) and is being replaced; the request was not "
            "completed. Retrying is safe, but if this request itself exhausts the worker's "
            "memory it will fail the same way",
            headers=retry,
        )
    if isinstance(exc, Cancelled):
        return problem_response(scope, "cancelled", f"the computation was cancelled: {exc}")
    if isinstance(exc, PoolBusy):
        return problem_response(scope, "busy", str(exc), headers=retry)
    if isinstance(exc, PoolUnavailable):
        return problem_response(scope, "unavailable", str(exc), headers=retry)
    return problem_response(scope, "internal", f"{type(exc).__name__}: {exc}")


def explainer(request: Request) -> Callable[[BaseException], tuple[int, dict[str, Any]]]:
    """For a job started by `request`: its failure as (status, problem body), the problem
    the synchronous request would have answered."""
    scope = {
        "type": "http",
        "method": request.method,
        "path": request.url.path,
        "headers": [],
        "query_string": b"",
        "app": request.app,
    }

    def explain(exc: BaseException) -> tuple[int, dict[str, Any]]:
        if isinstance(exc, ServiceError):
            response = problem_response(
                scope,
                exc.slug,
                exc.detail,
                status=status_of(exc),
                errors=exc.errors,
                **exc.extensions,
            )
        elif isinstance(exc, PoolError):
            response = pool_problem(Request(scope), exc)
        else:
            log.error("unhandled error in a job on %s", scope["path"], exc_info=exc)
            response = problem_response(
                scope, "internal", f"{type(exc).__name__} while answering; see server logs"
            )
        return response.status_code, orjson.loads(response.body)

    return explain


def _allowed_methods(request: Request) -> str:
    """Every documented method on this path (from the OpenAPI document, built once)."""
    table: list[tuple[re.Pattern[str], str]] | None = getattr(
        request.app.state, "allowed_methods", None
    )
    if table is None:
        table = []
        for path, item in request.app.openapi().get("paths", {}).items():
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path))
            table.append((re.compile(f"^{pattern}$"), ", ".join(sorted(m.upper() for m in item))))
        request.app.state.allowed_methods = table
    return next((methods for pattern, methods in table if pattern.match(request.url.path)), "")


def install(app: FastAPI) -> None:
    async def on_problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return problem_response(
            request.scope,
            exc.slug,
            exc.detail,
            status=status_of(exc),
            errors=exc.errors,
            headers=headers_of(exc),
            **exc.extensions,
        )

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_problem(request, exc)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        slug = slug_for_status(exc.status_code)
        detail = str(exc.detail)
        if exc.status_code == 404:
            detail = f"no such path: {request.url.path} (the API is described at /docs)"
        if exc.status_code == 400:  # FastAPI's own: a body its JSON parser gave up on
            detail = (
                "the body could not be parsed as JSON (nested too deeply, or "
                f"otherwise malformed): {detail}"
            )
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            # Starlette names the methods of the first route matching the path only; a
            # path served by several routes (GET, PATCH, DELETE /v1/tapes/{id}) has more.
            allow = _allowed_methods(request) or (headers or {}).get("Allow", "")
            headers = {
                **{k: v for k, v in (headers or {}).items() if k.lower() != "allow"},
                "Allow": allow,
            }
            detail = f"{request.method} is not allowed on {request.url.path}" + (
                f"; allowed: {allow}" if allow else ""
            )
        return problem_response(
            request.scope,
            slug,
            detail,
            status=exc.status_code,
            headers=headers,
        )

    async def on_pool(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, PoolError)
        return pool_problem(request, exc)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            request.scope, "internal", f"{type(exc).__name__} while answering; see server logs"
        )

    app.add_exception_handler(ServiceError, on_problem)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(PoolError, on_pool)
    app.add_exception_handler(Exception, on_unexpected)


__all__ = ["PROBLEM_TYPES", "install", "pool_problem"]
