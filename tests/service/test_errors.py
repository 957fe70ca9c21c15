"""Every error is application/problem+json (RFC 9457) with a detail that names the field,
the line or the limit; malformed, oversized and mistyped requests are 4xx, never 500."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.api.schemas import GRADIENT_EXAMPLE
from tests.service.wire import MSGPACK, arr, num, post, problem, t, t64

BODY = json.dumps(GRADIENT_EXAMPLE)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/xml", "application/x-www-form-urlencoded"]
)
def test_unsupported_media_type(client, content_type: str) -> None:
    found = problem(
        client.post("/v1/gradient", content=BODY, headers={"content-type": content_type}),
        415,
        "unsupported-media-type",
    )
    assert content_type in found["detail"] and "application/msgpack" in found["detail"]


def test_missing_content_type(client) -> None:
    found = problem(client.post("/v1/gradient", content=BODY.encode()), 415)
    assert "no Content-Type" in found["detail"]


def test_json_with_charset_is_json(client) -> None:
    response = client.post(
        "/v1/gradient", content=BODY, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200


def test_not_acceptable(client) -> None:
    found = problem(
        client.post("/v1/gradient", json=GRADIENT_EXAMPLE, headers={"accept": "text/html"}),
        406,
        "not-acceptable",
    )
    assert "text/html" in found["detail"]


def test_malformed_json(client) -> None:
    found = problem(
        client.post(
            "/v1/gradient", content=b'{"target": ', headers={"content-type": "application/json"}
        ),
        400,
        "malformed-body",
    )
    assert "not valid JSON" in found["detail"]


def test_malformed_msgpack(client) -> None:
    found = problem(
        client.post("/v1/gradient", content=b"\xc1\xc1\xc1", headers={"content-type": MSGPACK}),
        400,
        "malformed-body",
    )
    assert "msgpack" in found["detail"]


def test_body_too_large(client) -> None:  # the tests' server takes up to 4 MiB
    big = b"x" * (4 * 2**20 + 1)
    found = problem(
        client.post("/v1/gradient", content=big, headers={"content-type": "application/json"}),
        413,
        "body-too-large",
    )
    assert "4,194,304" in found["detail"] and found["limit"] == 4 * 2**20


def test_chunked_body_too_large(client) -> None:
    def chunks():
        for _ in range(5):
            yield b"x" * 2**20

    found = problem(
        client.post("/v1/gradient", content=chunks(), headers={"content-type": "application/json"}),
        413,
        "body-too-large",
    )
    assert "4,194,304" in found["detail"]


def test_chunked_body_within_the_limit_is_read(client) -> None:
    def chunks():
        yield BODY[:20].encode()
        yield BODY[20:].encode()

    response = client.post(
        "/v1/gradient", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


def test_unknown_field_is_named(client) -> None:
    body = {**GRADIENT_EXAMPLE, "definition": {**GRADIENT_EXAMPLE["definition"], "extra": 1}}
    found = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert found["errors"][0]["field"] == "definition.extra"
    assert found["detail"].startswith("definition.extra:")


def test_missing_field_is_named(client) -> None:
    body = {k: v for k, v in GRADIENT_EXAMPLE.items() if k != "target"}
    found = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert found["errors"] == [{"field": "target", "message": "Field required", "kind": "missing"}]


def test_body_that_is_not_an_object(client) -> None:
    problem(client.post("/v1/gradient", json=[1, 2]), 422, "validation")
    problem(client.post("/v1/gradient", json="text"), 422, "validation")
    problem(
        client.post("/v1/gradient", content=b"", headers={"content-type": "application/json"}),
        422,
        "validation",
    )


def _with_input(value) -> dict:
    return {
        "definition": {
            "variables": {"w": 2.0},
            "inputs": {"x": value},
            "program": ["y = sum(w * x)"],
        },
        "target": "y",
    }


def test_nan_in_inputs_is_refused(client) -> None:
    raw = json.dumps(_with_input([1.0, 2.0])).replace("2.0]", "NaN]")
    found = problem(
        client.post("/v1/gradient", content=raw, headers={"content-type": "application/json"}),
        422,
        "validation",
    )
    assert found["errors"][0]["field"] == "definition.inputs.x"
    assert "allow_nonfinite" in found["detail"]
    found = problem(client.post("/v1/gradient", json=_with_input(t64([1.0, np.inf]))), 422)
    assert "1 of 2" in found["detail"]


def test_nonfinite_allowed_when_asked(client) -> None:
    body = {
        **_with_input({"dtype": "float32", "shape": [2], "data": [1.0, "Infinity"]}),
        "allow_nonfinite": True,
    }
    answer = post(client, "/v1/gradient", body)
    assert answer["value"]["data"] == ["Infinity"]
    assert answer["gradients"]["w"]["data"] == ["Infinity"]
    nan = post(
        client,
        "/v1/gradient",
        {**body, "definition": {**body["definition"], "program": ["y = sum(w * x) * 0"]}},
    )
    assert nan["value"]["data"] == ["NaN"]


@pytest.mark.parametrize(
    "tensor,field,words",
    [
        ({"dtype": "float32", "shape": [3], "data": [1, 2]}, "definition.inputs.x", "2 element"),
        ({"dtype": "float32", "shape": [2], "base64": "AAAA"}, "definition.inputs.x", "3 byte"),
        (
            {"dtype": "float32", "shape": [2], "base64": "not base64!"},
            "definition.inputs.x",
            "not valid base64",
        ),
        ({"dtype": "int8", "data": [1, 300]}, "definition.inputs.x", "range of int8"),
        ({"dtype": "int32", "data": [1.5]}, "definition.inputs.x", "whole numbers"),
        ({"dtype": "float32", "data": [[1, 2], [3]]}, "definition.inputs.x", "regular"),
        ({"dtype": "float32", "data": ["a"]}, "definition.inputs.x", "'a'"),
        (
            {"dtype": "complex64", "data": [1]},
            "definition.inputs.x.TensorData.dtype",
            "Input should be",
        ),
        (
            {"dtype": "float32", "shape": [-1], "data": []},
            "definition.inputs.x.TensorData.shape.0",
            "greater than or equal",
        ),
        (True, "definition.inputs.x", "a tensor is"),
    ],
)
def test_malformed_tensors_name_the_field(client, tensor, field: str, words: str) -> None:
    found = problem(client.post("/v1/gradient", json=_with_input(tensor)), 422, "validation")
    assert found["errors"][0]["field"] == field, found
    assert words in found["detail"], found


@pytest.mark.parametrize(
    "variable,field,words",
    [
        (
            {"dtype": "complex64", "data": [1]},
            "definition.variables.w.TensorData.dtype",
            "Input should be",
        ),
        (
            {"value": {"dtype": "float32", "shape": [-1], "data": []}, "trainable": True},
            "definition.variables.w.value.TensorData.shape.0",
            "greater than or equal",
        ),
        ({"value": [1.0], "trainable": "maybe"}, "definition.variables.w.trainable", "boolean"),
        ("abc", "definition.variables.w", "a tensor is"),
    ],
)
def test_malformed_variables_name_the_field_as_sent(
    client, variable, field: str, words: str
) -> None:
    """A variable's path names what the client wrote, as an input's does: not the
    schema's union tags (`definition.variables.w.VariableSpec.value.TensorData...`,
    `definition.variables.w.TensorValue...` before)."""
    body = {
        "definition": {"variables": {"w": variable}, "program": ["y = sum(w)"]},
        "target": "y",
    }
    found = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert found["errors"][0]["field"] == field, found
    assert found["detail"].startswith(field + ": ") and words in found["detail"], found


def test_time_limit_above_the_maximum(client) -> None:
    found = problem(
        client.post("/v1/gradient", json={**GRADIENT_EXAMPLE, "time_limit": 61}), 422, "too-large"
    )
    assert found["errors"][0]["field"] == "time_limit" and "60" in found["detail"]
    problem(
        client.post("/v1/gradient", json={**GRADIENT_EXAMPLE, "time_limit": 0}), 422, "validation"
    )


def test_not_found(client) -> None:
    found = problem(client.get("/v2/gradient"), 404, "not-found")
    assert found["instance"] == "/v2/gradient" and "/docs" in found["detail"]


def test_method_not_allowed(client) -> None:
    response = client.get("/v1/gradient")
    found = problem(response, 405, "method-not-allowed")
    assert response.headers["allow"] == "POST" and "allowed: POST" in found["detail"]
    problem(client.post("/healthz"), 405)


def test_problem_types_are_documented(client) -> None:
    response = client.get("/problems/batch-dependence")
    assert response.status_code == 200 and "independent" in response.text
    problem(client.get("/problems/nothing"), 404)


def test_execution_errors_are_422(client) -> None:
    body = {
        "definition": {
            "inputs": {"a": t(np.zeros((2, 2))), "b": t([1.0, 1.0])},
            "program": ["x = sum(solve(a, b))"],
        },
        "target": "x",
        "sources": ["b"],
    }
    found = problem(client.post("/v1/gradient", json=body), 422, "execution")
    assert found["errors"][0]["op"] == "solve" and found["errors"][0]["line"] == 1


def test_server_keeps_answering(client) -> None:
    assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    assert arr(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["gradients"]["w2"]) == 7.0
