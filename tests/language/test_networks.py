"""Issue 13's language functions in whole networks: a small CNN (conv2d, relu,
max_pool2d, reshape, matmul, softmax_cross_entropy) and a one-block attention model
(embedding, causal scaled_dot_product_attention, layer_norm), their gradients and
Hessian-vector products against central finite differences, and the problems a bad
call reports."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.language import DefinitionError, compile_definition, evaluate

rng = np.random.default_rng(13)
CNN = {
    "variables": {
        "w1": rng.standard_normal((4, 1, 3, 3)) * 0.5,
        "b1": rng.standard_normal(4) * 0.1,
        "w2": rng.standard_normal((36, 3)) * 0.3,
        "b2": rng.standard_normal(3) * 0.1,
    },
    "inputs": {"x": rng.standard_normal((2, 1, 6, 6)), "y": np.array([2, 0], np.int32)},
    "program": [
        "h = relu(conv2d(x, w1, b1, padding='same'))",
        "p = max_pool2d(h, 2)",
        "logits = reshape(p, (2, 36)) @ w2 + b2",
        "loss = softmax_cross_entropy(logits, y)",
    ],
}
ATTENTION = {
    "variables": {
        "table": rng.standard_normal((7, 4)),
        "wq": rng.standard_normal((4, 4)) * 0.5,
        "wk": rng.standard_normal((4, 4)) * 0.5,
        "wv": rng.standard_normal((4, 4)) * 0.5,
    },
    "inputs": {"ids": np.array([[1, 5, 2, 2], [6, 0, 3, 1]], np.int32)},
    "program": [
        "e = embedding(table, ids)",
        "a = scaled_dot_product_attention(e @ wq, e @ wk, e @ wv, causal=True)",
        "loss = mean(layer_norm(a + e) ** 3)",
    ],
}
NAMES = {
    "cnn": (CNN, ["w1", "b1", "w2", "b2"]),
    "attention": (ATTENTION, ["table", "wq", "wk", "wv"]),
}


def _loss_fn(defn: dict, names: list[str]):
    program = compile_definition(defn)
    leaves = program.leaves(defn)

    def loss(*values):
        env = dict(leaves, **dict(zip(names, values)))
        return program.run(env, targets=["loss"])["loss"]

    return loss


def _fd_gradient(loss, values: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    out = []
    for k, base in enumerate(values):
        grad = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            vals = []
            for sign in (1, -1):
                moved = [v.copy() for v in values]
                moved[k][i] += sign * eps
                vals.append(float(loss(*[gt.constant(m) for m in moved]).numpy()))
            grad[i] = (vals[0] - vals[1]) / (2 * eps)
        out.append(grad)
    return out


@pytest.mark.parametrize("net", sorted(NAMES))
def test_gradient_matches_finite_differences(net: str) -> None:
    defn, names = NAMES[net]
    result = evaluate(defn, "loss", names)
    values = [np.asarray(defn["variables"][n], np.float64) for n in names]
    expected = _fd_gradient(_loss_fn(defn, names), values)
    for name, fd in zip(names, expected):
        np.testing.assert_allclose(np.asarray(result.gradients[name]), fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("net", sorted(NAMES))
def test_hvp_matches_finite_differences_of_the_gradient(net: str) -> None:
    defn, names = NAMES[net]
    loss = _loss_fn(defn, names)
    values = [np.asarray(defn["variables"][n], np.float64) for n in names]
    vector = [np.random.default_rng(1).standard_normal(v.shape) for v in values]
    products = gt.hvp(loss, [gt.constant(v) for v in values], [gt.constant(v) for v in vector])

    def gradient(at: list[np.ndarray]) -> list[np.ndarray]:
        return [
            g.numpy() for g in gt.grad(loss, argnums=tuple(range(len(at))))(*map(gt.constant, at))
        ]

    eps = 1e-5
    plus = gradient([v + eps * d for v, d in zip(values, vector)])
    minus = gradient([v - eps * d for v, d in zip(values, vector)])
    for product, p, m in zip(products, plus, minus):
        np.testing.assert_allclose(product.numpy(), (p - m) / (2 * eps), rtol=1e-5, atol=1e-7)
    # Several vectors in one batched pass (a HessianOperator) give the same products.
    operator = gt.hessian_operator(loss, *[gt.constant(v) for v in values])
    batched = operator.hvp_many(*[gt.constant(np.stack([d, -2 * d])) for d in vector])
    for product, b in zip(products, batched):
        np.testing.assert_allclose(b.numpy()[0], product.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b.numpy()[1], -2 * product.numpy(), rtol=1e-9, atol=1e-12)


def problems(program: list[str], inputs: dict) -> list[str]:
    with pytest.raises(DefinitionError) as info:
        compile_definition({"inputs": inputs, "program": program})
    return [str(p) for p in info.value.problems]


IMG = {"x": np.zeros((2, 3, 8, 8)), "w": np.zeros((4, 3, 3, 3)), "k": np.zeros((2, 4), np.int32)}
L1 = "program line 1, column 5"


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "y = conv2d(x, w[:, :2])",
            (
                f"{L1}: conv2d: weight (4, 2, 3, 3) must have C_in/groups = 3 channels for input "
                "(2, 3, 8, 8) with groups=1"
            ),
        ),
        (
            "y = conv2d(x, w, groups=2)",
            f"{L1}: conv2d: groups=2 must divide the input channels (3) and the output channels (4)",
        ),
        (
            "y = conv(x, w, w[0, 0, 0])",
            f"{L1}: conv: bias (3,) must have shape (4,) for weight (4, 3, 3, 3)",
        ),
        (
            "y = conv1d(x, w)",
            f"{L1}: conv1d: weight (4, 3, 3, 3) must be [C_out, C_in/groups, k]",
        ),
        (
            "y = conv2d(x, w, padding=((1, 2), (3,)))",
            (
                f"{L1}: conv2d: padding must be int | tuple[int, ...] | tuple[tuple[int, int], ...] "
                "| 'SAME_UPPER' | 'SAME_LOWER' | 'VALID' | 'same' | 'valid' | None, got a tuple or list"
            ),
        ),
        (
            "y = conv2d(x, w, stride=(1, 2, 3))",
            f"{L1}: conv2d: strides must be 2 positive ints, got (1, 2, 3)",
        ),
        (
            "y = conv(x[0], w)",
            (
                f"{L1}: conv: input (3, 8, 8) and weight (4, 3, 3, 3) must be [N, C, *spatial] and "
                "[C_out, C_in/groups, *kernel] with as many spatial axes"
            ),
        ),
        (
            "y = max_pool2d(x, 9)",
            (
                f"{L1}: max_pool2d: a window of (9, 9) (dilations (1, 1)) does not fit the spatial "
                "shape (8, 8) padded by ((0, 0), (0, 0))"
            ),
        ),
        (
            "y = avg_pool(x, (2, 2), pads=2)",
            f"{L1}: avg_pool: pads ((2, 2), (2, 2)) must be smaller than the window (2, 2)",
        ),
        (
            "y = max_pool2d(k, 2)",
            f"{L1}: max_pool2d: x must be a floating-point tensor, got int32; cast it first",
        ),
        (
            "y = embedding(w, x)",
            f"{L1}: embedding: ids must be an integer tensor, got float64",
        ),
        (
            "y = scaled_dot_product_attention(x, x, w)",
            (
                f"{L1}: scaled_dot_product_attention: k (2, 3, 8, 8) and v (4, 3, 3, 3) must have "
                "the same non-zero number of keys"
            ),
        ),
        (
            "y = pad(x[0, 0], ((8, 0), (0, 0)), mode='REFLECT')",
            (
                f"{L1}: pad: REFLECT padding of (8, 0) needs at most 7 entries on each side of axis 0 "
                "(size 8)"
            ),
        ),
    ],
)
def test_bad_calls_name_the_line_op_and_shapes(line: str, message: str) -> None:
    assert problems([line], IMG) == [message]


def test_im2col_workspace_counts_against_the_limit() -> None:
    inputs = {"z": np.zeros((1, 1, 1, 1)), "w": np.zeros((16, 16, 5, 5))}
    line = "y = conv2d(broadcast_to(z, (16, 16, 128, 128)), w)"
    assert problems([line], inputs) == [
        f"{L1}: conv2d: its gradient needs 98406400 elements of workspace; the limit is 16777216"
    ]
    pooled = "y = max_pool(broadcast_to(z, (16, 16, 128, 128)), (8, 8), strides=1)"
    assert problems([pooled], inputs) == [
        f"{L1}: max_pool: its gradient needs 239878144 elements of workspace; the limit is 16777216"
    ]
