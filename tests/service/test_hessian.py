"""POST /v1/hessian: SCENARIOS.md 10 over HTTP (the tests' server builds Hessians over up
to 100 parameters, in chunks of 16 rows)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.wire import arr, num, post, problem, t

rng = np.random.default_rng(10)


def test_hessian_of_two_layers_is_symmetric(client) -> None:  # 10
    x = rng.standard_normal((7, 5))
    defn = {
        "variables": {
            "k1": t(rng.standard_normal((5, 8)) * 0.5, "float64"),
            "b1": t(np.full(8, 0.1), "float64"),
            "k2": t(rng.standard_normal((8, 6)) * 0.5, "float64"),
            "b2": t(np.full(6, 0.1), "float64"),
        },
        "inputs": {"x": t(x, "float64")},
        "program": ["h = relu(x @ k1 + b1)", "out = relu(h @ k2 + b2)", "loss = mean(out ** 2)"],
    }
    answer = post(client, "/v1/hessian", {"definition": defn, "target": "loss", "sources": ["k1"]})
    h = arr(answer["hessian"]["k1"]["k1"])
    assert h.shape == (5, 8, 5, 8)
    h_mat = h.reshape(40, 40)
    np.testing.assert_allclose(h_mat, h_mat.T, atol=1e-12)
    # Each row matches the jacobian of the gradient (the scenario's definition).
    grad = post(client, "/v1/gradient", {"definition": defn, "target": "loss", "sources": ["k1"]})
    np.testing.assert_allclose(
        arr(answer["gradients"]["k1"]), arr(grad["gradients"]["k1"]), rtol=1e-12
    )


def test_newton_step_solves_a_quadratic(client) -> None:  # 10
    x, y = rng.standard_normal((7, 5)), rng.standard_normal((7, 8))
    kernel = rng.standard_normal((5, 8))
    defn = {
        "variables": {"kernel": t(kernel, "float64")},
        "inputs": {"x": t(x, "float64"), "y": t(y, "float64")},
        "program": ["loss = mean((x @ kernel - y) ** 2)"],
    }
    body = {"definition": defn, "target": "loss", "newton": {"damping": 1e-9}}
    answer = post(client, "/v1/hessian", body)
    h = arr(answer["hessian"]["kernel"]["kernel"]).reshape(40, 40)
    g = arr(answer["gradients"]["kernel"]).reshape(40)
    step = arr(answer["newton_step"]["kernel"])
    np.testing.assert_allclose(
        step.reshape(40), np.linalg.solve(h + 1e-9 * np.eye(40), g), rtol=1e-9
    )
    stepped = kernel - step
    best = np.linalg.lstsq(x, y, rcond=None)[0]
    np.testing.assert_allclose(stepped, best, rtol=1e-6, atol=1e-8)
    after = post(
        client,
        "/v1/gradient",
        {"definition": {**defn, "variables": {"kernel": t(stepped, "float64")}}, "target": "loss"},
    )
    assert num(after["value"]) == pytest.approx(np.mean((x @ best - y) ** 2), rel=1e-9)
    assert np.abs(arr(after["gradients"]["kernel"])).max() < 1e-7  # damping leaves ~1e-9


def test_blocks_over_several_sources(client) -> None:
    defn = {
        "variables": {"a": t([1.0, 2.0], "float64"), "b": t(3.0, "float64")},
        "program": ["f = sum(a * a) * b + b ** 3"],
    }
    answer = post(client, "/v1/hessian", {"definition": defn, "target": "f"})
    blocks = {(i, j): arr(answer["hessian"][i][j]) for i in "ab" for j in "ab"}
    np.testing.assert_allclose(blocks["a", "a"], 2 * 3.0 * np.eye(2))
    np.testing.assert_allclose(blocks["a", "b"], [2.0, 4.0])
    np.testing.assert_allclose(blocks["b", "a"], [2.0, 4.0])
    np.testing.assert_allclose(blocks["b", "b"], 18.0)
    assert answer["newton_step"] is None


def test_singular_newton_step_says_to_damp(client) -> None:
    defn = {"variables": {"a": t([1.0, 2.0], "float64")}, "program": ["f = sum(a) ** 2"]}
    found = problem(
        client.post(
            "/v1/hessian", json={"definition": defn, "target": "f", "newton": {"damping": 0}}
        ),
        422,
        "invalid-request",
    )
    assert "damping" in found["detail"]


def test_too_large_suggests_hvp(client) -> None:
    defn = {"variables": {"w": t(np.ones((11, 10)))}, "program": ["f = sum(w ** 3)"]}
    found = problem(
        client.post("/v1/hessian", json={"definition": defn, "target": "f"}), 422, "too-large"
    )
    assert "110 x 110" in found["detail"] and "/v1/hvp" in found["detail"]


def test_needs_a_scalar_target(client) -> None:
    defn = {"variables": {"w": t(np.ones(3))}, "program": ["f = w ** 3"]}
    found = problem(
        client.post("/v1/hessian", json={"definition": defn, "target": "f"}), 422, "invalid-request"
    )
    assert "scalar" in found["detail"] and "[3]" in found["detail"]


def test_user_function_backward_is_differentiated_through_its_forward(client) -> None:
    """Issue 19: a function's forward is recorded (as tf.custom_gradient's), so the
    Hessian of a backward that uses forward names has TensorFlow's values."""
    defn = {
        "variables": {"x": t(np.array([-1.0, 0.5, 2.0]), "float64")},
        "functions": {
            "log1pexp": {
                "params": ["z"],
                "forward": ["e = exp(z)", "out = log(1 + e)"],
                "backward": ["grad_z = upstream * (1 - 1 / (1 + e))"],
                "output": "out",
            }
        },
        "program": ["y = sum(log1pexp(x) + x ** 3)"],
    }
    answer = post(client, "/v1/hessian", {"definition": defn, "target": "y", "sources": ["x"]})
    h = arr(answer["hessian"]["x"]["x"])
    # TensorFlow 2.21: diag(sigmoid'(x)) + 6x
    np.testing.assert_allclose(np.diag(h), [-5.80338, 3.23500, 12.10499], atol=1e-5)
