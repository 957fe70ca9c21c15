"""POST /v1/hvp: one vector or many in one batched pass. The stateless half of
SCENARIOS.md 14: batched HVPs equal fresh single ones and the Hessian's products (reuse
across requests is issue 6's tapes)."""

from __future__ import annotations

import numpy as np

from tests.service.wire import arr, post, problem, t

rng = np.random.default_rng(14)
X = rng.standard_normal((6, 4))
DEFN = {
    "variables": {
        "k": t(rng.standard_normal((4, 3)), "float64"),
        "b": t(rng.standard_normal(3), "float64"),
    },
    "inputs": {"x": t(X, "float64")},
    "program": ["loss = sum(tanh(x @ k + b) ** 2)"],
}


def _flat(blocks: dict, i: str, j: str) -> np.ndarray:
    sizes = {"k": 12, "b": 3}
    return arr(blocks[i][j]).reshape(sizes[i], sizes[j])


def test_many_vectors_in_one_pass_equal_single_ones_and_the_hessian(client) -> None:
    hessian = post(client, "/v1/hessian", {"definition": DEFN, "target": "loss"})["hessian"]
    h = np.block([[_flat(hessian, i, j) for j in "kb"] for i in "kb"])
    vectors = [{"k": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)} for _ in range(5)]
    wire = [{k: t(v, "float64") for k, v in vec.items()} for vec in vectors]
    batched = post(client, "/v1/hvp", {"definition": DEFN, "target": "loss", "vectors": wire})
    assert batched["hvp"] is None and len(batched["hvps"]) == 5
    for vec, one_wire, product in zip(vectors, wire, batched["hvps"], strict=True):
        expected = h @ np.concatenate([vec["k"].reshape(-1), vec["b"]])
        got = np.concatenate([arr(product["k"]).reshape(-1), arr(product["b"])])
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
        single = post(client, "/v1/hvp", {"definition": DEFN, "target": "loss", "vector": one_wire})
        assert single["hvps"] is None
        for key in ("k", "b"):
            np.testing.assert_allclose(arr(single["hvp"][key]), arr(product[key]), rtol=1e-12)


def test_vectors_keyed_by_alias(client) -> None:
    body = {
        "definition": DEFN,
        "target": "loss",
        "sources": {"bias": "b"},
        "vector": {"bias": t(np.ones(3), "float64")},
    }
    answer = post(client, "/v1/hvp", body)
    assert set(answer["hvp"]) == {"bias"} and set(answer["gradients"]) == {"bias"}


def test_vector_problems_name_the_field(client) -> None:
    base = {"definition": DEFN, "target": "loss", "sources": ["b"]}
    wrong_shape = problem(
        client.post("/v1/hvp", json={**base, "vector": {"b": t(np.ones(4))}}),
        422,
        "invalid-request",
    )
    assert "vector.b" in wrong_shape["detail"] and "[4]" in wrong_shape["detail"]
    missing = problem(
        client.post("/v1/hvp", json={**base, "vectors": [{"k": t(np.ones(3))}]}),
        422,
        "invalid-request",
    )
    assert "vectors.0" in missing["detail"] and "'b'" in missing["detail"]
    both = problem(
        client.post("/v1/hvp", json={**base, "vector": {}, "vectors": [{}]}), 422, "validation"
    )
    assert "exactly one" in both["detail"]
    # The fields named, not 'body': the two given, or `vector` when none is (on a tape
    # too, where {"curvature": "ggn"} alone answered 'body: Value error, ...').
    assert [e["field"] for e in both["errors"]] == ["vector", "vectors"], both
    assert both["detail"].startswith("vector: give exactly one of"), both
    made = client.post("/v1/tapes", json={"definition": DEFN, "target": "loss"})
    assert made.status_code == 201, made.text
    tape = made.json()["tape_id"]
    for path, body in (("/v1/hvp", base), (f"/v1/tapes/{tape}/hvp", {"curvature": "ggn"})):
        none = problem(client.post(path, json=body), 422, "validation")
        assert [e["field"] for e in none["errors"]] == ["vector"], (path, none)
        assert none["detail"].startswith("vector: give exactly one of 'vector'"), (path, none)
    client.delete(f"/v1/tapes/{tape}")
    many = [{"b": t(np.ones(3))}] * 33  # the tests' server answers up to 32
    problem(client.post("/v1/hvp", json={**base, "vectors": many}), 422, "too-large")


# A 0-d parameter beside a 1-d one (issue 18): loss = sum(w^3) b^2, its HVP in closed form.
ZERO_D = {"variables": {"w": [1.0, 2.0], "b": 0.5}, "program": ["loss = sum(w * w * w) * b * b"]}


def _zero_d_hvp(vw: np.ndarray, vb: float) -> dict[str, np.ndarray]:
    w, b = np.array([1.0, 2.0]), 0.5
    return {
        "w": 6 * w * b * b * vw + 6 * w * w * b * vb,
        "b": np.asarray(np.sum(6 * w * w * b * vw) + 2 * np.sum(w**3) * vb),
    }


def _assert_zero_d_answer(product: dict, vw: list[float], vb: float) -> None:
    expected = _zero_d_hvp(np.array(vw), vb)
    for key in ("w", "b"):
        assert isinstance(product[key], dict), f"{key}: {product[key]!r} is not a tensor"
        assert product[key]["shape"] == list(expected[key].shape)
        np.testing.assert_allclose(arr(product[key]), expected[key], rtol=1e-6)


def test_a_0d_parameter_answers_a_0d_tensor_single_and_batched(client) -> None:
    body = {"definition": ZERO_D, "target": "loss"}
    single = post(client, "/v1/hvp", {**body, "vector": {"w": [1, 0], "b": 1.0}})
    _assert_zero_d_answer(single["hvp"], [1, 0], 1.0)
    vectors = [{"w": [1, 0], "b": 1.0}, {"w": [0, 1], "b": -2.0}]
    batched = post(client, "/v1/hvp", {**body, "vectors": vectors})
    for vector, product in zip(vectors, batched["hvps"], strict=True):
        _assert_zero_d_answer(product, vector["w"], vector["b"])


def test_a_0d_parameter_on_a_tape_answers_a_0d_tensor(client) -> None:
    created = client.post("/v1/tapes", json={"definition": ZERO_D, "target": "loss"})
    assert created.status_code == 201, created.text
    tape = created.json()["tape_id"]
    try:
        single = post(client, f"/v1/tapes/{tape}/hvp", {"vector": {"w": [1, 0], "b": 1.0}})
        _assert_zero_d_answer(single["hvp"], [1, 0], 1.0)
        vectors = [{"w": [1, 0], "b": 1.0}, {"w": [0.5, 1], "b": 3.0}]
        batched = post(client, f"/v1/tapes/{tape}/hvp", {"vectors": vectors})
        for vector, product in zip(vectors, batched["hvps"], strict=True):
            _assert_zero_d_answer(product, vector["w"], vector["b"])
    finally:
        client.delete(f"/v1/tapes/{tape}")


def test_repeated_requests_with_new_values_answer_the_closed_form(client) -> None:
    """One structure, new values each time (a worker compiles the pass on its second
    request and replays it afterwards): every answer is the closed form's, for one vector
    and for two."""
    for i in range(6):
        x, k, b = (rng.standard_normal(s) for s in [(6, 4), (4, 3), (3,)])
        vectors = [
            {"k": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
            for _ in range(1 + i % 2)
        ]
        body = {
            "definition": {
                **DEFN,
                "variables": {"k": t(k, "float64"), "b": t(b, "float64")},
                "inputs": {"x": t(x, "float64")},
            },
            "target": "loss",
            "vectors": [{n: t(v, "float64") for n, v in vec.items()} for vec in vectors],
        }
        answer = post(client, "/v1/hvp", body)
        th = np.tanh(x @ k + b)
        dz, s = 2 * th * (1 - th**2), 2 * (1 - th**2) * (1 - 3 * th**2)
        np.testing.assert_allclose(arr(answer["value"]), np.sum(th**2), rtol=1e-12)
        np.testing.assert_allclose(arr(answer["gradients"]["k"]), x.T @ dz, rtol=1e-10)
        for vec, product in zip(vectors, answer["hvps"], strict=True):
            dzv = s * (x @ vec["k"] + vec["b"])
            np.testing.assert_allclose(arr(product["k"]), x.T @ dzv, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(arr(product["b"]), dzv.sum(0), rtol=1e-10, atol=1e-12)
