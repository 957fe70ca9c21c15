"""Issue 12 on tapes, over HTTP with real workers: flat answers of a tape's gradient and
jacobian, a stored model recorded at a flat `point`, tapes bound to datasets that survive
a killed worker and an overwritten dataset, and PATCH rebinding a bound input."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np

from tests.service.test_datasets import PROGRAM, X, Y, W, inline, put_msgpack
from tests.service.wire import arr, ok, post, problem, t

rng = np.random.default_rng(12)
A = rng.normal(size=(2, 2))
B = 0.7
XS = rng.normal(size=(3, 2))
SMALL = {"variables": {"a": t(A, "float64"), "b": t(B, "float64"), "c": t([1.0], "float64")},
         "inputs": {"x": t(XS, "float64")},
         "program": ["h = (x @ a) * b", "loss = sum(h ** 2)"]}


def create(client, body: dict) -> dict:
    r = client.post("/v1/tapes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


# ---- flat answers on a tape ----------------------------------------------------------------


def test_tape_gradient_flat_follows_the_sources_order(client) -> None:
    tape_id = create(client, {"definition": SMALL, "target": "loss"})["tape_id"]
    sources = {"B": "b", "A": "a", "C": "c"}
    named = post(client, f"/v1/tapes/{tape_id}/gradient", {"target": "h", "sources": sources})
    assert named["gradients"]["C"] is None  # unconnected
    flat = post(client, f"/v1/tapes/{tape_id}/gradient",
                {"target": "h", "sources": sources, "flat": True})
    assert flat["gradients"] == {}
    assert flat["flat"]["order"] == [
        {"source": "B", "shape": [], "offset": 0, "size": 1},
        {"source": "A", "shape": [2, 2], "offset": 1, "size": 4},
        {"source": "C", "shape": [1], "offset": 5, "size": 1},
    ]
    # d sum(h)/db = sum(x @ a); d sum(h)/da[k, l] = b * sum_i x[i, k]: closed forms
    want = np.concatenate([[np.sum(XS @ A)], np.repeat(B * XS.sum(0), 2), [0.0]])
    np.testing.assert_allclose(arr(flat["flat"]["gradient"]), want, rtol=1e-12)
    assert flat["flat"]["gradient"]["dtype"] == "float64"
    # default sources: the tape's (a, b, c in definition order), default target: loss
    default = post(client, f"/v1/tapes/{tape_id}/gradient", {"flat": True})
    assert [s["source"] for s in default["flat"]["order"]] == ["a", "b", "c"]
    h = XS @ A * B
    np.testing.assert_allclose(arr(default["flat"]["gradient"]), np.concatenate(
        [(2 * B * XS.T @ h).reshape(-1), [np.sum(2 * h * (XS @ A))], [0.0]]), rtol=1e-12)
    client.delete(f"/v1/tapes/{tape_id}")


def test_tape_jacobian_flat_is_one_matrix(client) -> None:
    tape_id = create(client, {"definition": SMALL, "target": "loss"})["tape_id"]
    got = post(client, f"/v1/tapes/{tape_id}/jacobian",
               {"target": "h", "sources": ["a", "b"], "flat": True})
    assert got["jacobians"] == {}
    assert got["flat"]["order"] == [
        {"source": "a", "shape": [2, 2], "offset": 0, "size": 4},
        {"source": "b", "shape": [], "offset": 4, "size": 1},
    ]
    # h[i, j] = b * sum_k x[i, k] a[k, j]: dh[i, j]/da[k, l] = b x[i, k] [j == l]
    truth = np.zeros((3, 2, 5))
    for i in range(3):
        for j in range(2):
            for k in range(2):
                truth[i, j, 2 * k + j] = B * XS[i, k]
            truth[i, j, 4] = (XS @ A)[i, j]
    jac = arr(got["flat"]["jacobian"])
    assert jac.shape == (6, 5)
    np.testing.assert_allclose(jac, truth.reshape(6, 5), rtol=1e-12)
    # the stateless route answers the same matrix
    stateless = post(client, "/v1/jacobian", {"definition": SMALL, "target": "h",
                                              "sources": ["a", "b"], "flat": True,
                                              "allow_unused": True})
    np.testing.assert_array_equal(arr(stateless["flat"]["jacobian"]), jac)
    # per example: dh[i]/dx[i] = b a^T, [B, 2, 2]; the order over x's shape[1:]
    batch = post(client, f"/v1/tapes/{tape_id}/jacobian",
                 {"target": "h", "sources": ["x"], "batch": True, "flat": True})
    assert batch["flat"]["order"] == [{"source": "x", "shape": [2], "offset": 0, "size": 2}]
    np.testing.assert_allclose(arr(batch["flat"]["jacobian"]),
                               np.broadcast_to(B * A.T, (3, 2, 2)), rtol=1e-12)
    # unconnected sources hold zeros in a flat matrix
    zero = post(client, f"/v1/tapes/{tape_id}/jacobian",
                {"target": "h", "sources": ["c", "b"], "flat": True})
    np.testing.assert_array_equal(arr(zero["flat"]["jacobian"])[:, 0], np.zeros(6))
    body = problem(client.post(f"/v1/tapes/{tape_id}/jacobian",
                               json={"target": "h", "flat": "yes"}), 422)
    assert body["errors"][0]["field"] == "flat", body
    client.delete(f"/v1/tapes/{tape_id}")


# ---- a stored model recorded at a flat point ------------------------------------------------


def test_post_tape_with_model_and_point(client) -> None:
    r = client.post("/v1/models", json={"name": "small-point", "definition": SMALL,
                                        "replace": True})
    assert r.status_code in (200, 201), r.text
    a2, b2 = A + 0.25, -1.5
    by_name = create(client, {"model": "small-point", "target": "loss",
                              "variables": {"a": a2.tolist(), "b": b2}})
    point = [*a2.reshape(-1), b2, 3.0]  # a, b, c: the trainable variables in order
    flat = create(client, {"model": "small-point", "target": "loss", "point": point,
                           "flat": True})
    assert flat["value"] == by_name["value"]
    assert [s["source"] for s in flat["flat"]["order"]] == ["a", "b", "c"]
    np.testing.assert_array_equal(arr(flat["flat"]["gradient"])[:5], np.concatenate(
        [arr(by_name["gradients"]["a"]).reshape(-1), [arr(by_name["gradients"]["b"])]]))
    vector = {"a": t(np.eye(2), "float64"), "b": t(1.0, "float64"), "c": t([0.0], "float64")}
    want = post(client, f"/v1/tapes/{by_name['tape_id']}/hvp", {"vector": vector})
    got = post(client, f"/v1/tapes/{flat['tape_id']}/hvp", {"vector": vector})
    assert got == want
    # msgpack, named sources: the point follows their order
    packed = client.post("/v1/tapes", content=msgpack.packb({
        "model": "small-point", "target": "loss", "sources": ["b", "a"],
        "point": [b2, *a2.reshape(-1)]}), headers={"content-type": "application/msgpack",
                                                   "accept": "application/json"})
    assert packed.status_code == 201, packed.text
    assert packed.json()["value"] == by_name["value"]
    # the checks and problems of PATCH
    body = problem(client.post("/v1/tapes", json={"model": "small-point", "target": "loss",
                                                  "point": [1.0, 2.0]}), 422)
    assert body["detail"] == ("point: a flat vector of the sources needs shape [6] (a[2, 2], "
                              "b[], c[1]), got [2]"), body
    assert body["errors"][0]["field"] == "point"
    patched = problem(client.patch(f"/v1/tapes/{flat['tape_id']}", json={"point": [1.0, 2.0]}),
                      422)
    assert patched["detail"] == body["detail"]
    body = problem(client.post("/v1/tapes", json={"model": "small-point", "target": "loss",
                                                  "point": point, "variables": {"b": 1.0}}), 422)
    assert "'point'" in body["detail"] and "'variables'" in body["detail"], body
    body = problem(client.post("/v1/tapes", json={"model": "small-point", "target": "loss",
                                                  "point": [[1.0, 2.0]]}), 422)
    assert "point" in body["detail"], body
    for tape_id in (by_name["tape_id"], flat["tape_id"], packed.json()["tape_id"]):
        client.delete(f"/v1/tapes/{tape_id}")


# ---- a killed worker: tapes recorded again from what the store holds ---------------------------


def kill_worker_of(server, client, tape_id: str) -> None:
    """SIGKILL the worker holding the tape, and wait until the pool has replaced it."""
    index = ok(client.get(f"/v1/tapes/{tape_id}"))["worker"]
    victim = next(w for w in server.wait_ready()["workers"] if w["index"] == index)
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = {w["index"]: w for w in server.wait_ready()["workers"]}
        if workers[index]["pid"] != victim["pid"]:
            return
        time.sleep(0.05)
    raise TimeoutError("the killed worker was not replaced")


def test_point_tape_is_rebuilt_at_its_point(server, client) -> None:
    r = client.post("/v1/models", json={"name": "small-point", "definition": SMALL,
                                        "replace": True})
    assert r.status_code in (200, 201), r.text
    point = [0.5, -0.5, 1.0, 2.0, 0.3, 1.0]
    tape = create(client, {"model": "small-point", "target": "loss", "point": point})
    vector = {"flat_vector": [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], "flat": True}
    before = post(client, f"/v1/tapes/{tape['tape_id']}/hvp", vector)
    kill_worker_of(server, client, tape["tape_id"])
    after = post(client, f"/v1/tapes/{tape['tape_id']}/hvp", vector)
    assert after == before
    info = ok(client.get(f"/v1/tapes/{tape['tape_id']}"))
    assert info["rebuilds"] == 1
    gradient = post(client, f"/v1/tapes/{tape['tape_id']}/gradient", {})
    assert gradient["value"] == tape["value"]  # the point, not the stored model's values
    client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_dataset_tape_survives_a_killed_worker_and_an_overwrite(server, client) -> None:
    put_msgpack(client, "restart-data", {"X": X, "Y": Y})
    defn = {"variables": {"w": t(W, "float64")}, "inputs": {"dataset": "restart-data",
                                                            "rows": {"start": 0, "stop": 30}},
            "program": PROGRAM}
    tape = create(client, {"definition": defn, "target": "loss"})
    tape_id = tape["tape_id"]
    vectors = {"vectors": [{"w": t(v, "float64")} for v in np.eye(3)]}
    hessian = post(client, f"/v1/tapes/{tape_id}/hvp", vectors)["hvps"]
    gradient = post(client, f"/v1/tapes/{tape_id}/gradient", {})
    # the truth: logistic loss on the first 30 rows, by NumPy
    x, y = X[:30], Y[:30]
    p = 1 / (1 + np.exp(-(x @ W)))
    np.testing.assert_allclose(arr(gradient["gradients"]["w"]), x.T @ (p - y) / 30, rtol=1e-12)
    np.testing.assert_allclose(np.stack([arr(h["w"]) for h in hessian]),
                               x.T @ (x * (p * (1 - p))[:, None]) / 30, rtol=1e-12)

    kill_worker_of(server, client, tape_id)
    again = post(client, f"/v1/tapes/{tape_id}/hvp", vectors)["hvps"]
    assert again == hessian
    assert ok(client.get(f"/v1/tapes/{tape_id}"))["rebuilds"] == 1

    # overwritten under the same name: the tape keeps the arrays it was recorded with,
    # through another worker death too; a new tape (or request) reads the new arrays
    put_msgpack(client, "restart-data", {"X": -X, "Y": 1 - Y})
    kill_worker_of(server, client, tape_id)
    assert post(client, f"/v1/tapes/{tape_id}/gradient", {}) == gradient
    assert post(client, f"/v1/tapes/{tape_id}/hvp", vectors)["hvps"] == hessian
    assert ok(client.get(f"/v1/tapes/{tape_id}"))["rebuilds"] == 2
    fresh = post(client, "/v1/gradient", {"definition": defn, "target": "loss"})
    want = post(client, "/v1/gradient", {"definition": {**inline(slice(0, 30)), "inputs": {
        "X": t(-X[:30], "float64"), "Y": t(1 - Y[:30], "float64")}}, "target": "loss"})
    assert fresh == want
    client.delete(f"/v1/tapes/{tape_id}")
