"""The op catalogue and the shape rules: every public op is callable from a program, and
the inferred shape and dtype equal the engine's real output, op by op."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

import engine as gt
from engine.language import catalogue
from engine.language.catalogue import BUILTINS, SIGNATURES
from engine.language.constants import KINDS
from tests.engine.test_ops import RULE_ROWS
from tests.language.helpers import leaves_for_ops, run_line

# One row per call form: op -> expressions over the inputs of leaves_for_ops(). An op
# with a row of its own in tests/engine/test_ops.py is checked there already; a row here
# adds call forms (literals, keywords, other dtypes).
EXAMPLES = {
    "add": ["a + b", "add(a, c)", "a + 1", "k + 2", "1 + f"],
    "subtract": ["a - col", "1.5 - a", "subtract(t, a)"],
    "multiply": ["a * s", "k * k", "2 * f"],
    "divide": ["a / p", "divide(1, p)", "f / 2"],
    "power": ["p ** 0.5", "k ** 2", "power(p, a)"],
    "maximum": ["maximum(a, 0)", "maximum(k, 1)"],
    "minimum": ["minimum(a, b)"],
    "negative": ["-a", "negative(k)"],
    "exp": ["exp(a)", "exp(f)"],
    "log": ["log(p)"],
    "log1p": ["log1p(p)"],
    "expm1": ["expm1(a)"],
    "sqrt": ["sqrt(p)"],
    "sin": ["sin(a)"],
    "cos": ["cos(s)"],
    "tanh": ["tanh(t)"],
    "sigmoid": ["sigmoid(a)"],
    "relu": ["relu(a)"],
    "abs": ["abs(a)", "abs(k)"],
    "cast": ["cast(k, 'float64')", "cast(a, dtype='int32')", "cast(a)", "cast(f, 'float32')"],
    "where": ["where(m, a, 0)", "where(a > 0, a, b)", "where(m, k, 1)"],
    "sign": ["sign(a)"],
    "greater": ["a > b", "greater(k, 1)"],
    "greater_equal": ["a >= 0.5"],
    "less": ["a < c"],
    "less_equal": ["less_equal(k, k)"],
    "equal": ["a == b", "equal(m, m)"],
    "not_equal": ["k != 0"],
    "logical_and": ["logical_and(m, a > 0)"],
    "logical_or": ["logical_or(m, m)"],
    "logical_not": ["logical_not(m)"],
    "isfinite": ["isfinite(a)"],
    "square": ["square(a)", "square(k)"],
    "reciprocal": ["reciprocal(p)"],
    "tan": ["tan(a)"],
    "clip": ["clip(a, -0.5, 0.5)", "clip(k, 0, 2)"],
    "softplus": ["softplus(a)"],
    "log_sigmoid": ["log_sigmoid(a)"],
    "elu": ["elu(a)", "elu(a, alpha=0.5)"],
    "leaky_relu": ["leaky_relu(a, 0.1)"],
    "silu": ["silu(a)"],
    "gelu": ["gelu(a)", "gelu(a, approximate=True)"],
    "identity": ["identity(a)", "identity(k)"],
    "erf": ["erf(a)"],
    "rsqrt": ["rsqrt(p)"],
    "xlogy": ["xlogy(a, p)", "xlogy(c, p)"],
    "divide_no_nan": ["divide_no_nan(a, b)", "divide_no_nan(a, 0.0)"],
    "cumsum": ["cumsum(a)", "cumsum(t, axis=-1, exclusive=True, reverse=True)"],
    "sort": ["sort(a)", "sort(t, axis=0, direction='DESCENDING')", "sort(s)"],
    "pad": [
        "pad(a, ((1, 0), (0, 2)))",
        "pad(c, ((2, 2),), constant_values=1.5)",
        "pad(a, ((2, 1), (3, 0)), mode='REFLECT')",
        "pad(t, ((0, 0), (1, 3), (0, 1)), 'EDGE')",
    ],
    "tile": ["tile(a, (2, 1))", "tile(t, (1, 2, 3))"],
    "gather_nd": ["gather_nd(transpose(a), reshape(lab, (3, 1)))"],
    "scatter_nd": ["scatter_nd(reshape(lab, (3, 1)), a, (4, 4))"],
    "reshape": ["reshape(a, (4, -1))", "reshape(t, shape=24)", "reshape(s, (1, 1))"],
    "transpose": ["transpose(t)", "transpose(t, (1, 2, 0))", "transpose(a, axes=(0, 1))"],
    "swapaxes": ["swapaxes(t, 0, 2)", "swapaxes(a)"],
    "moveaxis": ["moveaxis(t, 0, -1)", "moveaxis(t, source=2, destination=0)"],
    "broadcast_to": ["broadcast_to(c, (2, 3, 4))", "broadcast_to(s, (2,))"],
    "expand_dims": ["expand_dims(a, -1)", "expand_dims(s)"],
    "squeeze": ["squeeze(col)", "squeeze(col, axis=1)", "squeeze(a)"],
    "flatten": ["flatten(t)", "flatten(s)"],
    "concatenate": [
        "concatenate([a, b, a], axis=0)",
        "concatenate([a, col], axis=1)",
        "concatenate([c])",
    ],
    "stack": ["stack([a, b], axis=-1)", "stack([s, s, s])", "stack([r], axis=1)"],
    "getitem": [
        "a[1:, ::2]",
        "t[..., 2]",
        "a[None, 1]",
        "getitem(a, (0, None))",
        "t[-1, :2, 1:3]",
        "a[:, -1]",
        "s[None]",
        "t[::-1]",
        "a[5:]",
    ],
    "take": ["take(a, [3, 1, 0], axis=1)", "take(a, lab, axis=1)", "take(t, 1, axis=0)"],
    "matmul": [
        "a @ transpose(a)",
        "c @ transpose(a)",
        "a @ c",
        "t @ c",
        "c @ c",
        "t @ transpose(t, (0, 2, 1))",
        "k @ transpose(k)",
        "sq @ a",
    ],
    "outer": ["outer(r, c)", "outer(a, s)"],
    "einsum": [
        "einsum('ij,jk->ik', a, transpose(b))",
        "einsum('...ij,j', t, c)",
        "einsum('ij->', a)",
        "einsum('ij,ij->i', a, col)",
        "einsum('bij,j->bi', t, c)",
    ],
    "solve": ["solve(sq, r)", "solve(sq, a)"],
    "sum": [
        "sum(a)",
        "sum(t, axis=(0, -1), keepdims=True)",
        "sum(k, 0)",
        "sum(s)",
        "sum(k, axis=())",
    ],
    "max": ["max(a, axis=-1)", "max(k)"],
    "min": ["min(t, 0, True)"],
    "prod": ["prod(a, axis=1)", "prod(k)"],
    "argmax": ["argmax(a)", "argmax(t, axis=1)"],
    "argmin": ["argmin(t, axis=-1)"],
    "any": ["any(m)", "any(a, axis=1)"],
    "all": ["all(m, axis=0, keepdims=True)"],
    "mean": ["mean(a, axis=0)", "mean(f)"],
    "var": ["var(a, axis=0)", "var(t)"],
    "std": ["std(t, axis=-1, ddof=1)"],
    "logsumexp": ["logsumexp(a, axis=-1)", "logsumexp(t, keepdims=True)"],
    "norm": [
        "norm(a)",
        "norm(a, ord=1, axis=0)",
        "norm(a, ord='inf', axis=1, keepdims=True)",
        "norm(r, 2)",
    ],
    "stop_gradient": ["stop_gradient(a)", "stop_gradient(k)"],
    "log_softmax": ["log_softmax(t, axis=0)"],
    "softmax": ["softmax(a)"],
    "mean_squared_error": [
        "mean_squared_error(a, b)",
        "mean_squared_error(a, b, reduction='none')",
    ],
    "huber": ["huber(a, b, delta=0.5, reduction='sum')"],
    "softmax_cross_entropy": [
        "softmax_cross_entropy(a, lab)",
        "softmax_cross_entropy(a, softmax(b), reduction='none')",
        "softmax_cross_entropy(t, r, axis=1, reduction='none')".replace(
            "r, ", "softmax(t, axis=1), "
        ),
    ],
    "sigmoid_cross_entropy": ["sigmoid_cross_entropy(a, sigmoid(b))"],
    "batch_norm": ["batch_norm(a)", "batch_norm(t, c, c)", "batch_norm(a, gamma=col)"],
    "layer_norm": ["layer_norm(t, c)", "layer_norm(a, beta=c)"],
    "clip_by_norm": ["clip_by_norm(a, 0.5)", "clip_by_norm(a, clip_norm=2.0, axis=1)"],
    # issue 13
    "conv": [
        "conv(img, filt)",
        "conv(img, filt, c, strides=(2, 1), pads=((1, 0), (2, 1)), dilations=2)",
        "conv(seq, reshape(filt, (4, 3, 6)), pads=[1, 2])",
        "conv(img, reshape(filt, (6, 1, 6, 2)), groups=3, pads=1)",
    ],
    "conv1d": [
        "conv1d(seq, reshape(filt, (4, 3, 6)), stride=2, padding=3)",
        "conv1d(seq, reshape(filt, (4, 3, 6)), padding='same')",
    ],
    "conv2d": ["conv2d(img, filt, c, padding=(1, 0), dilation=(1, 2))", "conv2d(img, filt)"],
    "max_pool": [
        "max_pool(img, (2, 2))",
        "max_pool(seq, (3,), strides=2, pads=1, ceil_mode=True)",
        "max_pool(t, (2, 2), dilations=(1, 2), pads=((1, 0), (0, 1)))",
    ],
    "avg_pool": [
        "avg_pool(img, (3, 3), strides=2, pads=1, count_include_pad=True, ceil_mode=True)",
        "avg_pool(a, (2, 3))",
        "avg_pool(img, (2, 3), strides=2, pads='SAME_LOWER')",
    ],
    "max_pool2d": ["max_pool2d(img, 2)", "max_pool2d(img, (3, 2), stride=1, padding=1)"],
    "avg_pool2d": ["avg_pool2d(img, 3, 2, 1, ceil_mode=True)", "avg_pool2d(t, (2, 2))"],
    "embedding": ["embedding(transpose(a), ids)", "embedding(c, lab)", "embedding(t, 1)"],
    "scaled_dot_product_attention": [
        "scaled_dot_product_attention(heads, heads, heads)",
        "scaled_dot_product_attention(heads, heads[..., :3, :], heads[0, :, :3], causal=True)",
        "scaled_dot_product_attention(a, b, col)",
    ],
    # built-ins
    "grad": ["grad(sum(a * a), a)", "grad(a, c)"],
    "clip_grad_norm": ["clip_grad_norm(a, 1.0)"],
}
CASES = [(op, expr) for op, exprs in EXAMPLES.items() for expr in exprs]


def test_every_public_op_has_a_shape_rule_and_an_example() -> None:
    """Adding an op means one block (with its shape rule) and one row here."""
    missing = sorted(name for name, info in gt.public_ops.items() if info.shape_rule is None)
    assert not missing, f"public ops registered without shape_rule=: {missing}"
    unchecked = set(gt.public_ops) - set(EXAMPLES) - RULE_ROWS
    assert not unchecked, f"shape rules no test compares with the engine: {sorted(unchecked)}"
    assert set(EXAMPLES) <= set(gt.public_ops) | set(BUILTINS)
    assert set(BUILTINS) <= set(EXAMPLES)


def test_rule_kinds_name_real_parameters_and_known_kinds() -> None:
    for name, info in gt.public_ops.items():
        params = inspect.signature(info.fn).parameters
        assert set(info.kinds) <= set(params), name
        assert set(info.kinds.values()) <= set(KINDS) | {"tensors"}, name


@pytest.mark.parametrize("op,expr", CASES, ids=[f"{op}:{expr}" for op, expr in CASES])
def test_inferred_type_is_the_engines(op: str, expr: str) -> None:
    inferred, actual = run_line(expr, leaves_for_ops())
    assert inferred.shape == actual.shape
    assert inferred.dtype == actual.dtype


def test_catalogue_is_json_and_complete() -> None:
    entries = catalogue()
    json.dumps(entries)
    names = [e["name"] for e in entries]
    assert set(names) == set(SIGNATURES) == set(gt.public_ops) | set(BUILTINS)
    by_name = {e["name"]: e for e in entries}
    total = by_name["sum"]
    assert total["signature"] == "sum(x, axis=None, keepdims=False)"
    assert total["family"] == "reduction"
    assert total["doc"] == gt.public_ops["sum"].doc
    assert [p["kind"] for p in total["params"]] == ["tensor", "constant", "constant"]
    assert total["params"][1] == {
        "name": "axis",
        "kind": "constant",
        "type": "int | tuple[int, ...] | None",
        "required": False,
        "variadic": False,
        "default": None,
    }
    assert by_name["add"]["operator"] == "+"
    assert by_name["matmul"]["operator"] == "@"
    assert by_name["einsum"]["signature"] == "einsum(spec, *operands)"
    assert by_name["concatenate"]["params"][0]["type"] == "list[tensor]"
    assert by_name["batch_norm"]["params"][1]["type"] == "tensor | None"
    assert by_name["grad"]["family"] == "builtin"
    assert by_name["clip_grad_norm"]["signature"] == "clip_grad_norm(x, max_norm)"


def test_catalogue_lists_user_functions() -> None:
    from engine.language import FunctionDef

    fn = FunctionDef(("x", "y"), ("z = x * y",), ("grad_x = upstream * y", "grad_y = upstream * x"))
    entries = catalogue({"mul": fn})
    entry = next(e for e in entries if e["name"] == "mul")
    assert entry["signature"] == "mul(x, y)"
    assert entry["family"] == "function"


def test_values_match_direct_engine_calls() -> None:
    # A spot check beside the property tests: the program computes what gt computes.
    leaves = leaves_for_ops()
    _, r = run_line("softmax_cross_entropy(a, lab) + mean(t[..., 1:] ** 2)", leaves)
    a, lab, t = (gt.constant(leaves[n]) for n in ("a", "lab", "t"))
    expected = gt.softmax_cross_entropy(a, lab) + gt.mean(t[..., 1:] ** 2)
    np.testing.assert_array_equal(r.numpy(), expected.numpy())
