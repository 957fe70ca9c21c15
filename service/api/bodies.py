"""Who may send a body, and how much of one, settled before FastAPI reads it.

FastAPI reads and parses a request's body before it solves the route's dependencies, so
an API key checked by a dependency is checked after the work a body costs: a keyless
client could make the server parse 20 MB of JSON only to be told 401. And it parses JSON
with `json.loads` on the event loop, then validates on the loop too, where a small body
can be costly (a 3 MB list of a million empty lists makes a million validation errors).

The route classes here do it in order instead:

1. GatedRoute (every /v1 resource but jobs) authenticates the caller and passes its fair
   share (service/api/fairness.py: a token, then one of its key's slots; a read or a
   delete, which queues nothing on a worker, the token alone) *before a byte
   of the body is read*: a 401 or 429 goes out while the client is still sending, and
   the server discards the rest of the body unparsed. The slot is held while the body is
   read, parsed and computed, so one key parses at most its slots' worth at a time.
2. BoundedRoute (every route) then reads the body and parses it, a large one in a
   worker thread, refusing a body nested deeper than `max_body_depth` or holding more
   than `max_body_containers` lists and objects (settings) with a precise problem:
   - JSON: brackets are counted per received chunk, so a body of millions of empty
     lists is refused before it is joined or parsed;
   - msgpack: containers are counted from their headers while the body is unpacked,
     and refused before the next one is built (a 7.6 MiB body of empty arrays would
     otherwise become half a GiB of lists).
   A body that does not parse is a 400. The parsed value is handed to FastAPI by the
   request the route class makes, a BoundedRequest, whose `body()` and `json()` answer
   it (for msgpack an UnpackedBody), never parsed again: FastAPI's documented extension
   point, not Starlette's private caches.

Meanwhile the loop keeps answering other requests (/healthz included). A small body
(see _INLINE_JSON_BYTES) is parsed on the loop: the thread's round trip costs more than
its parse, and the parsers hold the GIL anyway.

JSON is parsed by orjson (10x json's speed, and it refuses lone surrogates itself); a
body orjson refuses, or one where it would read differently (an integer past 64 bits,
which it makes a float), is parsed by json, whose answer (or error) is the contract.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import anyio
import msgpack
import orjson
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from service.api.auth import api_key_scheme, authenticate, bearer_scheme
from service.api.fairness import Fairness
from service.api.negotiation import Format, body_format
from service.api.openapi import problem_responses
from service.api.problems import ProblemError
from service.api.schemas import UnpackedBody

_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_SLICE = 1 << 20
# A small body is parsed on the loop (a thread's round trip costs 40 us to 1 ms here):
# orjson reads 64 KiB in ~60 us; with at most 4,096 brackets the check after it takes
# at most ~1.5 ms. A msgpack body of 16 KiB unpacks in ~0.3 ms and is checked in at most
# ~5 ms (16,000 empty arrays): what a thread holding the GIL would cost the loop anyway
# (the interpreter's switch interval is 5 ms).
_INLINE_JSON_BYTES = 64 * 1024
_INLINE_JSON_BRACKETS = 4096
_INLINE_MSGPACK_BYTES = 16 * 1024
# An integer literal of 19 digits or more may be past 64 bits, where orjson reads a
# float and json an int. Found in the body with every digit made "d", the fraction and
# exponent marks "x" and all else a space: a space then 19 d's (a fraction's digits
# follow an x; 19-digit exponents after "e-" are sent to json too, needlessly).
_DIGIT_CLASSES = bytes(
    ord("d") if b in b"0123456789" else ord("x") if b in b".eE+" else ord(" ") for b in range(256)
)
_LONG_INTEGER = b" " + b"d" * 19


def _may_hold_long_integer(body: bytes) -> bool:
    classes = body.translate(_DIGIT_CLASSES)
    return _LONG_INTEGER in classes or classes.startswith(_LONG_INTEGER[1:])


_CONTAINERS = (dict, list)


class BodyShape:
    """Depth and container count of a body, refused past the limits."""

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

    def too_deep(self) -> ProblemError:
        return ProblemError(
            "malformed-body",
            f"the body is nested more than {self.max_depth} levels deep (the server's "
            "max_body_depth)",
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

    def check(self, value: Any, text_checked: bool = False) -> None:
        """Depth, container count and text (unless `text_checked`: orjson refused lone
        surrogates already) of a parsed JSON body."""
        if type(value) not in _CONTAINERS:
            return
        containers = 0
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            children: Any = item.values() if type(item) is dict else item
            # The types present, found in one C loop: a list of a thousand numbers is
            # searched neither for containers nor for text item by item.
            kinds = set(map(type, children))
            if not text_checked:
                if children is item:
                    if str in kinds:
                        _encodable(item)
                else:
                    _encodable(item.keys())
            containers += 1
            if containers > self.max_containers:
                raise self.too_many()
            if depth > self.max_depth:
                raise self.too_deep()
            if dict in kinds or list in kinds:
                stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)


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


# ----------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------


_UNPARSED = object()


def parse_json_fast(body: bytes, shape: BodyShape, brackets: int | None = None) -> Any:
    """The body as orjson reads it, checked; _UNPARSED where json must read it (a body
    orjson refuses, or one that may hold an integer past 64 bits). `brackets`, the count of [ and {
    in the body (count_brackets), bounds its containers and so its depth: within the
    depth limit, nothing is left to check."""
    if _may_hold_long_integer(body):
        return _UNPARSED
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _UNPARSED
    if brackets is None or brackets > shape.max_depth:
        shape.check(value, text_checked=True)
    return value


def parse_json(body: bytes, shape: BodyShape, brackets: int | None = None) -> Any:
    """The parsed body, or the problem (400 or 422): by orjson where it reads the body
    as json does, else by json (its errors name the position)."""
    value = parse_json_fast(body, shape, brackets)
    if value is not _UNPARSED:
        return value
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ProblemError(
            "malformed-body",
            f"the body is not valid JSON: {exc.msg} at character {exc.pos}",
        ) from None
    except UnicodeDecodeError as exc:
        raise ProblemError(
            "malformed-body",
            f"the body is not valid JSON: it is not UTF-8 text (byte {exc.start})",
        ) from None
    except RecursionError:
        raise ProblemError(
            "malformed-body",
            "the body could not be parsed as JSON: it is nested too deeply",
        ) from None
    shape.check(value)
    return value


# ----------------------------------------------------------------------------------------
# msgpack
# ----------------------------------------------------------------------------------------

_SCALAR, _ARRAY, _MAP = 0, 1, 2
# What each msgpack type byte opens: fixarray, array 16/32; fixmap, map 16/32; else one
# scalar (nil, bool, int, float, str, bin, ext), which Unpacker.unpack builds whole.
_KIND = bytes(
    _ARRAY
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)
    else _MAP
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)
    else _SCALAR
    for b in range(256)
)


def _malformed_msgpack(reason: str) -> ProblemError:
    return ProblemError("malformed-body", f"the body is not valid msgpack: {reason}")


def unpack_msgpack(body: bytes, shape: BodyShape) -> Any:
    """The unpacked body, built container by container from the headers, each counted
    (and its depth checked) before it is built: a body past max_body_containers or
    max_body_depth is refused having built at most that many (empty) containers, and
    no header's claimed length is allocated ahead. A small body, which cannot hold many
    containers, is unpacked by msgpack at once and checked after (8x faster); whatever
    that refuses is walked, whose refusal (or answer) is the contract."""
    if len(body) <= _INLINE_MSGPACK_BYTES:
        value = _unpack_small(body, shape)
        if value is not _UNPARSED:
            return value
    try:
        return _unpack_walk(body, shape)
    except ProblemError:
        raise
    except msgpack.OutOfData:
        raise _malformed_msgpack("it ends inside a value") from None
    except IndexError:  # the type byte of a value past the end
        raise _malformed_msgpack("it ends inside a list or map") from None
    except UnicodeDecodeError as exc:
        raise _malformed_msgpack(f"a string is not UTF-8 ({exc.reason})") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise _malformed_msgpack(str(exc) or type(exc).__name__) from None


def _unpack_small(body: bytes, shape: BodyShape) -> Any:
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True)
        shape.check(value, text_checked=True)  # msgpack's strings are UTF-8 already
    except Exception:  # noqa: BLE001 - the walk says what is wrong with it
        return _UNPARSED
    return value


def _unpack_walk(body: bytes, shape: BodyShape) -> Any:
    # The whole body in one read: BytesIO hands over `body` itself (no copy) and the
    # unpacker copies it once into its buffer, where its default 16 KiB reads made two
    # copies of every tensor's bytes (each chunk read out, then appended).
    size = max(1, len(body))
    unpacker = msgpack.Unpacker(
        io.BytesIO(body), raw=False, strict_map_key=True, max_buffer_size=size, read_size=size
    )
    tell, unpack = unpacker.tell, unpacker.unpack
    containers = 0

    def open_container(kind: int, depth: int) -> tuple[Any, int]:
        nonlocal containers
        containers += 1
        if containers > shape.max_containers:
            raise shape.too_many()
        if depth > shape.max_depth:
            raise shape.too_deep()
        if kind == _ARRAY:
            return [], unpacker.read_array_header()
        return {}, 2 * unpacker.read_map_header()  # keys and values

    # One frame per open container: [container, values still to read, the pending key,
    # its depth] (a container is let go once its last value is opened, so the depth is
    # its own, not the stack's).
    stack: list[list[Any]] = []
    kind = _KIND[body[0]]
    if kind == _SCALAR:
        root = unpack()
    else:
        root, count = open_container(kind, 1)
        if count:
            stack.append([root, count, None, 1])
    while stack:
        frame = stack[-1]
        container, left = frame[0], frame[1]
        if isinstance(container, list):
            append = container.append
            while left and not _KIND[body[tell()]]:  # a run of scalars, the common case
                append(unpack())
                left -= 1
            if not left:
                stack.pop()
                continue
            child, count = open_container(_KIND[body[tell()]], frame[3] + 1)
            append(child)
        elif left % 2 == 0:  # a map's key
            if _KIND[body[tell()]]:
                raise _malformed_msgpack("a map key is a list or a map")
            key = unpack()
            if not isinstance(key, str | bytes):
                raise _malformed_msgpack(f"a map key is a {type(key).__name__}, not a string")
            frame[1], frame[2] = left - 1, key
            continue
        else:  # a map's value
            kind = _KIND[body[tell()]]
            if kind == _SCALAR:
                container[frame[2]] = unpack()
                count = 0
            else:
                child, count = open_container(kind, frame[3] + 1)
                container[frame[2]] = child
        frame[1] = left - 1
        if frame[1] == 0:
            stack.pop()
        if count:
            stack.append([child, count, None, frame[3] + 1])
    if tell() != len(body):
        raise _malformed_msgpack(f"{len(body) - tell():,} bytes follow the document")
    return root


# ----------------------------------------------------------------------------------------
# Route classes
# ----------------------------------------------------------------------------------------


class BoundedRequest(Request):
    """A request whose body read_bounded reads, sizes and parses once: FastAPI's
    `body()` and `json()` calls (fastapi.routing.get_request_handler) then answer what it
    found, and nothing is read or parsed twice. The route classes below make one of the
    request Starlette made (FastAPI's documented extension point, "Custom Request and
    APIRoute class"); until read_bounded has run (a body the route reads itself: an ONNX
    upload, a .npy dataset), every method is Starlette's own.

    Starlette caches a body in private attributes of its Request (not API: a release may
    change them), so what read_bounded found lives in attributes of this class instead.
    Made from the scope and the receive channel only, as FastAPI's docs do: Starlette
    keeps `send` private, which only HTTP/2 server push and early hints use (we use
    neither)."""

    # What read_bounded found (class defaults: a request whose body is not read costs
    # nothing more): the body (for msgpack an UnpackedBody, which the request model takes
    # as it is) and its parsed value, JSON's or msgpack's.
    bounded_body: bytes | None = None
    bounded_value: Any = _UNPARSED

    async def body(self) -> bytes:
        if self.bounded_body is None:
            return await super().body()
        return self.bounded_body

    async def json(self) -> Any:
        """The parsed body (FastAPI asks for it only for a JSON media type)."""
        if self.bounded_value is _UNPARSED:
            return await super().json()
        return self.bounded_value

    def stream(self) -> AsyncGenerator[bytes, None]:
        # Starlette's generator itself while unread (no layer of ours on each chunk).
        if self.bounded_body is None:
            return super().stream()
        return _replay(self.bounded_body)


async def _replay(body: bytes) -> AsyncGenerator[bytes, None]:
    """A body read already, streamed as Starlette streams one it has read."""
    yield body
    yield b""


async def _read_counting(request: Request, shape: BodyShape | None) -> tuple[bytes, int]:
    """The body and, with a shape, its brackets counted chunk by chunk as it arrives
    (JSON). Read through Starlette's stream, not its body(), which would keep a copy of
    its own in the request until the answer goes out (a msgpack body's bytes beside the
    UnpackedBody made of them: twice the body for the whole request)."""
    chunks: list[bytes] = []
    found = 0
    async for chunk in request.stream():
        if shape is not None:
            found = shape.count_brackets(chunk, found)
        chunks.append(chunk)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return body, found


async def _parse_json(body: bytes, shape: BodyShape, brackets: int) -> Any:
    if len(body) <= _INLINE_JSON_BYTES and brackets <= _INLINE_JSON_BRACKETS:
        value = parse_json_fast(body, shape, brackets)
        if value is not _UNPARSED:
            return value
    return await anyio.to_thread.run_sync(parse_json, body, shape, brackets)


async def _unpack(body: bytes, shape: BodyShape) -> UnpackedBody:
    if len(body) <= _INLINE_MSGPACK_BYTES:
        return _unpacked(body, shape)
    return await anyio.to_thread.run_sync(_unpacked, body, shape)


def _bounded(request: Request) -> BoundedRequest:
    if not isinstance(request, BoundedRequest):
        # A route of another class: Starlette's own request has nowhere to keep the body.
        raise TypeError("a body is read bounded from a BoundedRoute's or GatedRoute's request")
    return request


async def read_bounded(request: Request) -> None:
    """Read, size and parse the body of a BoundedRequest (a large one in a thread),
    leaving it and its value where FastAPI and the routes read them (`request.body()`,
    `request.json()`, parsed_body); the problem when it is malformed or too large. A
    body that is neither JSON nor msgpack is left unread."""
    request = _bounded(request)
    content_type = request.headers.get("content-type")
    if request.method not in _WITH_BODY or not content_type:
        return
    try:
        fmt = body_format(content_type)
    except ProblemError:
        return  # not JSON or msgpack: the route answers (415, or its own media type)
    settings = request.app.state.settings
    shape = BodyShape(settings.max_body_depth, settings.max_body_containers)
    try:
        body, brackets = await _read_counting(request, shape if fmt is Format.JSON else None)
    except ClientDisconnect:
        # Nobody reads this answer; it only keeps a client that left from being an error.
        raise ProblemError(
            "malformed-body", "the client disconnected before its body ended"
        ) from None
    if not body:  # FastAPI validates an empty body as a missing one
        request.bounded_body = body
    elif fmt is Format.JSON:
        request.bounded_value = await _parse_json(body, shape, brackets)
        request.bounded_body = body
    else:
        unpacked = await _unpack(body, shape)
        request.bounded_body, request.bounded_value = unpacked, unpacked.value


async def parsed_body(request: Request) -> Any:
    """The JSON or msgpack body, read, sized and parsed as read_bounded does, for a route
    that takes the request rather than a body model (its route class parses only the
    bodies of body models); 400 for an empty one, 415 for one of another media type."""
    request = _bounded(request)
    if request.bounded_body is None:
        await read_bounded(request)
    if request.bounded_body is None:  # left unread: neither JSON nor msgpack
        raise ProblemError(
            "unsupported-media-type",
            "the body is application/json or application/msgpack; got "
            f"{request.headers.get('content-type') or 'no Content-Type'}",
        )
    if request.bounded_value is _UNPARSED:
        raise ProblemError("malformed-body", "the body is empty")
    return request.bounded_value


def _unpacked(body: bytes, shape: BodyShape) -> UnpackedBody:
    value = unpack_msgpack(body, shape)
    unpacked = UnpackedBody(body)
    unpacked.value = value
    return unpacked


def _may_send_body(route: APIRoute) -> bool:
    return bool((route.methods or set()) & _WITH_BODY)


class BoundedRoute(APIRoute):
    """An APIRoute that parses and sizes its body (a large one in a thread) before
    FastAPI runs (when it takes a body model: a route that reads its body itself, as an
    ONNX upload does, gets it unread, or parses it with parsed_body). A route whose
    method sends a body gets a BoundedRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not _may_send_body(self):
            return handler
        reads_body = self.body_field is not None

        async def bounded(request: Request) -> Response:
            request = BoundedRequest(request.scope, request.receive)
            if reads_body:
                await read_bounded(request)
            return await handler(request)

        return bounded


# The OpenAPI security requirement of a gated route: either key scheme (the document's
# final touch adds `{}`, no key, as servers without keys take: service/api/openapi.py).
KEY_SECURITY: tuple[dict[str, list[str]], ...] = (
    {bearer_scheme.scheme_name: []},
    {api_key_scheme.scheme_name: []},
)


class GatedRoute(BoundedRoute):
    """A BoundedRoute whose caller is authenticated and admitted by its fair share
    before its body is read (the /v1 resources).

    The gate reads the two key schemes itself, so the route declares them to the OpenAPI
    document only (`security`), not as dependencies: FastAPI would solve both again for
    every request (~10 us each) to hand the route nothing it uses."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **options: Any) -> None:
        extra = dict(options.pop("openapi_extra", None) or {})
        extra.setdefault("security", [dict(s) for s in KEY_SECURITY])
        # The gate answers these on every gated route, whatever the route declares: 401
        # without an accepted key, 429 past the key's rate or its line.
        responses = dict(options.pop("responses", None) or {})
        for status, response in problem_responses(401, 429).items():
            responses.setdefault(status, response)
        super().__init__(path, endpoint, openapi_extra=extra, responses=responses, **options)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = APIRoute.get_route_handler(self)
        may_send_body = _may_send_body(self)
        reads_body = may_send_body and self.body_field is not None
        # A compute route that may start a job (routes/_compute.register marks it).
        may_run_jobs = bool(getattr(self.endpoint, "may_run_jobs", False))
        # Reads and deletes queue nothing on a worker: no slot (only the rate applies).
        computes = not (self.methods or set()) <= {"GET", "HEAD", "DELETE"}

        async def gated(request: Request) -> Response:
            if may_send_body:
                request = BoundedRequest(request.scope, request.receive)
            # The same dependency the route declares (it answers from the request's
            # state the second time): 401 before anything is read.
            owner = await authenticate(
                request, await bearer_scheme(request), await api_key_scheme(request)
            )
            fairness: Fairness = request.app.state.fairness
            async with fairness.admit(owner, computes) as admission:
                if may_run_jobs and reads_body:
                    # Read while in the key's line (bounded by max_waiting_per_key): a
                    # request that starts a job answers 202 without waiting for a slot.
                    await read_bounded(request)
                    if asks_async(request):
                        admission.without_slot()
                    else:
                        await admission.take_slot()
                elif computes:
                    await admission.take_slot()
                    if reads_body:
                        await read_bounded(request)
                return await handler(request)

        return gated


def prefers_async(request: Request) -> bool:
    """`Prefer: respond-async` (RFC 7240) among the request's preferences."""
    return any(
        part.split(";", 1)[0].strip().lower() == "respond-async"
        for value in request.headers.getlist("prefer")
        for part in value.split(",")
    )


def asks_async(request: Request) -> bool:
    """The request asks to run as a job: the Prefer header, or `"async": true` in its
    body (read already)."""
    if prefers_async(request):
        return True
    body = request.bounded_value if isinstance(request, BoundedRequest) else None
    return isinstance(body, dict) and body.get("async") is True
