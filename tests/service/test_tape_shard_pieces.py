"""Jacobians, gradients of any target and influence functions on sharded tapes
(issue 16): answers assembled from the parts' pieces equal the unsharded tape's
(float64: to rounding). 10 examples over 3 shards (4 + 3 + 3), both reductions. Real
server, real workers."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from tests.service.test_jobs import start, wait
from tests.service.test_tape_workloads import kill_worker
from tests.service.wire import arr, ok, post, problem, t

rng = np.random.default_rng(1616)
N = 10
X = rng.standard_normal((N, 3))
Y = rng.standard_normal((N, 2))
W1 = rng.standard_normal((3, 4)) * 0.7
B1 = rng.standard_normal(4) * 0.1
W2 = rng.standard_normal((4, 2)) * 0.7
KEYS = ("w1", "b1", "w2")

MODEL = ["h = tanh(x @ w1 + b1)", "out = h @ w2"]
# Names of every kind a jacobian may ask for: per-example (out, err), batch-independent
# (pen), and mixing the examples otherwise than the loss (hm).
MEAN = [
    *MODEL,
    "err = sum((out - y) ** 2, axis=1)",
    "pen = 0.01 * sum(w1 ** 2)",
    "hm = mean(h, axis=0)",
    "loss = mean(err) + pen",
]
SUM = [
    *MODEL,
    "err = sum((out - y) ** 2, axis=1)",
    "pen = 0.01 * sum(w1 ** 2)",
    "hm = mean(h, axis=0)",
    "loss = sum(err)",
]
# Influence needs the loss a function of the output (no penalty of the weights).
INFLUENCE = {
    "mean": [*MODEL, "loss = mean((out - y) ** 2)"],
    "sum": [*MODEL, "loss = sum((out - y) ** 2)"],
}


def definition(program: list[str]) -> dict:
    return {
        "variables": {"w1": t(W1, "float64"), "b1": t(B1, "float64"), "w2": t(W2, "float64")},
        "inputs": {"x": t(X, "float64"), "y": t(Y, "float64")},
        "program": program,
    }


def record(client, program: list[str], **extra) -> str:
    r = client.post(
        "/v1/tapes", json={"definition": definition(program), "target": "loss", **extra}
    )
    assert r.status_code == 201, r.text
    return r.json()["tape_id"]


def close(a, b, rtol: float = 1e-10) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, float(np.abs(b).max(initial=0.0)))
    assert np.abs(a - b).max(initial=0.0) <= rtol * scale, (a, b)


@pytest.fixture(scope="module", params=["mean", "sum"])
def jacobian_pair(request, client):
    """(unsharded, sharded over 3 parts) tapes of the same data, with `reduction`."""
    program = MEAN if request.param == "mean" else SUM
    plain = record(client, program)
    sharded = record(client, program, shards=3, shard_reduction=request.param)
    assert [s["rows"] for s in ok(client.get(f"/v1/tapes/{sharded}"))["shards"]] == [4, 3, 3]
    yield plain, sharded
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape}")


def same_jacobian(client, plain: str, sharded: str, body: dict) -> dict:
    want = post(client, f"/v1/tapes/{plain}/jacobian", body)
    got = post(client, f"/v1/tapes/{sharded}/jacobian", body)
    close(arr(got["value"]), arr(want["value"]))
    if body.get("flat"):
        assert got["flat"]["order"] == want["flat"]["order"]
        close(arr(got["flat"]["jacobian"]), arr(want["flat"]["jacobian"]))
        return got
    assert set(got["jacobians"]) == set(want["jacobians"])
    for key, value in want["jacobians"].items():
        if value is None:
            assert got["jacobians"][key] is None, key
        else:
            close(arr(got["jacobians"][key]), arr(value))
    return got


@pytest.mark.parametrize(
    "body",
    [
        # The loss: the parts' jacobians weighted as gradients; over the split input x,
        # each part's rows.
        {"sources": ["w1", "b1", "x"]},
        # Per-example names: the parts' rows in order; over x, block diagonal.
        {"target": "out", "sources": ["w2", "x", "y"]},
        {"target": "err", "sources": {"a": "w1", "b": "y"}},
        {"target": "out", "sources": ["x"], "batch": True},
        {"target": "err", "sources": ["x", "y"], "batch": True},
        # A name that reads no split input: every part's is the unsharded one.
        {"target": "pen", "sources": ["w1", "x"]},
        {"target": "pen", "sources": ["w1", "x"], "unconnected": "zero"},
        # Flat matrices (SciPy's least_squares `jac`), full and per example.
        {"target": "out", "sources": ["w1", "b1", "w2"], "flat": True},
        {"target": "out", "sources": ["x"], "batch": True, "flat": True},
    ],
)
def test_sharded_jacobians_equal_unsharded(client, jacobian_pair, body) -> None:
    plain, sharded = jacobian_pair
    got = same_jacobian(client, plain, sharded, body)
    if body.get("target") == "out" and not body.get("batch") and not body.get("flat"):
        # The full jacobian over a split input: zero between different examples.
        dx = arr(got["jacobians"]["x"])
        assert dx.shape == (N, 2, N, 3)
        assert not dx[:4, :, 4:].any() and np.abs(dx[:4, :, :4]).max() > 0


@pytest.mark.parametrize(
    "body",
    [
        {"target": "out", "sources": ["w1", "x"]},  # the parts' added; x: each part's rows
        {"target": "err", "sources": ["b1", "y"], "unconnected": "zero"},
        {"target": "pen", "sources": ["w1", "x"]},  # any part's; x: unconnected
        {"target": "pen", "sources": ["w1", "x"], "unconnected": "zero"},
        {"sources": ["x", "w2"]},  # the loss over a split input: each part's rows, weighted
        {"target": "out", "sources": ["w1", "x"], "flat": True},
    ],
)
def test_sharded_gradients_of_any_target_equal_unsharded(client, jacobian_pair, body) -> None:
    plain, sharded = jacobian_pair
    want = post(client, f"/v1/tapes/{plain}/gradient", body)
    got = post(client, f"/v1/tapes/{sharded}/gradient", body)
    close(arr(got["value"]), arr(want["value"]))
    if body.get("flat"):
        assert got["flat"]["order"] == want["flat"]["order"]
        close(arr(got["flat"]["gradient"]), arr(want["flat"]["gradient"]))
        return
    assert set(got["gradients"]) == set(want["gradients"])
    for key, value in want["gradients"].items():
        if value is None:
            assert got["gradients"][key] is None, key
        else:
            close(arr(got["gradients"][key]), arr(value))


def test_a_gradient_of_a_name_that_mixes_the_examples_is_refused(client, jacobian_pair) -> None:
    _, sharded = jacobian_pair
    found = problem(client.post(f"/v1/tapes/{sharded}/gradient", json={"target": "hm"}), 422)
    assert "mixes the examples" in found["detail"], found
    assert found["errors"][0]["field"] == "target", found


def test_a_sharded_jacobian_as_a_job(client, jacobian_pair) -> None:
    plain, sharded = jacobian_pair
    body = {"target": "out", "sources": ["w1", "x"]}
    job = wait(
        client, start(client, f"/v1/tapes/{sharded}/jacobian", body), ("succeeded", "failed")
    )
    assert job["state"] == "succeeded", job
    want = post(client, f"/v1/tapes/{plain}/jacobian", body)
    for key in ("w1", "x"):
        close(arr(job["result"]["jacobians"][key]), arr(want["jacobians"][key]))


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"target": "hm"}, "target", "mixes the examples"),
        ({"target": "out", "sources": ["w1"], "batch": True}, "batch", "'w1' is not a split"),
        ({"target": "loss", "sources": ["x"], "batch": True}, "batch", "not along the batch"),
        ({"target": "nope"}, "target", "unknown target"),
    ],
)
def test_what_a_sharded_jacobian_refuses(client, jacobian_pair, body, field, words) -> None:
    _, sharded = jacobian_pair
    found = problem(client.post(f"/v1/tapes/{sharded}/jacobian", json=body), 422)
    assert words in found["detail"], found
    assert field in found["detail"] or any(
        field == e.get("field") for e in found.get("errors") or []
    ), found


def test_a_sharded_jacobian_past_the_size_limit_is_refused_at_the_full_size(client) -> None:
    """The limit (the test server's 200,000 elements) is the unsharded answer's: the
    parts' blocks (100 * 2 * 100 * 3 each) do not slip past it (200 * 2 * 200 * 3)."""
    x = np.random.default_rng(3).standard_normal((200, 3))
    d = {
        **definition(MEAN),
        "inputs": {"x": t(x, "float64"), "y": t(np.zeros((200, 2)), "float64")},
    }
    r = client.post("/v1/tapes", json={"definition": d, "target": "loss", "shards": 2})
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    try:
        found = problem(
            client.post(f"/v1/tapes/{tape}/jacobian", json={"target": "out", "sources": ["x"]}), 422
        )
        assert found["type"].endswith("too-large"), found
        assert "240,000 elements" in found["detail"], found
        # Per example it fits: 200 blocks of 2 x 3.
        per_example = post(
            client, f"/v1/tapes/{tape}/jacobian", {"target": "out", "sources": ["x"], "batch": True}
        )
        assert arr(per_example["jacobians"]["x"]).shape == (200, 2, 3)
    finally:
        client.delete(f"/v1/tapes/{tape}")


# ----------------------------------------------------------------------------------------
# Influence
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["mean", "sum"])
def influence_pair(request, client):
    program = INFLUENCE[request.param]
    plain = record(client, program, output="out")
    sharded = record(client, program, output="out", shards=3, shard_reduction=request.param)
    yield plain, sharded, request.param
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape}")


def same_influence(client, plain: str, sharded: str, body: dict) -> dict:
    # Solved to convergence: CG's unconverged iterates carry the sums' rounding, which
    # the parts' order of summation changes.
    body = {"tol": 1e-12, "max_iterations": 200, **body}
    want = post(client, f"/v1/tapes/{plain}/influence", body)
    got = post(client, f"/v1/tapes/{sharded}/influence", body)
    assert len(got["scores"]) == N
    close(got["scores"], want["scores"])
    close(got["removal"], want["removal"])
    close(got["test_loss"], want["test_loss"])
    for key in KEYS:
        close(arr(got["s_test"][key]), arr(want["s_test"][key]))
    for key in ("helpful", "harmful", "converged", "stopped", "curvature"):
        assert got[key] == want[key], key
    # The early residuals are the solve's arithmetic; the late ones, near tol = 1e-12, its
    # rounding, which the parts' order of summation changes: so the iteration that
    # first brings the residual under 1e-8 of the first is the same (or one off), while
    # the total may differ by a few (33 against 31 once the bias sums ran as GEMVs). One
    # HVP per iteration beyond the same start either way.
    close(got["residuals"][:5], want["residuals"][:5])
    assert abs(_reaching(got["residuals"], 1e-8) - _reaching(want["residuals"], 1e-8)) <= 1
    assert got["hvps"] - got["iterations"] == want["hvps"] - want["iterations"]
    return got


def _reaching(residuals: list[float], fraction: float) -> int:
    """The first iteration whose residual is under `fraction` of the first."""
    return next(i for i, r in enumerate(residuals) if r <= fraction * residuals[0])


X_TEST = rng.standard_normal((3, 3))
Y_TEST = rng.standard_normal((3, 2))


@pytest.mark.parametrize(
    "body",
    [
        {
            "test_inputs": {"x": t(X_TEST, "float64"), "y": t(Y_TEST, "float64")},
            "curvature": "ggn",
            "damping": 0.1,
        },
        # Training rows over every part, one twice: each part's loss on its own rows.
        {"rows": [0, 5, 9, 5], "curvature": "ggn", "damping": 0.1, "top_k": 3},
        {"rows": [7], "damping": 1.0},  # the Hessian, on the last part only
        {"rows": [1, 2], "curvature": "empirical_fisher", "damping": 0.5},
    ],
)
def test_sharded_influence_equals_unsharded(client, influence_pair, body) -> None:
    plain, sharded, reduction = influence_pair
    got = same_influence(client, plain, sharded, body)
    # The removal predicts the change of the whole loss: c = 1/N for a mean (not a
    # part's 1/n_k), 1 for a sum.
    c = -np.asarray(got["removal"]) / np.asarray(got["scores"])
    close(c, np.full(N, 1 / N if reduction == "mean" else 1.0), 1e-12)


def test_what_sharded_influence_refuses(client, influence_pair, jacobian_pair) -> None:
    _, sharded, _ = influence_pair
    found = problem(client.post(f"/v1/tapes/{sharded}/influence", json={"rows": [3, 10, -1]}), 422)
    assert "rows" in found["detail"] and "[10, -1]" in found["detail"], found
    assert "10 examples" in found["detail"], found
    found = problem(
        client.post(
            f"/v1/tapes/{sharded}/influence", json={"test_inputs": {"x": t(X_TEST, "float64")}}
        ),
        422,
    )
    assert "test_inputs" in found["detail"] and "'y'" in found["detail"], found
    # A tape recorded without `output`: the unsharded tape's refusal.
    _, no_output = jacobian_pair
    found = problem(client.post(f"/v1/tapes/{no_output}/influence", json={"rows": [1]}), 422)
    assert "output" in found["detail"], found


def test_a_killed_part_is_rebuilt_and_answers_the_same(server, client) -> None:
    """A part's worker killed: the next jacobian and influence record that part again
    and answer the same numbers."""
    sharded = record(client, INFLUENCE["mean"], output="out", shards=3)
    base = f"/v1/tapes/{sharded}"
    jac = {"target": "out", "sources": ["w2", "x"]}
    influence = {"rows": [2, 8], "curvature": "ggn", "damping": 0.1, "tol": 1e-12}
    try:
        before = post(client, f"{base}/jacobian", jac), post(client, f"{base}/influence", influence)
        info = ok(client.get(base))
        kill_worker(server, info["shards"][1]["worker"])
        after = post(client, f"{base}/jacobian", jac)
        for key in ("w2", "x"):
            close(arr(after["jacobians"][key]), arr(before[0]["jacobians"][key]), 1e-13)
        kill_worker(server, info["shards"][0]["worker"])  # the coordinator's
        again = post(client, f"{base}/influence", influence)
        close(again["scores"], before[1]["scores"], 1e-12)
        # The first part, recorded again, still reads its program's batch axis.
        again = post(client, f"{base}/jacobian", jac)
        close(arr(again["jacobians"]["x"]), arr(before[0]["jacobians"]["x"]), 1e-13)
        assert ok(client.get(base))["rebuilds"] == info["rebuilds"] + 3
    finally:
        client.delete(base)


def test_a_part_killed_mid_influence_is_asked_again(client, influence_pair) -> None:
    """A part's worker (not the coordinator's) killed while an influence solve runs
    across the shards: that part is recorded again and asked again, the run goes on,
    and the answer is the undisturbed one."""
    plain, sharded, _ = influence_pair
    base = f"/v1/tapes/{sharded}"
    # Past convergence on purpose (tol out of reach): long enough to be killed in.
    body = {
        "rows": [1, 6],
        "curvature": "ggn",
        "damping": 1.0,
        "tol": 1e-30,
        "max_iterations": 1500,
        "max_seconds": 50,
        "time_limit": 60,
    }
    info = ok(client.get(base))
    middle = info["shards"][1]["worker"]
    assert middle != info["shards"][0]["worker"]  # alone on its worker: not the coordinator
    location = start(client, f"{base}/influence", body)
    job = wait(client, location, ("running",))
    while not (job["progress"] or {}).get("done"):  # well into the solve
        job = client.get(location).json()
    assert job["state"] == "running", job
    # Not kill_worker: it waits for every worker to be idle, i.e. for the run to end.
    victim = next(w for w in client.get("/readyz").json()["workers"] if w["index"] == middle)
    os.kill(victim["pid"], signal.SIGKILL)
    job = wait(client, location, ("succeeded", "failed"), timeout=120)
    assert job["state"] == "succeeded", job
    assert ok(client.get(base))["shards"][1]["rebuilds"] == info["shards"][1]["rebuilds"] + 1
    want = post(client, f"/v1/tapes/{plain}/influence", body)
    close(job["result"]["scores"], want["scores"], 1e-10)
    close(job["result"]["removal"], want["removal"], 1e-10)
