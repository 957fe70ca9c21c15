"""Issue 12 on tapes, over HTTP with real workers: flat answers of a tape's gradient and
jacobian, a stored model recorded at a flat `point`, tapes bound to datasets that survive
a killed worker and an overwritten dataset, and PATCH rebinding a bound input."""

from __future__ import annotations

import os
import signal
import time

import httpx
import msgpack
import numpy as np

from tests.service.conftest import start_server, stop_server
from tests.service.test_datasets import PROGRAM, W, X, Y, inline, put_msgpack
from tests.service.wire import arr, ok, post, problem, t, without_execution

rng = np.random.default_rng(12)
A = rng.normal(size=(2, 2))
B = 0.7
XS = rng.normal(size=(3, 2))
SMALL = {
    "variables": {"a": t(A, "float64"), "b": t(B, "float64"), "c": t([1.0], "float64")},
    "inputs": {"x": t(XS, "float64")},
    "program": ["h = (x @ a) * b", "loss = sum(h ** 2)"],
}


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
    flat = post(
        client, f"/v1/tapes/{tape_id}/gradient", {"target": "h", "sources": sources, "flat": True}
    )
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
    np.testing.assert_allclose(
        arr(default["flat"]["gradient"]),
        np.concatenate([(2 * B * XS.T @ h).reshape(-1), [np.sum(2 * h * (XS @ A))], [0.0]]),
        rtol=1e-12,
    )
    client.delete(f"/v1/tapes/{tape_id}")


def test_tape_jacobian_flat_is_one_matrix(client) -> None:
    tape_id = create(client, {"definition": SMALL, "target": "loss"})["tape_id"]
    got = post(
        client,
        f"/v1/tapes/{tape_id}/jacobian",
        {"target": "h", "sources": ["a", "b"], "flat": True},
    )
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
    stateless = post(
        client,
        "/v1/jacobian",
        {
            "definition": SMALL,
            "target": "h",
            "sources": ["a", "b"],
            "flat": True,
            "allow_unused": True,
        },
    )
    np.testing.assert_array_equal(arr(stateless["flat"]["jacobian"]), jac)
    # per example: dh[i]/dx[i] = b a^T, [B, 2, 2]; the order over x's shape[1:]
    batch = post(
        client,
        f"/v1/tapes/{tape_id}/jacobian",
        {"target": "h", "sources": ["x"], "batch": True, "flat": True},
    )
    assert batch["flat"]["order"] == [{"source": "x", "shape": [2], "offset": 0, "size": 2}]
    np.testing.assert_allclose(
        arr(batch["flat"]["jacobian"]), np.broadcast_to(B * A.T, (3, 2, 2)), rtol=1e-12
    )
    # unconnected sources hold zeros in a flat matrix
    zero = post(
        client,
        f"/v1/tapes/{tape_id}/jacobian",
        {"target": "h", "sources": ["c", "b"], "flat": True},
    )
    np.testing.assert_array_equal(arr(zero["flat"]["jacobian"])[:, 0], np.zeros(6))
    body = problem(
        client.post(f"/v1/tapes/{tape_id}/jacobian", json={"target": "h", "flat": "yes"}), 422
    )
    assert body["errors"][0]["field"] == "flat", body
    client.delete(f"/v1/tapes/{tape_id}")


# ---- a stored model recorded at a flat point ------------------------------------------------


def test_post_tape_with_model_and_point(client) -> None:
    r = client.post(
        "/v1/models", json={"name": "small-point", "definition": SMALL, "replace": True}
    )
    assert r.status_code in (200, 201), r.text
    a2, b2 = A + 0.25, -1.5
    by_name = create(
        client, {"model": "small-point", "target": "loss", "variables": {"a": a2.tolist(), "b": b2}}
    )
    point = [*a2.reshape(-1), b2, 3.0]  # a, b, c: the trainable variables in order
    flat = create(client, {"model": "small-point", "target": "loss", "point": point, "flat": True})
    assert flat["value"] == by_name["value"]
    assert [s["source"] for s in flat["flat"]["order"]] == ["a", "b", "c"]
    np.testing.assert_array_equal(
        arr(flat["flat"]["gradient"])[:5],
        np.concatenate(
            [arr(by_name["gradients"]["a"]).reshape(-1), [arr(by_name["gradients"]["b"])]]
        ),
    )
    vector = {"a": t(np.eye(2), "float64"), "b": t(1.0, "float64"), "c": t([0.0], "float64")}
    want = post(client, f"/v1/tapes/{by_name['tape_id']}/hvp", {"vector": vector})
    got = post(client, f"/v1/tapes/{flat['tape_id']}/hvp", {"vector": vector})
    assert got == want
    # msgpack, named sources: the point follows their order
    packed = client.post(
        "/v1/tapes",
        content=msgpack.packb(
            {
                "model": "small-point",
                "target": "loss",
                "sources": ["b", "a"],
                "point": [b2, *a2.reshape(-1)],
            }
        ),
        headers={"content-type": "application/msgpack", "accept": "application/json"},
    )
    assert packed.status_code == 201, packed.text
    assert packed.json()["value"] == by_name["value"]
    # the checks and problems of PATCH
    body = problem(
        client.post(
            "/v1/tapes", json={"model": "small-point", "target": "loss", "point": [1.0, 2.0]}
        ),
        422,
    )
    assert body["detail"] == (
        "point: a flat vector of the sources needs shape [6] (a[2, 2], b[], c[1]), got [2]"
    ), body
    assert body["errors"][0]["field"] == "point"
    patched = problem(client.patch(f"/v1/tapes/{flat['tape_id']}", json={"point": [1.0, 2.0]}), 422)
    assert patched["detail"] == body["detail"]
    body = problem(
        client.post(
            "/v1/tapes",
            json={
                "model": "small-point",
                "target": "loss",
                "point": point,
                "variables": {"b": 1.0},
            },
        ),
        422,
    )
    assert "'point'" in body["detail"] and "'variables'" in body["detail"], body
    body = problem(
        client.post(
            "/v1/tapes", json={"model": "small-point", "target": "loss", "point": [[1.0, 2.0]]}
        ),
        422,
    )
    assert "point" in body["detail"], body
    for tape_id in (by_name["tape_id"], flat["tape_id"], packed.json()["tape_id"]):
        client.delete(f"/v1/tapes/{tape_id}")


# ---- a killed worker: tapes recorded again from what the store holds ---------------------------


def kill_worker_of(server, client, tape_id: str) -> None:
    """SIGKILL the worker holding the tape, and wait until the pool has replaced it."""
    kill_worker(server, ok(client.get(f"/v1/tapes/{tape_id}"))["worker"])


def kill_worker(server, index: int) -> None:
    """SIGKILL worker `index` and wait until the pool has replaced it."""
    victim = next(w for w in server.wait_ready()["workers"] if w["index"] == index)
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
    while time.monotonic() < deadline:
        workers = {w["index"]: w for w in server.wait_ready()["workers"]}
        if workers[index]["pid"] != victim["pid"]:
            return
        time.sleep(0.05)
    raise TimeoutError("the killed worker was not replaced")


def test_point_tape_is_rebuilt_at_its_point(server, client) -> None:
    r = client.post(
        "/v1/models", json={"name": "small-point", "definition": SMALL, "replace": True}
    )
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
    defn = {
        "variables": {"w": t(W, "float64")},
        "inputs": {"dataset": "restart-data", "rows": {"start": 0, "stop": 30}},
        "program": PROGRAM,
    }
    tape = create(client, {"definition": defn, "target": "loss"})
    tape_id = tape["tape_id"]
    vectors = {"vectors": [{"w": t(v, "float64")} for v in np.eye(3)]}
    hessian = post(client, f"/v1/tapes/{tape_id}/hvp", vectors)["hvps"]
    gradient = post(client, f"/v1/tapes/{tape_id}/gradient", {})
    # the truth: logistic loss on the first 30 rows, by NumPy
    x, y = X[:30], Y[:30]
    p = 1 / (1 + np.exp(-(x @ W)))
    np.testing.assert_allclose(arr(gradient["gradients"]["w"]), x.T @ (p - y) / 30, rtol=1e-12)
    np.testing.assert_allclose(
        np.stack([arr(h["w"]) for h in hessian]),
        x.T @ (x * (p * (1 - p))[:, None]) / 30,
        rtol=1e-12,
    )

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
    want = post(
        client,
        "/v1/gradient",
        {
            "definition": {
                **inline(slice(0, 30)),
                "inputs": {"X": t(-X[:30], "float64"), "Y": t(1 - Y[:30], "float64")},
            },
            "target": "loss",
        },
    )
    assert without_execution(fresh) == without_execution(want)
    # deleted: the tape still holds its arrays in the store, through one more worker death
    assert client.delete("/v1/datasets/restart-data").status_code == 204
    kill_worker_of(server, client, tape_id)
    assert post(client, f"/v1/tapes/{tape_id}/hvp", vectors)["hvps"] == hessian
    problem(
        client.post("/v1/gradient", json={"definition": defn, "target": "loss"}),
        404,
        "dataset-not-found",
    )
    client.delete(f"/v1/tapes/{tape_id}")


# ---- PATCH of inputs bound to a dataset -------------------------------------------------------


def logistic(rows, w: np.ndarray = W) -> tuple[float, np.ndarray, np.ndarray]:
    """Value, gradient and Hessian of the mean logistic loss at w on X[rows], by NumPy."""
    x, y = X[rows], Y[rows]
    z = x @ w
    p = 1 / (1 + np.exp(-z))
    value = np.mean(np.logaddexp(0, z) - y * z)
    return value, x.T @ (p - y) / len(y), x.T @ (x * (p * (1 - p))[:, None]) / len(y)


def check_at(client, tape_id: str, answer: dict, rows, w: np.ndarray = W) -> None:
    value, gradient, hessian = logistic(rows, w)
    np.testing.assert_allclose(arr(answer["value"]), value, rtol=1e-12)
    np.testing.assert_allclose(arr(answer["gradients"]["w"]), gradient, rtol=1e-12, atol=1e-15)
    hvps = post(
        client, f"/v1/tapes/{tape_id}/hvp", {"vectors": [{"w": t(v, "float64")} for v in np.eye(3)]}
    )["hvps"]
    np.testing.assert_allclose(np.stack([arr(h["w"]) for h in hvps]), hessian, rtol=1e-12)


def test_patch_rebinds_dataset_inputs(client) -> None:
    put_msgpack(client, "batches", {"X": X, "Y": Y})
    defn = {
        "variables": {"w": t(W, "float64")},
        "inputs": {"dataset": "batches", "rows": {"stop": 10}},
        "program": PROGRAM,
    }
    tape_id = create(client, {"definition": defn, "target": "loss"})["tape_id"]
    patch = f"/v1/tapes/{tape_id}"
    # the next mini-batch of every array of the dataset, nothing resent
    moved = ok(
        client.patch(
            patch, json={"inputs": {"dataset": "batches", "rows": {"start": 10, "stop": 20}}}
        )
    )
    check_at(client, tape_id, moved, slice(10, 20))
    # per input, by indices, a smaller last batch
    rows = [39, 2, 2, 17, 30]
    moved = ok(
        client.patch(
            patch,
            json={
                "inputs": {
                    "X": {"dataset": "batches", "array": "X", "rows": rows},
                    "Y": {"dataset": "batches", "array": "Y", "rows": rows},
                }
            },
        )
    )
    check_at(client, tape_id, moved, rows)
    # sent data replaces the binding (bare lists take the bound float64)
    moved = ok(client.patch(patch, json={"inputs": {"X": X[:7].tolist(), "Y": Y[:7].tolist()}}))
    check_at(client, tape_id, moved, slice(0, 7))
    # ... and a dataset binds it again, with the flat answer of an optimizer step
    moved = ok(client.patch(patch, json={"inputs": {"dataset": "batches"}, "flat": True}))
    np.testing.assert_allclose(arr(moved["flat"]["gradient"]), logistic(slice(None))[1], rtol=1e-12)

    # new data and a new point in one PATCH (an optimizer's mini-batch step)
    moved = ok(
        client.patch(
            patch,
            json={"point": (W + 1).tolist(), "inputs": {"dataset": "batches", "rows": [1, 2, 3]}},
        )
    )
    check_at(client, tape_id, moved, [1, 2, 3], W + 1)
    body = problem(
        client.patch(patch, json={"point": W.tolist(), "variables": {"w": W.tolist()}}), 422
    )
    assert "'point'" in body["detail"] and "'variables'" in body["detail"], body
    moved = ok(client.patch(patch, json={"point": W.tolist(), "inputs": {"dataset": "batches"}}))
    check_at(client, tape_id, moved, slice(None))

    # problems; a failed PATCH keeps the tape as it was (all 40 rows)
    body = problem(
        client.patch(patch, json={"inputs": {"dataset": "batches", "rows": [0, 40]}}), 422
    )
    assert "row 40 is out of range" in body["detail"] and "40 rows (0..39)" in body["detail"]
    body = problem(
        client.patch(patch, json={"inputs": {"X": {"dataset": "nope", "array": "X"}}}),
        404,
        "dataset-not-found",
    )
    assert "inputs.X: no stored dataset 'nope'" in body["detail"], body
    body = problem(
        client.patch(patch, json={"inputs": {"X": {"dataset": "batches", "array": "Z"}}}), 422
    )
    assert body["detail"].startswith("inputs.X.array: the dataset 'batches' has no array 'Z'")
    put_msgpack(client, "extra", {"X": X, "Y": Y, "Z": X})
    body = problem(client.patch(patch, json={"inputs": {"dataset": "extra"}}), 422)
    assert body["detail"].startswith("inputs.Z: the tape's definition has no input 'Z'"), body
    body = problem(
        client.patch(
            patch,
            json={
                "inputs": {
                    "X": {"dataset": "batches", "array": "X", "rows": [0, 1, 2]},
                    "Y": {"dataset": "batches", "array": "Y", "rows": [0, 1]},
                }
            },
        ),
        422,
    )
    assert body["detail"] == (
        "program line 2, column 27: multiply: shapes (2,) and (3,) do not broadcast"
    ), body
    body = problem(client.patch(patch, json={"inputs": {"X": t([[1, 2, 3]], "int32")}}), 422)
    assert body["detail"] == ("inputs.X: dtype int32 cannot replace the bound array's float64"), (
        body
    )
    body = problem(client.patch(patch, json={"inputs": {"X": {"dataset": "batches"}}}), 422)
    assert body["errors"][0]["field"].startswith("inputs.X"), body
    check_at(client, tape_id, post(client, f"/v1/tapes/{tape_id}/gradient", {}), slice(None))
    client.delete(patch)


# ---- an in-memory store: the arrays travel with the requests ---------------------------------


def test_datasets_with_an_in_memory_store(tmp_path) -> None:
    srv = start_server(
        {
            "GRADTAPE_STORE_PATH": ":memory:",
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
        },
        tmp_path / "server.log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            put_msgpack(c, "mem", {"X": X, "Y": Y})
            bound = {
                "variables": {"w": t(W, "float64")},
                "inputs": {"dataset": "mem", "rows": {"stop": 25}},
                "program": PROGRAM,
            }
            got = post(c, "/v1/gradient", {"definition": bound, "target": "loss"})
            assert without_execution(got) == without_execution(
                post(c, "/v1/gradient", {"definition": inline(slice(0, 25)), "target": "loss"})
            )
            # a stored model bound to it, at a new point
            assert (
                c.post("/v1/models", json={"name": "mem-model", "definition": bound}).status_code
                == 201
            )
            moved = post(
                c,
                "/v1/gradient",
                {"model": "mem-model", "target": "loss", "variables": {"w": (W + 1).tolist()}},
            )
            assert without_execution(moved) == without_execution(
                post(
                    c,
                    "/v1/gradient",
                    {
                        "definition": {
                            **inline(slice(0, 25)),
                            "variables": {"w": t(W + 1, "float64")},
                        },
                        "target": "loss",
                    },
                )
            )
            # a tape: recorded, rebuilt after its worker died, rebound by PATCH
            tape_id = create(c, {"definition": bound, "target": "loss"})["tape_id"]
            check_at(c, tape_id, got, slice(0, 25))
            kill_worker_of(srv, c, tape_id)
            check_at(c, tape_id, post(c, f"/v1/tapes/{tape_id}/gradient", {}), slice(0, 25))
            assert ok(c.get(f"/v1/tapes/{tape_id}"))["rebuilds"] == 1
            rows = {"start": 25, "stop": 40}
            patched = ok(
                c.patch(f"/v1/tapes/{tape_id}", json={"inputs": {"dataset": "mem", "rows": rows}})
            )
            check_at(c, tape_id, patched, slice(25, 40))
        assert not list(tmp_path.rglob("*.sqlite3*"))  # nothing on disk: the store is memory
    finally:
        stop_server(srv)


def test_point_over_onnx_initializers(server, client) -> None:
    """A point over sources that are initializers of an imported model (not variables of
    the definition): POST and PATCH record there, and a rebuild too."""
    from tests.engine.onnx.graphs import fixture
    from tests.service.test_onnx import b64, definition

    data, _ = fixture("transformer")
    defn = definition("transformer", {"onnx": b64(data)})
    bias = np.linspace(-1, 1, 10)

    def at(b: np.ndarray) -> dict:
        return post(
            client,
            "/v1/gradient",
            {
                "definition": {**defn, "variables": {"head.bias": t(b)}},
                "target": "loss",
                "sources": ["head.bias"],
            },
        )

    tape = create(
        client,
        {"definition": defn, "target": "loss", "sources": ["head.bias"], "point": bias.tolist()},
    )
    want = at(bias)
    assert tape["value"] == want["value"] and tape["gradients"] == want["gradients"]
    patched = ok(client.patch(f"/v1/tapes/{tape['tape_id']}", json={"point": (2 * bias).tolist()}))
    want = at(2 * bias)
    assert patched["value"] == want["value"] and patched["gradients"] == want["gradients"]
    kill_worker_of(server, client, tape["tape_id"])
    again = post(client, f"/v1/tapes/{tape['tape_id']}/gradient", {})
    assert again["value"] == want["value"] and again["gradients"] == want["gradients"]
    client.delete(f"/v1/tapes/{tape['tape_id']}")
