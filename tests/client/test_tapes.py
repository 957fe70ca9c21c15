"""RemoteTape against the live server: recorded once, then HVPs, PATCH, the server's
Lanczos / Hutchinson / CG, and SciPy driving the remote Hessian through
linear_operator(), fun/jac/hessp, to the answers of dense NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from gradtape.client import Client, Definition, TapeGone
from scipy.optimize import minimize
from scipy.sparse.linalg import LinearOperator, cg, eigsh

from tests.client.test_stateless import logistic


def quartic(rng: np.random.Generator, n: int = 12) -> tuple[Definition, dict, np.ndarray]:
    """loss = x.A.x / 2 + sum(x^4) / 4 over two sources (a vector and a matrix), its
    dense Hessian A + diag(3 x^2) at the recorded point, sources ordered (u, m)."""
    A = rng.standard_normal((n, n))
    A = A @ A.T / n
    u, m = rng.standard_normal(4), rng.standard_normal((2, (n - 4) // 2))
    d = Definition(
        """
        x    = concatenate([u, reshape(m, shape=(-1,))])
        loss = sum(x * (A @ x)) / 2 + sum(x * x * x * x) / 4
        """,
        variables={"u": u, "m": m},
        inputs={"A": A},
    )
    x = np.concatenate([u, m.reshape(-1)])
    return d, {"u": u, "m": m}, A + np.diag(3 * x**2)


def test_tape_value_gradients_hvps(client: Client, rng: np.random.Generator) -> None:
    definition, w, loss, grad, hess = logistic(40, 5, rng)
    with client.tape(definition, "loss") as tape:
        assert tape.sources == ["w"] and tape.size == 5
        assert tape.value == pytest.approx(loss(w), rel=1e-13)
        np.testing.assert_allclose(tape.gradients["w"], grad(w), rtol=1e-11)
        v = rng.standard_normal((4, 5))
        np.testing.assert_allclose(tape.hvp({"w": v[0]})["w"], hess(w) @ v[0], rtol=1e-11)
        many = tape.hvp_many([{"w": row} for row in v])
        np.testing.assert_allclose(np.stack([h["w"] for h in many]), v @ hess(w), rtol=1e-11)
        info = tape.info()
        assert info["tape_id"] == tape.id and info["hits"] >= 2
        assert tape.id in [t["tape_id"] for t in client.tapes()["tapes"]]
    with pytest.raises(TapeGone) as gone:  # the context manager deleted it
        tape.hvp({"w": v[0]})
    assert gone.value.reason == "deleted" and gone.value.status == 404


def test_sharded_tape_answers_as_one(client: Client, rng: np.random.Generator) -> None:
    """shards=2: the batch split over the server's two workers; the value, gradient,
    HVPs and the server's Lanczos equal the unsharded tape's."""
    definition, w, loss, grad, hess = logistic(41, 5, rng)
    v = rng.standard_normal((3, 5))
    with client.tape(
        definition, "loss", shards=2, shard_by=["X", "y"], shard_reduction="mean"
    ) as tape:
        assert tape.value == pytest.approx(loss(w), rel=1e-12)
        np.testing.assert_allclose(tape.gradients["w"], grad(w), rtol=1e-11)
        np.testing.assert_allclose(tape.hvp({"w": v[0]})["w"], hess(w) @ v[0], rtol=1e-11)
        many = tape.hvp_many([{"w": row} for row in v])
        np.testing.assert_allclose(np.stack([h["w"] for h in many]), v @ hess(w), rtol=1e-11)
        assert [s["rows"] for s in tape.info()["shards"]] == [21, 20]
        top = tape.eigenvalues(k=2, tol=1e-10)
        np.testing.assert_allclose(
            top.eigenvalues, np.linalg.eigvalsh(hess(w))[::-1][:2], rtol=1e-9
        )

    # The stateless requests take the same fields.
    value, grads = client.gradient(definition, "loss", shards=2)
    assert value == pytest.approx(loss(w), rel=1e-12)
    np.testing.assert_allclose(grads["w"], grad(w), rtol=1e-11)
    answer = client.hvp(definition, "loss", {"w": v[0]}, shards=3, shard_by=("X", "y"))
    np.testing.assert_allclose(answer.hvp["w"], hess(w) @ v[0], rtol=1e-11)


def test_update_records_again(client: Client, rng: np.random.Generator) -> None:
    definition, w, loss, grad, hess = logistic(40, 5, rng)
    with client.tape(definition, "loss", "w") as tape:  # a single source: bare arrays
        w2 = w + 0.5
        assert tape.update(w=w2) is tape
        assert tape.value == pytest.approx(loss(w2), rel=1e-13)
        np.testing.assert_allclose(tape.gradients, grad(w2), rtol=1e-11)
        v = rng.standard_normal(5)
        np.testing.assert_allclose(tape.hvp(v), hess(w2) @ v, rtol=1e-11)
        # An input changes too: the data, by name.
        X2 = rng.standard_normal((40, 5))
        tape.update(X=X2)
        assert tape.value != pytest.approx(loss(w2))


def test_other_targets_of_the_recording(client: Client, rng: np.random.Generator) -> None:
    definition, *_ = logistic(10, 3, rng)
    X = definition["inputs"]["X"]
    with client.tape(definition, "loss") as tape:
        margins = tape.jacobian("margin", "w").jacobians
        y = definition["inputs"]["y"]
        np.testing.assert_allclose(margins, y[:, None] * X, rtol=1e-13)
        dX = tape.gradient("loss", ["X"]).gradients["X"]
        assert dX.shape == X.shape and dX.dtype == np.float64


def test_eigenvalues_trace_solve(client: Client, rng: np.random.Generator) -> None:
    definition, _, H = quartic(rng)
    exact = np.linalg.eigvalsh(H)
    with client.tape(definition, "loss") as tape:
        assert tape.sources == ["u", "m"]
        top = tape.eigenvalues(3, eigenvectors=True)
        assert top.converged
        np.testing.assert_allclose(top.eigenvalues, exact[::-1][:3], rtol=1e-8)
        vec = tape.flatten(top.eigenvectors[0])
        np.testing.assert_allclose(H @ vec, exact[-1] * vec, atol=1e-6)
        bottom = tape.eigenvalues(2, "SA")
        np.testing.assert_allclose(bottom.eigenvalues, exact[:2], rtol=1e-8)

        estimate = tape.trace(method="hutchinson", max_hvps=256, batch_size=32)
        assert estimate.hvps == 256 and estimate.stderr is not None
        assert abs(estimate.trace - np.trace(H)) <= 5 * estimate.stderr + 1e-9

        b = {"u": rng.standard_normal(4), "m": rng.standard_normal((2, 4))}
        x = tape.solve(b, damping=0.1, tol=1e-10, max_iterations=200)
        assert x.converged and x.residuals[0] == pytest.approx(1.0)
        want = np.linalg.solve(H + 0.1 * np.eye(12), tape.flatten(b))
        np.testing.assert_allclose(tape.flatten(x.solution), want, rtol=1e-7)
        newton = tape.solve(damping=0.0, tol=1e-10)  # b: the gradient
        g = tape.flatten(tape.gradients)
        np.testing.assert_allclose(tape.flatten(newton.solution), np.linalg.solve(H, g), rtol=1e-7)


def test_curvature_estimators(client: Client, rng: np.random.Generator) -> None:
    """trace(method=), diagonal(), spectral_density() and power iteration with
    eigenvectors, in the tape's source structure, against the dense Hessian."""
    definition, _, H = quartic(rng)
    values, vectors = np.linalg.eigh(H)
    with client.tape(definition, "loss") as tape:
        exact = tape.trace()  # auto: 12 parameters fit the budget
        assert exact.method == "exact" and exact.stderr == 0.0 and exact.hvps == 12
        assert exact.trace == pytest.approx(np.trace(H), rel=1e-12)
        plus = tape.trace(method="hutchpp", max_hvps=9, batch_size=3)
        assert plus.method == "hutchpp" and plus.hvps == 9 and plus.sketch == 3
        # 3 probes are too few for a standard error (fewer than 30): none, not converged.
        assert plus.stderr is None and not plus.converged
        plain = tape.trace(method="hutchinson", max_hvps=60, batch_size=3)
        assert plain.samples == 60 and plain.converged
        assert abs(plain.trace - np.trace(H)) <= 4 * plain.stderr + 1e-9

        diagonal = tape.diagonal()
        assert diagonal.method == "exact" and diagonal.stderr is None
        assert diagonal.diagonal["m"].shape == (2, 4)
        np.testing.assert_allclose(tape.flatten(diagonal.diagonal), np.diag(H), rtol=1e-12)
        estimate, stderr = tape.diagonal(method="hutchinson", max_hvps=2000, batch_size=100)
        err = tape.flatten(stderr)
        assert np.all(np.abs(tape.flatten(estimate) - np.diag(H)) <= 4.5 * err + 1e-12)

        density = tape.spectral_density(probes=5, steps=12, sigma=0.1)
        assert density.probes == 5 and density.steps == 12 and density.parameters == 12
        for nodes, weights in zip(density.nodes, density.weights, strict=True):
            np.testing.assert_allclose(nodes[[0, -1]], values[[0, -1]], rtol=1e-7)
            assert weights.sum() == pytest.approx(1.0)
        # Re-smoothed locally from the raw quadrature: the server's density, and any other.
        np.testing.assert_allclose(
            density.smoothed(density.grid, 0.1), density.density, rtol=1e-9, atol=1e-12
        )
        assert np.trapezoid(
            density.smoothed(np.linspace(-5, 40, 4000), 0.5), np.linspace(-5, 40, 4000)
        ) == pytest.approx(1.0, abs=1e-3)

        # As jobs with progress: the same answers.
        seen: list = []
        job = tape.spectral_density(probes=5, steps=12, sigma=0.1, progress=seen.append)
        np.testing.assert_array_equal(job.density, density.density)
        assert seen[-1].state == "succeeded" and seen[-1].progress["done"] == density.hvps
        job_diagonal = tape.diagonal(
            method="hutchinson", max_hvps=2000, batch_size=100, progress=lambda s: None
        )
        np.testing.assert_array_equal(tape.flatten(job_diagonal.diagonal), tape.flatten(estimate))

        top = tape.eigenvalues(2, method="power", tol=1e-10, max_hvps=5000, eigenvectors=True)
        assert top.method == "power" and top.converged
        np.testing.assert_allclose(top.eigenvalues, values[::-1][:2], rtol=1e-8)
        for vector, want in zip(top.eigenvectors, vectors[:, ::-1].T[:2], strict=True):
            got = tape.flatten(vector)
            np.testing.assert_allclose(got * np.sign(got @ want), want, atol=1e-6)


def test_progress_runs_lanczos_as_a_job(client: Client, rng: np.random.Generator) -> None:
    """progress= (tests/client/test_jobs.py has the rest): the same eigenvalues."""
    definition, _, H = quartic(rng)
    with client.tape(definition, "loss") as tape:
        states: list[str] = []
        eig = tape.eigenvalues(2, tol=1e-10, progress=lambda s: states.append(s.state))
        np.testing.assert_allclose(eig.eigenvalues, np.linalg.eigvalsh(H)[::-1][:2], rtol=1e-6)
        assert states[-1] == "succeeded"


def test_linear_operator_drives_eigsh_and_cg(server, rng: np.random.Generator) -> None:
    definition, _, H = quartic(rng)
    with Client(server.base_url) as client, client.tape(definition, "loss") as tape:
        op = tape.linear_operator()
        assert isinstance(op, LinearOperator)
        assert op.shape == (12, 12) and op.dtype == np.float64
        hits = tape.info()["hits"]
        X = rng.standard_normal((12, 5))
        np.testing.assert_allclose(op @ X, H @ X, rtol=1e-10)  # matmat: one request
        assert tape.info()["hits"] == hits + 1  # five columns, one request (GET is no hit)
        np.testing.assert_allclose(op.T @ X[:, 0], H @ X[:, 0], rtol=1e-10)

        vals, _ = eigsh(op, k=3, which="LA", tol=1e-10)
        np.testing.assert_allclose(np.sort(vals), np.linalg.eigvalsh(H)[-3:], rtol=1e-8)
        b = rng.standard_normal(12)
        x, info = cg(op, b, rtol=1e-10, maxiter=500)
        assert info == 0
        np.testing.assert_allclose(x, np.linalg.solve(H, b), rtol=1e-6)


def test_linear_operator_of_a_float32_tape(client: Client, rng: np.random.Generator) -> None:
    """The operator is float64 whatever the tape computes in (float32 here)."""
    A = rng.standard_normal((6, 6)).astype(np.float32)
    A = A @ A.T
    d = {
        "variables": {"w": np.ones(6, np.float32)},
        "inputs": {"A": A},
        "program": ["loss = sum(w * (A @ w)) / 2"],
    }
    with client.tape(d, "loss") as tape:
        op = tape.linear_operator()
        out = op @ np.eye(6)[:, 0]
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, A[:, 0], rtol=1e-6)


@pytest.mark.parametrize("method", ["Newton-CG", "trust-krylov"])
def test_minimize_with_remote_hessian_products(
    server, rng: np.random.Generator, method: str
) -> None:
    """scipy.optimize.minimize(fun, jac, hessp) on a remote tape, re-recorded (PATCH) as x
    moves, reaches the optimum a dense NumPy Newton iteration finds."""
    definition, w0, loss, grad, hess = logistic(60, 4, rng)
    w = w0.copy()
    for _ in range(50):
        w = w - np.linalg.solve(hess(w), grad(w))
    with Client(server.base_url) as client, client.tape(definition, "loss") as tape:
        result = minimize(
            tape.fun,
            tape.flatten({"w": w0}),
            jac=tape.jac,
            hessp=tape.hessp,
            method=method,
            options={"gtol": 1e-8} if method == "trust-krylov" else {"xtol": 1e-12},
        )
    assert result.success, result
    assert np.linalg.norm(grad(result.x)) < 1e-7  # stationary by NumPy's own gradient
    np.testing.assert_allclose(result.x, w, atol=1e-7)
    assert result.fun == pytest.approx(loss(w), rel=1e-12)
