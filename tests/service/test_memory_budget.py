"""The request memory budget (issue 11, item 3), on a server of its own with a small
budget: batched passes (HVP vectors, on a tape too; trace probes) are split to fit it
and answer what one pass would; what cannot fit one item at a time is a 422 naming the
largest op, its shape and the budget, before anything runs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgpack
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import MSGPACK, arr, problem, t64, tbin

MIB = 2**20
BUDGET = 10 * MIB


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    folder = tmp_path_factory.mktemp("tight")
    srv: Server = start_server(
        {
            "GRADTAPE_DATA_DIR": str(folder / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_REQUEST_MEMORY_BUDGET": str(BUDGET),
        },
        folder / "server.log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120.0) as c:
            yield c
    finally:
        stop_server(srv)


g = np.random.default_rng(3)
W = g.standard_normal((256, 256)).astype(np.float32) / 16
X = g.standard_normal((256, 256)).astype(np.float32)
MEDIUM = {
    "variables": {"w": tbin(W)},
    "inputs": {"x": tbin(X)},
    "program": ["h = tanh(x @ w)", "loss = sum(h * h)"],
}  # 2 or 3 vectors fit a pass
VECTORS = [{"w": tbin(g.standard_normal((256, 256)).astype(np.float32))} for _ in range(12)]
HUGE = {
    "variables": {"w": t64(np.ones((64, 2048), np.float32) / 64)},
    "inputs": {"x": t64(np.ones((2048, 64), np.float32))},
    "program": ["h = x @ w", "loss = sum(tanh(h))"],
}  # a 2048 x 2048 intermediate


def products(answer: dict) -> np.ndarray:
    return np.stack([arr(p["w"]) for p in answer["hvps"]])


def same_products(split: np.ndarray, whole: np.ndarray) -> None:
    """Equal up to float32 summation order (passes of other batch sizes sum otherwise)."""
    np.testing.assert_allclose(split, whole, rtol=1e-4, atol=1e-5 * np.abs(whole).max())


def send(c: httpx.Client, path: str, body: dict, status: int = 200) -> dict:
    response = c.post(
        path, content=msgpack.packb(body), headers={"content-type": MSGPACK, "accept": MSGPACK}
    )
    assert response.status_code == status, response.content[:500]
    return msgpack.unpackb(response.content)


def test_hvps_past_the_budget_are_split_and_equal_one_pass(tight, client) -> None:
    body = {"definition": MEDIUM, "target": "loss", "vectors": VECTORS}
    split = products(send(tight, "/v1/hvp", body))  # several passes
    whole = products(send(client, "/v1/hvp", body))  # the default budget: one
    assert split.shape == (12, 256, 256)
    same_products(split, whole)


def test_a_tape_splits_its_hvps_and_probes(tight, client) -> None:
    answers = []
    for c in (tight, client):
        tape = send(c, "/v1/tapes", {"definition": MEDIUM, "target": "loss"}, 201)
        try:
            hvps = products(send(c, f"/v1/tapes/{tape['tape_id']}/hvp", {"vectors": VECTORS}))
            trace = send(
                c,
                f"/v1/tapes/{tape['tape_id']}/trace",
                {"method": "hutchinson", "max_hvps": 32, "batch_size": 16, "seed": 7},
            )
        finally:
            c.delete(f"/v1/tapes/{tape['tape_id']}")
        answers.append((hvps, trace))
    (split, trace_split), (whole, trace_whole) = answers
    same_products(split, whole)
    assert trace_split["hvps"] == trace_whole["hvps"] == 32
    np.testing.assert_allclose(trace_split["trace"], trace_whole["trace"], rtol=1e-5)


@pytest.mark.parametrize("path", ["/v1/gradient", "/v1/hvp", "/v1/jacobian", "/v1/tapes"])
def test_what_cannot_fit_once_is_a_422_naming_op_shape_and_budget(tight, path) -> None:
    body: dict = {"definition": HUGE, "target": "loss"}
    if path == "/v1/hvp":
        body["vector"] = {"w": t64(np.ones((64, 2048), np.float32))}
    response = tight.post(path, json=body)
    found = problem(response, 422, "too-large")
    assert "10.0 MiB" in found["detail"] and "[2048, 2048]" in found["detail"], found
    located = found["errors"][0]
    assert located["line"] == 1 and located["op"] == "matmul", located
    assert tight.get("/readyz").status_code == 200
