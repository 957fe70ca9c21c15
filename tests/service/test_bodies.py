"""service/api/bodies.py on its own: the msgpack walk builds what msgpack.unpackb builds,
counts every list and map before building it, and refuses at exactly the limits; JSON
problems are raised where the body is parsed, with the position. The fast paths (orjson
for JSON, msgpack.unpackb for a small msgpack body) answer exactly what json and the walk
answer, value for value and type for type, or leave the body to them. The route class's
request hands FastAPI the value parsed once (BoundedRequest's body() and json())."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Annotated, Any

import httpx
import msgpack
import pytest
from fastapi import APIRouter, Body, FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api import errors
from service.api.bodies import (
    _INLINE_JSON_BRACKETS,
    _INLINE_JSON_BYTES,
    _UNPARSED,
    BodyShape,
    BoundedRequest,
    BoundedRoute,
    _parse_json,
    _unpack_walk,
    parse_json,
    parse_json_fast,
    parsed_body,
    unpack_msgpack,
)
from service.api.problems import ProblemError
from service.api.schemas import UnpackedBody
from service.api.schemas.base import RequestModel
from service.core.config import Settings

LOOSE = BodyShape(max_depth=10_000, max_containers=10**9)

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)
documents = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20), st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=200,
)


@settings(max_examples=150, deadline=None)
@given(documents)
def test_the_walk_builds_what_unpackb_builds(document: Any) -> None:
    packed = msgpack.packb(document, use_bin_type=True)
    assert _unpack_walk(packed, LOOSE) == msgpack.unpackb(packed, raw=False)
    assert unpack_msgpack(packed, LOOSE) == msgpack.unpackb(packed, raw=False)


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 is not 1.0; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: past 64 bits too, which orjson would read as floats
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_documents = st.recursive(
    json_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=12), st.dictionaries(st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=120,
)


@settings(max_examples=300, deadline=None)
@given(json_documents, st.booleans())
def test_parse_json_reads_what_json_reads(document: Any, ascii_only: bool) -> None:
    body = json.dumps(document, ensure_ascii=ascii_only).encode()
    assert same(parse_json(body, LOOSE), json.loads(body))
    brackets = body.count(b"[") + body.count(b"{")
    assert same(parse_json(body, LOOSE, brackets), json.loads(body))


@pytest.mark.parametrize(
    "text",
    [
        "[12345678901234567890]",  # past 64 bits: an int, not orjson's float
        '{"a": -98765432109876543210}',
        "1234567890123456789012",
        "[1e400, -1e400]",  # json's infinities (orjson refuses them)
        "[1.0, NaN, Infinity]",  # json's non-standard literals
        "\ufeff[1, 2]",  # a UTF-8 byte order mark, which json skips
        "[0.0011135332752019167, 1.00000000000000000000001, 1e-0000000000000000000001]",
    ],
)
def test_parse_json_edge_cases_read_as_json_reads_them(text: str) -> None:
    body = text.encode()
    assert same(parse_json(body, LOOSE), json.loads(body))


def test_fast_json_leaves_long_integers_and_lone_surrogates_to_json() -> None:
    assert parse_json_fast(b"[1, 12345678901234567890]", LOOSE) is _UNPARSED
    assert parse_json_fast(b'{"a": -1234567890123456789}', LOOSE) is _UNPARSED
    assert parse_json_fast(b'["\\ud800"]', LOOSE) is _UNPARSED
    assert same(
        parse_json_fast(b"[123456789012345678, 0.00123456789012345678]", LOOSE),
        [123456789012345678, 0.00123456789012345678],
    )
    with pytest.raises(ProblemError, match="surrogate") as lone:
        parse_json(b'{"program": ["s = x\\udc00"]}', LOOSE)
    assert lone.value.slug == "malformed-body"


def test_json_limits_are_exact_on_either_path() -> None:
    shape = BodyShape(max_depth=5, max_containers=7)
    five, six = b"[" * 5 + b"]" * 5, b"[" * 6 + b"]" * 6
    for brackets in (None, 5, 6):
        assert parse_json(five, shape, brackets) == [[[[[]]]]]
    for brackets in (None, 6):
        with pytest.raises(ProblemError, match="more than 5 levels") as deep:
            parse_json(six, shape, brackets)
        assert deep.value.slug == "malformed-body"
    with pytest.raises(ProblemError, match="more than 7 lists and objects"):
        parse_json(b'[[], {}, [1], {"a": [2]}, [], []]', shape)
    # a list of a thousand numbers and one list deep inside is searched for containers
    deep_inside = [0.5] * 1000 + [[[[["x"]]]]]  # 5 levels
    assert parse_json(json.dumps(deep_inside).encode(), shape) == deep_inside
    deep_inside[-1] = [deep_inside[-1]]  # 6
    with pytest.raises(ProblemError, match="more than 5 levels"):
        parse_json(json.dumps(deep_inside).encode(), shape)


def test_long_headers_and_every_length_form() -> None:
    # fix/16/32-bit arrays, maps, strings and bins, and a list of scalars long enough to
    # take the walk's fast loop past a buffer refill
    document = {
        "a" * 40_000: [
            list(range(20)),
            list(range(70_000)),
            "x" * 70_000,
            b"y" * 300,
            {str(i): i for i in range(20)},
            {str(i): [i] for i in range(70_000)},
        ]
    }
    packed = msgpack.packb(document, use_bin_type=True)
    assert unpack_msgpack(packed, LOOSE) == document


def nested(depth: int) -> bytes:
    return b"\x91" * (depth - 1) + b"\x90"


def test_the_limits_are_exact() -> None:
    shape = BodyShape(max_depth=5, max_containers=7)
    assert unpack_msgpack(nested(5), shape) == [[[[[]]]]]
    with pytest.raises(ProblemError, match="more than 5 levels") as deep:
        unpack_msgpack(nested(6), shape)
    assert deep.value.slug == "malformed-body"
    seven = msgpack.packb([[], {}, [1], {"a": [2]}, []])  # 1 + 6 = 7 containers
    assert unpack_msgpack(seven[:1] + seven[1:], shape) == msgpack.unpackb(seven)
    with pytest.raises(ProblemError, match="more than 7 lists and objects") as many:
        unpack_msgpack(msgpack.packb([[], {}, [1], {"a": [2]}, [], []]), shape)
    assert many.value.slug == "too-large"


def test_json_problems_come_from_the_parse_with_the_position() -> None:
    with pytest.raises(ProblemError) as bad:
        parse_json(b'{"a": [1, 2,]}', LOOSE)
    assert bad.value.slug == "malformed-body"
    assert str(bad.value) == "the body is not valid JSON: Expecting value at character 12"
    with pytest.raises(ProblemError, match="not UTF-8 text"):
        parse_json(b'{"a": "\xff"}', LOOSE)


def test_bodies_parsed_on_the_loop_or_in_a_thread_read_alike() -> None:
    shape = BodyShape(max_depth=64, max_containers=10**6)
    small = json.dumps({"a": [0.5] * 10, "b": "x"}).encode()
    large = json.dumps({"a": [0.25] * 20_000}).encode()
    bracketed = json.dumps([[1]] * (_INLINE_JSON_BRACKETS + 1)).encode()
    assert len(small) < _INLINE_JSON_BYTES < len(large) and len(bracketed) < _INLINE_JSON_BYTES
    for body in (small, large, bracketed, b"[1, NaN, 12345678901234567890]"):
        brackets = body.count(b"[") + body.count(b"{")
        assert same(asyncio.run(_parse_json(body, shape, brackets)), json.loads(body))


# ----------------------------------------------------------------------------------------
# The route class and its request, in a FastAPI app of their own (in-process, over ASGI)
# ----------------------------------------------------------------------------------------


class Pair(RequestModel):
    a: list[float]
    b: str


def bounded_app() -> tuple[FastAPI, dict[str, Any]]:
    """Routes of the BoundedRoute class taking a body of any shape, a body model and the
    request alone; `seen` keeps what each endpoint was handed."""
    router = APIRouter(route_class=BoundedRoute)
    seen: dict[str, Any] = {}

    @router.post("/any")
    async def take_any(request: Request, payload: Annotated[Any, Body()]) -> dict[str, bool]:
        seen.update(request=request, payload=payload, body=await request.body())
        seen["streamed"] = b"".join([chunk async for chunk in request.stream()])
        seen["json"] = await request.json()
        return {}

    @router.post("/pair")
    async def take_pair(request: Request, pair: Pair) -> dict[str, bool]:
        seen.update(request=request, pair=pair, body=await request.body())
        return {}

    @router.post("/raw")
    async def take_raw(request: Request) -> Any:
        return await parsed_body(request)

    app = FastAPI()
    app.include_router(router)
    errors.install(app)
    app.state.settings = Settings(max_body_depth=8, max_body_containers=100)
    return app, seen


def post(app: FastAPI, path: str, body: bytes, media: str) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, content=body, headers={"content-type": media})

    return asyncio.run(send())


def test_fastapi_validates_the_value_the_route_class_parsed() -> None:
    """FastAPI's body() and json() answer what read_bounded read and parsed: the very
    object, not a second parse, and the body's bytes wherever the endpoint asks."""
    app, seen = bounded_app()
    sent = json.dumps({"a": [1.5, 2], "b": "x"}).encode()
    assert post(app, "/any", sent, "application/json").status_code == 200
    request = seen["request"]
    assert isinstance(request, BoundedRequest)
    assert seen["payload"] is request.bounded_value is seen["json"]
    assert seen["payload"] == {"a": [1.5, 2], "b": "x"}
    assert seen["body"] == seen["streamed"] == sent


def test_a_msgpack_body_reaches_its_model_unpacked_once() -> None:
    app, seen = bounded_app()
    sent = msgpack.packb({"a": [0.5, -1.0], "b": "y"})
    assert post(app, "/pair", sent, "application/msgpack").status_code == 200
    assert seen["pair"] == Pair(a=[0.5, -1.0], b="y")
    body = seen["body"]
    assert isinstance(body, UnpackedBody) and body == sent
    assert body.value is seen["request"].bounded_value == {"a": [0.5, -1.0], "b": "y"}


def test_parsed_body_for_a_route_taking_the_request() -> None:
    app, _ = bounded_app()
    value = {"x": [[1, 2], [3, 4]], "name": "d"}
    for body, media in (
        (json.dumps(value).encode(), "application/json"),
        (msgpack.packb(value), "application/msgpack"),
    ):
        answer = post(app, "/raw", body, media)
        assert answer.status_code == 200 and answer.json() == value, answer.text
    for body, media, status, detail in (
        (b"", "application/json", 400, "the body is empty"),
        (b"", "application/msgpack", 400, "the body is empty"),
        (b"[" * 9 + b"]" * 9, "application/json", 400, "max_body_depth"),
        (msgpack.packb([[]] * 100), "application/msgpack", 422, "max_body_containers"),
        (b'{"x": [1,]}', "application/json", 400, "not valid JSON"),
        (b"x,y\n1,2\n", "text/csv", 415, "got text/csv"),
    ):
        answer = post(app, "/raw", body, media)
        assert answer.status_code == status, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert detail in answer.json()["detail"]


def test_a_request_of_another_route_class_is_refused_not_read_unbounded() -> None:
    """parsed_body needs the request a BoundedRoute makes: Starlette's own has nowhere
    for the body to be kept but its private attributes."""
    request = Request({"type": "http", "method": "POST", "headers": []})
    with pytest.raises(TypeError, match="BoundedRoute"):
        asyncio.run(parsed_body(request))


@pytest.mark.parametrize("media", ["application/json", "application/msgpack"])
def test_a_client_gone_mid_body_is_a_problem_not_an_error(media: str) -> None:
    """ClientDisconnect while the body streams in (JSON's counted chunks, msgpack's whole
    read) answers the malformed-body problem (nobody reads it: it keeps a client that
    left from being logged as a server error)."""
    app, seen = bounded_app()
    messages = [
        {"type": "http.request", "body": b'{"a": [1.5, ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/pair",
        "raw_path": b"/pair",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", media.encode()), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 400 and "pair" not in seen
    assert json.loads(body)["detail"] == "the client disconnected before its body ended"


def test_a_msgpack_body_is_held_once_by_its_request() -> None:
    # Read through Starlette's body() it stayed cached in the request beside the
    # UnpackedBody made of it: twice the body until the answer (review r10).
    app, seen = bounded_app()
    sent = msgpack.packb({"a": [0.5] * 200_000, "b": "y"})  # ~1.8 MB
    assert post(app, "/pair", sent, "application/msgpack").status_code == 200
    request = seen["request"]
    held = [v for v in vars(request).values() if isinstance(v, bytes) and len(v) >= len(sent)]
    held.append(request.bounded_body)
    assert len({id(v) for v in held}) == 1, f"{len(held)} copies of a {len(sent):,}-byte body"
