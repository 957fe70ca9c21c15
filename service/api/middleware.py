"""Pure ASGI middleware (no per-request task or body copy): the request body limit, the
per-route metrics, and the watch on each client's connection."""

from __future__ import annotations

import time

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.problems import ProblemError, problem_response
from service.domain.metrics import Metrics
from service.pool import calls

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# The methods the metrics name; any other (h11 accepts every token as a method) counts as
# "other", so that a client cannot grow the metrics by one series per invented method.
COUNTED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, or, for a chunked
    body, as soon as the app has read past the limit (its receive raises the problem,
    which the app's handlers answer). A chunked body is not read ahead of the app: the
    /v1 routes refuse a keyless or over-rate caller before they read a byte of it."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                response = problem_response(
                    scope, "body-too-large", self._detail(f"{length:,} bytes"), limit=self.max_bytes
                )
                await response(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        size = 0

        async def receive_counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    raise ProblemError(
                        "body-too-large", self._detail("larger than that"), limit=self.max_bytes
                    )
            return message

        await self.app(scope, receive_counted, send)

    def _detail(self, size: str) -> str:
        return (
            f"this server accepts bodies of up to {self.max_bytes:,} bytes (setting "
            f"max_body_bytes); this one is {size}. Send large tensors as binary "
            "(application/msgpack) or split the request"
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class MetricsMiddleware:
    """Counts every HTTP request and its latency by method, route template and status:
    labels from a bounded set (the route's template, never the path; a known method or
    "other"), so that no request can add series without limit."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in COUNTED_METHODS else "other"
            self.metrics.observe(method, path, status, time.perf_counter() - started)


class DisconnectMiddleware:
    """Gives every HTTP request a calls.Watch whose `gone()` says whether its client has
    disconnected, so that the pool cancels the computation of a client that left
    (service/pool/calls.py). `gone()` peeks at the ASGI receive channel without waiting:
    once the body is read, the next message a server sends is http.disconnect. A body
    message seen by the peek (a request the app has not read yet) is kept for the app.
    Once the answer has started, the request is answered: work it left running in the
    background is not the client's to cancel."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kept: list[Message] = []
        disconnected = answering = False

        async def receive_kept() -> Message:
            nonlocal disconnected
            message = kept.pop(0) if kept else await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
            return message

        async def send_noting(message: Message) -> None:
            nonlocal answering
            if message["type"] == "http.response.start":
                answering = True
            await send(message)

        async def gone() -> bool:
            nonlocal disconnected
            while not disconnected and not answering:
                message: Message | None = None
                with anyio.CancelScope() as peek:
                    peek.cancel()  # take a message only if one is there already
                    message = await receive()
                if message is None:
                    return False
                if message["type"] == "http.disconnect":
                    disconnected = True
                else:
                    kept.append(message)
            return disconnected and not answering

        token = calls.current.set(calls.Watch(gone))
        try:
            await self.app(scope, receive_kept, send_noting)
        finally:
            calls.current.reset(token)
