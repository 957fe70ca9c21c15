"""Sharded tapes (issue 16): a batch split over the workers, each recording its part; the
loss, gradients, HVPs and the tapes' algorithms combine the parts and equal the
unsharded tape's answers (float64: to rounding). Real server, real workers."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from starlette.requests import Request

from engine.hessian_algorithms import budget as algorithm_budget
from engine.language.limits import Limits
from service.api.errors import pool_problem
from service.core import shm
from service.core.config import Settings
from service.pool import ComputeFailed
from service.worker import shards as worker_shards
from service.worker.compute import WorkerContext
from tests.engine.clock import FakeClock
from tests.service.conftest import start_server, stop_server
from tests.service.test_jobs import same_answer, start, wait, wait_for_progress
from tests.service.test_tape_workloads import kill_worker
from tests.service.wire import arr, num, ok, post, problem, t

rng = np.random.default_rng(16)
N = 11  # not divisible by 2 or 3: uneven parts
X = rng.standard_normal((N, 3))
Y = rng.standard_normal((N, 2))
W1 = rng.standard_normal((3, 4)) * 0.7
B1 = rng.standard_normal(4) * 0.1
W2 = rng.standard_normal((4, 2)) * 0.7

PROGRAM = [
    "h = tanh(x @ w1 + b1)",
    "out = h @ w2",
    "loss = mean((out - y) ** 2) + 0.01 * sum(w1 ** 2)",
]
SUM_PROGRAM = ["h = tanh(x @ w1 + b1)", "out = h @ w2", "loss = sum((out - y) ** 2)"]
KEYS = ("w1", "b1", "w2")
SHAPES = {"w1": (3, 4), "b1": (4,), "w2": (4, 2)}


def definition(program: list[str] = PROGRAM) -> dict:
    return {
        "variables": {"w1": t(W1, "float64"), "b1": t(B1, "float64"), "w2": t(W2, "float64")},
        "inputs": {"x": t(X, "float64"), "y": t(Y, "float64")},
        "program": program,
    }


def record(client, **extra) -> dict:
    body = {
        "definition": extra.pop("definition", None) or definition(extra.pop("program", PROGRAM)),
        "target": "loss",
        **extra,
    }
    r = client.post("/v1/tapes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def vectors(seed: int, k: int) -> list[dict[str, np.ndarray]]:
    g = np.random.default_rng(seed)
    return [{key: g.standard_normal(SHAPES[key]) for key in KEYS} for _ in range(k)]


def wire(v: dict[str, np.ndarray]) -> dict:
    return {key: t(value, "float64") for key, value in v.items()}


def close(a, b, rtol: float = 1e-11) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.abs(b).max(initial=0.0)))
    assert np.abs(a - b).max(initial=0.0) <= rtol * scale, (a, b)


def close_tensors(a: dict, b: dict, rtol: float = 1e-11) -> None:
    assert set(a) == set(b)
    for key, value in a.items():
        close(arr(value), arr(b[key]), rtol)


@pytest.fixture(scope="module")
def pair(client):
    """The same mean-loss tape unsharded and in 3 shards (11 = 4 + 4 + 3 examples)."""
    plain = record(client)
    sharded = record(client, shards=3, shard_by=["x", "y"])
    yield plain, sharded
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_sharded_loss_and_gradient_equal_unsharded(client, pair) -> None:
    plain, sharded = pair
    close(num(sharded["value"]), num(plain["value"]))
    close_tensors(sharded["gradients"], plain["gradients"])
    info = ok(client.get(f"/v1/tapes/{sharded['tape_id']}"))
    assert [s["rows"] for s in info["shards"]] == [4, 4, 3]
    assert info["shard_reduction"] == "mean" and info["shard_by"] == ["x", "y"]
    assert info["bytes"] == sum(s["bytes"] for s in info["shards"]) > 0
    # Distinct workers while there are enough (the test server has 2).
    assert {s["worker"] for s in info["shards"]} == {0, 1}
    # The parts are not tapes of their own in the caller's list.
    listed = [x["tape_id"] for x in ok(client.get("/v1/tapes"))["tapes"]]
    assert sharded["tape_id"] in listed and len(listed) == len(set(listed))
    again = post(client, f"/v1/tapes/{sharded['tape_id']}/gradient", {})
    close_tensors(again["gradients"], plain["gradients"])


def test_sharded_hvp_and_batched_hvps_equal_unsharded(client, pair) -> None:
    plain, sharded = pair
    vs = vectors(1, 4)
    for body in ({"vector": wire(vs[0])}, {"vectors": [wire(v) for v in vs]}):
        want = post(client, f"/v1/tapes/{plain['tape_id']}/hvp", body)
        got = post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", body)
        # How the passes ran is one worker's account: the sum of parts has none.
        assert got.get("execution") is None and want["execution"] is not None
        if "vector" in body:
            close_tensors(got["hvp"], want["hvp"])
        else:
            assert len(got["hvps"]) == 4
            for g, w in zip(got["hvps"], want["hvps"], strict=True):
                close_tensors(g, w)
    flat = {
        "flat_vector": t(np.concatenate([vs[1][k].ravel() for k in KEYS]), "float64"),
        "flat": True,
    }
    want = post(client, f"/v1/tapes/{plain['tape_id']}/hvp", flat)
    got = post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", flat)
    close(arr(got["flat"]["hvp"]), arr(want["flat"]["hvp"]))


def traffic(client) -> dict[str, float]:
    """The pool's array bytes so far, by route (GET /metrics)."""
    found = {"to_workers": 0.0, "from_workers": 0.0, "between_workers": 0.0}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("gradtape_pool_array_bytes_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            found[route] = float(line.rsplit(" ", 1)[1])
    return found


def hvp_traffic(client, pair) -> tuple[int, dict[str, float], dict[str, float]]:
    """(the bytes of 4 vectors, the unsharded tape's HVP traffic, the sharded one's),
    both answers checked equal. The sharded tape's parts lie on workers a, b, a: the
    coordinator's worker holds two of the three parts."""
    plain, sharded = pair
    body = {"vectors": [wire(v) for v in vectors(7, 4)]}
    size = 4 * 8 * sum(int(np.prod(SHAPES[k])) for k in KEYS)  # float64
    deltas, answers = [], []
    for tape in (plain, sharded):
        # Recorded again first if an earlier test's kill took it (its definition travels).
        post(client, f"/v1/tapes/{tape['tape_id']}/gradient", {})
        before = traffic(client)
        answers.append(post(client, f"/v1/tapes/{tape['tape_id']}/hvp", body)["hvps"])
        after = traffic(client)
        deltas.append({k: after[k] - before[k] for k in after})
    for g, w in zip(*answers, strict=True):
        close_tensors(g, w)
    return size, deltas[0], deltas[1]


def test_local_pool_routes_the_off_coordinator_parts_answer_once(client, pair) -> None:
    """The local pool keeps the answer of the part off the coordinator's worker here and
    sends it on with the sum (bench/RESULTS.md: a handoff between workers did not pay on
    one host); the coordinator's own two parts never travel. /metrics counts it."""
    size, plain, sharded = hvp_traffic(client, pair)
    assert plain == {"to_workers": size, "from_workers": size, "between_workers": 0}
    # In: the vectors to each part, the kept part's answer to the sum; out: the kept
    # part's answer and the sum.
    assert sharded == {"to_workers": 4 * size, "from_workers": 2 * size, "between_workers": 0}


def test_sharded_algorithms_equal_unsharded(client, pair) -> None:
    plain, sharded = pair
    for path, body, pick in (
        ("eigenvalues", {"k": 3, "tol": 1e-10, "max_hvps": 60}, lambda r: r["eigenvalues"]),
        ("trace", {"method": "exact"}, lambda r: r["trace"]),
        ("trace", {"method": "hutchinson", "max_hvps": 32, "seed": 3}, lambda r: r["trace"]),
        (
            "solve",
            {"damping": 0.5, "tol": 1e-12},
            lambda r: np.concatenate([arr(r["solution"][k]).ravel() for k in KEYS]),
        ),
        (
            "diagonal",
            {"method": "exact"},
            lambda r: np.concatenate([arr(r["diagonal"][k]).ravel() for k in KEYS]),
        ),
        ("spectral-density", {"probes": 2, "steps": 6, "points": 16}, lambda r: r["density"]),
    ):
        want = post(client, f"/v1/tapes/{plain['tape_id']}/{path}", body)
        got = post(client, f"/v1/tapes/{sharded['tape_id']}/{path}", body)
        close(pick(got), pick(want), 1e-9)
        assert got["hvps"] == want["hvps"], path


def test_curvature_products_and_eigenvalues_equal_unsharded(client) -> None:
    """With the model's output named, the Gauss-Newton and empirical Fisher products
    (1/N sum_i g_i g_i^T v: the parts' own 1/n_i reweighted by n_i / N) and an algorithm
    on the GGN equal the unsharded tape's."""
    program = ["h = tanh(x @ w1 + b1)", "out = h @ w2", "loss = mean((out - y) ** 2)"]
    plain = record(client, program=program, output="out")
    sharded = record(client, program=program, output="out", shards=3)
    vs = [wire(v) for v in vectors(13, 2)]
    for curvature in ("ggn", "empirical_fisher"):
        body = {"vectors": vs, "curvature": curvature}
        want = post(client, f"/v1/tapes/{plain['tape_id']}/hvp", body)["hvps"]
        got = post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", body)["hvps"]
        for g, w in zip(got, want, strict=True):
            close_tensors(g, w)
    body = {"k": 2, "curvature": "ggn", "tol": 1e-10, "max_hvps": 60}
    close(
        post(client, f"/v1/tapes/{sharded['tape_id']}/eigenvalues", body)["eigenvalues"],
        post(client, f"/v1/tapes/{plain['tape_id']}/eigenvalues", body)["eigenvalues"],
        1e-9,
    )
    # A sharded tape's answers state their curvature as the unsharded one's do.
    body = {"method": "exact", "curvature": "fisher", "samples": 3, "fisher_seed": 1}
    answers = [
        post(client, f"/v1/tapes/{tape['tape_id']}/trace", body) for tape in (plain, sharded)
    ]
    for answer in answers:
        used = answer["curvature_used"]
        assert (used["kind"], used["samples"], used["approximate"]) == ("fisher", 3, True)
    # ... but each part draws its own targets from that seed: not the unsharded tape's
    # sampled matrix (another trace), which the sharded answer says and the other does not.
    assert answers[1]["trace"] != pytest.approx(answers[0]["trace"], rel=1e-6)
    assert "on this tape's 3 parts" in answers[1]["curvature_used"]["reason"]
    assert "parts" not in answers[0]["curvature_used"]["reason"]
    hvp = {"vector": vs[0], "curvature": "fisher", "samples": 3, "fisher_seed": 1}
    product = post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", hvp)["curvature_used"]
    assert "on this tape's 3 parts" in product["reason"]
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_sum_reduction_and_two_shards(client) -> None:
    plain = record(client, program=SUM_PROGRAM)
    sharded = record(client, program=SUM_PROGRAM, shards=2, shard_reduction="sum")
    close(num(sharded["value"]), num(plain["value"]))
    close_tensors(sharded["gradients"], plain["gradients"])
    v = {"vector": wire(vectors(2, 1)[0])}
    close_tensors(
        post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", v)["hvp"],
        post(client, f"/v1/tapes/{plain['tape_id']}/hvp", v)["hvp"],
    )
    # Without shard_reduction the program's sum is read, never a mean's silent half
    # (tests/service/test_shard_reduction.py: what is read, and what is refused).
    read = record(client, program=SUM_PROGRAM, shards=2)
    close(num(read["value"]), num(plain["value"]))
    for tape in (plain, sharded, read):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_a_killed_shard_is_rebuilt_alone(server, client, pair) -> None:
    _, sharded = pair
    base = f"/v1/tapes/{sharded['tape_id']}"
    v = {"vectors": [wire(x) for x in vectors(5, 2)]}
    before = post(client, f"{base}/hvp", v)
    eigen = {"k": 2, "tol": 1e-10, "max_hvps": 60}
    top = post(client, f"{base}/eigenvalues", eigen)
    info = ok(client.get(base))

    def rebuilt_since(old: dict) -> list[int]:
        now = ok(client.get(base))
        return [
            s["rebuilds"] - s0["rebuilds"]
            for s, s0 in zip(now["shards"], old["shards"], strict=True)
        ]

    # The middle part is alone on its worker (parts on a, b, a): only it is recorded again.
    workers = [s["worker"] for s in info["shards"]]
    assert workers[0] == workers[2] != workers[1], workers
    kill_worker(server, workers[1])
    after = post(client, f"{base}/hvp", v)
    for g, w in zip(after["hvps"], before["hvps"], strict=True):
        close_tensors(g, w, 1e-13)
    assert rebuilt_since(info) == [0, 1, 0]
    # The coordinator's worker (holding parts 0 and 2): they are recorded again, and an
    # algorithm across the shards gives the same numbers.
    middle = ok(client.get(base))
    kill_worker(server, workers[0])
    again = post(client, f"{base}/eigenvalues", eigen)
    close(again["eigenvalues"], top["eigenvalues"], 1e-12)
    assert rebuilt_since(middle) == [1, 0, 1]
    assert ok(client.get(base))["rebuilds"] == info["rebuilds"] + 3


def test_sharded_tape_over_a_stored_dataset(client) -> None:
    r = client.put("/v1/datasets/shard-batch", json={"X": t(X, "float64"), "Y": t(Y, "float64")})
    assert r.status_code in (200, 201), r.text
    program = ["h = tanh(X @ w1 + b1)", "out = h @ w2", "loss = mean((out - Y) ** 2)"]
    variables = definition()["variables"]
    rows = {"start": 1, "stop": 11, "step": 1}
    inline = {
        "variables": variables,
        "program": program,
        "inputs": {"X": t(X[1:], "float64"), "Y": t(Y[1:], "float64")},
    }
    bound = {
        "variables": variables,
        "program": program,
        "inputs": {"dataset": "shard-batch", "rows": rows},
    }
    plain = record(client, definition=inline)
    sharded = record(client, definition=bound, shards=3)
    close(num(sharded["value"]), num(plain["value"]))
    close_tensors(sharded["gradients"], plain["gradients"])
    v = {"vector": wire(vectors(7, 1)[0])}
    close_tensors(
        post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", v)["hvp"],
        post(client, f"/v1/tapes/{plain['tape_id']}/hvp", v)["hvp"],
    )
    assert [s["rows"] for s in ok(client.get(f"/v1/tapes/{sharded['tape_id']}"))["shards"]] == [
        4,
        3,
        3,
    ]
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_patch_updates_every_shard(client) -> None:
    plain = record(client)
    sharded = record(client, shards=2)
    new = {"variables": {"w2": t(W2 * 0.5, "float64")}}
    want = ok(client.patch(f"/v1/tapes/{plain['tape_id']}", json=new))
    got = ok(client.patch(f"/v1/tapes/{sharded['tape_id']}", json=new))
    close(num(got["value"]), num(want["value"]))
    close_tensors(got["gradients"], want["gradients"])
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_deleting_a_sharded_tape(client) -> None:
    sharded = record(client, shards=2)
    assert client.delete(f"/v1/tapes/{sharded['tape_id']}").status_code == 204
    problem(client.get(f"/v1/tapes/{sharded['tape_id']}"), 404)
    problem(
        client.post(f"/v1/tapes/{sharded['tape_id']}/hvp", json={"vector": wire(vectors(1, 1)[0])}),
        404,
    )


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"shards": 0}, "shards", "greater than or equal to 1"),
        ({"shards": 12}, "shards", "at most 11"),
        ({"shards": 100000}, "shards", "max_shards"),
        ({"shards": 2, "shard_by": ["x", "nope"]}, "shard_by", "no input 'nope'"),
        ({"shards": 2, "shard_reduction": "median"}, "shard_reduction", "mean"),
        ({"shard_by": ["x"]}, "", "need 'shards'"),
    ],
)
def test_validation(client, extra, field, words) -> None:
    body = {"definition": definition(), "target": "loss", **extra}
    found = problem(client.post("/v1/tapes", json=body), 422)
    assert words in found["detail"] or any(
        words in e.get("message", "") for e in found.get("errors") or []
    ), found
    if field:
        assert field in found["detail"] or any(
            field in str(e.get("field", e.get("loc"))) for e in found.get("errors") or []
        ), found


def test_axes_must_agree_and_scalars_cannot_split(client) -> None:
    d = definition()
    d["inputs"]["z"] = t(np.ones(5), "float64")
    d["inputs"]["s"] = t(2.0, "float64")
    found = problem(
        client.post("/v1/tapes", json={"definition": d, "target": "loss", "shards": 2}), 422
    )
    assert "shard_by" in found["detail"] and "'z': 5" in found["detail"], found
    found = problem(
        client.post(
            "/v1/tapes",
            json={"definition": d, "target": "loss", "shards": 2, "shard_by": ["x", "s"]},
        ),
        422,
    )
    assert "'s' is a scalar" in found["detail"], found
    # Naming the batch inputs splits them only.
    ok_tape = record(client, definition=d, shards=2, shard_by=["x", "y"])
    client.delete(f"/v1/tapes/{ok_tape['tape_id']}")


def test_gradients_of_other_targets_and_split_inputs(client, pair) -> None:
    """Another target's gradient (the output's: the parts' added) and the loss's over a
    split input (each part's rows, weighted n_i / N) equal the unsharded tape's; more in
    test_tape_shard_pieces.py."""
    plain, sharded = pair
    for body in (
        {"target": "out"},
        {"sources": ["x", "w1"]},
        {"target": "out", "sources": {"a": "x", "b": "b1"}},
    ):
        want = post(client, f"/v1/tapes/{plain['tape_id']}/gradient", body)
        got = post(client, f"/v1/tapes/{sharded['tape_id']}/gradient", body)
        close(arr(got["value"]), arr(want["value"]))
        close_tensors(got["gradients"], want["gradients"])


def test_a_sharded_tape_survives_a_restart(tmp_path) -> None:
    """The store keeps the sharded tape and its parts: after a restart each part is
    recorded again on first use and the answers are the same."""
    settings = {"GRADTAPE_DATA_DIR": str(tmp_path / "data")}
    log = tmp_path / "server.log"
    v = {"vector": wire(vectors(9, 1)[0])}
    srv = start_server(settings, log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            sharded = record(c, shards=2, ttl=600.0)
            base = f"/v1/tapes/{sharded['tape_id']}"
            hvp = post(c, f"{base}/hvp", v)["hvp"]
            trace = post(c, f"{base}/trace", {"method": "exact"})["trace"]
            assert "gradtape_tapes 1.0" in c.get("/metrics").text  # the parts not counted
    finally:
        stop_server(srv)
    srv = start_server(settings, log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            about = ok(c.get(base))
            assert not about["loaded"] and [s["rows"] for s in about["shards"]] == [6, 5]
            close_tensors(post(c, f"{base}/hvp", v)["hvp"], hvp, 1e-14)
            close(post(c, f"{base}/trace", {"method": "exact"})["trace"], trace, 1e-14)
            about = ok(c.get(base))
            assert about["loaded"] and [s["rebuilds"] for s in about["shards"]] == [1, 1]
            assert [x["tape_id"] for x in ok(c.get("/v1/tapes"))["tapes"]] == [sharded["tape_id"]]
    finally:
        stop_server(srv)


def test_stateless_requests_with_shards(client) -> None:
    """POST /v1/gradient and /v1/hvp with shards: temporary shards, the same answers."""
    held = len(ok(client.get("/v1/tapes"))["tapes"])
    body = {"definition": definition(), "target": "loss"}
    want = post(client, "/v1/gradient", body)
    got = post(client, "/v1/gradient", {**body, "shards": 3})
    close(num(got["value"]), num(want["value"]))
    close_tensors(got["gradients"], want["gradients"])
    vs = [wire(v) for v in vectors(11, 3)]
    want = post(client, "/v1/hvp", {**body, "vectors": vs})
    got = post(client, "/v1/hvp", {**body, "vectors": vs, "shards": 2, "shard_by": ["x", "y"]})
    close(num(got["value"]), num(want["value"]))
    close_tensors(got["gradients"], want["gradients"])
    for g, w in zip(got["hvps"], want["hvps"], strict=True):
        close_tensors(g, w)
    flat = {**body, "vector": vs[0], "flat": True}
    want = post(client, "/v1/hvp", flat)
    got = post(client, "/v1/hvp", {**flat, "shards": 2})
    close(arr(got["flat"]["hvp"]), arr(want["flat"]["hvp"]))
    close(arr(got["flat"]["gradient"]), arr(want["flat"]["gradient"]))
    assert got["flat"]["order"] == want["flat"]["order"]
    assert len(ok(client.get("/v1/tapes"))["tapes"]) == held  # nothing left behind
    found = problem(client.post("/v1/gradient", json={**body, "shards": 40}), 422)
    assert "shards" in found["detail"] and "at most 11" in found["detail"]


def test_a_sharded_job_reports_progress_and_is_cancelled_whole(
    client, pair, run_limits: tuple[float, float]
) -> None:
    """An algorithm across the shards as a job: progress on the way, the synchronous
    answer at the end; a cancelled one stops its fan-out and leaves the tape as it was."""
    _, sharded = pair
    base = f"/v1/tapes/{sharded['tape_id']}"
    # Seeded and run to max_hvps, never cut by time (run_limits), so that the job and the
    # synchronous run answer the same: on Ray with the suite in parallel at load 15, 300
    # HVPs took over 60 s, and the two runs stopped at 115 and 91 products.
    body = {
        "method": "hutchinson",
        "max_hvps": 300,
        "batch_size": 1,
        "seed": 4,
        "max_seconds": run_limits[0],
        "time_limit": run_limits[1],
    }
    location = start(client, f"{base}/trace", body)
    seen = []
    job = client.get(location).json()
    while job["state"] in ("queued", "running"):
        if job["progress"] is not None:
            seen.append(job["progress"])
        time.sleep(0.02)
        job = client.get(location).json()
    assert job["state"] == "succeeded", job
    assert seen and all(p["unit"] == "hvps" and p["total"] == 300 for p in seen), seen
    same_answer(job["result"], post(client, f"{base}/trace", body))
    v = {"vector": wire(vectors(3, 1)[0])}
    before = post(client, f"{base}/hvp", v)
    long = {**body, "max_hvps": 4000, "max_seconds": 120, "time_limit": 60}
    location = start(client, f"{base}/trace", long)
    wait_for_progress(client, location)  # under way across the shards: an event, not a sleep
    assert client.delete(location).status_code == 204
    assert client.get(location).json()["state"] == "cancelled"
    close_tensors(post(client, f"{base}/hvp", v)["hvp"], before["hvp"], 0)


@pytest.fixture
def run_limits() -> tuple[float, float]:
    """(max_seconds, time_limit) of a run that must not be cut short: the server's most
    (tests/service/conftest: 60 s); test_ray's servers allow more, and restarting a Ray
    actor on a loaded machine takes tens of seconds."""
    return 50.0, 60.0


def test_a_coordinator_lost_mid_run_starts_the_run_again(
    server, client, pair, run_limits: tuple[float, float]
) -> None:
    """The coordinator's worker killed while an algorithm runs across the shards: the run
    starts again from scratch (its parts there recorded again) and, seeded, answers what
    an undisturbed run answers."""
    _, sharded = pair
    base = f"/v1/tapes/{sharded['tape_id']}"
    # Long enough to be killed mid-run (a second or two on a quiet machine), short enough
    # that the first part, the run again and the synchronous run fit the time limits ten
    # times over on a loaded one: neither max_seconds nor the time limit cuts it.
    body = {
        "method": "hutchinson",
        "max_hvps": 400,
        "batch_size": 1,
        "seed": 8,
        "max_seconds": run_limits[0],
        "time_limit": run_limits[1],
    }
    location = start(client, f"{base}/trace", body)
    coordinator = ok(client.get(base))["shards"][0]["worker"]
    job = wait(client, location, ("running",))
    while not (job["progress"] or {}).get("done"):  # well into the run
        job = client.get(location).json()
    assert job["state"] == "running", job
    # Not kill_worker: it waits for every worker to be idle, i.e. for the run to end.
    victim = next(w for w in client.get("/readyz").json()["workers"] if w["index"] == coordinator)
    os.kill(victim["pid"], signal.SIGKILL)
    job = wait(client, location, ("succeeded", "failed"), timeout=2 * run_limits[1])
    assert job["state"] == "succeeded", job.get("error") or job
    same_answer(job["result"], post(client, f"{base}/trace", body))


def test_a_sharded_tape_is_evicted_whole(client, tmp_path) -> None:
    """A part evicted for a newer tape's room takes its sharded tape with it: the id
    answers 404 tape-evicted, never a tape missing one of its parts."""
    probe = record(client, shards=2)
    part = max(s["bytes"] for s in ok(client.get(f"/v1/tapes/{probe['tape_id']}"))["shards"])
    client.delete(f"/v1/tapes/{probe['tape_id']}")
    # Room for one part per worker, not two.
    settings = {
        "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
        "GRADTAPE_TAPE_MEMORY_BUDGET": str(int(part * 1.5)),
        "GRADTAPE_REQUEST_MEMORY_BUDGET": str(64 * 2**20),
    }
    srv = start_server(settings, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            old = record(c, shards=2)
            new = record(c, shards=2)
            gone = problem(
                c.post(f"/v1/tapes/{old['tape_id']}/hvp", json={"vector": wire(vectors(1, 1)[0])}),
                404,
            )
            assert gone["type"].endswith("tape-evicted"), gone
            assert [t["tape_id"] for t in ok(c.get("/v1/tapes"))["tapes"]] == [new["tape_id"]]
            post(c, f"/v1/tapes/{new['tape_id']}/hvp", {"vector": wire(vectors(1, 1)[0])})
    finally:
        stop_server(srv)


def test_a_sharded_algorithm_stops_within_its_time(client, pair) -> None:
    """max_seconds across the shards, end to end: the run stops at its time and answers
    what it has. How soon it stops, waits for the parts included, is shown on an
    injected clock below (no wall-clock bound here). (Its `seconds` are the algorithm's
    own, which start after the request's first moments: they may fall short of 0.5.)"""
    _, sharded = pair
    body = {"method": "hutchinson", "max_hvps": 5000, "batch_size": 1, "max_seconds": 0.5}
    got = post(client, f"/v1/tapes/{sharded['tape_id']}/trace", body)
    assert got["stopped"] == "time_limit" and 0 < got["hvps"] < 5000, got
    assert not got["converged"], got
    assert np.isfinite(got["trace"])


def test_a_sharded_runs_time_counts_its_waits_for_the_parts(monkeypatch) -> None:
    """The coordinator's run on an injected clock (the budgets' clock, which the worker's
    request time is counted on too): the parts take 0.2 s to send each product, so a
    0.5 s max_seconds stops the run at the first check past it, after the third product,
    on a quiet or a loaded machine alike (issue 27, item 13). The answer is the
    Hutchinson mean of what was seen, against the matrix itself."""
    clock = FakeClock()
    monkeypatch.setattr(algorithm_budget, "clock", clock)
    context = _worker_context()
    a = np.diag([1.0, 2.0, 3.0])
    options = {"method": "hutchinson", "max_hvps": 5000, "batch_size": 1, "max_seconds": 0.5}
    reply = worker_shards.shard_run(
        {
            "run": "timed",
            "layout": [["w", [3], "float64"]],
            "kind": "tape_trace",
            "payload": {"options": options},
        },
        context,
    )
    products = 0
    while reply["run"] is not None:
        asked = np.stack([need["w"] for need in reply["need"]])
        clock.advance(0.2)  # the parts computing: the coordinator waits
        products += 1
        reply = worker_shards.shard_step(
            {"run": "timed", "parts": [asked @ a], "weights": [1.0]}, context
        )
    answer = reply["answer"]
    assert (answer["stopped"], answer["hvps"], products) == ("time_limit", 3, 3), answer
    assert answer["seconds"] == pytest.approx(0.6) and not answer["converged"]
    # Rademacher probes z: z^T A z is the trace of a diagonal A, whatever z is.
    assert answer["trace"] == pytest.approx(6.0)


@pytest.mark.parametrize("shard_by", [None, ["x", "y"]])
def test_a_split_input_is_refused_as_a_source(client, shard_by) -> None:
    """The gradient over a split input has each part's rows, never a sum of the parts':
    refused (422 naming sources and the input) wherever the sources are given."""
    held = len(ok(client.get("/v1/tapes"))["tapes"])
    split = {"shards": 2, **({"shard_by": shard_by} if shard_by else {})}
    body = {"definition": definition(), "target": "loss", "sources": ["x", "w1"], **split}
    v = {"x": t(X, "float64"), "w1": t(W1, "float64")}
    for path, extra in (
        ("/v1/tapes", {}),
        ("/v1/gradient", {}),
        ("/v1/hvp", {"vector": v}),
        ("/v1/tapes", {"sources": {"a": "w1", "b": "x"}}),
    ):
        found = problem(client.post(path, json={**body, **extra}), 422)
        assert "sources" in found["detail"] and "'x' is split" in found["detail"], found
        assert found["errors"][0]["field"] == "sources", found
    assert len(ok(client.get("/v1/tapes"))["tapes"]) == held  # no parts left behind
    # An input that is not split is an ordinary source: its gradient is the parts' sum.
    d = definition()
    d["inputs"]["c"] = t(np.array(0.3), "float64")
    d["program"] = [*PROGRAM[:-1], "loss = mean((out - y) ** 2) * c"]
    plain = post(
        client, "/v1/gradient", {"definition": d, "target": "loss", "sources": ["c", "w1"]}
    )
    sharded = post(
        client,
        "/v1/gradient",
        {"definition": d, "target": "loss", "sources": ["c", "w1"], "shards": 3},
    )
    close_tensors(sharded["gradients"], plain["gradients"])


def test_a_patch_failing_on_one_shard_changes_none(client) -> None:
    """A PATCH whose new values make one part's loss non-finite fails whole: every part
    keeps its old values, and the sharded tape answers as the unsharded one still does."""
    x = np.array([[1.0], [1.0], [-1.0], [-1.0]])  # the second part holds the negatives
    d = {
        "variables": {"w": t(np.array([0.1]), "float64")},
        "inputs": {"x": t(x, "float64")},
        "program": ["loss = mean(log(1.0 + x @ w))"],
    }
    plain = record(client, definition=d)
    sharded = record(client, definition=d, shards=2)
    bad = {"variables": {"w": t(np.array([2.0]), "float64")}}  # log(1 - 2) on part 2
    for tape in (plain, sharded):
        found = problem(client.patch(f"/v1/tapes/{tape['tape_id']}", json=bad), 422)
        assert "non-finite" in found["type"], found
    want = post(client, f"/v1/tapes/{plain['tape_id']}/gradient", {})
    got = post(client, f"/v1/tapes/{sharded['tape_id']}/gradient", {})
    close(num(got["value"]), num(want["value"]))
    close_tensors(got["gradients"], want["gradients"])
    v = {"vector": {"w": t(np.array([1.0]), "float64")}}
    close_tensors(
        post(client, f"/v1/tapes/{sharded['tape_id']}/hvp", v)["hvp"],
        post(client, f"/v1/tapes/{plain['tape_id']}/hvp", v)["hvp"],
    )
    # ...and a good PATCH afterwards still updates every part.
    good = {"variables": {"w": t(np.array([0.4]), "float64")}}
    want = ok(client.patch(f"/v1/tapes/{plain['tape_id']}", json=good))
    got = ok(client.patch(f"/v1/tapes/{sharded['tape_id']}", json=good))
    close(num(got["value"]), num(want["value"]))
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_stateless_shards_are_out_of_the_quotas_and_the_store(tmp_path) -> None:
    """A stateless sharded request records no stored tape: a key at its tape quota may
    make one, and the store holds no row (live or tombstone) and no definition after."""
    settings = {"GRADTAPE_DATA_DIR": str(tmp_path / "data"), "GRADTAPE_MAX_TAPES_PER_KEY": "1"}
    srv = start_server(settings, tmp_path / "server.log")
    db = tmp_path / "data" / "gradtape.sqlite3"

    def rows() -> tuple[int, int]:
        with sqlite3.connect(db) as con:
            return (
                con.execute("SELECT count(*) FROM tapes").fetchone()[0],
                con.execute("SELECT count(*) FROM definitions").fetchone()[0],
            )

    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            tape = record(c)
            found = problem(
                c.post("/v1/tapes", json={"definition": definition(), "target": "loss"}), 429
            )
            assert "max_tapes_per_key" in found["detail"]
            before = rows()
            body = {"definition": definition(), "target": "loss"}
            want = post(c, "/v1/gradient", body)
            got = post(c, "/v1/gradient", {**body, "shards": 2})
            close_tensors(got["gradients"], want["gradients"])
            vs = [wire(v) for v in vectors(5, 2)]
            want = post(c, "/v1/hvp", {**body, "vectors": vs})
            got = post(c, "/v1/hvp", {**body, "vectors": vs, "shards": 2})
            for g, w in zip(got["hvps"], want["hvps"], strict=True):
                close_tensors(g, w)
            problem(c.post("/v1/gradient", json={**body, "target": "out", "shards": 2}), 422)
            assert rows() == before
            # The stored tape is untouched and still the key's only one.
            assert [x["tape_id"] for x in ok(c.get("/v1/tapes"))["tapes"]] == [tape["tape_id"]]
            post(c, f"/v1/tapes/{tape['tape_id']}/gradient", {})
    finally:
        stop_server(srv)


def test_a_non_scalar_target_with_shards_says_so(client) -> None:
    d = definition()
    d["program"] = [*PROGRAM[:-1], "s = sum(out, axis=1)"]
    for path in ("/v1/tapes", "/v1/gradient"):
        found = problem(client.post(path, json={"definition": d, "target": "s", "shards": 2}), 422)
        assert "sharded" in found["detail"] and "'s'" in found["detail"], found
        assert "a tape's target" not in found["detail"], found


def _worker_context() -> WorkerContext:
    return WorkerContext(
        index=0,
        device="cpu",
        limits=Limits(),
        chunk_size=64,
        hessian_max_size=100,
        jacobian_max_elements=1000,
    )


def test_the_coordinators_stash_keeps_every_pending_answer(monkeypatch) -> None:
    """Many requests' parts kept at once (more than the 32 a count bound kept): none is
    lost before its sum; past the byte bound a part's answer is sent back instead, and
    the sum takes it as well."""
    context = _worker_context()
    answers = [
        {
            "value": np.array(float(i)),
            "gradients": {"w": np.full(3, float(i))},
            "tape": {"bytes": 1},
        }
        for i in range(80)
    ]
    kept = [worker_shards.stash(context, f"req{i}:0", dict(a)) for i, a in enumerate(answers)]
    assert all("stashed" in k for k in kept)
    for i in (0, 40, 79):  # the oldest too
        summed = worker_shards.shard_combine(
            {
                "parts": [kept[i], {"value": np.array(1.0), "gradients": {"w": np.ones(3)}}],
                "weights": [0.5, 0.5],
            },
            context,
        )
        assert float(summed["value"]) == (i + 1) / 2
        close(summed["gradients"]["w"], np.full(3, (i + 1) / 2))
    worker_shards.shard_drop({"stash": [f"req{i}:0" for i in range(80)]}, context)
    assert not context.state["shard_stash"]
    monkeypatch.setattr(worker_shards, "STASH_MOST_BYTES", 100)
    big = {"value": np.array(2.0), "gradients": {"w": np.ones(20)}, "tape": {"bytes": 1}}
    sent = worker_shards.stash(context, "big:0", big)
    assert "stashed" not in sent and not context.state["shard_stash"]
    summed = worker_shards.shard_combine({"parts": [sent, sent], "weights": [1.0, 1.0]}, context)
    close(summed["gradients"]["w"], np.full(20, 2.0))


def test_an_idle_sharded_run_leaves_the_worker(monkeypatch) -> None:
    """A run whose caller never sends the products it needs stops after
    RUN_IDLE_SECONDS and is no longer among the worker's runs."""
    monkeypatch.setattr(worker_shards, "RUN_IDLE_SECONDS", 0.05)
    context = _worker_context()
    runs = worker_shards._runs(context)
    run = worker_shards.Run("idle", [["w", [3], "float64"]], runs)
    runs[run.id] = run
    run.start(lambda flat: {"product": flat.matvec(np.ones((1, 3)))})
    deadline = time.monotonic() + 120  # a guard against a hang: the run's thread decides
    while runs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runs == {}
    assert run.next_event()[0] == "need"
    event, error = run.next_event()
    assert event == "error" and isinstance(error, worker_shards.RunDropped)


def test_a_lost_shard_state_is_a_503_to_retry() -> None:
    """A coordinator that lost a request's state twice over: 503 with Retry-After (the
    request was fine; asking again works), never a 500."""
    settings = Settings()
    app = SimpleNamespace(state=SimpleNamespace(settings=settings))
    request = Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/v1/gradient",
            "headers": [],
            "query_string": b"",
            "app": app,
        }
    )
    response = pool_problem(
        request,
        ComputeFailed({"type": "shard-state-lost", "message": "worker 0 holds no sharded run r1"}),
    )
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(settings.retry_after)
    assert response.headers["Content-Type"] == "application/problem+json"
    assert b"holds no sharded run" in response.body


def test_the_pools_kept_answers_are_gathered_once_released_and_lost_clearly() -> None:
    """The pool protocol under the sums (service/pool/base.py), on a real local pool of
    two workers: an answer kept from worker 1 (arrays past the shared-memory threshold)
    is summed in worker 0 when gathered; gathered twice, released, or never kept: the
    request fails with shard-state-lost (the sharded tape then asks its parts again);
    nothing is left in /dev/shm."""
    import asyncio

    from service.pool import KEEP, KEPT_LOST
    from service.pool.local import WorkerPool

    big = np.arange(50_000, dtype=np.float64)  # 400 KB: through the workers' arenas

    def part(scale: float) -> dict:
        return {
            "parts": [{"value": np.array(scale), "gradients": {"w": big * scale}}],
            "weights": [1.0],
        }

    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=2))
        await pool.start()
        try:
            kept = await pool.submit("shard_combine", {**part(2.0), KEEP: "a"}, worker=1)
            assert kept.result == {"stashed": "a", "kept": True}
            summed = await pool.submit(
                "shard_combine",
                {"parts": [{"stashed": "a"}, part(1.0)["parts"][0]], "weights": [0.5, 0.5]},
                worker=0,
                gather=["a"],
            )
            assert float(summed.result["value"]) == 1.5
            np.testing.assert_array_equal(summed.result["gradients"]["w"], big * 1.5)
            for keys in (["a"], ["never"]):  # gathered already; never kept
                with pytest.raises(ComputeFailed) as lost:
                    await pool.submit(
                        "shard_combine",
                        {"parts": [{"stashed": keys[0]}], "weights": [1.0]},
                        worker=0,
                        gather=keys,
                    )
                assert lost.value.error["type"] == KEPT_LOST
            await pool.submit("shard_combine", {**part(3.0), KEEP: "b"}, worker=1)
            pool.release(["b", "unknown"])
            with pytest.raises(ComputeFailed) as lost:
                await pool.submit(
                    "shard_combine",
                    {"parts": [{"stashed": "b"}], "weights": [1.0]},
                    worker=0,
                    gather=["b"],
                )
            assert lost.value.error["type"] == KEPT_LOST
            # A kept answer's error is answered as ever, and nothing is kept.
            with pytest.raises(ComputeFailed) as failed:
                await pool.submit(
                    "shard_combine",
                    {"parts": [{"stashed": "nowhere"}], "weights": [1.0], KEEP: "c"},
                    worker=1,
                )
            assert failed.value.error["type"] == KEPT_LOST  # the worker's own: no stash
            assert "c" not in pool._kept
            # Stashed by its worker itself (the coordinator's own part): not kept again;
            # the sum in that worker finds it there.
            own = await pool.submit(
                "shard_combine", {**part(4.0), KEEP: "d", "stash": "d"}, worker=0
            )
            assert own.result == {"stashed": "d", "tape": None} and "d" not in pool._kept
            summed = await pool.submit(
                "shard_combine", {"parts": [{"stashed": "d"}], "weights": [0.25]}, worker=0
            )
            np.testing.assert_array_equal(summed.result["gradients"]["w"], big)
            prefix = pool._channel.prefix if pool._channel is not None else None
        finally:
            await pool.close()
        if prefix is not None:
            assert not [n for n in os.listdir(shm.DIRECTORY) if n.startswith(prefix)]

    asyncio.run(scenario())
