"""Issue 12's user story, end to end over HTTP with real workers: L2-regularised logistic
regression on a 569x30 data set (a seeded synthetic one shaped like scikit-learn's
breast_cancer; scikit-learn is not a dependency), the data uploaded once, SciPy's
Newton-CG driven by gradient calls that carry only the flat parameters, and by HVPs of a
tape moved to each new point with one PATCH, all in float64 by the definition's dtype.
Checked against SciPy on NumPy's own closed-form gradient and Hessian to 1e-8."""

from __future__ import annotations

import json

import msgpack
import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

from tests.service.wire import MSGPACK, arr, tbin

N, D, LAM = 569, 30, 0.01
rng = np.random.default_rng(569)
X = rng.normal(size=(N, D)) * rng.uniform(0.5, 2.0, size=D)
TRUE = rng.normal(size=D) * 0.7
Y = (rng.uniform(size=N) < expit(X @ TRUE - 0.3)).astype(np.float64)

MODEL = {
    "dtype": "float64",
    "variables": {"w": [0.0] * D, "b": 0.0},
    "inputs": {"dataset": "breast_cancer_like"},
    "program": [
        "z = X @ w + b",
        f"loss = mean(softplus(z) - y * z) + {LAM / 2} * sum(w ** 2)",
    ],
}


def numpy_solution() -> np.ndarray:
    """The same objective in NumPy (closed-form gradient and Hessian), solved by SciPy."""
    A = np.hstack([X, np.ones((N, 1))])
    reg = np.r_[np.full(D, LAM), 0.0]

    def fun(t):
        z = A @ t
        return np.mean(np.logaddexp(0, z) - Y * z) + 0.5 * np.sum(reg * t * t)

    def jac(t):
        return A.T @ (expit(A @ t) - Y) / N + reg * t

    def hessp(t, p):
        s = expit(A @ t)
        return A.T @ (s * (1 - s) * (A @ p)) / N + reg * p

    out = minimize(
        fun,
        np.zeros(D + 1),
        jac=jac,
        hessp=hessp,
        method="Newton-CG",
        options={"xtol": 1e-13, "maxiter": 200},
    )
    assert out.success, out.message
    return out.x


def test_logistic_regression_newton_cg_through_the_api(client) -> None:
    packed = msgpack.packb({"X": tbin(X, "float64"), "y": tbin(Y, "float64")})
    r = client.put(
        "/v1/datasets/breast_cancer_like", content=packed, headers={"content-type": MSGPACK}
    )
    assert r.status_code in (200, 201), r.text
    r = client.post("/v1/models", json={"name": "logreg", "definition": MODEL, "replace": True})
    assert r.status_code in (200, 201), r.text

    sent: list[int] = []

    def call(method: str, path: str, body: dict) -> dict:
        content = json.dumps(body).encode()
        sent.append(len(content))
        r = client.request(
            method, path, content=content, headers={"content-type": "application/json"}
        )
        assert r.status_code in (200, 201), r.text
        return r.json()

    def fun_and_jac(x: np.ndarray) -> tuple[float, np.ndarray]:
        answer = call(
            "POST",
            "/v1/gradient",
            {"model": "logreg", "target": "loss", "point": x.tolist(), "flat": True},
        )
        assert [s["source"] for s in answer["flat"]["order"]] == ["w", "b"]
        gradient = arr(answer["flat"]["gradient"])
        assert gradient.dtype == np.float64 and gradient.shape == (D + 1,)
        return float(arr(answer["value"])), gradient

    tape = call("POST", "/v1/tapes", {"model": "logreg", "target": "loss", "flat": True})
    tape_id, at = tape["tape_id"], np.zeros(D + 1)
    patches = 0

    def hessp(x: np.ndarray, p: np.ndarray) -> np.ndarray:
        nonlocal at, patches
        if not np.array_equal(x, at):  # one PATCH per Newton step: value and gradient too
            moved = call("PATCH", f"/v1/tapes/{tape_id}", {"point": x.tolist(), "flat": True})
            np.testing.assert_array_equal(arr(moved["flat"]["gradient"]), fun_and_jac(x)[1])
            at, patches = x.copy(), patches + 1
        answer = call("POST", f"/v1/tapes/{tape_id}/hvp", {"flat_vector": p.tolist(), "flat": True})
        return arr(answer["flat"]["hvp"])

    out = minimize(
        fun_and_jac,
        np.zeros(D + 1),
        jac=True,
        hessp=hessp,
        method="Newton-CG",
        options={"xtol": 1e-13, "maxiter": 200},
    )
    assert out.success, out.message
    np.testing.assert_allclose(out.x, numpy_solution(), rtol=0, atol=1e-8)
    assert out.nfev < 40 and patches >= 3  # float64 throughout: no precision loss
    # the data went up once; every later request carries only parameters
    assert max(sent) < 3000, max(sent)
    assert len(packed) > 130_000
    client.delete(f"/v1/tapes/{tape_id}")
