"""Every operation of openapi/openapi.json answers as the contract says (issue 18, item 4).

Each operation is driven against the real server with 0-d, 1-d and n-d parameters,
sources absent / a name / a list / an alias mapping, single and batched vectors, in all
three encodings (JSON lists, base64, msgpack). Each answer is checked by
tests/service/conformance.py: a status and content type the spec declares, the response
schema, every tensor decoding to the shape it claims in the encoding asked for. The
numbers are checked too: against central finite differences of the same program in
NumPy (float64), or closed forms.

`test_every_operation_is_covered` fails when the spec has an operation that no test here
drives (add its driver to DRIVERS), or when a driving test ran without reaching it.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import numpy as np
import pytest

from tests.service.conformance import (
    COVERED,
    ENCODINGS,
    JSON,
    MSGPACK,
    Encoding,
    check,
    decode,
    spec_operations,
    validate,
)

RTOL, ATOL = 1e-5, 1e-6  # float64 answers against float64 finite differences

# -- the program: a 0-d, a 1-d and a 2-d parameter, two inputs ---------------------------

PROGRAM = [
    "z = M @ (w * x)",
    "y = tanh(z) * a",
    "b = tanh(X * w) * a",
    (
        "loss = a * a * sum(w * w * w) + sum(y) + 0.1 * sum(b) + sum(M * M * M) * a"
        " + 5 * (a * a + sum(w * w) + sum(M * M))"
    ),
]
POINT: dict[str, np.ndarray] = {
    "a": np.array(0.7),
    "w": np.array([0.3, -0.5, 0.9]),
    "M": np.array([[0.1, 0.2, -0.3], [0.4, -0.1, 0.2]]),
    "x": np.array([1.0, 2.0, -1.0]),
    "X": np.array([[0.5, -1.0, 0.25], [1.5, 0.2, -0.7], [-0.3, 0.8, 1.1], [0.0, -0.4, 0.6]]),
}
VARIABLES = ("a", "w", "M")
INPUTS = ("x", "X")


def forward(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    a, w, M, x, X = p["a"], p["w"], p["M"], p["x"], p["X"]
    z = M @ (w * x)
    y = np.tanh(z) * a
    b = np.tanh(X * w) * a
    loss = (
        a * a * np.sum(w**3)
        + np.sum(y)
        + 0.1 * np.sum(b)
        + np.sum(M**3) * a
        + 5 * (a * a + np.sum(w * w) + np.sum(M * M))
    )
    return {"z": z, "y": y, "b": b, "loss": np.asarray(loss)}


def fd_jacobian(fn, point: dict[str, np.ndarray], src: str, h: float) -> np.ndarray:
    """d fn(point) / d point[src], by central differences: out.shape + src.shape."""
    base = np.asarray(fn(point))
    out = np.zeros(base.shape + point[src].shape)
    for idx in np.ndindex(point[src].shape):
        plus = {**point, src: point[src].copy()}
        minus = {**point, src: point[src].copy()}
        plus[src][idx] += h
        minus[src][idx] -= h
        out[(...,) + idx] = (np.asarray(fn(plus)) - np.asarray(fn(minus))) / (2 * h)
    return out


@functools.cache
def _jac(target: str, src: str, key: tuple = ()) -> np.ndarray:
    point = _point(key)
    return fd_jacobian(lambda p: forward(p)[target], point, src, 1e-6)


@functools.cache
def _hess(p: str, q: str, key: tuple = ()) -> np.ndarray:
    """The Hessian block d2 loss / dp dq: p.shape + q.shape."""
    point = _point(key)
    grad_p = lambda pt: fd_jacobian(lambda pp: forward(pp)["loss"], pt, p, 1e-4)
    return fd_jacobian(grad_p, point, q, 1e-4)


def _point(key: tuple) -> dict[str, np.ndarray]:
    """POINT with some values replaced: key is ((name, tuple(flat values)), ...)."""
    point = {k: v.astype(np.float64) for k, v in POINT.items()}
    for name, flat in key:
        point[name] = np.asarray(flat, dtype=np.float64).reshape(POINT[name].shape)
    return point


def value_of(name: str, key: tuple = ()) -> np.ndarray:
    return forward(_point(key))[name]


def hvp_ref(
    sources: dict[str, str], vector: dict[str, np.ndarray], key: tuple = ()
) -> dict[str, np.ndarray]:
    out = {}
    for k, p in sources.items():
        out[k] = sum(
            np.tensordot(_hess(p, q, key), vector[kq], axes=vector[kq].ndim)
            for kq, q in sources.items()
        )
    return out


def dense_hessian(sources: dict[str, str]) -> np.ndarray:
    sizes = [POINT[n].size for n in sources.values()]
    rows = [
        np.concatenate(
            [_hess(p, q).reshape(POINT[p].size, POINT[q].size) for q in sources.values()], axis=1
        )
        for p in sources.values()
    ]
    h = np.concatenate(rows, axis=0)
    assert h.shape == (sum(sizes), sum(sizes))
    return h


def flat(values: dict[str, np.ndarray], sources: dict[str, str]) -> np.ndarray:
    return np.concatenate([np.asarray(values[k], np.float64).reshape(-1) for k in sources])


def unflat(vec: np.ndarray, sources: dict[str, str]) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for k, n in sources.items():
        size = POINT[n].size
        out[k] = vec[at : at + size].reshape(POINT[n].shape)
        at += size
    return out


def close(
    got: np.ndarray, want: np.ndarray, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    assert got.shape == np.shape(want), f"{what}: shape {got.shape}, expected {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def tensor_of(answer: Any, what: str, shape: tuple[int, ...], dtype: str = "float64") -> np.ndarray:
    """An answered tensor (already checked for its encoding) of this shape and dtype."""
    assert isinstance(answer, dict), f"{what}: expected a tensor object, got {answer!r}"
    array = decode(answer)
    assert answer.get("dtype", "float32") == dtype, f"{what}: dtype {answer.get('dtype')}"
    assert array.shape == tuple(shape), f"{what}: shape {array.shape}, expected {shape}"
    return array.astype(np.float64)


# -- requests ------------------------------------------------------------------------------

# Sources: absent (every trainable variable), a name, a list of one name per rank, an
# alias mapping over all three ranks.
SOURCES: dict[str, Any] = {
    "absent": None,
    "name-0d": "a",
    "list-0d": ["a"],
    "list-1d": ["w"],
    "list-nd": ["M"],
    "dict-all": {"A": "a", "W": "w", "MM": "M"},
}


def answer_keys(sources: Any) -> dict[str, str]:
    """Answer key -> name for a `sources` value."""
    if sources is None:
        return {n: n for n in VARIABLES}
    if isinstance(sources, str):
        return {sources: sources}
    if isinstance(sources, list):
        return {n: n for n in sources}
    return dict(sources)


def definition(enc: Encoding) -> dict[str, Any]:
    return {
        "variables": {n: enc.tensor(POINT[n]) for n in VARIABLES},
        "inputs": {n: enc.tensor(POINT[n]) for n in INPUTS},
        "program": PROGRAM,
    }


def with_sources(body: dict[str, Any], sources: Any) -> dict[str, Any]:
    return body if sources is None else {**body, "sources": sources}


VECTOR_RNG = np.random.default_rng(18)
VECTORS = [
    {n: VECTOR_RNG.standard_normal(POINT[n].shape) for n in VARIABLES + INPUTS} for _ in range(3)
]


def vector(keys: dict[str, str], i: int = 0) -> dict[str, np.ndarray]:
    return {k: VECTORS[i][n] for k, n in keys.items()}


def check_gradients(
    grads: dict[str, Any], keys: dict[str, str], what: str, key: tuple = ()
) -> None:
    assert set(grads) == set(keys), f"{what}: keys {sorted(grads)}, expected {sorted(keys)}"
    for k, n in keys.items():
        got = tensor_of(grads[k], f"{what}[{k}]", POINT[n].shape)
        close(got, _jac("loss", n, key), f"{what}[{k}]")


def check_hvps(
    products: dict[str, Any],
    keys: dict[str, str],
    vec: dict[str, np.ndarray],
    what: str,
    key: tuple = (),
) -> None:
    assert isinstance(products, dict), f"{what}: {products!r}"
    assert set(products) == set(keys), f"{what}: keys {sorted(products)} != {sorted(keys)}"
    want = hvp_ref(keys, vec, key)
    for k, n in keys.items():
        got = tensor_of(products[k], f"{what}[{k}]", POINT[n].shape)
        close(got, want[k], f"{what}[{k}]", rtol=1e-4, atol=1e-5)


ENC = [pytest.param(Encoding(e), id=e) for e in ENCODINGS]
SRC = [pytest.param(s, id=k) for k, s in SOURCES.items()]


# -- stateless ----------------------------------------------------------------------------


@pytest.mark.parametrize("sources", SRC)
@pytest.mark.parametrize("enc", ENC)
def test_gradient(client, enc: Encoding, sources: Any) -> None:
    body = with_sources({"definition": definition(enc), "target": "loss"}, sources)
    answer = check(enc.request(client, "POST", "/v1/gradient", body), 200, enc.name)
    close(tensor_of(answer["value"], "value", ()), value_of("loss"), "value")
    check_gradients(answer["gradients"], answer_keys(sources), "gradients")


@pytest.mark.parametrize("sources", SRC)
@pytest.mark.parametrize("enc", ENC)
def test_jacobian(client, enc: Encoding, sources: Any) -> None:
    body = with_sources(
        {"definition": definition(enc), "target": "y", "allow_unused": True}, sources
    )
    answer = check(enc.request(client, "POST", "/v1/jacobian", body), 200, enc.name)
    close(tensor_of(answer["value"], "value", (2,)), value_of("y"), "value")
    keys = answer_keys(sources)
    assert set(answer["jacobians"]) == set(keys)
    for k, n in keys.items():
        got = tensor_of(answer["jacobians"][k], f"jacobians[{k}]", (2,) + POINT[n].shape)
        close(got, _jac("y", n), f"jacobians[{k}]")


def batch_jacobian_ref() -> np.ndarray:
    full = _jac("b", "X")  # (4, 3, 4, 3)
    return np.stack([full[i, :, i, :] for i in range(4)])


@pytest.mark.parametrize("enc", ENC)
def test_batch_jacobian(client, enc: Encoding) -> None:
    body = {
        "definition": definition(enc),
        "target": "b",
        "sources": ["X"],
        "batch": True,
        "allow_unused": True,
    }
    answer = check(enc.request(client, "POST", "/v1/jacobian", body), 200, enc.name)
    got = tensor_of(answer["jacobians"]["X"], "jacobians[X]", (4, 3, 3))
    close(got, batch_jacobian_ref(), "batch jacobian")


@pytest.mark.parametrize("sources", SRC)
@pytest.mark.parametrize("enc", ENC)
def test_hessian(client, enc: Encoding, sources: Any) -> None:
    damping = 0.5
    body = with_sources(
        {"definition": definition(enc), "target": "loss", "newton": {"damping": damping}}, sources
    )
    answer = check(enc.request(client, "POST", "/v1/hessian", body), 200, enc.name)
    keys = answer_keys(sources)
    close(tensor_of(answer["value"], "value", ()), value_of("loss"), "value")
    check_gradients(answer["gradients"], keys, "gradients")
    assert set(answer["hessian"]) == set(keys)
    for ka, a in keys.items():
        assert set(answer["hessian"][ka]) == set(keys), f"hessian[{ka}]"
        for kb, b in keys.items():
            got = tensor_of(
                answer["hessian"][ka][kb], f"hessian[{ka}][{kb}]", POINT[a].shape + POINT[b].shape
            )
            close(got, _hess(a, b), f"hessian[{ka}][{kb}]", rtol=1e-4, atol=1e-5)
    h = dense_hessian(keys)
    g = flat({k: _jac("loss", n) for k, n in keys.items()}, keys)
    step = unflat(np.linalg.solve(h + damping * np.eye(len(g)), g), keys)
    assert answer.get("newton_step") is not None, "newton_step missing"
    for k, n in keys.items():
        got = tensor_of(answer["newton_step"][k], f"newton_step[{k}]", POINT[n].shape)
        close(got, step[k], f"newton_step[{k}]", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("sources", SRC)
@pytest.mark.parametrize("enc", ENC)
def test_hvp(client, enc: Encoding, sources: Any, batched: bool) -> None:
    keys = answer_keys(sources)
    body = with_sources({"definition": definition(enc), "target": "loss"}, sources)
    if batched:
        body["vectors"] = [enc.tensors(vector(keys, i)) for i in range(3)]
    else:
        body["vector"] = enc.tensors(vector(keys))
    answer = check(enc.request(client, "POST", "/v1/hvp", body), 200, enc.name)
    close(tensor_of(answer["value"], "value", ()), value_of("loss"), "value")
    check_gradients(answer["gradients"], keys, "gradients")
    if batched:
        assert isinstance(answer.get("hvps"), list) and len(answer["hvps"]) == 3, answer
        for i, product in enumerate(answer["hvps"]):
            check_hvps(product, keys, vector(keys, i), f"hvps[{i}]")
    else:
        check_hvps(answer.get("hvp"), keys, vector(keys), "hvp")


# -- the issue's own request: a 0-d parameter's HVP ------------------------------------------

ISSUE_W, ISSUE_B = np.array([1.0, 2.0]), 0.5
ISSUE_VECTORS = [({"w": [1.0, 0.0], "b": 1.0}), ({"w": [0.0, 1.0], "b": -2.0})]


def issue_hvp(v: dict[str, Any]) -> dict[str, np.ndarray]:
    """loss = sum(w^3) b^2: H_ww = diag(6 w b^2), H_wb = 6 w^2 b, H_bb = 2 sum(w^3)."""
    w, b = ISSUE_W, ISSUE_B
    vw, vb = np.asarray(v["w"]), float(v["b"])
    return {
        "w": 6 * w * b * b * vw + 6 * w * w * b * vb,
        "b": np.asarray(np.sum(6 * w * w * b * vw) + 2 * np.sum(w**3) * vb),
    }


def issue_wire(enc: Encoding, value: Any) -> Any:
    """As the issue wrote it (bare numbers and lists) in JSON; tensors otherwise."""
    return value if enc.name == "json" else enc.tensor(value, "float32")


def issue_definition(enc: Encoding) -> dict[str, Any]:
    return {
        "variables": {"w": issue_wire(enc, ISSUE_W.tolist()), "b": issue_wire(enc, ISSUE_B)},
        "program": ["loss = sum(w * w * w) * b * b"],
    }


def check_issue_products(products: Any, v: dict[str, Any], what: str) -> None:
    want = issue_hvp(v)
    assert isinstance(products, dict) and set(products) == {"w", "b"}, f"{what}: {products}"
    for k, shape in (("w", (2,)), ("b", ())):
        got = tensor_of(products[k], f"{what}[{k}]", shape, dtype="float32")
        close(got, want[k], f"{what}[{k}]", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["stateless", "tape"])
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("enc", ENC)
def test_hvp_of_a_0d_parameter_is_a_tensor(
    client, enc: Encoding, batched: bool, route: str
) -> None:
    """The issue's request: the product for the 0-d `b` is a tensor, not a bare number."""
    vecs = [{k: issue_wire(enc, v) for k, v in vec.items()} for vec in ISSUE_VECTORS]
    ask = {"vectors": vecs} if batched else {"vector": vecs[0]}
    if route == "stateless":
        body = {"definition": issue_definition(enc), "target": "loss", **ask}
        answer = check(enc.request(client, "POST", "/v1/hvp", body), 200, enc.name)
    else:
        tape = check(
            enc.request(
                client, "POST", "/v1/tapes", {"definition": issue_definition(enc), "target": "loss"}
            ),
            201,
            enc.name,
        )
        try:
            answer = check(
                enc.request(client, "POST", f"/v1/tapes/{tape['tape_id']}/hvp", ask), 200, enc.name
            )
        finally:
            check(client.delete(f"/v1/tapes/{tape['tape_id']}"), 204)
    if batched:
        assert isinstance(answer.get("hvps"), list) and len(answer["hvps"]) == 2, answer
        for i, product in enumerate(answer["hvps"]):
            check_issue_products(product, ISSUE_VECTORS[i], f"hvps[{i}]")
    else:
        check_issue_products(answer.get("hvp"), ISSUE_VECTORS[0], "hvp")


# -- tapes ----------------------------------------------------------------------------------


def new_tape(client, enc: Encoding, sources: Any, **extra: Any) -> dict[str, Any]:
    body = with_sources({"definition": definition(enc), "target": "loss", **extra}, sources)
    return check(enc.request(client, "POST", "/v1/tapes", body), 201, enc.name)


@pytest.mark.parametrize("sources", SRC)
@pytest.mark.parametrize("enc", ENC)
def test_tape_lifecycle(client, enc: Encoding, sources: Any) -> None:
    keys = answer_keys(sources)
    created = new_tape(client, enc, sources, ttl=600)
    tape_id = created["tape_id"]
    try:
        _tape_lifecycle(client, enc, keys, created)
    finally:
        client.delete(f"/v1/tapes/{tape_id}")  # cleanup when it failed half way


def _tape_lifecycle(client, enc: Encoding, keys: dict[str, str], created: dict) -> None:
    tape_id = created["tape_id"]
    url = f"/v1/tapes/{tape_id}"
    close(tensor_of(created["value"], "value", ()), value_of("loss"), "value")
    check_gradients(created["gradients"], keys, "created gradients")

    info = check(enc.request(client, "GET", url), 200, enc.name)
    assert info["tape_id"] == tape_id and info["target"] == "loss"
    assert info["sources"] == keys, info["sources"]
    listed = check(enc.request(client, "GET", "/v1/tapes"), 200, enc.name)
    assert tape_id in [t["tape_id"] for t in listed["tapes"]]

    grad = check(enc.request(client, "POST", f"{url}/gradient", {}), 200, enc.name)
    close(tensor_of(grad["value"], "value", ()), value_of("loss"), "tape value")
    check_gradients(grad["gradients"], keys, "tape gradients")
    by_input = check(
        enc.request(client, "POST", f"{url}/gradient", {"sources": {"dx": "x"}}), 200, enc.name
    )
    close(
        tensor_of(by_input["gradients"]["dx"], "gradients[dx]", (3,)),
        _jac("loss", "x"),
        "tape gradient over an input",
    )

    jac = check(enc.request(client, "POST", f"{url}/jacobian", {"target": "y"}), 200, enc.name)
    close(tensor_of(jac["value"], "value", (2,)), value_of("y"), "tape jacobian value")
    assert set(jac["jacobians"]) == set(keys)
    for k, n in keys.items():
        got = tensor_of(jac["jacobians"][k], f"jacobians[{k}]", (2,) + POINT[n].shape)
        close(got, _jac("y", n), f"tape jacobians[{k}]")

    a_new = 0.4
    moved = check(
        enc.request(client, "PATCH", url, {"variables": {"a": enc.tensor(a_new)}}), 200, enc.name
    )
    assert moved["tape_id"] == tape_id
    key = (("a", (a_new,)),)
    close(tensor_of(moved["value"], "value", ()), value_of("loss", key), "patched value")
    check_gradients(moved["gradients"], keys, "patched gradients", key)

    # products at the patched point
    one = check(
        enc.request(client, "POST", f"{url}/hvp", {"vector": enc.tensors(vector(keys))}),
        200,
        enc.name,
    )
    check_hvps(one.get("hvp"), keys, vector(keys), "tape hvp", key)
    many = check(
        enc.request(
            client,
            "POST",
            f"{url}/hvp",
            {"vectors": [enc.tensors(vector(keys, i)) for i in range(3)]},
        ),
        200,
        enc.name,
    )
    assert isinstance(many.get("hvps"), list) and len(many["hvps"]) == 3, many
    for i, product in enumerate(many["hvps"]):
        check_hvps(product, keys, vector(keys, i), f"tape hvps[{i}]", key)

    check(enc.request(client, "DELETE", url), 204, enc.name)
    check(enc.request(client, "GET", url), 404, enc.name)


@pytest.mark.parametrize("enc", ENC)
def test_tape_batch_jacobian(client, enc: Encoding) -> None:
    tape_id = new_tape(client, enc, None)["tape_id"]
    try:
        answer = check(
            enc.request(
                client,
                "POST",
                f"/v1/tapes/{tape_id}/jacobian",
                {"target": "b", "sources": ["X"], "batch": True},
            ),
            200,
            enc.name,
        )
        got = tensor_of(answer["jacobians"]["X"], "jacobians[X]", (4, 3, 3))
        close(got, batch_jacobian_ref(), "tape batch jacobian")
    finally:
        check(client.delete(f"/v1/tapes/{tape_id}"), 204)


ALGORITHM_SOURCES = [
    pytest.param(s, id=k) for k, s in SOURCES.items() if k in ("list-0d", "list-nd", "dict-all")
]


@pytest.mark.parametrize("sources", ALGORITHM_SOURCES)
@pytest.mark.parametrize("enc", ENC)
def test_tape_algorithms(client, enc: Encoding, sources: Any) -> None:
    keys = answer_keys(sources)
    h = dense_hessian(keys)
    n = h.shape[0]
    exact = np.linalg.eigvalsh(h)
    tape_id = new_tape(client, enc, sources)["tape_id"]
    url = f"/v1/tapes/{tape_id}"
    try:
        k = min(2, n)
        eig = check(
            enc.request(
                client,
                "POST",
                f"{url}/eigenvalues",
                {"k": k, "which": "LA", "eigenvectors": True, "tol": 1e-8},
            ),
            200,
            enc.name,
        )
        close(np.asarray(eig["eigenvalues"]), exact[::-1][:k], "eigenvalues", rtol=1e-4, atol=1e-4)
        assert len(eig["eigenvectors"]) == k
        for i, vec in enumerate(eig["eigenvectors"]):
            assert set(vec) == set(keys)
            y = flat(
                {
                    kk: tensor_of(vec[kk], f"eigenvectors[{i}][{kk}]", POINT[nn].shape)
                    for kk, nn in keys.items()
                },
                keys,
            )
            close(
                np.linalg.norm(h @ y - eig["eigenvalues"][i] * y),
                0.0,
                f"eigenvector {i} residual",
                atol=1e-3,
            )

        trace = check(
            enc.request(
                client, "POST", f"{url}/trace", {"max_hvps": 64, "batch_size": 16, "seed": 1}
            ),
            200,
            enc.name,
        )
        bound = 6 * (trace["stderr"] or 0.0) + 1e-4 * abs(np.trace(h)) + 1e-6
        assert abs(trace["trace"] - np.trace(h)) <= bound, (trace, np.trace(h))

        diagonal = check(enc.request(client, "POST", f"{url}/diagonal", {}), 200, enc.name)
        assert diagonal["method"] == "exact" and diagonal["reached"] == n, diagonal
        for kk, nn in keys.items():
            close(
                tensor_of(diagonal["diagonal"][kk], f"diagonal[{kk}]", POINT[nn].shape),
                unflat(np.diag(h), keys)[kk],
                f"diagonal[{kk}]",
                rtol=1e-4,
                atol=1e-5,
            )

        density = check(
            enc.request(
                client, "POST", f"{url}/spectral-density", {"probes": 3, "steps": n, "points": 50}
            ),
            200,
            enc.name,
        )
        assert density["parameters"] == n and len(density["density"]) == 50, density
        for nodes, weights in zip(density["nodes"], density["weights"], strict=True):
            assert len(nodes) == len(weights) and abs(sum(weights) - 1) < 1e-6
            assert exact[0] - 1e-4 <= min(nodes) and max(nodes) <= exact[-1] + 1e-4

        damping = 0.5
        g = flat({kk: _jac("loss", nn) for kk, nn in keys.items()}, keys)
        solved = check(
            enc.request(client, "POST", f"{url}/solve", {"damping": damping, "tol": 1e-10}),
            200,
            enc.name,
        )
        want = unflat(np.linalg.solve(h + damping * np.eye(n), g), keys)
        assert solved["converged"], solved
        for kk, nn in keys.items():
            close(
                tensor_of(solved["solution"][kk], f"solution[{kk}]", POINT[nn].shape),
                want[kk],
                f"solution[{kk}]",
                rtol=1e-4,
                atol=1e-5,
            )
        b = vector(keys, 1)
        solved_b = check(
            enc.request(
                client,
                "POST",
                f"{url}/solve",
                {"vector": enc.tensors(b), "damping": damping, "tol": 1e-10},
            ),
            200,
            enc.name,
        )
        want = unflat(np.linalg.solve(h + damping * np.eye(n), flat(b, keys)), keys)
        assert solved_b["rhs"] == "vector"
        for kk, nn in keys.items():
            close(
                tensor_of(solved_b["solution"][kk], f"solution[{kk}]", POINT[nn].shape),
                want[kk],
                f"solution[{kk}] for a vector",
                rtol=1e-4,
                atol=1e-5,
            )
    finally:
        check(client.delete(url), 204)


# A logistic regression with its output named: the GGN X^T diag(p(1-p)) X / N and the
# per-example gradients (p_i - y_i) x_i are closed forms.
LOGISTIC_X = np.array([[0.5, -1.0], [1.5, 0.2], [-0.3, 0.8], [0.0, -0.4], [1.0, 1.0]])
LOGISTIC_Y = np.array([1.0, 0.0, 1.0, 0.0, 1.0])
LOGISTIC_W = np.array([0.4, -0.3])


@pytest.mark.parametrize("enc", ENC)
def test_tape_influence(client, enc: Encoding) -> None:
    """/influence on a tape recorded with `output`, on test inputs and on training rows,
    with the GGN as the curvature: the scores -g_i . (GGN + damping I)^-1 grad L_test."""
    body = {
        "definition": {
            "variables": {"w": enc.tensor(LOGISTIC_W)},
            "inputs": {"x": enc.tensor(LOGISTIC_X), "y": enc.tensor(LOGISTIC_Y)},
            "program": ["z = x @ w", "loss = sigmoid_cross_entropy(z, y)"],
        },
        "target": "loss",
        "output": "z",
    }
    tape_id = check(enc.request(client, "POST", "/v1/tapes", body), 201, enc.name)["tape_id"]
    p = 1 / (1 + np.exp(-LOGISTIC_X @ LOGISTIC_W))
    ggn = (LOGISTIC_X.T * (p * (1 - p))) @ LOGISTIC_X / len(p)
    per_example = LOGISTIC_X * (p - LOGISTIC_Y)[:, None]
    try:
        x_test, y_test = np.array([[0.2, 0.9]]), np.array([0.0])
        p_test = 1 / (1 + np.exp(-x_test @ LOGISTIC_W))
        for test, g_test in (
            (
                {"test_inputs": enc.tensors({"x": x_test, "y": y_test})},
                x_test.T @ (p_test - y_test),
            ),
            ({"rows": [1, 3]}, per_example[[1, 3]].mean(axis=0)),
        ):
            found = check(
                enc.request(
                    client,
                    "POST",
                    f"/v1/tapes/{tape_id}/influence",
                    {**test, "curvature": "ggn", "damping": 0.1, "tol": 1e-12, "top_k": 2},
                ),
                200,
                enc.name,
            )
            want = -per_example @ np.linalg.solve(ggn + 0.1 * np.eye(2), g_test)
            close(np.asarray(found["scores"]), want, "influence scores", rtol=1e-8, atol=1e-12)
            assert found["harmful"] == list(np.argsort(-want)[:2]), found
            assert set(found["s_test"]) == {"w"}
            tensor_of(found["s_test"]["w"], "s_test[w]", (2,))
    finally:
        check(client.delete(f"/v1/tapes/{tape_id}"), 204)


@pytest.mark.parametrize("enc", ENC)
def test_jobs(client, enc: Encoding) -> None:
    """A trace run as a job: 202 with the job's document, its state and progress, its
    answer inline and at /result, the list, the events stream, DELETE."""
    sources = SOURCES["dict-all"]
    keys = answer_keys(sources)
    h = dense_hessian(keys)
    tape_id = new_tape(client, enc, sources)["tape_id"]
    accept = {"accept": MSGPACK if enc.name == "msgpack" else JSON}
    try:
        r = enc.request(
            client,
            "POST",
            f"/v1/tapes/{tape_id}/trace",
            {"method": "hutchinson", "max_hvps": 64, "batch_size": 16, "seed": 1, "async": True},
        )
        job = check(r, 202, enc.name)
        location = f"/v1/jobs/{job['job_id']}"
        assert r.headers["location"] == location
        deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
        while (job := check(client.get(location, headers=accept), 200, enc.name))["state"] in (
            "queued",
            "running",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.02)
        assert job["state"] == "succeeded", job
        trace = job["result"]
        bound = 6 * (trace["stderr"] or 0.0) + 1e-4 * abs(np.trace(h)) + 1e-6
        assert abs(trace["trace"] - np.trace(h)) <= bound, (trace, np.trace(h))
        assert job["progress"]["done"] == 64 and job["progress"]["total"] == 64
        result = check(client.get(f"{location}/result", headers=accept), 200, enc.name)
        assert result == trace
        listed = check(client.get("/v1/jobs", headers=accept), 200)
        assert job["job_id"] in [j["job_id"] for j in listed["jobs"]]
        events = check(client.get(f"{location}/events"), 200)
        assert events.rstrip().splitlines()[1] == "event: succeeded", events
        check(client.delete(location), 204)
        check(client.get(location), 404)
    finally:
        check(client.delete(f"/v1/tapes/{tape_id}"), 204)


# -- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("enc", ENC)
def test_models(client, enc: Encoding) -> None:
    name = f"conformance-{enc.name}"
    body = {
        "name": name,
        "definition": definition(enc),
        "description": "conformance",
        "replace": True,
    }
    info = check(enc.request(client, "POST", "/v1/models", body), (200, 201), enc.name)
    try:
        _use_model(client, enc, name, body, info)
    finally:
        check(enc.request(client, "DELETE", f"/v1/models/{name}"), 204, enc.name)
    check(enc.request(client, "GET", f"/v1/models/{name}"), 404, enc.name)


def _use_model(client, enc: Encoding, name: str, body: dict, info: dict) -> None:
    assert info["name"] == name
    assert {k: v["shape"] for k, v in info["variables"].items()} == {
        n: list(POINT[n].shape) for n in VARIABLES
    }
    assert info["names"]["loss"]["shape"] == []
    again = check(enc.request(client, "POST", "/v1/models", body), 200, enc.name)
    assert again["digest"] == info["digest"]
    assert check(enc.request(client, "GET", f"/v1/models/{name}"), 200, enc.name)["name"] == name
    listed = check(enc.request(client, "GET", "/v1/models"), 200, enc.name)
    assert name in [m["name"] for m in listed["models"]]

    keys = answer_keys(None)
    grad = check(
        enc.request(client, "POST", "/v1/gradient", {"model": name, "target": "loss"}),
        200,
        enc.name,
    )
    check_gradients(grad["gradients"], keys, "gradients of a stored model")
    tape = check(
        enc.request(client, "POST", "/v1/tapes", {"model": name, "target": "loss"}), 201, enc.name
    )
    try:
        products = check(
            enc.request(
                client,
                "POST",
                f"/v1/tapes/{tape['tape_id']}/hvp",
                {"vector": enc.tensors(vector(keys))},
            ),
            200,
            enc.name,
        )
        check_hvps(products["hvp"], keys, vector(keys), "hvp of a stored model's tape")
    finally:
        check(client.delete(f"/v1/tapes/{tape['tape_id']}"), 204)


def test_onnx_model(client) -> None:
    """PUT /v1/models/{name} with an ONNX file; a definition calls it by reference, and
    the answer's gradients are PyTorch's (tests/engine/onnx/fixtures)."""
    from tests.engine.onnx.graphs import fixture
    from tests.service.conformance import check_tensor

    data, record = fixture("transformer")
    name = "conformance-onnx"
    info = check(
        client.put(
            f"/v1/models/{name}", content=data, headers={"content-type": "application/onnx"}
        ),
        (200, 201),
    )
    try:
        assert info["variables"]["head.bias"]["shape"] == [10]
        grad = check(
            client.post(
                "/v1/gradient",
                json={
                    "definition": {
                        "models": {"net": {"stored": name}},
                        "inputs": {
                            "x": {
                                "dtype": "int64",
                                "shape": list(record["x"].shape),
                                "data": record["x"].reshape(-1).tolist(),
                            },
                            "y": {"dtype": "int64", "shape": [4], "data": record["y"].tolist()},
                        },
                        "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
                    },
                    "target": "loss",
                    "sources": ["head.bias"],
                },
            ),
            200,
        )
        got = check_tensor(grad["gradients"]["head.bias"], "head.bias", "json")
        np.testing.assert_allclose(got, record["f32/grad/head.bias"], rtol=1e-4, atol=1e-7)
    finally:
        check(client.delete(f"/v1/models/{name}"), 204)


# -- datasets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("enc", ENC)
def test_datasets(client, enc: Encoding) -> None:
    name = f"conformance-{enc.name}"
    arrays = {n: enc.tensor(POINT[n]) for n in INPUTS}
    info = check(enc.request(client, "PUT", f"/v1/datasets/{name}", arrays), (200, 201), enc.name)
    try:
        assert {k: v["shape"] for k, v in info["arrays"].items()} == {
            n: list(POINT[n].shape) for n in INPUTS
        }
        assert (
            check(enc.request(client, "GET", f"/v1/datasets/{name}"), 200, enc.name)["version"]
            == info["version"]
        )
        listed = check(enc.request(client, "GET", "/v1/datasets"), 200, enc.name)
        assert name in [d["name"] for d in listed["datasets"]]
        bound = {**definition(enc), "inputs": {"dataset": name}}
        keys = answer_keys(None)
        grad = check(
            enc.request(client, "POST", "/v1/gradient", {"definition": bound, "target": "loss"}),
            200,
            enc.name,
        )
        check_gradients(grad["gradients"], keys, "gradients with inputs from a dataset")
    finally:
        check(enc.request(client, "DELETE", f"/v1/datasets/{name}"), 204, enc.name)
    check(enc.request(client, "GET", f"/v1/datasets/{name}"), 404, enc.name)


# -- around them ----------------------------------------------------------------------------

ACCEPT = [pytest.param(JSON, id="json"), pytest.param(MSGPACK, id="msgpack")]


@pytest.mark.parametrize("accept", ACCEPT)
def test_operations_endpoints(client, accept: str) -> None:
    ops = check(client.get("/v1/ops", headers={"accept": accept}), 200)
    names = {op["name"] for op in ops["ops"]}
    assert {"tanh", "sum", "matmul"} <= names, sorted(names)
    assert check(client.get("/healthz", headers={"accept": accept}), 200)["status"] == "ok"
    ready = check(client.get("/readyz", headers={"accept": accept}), 200)
    assert ready["workers"]
    metrics = check(client.get("/metrics", headers={"accept": accept}), 200)
    assert "# TYPE" in metrics


@pytest.mark.parametrize("enc", ENC)
def test_problems_follow_the_schema(client, enc: Encoding) -> None:
    bad = {"definition": {**definition(enc), "program": ["loss = sum(w @ nope)"]}, "target": "loss"}
    for path in ("/v1/gradient", "/v1/jacobian", "/v1/hessian", "/v1/tapes"):
        check(enc.request(client, "POST", path, bad), 422, enc.name)
    check(enc.request(client, "POST", "/v1/hvp", {**bad, "vector": {}}), 422, enc.name)
    for method, path, body in (
        ("POST", "/v1/tapes/nope/hvp", {"vector": {}}),
        ("POST", "/v1/tapes/nope/gradient", {}),
        ("POST", "/v1/tapes/nope/solve", {}),
        ("GET", "/v1/tapes/nope", None),
        ("DELETE", "/v1/tapes/nope", None),
        ("GET", "/v1/models/nope", None),
    ):
        check(enc.request(client, method, path, body), 404, enc.name)


# -- unconnected sources: null, or zeros of the source's shape ---------------------------------

UNCONNECTED = {
    "u": np.array(1.5),
    "U": np.array([1.0, -2.0]),
    "UU": np.ones((2, 2)),
    "e": np.zeros((0,)),
}


def unconnected_definition(enc: Encoding) -> dict[str, Any]:
    out = definition(enc)
    out["variables"].update({n: enc.tensor(v) for n, v in UNCONNECTED.items()})
    return out


def check_unconnected(
    answers: dict[str, Any], zeros: bool, lead: tuple[int, ...], what: str
) -> None:
    for n, v in UNCONNECTED.items():
        if not zeros:
            assert answers[n] is None, f"{what}[{n}]: {answers[n]!r}, expected null"
            continue
        got = tensor_of(answers[n], f"{what}[{n}]", lead + v.shape)
        assert not got.any(), f"{what}[{n}]: {got}, expected zeros"


UNCONNECTED_SOURCES = ["a", *UNCONNECTED]


@pytest.mark.parametrize("mode", ["none", "zero"])
@pytest.mark.parametrize("enc", ENC)
def test_unconnected_gradients_and_jacobians(client, enc: Encoding, mode: str) -> None:
    body = {
        "definition": unconnected_definition(enc),
        "sources": UNCONNECTED_SOURCES,
        "unconnected": mode,
    }
    grad = check(
        enc.request(client, "POST", "/v1/gradient", {**body, "target": "loss"}), 200, enc.name
    )
    close(tensor_of(grad["gradients"]["a"], "gradients[a]", ()), _jac("loss", "a"), "a")
    check_unconnected(grad["gradients"], mode == "zero", (), "gradients")
    jac = check(
        enc.request(client, "POST", "/v1/jacobian", {**body, "target": "y", "allow_unused": True}),
        200,
        enc.name,
    )
    close(tensor_of(jac["jacobians"]["a"], "jacobians[a]", (2,)), _jac("y", "a"), "a")
    check_unconnected(jac["jacobians"], mode == "zero", (2,), "jacobians")
    tape = check(
        enc.request(
            client,
            "POST",
            "/v1/tapes",
            {
                "definition": unconnected_definition(enc),
                "target": "loss",
                "sources": UNCONNECTED_SOURCES,
            },
        ),
        201,
        enc.name,
    )
    try:
        on_tape = check(
            enc.request(
                client, "POST", f"/v1/tapes/{tape['tape_id']}/gradient", {"unconnected": mode}
            ),
            200,
            enc.name,
        )
        check_unconnected(on_tape["gradients"], mode == "zero", (), "tape gradients")
    finally:
        check(client.delete(f"/v1/tapes/{tape['tape_id']}"), 204)


@pytest.mark.parametrize("enc", ENC)
def test_unconnected_hessian_blocks_are_zeros(client, enc: Encoding) -> None:
    body = {
        "definition": unconnected_definition(enc),
        "target": "loss",
        "sources": UNCONNECTED_SOURCES,
    }
    answer = check(enc.request(client, "POST", "/v1/hessian", body), 200, enc.name)
    shapes = {"a": (), **{n: v.shape for n, v in UNCONNECTED.items()}}
    close(
        tensor_of(answer["hessian"]["a"]["a"], "hessian[a][a]", ()),
        _hess("a", "a"),
        "hessian[a][a]",
        rtol=1e-4,
        atol=1e-5,
    )
    for p, p_shape in shapes.items():
        for q, q_shape in shapes.items():
            if p == q == "a":
                continue
            got = tensor_of(answer["hessian"][p][q], f"hessian[{p}][{q}]", p_shape + q_shape)
            assert not got.any(), f"hessian[{p}][{q}]: {got}"


@pytest.mark.parametrize("route", ["stateless", "tape"])
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("enc", ENC)
def test_unconnected_hvps_are_zeros(client, enc: Encoding, batched: bool, route: str) -> None:
    """HVPRequest: 'Gradients and products of unconnected sources are zeros'."""
    vec = {"a": enc.tensor(1.0), **{n: enc.tensor(np.ones_like(v)) for n, v in UNCONNECTED.items()}}
    ask = {"vectors": [vec, vec]} if batched else {"vector": vec}
    base = {
        "definition": unconnected_definition(enc),
        "target": "loss",
        "sources": UNCONNECTED_SOURCES,
    }
    if route == "stateless":
        answer = check(enc.request(client, "POST", "/v1/hvp", {**base, **ask}), 200, enc.name)
        check_unconnected(answer["gradients"], True, (), "gradients")
    else:
        tape = check(enc.request(client, "POST", "/v1/tapes", base), 201, enc.name)
        try:
            answer = check(
                enc.request(client, "POST", f"/v1/tapes/{tape['tape_id']}/hvp", ask), 200, enc.name
            )
        finally:
            check(client.delete(f"/v1/tapes/{tape['tape_id']}"), 204)
    products = answer["hvps"] if batched else [answer["hvp"]]
    for i, product in enumerate(products):
        close(
            tensor_of(product["a"], f"hvp {i} [a]", ()),
            _hess("a", "a"),
            "hvp[a]",
            rtol=1e-4,
            atol=1e-5,
        )
        check_unconnected(product, True, (), f"hvp {i}")


# -- other float dtypes: float16 and float32 keep their dtype and byte counts ------------------


def small_hvp(
    w: np.ndarray, b: float, M: np.ndarray, vw: np.ndarray, vb: float, vM: np.ndarray
) -> dict[str, np.ndarray]:
    """loss = sum(w^3) b^2 + sum(M^2) b, in closed form."""
    return {
        "w": 6 * w * b * b * vw + 6 * w * w * b * vb,
        "b": np.asarray(np.sum(6 * w * w * b * vw) + 2 * np.sum(w**3) * vb + np.sum(2 * M * vM)),
        "M": 2 * b * vM + 2 * M * vb,
    }


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("enc", ENC)
def test_other_dtypes(client, enc: Encoding, dtype: str) -> None:
    w, b, M = np.array([0.5, -1.0, 0.25]), 0.75, np.array([[0.5, 1.0], [-0.5, 0.25]])
    vw, vb, vM = np.array([1.0, 0.5, -1.0]), -0.5, np.array([[0.25, 0.0], [1.0, -1.0]])
    body = {
        "definition": {
            "variables": {
                "w": enc.tensor(w, dtype),
                "b": enc.tensor(b, dtype),
                "M": enc.tensor(M, dtype),
            },
            "program": ["loss = sum(w * w * w) * b * b + sum(M * M) * b"],
        },
        "target": "loss",
        "vector": {
            "w": enc.tensor(vw, dtype),
            "b": enc.tensor(vb, dtype),
            "M": enc.tensor(vM, dtype),
        },
    }
    answer = check(enc.request(client, "POST", "/v1/hvp", body), 200, enc.name)
    rtol = 1e-2 if dtype == "float16" else 1e-5
    want_value = np.sum(w**3) * b * b + np.sum(M * M) * b
    close(tensor_of(answer["value"], "value", (), dtype), want_value, "value", rtol, rtol)
    want_grad = {
        "w": 3 * w * w * b * b,
        "b": np.asarray(2 * np.sum(w**3) * b + np.sum(M * M)),
        "M": 2 * M * b,
    }
    want_hvp = small_hvp(w, b, M, vw, vb, vM)
    for k, shape in (("w", (3,)), ("b", ()), ("M", (2, 2))):
        close(
            tensor_of(answer["gradients"][k], f"gradients[{k}]", shape, dtype),
            want_grad[k],
            f"gradients[{k}]",
            rtol,
            rtol,
        )
        close(
            tensor_of(answer["hvp"][k], f"hvp[{k}]", shape, dtype),
            want_hvp[k],
            f"hvp[{k}]",
            rtol,
            rtol,
        )


# -- content negotiation across encodings ------------------------------------------------------

NEGOTIATION = {
    # name: (body encoding, content type, accept, response_encoding, answer encoding)
    "lists-accept-msgpack": ("json", JSON, MSGPACK, None, "msgpack"),
    "lists-ask-base64": ("json", JSON, JSON, "base64", "base64"),
    "base64-ask-data": ("base64", JSON, JSON, "data", "json"),
    "msgpack-bytes-accept-json": ("msgpack", MSGPACK, JSON, None, "base64"),
    "msgpack-lists-accept-json": ("json", MSGPACK, JSON, None, "json"),
}


@pytest.mark.parametrize("route", ["/v1/gradient", "/v1/hessian", "/v1/hvp", "tape-hvp"])
@pytest.mark.parametrize("case", list(NEGOTIATION))
def test_negotiated_encodings(client, case: str, route: str) -> None:
    body_enc, ctype, accept, response_encoding, answered = NEGOTIATION[case]
    enc = Encoding(body_enc)
    keys = answer_keys(None)

    def send(path: str, body: dict[str, Any], status: int = 200) -> Any:
        if response_encoding:
            body = {**body, "response_encoding": response_encoding}
        headers = {"content-type": ctype, "accept": accept}
        content = msgpack_packb(body) if ctype == MSGPACK else json_dumps(body)
        return check(client.post(path, content=content, headers=headers), status, answered)

    base = {"definition": definition(enc), "target": "loss"}
    vec = {"vector": enc.tensors(vector(keys))}
    if route == "tape-hvp":
        tape = send("/v1/tapes", base, 201)
        try:
            answer = send(f"/v1/tapes/{tape['tape_id']}/hvp", vec)
        finally:
            check(client.delete(f"/v1/tapes/{tape['tape_id']}"), 204)
    else:
        answer = send(route, {**base, **vec} if route == "/v1/hvp" else base)
    if "hvp" in route:
        check_hvps(answer["hvp"], keys, vector(keys), "hvp")
    else:
        check_gradients(answer["gradients"], keys, "gradients")


def msgpack_packb(body: Any) -> bytes:
    import msgpack

    return msgpack.packb(body, use_bin_type=True)


def json_dumps(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()


@pytest.mark.parametrize("enc", ENC)
def test_curvature_beyond_products(client, enc: Encoding) -> None:
    """The operations of issues 29 and 30 on a logistic regression: the Frobenius norm
    (against the dense Hessian's), per-example gradients on a tape and without one
    (`scale` times their sum is the batch gradient), K-FAC, and a Laplace fit with its
    evidence, predictive and samples. Their values against references (curvlinops,
    laplace-torch, loops of single examples) are tests/service/test_tape_kfac_laplace.py's
    and test_frobenius.py's; here every answer meets the contract in every encoding."""
    definition = {
        "variables": {"w": [0.3, -0.2], "b": 0.1},
        "inputs": {
            "X": [[0.5, 1.0], [-1.0, 0.3], [1.5, -0.5], [0.2, 0.2]],
            "y": [1.0, 0.0, 1.0, 0.0],
        },
        "program": ["z = X @ w + b", "loss = sigmoid_cross_entropy(z, y)"],
        "dtype": "float64",
    }
    created = check(
        enc.request(
            client,
            "POST",
            "/v1/tapes",
            {"definition": definition, "target": "loss", "output": "z"},
        ),
        201,
        enc.name,
    )
    url = f"/v1/tapes/{created['tape_id']}"
    try:
        grads = {k: decode(v).astype(np.float64) for k, v in created["gradients"].items()}
        hessian = check(
            enc.request(
                client,
                "POST",
                "/v1/hessian",
                {"definition": definition, "target": "loss"},
            ),
            200,
            enc.name,
        )
        exact = sum(
            float(np.sum(np.square(decode(block))))
            for row in hessian["hessian"].values()
            for block in row.values()
        )
        frob = check(
            enc.request(
                client, "POST", f"{url}/frobenius-norm", {"max_hvps": 512, "batch_size": 16}
            ),
            200,
            enc.name,
        )
        assert abs(frob["frobenius_norm_squared"] - exact) <= 6 * frob["stderr"] + 1e-9 * exact

        for route, body in (
            (f"{url}/per-example", {"gradients": True}),
            (
                "/v1/per-example",
                {
                    "definition": definition,
                    "target": "loss",
                    "output": "z",
                    "gradients": True,
                },
            ),
        ):
            each = check(enc.request(client, "POST", route, body), 200, enc.name)
            assert each["examples"] == 4
            for key, g in grads.items():
                rows = decode(each["gradients"][key]).astype(np.float64)
                close(each["scale"] * rows.sum(axis=0), g, f"{route} {key}", rtol=1e-10)

        check(enc.request(client, "POST", f"{url}/kfac", {}), 200, enc.name)
        fit = check(enc.request(client, "POST", f"{url}/laplace", {}), 200, enc.name)
        fit_url = f"{url}/laplace/{fit['laplace_id']}"
        check(
            enc.request(
                client, "POST", f"{fit_url}/log-marginal-likelihood", {"prior_precision": 2.0}
            ),
            200,
            enc.name,
        )
        check(
            enc.request(
                client,
                "POST",
                f"{fit_url}/predictive",
                {"test_inputs": {"X": [[0.1, 0.2], [1.0, -1.0]]}},
            ),
            200,
            enc.name,
        )
        check(
            enc.request(client, "POST", f"{fit_url}/samples", {"count": 2, "seed": 0}),
            200,
            enc.name,
        )
        listed = check(enc.request(client, "GET", f"{url}/laplace"), 200, enc.name)
        assert [f["laplace_id"] for f in listed["fits"]] == [fit["laplace_id"]]
        about = check(enc.request(client, "GET", fit_url), 200, enc.name)
        assert about["laplace_id"] == fit["laplace_id"] and about["bytes"] > 0
        check(enc.request(client, "DELETE", fit_url), 204, enc.name)
        check(enc.request(client, "GET", fit_url), 404, enc.name)
        assert check(enc.request(client, "GET", f"{url}/laplace"), 200, enc.name)["fits"] == []
    finally:
        client.delete(url)


# -- every operation is driven ---------------------------------------------------------------

# Which tests drive each operation of the spec. A new route fails the test below until a
# test here drives it and is listed.
DRIVERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("POST", "/v1/per-example"): ("test_curvature_beyond_products",),
    ("POST", "/v1/tapes/{tape_id}/frobenius-norm"): ("test_curvature_beyond_products",),
    ("POST", "/v1/tapes/{tape_id}/kfac"): ("test_curvature_beyond_products",),
    ("POST", "/v1/tapes/{tape_id}/laplace"): ("test_curvature_beyond_products",),
    ("GET", "/v1/tapes/{tape_id}/laplace"): ("test_curvature_beyond_products",),
    ("GET", "/v1/tapes/{tape_id}/laplace/{laplace_id}"): ("test_curvature_beyond_products",),
    ("DELETE", "/v1/tapes/{tape_id}/laplace/{laplace_id}"): ("test_curvature_beyond_products",),
    ("POST", "/v1/tapes/{tape_id}/laplace/{laplace_id}/log-marginal-likelihood"): (
        "test_curvature_beyond_products",
    ),
    ("POST", "/v1/tapes/{tape_id}/laplace/{laplace_id}/predictive"): (
        "test_curvature_beyond_products",
    ),
    ("POST", "/v1/tapes/{tape_id}/laplace/{laplace_id}/samples"): (
        "test_curvature_beyond_products",
    ),
    ("POST", "/v1/tapes/{tape_id}/per-example"): ("test_curvature_beyond_products",),
    ("POST", "/v1/gradient"): ("test_gradient", "test_models"),
    ("POST", "/v1/jacobian"): ("test_jacobian", "test_batch_jacobian"),
    ("POST", "/v1/hessian"): ("test_hessian",),
    ("POST", "/v1/hvp"): ("test_hvp", "test_hvp_of_a_0d_parameter_is_a_tensor"),
    ("GET", "/v1/tapes"): ("test_tape_lifecycle",),
    ("POST", "/v1/tapes"): ("test_tape_lifecycle", "test_tape_algorithms", "test_models"),
    ("GET", "/v1/tapes/{tape_id}"): ("test_tape_lifecycle",),
    ("PATCH", "/v1/tapes/{tape_id}"): ("test_tape_lifecycle",),
    ("DELETE", "/v1/tapes/{tape_id}"): ("test_tape_lifecycle",),
    ("POST", "/v1/tapes/{tape_id}/hvp"): (
        "test_tape_lifecycle",
        "test_hvp_of_a_0d_parameter_is_a_tensor",
    ),
    ("POST", "/v1/tapes/{tape_id}/gradient"): ("test_tape_lifecycle",),
    ("POST", "/v1/tapes/{tape_id}/jacobian"): ("test_tape_lifecycle", "test_tape_batch_jacobian"),
    ("POST", "/v1/tapes/{tape_id}/eigenvalues"): ("test_tape_algorithms",),
    ("POST", "/v1/tapes/{tape_id}/trace"): ("test_tape_algorithms",),
    ("POST", "/v1/tapes/{tape_id}/diagonal"): ("test_tape_algorithms",),
    ("POST", "/v1/tapes/{tape_id}/spectral-density"): ("test_tape_algorithms",),
    ("POST", "/v1/tapes/{tape_id}/solve"): ("test_tape_algorithms",),
    ("POST", "/v1/tapes/{tape_id}/influence"): ("test_tape_influence",),
    ("GET", "/v1/jobs"): ("test_jobs",),
    ("GET", "/v1/jobs/{job_id}"): ("test_jobs",),
    ("GET", "/v1/jobs/{job_id}/result"): ("test_jobs",),
    ("GET", "/v1/jobs/{job_id}/events"): ("test_jobs",),
    ("DELETE", "/v1/jobs/{job_id}"): ("test_jobs",),
    ("GET", "/v1/models"): ("test_models",),
    ("POST", "/v1/models"): ("test_models",),
    ("GET", "/v1/models/{name}"): ("test_models",),
    ("DELETE", "/v1/models/{name}"): ("test_models", "test_onnx_model"),
    ("PUT", "/v1/models/{name}"): ("test_onnx_model",),
    ("PUT", "/v1/datasets/{name}"): ("test_datasets",),
    ("GET", "/v1/datasets"): ("test_datasets",),
    ("GET", "/v1/datasets/{name}"): ("test_datasets",),
    ("DELETE", "/v1/datasets/{name}"): ("test_datasets",),
    ("GET", "/v1/ops"): ("test_operations_endpoints",),
    ("GET", "/healthz"): ("test_operations_endpoints",),
    ("GET", "/readyz"): ("test_operations_endpoints",),
    ("GET", "/metrics"): ("test_operations_endpoints",),
}

RAN: set[str] = set()


@pytest.fixture(autouse=True)
def _record_which_tests_ran(request: pytest.FixtureRequest):
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:  # the call's report is in by teardown
        RAN.add(request.node.originalname)


def test_every_operation_is_covered() -> None:
    """Runs last in this module: every operation of the spec has a driver here, and each
    driver that ran reached its operations with a success that passed the checks."""
    missing = [op for op in spec_operations() if op not in DRIVERS]
    assert not missing, (
        f"operations of openapi.json no conformance test drives: {missing};"
        " drive them in tests/service/test_conformance.py and list them "
        "in DRIVERS"
    )
    stale = [op for op in DRIVERS if op not in spec_operations()]
    assert not stale, f"DRIVERS lists operations the spec no longer has: {stale}"
    names = {n for drivers in DRIVERS.values() for n in drivers}
    assert names <= set(globals()), f"DRIVERS names unknown tests: {names - set(globals())}"
    unreached = [op for op, drivers in DRIVERS.items() if set(drivers) <= RAN and op not in COVERED]
    assert not unreached, f"driven but never answered with a checked success: {unreached}"


def test_validator_catches_a_bare_number_for_a_tensor() -> None:
    """The checks themselves: a bare number where the schema wants a tensor fails."""
    schema = {"$ref": "#/components/schemas/HVPResponse"}
    good = {
        "value": {"dtype": "float32", "shape": [], "data": [1.0]},
        "gradients": {},
        "hvp": {"b": {"dtype": "float32", "shape": [], "data": [21.0]}},
    }
    validate(good, schema, "good")
    with pytest.raises(AssertionError, match="does not follow its schema"):
        validate({**good, "hvp": {"b": 21.0}}, schema, "bad")
    assert math.isclose(float(issue_hvp(ISSUE_VECTORS[0])["b"]), 21.0)
