"""Errors as application/problem+json (RFC 9457), in one place.

Every error the service answers has a `type` from PROBLEM_TYPES, served as a relative
URI `/problems/<slug>` (GET it for the description), a `title` that is the same for
every occurrence of the type, a `detail` that names the field, the program line and
column or the shapes, the `instance` (the request path), and extension members such
as `errors` (one entry per located problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Scope

from service.core.errors import ServiceError

PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class ProblemType:
    status: int
    title: str
    description: str


PROBLEM_TYPES: dict[str, ProblemType] = {
    "malformed-body": ProblemType(
        400, "Malformed body", "The body is not valid JSON (or msgpack)."
    ),
    "unauthorized": ProblemType(
        401,
        "Unauthorized",
        "This server requires an API key (Authorization: Bearer <key>, or X-API-Key) and "
        "the request has none, or one it does not accept.",
    ),
    "not-found": ProblemType(404, "Not found", "No such path. See /docs for the API."),
    "tape-not-found": ProblemType(
        404,
        "Tape not found",
        "No tape with this id is visible to this API key (or it was deleted).",
    ),
    "tape-expired": ProblemType(
        404,
        "Tape expired",
        "The tape was not used within its ttl and was dropped; record it again with "
        "POST /v1/tapes.",
    ),
    "tape-evicted": ProblemType(
        404,
        "Tape evicted",
        "The tape's worker needed room for more recently used tapes within its memory "
        "budget; record it again with POST /v1/tapes.",
    ),
    "laplace-not-found": ProblemType(
        404,
        "Laplace fit not found",
        "The tape holds no Laplace fit with this id: it was deleted, or dropped with the "
        "tape's recording (an update, a rebuilt worker, an evicted tape); GET "
        "/v1/tapes/{id}/laplace lists the tape's fits.",
    ),
    "model-not-found": ProblemType(
        404, "Model not found", "No stored model with this name is visible to this API key."
    ),
    "model-exists": ProblemType(
        409,
        "Model exists",
        "A model with this name is stored already; send replace: true to replace it.",
    ),
    "dataset-not-found": ProblemType(
        404,
        "Dataset not found",
        "No stored dataset with this name is visible to this API key (PUT /v1/datasets/{name} "
        "stores one).",
    ),
    "dataset-too-large": ProblemType(
        413,
        "Dataset too large",
        "The dataset is larger than this server stores (max_dataset_bytes), or this API key's "
        "datasets would exceed max_dataset_bytes_per_key or max_datasets_per_key.",
    ),
    "method-not-allowed": ProblemType(
        405, "Method not allowed", "The path exists but not with this method (see Allow)."
    ),
    "not-acceptable": ProblemType(
        406,
        "Not acceptable",
        "The Accept header names no type this service writes (application/json, "
        "application/msgpack).",
    ),
    "body-too-large": ProblemType(
        413, "Body too large", "The body is larger than the server's limit (max_body_bytes)."
    ),
    "unsupported-media-type": ProblemType(
        415,
        "Unsupported media type",
        "The Content-Type is not application/json or application/msgpack.",
    ),
    "validation": ProblemType(
        422,
        "Invalid request",
        "A field of the request is missing, unknown or malformed; `errors` lists each with "
        "its dotted `field` path.",
    ),
    "definition": ProblemType(
        422,
        "Invalid definition",
        "The definition (or its target and sources) cannot run: `errors` lists each problem "
        "with its section, line, column, op and shapes.",
    ),
    "invalid-request": ProblemType(
        422, "Invalid request", "The request does not fit its definition (shapes, targets)."
    ),
    "execution": ProblemType(
        422,
        "Computation failed",
        "A checked definition failed while running (a singular matrix, a label out of range).",
    ),
    "non-finite": ProblemType(
        422,
        "Non-finite result",
        "The answer would hold NaN or infinite values: `errors` names the op (line, column, "
        "op) where the first one appeared, in the forward pass or in a derivative. Send "
        "allow_nonfinite: true to receive such answers, with `nonfinite` listing the fields.",
    ),
    "batch-dependence": ProblemType(
        422,
        "Examples are not independent",
        "A batch jacobian was asked of a computation that mixes the examples of the batch "
        "(batch normalization, a mean over the batch axis): per-example jacobians would be "
        "meaningless. Ask for the full jacobian instead.",
    ),
    "unsupported": ProblemType(
        422, "Unsupported derivative", "An op has no rule for the derivative asked of it."
    ),
    "too-large": ProblemType(
        422,
        "Too large to compute",
        "The answer would exceed a size limit of this server (hessian_max_size, "
        "jacobian_max_elements, hvp_max_vectors, max_time_limit, tape_memory_budget, "
        "algorithm_max_hvps, tape_max_ttl; too many `vectors` carries the server's "
        "hvp_max_vectors as `limit`: send chunks of it), or its estimated compute exceeds "
        "the request's time_limit (`estimate`, `time_limit`: run it as a job with a longer "
        "one).",
    ),
    "quota-exceeded": ProblemType(
        429,
        "Quota exceeded",
        "This API key holds as many tapes, tape bytes or models as its quota allows "
        "(max_tapes_per_key, max_tape_bytes_per_key, max_models_per_key); delete some or "
        "let tapes expire. `quota` names which.",
    ),
    "rate-limited": ProblemType(
        429,
        "Too many requests",
        "This API key sent requests faster than its rate (rate_limit_per_second, "
        "rate_limit_burst) or has too many waiting (max_waiting_per_key): retry after "
        "`Retry-After` seconds.",
    ),
    "job-not-found": ProblemType(
        404,
        "Job not found",
        "No such job for this API key: never started, or expired (job_ttl) after it ended.",
    ),
    "job-not-finished": ProblemType(
        409, "Job not finished", "The job has no answer yet: it is queued or running."
    ),
    "cancelled": ProblemType(
        409,
        "Cancelled",
        "The computation was cancelled before it finished (DELETE /v1/jobs/{id}, or its "
        "client disconnected); its worker stopped at its next op and is free.",
    ),
    "internal": ProblemType(500, "Internal error", "A bug: please report it with the detail."),
    "worker-crashed": ProblemType(
        502,
        "Worker crashed",
        "The worker process computing the request died; it has been replaced.",
    ),
    "job-lost": ProblemType(
        502,
        "Job lost",
        "The HTTP process that ran the job exited before the job ended (with several HTTP "
        "processes, another one answers for it); start the request again.",
    ),
    "busy": ProblemType(
        503, "Service busy", "Every worker is busy and the queue is full: retry after a while."
    ),
    "unavailable": ProblemType(
        503, "Service unavailable", "The service is starting or shutting down."
    ),
    "not-ready": ProblemType(503, "Not ready", "Some worker is not up and answering."),
    "device": ProblemType(503, "Device unavailable", "The worker's device cannot compute."),
    "time-limit": ProblemType(
        504,
        "Time limit exceeded",
        "The computation ran past its time limit; its worker was stopped and replaced.",
    ),
    "out-of-memory": ProblemType(
        507, "Out of memory", "The computation needs more memory than the worker has."
    ),
}

_STATUS_SLUGS = {
    400: "malformed-body",
    404: "not-found",
    405: "method-not-allowed",
    406: "not-acceptable",
    413: "body-too-large",
    415: "unsupported-media-type",
}


def type_uri(slug: str) -> str:
    return f"/problems/{slug}"


def slug_for_status(status: int) -> str | None:
    return _STATUS_SLUGS.get(status)


class ProblemError(ServiceError):
    """A domain error with HTTP details the domain does not know of: a status other than
    its type's, or headers (WWW-Authenticate, Retry-After). Raised by the HTTP layer."""

    def __init__(
        self,
        slug: str,
        detail: str,
        *,
        status: int | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ):
        super().__init__(slug, detail, errors=errors, **extensions)
        self.status = status
        self.headers = headers


def status_of(exc: ServiceError) -> int:
    """The HTTP status a domain error answers with: its problem type's, unless the HTTP
    layer chose another."""
    known = PROBLEM_TYPES.get(exc.slug)  # an unknown slug is our bug: a 500, still a problem
    return getattr(exc, "status", None) or (known.status if known else 500)


def headers_of(exc: ServiceError) -> dict[str, str] | None:
    return getattr(exc, "headers", None)


# What a problem echoes of a request is bounded: the detail, each error's message and the
# instance (the request's path, which a client chose) are cut with "..." past these.
MAX_DETAIL_CHARS = 2000
MAX_MESSAGE_CHARS = 500
MAX_INSTANCE_CHARS = 256


def _capped(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def problem_body(
    slug: str | None,
    status: int,
    detail: str,
    instance: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    **extensions: Any,
) -> dict[str, Any]:
    known = PROBLEM_TYPES.get(slug) if slug else None
    body: dict[str, Any] = {
        "type": type_uri(slug) if slug and known else "about:blank",
        "title": known.title if known else HTTPStatus(status).phrase,
        "status": status,
        "detail": _capped(detail, MAX_DETAIL_CHARS),
    }
    if instance is not None:
        body["instance"] = _capped(instance, MAX_INSTANCE_CHARS)
    if errors is not None:
        body["errors"] = [
            {
                k: _capped(v, MAX_MESSAGE_CHARS) if isinstance(v, str) else v
                for k, v in e.items()
                if v is not None
            }
            for e in errors
        ]
    body.update(extensions)
    return body


def job_problem(slug: str, detail: str, instance: str) -> dict[str, Any]:
    """A job's problem body written without a request (a job whose process is gone, one
    cancelled because its tape was deleted)."""
    return problem_body(slug, PROBLEM_TYPES[slug].status, detail, instance, None)


def problem_response(
    scope: Scope | None,
    slug: str | None,
    detail: str,
    *,
    status: int | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> Response:
    """The problem+json response; counts it in the app's metrics by type."""
    if status is None:
        status = PROBLEM_TYPES[slug].status if slug else 500
    instance = scope.get("path") if scope is not None else None
    body = problem_body(slug, status, detail, instance, errors, **extensions)
    if scope is not None and "app" in scope:
        metrics = getattr(scope["app"].state, "metrics", None)
        if metrics is not None:
            metrics.problem(slug or str(status))
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        headers=headers,
        media_type=PROBLEM_JSON,
    )
