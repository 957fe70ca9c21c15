"""Content negotiation: which body format a request uses and which its answer gets, and
writing the answer.

Bodies are JSON (`application/json`) or msgpack (`application/msgpack`, also spelled
`application/x-msgpack` or `application/vnd.msgpack`). The answer takes the format the
Accept header prefers, else the request's own; tensors in a JSON answer are data lists
or base64 (see payloads.answer_encoding), in a msgpack answer raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np
import orjson
from fastapi import Request
from starlette.responses import Response

from service.api.problems import ProblemError
from service.api.tensors import to_wire
from service.core.wire import Encoding

JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_ALIASES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})


class Format(StrEnum):
    JSON = "json"
    MSGPACK = "msgpack"


@dataclass(frozen=True)
class Negotiated:
    body: Format
    answer: Format


def bare_media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def body_format(content_type: str | None) -> Format:
    media = bare_media_type(content_type or "")
    if media == JSON or (media.startswith("application/") and media.endswith("+json")):
        return Format.JSON
    if media in MSGPACK_ALIASES:
        return Format.MSGPACK
    got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    raise ProblemError(
        "unsupported-media-type",
        f"the body must be application/json or application/msgpack; got {got}",
    )


def answer_format(accept: str | None, default: Format) -> Format:
    """The format the Accept header prefers (q-values honoured), else `default`."""
    if not accept:
        return default
    best: tuple[float, int, Format] | None = None
    for position, part in enumerate(accept.split(",")):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        q = 1.0
        for param in fields[1:]:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q <= 0:
            continue
        if media == JSON or media == "application/problem+json":
            fmt = Format.JSON
        elif media in MSGPACK_ALIASES:
            fmt = Format.MSGPACK
        elif media in ("*/*", "application/*"):
            fmt = default
        else:
            continue
        rank = (q, -position, fmt)
        if best is None or rank[:2] > best[:2]:
            best = rank
    if best is None:
        raise ProblemError(
            "not-acceptable",
            f"Accept {accept!r} names no type this service writes; ask for "
            "application/json or application/msgpack",
        )
    return best[2]


async def negotiate(request: Request) -> Negotiated:
    """Dependency of the POST routes: 415 for a body that is neither JSON nor msgpack,
    406 for an Accept header that takes neither."""
    body = body_format(request.headers.get("content-type"))
    return Negotiated(body, answer_format(request.headers.get("accept"), body))


# ----------------------------------------------------------------------------------------
# Writing answers
# ----------------------------------------------------------------------------------------


def _wire(value: Any, encoding: Encoding) -> Any:
    if isinstance(value, np.ndarray):
        return to_wire(value, encoding)
    if isinstance(value, dict):
        return {k: _wire(v, encoding) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wire(v, encoding) for v in value]
    return value


def answer(
    result: dict[str, Any],
    negotiated: Negotiated,
    encoding: Encoding,
    compute_seconds: float | None = None,
) -> Response:
    """The response for a worker's result (arrays become wire tensors). With
    `compute_seconds`, a `Server-Timing: compute;dur=<ms>` header says how long the worker
    computed (the rest of the latency is transport and queueing)."""
    headers = None
    if compute_seconds is not None:
        headers = {"Server-Timing": f'compute;dur={compute_seconds * 1e3:.3f};desc="worker"'}
    if negotiated.answer is Format.MSGPACK:
        body = msgpack.packb(_wire(result, Encoding.BINARY), use_bin_type=True)
        return Response(body, media_type=MSGPACK, headers=headers)
    content = orjson.dumps(_wire(result, encoding), option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(content, media_type=JSON, headers=headers)
