"""Issue 27, item 5: bare numbers take the dtype of the tensor they stand for. On a
float64 tape (or a float64 definition), a bare-list vector, a solve's right-hand side
and influence test points give the same answers, bit for bit, as the same values sent as
typed float64 tensors (they were read as float32: 1.5e-8 off)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.wire import arr, post, t

rng = np.random.default_rng(5)
X = rng.standard_normal((6, 3))
Y = rng.standard_normal((6, 1))
DEFINITION = {
    "dtype": "float64",
    "variables": {"w": (rng.standard_normal((3, 1)) / 3).tolist()},
    "inputs": {"X": X.tolist(), "y": Y.tolist()},
    "program": ["out = tanh(X @ w)", "loss = mean((out - y) ** 2)"],
}
# 0.1 and friends are not float32 numbers: read as float32 they move by ~1e-8.
BARE = [[0.1], [0.7], [-0.3]]


@pytest.fixture(scope="module")
def tape(client) -> str:
    r = client.post("/v1/tapes", json={"definition": DEFINITION, "target": "loss", "output": "out"})
    assert r.status_code == 201, r.text
    return r.json()["tape_id"]


def test_a_bare_vector_on_a_float64_tape_is_float64(client, tape) -> None:
    url = f"/v1/tapes/{tape}"
    typed = post(client, f"{url}/hvp", {"vector": {"w": t(BARE, "float64")}})
    bare = post(client, f"{url}/hvp", {"vector": {"w": BARE}})
    many = post(client, f"{url}/hvp", {"vectors": [{"w": BARE}, {"w": BARE}]})
    assert np.array_equal(arr(bare["hvp"]["w"]), arr(typed["hvp"]["w"]))
    assert np.array_equal(arr(many["hvps"][1]["w"]), arr(typed["hvp"]["w"]))
    assert arr(bare["hvp"]["w"]).dtype == np.float64
    b_typed = post(client, f"{url}/solve", {"vector": {"w": t(BARE, "float64")}, "tol": 1e-12})
    b_bare = post(client, f"{url}/solve", {"vector": {"w": BARE}, "tol": 1e-12})
    assert np.array_equal(arr(b_bare["solution"]["w"]), arr(b_typed["solution"]["w"]))
    points = {"X": [[0.1, 0.2, 0.3]], "y": [[0.7]]}
    typed_points = {k: t(v, "float64") for k, v in points.items()}
    i_typed = post(client, f"{url}/influence", {"test_inputs": typed_points, "tol": 1e-12})
    i_bare = post(client, f"{url}/influence", {"test_inputs": points, "tol": 1e-12})
    assert i_bare["scores"] == i_typed["scores"]


def test_a_bare_vector_of_a_float64_definition_is_float64(client) -> None:
    body = {"definition": DEFINITION, "target": "loss"}
    typed = post(client, "/v1/hvp", {**body, "vector": {"w": t(BARE, "float64")}})
    bare = post(client, "/v1/hvp", {**body, "vector": {"w": BARE}})
    assert np.array_equal(arr(bare["hvp"]["w"]), arr(typed["hvp"]["w"]))
