"""Issue 27, items 2 to 4: a job has its own time budget (job_time_limit, far above the
synchronous time_limit; a request's time_limit may ask it for less); the exact trace or
diagonal named without a budget takes n HVPs instead of refusing the default 256; an
exact run cut short says `partial`; and a finished job's progress is its answer's own
figures. No wall-clock bound: the budget is read from the job's progress, and the run cut
short is one whose n HVPs cannot fit in the smallest max_seconds on any machine."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from tests.service.test_jobs import wait
from tests.service.wire import post, problem, t, t64


def _tape(client: httpx.Client, n: int, rows: int = 8) -> str:
    """sum(tanh(X @ w)^2) over n parameters: its Hessian is dense and definite enough."""
    rng = np.random.default_rng(n)
    definition = {
        "variables": {"w": t(rng.standard_normal(n) / np.sqrt(n), "float64")},
        "inputs": {"X": t(rng.standard_normal((rows, n)), "float64")},
        "program": ["loss = sum(tanh(X @ w) ** 2)"],
    }
    r = client.post("/v1/tapes", json={"definition": definition, "target": "loss"})
    assert r.status_code == 201, r.text
    return r.json()["tape_id"]


@pytest.fixture(scope="module")
def tape_300(client: httpx.Client) -> str:
    return _tape(client, 300)


def _job(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json={**body, "async": True})
    assert r.status_code == 202, r.text
    job = wait(client, r.headers["location"], ("succeeded", "failed", "cancelled"), timeout=120)
    assert job["state"] == "succeeded", job
    return job


def test_a_job_has_its_own_time_budget_and_may_ask_for_less(client, tape_300) -> None:
    url = f"/v1/tapes/{tape_300}/trace"
    body = {"method": "hutchinson", "max_hvps": 64, "batch_size": 8}
    # Above the synchronous maximum (60 s on this server): refused there, a job's right.
    refused = problem(client.post(url, json={**body, "time_limit": 120}), 422)
    assert "max_time_limit" in refused["detail"] and "job" in refused["detail"]
    # progress.max_seconds: 0.9 of the job's limit (the algorithm stops itself before the
    # pool would), less what the worker spent before the algorithm began.
    asked = _job(client, url, {**body, "time_limit": 120})
    assert 60 < asked["progress"]["max_seconds"] <= 0.9 * 120
    # Unasked: the job_time_limit (an hour by default), not the synchronous 30 s.
    default = _job(client, url, body)
    assert 1000 < default["progress"]["max_seconds"] <= 0.9 * 3600
    # Prefer: respond-async is a job as "async": true is.
    r = client.post(url, json=body, headers={"Prefer": "respond-async"})
    assert r.status_code == 202, r.text
    job = wait(client, r.headers["location"], ("succeeded", "failed"), timeout=120)
    assert 1000 < job["progress"]["max_seconds"] <= 0.9 * 3600
    # Less may be asked; more than the job budget may not.
    less = _job(client, url, {**body, "time_limit": 5})
    assert 0 < less["progress"]["max_seconds"] <= 0.9 * 5
    too_long = problem(client.post(url, json={**body, "time_limit": 4000, "async": True}), 422)
    assert "job_time_limit" in too_long["detail"] and too_long["errors"][0]["field"] == "time_limit"


def test_the_last_progress_of_a_finished_job_is_its_answer(client, tape_300) -> None:
    url = f"/v1/tapes/{tape_300}"
    trace = _job(client, f"{url}/trace", {"method": "hutchinson", "max_hvps": 400, "batch_size": 2})
    result, progress = trace["result"], trace["progress"]
    assert progress["estimate"] == result["trace"] and progress["error"] == result["stderr"]
    assert progress["done"] == result["hvps"] and progress["eta"] == 0.0
    solve = _job(client, f"{url}/solve", {"damping": 0.1, "tol": 1e-12, "max_iterations": 50})
    assert solve["progress"]["error"] == solve["result"]["residuals"][-1]
    eigen = _job(client, f"{url}/eigenvalues", {"k": 2, "tol": 1e-8, "max_hvps": 300})
    assert eigen["progress"]["estimate"] == eigen["result"]["eigenvalues"]
    assert eigen["progress"]["error"] == eigen["result"]["residuals"]
    # The Frobenius norm (a row of the operation table) too: its last report lagged.
    body = {"max_hvps": 400, "batch_size": 2, "rtol": 1e-12}
    norm = _job(client, f"{url}/frobenius-norm", body)
    assert norm["progress"]["estimate"] == norm["result"]["frobenius_norm_squared"]
    assert norm["progress"]["error"] == norm["result"]["stderr"]
    assert norm["progress"]["done"] == norm["result"]["hvps"]


def test_the_exact_method_named_without_a_budget_takes_n(client, tape_300) -> None:
    url = f"/v1/tapes/{tape_300}"
    sized = post(client, f"{url}/trace", {"method": "exact"})  # n = 300 > the default 256
    given = post(client, f"{url}/trace", {"method": "exact", "max_hvps": 300})
    assert sized["method"] == "exact" and sized["converged"] and not sized["partial"]
    assert sized["hvps"] == 300 and sized["trace"] == pytest.approx(given["trace"], rel=1e-12)
    diagonal = post(client, f"{url}/diagonal", {"method": "exact"})
    assert diagonal["hvps"] == 300 and diagonal["converged"]
    assert sum(np.sum(d["data"]) for d in diagonal["diagonal"].values()) == pytest.approx(
        sized["trace"], rel=1e-10
    )
    # As a job too (the 422 used to come after the job was queued).
    job = _job(client, f"{url}/trace", {"method": "exact"})
    assert job["result"]["hvps"] == 300 and job["result"]["trace"] == sized["trace"]
    # A budget the client sent is its own: below n is refused, naming n.
    found = problem(client.post(f"{url}/trace", json={"method": "exact", "max_hvps": 100}), 422)
    assert "at least 300" in found["detail"]


def test_an_exact_trace_cut_short_says_partial(client) -> None:
    # 3,000 parameters through 20 tanh layers: 3,000 HVPs (some 50 batched passes of
    # hundreds of ops each) do not fit in 0.05 s on any machine (a loaded one only stops
    # sooner).
    n, rng = 3000, np.random.default_rng(27)
    program = ["h0 = tanh(X @ w)"]
    program += [f"h{i} = tanh(h{i - 1} * 1.1 + 0.1)" for i in range(1, 20)]
    program += ["loss = sum(h19 ** 2) + sum(tanh(w) ** 2)"]
    definition = {
        "variables": {"w": t64(rng.standard_normal(n) / np.sqrt(n), "float64")},
        "inputs": {"X": t64(rng.standard_normal((30, n)), "float64")},
        "program": program,
    }
    r = client.post("/v1/tapes", json={"definition": definition, "target": "loss"})
    assert r.status_code == 201, r.text
    url = f"/v1/tapes/{r.json()['tape_id']}/trace"
    found = post(client, url, {"method": "exact", "max_hvps": n, "max_seconds": 0.05})
    assert found["stopped"] == "time_limit" and not found["converged"]
    assert found["method"] == "exact" and found["partial"] is True
    assert 0 < found["hvps"] < n
