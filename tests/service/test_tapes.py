"""/v1/tapes: record once, answer many requests (SCENARIOS.md 13 over HTTP), HVPs that
equal fresh ones and cost no memory (SCENARIOS.md 14), other targets on the same
recording, new values, expiry, deletion, and a tape rebuilt after its worker died."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

import httpx
import numpy as np
import pytest

from engine.replay import POOL_LIMIT
from tests.service.test_workers import _wait_dead
from tests.service.wire import MSGPACK, arr, num, ok, post, post_msgpack, problem, t, tbin

rng = np.random.default_rng(6)
X = rng.standard_normal((6, 4))
K = rng.standard_normal((4, 3))
B = rng.standard_normal(3)
DEFN = {
    "variables": {
        "k": t(K, "float64"),
        "b": t(B, "float64"),
        "frozen": {"value": t(np.ones(3), "float64"), "trainable": False},
    },
    "inputs": {"x": t(X, "float64")},
    "program": [
        "h = tanh(x @ k + b) * frozen",
        "loss = sum(h ** 2)",
        "penalty = mean(k ** 2) + mean(x ** 2)",
    ],
}


def create(client: httpx.Client, body: dict | None = None, **extra) -> dict:
    response = client.post(
        "/v1/tapes", json={"definition": DEFN, "target": "loss", **(body or {}), **extra}
    )
    assert response.status_code == 201, response.text
    created = response.json()
    assert response.headers["location"] == f"/v1/tapes/{created['tape_id']}"
    return created


def vec(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"k": g.standard_normal((4, 3)), "b": g.standard_normal(3)}


def wire(v: dict[str, np.ndarray]) -> dict:
    return {key: t(value, "float64") for key, value in v.items()}


def info(client: httpx.Client, tape_id: str) -> dict:
    return ok(client.get(f"/v1/tapes/{tape_id}"))


# ---- creating and reading ----------------------------------------------------------------


def test_create_answers_the_gradient_and_an_unguessable_id(client) -> None:
    created = create(client)
    fresh = post(
        client, "/v1/gradient", {"definition": DEFN, "target": "loss", "allow_unused": True}
    )
    assert len(created["tape_id"]) >= 32 and created["tape_id"].isascii()
    assert num(created["value"]) == pytest.approx(num(fresh["value"]), rel=1e-12)
    assert set(created["gradients"]) == {"k", "b"}  # the trainable variables
    for key in ("k", "b"):
        np.testing.assert_allclose(
            arr(created["gradients"][key]), arr(fresh["gradients"][key]), rtol=1e-12
        )
    assert created["bytes"] > X.nbytes and created["device"] == "cpu"
    assert created["ttl"] == 3600.0 and created["expires_at"].endswith("Z")
    about = info(client, created["tape_id"])
    assert about["tape_id"] == created["tape_id"] and about["hits"] == 0
    assert about["target"] == "loss" and about["sources"] == {"k": "k", "b": "b"}
    assert about["loaded"] and about["rebuilds"] == 0 and about["model"] is None
    assert about["worker"] == created["worker"] and about["bytes"] == created["bytes"]
    for stamp in ("created_at", "last_used_at", "expires_at"):
        assert about[stamp].endswith("Z")
    listed = ok(client.get("/v1/tapes"))["tapes"]
    assert created["tape_id"] in [tape["tape_id"] for tape in listed]
    other = create(client)
    assert other["tape_id"] != created["tape_id"]


def test_sources_as_aliases(client) -> None:
    created = create(client, sources={"kernel": "k"})
    assert set(created["gradients"]) == {"kernel"}
    answer = post(
        client,
        f"/v1/tapes/{created['tape_id']}/hvp",
        {"vector": {"kernel": t(np.ones((4, 3)), "float64")}},
    )
    assert set(answer["hvp"]) == {"kernel"}


# ---- SCENARIOS.md 14: HVP reuse --------------------------------------------------------


def test_tape_hvps_equal_fresh_ones(client) -> None:
    tape_id = create(client)["tape_id"]
    vectors = [vec(i) for i in range(6)]
    for v in vectors:
        mine = post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(v)})
        assert mine["hvps"] is None
        assert set(mine) == {"hvp", "hvps", "execution", "curvature_used"}
        assert mine["curvature_used"] == {  # the tape's Hessian itself, exactly
            "kind": "hessian",
            "samples": None,
            "seed": None,
            "structure": None,
            "approximate": False,
            "reason": None,
        }
        fresh = post(
            client,
            "/v1/hvp",
            {"definition": DEFN, "target": "loss", "allow_unused": True, "vector": wire(v)},
        )
        for key in ("k", "b"):
            np.testing.assert_allclose(
                arr(mine["hvp"][key]), arr(fresh["hvp"][key]), rtol=1e-12, atol=1e-14
            )
    batched = post(client, f"/v1/tapes/{tape_id}/hvp", {"vectors": [wire(v) for v in vectors]})
    assert batched["hvp"] is None and len(batched["hvps"]) == 6
    for v, product in zip(vectors, batched["hvps"], strict=True):
        single = post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(v)})
        for key in ("k", "b"):
            np.testing.assert_allclose(arr(product[key]), arr(single["hvp"][key]), rtol=1e-12)
    assert info(client, tape_id)["hits"] == 6 + 1 + 6


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_memory_stays_flat_over_500_hvps(server, client) -> None:
    g = np.random.default_rng(14)
    defn = {
        "variables": {
            "w1": t(g.standard_normal((16, 64)) * 0.3),
            "w2": t(g.standard_normal((64, 1)) * 0.3),
        },
        "inputs": {"x": t(g.standard_normal((256, 16))), "y": t(g.standard_normal((256, 1)))},
        "program": ["h = tanh(x @ w1)", "loss = mean((h @ w2 - y) ** 2)"],
    }
    created = create(client, {"definition": defn})
    tape_id, worker = created["tape_id"], created["worker"]
    pid = next(w["pid"] for w in server.wait_ready()["workers"] if w["index"] == worker)
    body = {
        "vectors": [
            {"w1": tbin(g.standard_normal((16, 64))), "w2": tbin(g.standard_normal((64, 1)))}
            for _ in range(4)
        ]
    }
    sizes, rss = [], []
    for i in range(500):
        ok(post_msgpack(client, f"/v1/tapes/{tape_id}/hvp", body))
        if i in (0, 49, 499):
            sizes.append(info(client, tape_id)["bytes"])
            rss.append(_rss(pid))
    # Nothing is recorded by an HVP: what a tape holds grows only by its rule stages'
    # caches (first HVP) and the compiled pass's kept buffers (from the third, at most
    # engine.replay.POOL_LIMIT), then stays put.
    assert sizes[1] == sizes[2], sizes
    assert created["bytes"] <= sizes[0] <= sizes[1] <= sizes[0] + POOL_LIMIT, sizes
    assert rss[2] <= rss[1] * 1.05 + 2**20, rss  # the worker holds no more after 450 more
    assert info(client, tape_id)["hits"] == 500


# ---- SCENARIOS.md 13: a persistent tape answers many requests --------------------------


def test_other_targets_on_the_same_recording(client) -> None:
    tape_id = create(client)["tape_id"]
    for _ in range(3):  # as often as asked: the recording is persistent
        again = post(client, f"/v1/tapes/{tape_id}/gradient", {})
        fresh = post(
            client, "/v1/gradient", {"definition": DEFN, "target": "loss", "allow_unused": True}
        )
        for key in ("k", "b"):
            np.testing.assert_allclose(
                arr(again["gradients"][key]), arr(fresh["gradients"][key]), rtol=1e-12
            )
    # Another target, over a variable, an input and a non-trainable variable.
    other = post(
        client,
        f"/v1/tapes/{tape_id}/gradient",
        {"target": "penalty", "sources": ["k", "x", "frozen"]},
    )
    assert num(other["value"]) == pytest.approx(np.mean(K**2) + np.mean(X**2), rel=1e-12)
    np.testing.assert_allclose(arr(other["gradients"]["k"]), 2 * K / K.size, rtol=1e-12)
    np.testing.assert_allclose(arr(other["gradients"]["x"]), 2 * X / X.size, rtol=1e-12)
    assert other["gradients"]["frozen"] is None
    zeros = post(
        client,
        f"/v1/tapes/{tape_id}/gradient",
        {"target": "penalty", "sources": ["b"], "unconnected": "zero"},
    )
    np.testing.assert_array_equal(arr(zeros["gradients"]["b"]), np.zeros(3))
    # A jacobian of a non-scalar name, full and per example.
    jac = post(client, f"/v1/tapes/{tape_id}/jacobian", {"target": "h", "sources": ["x"]})
    fresh = post(
        client,
        "/v1/jacobian",
        {"definition": DEFN, "target": "h", "sources": ["x"], "allow_unused": True},
    )
    assert jac["jacobians"]["x"]["shape"] == [6, 3, 6, 4]
    np.testing.assert_allclose(arr(jac["jacobians"]["x"]), arr(fresh["jacobians"]["x"]), rtol=1e-12)
    per_example = post(
        client, f"/v1/tapes/{tape_id}/jacobian", {"target": "h", "sources": ["x"], "batch": True}
    )
    assert per_example["jacobians"]["x"]["shape"] == [6, 3, 4]
    # ... and HVPs still answer from the same tape.
    post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(vec(1))})
    assert info(client, tape_id)["hits"] == 3 + 2 + 2 + 1


def test_msgpack_and_base64_on_a_tape(client) -> None:
    tape_id = create(client)["tape_id"]
    v = vec(3)
    response = post_msgpack(
        client,
        f"/v1/tapes/{tape_id}/hvp",
        {"vector": {k: tbin(x, "float64") for k, x in v.items()}},
    )
    assert response.headers["content-type"].startswith(MSGPACK)
    assert response.headers["server-timing"].startswith("compute;dur=")  # the worker's part
    binary = ok(response)["hvp"]
    as_json = post(
        client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(v), "response_encoding": "base64"}
    )["hvp"]
    assert "base64" in as_json["k"]
    np.testing.assert_array_equal(arr(binary["k"]), arr(as_json["k"]))


# ---- new values ------------------------------------------------------------------------


def test_patch_records_again_at_new_values(client) -> None:
    created = create(client)
    tape_id = created["tape_id"]
    k2 = K + 0.5
    updated = ok(
        client.patch(
            f"/v1/tapes/{tape_id}",
            json={
                "variables": {"k": t(k2, "float64")},
                "inputs": {"x": t(X * 2)},  # float32 values are cast to the recorded float64
            },
        )
    )
    assert updated["tape_id"] == tape_id
    moved = {
        **DEFN,
        "variables": {**DEFN["variables"], "k": t(k2, "float64")},
        "inputs": {"x": t((X * 2).astype(np.float32).astype(np.float64), "float64")},
    }
    fresh = post(
        client, "/v1/gradient", {"definition": moved, "target": "loss", "allow_unused": True}
    )
    assert num(updated["value"]) == pytest.approx(num(fresh["value"]), rel=1e-12)
    assert num(updated["value"]) != pytest.approx(num(created["value"]))
    v = vec(9)
    mine = post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(v)})
    hvp = post(
        client,
        "/v1/hvp",
        {"definition": moved, "target": "loss", "allow_unused": True, "vector": wire(v)},
    )
    np.testing.assert_allclose(arr(mine["hvp"]["k"]), arr(hvp["hvp"]["k"]), rtol=1e-12)
    unknown = problem(
        client.patch(
            f"/v1/tapes/{tape_id}",
            json={"variables": {"kk": t(K, "float64")}, "inputs": {"x": t(np.ones((2, 2)))}},
        ),
        422,
        "validation",
    )
    assert "variables.kk" in unknown["detail"] and "'k'" in unknown["detail"]
    assert [e["field"] for e in unknown["errors"]] == ["variables.kk", "inputs.x"]
    assert "shape [2, 2]" in unknown["errors"][1]["message"]
    problem(client.patch(f"/v1/tapes/{tape_id}", json={}), 422, "validation")
    after = post(client, f"/v1/tapes/{tape_id}/gradient", {})  # unchanged by the failures
    assert num(after["value"]) == pytest.approx(num(updated["value"]), rel=1e-12)


def test_patch_of_labels_as_a_bare_list_takes_their_integer_dtype(client) -> None:
    """A bare list stands for the tensor it replaces, in its dtype (the tensors and data
    guides): new int64 labels given as [0, 1, ...] were a 422 "dtype float64 cannot
    replace the recorded int64". Now they are those labels (the answer equals a fresh
    gradient with them), sent inline or replacing labels bound to a dataset; values
    that are no labels are refused naming the field, and a tensor that names a float
    dtype still keeps to the recorded kind."""
    g = np.random.default_rng(11)
    x, w = g.standard_normal((8, 3)), g.standard_normal((3, 4))
    labels, new = g.integers(0, 4, 8), g.integers(0, 4, 8)
    program = ["logits = x @ w", "loss = softmax_cross_entropy(logits, y)"]

    def definition(y: object) -> dict:
        return {"variables": {"w": t(w, "float64")}, "inputs": {"x": t(x, "float64"), "y": y}}

    fresh = post(
        client,
        "/v1/gradient",
        {"definition": {**definition(t(new, "int64")), "program": program}, "target": "loss"},
    )
    stored = client.put("/v1/datasets/patch-labels", json={"y": t(labels, "int64")})
    assert stored.status_code in (200, 201), stored.text
    bound = {"dataset": "patch-labels", "array": "y"}
    for y in (t(labels, "int64"), bound):
        tape_id = create(client, {"definition": {**definition(y), "program": program}})["tape_id"]
        patch = f"/v1/tapes/{tape_id}"
        moved = ok(client.patch(patch, json={"inputs": {"y": new.tolist()}}))
        assert num(moved["value"]) == pytest.approx(num(fresh["value"]), rel=1e-12), y
        np.testing.assert_allclose(
            arr(moved["gradients"]["w"]), arr(fresh["gradients"]["w"]), rtol=1e-12
        )
        # (2**53 + 1 reaches the server as the double 2**53: cast, it was label 2**53, a
        # value never sent; refused like the others, here before the program sees it)
        for values in ([1.5] * 8, [-1e300] * 8, [2**53 + 1] * 8, [-(2**53) - 1] * 8):
            refused = problem(client.patch(patch, json={"inputs": {"y": values}}), 422)
            assert refused["type"].endswith("/validation"), refused
            assert refused["errors"][0]["field"] == "inputs.y", refused
            assert "int64" in refused["detail"] and "whole numbers" in refused["detail"]
            assert "below 2**53" in refused["detail"], refused
        typed = problem(client.patch(patch, json={"inputs": {"y": t(new, "float32")}}), 422)
        assert "dtype float32 cannot replace" in typed["detail"], typed
        after = post(client, f"/v1/tapes/{tape_id}/gradient", {})  # the refusals kept it
        assert num(after["value"]) == pytest.approx(num(fresh["value"]), rel=1e-12)
        client.delete(patch)
    client.delete("/v1/datasets/patch-labels")


# ---- ending ----------------------------------------------------------------------------


def test_delete(client) -> None:
    tape_id = create(client)["tape_id"]
    response = client.delete(f"/v1/tapes/{tape_id}")
    assert response.status_code == 204 and not response.content
    gone = problem(client.get(f"/v1/tapes/{tape_id}"), 404, "tape-not-found")
    assert "deleted" in gone["detail"] and gone["reason"] == "deleted"
    problem(
        client.post(f"/v1/tapes/{tape_id}/hvp", json={"vector": wire(vec(0))}),
        404,
        "tape-not-found",
    )
    problem(client.delete(f"/v1/tapes/{tape_id}"), 404, "tape-not-found")
    assert tape_id not in [x["tape_id"] for x in ok(client.get("/v1/tapes"))["tapes"]]


def test_unknown_tape(client) -> None:
    found = problem(client.get("/v1/tapes/not-a-tape"), 404, "tape-not-found")
    assert "not-a-tape" in found["detail"] and "POST /v1/tapes" in found["detail"]
    problem(client.post("/v1/tapes/x" * 300 + "/hvp", json={"vector": {}}), 404)


def test_a_use_renews_a_tape(client) -> None:
    """A use moves the tape's expiry on (a ttl of an hour: no clock races the test)."""
    tape_id = create(client)["tape_id"]
    before = datetime.fromisoformat(info(client, tape_id)["expires_at"])
    post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": wire(vec(0))})
    after = datetime.fromisoformat(info(client, tape_id)["expires_at"])
    assert after > before, (before, after)
    client.delete(f"/v1/tapes/{tape_id}")


def test_expiry_says_so_and_a_tape_can_be_made_again(client) -> None:
    """A tape unused for its ttl (1 s) answers 404 tape-expired. Polled with reads, which
    are no use: on a loaded machine a use sent right after the creation could itself come
    later than the ttl (and a sleep of the ttl and a little could end before an answer
    that came late did), so the test waits for the expiry, with a guard against a hang
    only, and checks that it did not come before its time."""
    started = time.monotonic()
    created = create(client, ttl=1.0)
    tape_id = created["tape_id"]
    assert created["ttl"] == 1.0
    deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
    while (read := client.get(f"/v1/tapes/{tape_id}")).status_code == 200:
        assert time.monotonic() < deadline, "the unused tape never expired"
        time.sleep(0.05)
    assert time.monotonic() - started >= 1.0  # not before its ttl
    gone = problem(read, 404, "tape-expired")
    assert "expired" in gone["detail"] and "1 s" in gone["detail"]
    assert "POST /v1/tapes" in gone["detail"]
    problem(
        client.post(f"/v1/tapes/{tape_id}/hvp", json={"vector": wire(vec(0))}), 404, "tape-expired"
    )
    again = create(client, ttl=1.0)
    assert again["tape_id"] != tape_id
    too_long = problem(
        client.post("/v1/tapes", json={"definition": DEFN, "target": "loss", "ttl": 1e9}),
        422,
        "too-large",
    )
    assert "ttl" in too_long["detail"]


# ---- what a tape refuses ---------------------------------------------------------------


def test_refusals(client) -> None:
    not_scalar = problem(
        client.post("/v1/tapes", json={"definition": DEFN, "target": "h"}), 422, "invalid-request"
    )
    assert "scalar" in not_scalar["detail"] and "[6, 3]" in not_scalar["detail"]
    both = problem(
        client.post("/v1/tapes", json={"definition": DEFN, "model": "m", "target": "loss"}),
        422,
        "validation",
    )
    assert "exactly one of 'definition' or 'model'" in both["detail"]
    bad = problem(
        client.post("/v1/tapes", json={"definition": DEFN, "target": "los"}), 422, "definition"
    )
    assert "loss" in bad["detail"]  # the suggestion
    tape_id = create(client)["tape_id"]
    shape = problem(
        client.post(
            f"/v1/tapes/{tape_id}/hvp", json={"vector": {"k": t(np.ones(3)), "b": t(np.ones(3))}}
        ),
        422,
        "invalid-request",
    )
    assert "vector.k" in shape["detail"]
    unknown = problem(
        client.post(f"/v1/tapes/{tape_id}/gradient", json={"target": "nope"}), 422, "definition"
    )
    assert "nope" in unknown["detail"]
    many = {"vectors": [wire(vec(0))] * 33}  # the tests' server answers up to 32
    problem(client.post(f"/v1/tapes/{tape_id}/hvp", json=many), 422, "too-large")


# ---- no loss: a worker dies, the tape is recorded again --------------------------------


def test_killed_worker_loses_nothing(server, client) -> None:
    created = create(client)
    tape_id, worker = created["tape_id"], created["worker"]
    v = wire(vec(5))
    before = post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": v})
    victim = next(w for w in server.wait_ready()["workers"] if w["index"] == worker)
    os.kill(victim["pid"], signal.SIGKILL)
    _wait_dead(victim["pid"])
    # Until the server has seen it go (a request sent while the kernel still finishes the
    # process's exit could reach it: a 502 to retry, not what this test is about).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {w["index"]: w for w in client.get("/readyz").json()["workers"]}[worker]
        if now["generation"] != victim["generation"] or now["state"] != "idle":
            break
        time.sleep(0.01)
    after = post(client, f"/v1/tapes/{tape_id}/hvp", {"vector": v})  # rebuilt, transparently
    for key in ("k", "b"):
        np.testing.assert_array_equal(arr(after["hvp"][key]), arr(before["hvp"][key]))
    about = info(client, tape_id)
    assert about["rebuilds"] == 1 and about["loaded"] and about["hits"] == 2
    workers = {w["index"]: w for w in server.wait_ready()["workers"]}
    assert workers[worker]["pid"] != victim["pid"]
    assert 'gradtape_tape_events_total{event="rebuilt"}' in client.get("/metrics").text


def test_methods_of_a_tape(client) -> None:
    response = client.put("/v1/tapes/some-id", json={})
    found = problem(response, 405, "method-not-allowed")
    assert response.headers["allow"] == "DELETE, GET, PATCH"
    assert "allowed: DELETE, GET, PATCH" in found["detail"]
