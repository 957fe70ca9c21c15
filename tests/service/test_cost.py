"""Bytes cannot buy minutes (issue 25): a request whose estimated compute (contraction
FLOPs, transcendental elements and bytes moved by its passes, engine/language/cost.py)
exceeds its time limit is refused with a 422 before anything runs, naming the estimate,
the limit and the job form; the worker is not killed. Requests that fit are answered."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import arr, problem

BROADCAST = ["z = broadcast_to(sum(w), ({n}, {n}))", "loss = sum(sin(z) * z)"]
W = [1.0, 2.0, 3.0, 4.0]


@pytest.fixture(scope="module")
def roomy(tmp_path_factory) -> Iterator[httpx.Client]:
    """The server's default per-request limits (1,024 HVP vectors, 2^24 jacobian
    elements): only the cost guard stands between the issue's requests and a worker."""
    folder = tmp_path_factory.mktemp("cost")
    srv: Server = start_server(
        {
            "GRADTAPE_DATA_DIR": str(folder / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_HVP_MAX_VECTORS": "1024",
            "GRADTAPE_JACOBIAN_MAX_ELEMENTS": str(2**24),
            "GRADTAPE_MAX_BODY_BYTES": str(8 * 2**20),
        },
        folder / "server.log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120.0) as client:
            yield client
    finally:
        stop_server(srv)


def worker_pids(client: httpx.Client) -> list[int]:
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    return [w["pid"] for w in ready.json()["workers"]]


def program(n: int) -> list[str]:
    return [line.format(n=n) for line in BROADCAST]


def test_the_issues_hvp_of_1024_vectors_is_refused_before_it_runs(roomy) -> None:
    before = worker_pids(roomy)
    body = {
        "definition": {"program": program(2048), "variables": {"w": W}},
        "target": "loss",
        "vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 1024,
    }
    answer = problem(roomy.post("/v1/hvp", json=body), 422, "too-large")
    detail = answer["detail"]
    assert "the HVP of 1,024 vector(s) is estimated at about" in detail
    assert "time_limit is 30 s" in detail and '"async": true' in detail
    assert "job_time_limit" in detail and "transcendental" in detail
    assert answer["estimate"]["seconds"] > answer["time_limit"] == 30
    assert worker_pids(roomy) == before  # refused, not run to the limit and killed


def test_the_2048_row_jacobian_is_refused_before_it_runs(roomy) -> None:
    before = worker_pids(roomy)
    body = {
        "definition": {
            "program": [program(2048)[0], "y = sum(sin(z) * z, axis=1)"],
            "variables": {"w": W},
        },
        "target": "y",
    }
    answer = problem(roomy.post("/v1/jacobian", json=body), 422, "too-large")
    assert "the jacobian of 2,048 rows is estimated at about" in answer["detail"]
    assert answer["estimate"]["seconds"] > 30
    assert worker_pids(roomy) == before


def test_a_longer_time_limit_is_named_when_even_the_maximum_is_short(roomy) -> None:
    # 5 s asked: the refusal names the request's own limit (a job could take the rest).
    body = {
        "definition": {"program": program(2048), "variables": {"w": W}},
        "target": "loss",
        "vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 1024,
        "time_limit": 5,
    }
    detail = problem(roomy.post("/v1/hvp", json=body), 422, "too-large")["detail"]
    assert "time_limit is 5 s" in detail


def test_requests_that_fit_are_answered_with_their_values(roomy) -> None:
    # The issue's program at 256 x 256 with 32 vectors: milliseconds, and exact values.
    n, s = 256, sum(W)
    body = {
        "definition": {"program": program(n), "variables": {"w": W}},
        "target": "loss",
        "vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 32,
    }
    answer = roomy.post("/v1/hvp", json=body)
    assert answer.status_code == 200, answer.text
    # loss = n^2 s sin(s) with s = sum(w): every HVP entry is n^2 (2 cos s - s sin s) v_1
    want = n * n * (2 * np.cos(s) - s * np.sin(s))
    for product in answer.json()["hvps"]:
        np.testing.assert_allclose(arr(product["w"]), [want] * 4, rtol=1e-3)
    grad = roomy.post(
        "/v1/gradient",
        json={"definition": {"program": program(n), "variables": {"w": W}}, "target": "loss"},
    )
    assert grad.status_code == 200, grad.text
    want = n * n * (np.sin(s) + s * np.cos(s))
    np.testing.assert_allclose(arr(grad.json()["gradients"]["w"]), [want] * 4, rtol=1e-3)


def test_the_guard_is_off_when_a_throughput_is_zero(tmp_path) -> None:
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_COST_BYTES_PER_SECOND": "0",
        },
        tmp_path / "server.log",
    )
    try:
        body = {
            "definition": {"program": program(2048), "variables": {"w": W}},
            "target": "loss",
            "vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 32,
            "time_limit": 0.5,
        }
        # 32 vectors at 2048 x 2048 take seconds: with the guard off, the request runs
        # into its time limit (504) instead of a 422 before it starts.
        with httpx.Client(base_url=srv.base_url, timeout=120.0) as client:
            answer = client.post("/v1/hvp", json=body)
        assert answer.status_code == 504, answer.text
    finally:
        stop_server(srv)


def test_a_tapes_hvp_of_1024_vectors_is_refused_too(roomy) -> None:
    made = roomy.post(
        "/v1/tapes",
        json={"definition": {"program": program(2048), "variables": {"w": W}}, "target": "loss"},
    )
    assert made.status_code == 201, made.text
    before = worker_pids(roomy)
    tape = made.json()["tape_id"]
    body = {"vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 1024}
    answer = problem(roomy.post(f"/v1/tapes/{tape}/hvp", json=body), 422, "too-large")
    assert "the HVP of 1,024 vector(s) is estimated at about" in answer["detail"]
    assert worker_pids(roomy) == before
    # and a few vectors on the same tape are answered, exactly
    s = sum(W)
    few = roomy.post(f"/v1/tapes/{tape}/hvp", json={"vectors": body["vectors"][:2]})
    assert few.status_code == 200, few.text
    want = 2048 * 2048 * (2 * np.cos(s) - s * np.sin(s))
    np.testing.assert_allclose(arr(few.json()["hvps"][0]["w"]), [want] * 4, rtol=1e-3)
    roomy.delete(f"/v1/tapes/{tape}")


def test_recording_a_tape_is_guarded_as_a_gradient_is(roomy) -> None:
    """POST /v1/tapes runs the forward pass and its gradient, as /v1/gradient does: the
    same estimate refuses it before it runs (it ran into its time limit: a 504 and a
    killed worker)."""
    chain = ["a = broadcast_to(sum(w), (2048, 2048))"] + [
        f"m{i} = {'a' if i == 0 else f'm{i - 1}'} @ a" for i in range(4)
    ]
    body = {
        "definition": {"program": [*chain, "loss = sum(m3)"], "variables": {"w": W}},
        "target": "loss",
        "time_limit": 1,
    }
    gradient = problem(roomy.post("/v1/gradient", json=body), 422, "too-large")
    assert "the gradient is estimated at about" in gradient["detail"]
    before = worker_pids(roomy)
    answer = problem(roomy.post("/v1/tapes", json=body), 422, "too-large")
    assert "recording the tape is estimated at about" in answer["detail"], answer
    assert answer["estimate"] == gradient["estimate"] and answer["time_limit"] == 1
    assert worker_pids(roomy) == before


def matmul_chain(n: int, depth: int) -> bytes:
    """An ONNX model y = tanh(... tanh(x @ C) @ C ...) (depth matmuls) with C a constant
    filled at load: a few hundred bytes that cost depth * 2 n^3 FLOPs a pass."""
    from onnx import TensorProto, helper, numpy_helper

    fill = numpy_helper.from_array(np.array([1e-3], np.float32), "fill")
    nodes = [
        helper.make_node(
            "Constant",
            [],
            ["size"],
            value=numpy_helper.from_array(np.array([n, n], np.int64), "size"),
        ),
        helper.make_node("ConstantOfShape", ["size"], ["C"], value=fill),
    ]
    previous = "x"
    for i in range(depth):
        nodes.append(helper.make_node("MatMul", [previous, "C"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]))  # curved: HVPs run
        previous = f"t{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_an_onnx_models_matmuls_are_counted(roomy) -> None:
    """The same matmuls in an ONNX model as in the language: refused before they run (the
    model's nodes counted their results' bytes only, so 64 HVPs through 4 matmuls of
    1024 x 1024 passed the guard and ran into the time limit: a 504, a killed worker)."""
    before = worker_pids(roomy)
    body = {
        "definition": {
            "models": {"net": {"onnx": base64.b64encode(matmul_chain(1024, 4)).decode()}},
            "variables": {"w": W},
            "program": ["x = broadcast_to(sum(w), (1024, 1024))", "loss = sum(net(x))"],
        },
        "target": "loss",
        "vectors": [{"w": [1.0, 0.0, 0.0, 0.0]}] * 64,
        "time_limit": 1,
    }
    answer = problem(roomy.post("/v1/hvp", json=body), 422, "too-large")
    assert "the HVP of 64 vector(s) is estimated at about" in answer["detail"]
    # 4 matmuls of 2 * 1024^3 FLOPs a pass, over the recording and 64 HVP passes
    assert answer["estimate"]["flops"] >= 4 * 2 * 1024**3 * 64
    assert worker_pids(roomy) == before
