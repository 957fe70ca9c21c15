"""The schema and the validator say the same thing (issue 25's contract findings): what
the document allows is accepted, what it documents is what the routes answer."""

from __future__ import annotations

import json
from pathlib import Path

from tests.service.wire import problem

CONTRACT = json.loads(
    (Path(__file__).resolve().parents[2] / "openapi" / "openapi.json").read_text()
)


def test_an_empty_dataset_is_refused_by_the_schema_and_the_validator(client) -> None:
    body = CONTRACT["paths"]["/v1/datasets/{name}"]["put"]["requestBody"]["content"]
    for media in ("application/json", "application/msgpack"):
        assert body[media]["schema"]["minProperties"] == 1
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
