"""Hostile and careless input (issue 11): each case is one request a client could send
to hurt the service. Every answer is a precise problem (never a 500, never a hang), and
afterwards /readyz is ready with the same worker processes: nobody else paid for it."""

from __future__ import annotations

import base64

import httpx
import msgpack
import pytest

from tests.service.wire import MSGPACK, problem

HUGE = 2**70
W = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]}


@pytest.fixture
def unharmed(client: httpx.Client):
    """The workers' pids before the case; after it, the service is ready with the same."""
    def pids() -> list[int]:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        return [w["pid"] for w in ready.json()["workers"]]

    before = pids()
    yield
    assert pids() == before, "a worker was lost to this request"


def _definition_with(value: dict) -> dict:
    return {"definition": {"variables": {"w": value}, "program": ["loss = sum(w)"]},
            "target": "loss"}


@pytest.mark.parametrize("tensor", [
    {"dtype": "float32", "shape": [0, HUGE], "data": []},
    {"dtype": "float32", "shape": [0, HUGE], "base64": ""},
    {"dtype": "float32", "shape": [0] * 40, "data": []},
    {"dtype": "float32", "shape": [HUGE, HUGE], "data": [1.0]},
], ids=["huge-dimension", "huge-dimension-base64", "rank-40", "huge-product"])
def test_impossible_shapes_are_422_naming_the_shape(client, unharmed, tensor) -> None:
    body = problem(client.post("/v1/gradient", json=_definition_with(tensor)), 422)
    assert "definition.variables.w" in body["detail"] and "shape" in body["detail"]
    assert len(body["detail"]) < 400  # the client's numbers are not echoed at length


def test_impossible_shape_in_msgpack_is_422(client, unharmed) -> None:
    tensor = {"dtype": "float32", "shape": [0, 2**62], "data": b""}
    response = client.post("/v1/gradient", content=msgpack.packb(_definition_with(tensor)),
                           headers={"content-type": MSGPACK})
    assert "shape" in problem(response, 422)["detail"]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_uint64_from_booleans_is_stored_not_a_500(client, unharmed, encoding) -> None:
    body = {"name": f"bools-{encoding}",
            "definition": {"variables": {"w": {"dtype": "uint64", "shape": [2],
                                               "data": [True, False]}},
                           "inputs": {"x": [1.0, 2.0]}, "program": ["loss = sum(x * x)"]}}
    if encoding == "json":
        response = client.post("/v1/models", json=body)
    else:
        response = client.post("/v1/models", content=msgpack.packb(body),
                               headers={"content-type": MSGPACK})
    assert response.status_code == 201, response.text
    client.delete(f"/v1/models/bools-{encoding}")


def test_an_out_of_range_integer_is_422(client, unharmed) -> None:
    tensor = {"dtype": "uint8", "shape": [2], "data": [1, 300]}
    assert "range of uint8" in problem(
        client.post("/v1/gradient", json=_definition_with(tensor)), 422)["detail"]


def test_a_solve_whose_damping_overflows_is_a_422_not_nan(client, unharmed) -> None:
    created = client.post("/v1/tapes", json={"definition": {"variables": {"w": [1.0, 2.0]},
                          "program": ["loss = sum(w * w * w)"]}, "target": "loss"})
    tape = created.json()["tape_id"]
    try:
        body = problem(client.post(f"/v1/tapes/{tape}/solve", json={"damping": 1.7e308}),
                       422, "non-finite")
        assert "conjugate-gradient solve overflowed" in body["detail"]
    finally:
        client.delete(f"/v1/tapes/{tape}")


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_a_malformed_body(client, unharmed, depth) -> None:
    body = "[" * depth + "]" * depth
    response = client.post("/v1/gradient", content=body,
                           headers={"content-type": "application/json"})
    assert "parsed" in problem(response, 400, "malformed-body")["detail"]


def test_deeply_nested_msgpack_is_a_malformed_body(client, unharmed) -> None:
    depth = 10_000
    packed = b"\x91" * depth + b"\xc0"  # fixarray of one element, 10,000 deep
    response = client.post("/v1/gradient", content=packed, headers={"content-type": MSGPACK})
    assert response.status_code in (400, 422), response.text
    problem(response, response.status_code)


@pytest.mark.parametrize("line", [
    "loss = __import__('os').system('true')",
    "loss = (lambda: w)()",
    "loss = f'{w}'",
    "import os",
    "loss = w.__class__",
    "loss = sum(w) if True else w",
    "loss = [x for x in w]",
    "loss = eval('w')",
])
def test_code_that_is_not_the_language_is_refused(client, unharmed, line) -> None:
    body = {"definition": {"variables": {"w": [1.0]}, "program": [line]}, "target": "loss"}
    problem(client.post("/v1/gradient", json=body), 422, "definition")


def test_a_base64_tensor_of_the_wrong_length_is_422(client, unharmed) -> None:
    tensor = {"dtype": "float32", "shape": [3], "base64": base64.b64encode(b"\0" * 8).decode()}
    assert "byte" in problem(client.post("/v1/gradient", json=_definition_with(tensor)),
                             422)["detail"]
