"""POST /v1/jacobian: SCENARIOS.md 8, 9, 11 and 12 over HTTP (the server's chunk size in
the tests is 16 rows, so each jacobian here takes several backward passes)."""

from __future__ import annotations

import numpy as np

from tests.service.wire import arr, dense, post, problem, t

rng = np.random.default_rng(11)
X = rng.standard_normal((7, 5))
K1, B1 = rng.standard_normal((5, 8)) * 0.5, rng.standard_normal(8) * 0.1
K2, B2 = rng.standard_normal((8, 6)) * 0.5, rng.standard_normal(6) * 0.1


def _two_layers(extra: list[str] | None = None) -> dict:
    return {
        "variables": {
            "k1": t(K1, "float64"),
            "b1": t(B1, "float64"),
            "k2": t(K2, "float64"),
            "b2": t(B2, "float64"),
        },
        "inputs": {"x": t(X, "float64")},
        "program": [
            "h = elu(x @ k1 + b1)",
            *(extra or []),
            "y = elu(h2 @ k2 + b2)" if extra else "y = elu(h @ k2 + b2)",
        ],
    }


def test_scalar_source(client) -> None:  # 8
    x = np.linspace(-10, 10, 201)
    body = {
        "definition": {
            "variables": {"delta": 0.0},
            "inputs": {"x": t(x)},
            "program": ["y = sigmoid(x + delta)"],
        },
        "target": "y",
        "sources": "delta",
    }
    answer = post(client, "/v1/jacobian", body)
    jac = arr(answer["jacobians"]["delta"])
    assert jac.shape == (201,)
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(jac, s * (1 - s), rtol=1e-5, atol=1e-7)


def test_tensor_source(client) -> None:  # 9
    kernel, bias = rng.standard_normal((5, 10)), rng.standard_normal(10)
    defn = {
        "variables": {"kernel": t(kernel, "float64"), "bias": t(bias, "float64")},
        "inputs": {"x": t(X, "float64")},
        "program": ["y = relu(x @ kernel + bias)"],
    }
    answer = post(
        client, "/v1/jacobian", {"definition": defn, "target": "y", "sources": ["kernel"]}
    )
    jac = arr(answer["jacobians"]["kernel"])
    assert jac.shape == (7, 10, 5, 10)
    np.testing.assert_allclose(arr(answer["value"]), dense(X, kernel, bias), rtol=1e-12)
    grad = post(client, "/v1/gradient", {"definition": defn, "target": "y", "sources": ["kernel"]})
    assert np.max(np.abs(jac.sum(axis=(0, 1)) - arr(grad["gradients"]["kernel"]))) < 1e-6


def test_batch_jacobian(client) -> None:  # 11
    full = post(
        client, "/v1/jacobian", {"definition": _two_layers(), "target": "y", "sources": ["x"]}
    )
    jac = arr(full["jacobians"]["x"])
    assert jac.shape == (7, 6, 7, 5)
    for i in range(7):
        for j in range(7):
            if i != j:
                assert not jac[i, :, j, :].any()
    batch = post(
        client,
        "/v1/jacobian",
        {"definition": _two_layers(), "target": "y", "sources": ["x"], "batch": True},
    )
    per_example = arr(batch["jacobians"]["x"])
    assert per_example.shape == (7, 6, 5)
    np.testing.assert_allclose(per_example, jac.sum(axis=2), rtol=1e-12, atol=1e-14)


def test_batch_jacobian_refuses_dependent_examples(client) -> None:  # 12
    defn = _two_layers(["h2 = batch_norm(h)"])
    found = problem(
        client.post(
            "/v1/jacobian",
            json={"definition": defn, "target": "y", "sources": ["x"], "batch": True},
        ),
        422,
        "batch-dependence",
    )
    assert "batch normalization" in found["detail"] and "jacobian" in found["detail"]
    full = post(client, "/v1/jacobian", {"definition": defn, "target": "y", "sources": ["x"]})
    jac = arr(full["jacobians"]["x"])
    assert np.abs(jac[0, :, 1, :]).max() > 1e-6  # the (batch, batch) blocks are not diagonal


def test_batch_needs_a_shared_first_axis(client) -> None:
    """A batch jacobian of a target and sources without a shared first axis (a source
    of other rows, a scalar target): a 422 whose `errors` name `batch` (before: the
    detail alone said it, no `errors` entry), on the stateless route and a tape's."""
    defn = _two_layers()
    defn["program"] = [*defn["program"], "loss = sum(y)"]
    made = client.post("/v1/tapes", json={"definition": defn, "target": "loss"})
    assert made.status_code == 201, made.text
    tape = made.json()["tape_id"]
    cases = [
        (
            "/v1/jacobian",
            {"definition": _two_layers(), "target": "y", "sources": ["k1"]},
            ("[7, 6]", "[5, 8]"),
        ),
        ("/v1/jacobian", {"definition": defn, "target": "loss"}, ("has shape []",)),
        (f"/v1/tapes/{tape}/jacobian", {"target": "loss", "sources": ["x"]}, ("has shape []",)),
    ]
    for path, body, said in cases:
        found = problem(client.post(path, json={**body, "batch": True}), 422, "invalid-request")
        assert [e["field"] for e in found["errors"]] == ["batch"], (path, found)
        assert found["detail"].startswith("batch: true needs the target and each source"), found
        assert all(s in found["detail"] for s in said), (path, found)
    client.delete(f"/v1/tapes/{tape}")


def test_unconnected_source(client) -> None:
    defn = {"variables": {"a": t([1.0, 2.0]), "b": 1.0}, "program": ["y = a * a"]}
    none = post(client, "/v1/jacobian", {"definition": defn, "target": "y", "sources": ["a", "b"]})
    assert none["jacobians"]["b"] is None
    np.testing.assert_array_equal(arr(none["jacobians"]["a"]), np.diag([2.0, 4.0]))
    zero = post(
        client,
        "/v1/jacobian",
        {"definition": defn, "target": "y", "sources": ["b"], "unconnected": "zero"},
    )
    np.testing.assert_array_equal(arr(zero["jacobians"]["b"]), np.zeros(2))


def test_too_large(client) -> None:  # the tests' server answers up to 200,000 elements
    defn = {
        "variables": {"w": t(np.ones((500,)))},
        "inputs": {"x": t(np.ones((500,)))},
        "program": ["y = x * w"],
    }
    found = problem(
        client.post("/v1/jacobian", json={"definition": defn, "target": "y"}), 422, "too-large"
    )
    assert "250,000" in found["detail"] and "200,000" in found["detail"]
    assert found["limit"] == 200_000


def test_repeated_batch_jacobians_with_new_values(client) -> None:
    """One structure, new values each time (compiled on a worker's second request,
    replayed after): per-example jacobians of tanh(x @ w) against diag(1 - t^2) w^T, and
    a batch that mixes its examples refused every time."""
    for _ in range(5):
        x, w = rng.standard_normal((6, 4)), rng.standard_normal((4, 3))
        defn = {
            "variables": {"w": t(w, "float64")},
            "inputs": {"x": t(x, "float64")},
            "program": ["o = tanh(x @ w)"],
        }
        answer = post(
            client,
            "/v1/jacobian",
            {"definition": defn, "target": "o", "sources": ["x"], "batch": True},
        )
        th = np.tanh(x @ w)
        np.testing.assert_allclose(
            arr(answer["jacobians"]["x"]), (1 - th**2)[:, :, None] * w.T[None], rtol=1e-12
        )
        mixed = {**defn, "program": ["h = tanh(x @ w)", "o = h - mean(h, axis=0)"]}
        problem(
            client.post(
                "/v1/jacobian",
                json={"definition": mixed, "target": "o", "sources": ["x"], "batch": True},
            ),
            422,
            "batch-dependence",
        )
