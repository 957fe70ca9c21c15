"""The schema and the validator say the same thing (issue 25's contract findings): what
the document allows is accepted, what it documents is what the routes answer."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import msgpack

from tests.service.wire import problem

CONTRACT = json.loads(
    (Path(__file__).resolve().parents[2] / "openapi" / "openapi.json").read_text()
)


def test_an_empty_dataset_is_refused_by_the_schema_and_the_validator(client) -> None:
    body = CONTRACT["paths"]["/v1/datasets/{name}"]["put"]["requestBody"]["content"]
    for media in ("application/json", "application/msgpack"):
        assert body[media]["schema"] == {"$ref": "#/components/schemas/DatasetUpload"}
    assert CONTRACT["components"]["schemas"]["DatasetUpload"]["minProperties"] == 1
    answer = problem(client.put("/v1/datasets/empty", json={}), 422, "validation")
    assert answer["errors"][0]["field"] == "body"


def test_a_failed_jobs_result_documents_the_problems_it_answers() -> None:
    responses = CONTRACT["paths"]["/v1/jobs/{job_id}/result"]["get"]["responses"]
    # a failed job answers the synchronous request's problem, with its status
    for status in ("409", "422", "500", "502", "503", "504", "507"):
        assert status in responses, status


def test_the_event_stream_describes_its_events() -> None:
    ok = CONTRACT["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]
    stream = ok["content"]["text/event-stream"]
    assert "progress" in stream["schema"]["description"]
    item = stream["x-item-schema"]
    assert item["properties"]["data"] == {"$ref": "#/components/schemas/JobInfo"}
    assert set(item["properties"]["event"]["enum"]) == {
        "queued",
        "progress",
        "succeeded",
        "failed",
        "cancelled",
    }


def test_every_request_integer_is_bounded() -> None:
    def integers(node, path):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                yield path, node
            for key, value in node.items():
                yield from integers(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from integers(value, f"{path}[{i}]")

    schemas = CONTRACT["components"]["schemas"]
    requests = {name: s for name, s in schemas.items() if name.endswith(("Request", "Slice"))}
    found = list(integers(requests, "schemas"))
    assert len(found) >= 15
    unbounded = [path for path, node in found if node.get("maximum", 2**64) > 2**53 - 1]
    assert unbounded == []


def test_an_integer_option_written_as_a_whole_float_is_that_integer(client) -> None:
    # JSON Schema's "integer" includes 4.0: the validator takes it, as 4; 4.5 stays a 422.
    made = client.post(
        "/v1/tapes",
        json={
            "definition": {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]},
            "target": "loss",
        },
    )
    assert made.status_code == 201, made.text
    trace = f"/v1/tapes/{made.json()['tape_id']}/trace"
    whole = client.post(trace, json={"method": "exact", "batch_size": 2.0, "seed": 3.0})
    plain = client.post(trace, json={"method": "exact", "batch_size": 2, "seed": 3})
    assert whole.status_code == 200, whole.text
    assert whole.json()["trace"] == plain.json()["trace"] == 4.0  # H = 2 I
    answer = problem(client.post(trace, json={"batch_size": 2.5}), 422, "validation")
    assert answer["errors"][0]["field"] == "batch_size"
    client.delete(f"/v1/tapes/{made.json()['tape_id']}")


# Each schema-valid request is accepted and each schema-invalid one refused with a
# "validation" 422: the document's verdict (jsonschema over its own components) against
# the live server's, body by body. A 422 of another type (the definition cannot run, a
# 404 for a stored name) is past validation: the validator took the body.

DEFINITION = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]}


def _schema_says(schema_name: str, body: object) -> bool:
    document = {"$ref": f"#/components/schemas/{schema_name}", **CONTRACT}
    return jsonschema.Draft202012Validator(document).is_valid(body)


def _server_says(answer: httpx.Response) -> bool:
    if answer.status_code != 422:
        return True
    return answer.json()["type"] != "/problems/validation"


def _agree(client, path: str, schema_name: str, cases: list[tuple[dict, bool]]) -> None:
    for body, valid in cases:
        for encoding in ("json", "msgpack"):
            if encoding == "json":
                answer = client.post(path, json=body)
            else:
                answer = client.post(
                    path,
                    content=msgpack.packb(body),
                    headers={"Content-Type": "application/msgpack"},
                )
            assert _schema_says(schema_name, body) is valid, (body, "schema")
            assert _server_says(answer) is valid, (body, encoding, answer.text)


def test_definition_or_model_exactly_one_in_the_schema_and_the_validator(client) -> None:
    base = {"target": "loss"}
    _agree(
        client,
        "/v1/gradient",
        "GradientRequest",
        [
            ({**base, "definition": DEFINITION}, True),
            ({**base, "definition": DEFINITION, "model": None}, True),  # null is absent
            ({**base}, False),
            ({**base, "definition": None, "model": None}, False),
            ({**base, "definition": DEFINITION, "model": "mlp"}, False),
            ({**base, "model": "no-such-model"}, True),  # a 404 past validation
            # variables go with a stored model only
            ({**base, "definition": DEFINITION, "variables": {"w": [1.0, 2.0]}}, False),
            ({**base, "definition": DEFINITION, "variables": None}, True),
        ],
    )


def test_point_or_variables_on_every_stateless_route(client) -> None:
    """`point` and `variables` each move a stored model's sources; given both, the
    stateless routes answered 200 at the point and dropped `variables` unread (the data
    guide, and POST /v1/tapes, said a 422). Now every route refuses the pair, in the
    schema and the validator (as POST /v1/tapes did), and each alone answers at its own
    values."""
    stored = client.post("/v1/models", json={"name": "contract-point", "definition": DEFINITION})
    assert stored.status_code in (200, 201), stored.text
    base = {"model": "contract-point", "target": "loss"}
    point, variables = [3.0, 4.0], {"w": [5.0, 6.0]}
    routes = {
        "/v1/gradient": ("GradientRequest", {}),
        "/v1/jacobian": ("JacobianRequest", {}),
        "/v1/hessian": ("HessianRequest", {}),
        "/v1/hvp": ("HVPRequest", {"vector": {"w": [1.0, 0.0]}}),
    }
    for path, (schema_name, extra) in routes.items():
        body = {**base, **extra}
        _agree(
            client,
            path,
            schema_name,
            [
                ({**body, "point": point}, True),
                ({**body, "variables": variables}, True),
                ({**body, "point": point, "variables": variables}, False),
                ({**body, "point": point, "variables": {}}, True),  # none given
                ({**body, "point": None, "variables": variables}, True),
            ],
        )
        # each alone at its own values: sum(w * w) at (3, 4) and at (5, 6)
        at_point = client.post(path, json={**body, "point": point}).json()
        at_variables = client.post(path, json={**body, "variables": variables}).json()
        assert at_point["value"]["data"] == [25.0] and at_variables["value"]["data"] == [61.0]
    refused = problem(
        client.post("/v1/gradient", json={**base, "point": point, "variables": variables}), 422
    )
    assert "'point'" in refused["detail"] and "'variables'" in refused["detail"], refused
    client.delete("/v1/models/contract-point")


def test_shard_options_need_shards_in_the_schema_and_the_validator(client) -> None:
    base = {"target": "loss", "definition": DEFINITION}
    _agree(
        client,
        "/v1/gradient",
        "GradientRequest",
        [
            ({**base, "shard_by": "x"}, False),
            ({**base, "shard_by": None}, True),
            ({**base, "shard_reduction": "mean"}, False),
            ({**base, "shard_reduction": None}, False),  # named, even null, needs shards
            ({**base, "shards": 1, "shard_reduction": "sum"}, True),
        ],
    )


def test_one_vector_form_in_the_schema_and_the_validator(client) -> None:
    base = {"target": "loss", "definition": DEFINITION}
    vector = {"w": [1.0, 0.0]}
    _agree(
        client,
        "/v1/hvp",
        "HVPRequest",
        [
            ({**base, "vector": vector}, True),
            ({**base, "vectors": [vector], "vector": None}, True),
            ({**base, "flat_vector": [1.0, 0.0]}, True),
            ({**base}, False),
            ({**base, "vector": vector, "vectors": [vector]}, False),
            ({**base, "vectors": []}, False),
        ],
    )


def test_an_imported_model_is_onnx_or_stored_in_the_schema_and_the_validator(client) -> None:
    def body(model: dict) -> dict:
        definition = {"models": {"net": model}, "inputs": {"x": [1.0]}, "program": ["y = net(x)"]}
        return {"target": "y", "definition": definition}

    _agree(
        client,
        "/v1/gradient",
        "GradientRequest",
        [
            (body({"stored": "no-such-model"}), True),  # a 404 past validation
            (body({"stored": "no-such-model", "onnx": None}), True),
            (body({}), False),
            (body({"onnx": None, "stored": None}), False),
            (body({"onnx": "AAAA", "stored": "m"}), False),
            # base64 as the decoder reads it: padded, of its alphabet only
            (body({"onnx": "AAAA"}), True),  # not an ONNX file: a 422 past validation
            (body({"onnx": "AAA"}), False),
            (body({"onnx": "AA\u00e9="}), False),
            (body({"onnx": "AAAA=="}), False),  # excess padding, which b64decode ignores
        ],
    )


def _nested(row: list, depth: int) -> list:
    """`row` inside `depth` lists of one element each."""
    for _ in range(depth):
        row = [row]
    return row


def test_tensor_elements_and_dimensions_in_the_schema_and_the_validator(client) -> None:
    base = {"target": "loss", "definition": DEFINITION}
    _agree(
        client,
        "/v1/gradient",
        "GradientRequest",
        [
            ({**base, "point": [3.0, True]}, True),
            ({**base, "point": ["NaN", 1.0], "allow_nonfinite": True}, True),
            ({**base, "point": [{}]}, False),  # issue 25's case: not a number
            ({**base, "point": [[{}]]}, False),
            ({**base, "point": {"shape": [2], "data": [[{}], 1.0]}}, False),
            # nesting: as deep as the document's levels (MAX_NESTING), and no deeper
            ({**base, "point": {"shape": [1] * 7 + [2], "data": _nested([1.0, 2.0], 7)}}, True),
            ({**base, "point": {"shape": [1] * 8 + [2], "data": _nested([1.0, 2.0], 8)}}, False),
            ({**base, "point": _nested([1.0, 2.0], 8)}, False),
            ({**base, "point": {"shape": [2.0], "data": [1.0, 2.0]}}, True),  # a whole 2
            ({**base, "point": {"shape": [2.5], "data": [1.0, 2.0]}}, False),
            ({**base, "point": {"shape": [2**31], "data": [1.0, 2.0]}}, False),  # NumPy's
            # true/false beside a non-finite string: numbers, not the text 'True'
            ({**base, "point": [True, "NaN"], "allow_nonfinite": True}, True),
            # only the three non-finite strings stand for numbers (no "nan", no "1.5")
            ({**base, "point": ["nan", 1.0], "allow_nonfinite": True}, False),
            ({**base, "point": ["1.5", "NaN"], "allow_nonfinite": True}, False),
            ({**base, "point": {"shape": [2], "base64": "AACAPwAAAEA="}}, True),
            ({**base, "point": {"shape": [2], "base64": "AACAPwAAAEA"}}, False),
            ({**base, "point": {"shape": [2], "base64": "AACAPwAAAEA=="}}, False),  # excess
        ],
    )
    # the whole float is that integer: the point w = (1, 2) answers the gradient 2 w
    answer = client.post(
        "/v1/gradient", json={**base, "point": {"shape": [2.0], "data": [1.0, 2.0]}}
    )
    assert answer.json()["gradients"]["w"]["data"] == [2.0, 4.0]
    mixed = {**base, "point": [True, "Infinity"], "allow_nonfinite": True}
    assert client.post("/v1/gradient", json=mixed).json()["gradients"]["w"]["data"] == [
        2.0,
        "Infinity",
    ]
