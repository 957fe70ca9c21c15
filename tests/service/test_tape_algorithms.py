"""The algorithms on a tape (/eigenvalues, /trace, /solve) against the dense Hessian of
a small model from /v1/hessian: eigenvalues and eigenvectors, the trace within its
standard error, the damped Newton step; their limits and what they report."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.wire import arr, post, problem, t

rng = np.random.default_rng(61)
SHAPES = {"w1": (3, 5), "b1": (5,), "w2": (5, 2)}
DEFN = {
    "variables": {
        name: t(rng.standard_normal(shape) * 0.8, "float64") for name, shape in SHAPES.items()
    },
    "inputs": {
        "x": t(rng.standard_normal((10, 3)), "float64"),
        "y": t(rng.standard_normal((10, 2)), "float64"),
    },
    "program": ["h = tanh(x @ w1 + b1)", "loss = mean((h @ w2 - y) ** 2)"],
}
N = sum(int(np.prod(s)) for s in SHAPES.values())  # 30 parameters


def flat(tensors: dict) -> np.ndarray:
    return np.concatenate([arr(tensors[k]).reshape(-1) for k in SHAPES])


def split(x: np.ndarray) -> dict:
    out, start = {}, 0
    for name, shape in SHAPES.items():
        size = int(np.prod(shape))
        out[name] = t(x[start : start + size].reshape(shape), "float64")
        start += size
    return out


@pytest.fixture(scope="module")
def dense(client) -> tuple[np.ndarray, np.ndarray]:
    """The Hessian (N x N) and the gradient (N,)."""
    answer = post(client, "/v1/hessian", {"definition": DEFN, "target": "loss"})
    h = np.block(
        [
            [
                arr(answer["hessian"][a][b]).reshape(
                    int(np.prod(SHAPES[a])), int(np.prod(SHAPES[b]))
                )
                for b in SHAPES
            ]
            for a in SHAPES
        ]
    )
    return h, flat(answer["gradients"])


@pytest.fixture(scope="module")
def tape_id(client) -> str:
    response = client.post("/v1/tapes", json={"definition": DEFN, "target": "loss"})
    assert response.status_code == 201, response.text
    return response.json()["tape_id"]


@pytest.mark.parametrize("which", ["LA", "LM", "SA"])
def test_eigenvalues_match_the_dense_hessian(client, dense, tape_id, which: str) -> None:
    h, _ = dense
    values = np.linalg.eigvalsh(h)
    if which == "LA":
        want = np.sort(values)[::-1][:3]
    elif which == "SA":
        want = np.sort(values)[:3]
    else:
        want = values[np.argsort(-np.abs(values))][:3]
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/eigenvalues",
        {"k": 3, "which": which, "tol": 1e-10, "max_hvps": 100, "eigenvectors": True},
    )
    assert answer["converged"] and answer["stopped"] in ("converged", "exhausted")
    np.testing.assert_allclose(answer["eigenvalues"], want, rtol=1e-7, atol=1e-9)
    assert 3 <= answer["hvps"] == answer["iterations"] <= N
    assert len(answer["residuals"]) == 3 and answer["seconds"] >= 0
    for theta, vector in zip(answer["eigenvalues"], answer["eigenvectors"], strict=True):
        assert set(vector) == set(SHAPES) and vector["w1"]["shape"] == [3, 5]
        y = flat(vector)
        assert np.linalg.norm(y) == pytest.approx(1.0)
        np.testing.assert_allclose(h @ y, theta * y, atol=1e-6)


def test_eigenvalue_limits(client, tape_id) -> None:
    capped = post(client, f"/v1/tapes/{tape_id}/eigenvalues", {"k": 1, "tol": 1e-12, "max_hvps": 2})
    assert capped["hvps"] == 2 and capped["stopped"] == "max_hvps" and not capped["converged"]
    assert capped["eigenvectors"] is None and len(capped["eigenvalues"]) == 1
    too_many = problem(
        client.post(f"/v1/tapes/{tape_id}/eigenvalues", json={"k": 31}), 422, "invalid-request"
    )
    assert "30 parameters" in too_many["detail"]
    few = problem(
        client.post(f"/v1/tapes/{tape_id}/eigenvalues", json={"k": 5, "max_hvps": 4}),
        422,
        "invalid-request",
    )
    assert "max_hvps" in few["detail"]
    over = problem(
        client.post(f"/v1/tapes/{tape_id}/eigenvalues", json={"max_hvps": 10**6}), 422, "too-large"
    )
    assert "algorithm_max_hvps" in over["detail"]
    problem(
        client.post(f"/v1/tapes/{tape_id}/eigenvalues", json={"which": "XX"}), 422, "validation"
    )


def test_trace_within_its_standard_error(client, dense, tape_id) -> None:
    h, _ = dense
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/trace",
        {"method": "hutchinson", "batch_size": 32, "max_hvps": 2048, "seed": 5},
    )
    assert (
        answer["method"] == "hutchinson"
        and answer["samples"] == answer["hvps"] == 2048
        and answer["batches"] == 64
    )
    assert answer["batch_size"] == 32 and answer["stopped"] == "max_hvps"
    assert abs(answer["trace"] - np.trace(h)) < 4 * answer["stderr"]
    expected = np.sqrt(2 * (np.sum(h * h) - np.sum(np.diag(h) ** 2)) / 2048)
    assert answer["stderr"] == pytest.approx(expected, rel=0.15)
    again = post(
        client,
        f"/v1/tapes/{tape_id}/trace",
        {"method": "hutchinson", "batch_size": 32, "max_hvps": 2048, "seed": 5},
    )
    assert again["trace"] == answer["trace"]  # seeded
    early = post(
        client,
        f"/v1/tapes/{tape_id}/trace",
        {"method": "hutchinson", "batch_size": 16, "max_hvps": 5000, "rtol": 0.05},
    )
    assert early["stopped"] == "tolerance" and early["converged"]
    assert early["stderr"] <= 0.05 * abs(early["trace"]) and early["samples"] < 5000
    capped = post(client, f"/v1/tapes/{tape_id}/trace", {"method": "hutchinson", "batch_size": 64})
    assert capped["batch_size"] == 32  # the tests' server does 32 vectors per pass at most


def test_solve_is_the_damped_newton_step(client, dense, tape_id) -> None:
    h, g = dense
    damping = max(0.0, -np.linalg.eigvalsh(h).min()) + 0.05
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/solve",
        {"damping": damping, "tol": 1e-10, "max_iterations": 200},
    )
    assert answer["rhs"] == "gradient" and answer["converged"]
    assert answer["stopped"] == "converged" and answer["hvps"] == answer["iterations"]
    np.testing.assert_allclose(
        flat(answer["solution"]), np.linalg.solve(h + damping * np.eye(N), g), rtol=1e-7, atol=1e-10
    )
    residuals = answer["residuals"]
    assert residuals[0] == 1.0 and residuals[-1] <= 1e-10
    assert len(residuals) == answer["iterations"] + 1
    b = np.linspace(-1, 1, N)
    other = post(
        client, f"/v1/tapes/{tape_id}/solve", {"vector": split(b), "damping": damping, "tol": 1e-10}
    )
    assert other["rhs"] == "vector"
    np.testing.assert_allclose(
        flat(other["solution"]), np.linalg.solve(h + damping * np.eye(N), b), rtol=1e-7, atol=1e-10
    )


def test_solve_limits_and_curvature(client, dense, tape_id) -> None:
    h, _ = dense
    capped = post(
        client, f"/v1/tapes/{tape_id}/solve", {"damping": 10.0, "tol": 1e-14, "max_iterations": 3}
    )
    assert capped["stopped"] == "max_iterations" and capped["iterations"] == 3
    assert not capped["converged"] and len(capped["residuals"]) == 4
    by_hvps = post(
        client,
        f"/v1/tapes/{tape_id}/solve",
        {"damping": 10.0, "tol": 1e-14, "max_iterations": 50, "max_hvps": 2},
    )
    assert by_hvps["stopped"] == "max_hvps" and by_hvps["hvps"] == 2
    values, vectors = np.linalg.eigh(h)
    assert values[0] < 0  # this model's Hessian is indefinite: along its most negative
    bad = post(
        client,
        f"/v1/tapes/{tape_id}/solve",  # eigenvector CG meets it at once
        {"vector": split(vectors[:, 0]), "damping": 0.0},
    )
    assert bad["stopped"] == "negative_curvature" and not bad["converged"]
    assert bad["iterations"] == 0 and bad["hvps"] == 1
    problem(client.post(f"/v1/tapes/{tape_id}/solve", json={"damping": -1.0}), 422, "validation")
    wrong = problem(
        client.post(f"/v1/tapes/{tape_id}/solve", json={"vector": {"w1": t(np.ones(2))}}),
        422,
        "invalid-request",
    )
    assert "vector" in wrong["detail"]
