"""The operation table (service/core/operations.py) is the one declaration of an
operation on a tape: this walks it and fails on a row that is not routed, handled by the
worker, run or refused on a sharded tape, named for non-finite diagnoses, in the Python
SDK, or in the contract (openapi/openapi.json). And the options cross to the worker
typed: msgspec Structs, checked field by field on the way in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gradtape.client import _core
from gradtape.client.tape import RemoteTape

from engine.language import Limits
from service.api.routes import tapes as tape_routes
from service.api.schemas.operations import REQUEST_MODELS
from service.core.operations import (
    BY_KIND,
    OPERATIONS,
    CurvatureChoice,
    EigenvaluesOptions,
    Sharded,
    TraceOptions,
    curvature_choice,
    decode_options,
    encode_options,
)
from service.domain import shards as domain_shards
from service.worker import dispatch, tapes
from service.worker import shards as worker_shards
from tests.service.test_jobs import wait

ROOT = Path(__file__).resolve().parents[2]
IDS = [op.kind for op in OPERATIONS]


@pytest.fixture(scope="module")
def routes() -> dict[str, Any]:
    """The tape router's POST routes by path (the app includes it as it is)."""
    return {r.path: r for r in tape_routes.router.routes if "POST" in getattr(r, "methods", ())}


@pytest.fixture(scope="module")
def contract() -> dict[str, Any]:
    document: dict[str, Any] = json.loads((ROOT / "openapi" / "openapi.json").read_text())
    return document


@pytest.mark.parametrize("op", OPERATIONS, ids=IDS)
def test_routed(op: Any, routes: dict[str, Any]) -> None:
    route = routes.get(f"/v1/tapes/{{tape_id}}/{op.path}")
    assert route is not None, f"{op.kind}: no POST /v1/tapes/{{tape_id}}/{op.path}"
    assert route.name == op.name
    body = route.dependant.body_params[0]
    assert body.field_info.annotation is REQUEST_MODELS[op.kind]
    assert route.response_model.__name__ == op.result_name
    # Every option is a field of the request, with the Struct's default.
    fields = REQUEST_MODELS[op.kind].model_fields
    for f in msgspec.structs.fields(op.options):
        assert f.name in fields, f"{op.kind}: option {f.name} is not in the request"
        assert fields[f.name].default == f.default
    for name in op.tensors:
        assert name in fields
    # A row whose options state a curvature answers `curvature_used` (its schema says so).
    answers = route.response_model.model_fields
    assert ("curvature_used" in answers) is op.answers_curvature, op.kind
    if op.answers_curvature:
        assert answers["curvature_used"].is_required(), op.kind


@pytest.mark.parametrize("op", OPERATIONS, ids=IDS)
def test_handled_and_diagnosed(op: Any) -> None:
    assert op.kind in tapes.HANDLERS, f"{op.kind}: no worker handler"
    assert op.kind in tapes.OPERATION_FUNCTIONS, f"{op.kind}: no @operation function"
    assert dispatch.HANDLERS[op.kind] is tapes.HANDLERS[op.kind]
    assert dispatch.ALGORITHMS[op.kind] == op.diagnosis and op.diagnosis


@pytest.mark.parametrize("op", OPERATIONS, ids=IDS)
def test_sharded_or_refused(op: Any) -> None:
    if op.sharded is Sharded.algorithm:
        assert op.kind in domain_shards.ALGORITHMS
        # The coordinator builds the same function over the parts (no second list).
        run = worker_shards.Run("r", [], {})
        context = tapes.WorkerContext(0, "cpu", Limits(), 1024, 2048, 1 << 24)
        payload = {"options": encode_options(msgspec.convert({}, op.options))}
        assert callable(worker_shards._work(op.kind, payload, context, run))
    elif op.sharded is Sharded.own:
        assert op.kind not in domain_shards.ALGORITHMS
        source = Path(domain_shards.__file__).read_text()
        assert f'"{op.kind}"' in source, f"{op.kind}: no sharded path of its own"
    else:
        assert op.refusal, f"{op.kind}: refused on a sharded tape without a reason"


class _Recorder:
    """A client whose `_run` sends nothing: it keeps the first request an SDK call makes."""

    def __init__(self) -> None:
        self._core = _core.Core(transport="json")
        self.sent: list[_core.HTTPRequest] = []

    def _run(self, op: Any) -> Any:
        self.sent.append(next(op))
        op.close()


@pytest.mark.parametrize("op", OPERATIONS, ids=IDS)
def test_in_the_sdk(op: Any) -> None:
    client = _Recorder()
    answer = {"tape_id": "t", "value": 0.0, "gradients": {"w": [0.0]}}
    tape = RemoteTape(client, answer, None, "loss", None)  # type: ignore[arg-type]
    if op.sdk_method:  # a named method; every operation is also RemoteTape.call(path)
        method = getattr(tape, op.sdk_method, None)
        assert method is not None, f"{op.kind}: no RemoteTape.{op.sdk_method}"
        method() if op.kind != "tape_influence" else method(rows=[0])
    tape.call(op.path, max_seconds=1.0)
    for request in client.sent:
        assert (request.method, request.path) == ("POST", f"/v1/tapes/t/{op.path}")
        body = json.loads(request.content or b"{}")
        unknown = set(body) - set(REQUEST_MODELS[op.kind].model_fields) - {"async"}
        assert not unknown, f"{op.sdk_method} sends fields the request does not take: {unknown}"


@pytest.mark.parametrize("op", OPERATIONS, ids=IDS)
def test_in_the_contract(op: Any, contract: dict[str, Any]) -> None:
    post = contract["paths"].get(f"/v1/tapes/{{tape_id}}/{op.path}", {}).get("post")
    assert post is not None, f"{op.kind}: not in openapi/openapi.json (regenerate it)"
    assert post["operationId"] == op.name
    schemas = contract["components"]["schemas"]
    assert op.request in schemas and op.result_name in schemas
    assert set(schemas[op.request]["properties"]) == set(REQUEST_MODELS[op.kind].model_fields) - {
        "run_async"
    } | ({"async"} if op.job else set())


def test_options_cross_typed() -> None:
    trace = msgspec.convert({"method": "hutchinson", "max_hvps": 40, "seed": None}, TraceOptions)
    again = decode_options(BY_KIND["tape_trace"], encode_options(trace))
    assert again == trace and isinstance(again, TraceOptions) and again.method == "hutchinson"
    with pytest.raises(msgspec.ValidationError, match=r"max_hvps"):
        decode_options(BY_KIND["tape_trace"], {"max_hvps": "many"})
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `maxhvps`"):
        decode_options(BY_KIND["tape_trace"], {"maxhvps": 3})
    # Request-only checks live on the options and run wherever they are built.
    with pytest.raises(msgspec.ValidationError, match="largest magnitude"):
        msgspec.convert({"method": "power", "which": "SA"}, EigenvaluesOptions)
    assert msgspec.convert({"method": "power"}, EigenvaluesOptions).which == "LM"
    with pytest.raises(msgspec.ValidationError, match="Monte-Carlo Fisher"):
        curvature_choice({"curvature": "ggn", "samples": 3})
    assert curvature_choice(trace) == CurvatureChoice()


# A finished job's progress: the figures its row declares, read from its real answer ------

LOGISTIC = {
    "variables": {"w": {"dtype": "float64", "shape": [3], "data": [0.5, -0.3, 0.2]}},
    "inputs": {
        "X": {
            "dtype": "float64",
            "shape": [8, 3],
            "data": [((i * 7 + j * 3) % 11 - 5) / 4 for i in range(8) for j in range(3)],
        },
        "y": {"dtype": "float64", "shape": [8], "data": [i % 2 for i in range(8)]},
    },
    "program": ["z = X @ w", "loss = sigmoid_cross_entropy(z, y)"],
}
JOB_BODIES: dict[str, dict[str, Any]] = {
    "eigenvalues": {"k": 1},
    "trace": {"method": "hutchinson", "max_hvps": 40, "batch_size": 4},
    "diagonal": {"method": "exact"},
    "spectral-density": {"probes": 2, "steps": 3},
    "solve": {"damping": 0.1},
    "influence": {"rows": [0], "damping": 0.1},
    "frobenius-norm": {"max_hvps": 40, "batch_size": 8},
    "per-example": {},
    "kfac": {},
    "laplace": {},
}


def _finished(client: Any, location: str) -> dict[str, Any]:
    job = wait(client, location, ("succeeded", "failed", "cancelled"), timeout=120)
    assert job["state"] == "succeeded", job
    return job


def test_a_finished_jobs_progress_is_its_answers_declared_figures(client: Any) -> None:
    """Every job-capable row, run as a real job: its declared keys are in its answer, and
    its final progress carries exactly the figures they give (the declaration, not the
    answer's keys, decides: a new row must declare them)."""
    from service.domain.jobs import KEEP, TAKES

    assert set(JOB_BODIES) == {op.path for op in OPERATIONS if op.job}
    r = client.post("/v1/tapes", json={"definition": LOGISTIC, "target": "loss", "output": "z"})
    assert r.status_code == 201, r.text
    tape_id = r.json()["tape_id"]
    for op in OPERATIONS:
        if not op.job:
            continue
        started = client.post(
            f"/v1/tapes/{tape_id}/{op.path}", json={**JOB_BODIES[op.path], "async": True}
        )
        assert started.status_code == 202, (op.kind, started.text)
        job = _finished(client, started.headers["location"])
        answer, progress, declared = job["result"], job["progress"], op.progress
        missing = [k for k in declared.keys() if k not in answer]
        assert not missing, f"{op.kind}: declares {missing}, not in its answer {sorted(answer)}"
        if declared.done is None:  # one pass: nothing reported, nothing to copy
            assert progress is None or progress.get("estimate") is None, (op.kind, progress)
            continue
        assert progress is not None, f"{op.kind}: an algorithm job that reported nothing"
        assert progress["done"] == answer[declared.done] and progress["eta"] == 0.0
        for name, figure in (("estimate", declared.estimate), ("error", declared.error)):
            if figure is None:
                continue
            want = TAKES[figure.take](answer[figure.key], answer)
            if want is not KEEP:
                assert progress[name] == pytest.approx(want), (op.kind, name)
