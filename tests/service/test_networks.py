"""Issue 13's ops over HTTP: a small CNN written in the definition language (conv2d,
relu, max_pool2d, reshape, matmul, softmax_cross_entropy), its gradient and HVPs from
the service against finite differences of the engine's forward pass; a bad conv is a
422 naming the line and the shapes."""

from __future__ import annotations

import numpy as np

import engine as gt
from engine.language import compile_definition, evaluate
from tests.service.wire import arr, num, post, problem, t

rng = np.random.default_rng(31)
VALUES = {
    "w1": rng.standard_normal((4, 1, 3, 3)) * 0.5,
    "b1": rng.standard_normal(4) * 0.1,
    "w2": rng.standard_normal((36, 3)) * 0.3,
}
X = rng.standard_normal((2, 1, 6, 6))
LABELS = np.array([1, 2], np.int32)
PROGRAM = [
    "h = relu(conv2d(x, w1, b1, padding=1))",
    "p = max_pool2d(h, 2)",
    "loss = softmax_cross_entropy(reshape(p, (2, 36)) @ w2, y)",
]
DEFN = {
    "variables": {k: t(v, "float64") for k, v in VALUES.items()},
    "inputs": {"x": t(X, "float64"), "y": t(LABELS, "int32")},
    "program": PROGRAM,
}


def _loss(values: dict[str, np.ndarray]) -> float:
    defn = {"variables": values, "inputs": {"x": X, "y": LABELS}, "program": PROGRAM}
    program = compile_definition(defn)
    return float(program.run(program.leaves(defn), targets=["loss"])["loss"].numpy())


def _gradient(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    defn = {"variables": values, "inputs": {"x": X, "y": LABELS}, "program": PROGRAM}
    return {k: np.asarray(v) for k, v in evaluate(defn, "loss").gradients.items()}


def test_cnn_gradient_and_hvp_over_http(client) -> None:
    eps = 1e-6
    answer = post(client, "/v1/gradient", {"definition": DEFN, "target": "loss"})
    assert np.isclose(num(answer["value"]), _loss(VALUES), rtol=1e-12)
    grads = {k: arr(v) for k, v in answer["gradients"].items()}
    assert set(grads) == set(VALUES)
    for _ in range(3):  # directional derivatives against central differences of the loss
        d = {k: rng.standard_normal(v.shape) for k, v in VALUES.items()}
        plus = _loss({k: v + eps * d[k] for k, v in VALUES.items()})
        minus = _loss({k: v - eps * d[k] for k, v in VALUES.items()})
        along = sum(float(np.sum(grads[k] * d[k])) for k in VALUES)
        np.testing.assert_allclose(along, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-9)

    vectors = [{k: rng.standard_normal(v.shape) for k, v in VALUES.items()} for _ in range(2)]
    wire = [{k: t(v, "float64") for k, v in vec.items()} for vec in vectors]
    hvps = post(client, "/v1/hvp", {"definition": DEFN, "target": "loss", "vectors": wire})["hvps"]
    eps = 1e-5
    for vec, product in zip(vectors, hvps, strict=True):
        plus = _gradient({k: v + eps * vec[k] for k, v in VALUES.items()})
        minus = _gradient({k: v - eps * vec[k] for k, v in VALUES.items()})
        for k in VALUES:
            expected = (plus[k] - minus[k]) / (2 * eps)
            np.testing.assert_allclose(arr(product[k]), expected, rtol=1e-5, atol=1e-8)


def test_a_bad_conv_is_a_422_naming_line_and_shapes(client) -> None:
    bad = {**DEFN, "program": ["h = conv2d(x, w2)", *PROGRAM[1:]]}
    body = problem(client.post("/v1/gradient", json={"definition": bad, "target": "loss"}), 422)
    assert "line 1" in body["detail"] and "conv2d" in body["detail"]
    assert "(36, 3)" in body["detail"], body["detail"]


def test_the_catalogue_lists_the_new_ops(client) -> None:
    response = client.get("/v1/ops")
    assert response.status_code == 200
    body = response.json()
    entries = body["ops"] if isinstance(body, dict) else body
    names = {e["name"] for e in entries}
    assert {"conv", "conv2d", "max_pool2d", "embedding", "scaled_dot_product_attention"} <= names
    conv2d = next(e for e in entries if e["name"] == "conv2d")
    assert conv2d["signature"] == (
        "conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1)"
    )
    assert gt.conv2d is gt.public_ops["conv2d"].fn  # the engine's own op, same name
