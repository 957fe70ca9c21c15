"""/v1/models: named definitions stored on the server (SCENARIOS.md 4: a model holding a
custom gradient gives the same 2.0 when named later; test_restart.py does it across a
restart), used by every compute route and by tapes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.wire import arr, num, nums, ok, post, problem, t, without_execution

CLIPPED = {
    "variables": {"v": 2.0},
    "functions": {
        "clipped": {
            "params": ["x"],
            "forward": ["y = x"],
            "backward": ["grad_x = clip_by_norm(upstream, 0.5)"],
        }
    },
    "program": ["output = clipped(v * v)"],
}
rng = np.random.default_rng(4)
MLP = {
    "variables": {
        "w": t(rng.standard_normal((3, 2)), "float64"),
        "b": {"value": t(np.zeros(2), "float64"), "trainable": False},
    },
    "inputs": {"x": t(rng.standard_normal((5, 3)), "float64")},
    "program": ["h = tanh(x @ w + b)", "loss = sum(h ** 2)"],
}


def store(client, name: str, definition: dict, **extra) -> dict:
    response = client.post("/v1/models", json={"name": name, "definition": definition, **extra})
    assert response.status_code == 201, response.text
    assert response.headers["location"] == f"/v1/models/{name}"
    return response.json()


def test_custom_gradient_model(client) -> None:
    info = store(client, "clipped-square", CLIPPED, description="SCENARIOS.md 4")
    assert info["name"] == "clipped-square" and info["description"] == "SCENARIOS.md 4"
    assert info["functions"] == ["clipped"] and info["trainable"] == ["v"]
    assert info["variables"] == {"v": {"dtype": "float32", "shape": [], "trainable": True}}
    assert info["names"] == {"output": {"dtype": "float32", "shape": []}}
    assert len(info["digest"]) == 64 and info["created_at"] == info["updated_at"]
    answer = post(client, "/v1/gradient", {"model": "clipped-square", "target": "output"})
    assert num(answer["value"]) == 4.0 and nums(answer["gradients"]) == {"v": 2.0}
    assert ok(client.get("/v1/models/clipped-square")) == info
    assert "clipped-square" in [m["name"] for m in ok(client.get("/v1/models"))["models"]]


def test_every_route_takes_a_model(client) -> None:
    store(client, "mlp", MLP)
    by_value = {"definition": MLP, "target": "loss"}
    by_name = {"model": "mlp", "target": "loss"}
    for path, extra in (
        ("/v1/gradient", {}),
        ("/v1/jacobian", {"sources": ["x"]}),
        ("/v1/hessian", {}),
        ("/v1/hvp", {"vector": {"w": t(np.ones((3, 2)), "float64")}}),
    ):
        mine = post(client, path, {**by_name, **extra})
        fresh = post(client, path, {**by_value, **extra})
        assert without_execution(mine) == without_execution(fresh), path
    created = client.post("/v1/tapes", json=by_name)
    assert created.status_code == 201, created.text
    tape = created.json()
    assert set(tape["gradients"]) == {"w"}  # b is not trainable
    about = ok(client.get(f"/v1/tapes/{tape['tape_id']}"))
    assert about["model"] == "mlp"
    # A tape keeps the definition it was recorded from, whatever happens to the model.
    assert client.delete("/v1/models/mlp").status_code == 204
    hvp = post(
        client, f"/v1/tapes/{tape['tape_id']}/hvp", {"vector": {"w": t(np.ones((3, 2)), "float64")}}
    )
    fresh = post(client, "/v1/hvp", {**by_value, "vector": {"w": t(np.ones((3, 2)), "float64")}})
    np.testing.assert_allclose(arr(hvp["hvp"]["w"]), arr(fresh["hvp"]["w"]), rtol=1e-12)
    gone = problem(client.post("/v1/gradient", json=by_name), 404, "model-not-found")
    assert "'mlp'" in gone["detail"]
    problem(client.get("/v1/models/mlp"), 404, "model-not-found")
    problem(client.delete("/v1/models/mlp"), 404, "model-not-found")


def test_names_conflicts_and_replacing(client) -> None:
    first = store(client, "replaced", CLIPPED)
    clash = problem(
        client.post("/v1/models", json={"name": "replaced", "definition": MLP}), 409, "model-exists"
    )
    assert "replace" in clash["detail"]
    response = client.post(
        "/v1/models", json={"name": "replaced", "definition": MLP, "replace": True}
    )
    assert response.status_code == 200, response.text
    second = response.json()
    assert second["digest"] != first["digest"] and second["created_at"] == first["created_at"]
    assert second["updated_at"] >= first["updated_at"]
    assert post(client, "/v1/gradient", {"model": "replaced", "target": "loss"})["gradients"]
    bad_name = problem(
        client.post("/v1/models", json={"name": "no spaces", "definition": MLP}), 422, "validation"
    )
    assert bad_name["errors"][0]["field"] == "name"


def test_a_broken_definition_is_not_stored(client) -> None:
    found = problem(
        client.post(
            "/v1/models",
            json={
                "name": "broken",
                "definition": {"variables": {"w": 1.0}, "program": ["y = w @@ 2"]},
            },
        ),
        422,
        "definition",
    )
    assert found["errors"][0]["line"] == 1
    problem(client.get("/v1/models/broken"), 404, "model-not-found")


@pytest.mark.parametrize(
    "body",
    [
        {"target": "loss"},
        {"model": "mlp", "definition": MLP, "target": "loss"},
    ],
)
def test_definition_or_model(client, body: dict) -> None:
    found = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert "exactly one of 'definition' or 'model'" in found["detail"]
