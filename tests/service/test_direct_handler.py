"""The compute routes' requests handled without FastAPI's general handler
(bodies.direct_handler): the same answers, problems and order of checks as FastAPI's
own handler gives, request for request. Two apps in this process (each with its one
real worker): one as it is, one whose routes all keep FastAPI's handler; the same
requests, valid and not, go to both, and the direct one solves no dependency through
FastAPI for the compute requests whose body it parsed."""

from __future__ import annotations

import asyncio
from typing import Any

import fastapi.routing
import httpx
import msgpack
import pytest

from service.api import bodies
from service.api.schemas import GRADIENT_EXAMPLE
from service.core.config import Settings

MSGPACK = "application/msgpack"
JSON = "application/json"


def _requests(tape_id: str) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(method, path, body, headers): valid bodies and every kind of refusal."""
    import orjson

    def js(document: Any) -> bytes:
        return orjson.dumps(document)

    gradient = dict(GRADIENT_EXAMPLE)
    definition = gradient["definition"]
    hvp_vector = {"vector": {"w": [1.0, 0.5]}}
    out = [
        ("POST", "/v1/gradient", js(gradient), {"content-type": JSON}),
        ("POST", "/v1/gradient", js(gradient), {"content-type": JSON}),  # captured
        ("POST", "/v1/gradient", js(gradient), {"content-type": JSON}),  # replayed
        ("POST", "/v1/gradient", msgpack.packb(gradient), {"content-type": MSGPACK}),
        (
            "POST",
            "/v1/gradient",
            msgpack.packb(gradient),
            {"content-type": MSGPACK, "accept": MSGPACK},
        ),
        ("POST", "/v1/gradient", js({**gradient, "extra": 1}), {"content-type": JSON}),
        ("POST", "/v1/gradient", js({"target": "loss"}), {"content-type": JSON}),
        ("POST", "/v1/gradient", js({**gradient, "target": 3}), {"content-type": JSON}),
        ("POST", "/v1/gradient", js([1, 2]), {"content-type": JSON}),
        ("POST", "/v1/gradient", js(None), {"content-type": JSON}),
        (
            "POST",
            "/v1/gradient",
            js({**gradient, "definition": {**definition, "variables": {"w": "x"}}}),
            {"content-type": JSON},
        ),
        ("POST", "/v1/gradient", msgpack.packb([1]), {"content-type": MSGPACK}),
        ("POST", "/v1/gradient", b"{not json", {"content-type": JSON}),
        ("POST", "/v1/gradient", b"", {"content-type": JSON}),
        ("POST", "/v1/gradient", js(gradient), {"content-type": "text/plain"}),
        ("POST", "/v1/gradient", js(gradient), {"content-type": "application/problem+json"}),
        ("POST", "/v1/gradient", js(gradient), {}),
        ("POST", "/v1/gradient", js(gradient), {"content-type": JSON, "accept": "image/png"}),
        ("POST", "/v1/gradient", js({**gradient, "target": "nope"}), {"content-type": JSON}),
        ("POST", f"/v1/tapes/{tape_id}/hvp", js(hvp_vector), {"content-type": JSON}),
        ("POST", f"/v1/tapes/{tape_id}/hvp", msgpack.packb(hvp_vector), {"content-type": MSGPACK}),
        ("POST", f"/v1/tapes/{tape_id}/hvp", js({"vector": {"w": [1.0]}}), {"content-type": JSON}),
        ("POST", f"/v1/tapes/{tape_id}/hvp", js({"vectr": 1}), {"content-type": JSON}),
        ("POST", "/v1/tapes/t-none/hvp", js(hvp_vector), {"content-type": JSON}),
        ("POST", "/v1/tapes/t-none/hvp", js({"vectr": 1}), {"content-type": JSON}),
        ("POST", f"/v1/tapes/{tape_id}/hvp", js(hvp_vector), {"content-type": "text/csv"}),
    ]
    return out


def _comparable(response: httpx.Response) -> tuple[int, str, Any]:
    kind = response.headers.get("content-type", "")
    if kind.startswith(MSGPACK):
        body: Any = msgpack.unpackb(response.content)
    elif "json" in kind:
        body = response.json()
    else:
        body = response.content
    if isinstance(body, dict):
        body.pop("instance", None)  # a problem's id for this one request
        body.pop("tape_id", None)
    return response.status_code, kind, body


def test_the_direct_handler_answers_as_fastapis_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.api.app import create_app

    solved: list[str] = []
    solve = fastapi.routing.solve_dependencies

    async def counting(**kwargs: Any) -> Any:
        solved.append(kwargs["request"].url.path)
        return await solve(**kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)

    async def answers(app: Any) -> tuple[list[tuple[int, str, Any]], list[str]]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                created = await c.post(
                    "/v1/tapes",
                    json={
                        "definition": {
                            "variables": {"w": [0.5, -1.0]},
                            "inputs": {"x": [[1.0, 2.0], [3.0, 4.0]]},
                            "program": ["loss = sum(tanh(x @ w) ** 2)"],
                        },
                        "target": "loss",
                    },
                )
                assert created.status_code == 201, created.text
                tape_id = created.json()["tape_id"]
                solved.clear()
                got = []
                for method, path, body, headers in _requests(tape_id):
                    response = await c.request(method, path, content=body, headers=headers)
                    got.append(_comparable(response))
                return [(s, k, _without_tape(b, tape_id)) for s, k, b in got], list(solved)

    direct, direct_solved = asyncio.run(answers(create_app(Settings(workers=1))))
    monkeypatch.setattr(bodies, "direct_handler", lambda route, general: general)
    general, general_solved = asyncio.run(answers(create_app(Settings(workers=1))))
    for number, (left, right) in enumerate(zip(direct, general, strict=True)):
        assert left == right, f"request {number}: {left} != {right}"
    statuses = [status for status, _, _ in direct]
    assert statuses.count(200) >= 7 and {400, 404, 406, 415, 422} <= set(statuses)
    # FastAPI's handler solved the dependencies of every request that reached it (all
    # but the malformed JSON, refused as it was read); the direct one only those whose
    # body read_bounded left unparsed (empty, or of a media type it does not take).
    assert (len(general_solved), len(direct_solved)) == (25, 4), (general_solved, direct_solved)


def _without_tape(body: Any, tape_id: str) -> Any:
    """The answer with the tape's id (each app's own) taken out of its texts."""
    if isinstance(body, str):
        return body.replace(tape_id, "<tape>")
    if isinstance(body, dict):
        return {k: _without_tape(v, tape_id) for k, v in body.items()}
    if isinstance(body, list):
        return [_without_tape(v, tape_id) for v in body]
    return body
