"""The SDK's side of issue 12 against the live server: datasets (put, bind, rebind a
tape to the next mini-batch), flat gradients and jacobians of a tape, a stored model
recorded at a flat point, and PATCH by point; values against NumPy."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from gradtape.client import Client, InvalidRequest, dataset

PROGRAM = ["margin = y * (X @ w)", "loss = mean(softplus(-margin))"]


def truth(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    s = 1 / (1 + np.exp(y * (X @ w)))
    return float(np.mean(np.logaddexp(0, -y * (X @ w)))), -(X.T @ (y * s)) / len(y)


def test_datasets_and_rebinding_a_tape(client: Client, rng: np.random.Generator) -> None:
    X, y = rng.standard_normal((40, 3)), np.sign(rng.standard_normal(40))
    w = rng.standard_normal(3)
    info = client.put_dataset("sdk-data", {"X": X, "y": y})
    assert info["arrays"]["X"] == {"dtype": "float64", "shape": [40, 3], "bytes": X.nbytes}
    definition = {
        "variables": {"w": w},
        "inputs": dataset("sdk-data", rows=slice(0, 20)),
        "program": PROGRAM,
    }
    with client.tape(definition, "loss") as tape:
        value, gradient = truth(X[:20], y[:20], w)
        assert tape.value == pytest.approx(value, rel=1e-13)
        np.testing.assert_allclose(tape.gradients["w"], gradient, rtol=1e-12)
        # the next mini-batch: nothing but the binding travels
        tape.update(inputs=dataset("sdk-data", rows=slice(20, 40)))
        value, gradient = truth(X[20:], y[20:], w)
        assert tape.value == pytest.approx(value, rel=1e-13)
        np.testing.assert_allclose(tape.gradients["w"], gradient, rtol=1e-12)
        rows = np.array([5, 1, 33])
        tape.update(
            inputs={
                "X": dataset("sdk-data", "X", rows=rows),
                "y": dataset("sdk-data", "y", rows=rows),
            }
        )
        np.testing.assert_allclose(tape.gradients["w"], truth(X[rows], y[rows], w)[1], rtol=1e-12)
        # data sent replaces the binding
        tape.update(inputs={"X": X[:4], "y": y[:4]})
        np.testing.assert_allclose(tape.gradients["w"], truth(X[:4], y[:4], w)[1], rtol=1e-12)
        with pytest.raises(InvalidRequest) as bad:
            tape.update(inputs=dataset("sdk-data", rows=[0, 40]))
        assert "row 40 is out of range" in str(bad.value)
    client.delete_dataset("sdk-data")


def test_flat_gradients_and_jacobians_of_a_tape(client: Client, rng: np.random.Generator) -> None:
    X, y = rng.standard_normal((6, 3)), np.sign(rng.standard_normal(6))
    b = np.float64(0.3)
    w = rng.standard_normal(3)
    definition = {
        "variables": {"w": w, "b": b},
        "inputs": {"X": X, "y": y},
        "program": ["margin = y * (X @ w + b)", "loss = mean(softplus(-margin))"],
    }
    with client.tape(definition, "loss") as tape:
        flat = tape.gradient(flat=True)
        assert [s["source"] for s in flat.order] == ["w", "b"]
        np.testing.assert_array_equal(flat.gradients, tape.flatten(tape.gradients))
        jac = tape.jacobian("margin", flat=True)
        np.testing.assert_allclose(
            jac.jacobians, np.hstack([y[:, None] * X, y[:, None]]), rtol=1e-14
        )
        assert jac.order[1] == {"source": "b", "shape": [], "offset": 3, "size": 1}
        per_example = tape.jacobian("margin", ["X"], batch=True, flat=True)
        assert per_example.jacobians.shape == (6, 1, 3)
        np.testing.assert_allclose(per_example.jacobians[:, 0], y[:, None] * w, rtol=1e-14)
    stateless = client.jacobian(definition, "margin", ["w", "b"], flat=True, allow_unused=True)
    np.testing.assert_array_equal(stateless.jacobians, jac.jacobians)


def test_stored_model_at_a_point(client: Client, server, rng: np.random.Generator) -> None:
    X, y = rng.standard_normal((30, 4)), np.sign(rng.standard_normal(30))
    model = {
        "dtype": "float64",
        "variables": {"w": [0.0] * 4},
        "inputs": {"X": X.tolist(), "y": y.tolist()},
        "program": PROGRAM,
    }
    r = httpx.post(
        f"{server.base_url}/v1/models",
        json={"name": "sdk-point", "definition": model, "replace": True},
    )
    assert r.status_code in (200, 201), r.text
    w = rng.standard_normal(4)
    with client.tape(model="sdk-point", target="loss", point=w) as tape:
        value, gradient = truth(X, y, w)
        assert tape.value == pytest.approx(value, rel=1e-13)
        np.testing.assert_allclose(tape.jac(w), gradient, rtol=1e-12)  # no re-recording
        assert tape.info()["hits"] == 0
        tape.update(point=2 * w)
        np.testing.assert_allclose(tape.gradients["w"], truth(X, y, 2 * w)[1], rtol=1e-12)
        with pytest.raises(InvalidRequest) as bad:
            tape.update(point=w[:2])
        assert "needs shape [4]" in str(bad.value)
    with client.tape(model="sdk-point", target="loss", variables={"w": w}) as by_name:
        assert by_name.value == pytest.approx(value, rel=1e-13)
