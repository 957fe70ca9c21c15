"""openapi/openapi.json is the API contract: generated from the app, and this test fails
when it goes stale (regenerate with `gradtape openapi --out openapi/openapi.json`)."""

from __future__ import annotations

import json
import re
import tomllib

from service.cli import openapi_document
from service.core.operations import OPERATIONS
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
    for name in (
        "GradientRequest",
        "GradientResponse",
        "JacobianRequest",
        "HessianRequest",
        "HVPRequest",
        "TensorData",
        "TensorBase64",
        "Definition",
        "Problem",
        "TapeCreateRequest",
        "TapeCreateResponse",
        "TapeInfo",
        "TapeList",
        "TapeHVPRequest",
        "TapeHVPResponse",
        "TapeGradientRequest",
        "TapeJacobianRequest",
        "TapeUpdateRequest",
        "EigenvaluesRequest",
        "EigenvaluesResponse",
        "TraceRequest",
        "TraceResponse",
        "SolveRequest",
        "SolveResponse",
        "ModelCreateRequest",
        "ModelInfo",
        "ModelList",
    ):
        assert name in schemas
    gradient = spec["paths"]["/v1/gradient"]["post"]
    assert set(gradient["requestBody"]["content"]) == {"application/json", "application/msgpack"}
    assert set(gradient["responses"]["200"]["content"]) == {
        "application/json",
        "application/msgpack",
    }
    for status in ("400", "413", "415", "422", "502", "503", "504"):
        assert list(gradient["responses"][status]["content"]) == ["application/problem+json"]
    assert schemas["GradientRequest"]["examples"][0]["target"] == "s"


def test_operation_ids_are_stable_and_readable() -> None:
    spec = json.loads(CONTRACT.read_text())
    ids = {
        (path, method): op["operationId"]
        for path, item in spec["paths"].items()
        for method, op in item.items()
    }
    assert ids == {
        ("/v1/gradient", "post"): "compute_gradient",
        ("/v1/jacobian", "post"): "compute_jacobian",
        ("/v1/hessian", "post"): "compute_hessian",
        ("/v1/hvp", "post"): "compute_hvp",
        ("/v1/tapes", "post"): "create_tape",
        ("/v1/tapes", "get"): "list_tapes",
        ("/v1/tapes/{tape_id}", "get"): "read_tape",
        ("/v1/tapes/{tape_id}", "patch"): "update_tape",
        ("/v1/tapes/{tape_id}", "delete"): "delete_tape",
        ("/v1/tapes/{tape_id}/hvp", "post"): "compute_tape_hvp",
        ("/v1/tapes/{tape_id}/gradient", "post"): "compute_tape_gradient",
        ("/v1/tapes/{tape_id}/jacobian", "post"): "compute_tape_jacobian",
        # every row of the operation table (service/core/operations.py) by its own name;
        # those below are pinned: they must not change
        **{(f"/v1/tapes/{{tape_id}}/{op.path}", "post"): op.name for op in OPERATIONS},
        ("/v1/tapes/{tape_id}/eigenvalues", "post"): "compute_tape_eigenvalues",
        ("/v1/tapes/{tape_id}/trace", "post"): "estimate_tape_trace",
        ("/v1/tapes/{tape_id}/diagonal", "post"): "estimate_tape_diagonal",
        ("/v1/tapes/{tape_id}/spectral-density", "post"): "estimate_tape_spectral_density",
        ("/v1/tapes/{tape_id}/solve", "post"): "solve_tape",
        ("/v1/tapes/{tape_id}/influence", "post"): "compute_tape_influence",
        ("/v1/jobs", "get"): "list_jobs",
        ("/v1/jobs/{job_id}", "get"): "read_job",
        ("/v1/jobs/{job_id}", "delete"): "cancel_job",
        ("/v1/jobs/{job_id}/result", "get"): "read_job_result",
        ("/v1/jobs/{job_id}/events", "get"): "stream_job_events",
        ("/v1/models", "post"): "create_model",
        ("/v1/models", "get"): "list_models",
        ("/v1/models/{name}", "get"): "read_model",
        ("/v1/models/{name}", "delete"): "delete_model",
        ("/v1/models/{name}", "put"): "put_onnx_model",
        ("/v1/datasets", "get"): "list_datasets",
        ("/v1/datasets/{name}", "put"): "put_dataset",
        ("/v1/datasets/{name}", "get"): "read_dataset",
        ("/v1/datasets/{name}", "delete"): "delete_dataset",
        ("/v1/ops", "get"): "list_ops",
        ("/v1/per-example", "post"): "compute_per_example",
        ("/v1/tapes/{tape_id}/per-example", "post"): "compute_tape_per_example",
        ("/v1/tapes/{tape_id}/kfac", "post"): "compute_tape_kfac",
        ("/v1/tapes/{tape_id}/laplace", "post"): "fit_tape_laplace",
        (
            "/v1/tapes/{tape_id}/laplace/{laplace_id}/log-marginal-likelihood",
            "post",
        ): "compute_laplace_evidence",
        (
            "/v1/tapes/{tape_id}/laplace/{laplace_id}/predictive",
            "post",
        ): "compute_laplace_predictive",
        ("/v1/tapes/{tape_id}/laplace/{laplace_id}/samples", "post"): "sample_laplace_posterior",
        ("/v1/tapes/{tape_id}/laplace", "get"): "list_laplace_fits",
        ("/v1/tapes/{tape_id}/laplace/{laplace_id}", "get"): "read_laplace_fit",
        ("/v1/tapes/{tape_id}/laplace/{laplace_id}", "delete"): "delete_laplace_fit",
        ("/healthz", "get"): "check_health",
        ("/readyz", "get"): "check_readiness",
        ("/metrics", "get"): "read_metrics",
    }


def test_api_keys_are_declared_and_optional() -> None:
    spec = json.loads(CONTRACT.read_text())
    assert set(spec["components"]["securitySchemes"]) == {"bearerAuth", "apiKeyAuth"}
    tapes = spec["paths"]["/v1/tapes/{tape_id}/hvp"]["post"]
    assert tapes["security"] == [{"bearerAuth": []}, {"apiKeyAuth": []}, {}]
    assert "security" not in spec["paths"]["/healthz"]["get"]
    assert "201" in spec["paths"]["/v1/tapes"]["post"]["responses"]
    for status in ("401", "404", "429"):
        assert status in spec["paths"]["/v1/tapes"]["post"]["responses"]


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_deprecated_fields_say_what_instead_and_until_when() -> None:
    """The project's deprecation convention (service.core.operations.Deprecation): a
    deprecated answer field is still declared (and answered), marked `deprecated: true`,
    its description naming the release that removes it and a field of the same schema to
    read instead; once the package's version reaches that release, this fails until the
    field is gone."""
    spec = json.loads(CONTRACT.read_text())
    version = _release(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
    marked = {}
    for name, schema in spec["components"]["schemas"].items():
        for field, prop in schema.get("properties", {}).items():
            if prop.get("deprecated"):
                marked[f"{name}.{field}"] = prop
                notice = re.match(
                    r"Deprecated since gradtape ([\d.]+), removed in ([\d.]+): read `(\w+)`",
                    prop.get("description", ""),
                )
                assert notice, f"{name}.{field}: its description does not follow the convention"
                since, removed_in, instead = notice.groups()
                assert _release(since) <= version < _release(removed_in), (
                    f"{name}.{field}: removed in {removed_in}, and this is {version}: remove it"
                )
                assert instead in schema["properties"], (name, field, instead)
                assert field in schema.get("required", []), f"{name}.{field}: still answered"
    # The answers' old `curvature` strings (requests' `curvature` fields are not deprecated).
    assert set(marked) == {
        "FrobeniusNormResponse.curvature",
        "InfluenceResponse.curvature",
        "LaplaceResponse.curvature",
    }
