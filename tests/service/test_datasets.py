"""/v1/datasets: arrays stored on the server per API key, bound to a definition's or a
tape's inputs by name (all arrays, or one per input, with rows for mini-batches), kept
hot in the workers; over HTTP with real workers."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import msgpack
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import MSGPACK, arr, ok, post, problem, t, tbin

rng = np.random.default_rng(21)
X = rng.normal(size=(40, 3))
Y = (rng.uniform(size=40) < 0.5).astype(np.float64)
W = rng.normal(size=3)
PROGRAM = ["z = X @ w", "loss = mean(softplus(z) - Y * z)"]


def put_msgpack(client, name: str, arrays: dict) -> dict:
    r = client.put(
        f"/v1/datasets/{name}",
        content=msgpack.packb({k: tbin(v, "float64") for k, v in arrays.items()}),
        headers={"content-type": MSGPACK},
    )
    assert r.status_code in (200, 201), r.text
    return r.json()


def bound(inputs: dict) -> dict:
    """The definition with these inputs: bound to stored arrays as the API takes them (a
    whole dataset, or an array per input, with rows), or inline (`inline`)."""
    return {"variables": {"w": t(W, "float64")}, "inputs": inputs, "program": PROGRAM}


def inline(rows=None) -> dict:
    x, y = (X, Y) if rows is None else (X[rows], Y[rows])
    return bound({"X": t(x, "float64"), "Y": t(y, "float64")})


def test_put_get_list_delete(client) -> None:
    info = put_msgpack(client, "logit", {"X": X, "Y": Y})
    assert info["name"] == "logit" and info["bytes"] == X.nbytes + Y.nbytes
    assert info["arrays"] == {
        "X": {"dtype": "float64", "shape": [40, 3], "bytes": X.nbytes},
        "Y": {"dtype": "float64", "shape": [40], "bytes": Y.nbytes},
    }
    assert ok(client.get("/v1/datasets/logit")) == info
    assert "logit" in [d["name"] for d in ok(client.get("/v1/datasets"))["datasets"]]
    # JSON body, replacing: 200, a new version
    r = client.put("/v1/datasets/logit", json={"X": t(X, "float64"), "Y": t(Y, "float64")})
    assert r.status_code == 200 and r.json()["version"] == info["version"]  # same arrays
    tmp = client.put("/v1/datasets/tmp", json={"a": [1.0, 2.0]})
    assert tmp.status_code == 201 and tmp.json()["arrays"]["a"]["dtype"] == "float32"
    assert client.delete("/v1/datasets/tmp").status_code == 204
    body = problem(client.get("/v1/datasets/tmp"), 404, "dataset-not-found")
    assert "'tmp'" in body["detail"]
    problem(client.delete("/v1/datasets/tmp"), 404, "dataset-not-found")


def test_npz_and_npy_bodies_never_unpickled(client) -> None:
    buf = io.BytesIO()
    np.savez(buf, X=X, Y=Y)
    r = client.put(
        "/v1/datasets/npz",
        content=buf.getvalue(),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["arrays"]["X"]["shape"] == [40, 3]
    buf = io.BytesIO()
    np.save(buf, X)
    r = client.put(
        "/v1/datasets/npy?array=X",
        content=buf.getvalue(),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 201 and list(r.json()["arrays"]) == ["X"]
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    body = problem(
        client.put(
            "/v1/datasets/evil",
            content=buf.getvalue(),
            headers={"content-type": "application/octet-stream"},
        ),
        422,
    )
    assert "pickle" in body["detail"]
    problem(
        client.put(
            "/v1/datasets/junk",
            content=b"not numpy",
            headers={"content-type": "application/octet-stream"},
        ),
        422,
    )
    problem(
        client.put("/v1/datasets/text", content=b"x", headers={"content-type": "text/plain"}), 415
    )


def test_inputs_bound_by_dataset_match_inline_data(client) -> None:
    put_msgpack(client, "logit", {"X": X, "Y": Y})
    expected = post(client, "/v1/gradient", {"definition": inline(), "target": "loss"})
    whole = post(
        client,
        "/v1/gradient",
        {
            "definition": bound({"dataset": "logit"}),
            "target": "loss",
        },
    )
    per_input = post(
        client,
        "/v1/gradient",
        {
            "definition": bound(
                {
                    "X": {"dataset": "logit", "array": "X"},
                    "Y": {"dataset": "logit", "array": "Y"},
                }
            ),
            "target": "loss",
        },
    )
    for got in (whole, per_input):
        assert arr(got["value"]) == arr(expected["value"])
        np.testing.assert_array_equal(arr(got["gradients"]["w"]), arr(expected["gradients"]["w"]))


def test_rows_select_a_mini_batch(client) -> None:
    put_msgpack(client, "logit", {"X": X, "Y": Y})
    rows = [3, 0, 17, 39, 17]
    got = post(
        client,
        "/v1/gradient",
        {
            "definition": bound({"dataset": "logit", "rows": rows}),
            "target": "loss",
        },
    )
    want = post(client, "/v1/gradient", {"definition": inline(rows), "target": "loss"})
    assert arr(got["value"]) == arr(want["value"])
    sliced = post(
        client,
        "/v1/gradient",
        {
            "definition": bound({"dataset": "logit", "rows": {"start": 10, "stop": 30, "step": 2}}),
            "target": "loss",
        },
    )
    want = post(client, "/v1/gradient", {"definition": inline(slice(10, 30, 2)), "target": "loss"})
    assert arr(sliced["value"]) == arr(want["value"])
    body = problem(
        client.post(
            "/v1/gradient",
            json={
                "definition": bound({"dataset": "logit", "rows": [0, 40]}),
                "target": "loss",
            },
        ),
        422,
    )
    assert "row 40 is out of range" in body["detail"] and "40 rows (0..39)" in body["detail"]
    body = problem(
        client.post(
            "/v1/gradient",
            json={
                "definition": bound({"dataset": "logit", "rows": {"start": 0, "stop": 41}}),
                "target": "loss",
            },
        ),
        422,
    )
    assert "0..40" in body["detail"], body


@pytest.mark.parametrize("rows", [[], {"start": 5, "stop": 5}, {"start": 30, "stop": 10}])
def test_an_empty_mini_batch_is_refused(client, rows) -> None:
    """Issue 27, item 9: an empty mini-batch used to answer a loss of zero."""
    put_msgpack(client, "logit", {"X": X, "Y": Y})
    body = problem(
        client.post(
            "/v1/gradient",
            json={
                "definition": bound({"dataset": "logit", "rows": rows}),
                "target": "loss",
            },
        ),
        422,
    )
    assert "rows" in str(body) and ("at least 1" in str(body) or "no row" in body["detail"]), body


def test_unknown_dataset_or_array(client) -> None:
    body = problem(
        client.post(
            "/v1/gradient",
            json={
                "definition": bound({"dataset": "nope"}),
                "target": "loss",
            },
        ),
        404,
        "dataset-not-found",
    )
    assert "'nope'" in body["detail"]
    put_msgpack(client, "logit", {"X": X, "Y": Y})
    body = problem(
        client.post(
            "/v1/gradient",
            json={
                "definition": bound({"X": {"dataset": "logit", "array": "Z"}}),
                "target": "loss",
            },
        ),
        422,
    )
    assert "no array 'Z'" in body["detail"] and "X, Y" in body["detail"]


def test_overwrite_is_never_stale_and_tapes_keep_their_data(client) -> None:
    put_msgpack(client, "moving", {"X": X, "Y": Y})
    defn = bound({"dataset": "moving"})
    first = post(client, "/v1/gradient", {"definition": defn, "target": "loss"})
    tape = client.post("/v1/tapes", json={"definition": defn, "target": "loss"})
    assert tape.status_code == 201, tape.text
    tape_id = tape.json()["tape_id"]
    put_msgpack(client, "moving", {"X": 2 * X, "Y": Y})
    second = post(client, "/v1/gradient", {"definition": defn, "target": "loss"})
    want = post(
        client,
        "/v1/gradient",
        {
            "definition": {**inline(), "inputs": {"X": t(2 * X, "float64"), "Y": t(Y, "float64")}},
            "target": "loss",
        },
    )
    assert arr(second["value"]) == arr(want["value"]) != arr(first["value"])
    # the tape was bound to the first arrays; PATCH answers value and gradient there
    w2 = W + 0.5
    patched = ok(client.patch(f"/v1/tapes/{tape_id}", json={"variables": {"w": t(w2, "float64")}}))
    at_w2 = post(
        client,
        "/v1/gradient",
        {"definition": {**inline(), "variables": {"w": t(w2, "float64")}}, "target": "loss"},
    )
    assert arr(patched["value"]) == arr(at_w2["value"])
    np.testing.assert_array_equal(arr(patched["gradients"]["w"]), arr(at_w2["gradients"]["w"]))
    client.delete(f"/v1/tapes/{tape_id}")


def test_models_bind_datasets(client) -> None:
    put_msgpack(client, "logit", {"X": X, "Y": Y})
    r = client.post(
        "/v1/models",
        json={
            "name": "logit-model",
            "replace": True,
            "definition": bound({"dataset": "logit"}),
        },
    )
    assert r.status_code in (200, 201), r.text
    got = post(
        client,
        "/v1/gradient",
        {"model": "logit-model", "target": "loss", "variables": {"w": (W + 1).tolist()}},
    )
    want = post(
        client,
        "/v1/gradient",
        {"definition": {**inline(), "variables": {"w": t(W + 1, "float64")}}, "target": "loss"},
    )
    assert arr(got["value"]) == arr(want["value"])


# ---- owners, limits, the workers' memory -----------------------------------------------

KEYS = ("dataset-key-a", "dataset-key-b")


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("datasets")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(folder / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": ", ".join(KEYS),
            "GRADTAPE_MAX_DATASET_BYTES": "4000",
            "GRADTAPE_MAX_DATASET_BYTES_PER_KEY": "6000",
            "GRADTAPE_MAX_DATASETS_PER_KEY": "3",
            "GRADTAPE_WORKER_DATASET_MEMORY": "2500",  # about one 40x3 + 40 float64 dataset
        },
        folder / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def keyed(srv: Server, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=srv.base_url, timeout=60.0, headers={"Authorization": f"Bearer {key}"}
    )


def test_owned_by_the_key_and_size_limits(limited: Server) -> None:
    with keyed(limited, KEYS[0]) as a, keyed(limited, KEYS[1]) as b:
        put_msgpack(a, "mine", {"X": X, "Y": Y})  # 1280 bytes
        problem(b.get("/v1/datasets/mine"), 404, "dataset-not-found")
        assert ok(b.get("/v1/datasets"))["datasets"] == []
        problem(
            b.post(
                "/v1/gradient",
                json={
                    "definition": bound({"dataset": "mine"}),
                    "target": "loss",
                },
            ),
            404,
            "dataset-not-found",
        )
        big = np.zeros(501)  # 4008 bytes > max_dataset_bytes
        body = problem(
            a.put("/v1/datasets/big", json={"a": t(big, "float64")}), 413, "dataset-too-large"
        )
        assert "4,008 bytes" in body["detail"] and "max_dataset_bytes" in body["detail"]
        put_msgpack(a, "second", {"a": np.zeros(450)})  # 3600: 4880 held
        body = problem(
            a.put("/v1/datasets/third", json={"a": t(np.zeros(200), "float64")}),
            413,
            "dataset-too-large",
        )
        assert "6,480 bytes" in body["detail"] and "max_dataset_bytes_per_key" in body["detail"]
        # replacing counts the new arrays, not the old ones as well
        put_msgpack(a, "second", {"a": np.zeros(500)})
        put_msgpack(a, "third", {"a": np.zeros(10)})
        body = problem(a.put("/v1/datasets/fourth", json={"a": [1.0]}), 413)
        assert "max_datasets_per_key" in body["detail"]


def test_worker_memory_budget_evicts_but_answers_stay_right(limited: Server) -> None:
    """Two datasets that do not fit the worker's budget together, used in turns: each
    miss reads the store again, and every answer matches the data sent inline."""
    with keyed(limited, KEYS[1]) as c:
        put_msgpack(c, "one", {"X": X, "Y": Y})
        put_msgpack(c, "two", {"X": -X, "Y": 1 - Y})
        want = {
            "one": post(c, "/v1/gradient", {"definition": inline(), "target": "loss"}),
            "two": post(
                c,
                "/v1/gradient",
                {
                    "definition": {
                        **inline(),
                        "inputs": {"X": t(-X, "float64"), "Y": t(1 - Y, "float64")},
                    },
                    "target": "loss",
                },
            ),
        }
        for name in ("one", "two", "one", "two", "two"):
            got = post(
                c,
                "/v1/gradient",
                {
                    "definition": bound({"dataset": name}),
                    "target": "loss",
                },
            )
            assert arr(got["value"]) == arr(want[name]["value"]), name


def test_the_cache_is_an_lru_by_content(tmp_path) -> None:
    from service.core.store import Store
    from service.worker.datasets import DatasetCache

    store = Store(tmp_path / "store.db")
    store.open()
    rows = {
        n: store.put_dataset("", n, {"a": np.full(100, i, np.float64)})
        for i, n in enumerate(("p", "q", "r"))
    }
    blobs = {n: row.arrays[0].blob for n, row in rows.items()}
    cache = DatasetCache(str(tmp_path / "store.db"), budget=2000)  # two arrays of 800 bytes
    for n in ("p", "q", "p", "r"):
        assert cache.array(blobs[n])[0] == "pqr".index(n)
    assert cache.info() == {"arrays": 2, "bytes": 1600, "budget": 2000, "hits": 1, "misses": 3}
    cache.array(blobs["p"])  # p was used after q: q went, p stayed
    assert cache.hits == 2
    cache.array(blobs["q"])
    assert cache.misses == 4
    # a replaced dataset has new blobs: the cache never answers the old values
    new = store.put_dataset("", "p", {"a": np.full(100, 7.0)})
    assert cache.array(new.arrays[0].blob)[0] == 7.0
    store.close()


@pytest.mark.parametrize(
    ("rows", "field", "message"),
    [
        ({"start": 0, "stop": 3, "step": 0}, "rows.RowSlice.step", "greater than or equal to 1"),
        ({"start": 0, "bogus": 1}, "rows.RowSlice.bogus", "Extra inputs"),
        ([2**63], "rows.0", "less than or equal to"),
    ],
)
def test_a_bad_mini_batch_names_what_is_wrong_with_it(client, rows, field, message) -> None:
    """rows is a list or a slice: the problem shown first is the one with the form sent
    (it was 'rows.list[function-before[whole_float(), constrained-int]]: Input should be
    a valid list' for a slice whose step is 0)."""
    body = problem(
        client.post(
            "/v1/gradient",
            json={"definition": bound({"dataset": "logit", "rows": rows}), "target": "loss"},
        ),
        422,
        "validation",
    )
    assert body["detail"].startswith(f"definition.inputs.DatasetInputs.{field}: "), body
    assert message in body["detail"], body
    assert "[" not in body["errors"][0]["field"], body


def test_rows_out_of_range_name_the_field_as_written(client) -> None:
    """Rows past a dataset's array: a 422 whose `errors` name the field the client wrote
    (definition.inputs.X.rows, or inputs.X.rows on PATCH), its detail the array, the
    dataset and its rows. Before: 'inputs.X (dataset ..., array ...)' from the worker,
    no `errors` entry, a field the request never had."""
    put_msgpack(client, "logit", {"X": X, "Y": Y})  # 40 rows
    whole = {"dataset": "logit", "rows": {"start": 0, "stop": 50}}
    each = {
        "X": {"dataset": "logit", "array": "X", "rows": [0, 40]},
        "Y": {"dataset": "logit", "array": "Y", "rows": [0, 1]},
    }
    cases = [
        ("/v1/gradient", bound(whole), "definition.inputs.rows", "rows 0:50 is out of range"),
        ("/v1/gradient", bound(each), "definition.inputs.X.rows", "row 40 is out of range"),
        ("/v1/tapes", bound(each), "definition.inputs.X.rows", "row 40 is out of range"),
    ]
    for path, definition, field, said in cases:
        body = problem(client.post(path, json={"definition": definition, "target": "loss"}), 422)
        assert [e["field"] for e in body["errors"]] == [field], (path, body)
        assert body["detail"].startswith(f"{field}: {said}"), (path, body)
        assert "of dataset 'logit' has 40 rows" in body["detail"], (path, body)
    # PATCH: the tape's inputs are at the top of the body; the tape stays as it was.
    made = client.post(
        "/v1/tapes", json={"definition": bound(whole | {"rows": [0, 1]}), "target": "loss"}
    )
    assert made.status_code == 201, made.text
    tape = made.json()["tape_id"]
    moved = client.patch(f"/v1/tapes/{tape}", json={"inputs": {"X": each["X"]}})
    body = problem(moved, 422)
    assert [e["field"] for e in body["errors"]] == ["inputs.X.rows"], body
    assert body["detail"].startswith("inputs.X.rows: row 40 is out of range"), body
    kept = post(client, f"/v1/tapes/{tape}/gradient", {})
    assert kept["value"] == made.json()["value"] and kept["gradients"] == made.json()["gradients"]
    # In range: answered as before.
    inside = {"dataset": "logit", "rows": {"start": 30, "stop": 40}}
    ok = post(client, "/v1/gradient", {"definition": bound(inside), "target": "loss"})
    want = post(client, "/v1/gradient", {"definition": inline(slice(30, 40)), "target": "loss"})
    assert arr(ok["value"]) == arr(want["value"])
    client.delete(f"/v1/tapes/{tape}")
