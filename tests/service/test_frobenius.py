"""POST /v1/tapes/{id}/frobenius-norm (issue 29: the first operation built from the
operation table): ||C||_F^2 of the Hessian, the GGN and the Fisher of a small network,
against the dense matrices (tests/service/test_tape_curvature.py builds them from the
engine's jacobians), with its standard error; the same numbers on a sharded tape; and
through the SDK (its generic call and the named method)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.test_tape_curvature import DEFN, TRUTH
from tests.service.wire import post, problem


def squared_norm(curvature: str) -> float:
    return float(np.sum(TRUTH[curvature] ** 2))


@pytest.fixture(scope="module")
def tape_id(client) -> str:
    body = {"definition": DEFN, "target": "loss", "output": "logits"}
    response = client.post("/v1/tapes", json=body)
    assert response.status_code == 201, response.text
    return response.json()["tape_id"]


@pytest.mark.parametrize("curvature", ["hessian", "ggn", "fisher"])
def test_against_the_dense_matrix(client, tape_id, curvature: str) -> None:
    exact = squared_norm(curvature)
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/frobenius-norm",
        {"curvature": curvature, "max_hvps": 2000, "batch_size": 100, "seed": 3},
    )
    assert answer["curvature"] == curvature and answer["stopped"] == "max_hvps"
    # batches of at most the server's hvp_max_vectors
    assert answer["samples"] == answer["hvps"] == 2000 and answer["batch_size"] <= 100
    assert answer["batches"] == -(-2000 // answer["batch_size"])
    assert answer["converged"] and answer.get("nonfinite") is None
    stderr = answer["stderr"]
    # A real standard error: positive, small against the value, and the estimate within
    # 4 of them of the exact ||C||_F^2 (the seed is fixed: this is not a flaky bound).
    assert 0 < stderr < 0.05 * exact
    assert abs(answer["frobenius_norm_squared"] - exact) < 4 * stderr


def test_stops_at_its_tolerance_and_says_so(client, tape_id) -> None:
    answer = post(client, f"/v1/tapes/{tape_id}/frobenius-norm", {"rtol": 0.05, "max_hvps": 5000})
    assert answer["stopped"] == "tolerance" and answer["converged"]
    assert answer["stderr"] <= 0.05 * answer["frobenius_norm_squared"]
    assert 30 <= answer["samples"] < 5000
    # Too few probes for a standard error: none is claimed, and it did not converge.
    few = post(client, f"/v1/tapes/{tape_id}/frobenius-norm", {"max_hvps": 8, "batch_size": 4})
    assert few["stderr"] is None and not few["converged"] and few["samples"] == 8


def test_bad_options_are_refused_by_name(client, tape_id) -> None:
    url = f"/v1/tapes/{tape_id}/frobenius-norm"
    assert (
        "max_hvps" in problem(client.post(url, json={"max_hvps": 1}), 422, "validation")["detail"]
    )
    assert (
        "samples"
        in problem(client.post(url, json={"curvature": "ggn", "samples": 3}), 422, "validation")[
            "detail"
        ]
    )
    assert "probes" in problem(client.post(url, json={"probes": 3}), 422, "validation")["detail"]


def test_a_sharded_tape_answers_the_same(client, tape_id) -> None:
    body = {"definition": DEFN, "target": "loss", "output": "logits"}
    sharded = client.post("/v1/tapes", json={**body, "shards": 2, "shard_by": ["x", "y"]})
    assert sharded.status_code == 201, sharded.text
    ask = {"curvature": "ggn", "max_hvps": 64, "batch_size": 16, "seed": 5}
    whole = post(client, f"/v1/tapes/{tape_id}/frobenius-norm", ask)
    parts = post(client, f"/v1/tapes/{sharded.json()['tape_id']}/frobenius-norm", ask)
    assert parts["frobenius_norm_squared"] == pytest.approx(
        whole["frobenius_norm_squared"], rel=1e-9
    )
    assert parts["stderr"] == pytest.approx(whole["stderr"], rel=1e-9)


def test_through_the_sdk_generic_call(server, tape_id) -> None:
    from gradtape.client import Client

    with Client(server.base_url) as client:
        tape = client.tape(DEFN, "loss", output="logits")
        answer = tape.call("frobenius-norm", curvature="ggn", max_hvps=2000, batch_size=200)
        named = tape.frobenius_norm(curvature="ggn", max_hvps=2000, batch_size=200)
        tape.delete()
    assert abs(answer["frobenius_norm_squared"] - squared_norm("ggn")) < 4 * answer["stderr"]
    assert named["frobenius_norm_squared"] == answer["frobenius_norm_squared"]  # seed 0
