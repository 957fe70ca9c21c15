"""Issue 12 over HTTP with real workers: a definition's default dtype, plain functions
(the WGAN-GP critic written once), stored models at new points."""

from __future__ import annotations

import msgpack
import numpy as np

from tests.language.test_functions_dtype import DATA, EXPANDED_LINES, PARAMS, wgan
from tests.service.wire import (
    arr,
    num,
    ok,
    post,
    post_msgpack,
    problem,
    t,
    without_execution,
)


def listed(values: dict[str, np.ndarray]) -> dict[str, list]:
    """Bare nested lists: float64 only through the definition's dtype."""
    return {k: np.asarray(v).tolist() for k, v in values.items()}


def wgan_wire(params: dict[str, np.ndarray] = PARAMS) -> dict:
    defn = wgan(params)
    return {**defn, "variables": listed(defn["variables"]), "inputs": listed(DATA)}


# ---- dtype ----------------------------------------------------------------------------


def test_default_dtype_float64_json_and_msgpack(client) -> None:
    defn = {
        "dtype": "float64",
        "variables": {"w": [0.1, 0.2]},
        "inputs": {"c": 1e-300},
        "program": ["y = sum(w * w) + c"],
    }
    body = {"definition": defn, "target": "y"}
    for answer in (
        post(client, "/v1/gradient", body),
        ok(post_msgpack(client, "/v1/gradient", body)),
    ):
        assert answer["value"]["dtype"] == "float64"
        assert arr(answer["value"]) == np.float64(0.1) ** 2 + np.float64(0.2) ** 2 + 1e-300
        np.testing.assert_array_equal(arr(answer["gradients"]["w"]), [0.2, 0.4])
        assert answer["gradients"]["w"]["dtype"] == "float64"
    # without it: float32, as before
    answer = post(
        client,
        "/v1/gradient",
        {"definition": {**defn, "dtype": None, "inputs": {"c": 0.0}}, "target": "y"},
    )
    assert answer["value"]["dtype"] == "float32"


def test_default_dtype_mixing_is_the_clear_error(client) -> None:
    defn = {
        "dtype": "float64",
        "variables": {"w": [0.1, 0.2]},
        "inputs": {"x": t([1.0, 2.0], "float32")},
        "program": ["y = sum(w * x)"],
    }
    body = problem(client.post("/v1/gradient", json={"definition": defn, "target": "y"}), 422)
    assert "float64" in body["detail"] and "float32" in body["detail"], body
    bad = problem(
        client.post("/v1/gradient", json={"definition": {**defn, "dtype": "int32"}, "target": "y"}),
        422,
    )
    assert "dtype" in bad["detail"], bad


# ---- plain functions -------------------------------------------------------------------


def test_wgan_gp_critic_written_once_over_http(client) -> None:
    once = post(client, "/v1/gradient", {"definition": wgan_wire(), "target": "loss"})
    written = post(
        client,
        "/v1/gradient",
        {
            "definition": {
                "dtype": "float64",
                "variables": listed(PARAMS),
                "inputs": listed(DATA),
                "program": EXPANDED_LINES,
            },
            "target": "loss",
        },
    )
    assert once["value"]["dtype"] == "float64"
    np.testing.assert_allclose(arr(once["value"]), arr(written["value"]), rtol=1e-14)
    assert sorted(once["gradients"]) == sorted(f"critic.{k}" for k in PARAMS)
    for k in PARAMS:
        np.testing.assert_allclose(
            arr(once["gradients"][f"critic.{k}"]), arr(written["gradients"][k]), rtol=1e-12
        )
    # second order: HVPs of the critic written once = written out three times
    rng = np.random.default_rng(3)
    vector = {k: rng.normal(size=v.shape) for k, v in PARAMS.items()}
    h1 = post(
        client,
        "/v1/hvp",
        {
            "definition": wgan_wire(),
            "target": "loss",
            "vector": {f"critic.{k}": t(v, "float64") for k, v in vector.items()},
        },
    )
    h2 = post(
        client,
        "/v1/hvp",
        {
            "definition": {
                "dtype": "float64",
                "variables": listed(PARAMS),
                "inputs": listed(DATA),
                "program": EXPANDED_LINES,
            },
            "target": "loss",
            "vector": {k: t(v, "float64") for k, v in vector.items()},
        },
    )
    for k in PARAMS:
        np.testing.assert_allclose(
            arr(h1["hvp"][f"critic.{k}"]), arr(h2["hvp"][k]), rtol=1e-11, atol=1e-13
        )


def test_recursion_over_http_names_the_cycle(client) -> None:
    defn = {
        "inputs": {"x": 1.0},
        "program": ["y = f(x)"],
        "functions": {
            "f": {"params": ["a"], "forward": ["b = g(a)"]},
            "g": {"params": ["a"], "forward": ["b = f(a)"]},
        },
    }
    body = problem(client.post("/v1/gradient", json={"definition": defn, "target": "y"}), 422)
    assert "f -> g -> f" in body["detail"], body


# ---- stored models at new points ---------------------------------------------------------


def test_model_with_new_variables_on_every_route_and_tapes(client) -> None:
    r = client.post(
        "/v1/models", json={"name": "wgan-gp", "definition": wgan_wire(), "replace": True}
    )
    assert r.status_code in (200, 201), r.text
    rng = np.random.default_rng(9)
    moved = {**PARAMS, "w1": PARAMS["w1"] + 0.1 * rng.normal(size=PARAMS["w1"].shape)}
    expected = post(client, "/v1/gradient", {"definition": wgan_wire(moved), "target": "loss"})
    new = {"critic.w1": moved["w1"].tolist()}  # bare lists take the variable's float64
    got = post(client, "/v1/gradient", {"model": "wgan-gp", "variables": new, "target": "loss"})
    assert arr(got["value"]) == arr(expected["value"])
    for k in got["gradients"]:
        np.testing.assert_array_equal(arr(got["gradients"][k]), arr(expected["gradients"][k]))
    # msgpack, and the stored model itself is untouched
    packed = ok(
        post_msgpack(
            client, "/v1/gradient", {"model": "wgan-gp", "variables": new, "target": "loss"}
        )
    )
    assert arr(packed["value"]) == arr(expected["value"])
    stored = post(client, "/v1/gradient", {"model": "wgan-gp", "target": "loss"})
    assert arr(stored["value"]) != arr(expected["value"])
    # hessian / hvp / jacobian take them too
    for path, extra in (
        ("/v1/hvp", {"vector": {"critic.b2": [1.0]}, "sources": ["critic.b2"]}),
        ("/v1/jacobian", {"sources": ["critic.b2"]}),
        ("/v1/hessian", {"sources": ["critic.b2"]}),
    ):
        a = post(client, path, {"model": "wgan-gp", "variables": new, "target": "loss", **extra})
        b = post(client, path, {"definition": wgan_wire(moved), "target": "loss", **extra})
        assert without_execution(a) == without_execution(b), path
    # a tape recorded at the new point
    r = client.post("/v1/tapes", json={"model": "wgan-gp", "variables": new, "target": "loss"})
    assert r.status_code == 201, r.text
    assert arr(r.json()["value"]) == arr(expected["value"])
    client.delete(f"/v1/tapes/{r.json()['tape_id']}")


def test_model_variables_are_checked(client) -> None:
    model = {
        "dtype": "float64",
        "variables": {"w": [[1.0, 2.0]]},
        "inputs": {"x": [3.0, 4.0]},
        "program": ["y = sum(w * x)"],
    }
    r = client.post("/v1/models", json={"name": "tiny64", "definition": model, "replace": True})
    assert r.status_code in (200, 201), r.text
    body = problem(
        client.post(
            "/v1/gradient",
            json={"model": "tiny64", "variables": {"w": [1.0, 2.0, 3.0]}, "target": "y"},
        ),
        422,
    )
    assert body["detail"] == (
        "variables.w: float64[3] given, but the model's variable is float64[1, 2]"
    ), body
    body = problem(
        client.post(
            "/v1/gradient", json={"model": "tiny64", "variables": {"v": 1.0}, "target": "y"}
        ),
        422,
    )
    assert body["detail"] == "variables.v: the model has no variable 'v' (its variables: w)"
    body = problem(
        client.post(
            "/v1/gradient",
            json={"model": "tiny64", "variables": {"w": t([[1.0, 2.0]], "float32")}, "target": "y"},
        ),
        422,
    )
    assert "float32[1, 2] given" in body["detail"]
    body = problem(
        client.post(
            "/v1/gradient",
            json={"definition": model, "variables": {"w": [[1.0, 2.0]]}, "target": "y"},
        ),
        422,
    )
    assert "goes with 'model'" in body["detail"], body
    assert (
        num(
            post(
                client,
                "/v1/gradient",
                {"model": "tiny64", "variables": {"w": [[0.5, 0.0]]}, "target": "y"},
            )["value"]
        )
        == 1.5
    )
    assert msgpack  # msgpack bodies are exercised above


# ---- flat vectors ------------------------------------------------------------------------


def test_flat_answers_follow_the_sources_order(client) -> None:
    defn = {
        "dtype": "float64",
        "variables": {"a": [[1.0, 2.0], [3.0, 4.0]], "b": 0.5, "c": [1.0, 1.0]},
        "program": ["loss = sum(a ** 2) * b + sum(a) * b ** 3"],
    }
    named = post(
        client,
        "/v1/gradient",
        {"definition": defn, "target": "loss", "sources": {"B": "b", "A": "a", "C": "c"}},
    )
    flat = post(
        client,
        "/v1/gradient",
        {
            "definition": defn,
            "target": "loss",
            "flat": True,
            "sources": {"B": "b", "A": "a", "C": "c"},
        },
    )
    assert flat["gradients"] == {}
    assert flat["flat"]["order"] == [
        {"source": "B", "shape": [], "offset": 0, "size": 1},
        {"source": "A", "shape": [2, 2], "offset": 1, "size": 4},
        {"source": "C", "shape": [2], "offset": 5, "size": 2},  # unconnected: zeros
    ]
    want = np.concatenate(
        [
            arr(named["gradients"]["B"]).reshape(-1),
            arr(named["gradients"]["A"]).reshape(-1),
            np.zeros(2),
        ]
    )
    np.testing.assert_array_equal(arr(flat["flat"]["gradient"]), want)
    # a point moves every source at once, in that order
    point = [2.0, 1.0, 0.0, 0.0, -1.0, 7.0, 7.0]
    moved = post(
        client,
        "/v1/gradient",
        {
            "definition": defn,
            "target": "loss",
            "flat": True,
            "sources": {"B": "b", "A": "a", "C": "c"},
            "point": point,
        },
    )
    # loss = 2*(1+1) + 0 * 8: d/db = (2) + 3*4*0 = 2 ... computed by a plain request:
    plain = post(
        client,
        "/v1/gradient",
        {
            "definition": {
                **defn,
                "variables": {"a": [[1.0, 0.0], [0.0, -1.0]], "b": 2.0, "c": [7.0, 7.0]},
            },
            "target": "loss",
            "sources": ["b", "a"],
        },
    )
    np.testing.assert_array_equal(
        arr(moved["flat"]["gradient"])[:5],
        np.concatenate(
            [arr(plain["gradients"]["b"]).reshape(-1), arr(plain["gradients"]["a"]).reshape(-1)]
        ),
    )
    # HVPs with a flat vector and a flat answer
    hv = post(
        client,
        "/v1/hvp",
        {
            "definition": defn,
            "target": "loss",
            "sources": ["a", "b"],
            "flat_vector": [1, 0, 0, 0, 1],
            "flat": True,
        },
    )
    by_name = post(
        client,
        "/v1/hvp",
        {
            "definition": defn,
            "target": "loss",
            "sources": ["a", "b"],
            "vector": {"a": [[1, 0], [0, 0]], "b": 1.0},
        },
    )
    np.testing.assert_array_equal(
        arr(hv["flat"]["hvp"]),
        np.concatenate(
            [arr(by_name["hvp"]["a"]).reshape(-1), arr(by_name["hvp"]["b"]).reshape(-1)]
        ),
    )


def test_a_point_follows_the_requests_own_variable_order(client) -> None:
    """One client's definition must not decide how another's flat point is read: the same
    program with its variables in the other order reads the point in its own order."""
    program = ["loss = sum(a * a) + 10 * b * b"]
    first = {"variables": {"a": [1.0, 2.0], "b": 0.5}, "program": program}
    second = {"variables": {"b": 0.5, "a": [1.0, 2.0]}, "program": program}
    one = post(
        client,
        "/v1/gradient",
        {"definition": first, "target": "loss", "point": [3.0, 4.0, 1.0], "flat": True},
    )
    assert [o["source"] for o in one["flat"]["order"]] == ["a", "b"]
    np.testing.assert_array_equal(arr(one["flat"]["gradient"]), [6.0, 8.0, 20.0])
    other = post(
        client,
        "/v1/gradient",
        {"definition": second, "target": "loss", "point": [1.0, 3.0, 4.0], "flat": True},
    )
    assert [o["source"] for o in other["flat"]["order"]] == ["b", "a"]
    np.testing.assert_array_equal(arr(other["flat"]["gradient"]), [20.0, 6.0, 8.0])


def test_flat_vectors_of_the_wrong_length_name_both(client) -> None:
    defn = {"variables": {"a": [1.0, 2.0], "b": 0.5}, "program": ["loss = sum(a) * b"]}
    body = problem(
        client.post(
            "/v1/gradient", json={"definition": defn, "target": "loss", "point": [1.0, 2.0]}
        ),
        422,
    )
    assert body["detail"] == (
        "point: a flat vector of the sources needs shape [3] (a[2], b[]), got [2]"
    ), body
    body = problem(
        client.post("/v1/hvp", json={"definition": defn, "target": "loss", "flat_vector": [1.0]}),
        422,
    )
    assert "flat_vector" in body["detail"] and "[3]" in body["detail"], body
    r = client.post("/v1/tapes", json={"definition": defn, "target": "loss"})
    tape_id = r.json()["tape_id"]
    body = problem(client.patch(f"/v1/tapes/{tape_id}", json={"point": [1.0]}), 422)
    assert "needs shape [3]" in body["detail"], body
    moved = ok(client.patch(f"/v1/tapes/{tape_id}", json={"point": [1.0, 1.0, 3.0], "flat": True}))
    np.testing.assert_array_equal(arr(moved["flat"]["gradient"]), [3.0, 3.0, 2.0])
    client.delete(f"/v1/tapes/{tape_id}")
