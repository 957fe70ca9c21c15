"""The curvature estimators on a tape (issues 12.6 and 15.2) over HTTP with the real
workers, against the dense Hessian of a small model from /v1/hessian: /trace by method
(exact equals numpy's, Hutch++ within its standard error, stopping early), /diagonal
(exact per source, Hutchinson within its per-entry errors), /spectral-density (nodes,
weights and the smoothed density against the exact eigenvalues), power iteration and
eigenvectors on /eigenvalues; jobs with progress; and the 422s of bad parameters and of what would pass the memory bound."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.test_tape_algorithms import DEFN, SHAPES, N, dense, flat, tape_id  # noqa: F401
from tests.service.wire import arr, post, problem, t64


def test_trace_auto_is_exact_for_a_small_tape(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    answer = post(client, f"/v1/tapes/{tape_id}/trace", {})
    assert answer["method"] == "exact" and answer["stopped"] == "exhausted"
    assert answer["converged"] and answer["stderr"] == 0.0
    assert answer["trace"] == pytest.approx(np.trace(h), rel=1e-12)
    # n = 30 unit vectors in one pass (the tests' server takes 32 vectors per pass).
    assert answer["hvps"] == answer["samples"] == N and answer["batches"] == 1
    assert answer["batch_size"] == N


def test_trace_by_hutchpp(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    # auto with a budget below n = 30: Hutch++, whose 8 probes are too few for a
    # standard error (fewer than 30): unknown, and not converged.
    small = post(client, f"/v1/tapes/{tape_id}/trace", {"max_hvps": 24, "batch_size": 4})
    assert small["method"] == "hutchpp" and small["hvps"] == 24 and small["sketch"] > 0
    assert small["samples"] == 8 and small["stderr"] is None and not small["converged"]
    # With n HVPs left once its sketch would span n/3, Hutch++ takes the exact trace:
    # 2 rounds of 12 (a third would take Q to 12 > 10), then one pass of the 30 unit
    # vectors (it used to grow on to the whole space, 3n).
    handed = post(
        client,
        f"/v1/tapes/{tape_id}/trace",
        {"method": "hutchpp", "batch_size": 4, "max_hvps": 3000, "rtol": 0.05},
    )
    assert handed["method"] == "exact" and handed["stopped"] == "exhausted"
    assert handed["converged"] and handed["stderr"] == 0.0
    assert handed["hvps"] == 24 + N and handed["batch_size"] == N
    assert handed["trace"] == pytest.approx(np.trace(h), rel=1e-12)


def test_trace_by_hutchinson_stops_at_its_tolerance(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    # Hutchinson has no exact hand-over: with a tolerance it must stop on it, once its
    # standard error is known (30 samples on), long before the budget.
    early = post(
        client,
        f"/v1/tapes/{tape_id}/trace",
        {"method": "hutchinson", "batch_size": 1, "max_hvps": 3000, "rtol": 0.1, "seed": 1},
    )
    assert early["stopped"] == "tolerance" and early["converged"]
    assert 30 <= early["samples"] == early["hvps"] < 3000
    assert early["stderr"] <= 0.1 * abs(early["trace"])
    assert abs(early["trace"] - np.trace(h)) <= 4 * early["stderr"]
    # Two probes are no standard error: the reviewer's probe answered 0 and converged.
    two = post(client, f"/v1/tapes/{tape_id}/trace", {"method": "hutchinson", "max_hvps": 2})
    assert two["samples"] == 2 and two["stderr"] is None and not two["converged"]
    few = post(
        client,
        f"/v1/tapes/{tape_id}/diagonal",
        {"method": "hutchinson", "max_hvps": 2, "batch_size": 1, "rtol": 0.5},
    )
    assert few["stderr"] is None and few["error"] is None and not few["converged"]
    assert few["stopped"] == "max_hvps"


def test_trace_parameters_are_checked(client, tape_id) -> None:  # noqa: F811
    url = f"/v1/tapes/{tape_id}/trace"
    exact = problem(
        client.post(url, json={"method": "exact", "max_hvps": 10}), 422, "invalid-request"
    )
    assert "max_hvps" in exact["detail"] and "30 parameters" in exact["detail"]
    hutchpp = problem(
        client.post(url, json={"method": "hutchpp", "max_hvps": 2}), 422, "invalid-request"
    )
    assert "max_hvps" in hutchpp["detail"] and "at least 3" in hutchpp["detail"]
    # max_seconds below the floor an algorithm always gets was silently raised to it.
    for path in ("trace", "diagonal", "eigenvalues", "spectral-density", "solve", "influence"):
        short = problem(
            client.post(f"/v1/tapes/{tape_id}/{path}", json={"max_seconds": 1e-9}),
            422,
            "validation",
        )
        assert short["errors"][0]["field"] == "max_seconds", short
        assert "0.05" in short["errors"][0]["message"], short
    unknown = problem(client.post(url, json={"method": "lanczos"}), 422, "validation")
    assert unknown["errors"][0]["field"] == "method"
    problem(client.post(url, json={"atol": -1.0}), 422, "validation")


def test_diagonal_exact_and_hutchinson(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    exact = post(client, f"/v1/tapes/{tape_id}/diagonal", {})
    assert exact["method"] == "exact" and exact["stopped"] == "exhausted"
    assert exact["reached"] == N and exact["stderr"] is None and exact["error"] == 0.0
    assert {k: v["shape"] for k, v in exact["diagonal"].items()} == {
        k: list(s) for k, s in SHAPES.items()
    }
    np.testing.assert_allclose(flat(exact["diagonal"]), np.diag(h), rtol=1e-12, atol=1e-14)

    est = post(
        client,
        f"/v1/tapes/{tape_id}/diagonal",
        {"method": "hutchinson", "batch_size": 32, "max_hvps": 3200, "seed": 2},
    )
    assert est["method"] == "hutchinson" and est["samples"] == est["hvps"] == 3200
    stderr = flat(est["stderr"])
    z = (flat(est["diagonal"]) - np.diag(h)) / np.where(stderr > 0, stderr, 1.0)
    assert np.all(np.abs(z) < 4.5)
    assert est["error"] == pytest.approx(np.sqrt(np.mean(stderr**2)))
    early = post(
        client,
        f"/v1/tapes/{tape_id}/diagonal",
        {"method": "hutchinson", "max_hvps": 5000, "rtol": 0.2},
    )
    assert early["stopped"] == "tolerance" and early["hvps"] < 5000
    problem(
        client.post(f"/v1/tapes/{tape_id}/diagonal", json={"method": "hutchpp"}), 422, "validation"
    )
    few = problem(
        client.post(f"/v1/tapes/{tape_id}/diagonal", json={"method": "exact", "max_hvps": 29}),
        422,
        "invalid-request",
    )
    assert "exact diagonal" in few["detail"] and "29" in few["detail"]
    # The refusal says where "got 29" came from (it may be the default: past the
    # server's algorithm_max_hvps no budget reaches n) and what answers instead.
    assert "got 29 (the request's max_hvps, or its default)" in few["detail"]
    assert "method 'auto' (the default) or 'hutchinson'" in few["detail"]


def test_spectral_density_against_the_exact_eigenvalues(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    values = np.linalg.eigvalsh(h)
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/spectral-density",
        {"probes": 6, "steps": 64, "sigma": 0.05, "points": 300},
    )
    # 64 steps are capped at n = 30, which spans everything: each probe's nodes are the
    # eigenvalues it sees, its weights its squared components along them.
    assert answer["steps"] == N and answer["parameters"] == N and answer["probes"] == 6
    assert answer["stopped"] == "complete" and answer["converged"]
    assert answer["hvps"] <= 6 * N and answer["sigma"] == 0.05
    for nodes, weights in zip(answer["nodes"], answer["weights"], strict=True):
        assert sum(weights) == pytest.approx(1.0)
        assert min(nodes) == pytest.approx(values.min(), abs=1e-7)
        assert max(nodes) == pytest.approx(values.max(), abs=1e-7)
        # Moments of the quadrature: mean eigenvalue per probe, a Hutchinson sample of
        # tr(H)/n; checked below on average.
    grid, density = np.asarray(answer["grid"]), np.asarray(answer["density"])
    assert len(grid) == len(density) == len(answer["stderr"]) == 300
    assert np.trapezoid(density, grid) == pytest.approx(1.0, abs=1e-3)
    means = [np.dot(t, w) for t, w in zip(answer["nodes"], answer["weights"], strict=True)]
    assert abs(np.mean(means) - values.mean()) < 4 * np.std(means) / np.sqrt(6) + 1e-9
    # A grid of the client's choice, and the smoothed exact density as the reference.
    wide = post(
        client,
        f"/v1/tapes/{tape_id}/spectral-density",
        {"probes": 16, "steps": 30, "sigma": 0.3, "grid": list(np.linspace(-3, 6, 91))},
    )
    assert wide["grid"][0] == -3.0 and len(wide["grid"]) == 91
    z = (np.asarray(wide["grid"])[:, None] - values[None, :]) / 0.3
    exact = np.exp(-0.5 * z**2).sum(axis=1) / (N * 0.3 * np.sqrt(2 * np.pi))
    assert np.max(np.abs(np.asarray(wide["density"]) - exact)) < (5 * np.max(wide["stderr"]) + 1e-3)


def test_spectral_density_limits(client, tape_id) -> None:  # noqa: F811
    url = f"/v1/tapes/{tape_id}/spectral-density"
    cut = post(client, url, {"probes": 4, "steps": 20, "max_hvps": 30})
    assert cut["stopped"] == "max_hvps" and cut["hvps"] == 30 and not cut["converged"]
    for body, field in [
        ({"probes": 0}, "probes"),
        ({"sigma": 0}, "sigma"),
        ({"points": 1}, "points"),
        ({"grid": []}, "grid"),
        ({"steps": 5000}, "steps"),
    ]:
        found = problem(client.post(url, json=body), 422, "validation")
        assert found["errors"][0]["field"].startswith(field), found
    over = problem(client.post(url, json={"max_hvps": 10**6}), 422, "too-large")
    assert "algorithm_max_hvps" in over["detail"]


def test_power_iteration_and_eigenvectors(client, dense, tape_id) -> None:  # noqa: F811
    h, _ = dense
    values, vectors = np.linalg.eigh(h)
    order = np.argsort(-np.abs(values))[:2]
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/eigenvalues",
        {"k": 2, "method": "power", "tol": 1e-9, "max_hvps": 4000, "eigenvectors": True},
    )
    assert answer["method"] == "power" and answer["stopped"] == "converged"
    np.testing.assert_allclose(answer["eigenvalues"], values[order], rtol=1e-7)
    assert answer["hvps"] <= 2 * answer["iterations"]
    for y, i in zip(answer["eigenvectors"], order, strict=True):
        assert set(y) == set(SHAPES) and y["w1"]["shape"] == [3, 5]
        got = flat(y)
        want = vectors[:, i]
        np.testing.assert_allclose(got * np.sign(got @ want), want, atol=1e-5)
    lanczos = post(
        client, f"/v1/tapes/{tape_id}/eigenvalues", {"k": 2, "which": "LM", "tol": 1e-10}
    )
    assert lanczos["method"] == "lanczos"
    np.testing.assert_allclose(lanczos["eigenvalues"], answer["eigenvalues"], rtol=1e-6)
    wrong = problem(
        client.post(f"/v1/tapes/{tape_id}/eigenvalues", json={"method": "power", "which": "SA"}),
        422,
        "invalid-request",
    )
    assert "which" in wrong["detail"] and "lanczos" in wrong["detail"]
    assert wrong["errors"][0]["field"] == "which"


@pytest.mark.parametrize(
    "path,body",
    [
        ("diagonal", {"method": "hutchinson", "max_hvps": 64, "batch_size": 8}),
        ("spectral-density", {"probes": 4, "steps": 20}),
        ("eigenvalues", {"k": 2, "method": "power", "max_hvps": 200, "tol": 1e-8}),
    ],
)
def test_estimators_run_as_jobs(client, tape_id, path: str, body: dict) -> None:  # noqa: F811
    sync = post(client, f"/v1/tapes/{tape_id}/{path}", body)
    r = client.post(f"/v1/tapes/{tape_id}/{path}", json={**body, "async": True})
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
    while (job := client.get(location).json())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    assert job["state"] == "succeeded", job
    assert job["progress"]["unit"] == "hvps" and job["progress"]["done"] == sync["hvps"]
    assert {k: v for k, v in job["result"].items() if k != "seconds"} == {
        k: v for k, v in sync.items() if k != "seconds"
    }
    if path == "diagonal":
        np.testing.assert_array_equal(
            arr(job["result"]["diagonal"]["w1"]), arr(sync["diagonal"]["w1"])
        )


@pytest.fixture(scope="module")
def small_basis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server whose algorithms may hold 2,000 bytes of host vectors: 8 vectors of the
    tape's 30 parameters (240 bytes each)."""
    tmp = tmp_path_factory.mktemp("small-basis")
    srv: Server = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_LANCZOS_MAX_BASIS_BYTES": "2000",
        },
        tmp / "server.log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            yield client
    finally:
        stop_server(srv)


def test_the_memory_of_stored_vectors_is_bounded(small_basis, dense) -> None:  # noqa: F811
    h, _ = dense
    created = small_basis.post("/v1/tapes", json={"definition": DEFN, "target": "loss"})
    assert created.status_code == 201, created.text
    tape = created.json()["tape_id"]
    url = f"/v1/tapes/{tape}"
    density = problem(
        small_basis.post(f"{url}/spectral-density", json={"steps": 30}), 422, "too-large"
    )
    assert "30 vectors of 30 parameters" in density["detail"]
    assert "fewer steps" in density["detail"] and density["limit"] == 2000
    power = problem(
        small_basis.post(f"{url}/eigenvalues", json={"k": 5, "method": "power"}), 422, "too-large"
    )
    assert "power-iteration block of 10 vectors" in power["detail"]
    lanczos = problem(small_basis.post(f"{url}/eigenvalues", json={"k": 9}), 422, "too-large")
    assert "Lanczos basis of 9 vectors" in lanczos["detail"]
    # Within the bound: 8 steps fit; four probes run one at a time.
    fits = post(small_basis, f"{url}/spectral-density", {"probes": 4, "steps": 8})
    assert fits["probes"] == 4 and fits["hvps"] == 32 and fits["converged"]
    # Hutch++ stops growing its sketch at the bound and spends the rest on probes.
    plus = post(
        small_basis,
        f"{url}/trace",
        {"method": "hutchpp", "batch_size": 2, "max_hvps": 300, "seed": 4},
    )
    assert plus["sketch"] <= 4 and plus["hvps"] == 300 and plus["samples"] > 250
    assert abs(plus["trace"] - np.trace(h)) < 4 * plus["stderr"]


def test_an_exact_diagonal_stopped_by_time_answers_only_what_it_reached(client) -> None:
    # 4800 parameters, 4000 rows: one exact pass (32 unit vectors on the tests' server)
    # takes longer than max_seconds, so the run stops after it. The entries past the
    # reached ones were answered 0.0; now `diagonal` is null and `partial` holds only the
    # reached entries, which match the closed form
    # d^2/dW_aj^2 sum tanh(x W)^2 = sum_n x_na^2 f''(z_nj), f'' = 2 (1 - t^2)(1 - 3 t^2).
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4000, 60)) * 0.3
    w = rng.standard_normal((60, 80)) * 0.3
    defn = {
        "variables": {"w": t64(w, "float64")},
        "inputs": {"x": t64(x, "float64")},
        "program": ["loss = sum(tanh(x @ w) ** 2)"],
    }
    created = client.post("/v1/tapes", json={"definition": defn, "target": "loss"})
    assert created.status_code == 201, created.text[:300]
    tape = created.json()["tape_id"]
    answer = post(
        client,
        f"/v1/tapes/{tape}/diagonal",
        {"method": "exact", "max_hvps": 4800, "max_seconds": 0.05},
    )
    assert answer["stopped"] == "time_limit" and not answer["converged"]
    assert answer["diagonal"] is None and answer["error"] is None
    reached = answer["reached"]
    assert 0 < reached < 4800 and answer["hvps"] == answer["samples"] == reached
    th = np.tanh(x @ w)
    truth = ((x**2).T @ (2 * (1 - th**2) * (1 - 3 * th**2))).reshape(-1)  # (a, j) row-major
    partial = arr(answer["partial"])
    assert partial.shape == (reached,)
    np.testing.assert_allclose(partial, truth[:reached], rtol=1e-9, atol=1e-9)
    complete = post(client, f"/v1/tapes/{tape}/diagonal", {"method": "hutchinson"})
    assert complete["partial"] is None and complete["diagonal"] is not None
