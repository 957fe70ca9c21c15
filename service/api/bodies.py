"""Request bodies are parsed and sized off the event loop, before validation sees them.

FastAPI parses a JSON body with `json.loads` on the event loop and hands it to pydantic,
also on the loop; a small body can be costly there (a 3 MB list of a million empty lists
makes a million validation errors, a deeply nested one exhausts the recursion limit).
BoundedRoute, the route class of every router, does this first in a worker thread:

- parse (JSON or msgpack) and walk the result iteratively, refusing bodies nested deeper
  than `max_body_depth` or holding more than `max_body_containers` lists and objects
  (settings), with a precise problem, so that validation only ever sees bounded bodies;
- leave the parsed JSON in Starlette's request cache, so FastAPI does not parse it again.

Meanwhile the loop keeps answering other requests (/healthz included).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import msgpack
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from service.api.negotiation import Format, body_format
from service.api.problems import ProblemError

_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_SLICE = 1 << 20


class BodyShape:
    """Depth and container count of a parsed body, refused past the limits."""

    def __init__(self, max_depth: int, max_containers: int):
        self.max_depth = max_depth
        self.max_containers = max_containers

    def too_many(self) -> ProblemError:
        return ProblemError(
            "too-large",
            f"body: more than {self.max_containers:,} lists and objects (the server's "
            "max_body_containers); send large tensors flat, as base64, or in a msgpack body",
            errors=[{"field": "body", "message": "too many lists and objects"}],
        )

    def count_brackets(self, chunk: bytes, found: int) -> int:
        """`found` plus the lists and objects that `chunk` opens, refused past the limit.

        Every JSON list or object opens with a bracket, so counting them bounds the
        containers (brackets inside strings only over-count). Done per received chunk,
        in slices: a body of millions of empty lists is refused before it is joined or
        parsed, and no single C call holds the GIL (and so the event loop) for long.
        """
        for start in range(0, len(chunk), _SLICE):
            found += chunk.count(b"[", start, start + _SLICE)
            found += chunk.count(b"{", start, start + _SLICE)
            if found > self.max_containers:
                raise self.too_many()
        return found

    def check(self, value: Any) -> None:
        containers = 0
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, dict):
                _encodable(item.keys())
                children: Any = item.values()
            elif isinstance(item, list | tuple):
                _encodable(item)
                children = item
            else:
                continue
            containers += 1
            if containers > self.max_containers:
                raise self.too_many()
            if depth > self.max_depth:
                raise ProblemError(
                    "malformed-body",
                    f"the body is nested more than {self.max_depth} levels deep (the "
                    "server's max_body_depth)",
                )
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, dict | list | tuple))


def _encodable(items: Any) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no UTF-8 frame (to the
    workers, to the store) can carry: a malformed body, said here, not a 500 later."""
    for item in items:
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise ProblemError(
                    "malformed-body",
                    "the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                    "that is not half of a pair), which is not text",
                ) from None


def _parse(body: bytes, fmt: Format, shape: BodyShape) -> Any:
    """Runs in a worker thread: parse and size the body, or raise the problem."""
    if fmt is Format.JSON:
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # FastAPI reports it with the position (a 400 malformed-body)
        except RecursionError:
            raise ProblemError(
                "malformed-body",
                "the body could not be parsed as JSON: it is nested too deeply",
            ) from None
    else:
        try:
            # Sized after unpacking: a msgpack body of millions of tiny containers still
            # costs its memory here, in this thread (a streaming count would avoid it).
            value = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError):
            return None  # the request model reports it (a 400 malformed-body)
    shape.check(value)
    return value


async def _read_counting(request: Request, shape: BodyShape) -> bytes:
    """The body, its brackets counted chunk by chunk as it arrives."""
    chunks: list[bytes] = []
    found = 0
    async for chunk in request.stream():
        found = shape.count_brackets(chunk, found)
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # Starlette's cache: the route reads it from here
    return body


class BoundedRoute(APIRoute):
    """An APIRoute that parses and sizes its body in a thread before FastAPI runs."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            content_type = request.headers.get("content-type")
            if request.method not in _WITH_BODY or not content_type:
                return await handler(request)
            try:
                fmt = body_format(content_type)
            except ProblemError:
                return await handler(request)  # the route answers 415 itself
            settings = request.app.state.settings
            shape = BodyShape(settings.max_body_depth, settings.max_body_containers)
            if fmt is Format.JSON:
                body = await _read_counting(request, shape)
            else:
                body = await request.body()
            if body:
                value = await anyio.to_thread.run_sync(_parse, body, fmt, shape)
                if fmt is Format.JSON and value is not None:
                    request._json = value  # Starlette's cache: FastAPI parses no more
            return await handler(request)

        return bounded
