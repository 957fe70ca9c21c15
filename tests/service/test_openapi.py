"""openapi/openapi.json is the API contract: generated from the app, and this test fails
when it goes stale (regenerate with `gradtape openapi --out openapi/openapi.json`)."""

from __future__ import annotations

import json

from service.cli import openapi_document
from tests.service.conftest import ROOT

CONTRACT = ROOT / "openapi" / "openapi.json"


def test_contract_is_current() -> None:
    current = openapi_document()
    assert CONTRACT.read_text() == current, (
        "openapi/openapi.json is stale: run `gradtape openapi --out openapi/openapi.json`"
    )


def test_live_document_is_the_contract(client) -> None:
    assert client.get("/openapi.json").json() == json.loads(CONTRACT.read_text())


def test_named_schemas_and_problem_responses() -> None:
    spec = json.loads(CONTRACT.read_text())
    schemas = spec["components"]["schemas"]
    for name in ("GradientRequest", "GradientResponse", "JacobianRequest", "HessianRequest",
                 "HVPRequest", "TensorData", "TensorBase64", "Definition", "Problem"):
        assert name in schemas
    gradient = spec["paths"]["/v1/gradient"]["post"]
    assert set(gradient["requestBody"]["content"]) == {"application/json", "application/msgpack"}
    assert set(gradient["responses"]["200"]["content"]) == {"application/json",
                                                            "application/msgpack"}
    for status in ("400", "413", "415", "422", "502", "503", "504"):
        assert list(gradient["responses"][status]["content"]) == ["application/problem+json"]
    assert schemas["GradientRequest"]["examples"][0]["target"] == "s"
