"""Client.gradient / jacobian / hessian / hvp against the live server: NumPy answers in
the sources' structure, dtypes kept, equal over msgpack and json."""

from __future__ import annotations

import base64
import json

import msgpack
import numpy as np
import pytest
from gradtape.client import Client, Definition, Gradient

from tests.client.conftest import TRANSPORTS
from tests.service.conftest import Server

SCENARIO_15 = {
    "variables": {
        "w1": {"value": 2.0},
        "w2": {"value": {"dtype": "float32", "shape": [], "data": [3.0]}, "trainable": True},
    },
    "inputs": {"x1": 5.0, "x2": 7.0},
    "program": ["s = w1 * x1 + w2 * x2"],
}


def cubic(w: np.ndarray) -> dict:
    return {"variables": {"w": w}, "program": ["loss = sum(w * w * w)"]}


def test_gradient_of_the_design_example(client: Client) -> None:
    """SCENARIOS.md 15 as a dict (plain numbers: float32, as the API says)."""
    value, grads = client.gradient(SCENARIO_15, "s", ["w1", "w2"])
    assert value == np.float32(31.0) and value.dtype == np.float32 and value.shape == ()
    assert grads == {"w1": 5.0, "w2": 7.0}
    assert all(g.dtype == np.float32 for g in grads.values())


def test_sources_shape_the_answer(client: Client) -> None:
    every = client.gradient(SCENARIO_15, "s").gradients
    assert set(every) == {"w1", "w2"} and every["w2"] == 7.0
    aliased = client.gradient(SCENARIO_15, "s", {"a": "w1", "b": "x2"}).gradients
    assert set(aliased) == {"a", "b"} and aliased["a"] == 5.0 and aliased["b"] == 3.0
    single = client.gradient(SCENARIO_15, "s", "x1").gradients
    assert isinstance(single, np.ndarray) and single == 2.0


def test_float64_round_trips_exactly(client: Client, rng: np.random.Generator) -> None:
    """float64 stays float64 both ways: values float32 cannot hold come back bit-exact."""
    w = 1.0 + rng.standard_normal(5) * 1e-9
    x = np.array([1.0 + 2.0**-40, 3.0, -1.0 / 3.0, 1e-300, 1e300])
    answer = client.gradient(
        {"variables": {"w": w}, "inputs": {"x": x}, "program": ["y = sum(w * x)"]}, "y", ["w", "x"]
    )
    assert answer.value.dtype == np.float64
    assert answer.gradients["w"].dtype == np.float64
    assert np.array_equal(answer.gradients["w"], x)  # d(w.x)/dw = x, exactly
    assert np.array_equal(answer.gradients["x"], w)
    assert answer.value == pytest.approx(float(w @ x), rel=1e-15)


def test_other_dtypes_are_sent_as_they_are(client: Client) -> None:
    """An int32 input and a float16 variable keep their dtypes on the server."""
    d = Definition(
        "y = sum(w * cast(k, dtype='float16'))",
        variables={"w": np.array([0.5, 0.25], dtype=np.float16)},
        inputs={"k": np.array([2, 4], dtype=np.int32)},
    )
    value, grads = client.gradient(d, "y")
    assert value.dtype == np.float16 and value == 2.0
    assert grads["w"].dtype == np.float16 and grads["w"].tolist() == [2.0, 4.0]


def test_gradient_of_a_cubic(client: Client, rng: np.random.Generator) -> None:
    w = rng.standard_normal(7)
    value, grads = client.gradient(cubic(w), "loss")
    assert value == pytest.approx(np.sum(w**3), rel=1e-14)
    np.testing.assert_allclose(grads["w"], 3 * w**2, rtol=1e-14)


def test_jacobian(client: Client, rng: np.random.Generator) -> None:
    """y = tanh(A @ w): J = diag(1 - y^2) A."""
    A, w = rng.standard_normal((4, 3)), rng.standard_normal(3)
    value, jac = client.jacobian(
        {"variables": {"w": w}, "inputs": {"A": A}, "program": ["y = tanh(A @ w)"]}, "y", "w"
    )
    y = np.tanh(A @ w)
    np.testing.assert_allclose(value, y, rtol=1e-14)
    assert jac.shape == (4, 3) and jac.dtype == np.float64
    np.testing.assert_allclose(jac, (1 - y**2)[:, None] * A, rtol=1e-12)


def logistic(n: int, d: int, rng: np.random.Generator, lam: float = 0.1) -> tuple[dict, ...]:
    """L2-regularised logistic regression: the definition and its dense NumPy gradient
    and Hessian at w."""
    X, y = rng.standard_normal((n, d)), np.sign(rng.standard_normal(n))
    w = rng.standard_normal(d) * 0.1
    definition = Definition(
        """
        margin = y * (X @ w)
        loss   = mean(softplus(-margin)) + lam * sum(w * w) / 2
        """,
        variables={"w": w},
        inputs={"X": X, "y": y, "lam": np.float64(lam)},
    )

    def grad(w: np.ndarray) -> np.ndarray:
        s = 1 / (1 + np.exp(y * (X @ w)))  # sigmoid(-margin)
        return -(X.T @ (y * s)) / n + lam * w

    def hess(w: np.ndarray) -> np.ndarray:
        p = 1 / (1 + np.exp(-(X @ w)))
        return (X.T * (p * (1 - p))) @ X / n + lam * np.eye(d)

    def loss(w: np.ndarray) -> float:
        return float(np.mean(np.logaddexp(0, -y * (X @ w))) + lam * (w @ w) / 2)

    return definition, w, loss, grad, hess


def test_hessian_blocks_and_matrix(client: Client, rng: np.random.Generator) -> None:
    """Two sources: blocks hessian[a][b] of shape a.shape + b.shape; matrix() the dense
    one; the damped Newton step (H + damping I)^-1 g."""
    A = rng.standard_normal((5, 5))
    A = A @ A.T + np.eye(5)
    v = rng.standard_normal(5)
    d = {
        "variables": {"a": v[:2], "b": v[2:].reshape(3, 1)},
        "inputs": {"A": A},
        "program": ["v = concatenate([a, reshape(b, shape=(3,))])", "loss = sum(v * (A @ v)) / 2"],
    }
    answer = client.hessian(d, "loss", ["a", "b"], newton_damping=0.5)
    assert answer.hessian["a"]["b"].shape == (2, 3, 1)
    np.testing.assert_allclose(answer.matrix(), A, rtol=1e-13)
    g = A @ v
    np.testing.assert_allclose(answer.gradients["a"], g[:2], rtol=1e-13)
    step = np.linalg.solve(A + 0.5 * np.eye(5), g)
    np.testing.assert_allclose(answer.newton_step["a"], step[:2], rtol=1e-10)
    np.testing.assert_allclose(answer.newton_step["b"].reshape(3), step[2:], rtol=1e-10)
    single = client.hessian(d, "loss", "a").hessian
    np.testing.assert_allclose(single, A[:2, :2], rtol=1e-13)


def test_hvp_one_and_many(client: Client, rng: np.random.Generator) -> None:
    definition, w, _, grad, hess = logistic(30, 4, rng)
    H = hess(w)
    v = rng.standard_normal(4)
    one = client.hvp(definition, "loss", {"w": v})
    np.testing.assert_allclose(one.hvp["w"], H @ v, rtol=1e-11)
    np.testing.assert_allclose(one.gradients["w"], grad(w), rtol=1e-11)
    V = rng.standard_normal((3, 4))
    many = client.hvp(definition, "loss", vectors=[{"w": r} for r in V], sources="w")
    np.testing.assert_allclose(np.stack(many.hvps), V @ H, rtol=1e-11)


def test_transports_answer_equal_arrays(server: Server, rng: np.random.Generator) -> None:
    definition, *_ = logistic(20, 3, rng)
    v = {"w": rng.standard_normal(3)}
    answers = {}
    for transport in TRANSPORTS:
        with Client(server.base_url, transport=transport) as c:
            answers[transport] = (
                c.gradient(definition, "loss"),
                c.hessian(definition, "loss").matrix(),
                c.hvp(definition, "loss", v).hvp["w"],
            )
    (g1, h1, p1), (g2, h2, p2) = answers.values()
    assert isinstance(g1, Gradient) and np.array_equal(g1.value, g2.value)
    assert np.array_equal(g1.gradients["w"], g2.gradients["w"])
    assert np.array_equal(h1, h2) and np.array_equal(p1, p2)


def test_msgpack_sends_raw_bytes_and_json_base64(server: Server) -> None:
    """What goes on the wire, from the core that builds every request."""
    w = np.array([1.5, -2.0])
    body = {"definition": cubic(w), "target": "loss"}
    with Client(server.base_url, transport="msgpack") as c:
        request = c._core.request("POST", "/v1/gradient", body)
    assert request.headers["content-type"] == "application/msgpack"
    tensor = msgpack.unpackb(request.content)["definition"]["variables"]["w"]
    assert tensor == {"dtype": "float64", "shape": [2], "data": w.astype("<f8").tobytes()}
    with Client(server.base_url, transport="json") as c:
        request = c._core.request("POST", "/v1/gradient", body)
    sent = json.loads(request.content)
    assert sent["response_encoding"] == "base64"  # exact answers too
    tensor = sent["definition"]["variables"]["w"]
    assert tensor == {
        "dtype": "float64",
        "shape": [2],
        "base64": base64.b64encode(w.astype("<f8").tobytes()).decode(),
    }
