"""The op table: one row per op, driving gradient checks, forward values, batching and
(for a row that calls the op itself) the op's shape rule, as a program infers it.

Each row: a name, the function under test (engine tensors in, tensor out), the NumPy
reference for its value, the argument shapes, the input domain, the highest derivative
order checked, and a tolerance. Finite differences run in float64. Rows with loosened
tolerances say why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import engine as gt
from engine.language import compile_definition
from engine.testing import check_grads
from tests.engine import naive_conv

SCALAR = ((),)
MATRIX = ((3, 4),)
UNARY_SHAPES = [(), (3, 4), (2, 3, 4)]
BINARY_SHAPES = [((), ()), ((3, 4), (3, 4)), ((3, 1), (1, 4)), ((2, 3, 4), (4,)), ((), (3,))]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.exp(x))


def _logsumexp(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + _erf(x / np.sqrt(2)))


@dataclass
class Row:
    name: str
    fn: Callable[..., Any]
    ref: Callable[..., Any] | None
    shapes: list[tuple]  # each entry: a tuple of argument shapes
    domain: str = "real"
    order: int = 2
    tol: float = 1e-5
    note: str = ""
    modes: tuple = ("fwd", "rev")
    extra: dict = field(default_factory=dict)


def unary(name: str, ref: Callable[..., Any] | None, domain: str = "real", **kw: Any) -> Row:
    fn = getattr(gt, name)
    return Row(name, fn, ref, [(s,) for s in UNARY_SHAPES], domain, **kw)


def binary(name: str, ref: Callable[..., Any], domain: str = "real", **kw: Any) -> Row:
    return Row(name, getattr(gt, name), ref, BINARY_SHAPES, domain, **kw)


ROWS = [
    # ---- arithmetic ----
    binary("add", np.add),
    binary("subtract", np.subtract),
    binary("multiply", np.multiply),
    binary("divide", np.divide, domain="positive"),
    binary("power", np.power, domain="positive"),
    binary("maximum", np.maximum, domain="distinct"),
    binary("minimum", np.minimum, domain="distinct"),
    Row(
        "operators",
        lambda x, y: (x + 2.0) * y - x / 3.0 + (-x) ** 2,
        lambda x, y: (x + 2) * y - x / 3 + x**2,
        BINARY_SHAPES,
    ),
    # ---- unary math ----
    unary("negative", np.negative),
    unary("exp", np.exp),
    unary("log", np.log, domain="positive"),
    unary("log1p", np.log1p, domain="positive"),
    unary("log2", np.log2, domain="positive"),
    unary("expm1", np.expm1),
    unary("sqrt", np.sqrt, domain="positive"),
    unary("square", np.square),
    unary("reciprocal", np.reciprocal, domain="positive"),
    unary("sin", np.sin),
    unary("cos", np.cos),
    unary("tan", np.tan, domain="unit"),
    unary("tanh", np.tanh),
    unary("abs", np.abs, domain="away_from_zero"),
    unary("identity", lambda x: x),
    unary("erf", _erf),
    unary("rsqrt", lambda x: 1 / np.sqrt(x), domain="positive"),
    binary("xlogy", lambda x, y: x * np.log(y), domain="positive"),
    Row(
        "xlogy_zero",
        lambda x, y: gt.xlogy(x * gt.constant(np.array([0.0, 1.0, 0.0, 1.0]), device=x.device), y),
        lambda x, y: np.where(np.array([0, 1, 0, 1]) == 0, 0.0, x * np.log(y)),
        [((3, 4), (3, 4))],
        "positive",
    ),
    binary("divide_no_nan", np.divide, domain="positive"),
    binary("atan2", np.arctan2),
    Row(
        "divide_no_nan_zero",
        lambda x, y: gt.divide_no_nan(
            x, y * gt.constant(np.array([1.0, 0.0, 1.0, 0.0]), device=x.device)
        ),
        lambda x, y: np.where(
            np.array([1, 0, 1, 0]) == 0, 0.0, x / np.where(np.array([1, 0, 1, 0]) == 0, 1, y)
        ),
        [((3, 4), (3, 4))],
        "positive",
    ),
    unary("sigmoid", _sigmoid),
    unary("relu", lambda x: np.maximum(x, 0), domain="away_from_zero"),
    unary("elu", lambda x: np.where(x > 0, x, np.expm1(x)), domain="away_from_zero"),
    unary("leaky_relu", lambda x: np.where(x > 0, x, 0.2 * x), domain="away_from_zero"),
    unary("softplus", _softplus),
    unary("log_sigmoid", lambda x: -_softplus(-x)),
    unary("gelu", _gelu),
    Row(
        "gelu_tanh",
        lambda x: gt.gelu(x, approximate=True),
        _gelu_tanh,
        [(s,) for s in UNARY_SHAPES],
    ),
    unary("silu", lambda x: x * _sigmoid(x)),
    Row(
        "clip",
        lambda x: gt.clip(x, -0.5, 0.7),
        lambda x: np.clip(x, -0.5, 0.7),
        [(s,) for s in UNARY_SHAPES],
        "away_from_clip",
    ),
    Row(
        "where",
        lambda x, y: gt.where(x > y, x * y, x - y),
        lambda x, y: np.where(x > y, x * y, x - y),
        BINARY_SHAPES,
        "distinct",
    ),
    # ---- reductions ----
    Row(
        "cumsum",
        lambda x: gt.cumsum(x, axis=1),
        lambda x: np.cumsum(x, axis=1),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row(
        "cumsum_exclusive_reverse",
        lambda x: gt.cumsum(x, axis=0, exclusive=True, reverse=True),
        lambda x: np.flip(np.cumsum(np.flip(x, 0), 0), 0) - x,
        [((3, 4),)],
    ),
    Row(
        "moments",
        lambda x: gt.moments(x, axes=0)[0] * gt.moments(x, axes=0)[1],
        lambda x: np.mean(x, 0) * np.var(x, 0),
        [((3, 4),)],
    ),
    Row(
        "moments_keepdims",
        lambda x: gt.moments(x, axes=(0, 2), keepdims=True)[1],
        lambda x: np.var(x, axis=(0, 2), keepdims=True),
        [((2, 3, 4),)],
    ),
    Row("sum", lambda x: gt.sum(x), np.sum, [(s,) for s in UNARY_SHAPES]),
    Row(
        "sum_axis",
        lambda x: gt.sum(x, axis=1),
        lambda x: np.sum(x, axis=1),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row(
        "sum_keepdims",
        lambda x: gt.sum(x, axis=(0, -1), keepdims=True),
        lambda x: np.sum(x, axis=(0, -1), keepdims=True),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row(
        "mean",
        lambda x: gt.mean(x, axis=0),
        lambda x: np.mean(x, axis=0),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row(
        "max",
        lambda x: gt.max(x, axis=-1),
        lambda x: np.max(x, axis=-1),
        [((3, 4),), ((2, 3, 4),)],
        "distinct",
    ),
    Row(
        "min",
        lambda x: gt.min(x, axis=0, keepdims=True),
        lambda x: np.min(x, axis=0, keepdims=True),
        [((3, 4),)],
        "distinct",
    ),
    Row("max_all", lambda x: gt.max(x), np.max, [((3, 4),)], "distinct"),
    Row(
        "prod",
        lambda x: gt.prod(x, axis=1),
        lambda x: np.prod(x, axis=1),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row(
        "prod_zero",
        lambda x: gt.prod(x * gt.constant(np.array([1.0, 0.0, 1.0, 1.0])), axis=-1),
        lambda x: np.prod(x * np.array([1.0, 0, 1, 1]), axis=-1),
        [((3, 4),)],
    ),
    Row(
        "logsumexp",
        lambda x: gt.logsumexp(x, axis=-1),
        lambda x: _logsumexp(x, axis=-1),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row("var", lambda x: gt.var(x, axis=0), lambda x: np.var(x, axis=0), [((3, 4),)]),
    Row(
        "std",
        lambda x: gt.std(x, axis=-1, ddof=1),
        lambda x: np.std(x, axis=-1, ddof=1),
        [((3, 4),)],
    ),
    Row(
        "norm",
        lambda x: gt.norm(x, axis=-1),
        lambda x: np.linalg.norm(x, axis=-1),
        [((3, 4),), ((4,),)],
    ),
    Row(
        "norm_l1",
        lambda x: gt.norm(x, ord=1),
        lambda x: np.sum(np.abs(x)),
        [((3, 4),)],
        "away_from_zero",
    ),
    # ---- shape ----
    Row(
        "reshape",
        lambda x: gt.reshape(x, (4, -1)),
        lambda x: x.reshape(4, -1),
        [((3, 4),), ((2, 3, 4),)],
    ),
    Row("transpose", lambda x: gt.transpose(x), lambda x: x.T, [((3, 4),), ((2, 3, 4),)]),
    Row(
        "transpose_axes",
        lambda x: gt.transpose(x, (1, 2, 0)),
        lambda x: x.transpose(1, 2, 0),
        [((2, 3, 4),)],
    ),
    Row("expand_dims", lambda x: gt.expand_dims(x, 1), lambda x: np.expand_dims(x, 1), [((3, 4),)]),
    Row("squeeze", lambda x: gt.squeeze(x, 1), lambda x: np.squeeze(x, 1), [((3, 1, 4),)]),
    Row(
        "broadcast_to",
        lambda x: gt.broadcast_to(x, (2, 3, 4)),
        lambda x: np.broadcast_to(x, (2, 3, 4)),
        [((3, 1),), ((4,),), ((),)],
    ),
    Row(
        "concatenate",
        lambda x, y: gt.concatenate([x, y, x], axis=1),
        lambda x, y: np.concatenate([x, y, x], axis=1),
        [((3, 4), (3, 2))],
    ),
    Row(
        "stack",
        lambda x, y: gt.stack([x, y], axis=-1),
        lambda x, y: np.stack([x, y], axis=-1),
        [((3, 4), (3, 4))],
    ),
    Row("getitem_basic", lambda x: x[1:, ::2], lambda x: x[1:, ::2], [((3, 4),), ((3, 4, 2),)]),
    Row("getitem_int", lambda x: x[..., 2], lambda x: x[..., 2], [((3, 4),)]),
    Row("getitem_newaxis", lambda x: x[None, 1], lambda x: x[None, 1], [((3, 4),)]),
    Row(
        "getitem_array",
        lambda x: x[np.array([0, 2, 0])],
        lambda x: x[np.array([0, 2, 0])],
        [((3, 4),)],
    ),
    Row(
        "getitem_mask",
        lambda x: x[np.array([True, False, True])],
        lambda x: x[np.array([True, False, True])],
        [((3, 4),)],
    ),
    Row(
        "getitem_pairs",
        lambda x: x[np.array([0, 1, 1]), np.array([3, 0, 0])],
        lambda x: x[np.array([0, 1, 1]), np.array([3, 0, 0])],
        [((3, 4),)],
    ),
    Row(
        "take",
        lambda x: gt.take(x, np.array([[3, 1], [0, 0]]), axis=1),
        lambda x: np.take(x, np.array([[3, 1], [0, 0]]), axis=1),
        [((3, 4),)],
    ),
    Row(
        "gather_nd",
        lambda x: gt.gather_nd(x, np.array([[2, 1], [0, 3], [2, 1]])),
        lambda x: x[np.array([2, 0, 2]), np.array([1, 3, 1])],
        [((3, 4),), ((3, 4, 2),)],
    ),
    Row(
        "scatter_nd",
        lambda u: gt.scatter_nd(np.array([[2], [0], [2]]), u, (4, 3)),
        lambda u: np.stack([u[1], np.zeros(3), u[0] + u[2], np.zeros(3)]),
        [((3, 3),)],
    ),
    Row(
        "sort",
        lambda x: gt.sort(x, axis=0),
        lambda x: np.sort(x, axis=0),
        [((3, 4),), ((5,),)],
        "distinct",
    ),
    Row(
        "sort_descending",
        lambda x: gt.sort(x, direction="DESCENDING"),
        lambda x: -np.sort(-x, axis=-1),
        [((3, 4),)],
        "distinct",
    ),
    Row(
        "top_k",
        lambda x: gt.top_k(x, 2)[0],
        lambda x: -np.sort(-x, axis=-1)[..., :2],
        [((3, 4),), ((5,),)],
        "distinct",
    ),
    Row(
        "pad",
        lambda x: gt.pad(x, ((1, 0), (2, 1)), constant_values=0.5),
        lambda x: np.pad(x, ((1, 0), (2, 1)), constant_values=0.5),
        [((3, 4),)],
    ),
    Row(
        "pad_reflect",
        lambda x: gt.pad(x, ((2, 1), (0, 3)), mode="REFLECT"),
        lambda x: np.pad(x, ((2, 1), (0, 3)), mode="reflect"),
        [((3, 4),)],
    ),
    Row(
        "pad_symmetric_edge",
        lambda x: gt.pad(gt.pad(x, ((1, 3), (0, 0)), mode="SYMMETRIC"), ((0, 0), (2, 1)), "EDGE"),
        lambda x: np.pad(np.pad(x, ((1, 3), (0, 0)), mode="symmetric"), ((0, 0), (2, 1)), "edge"),
        [((3, 4),)],
    ),
    Row(
        "tile",
        lambda x: gt.tile(x, (2, 1, 3)),
        lambda x: np.tile(x, (2, 1, 3)),
        [((2, 3, 4),)],
    ),
    Row(
        "split",
        lambda x: gt.split(x, [1, -1, 1], axis=1)[1] * 2.0 + gt.split(x, 2, axis=1)[0],
        lambda x: x[:, 1:3] * 2 + x[:, :2],
        [((3, 4),)],
    ),
    Row(
        "unstack",
        lambda x: gt.unstack(x, axis=-1)[2][:3] * gt.unstack(x)[0],
        lambda x: x[:3, 2] * x[0],
        [((4, 3),)],
    ),
    # ---- linear algebra ----
    Row(
        "matmul",
        gt.matmul,
        np.matmul,
        [
            ((3, 4), (4, 2)),
            ((2, 3, 4), (4, 5)),
            ((2, 1, 3, 4), (4, 2)),  # rows of a stack times a matrix: y's VJP one GEMM
            ((2, 3, 4), (2, 4, 2)),
            ((4,), (4, 2)),
            ((3, 4), (4,)),
            ((4,), (4,)),
            ((2, 1, 3, 4), (5, 4, 2)),
        ],
    ),
    Row(
        "einsum_matmul",
        lambda x, y: gt.einsum("ij,jk->ik", x, y),
        lambda x, y: np.einsum("ij,jk->ik", x, y),
        [((3, 4), (4, 2))],
    ),
    Row(
        "einsum_batch",
        lambda x, y: gt.einsum("bij,bjk->bik", x, y),
        lambda x, y: np.einsum("bij,bjk->bik", x, y),
        [((2, 3, 4), (2, 4, 5))],
    ),
    Row(
        "einsum_reduce",
        lambda x, y: gt.einsum("ij,k->i", x, y),
        lambda x, y: np.einsum("ij,k->i", x, y),
        [((3, 4), (2,))],
    ),
    Row(
        "einsum_ellipsis",
        lambda x, y: gt.einsum("...ij,j", x, y),
        lambda x, y: np.einsum("...ij,j", x, y),
        [((2, 3, 4), (4,))],
    ),
    Row("outer", gt.outer, np.outer, [((3,), (4,))]),
    Row(
        "solve",
        lambda a, b: gt.solve(a + 4.0 * gt.eye(3, dtype="float64", device=a.device), b),
        lambda a, b: np.linalg.solve(a + 4 * np.eye(3), b),
        [((3, 3), (3,)), ((3, 3), (3, 2))],
    ),
    # ---- nn ----
    Row(
        "softmax",
        lambda x: gt.softmax(x),
        lambda x: np.exp(x - _logsumexp(x, -1, True)),
        [((3, 4),)],
    ),
    Row(
        "log_softmax",
        lambda x: gt.log_softmax(x, axis=0),
        lambda x: x - _logsumexp(x, 0, True),
        [((3, 4),)],
    ),
    Row(
        "mean_squared_error",
        lambda x, y: gt.mean_squared_error(x, y),
        lambda x, y: np.mean((x - y) ** 2),
        [((3, 4), (3, 4))],
    ),
    Row(
        "huber",
        lambda x, y: gt.huber(x, y, delta=0.8),
        lambda x, y: np.mean(
            np.where(np.abs(x - y) <= 0.8, 0.5 * (x - y) ** 2, 0.8 * np.abs(x - y) - 0.32)
        ),
        [((3, 4), (3, 4))],
        "distinct_by_delta",
    ),
    Row(
        "softmax_cross_entropy_int",
        lambda x: gt.softmax_cross_entropy(x, gt.constant([1, 0, 3], device=x.device)),
        lambda x: -np.mean((x - _logsumexp(x, -1, True))[np.arange(3), [1, 0, 3]]),
        [((3, 4),)],
    ),
    Row(
        "softmax_cross_entropy_onehot",
        lambda x, y: gt.softmax_cross_entropy(x, gt.softmax(y)),
        lambda x, y: (
            -np.mean(
                np.sum(np.exp(y - _logsumexp(y, -1, True)) * (x - _logsumexp(x, -1, True)), -1)
            )
        ),
        [((3, 4), (3, 4))],
    ),
    Row(
        "sigmoid_cross_entropy",
        lambda x, y: gt.sigmoid_cross_entropy(x, gt.sigmoid(y)),
        lambda x, y: np.mean(
            -_sigmoid(y) * np.log(_sigmoid(x)) - (1 - _sigmoid(y)) * np.log(1 - _sigmoid(x))
        ),
        [((3, 4), (3, 4))],
    ),
    Row(
        "batch_norm",
        lambda x, g, b: gt.batch_norm(x, g, b),
        lambda x, g, b: (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5) * g + b,
        [((5, 4), (4,), (4,))],
    ),
    Row(
        "layer_norm",
        lambda x: gt.layer_norm(x),
        lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
        [((3, 4),)],
    ),
    Row(
        "clip_by_norm",
        lambda x: gt.clip_by_norm(x, 0.5),
        lambda x: x * 0.5 / max(np.linalg.norm(x), 0.5),
        [((3, 4),)],
    ),
    Row(
        "clip_by_global_norm",
        lambda x, y: gt.concatenate(
            [gt.reshape(t, (-1,)) for t in gt.clip_by_global_norm([x, y], 1.5)[0]]
            + [gt.reshape(gt.clip_by_global_norm([x, y], 1.5)[1], (1,))]
        ),
        lambda x, y: np.concatenate(
            [t.ravel() * 1.5 / max(np.sqrt(np.sum(x**2) + np.sum(y**2)), 1.5) for t in (x, y)]
            + [[np.sqrt(np.sum(x**2) + np.sum(y**2))]]
        ),
        [((3, 4), (2,))],
    ),
    # ---- convolution and pooling (references: loops in tests/engine/naive_conv.py) ----
    Row(
        "conv",
        lambda x, w, b: gt.conv(x, w, b, strides=2, pads=[1, 2], groups=2),
        lambda x, w, b: naive_conv.conv(x, w, b, (2,), ((1, 2),), None, 2),
        [((2, 4, 7), (6, 2, 3), (6,))],
    ),
    Row(
        "conv_2d",
        lambda x, w: gt.conv(x, w, strides=(1, 2), pads=((1, 0), (2, 1)), dilations=(2, 1)),
        lambda x, w: naive_conv.conv(x, w, None, (1, 2), ((1, 0), (2, 1)), (2, 1)),
        [((2, 2, 6, 5), (3, 2, 3, 2))],
    ),
    Row(
        "conv_3d",
        lambda x, w: gt.conv(x, w, pads=[0, 1, 1, 1, 0, 1], dilations=(1, 1, 2), groups=2),
        lambda x, w: naive_conv.conv(x, w, None, None, ((0, 1), (1, 0), (1, 1)), (1, 1, 2), 2),
        [((1, 2, 3, 4, 5), (2, 1, 2, 2, 2))],
    ),
    Row(
        "conv_auto_pad",
        lambda x, w: (
            gt.conv(x, w, strides=2, pads="SAME_LOWER")
            + gt.conv(x, w, strides=2, pads="SAME_UPPER")
        ),
        lambda x, w: (
            naive_conv.conv(x, w, None, (2,), ((2, 1),))
            + naive_conv.conv(x, w, None, (2,), ((1, 2),))
        ),
        [((2, 2, 7), (3, 2, 4))],
    ),
    Row(
        "max_pool",
        lambda x: gt.max_pool(x, (2, 3), strides=(2, 1), pads=((1, 0), (1, 1))),
        lambda x: naive_conv.pool(x, "max", (2, 3), (2, 1), ((1, 0), (1, 1))),
        [((2, 2, 5, 4),), ((3, 5),)],
        "distinct",
    ),
    Row(
        "max_pool_dilated_ceil",
        lambda x: gt.max_pool(x, (2,), strides=2, dilations=2, ceil_mode=True),
        lambda x: naive_conv.pool(x, "max", (2,), (2,), None, (2,), ceil_mode=True),
        [((2, 3, 8),)],
        "distinct",
    ),
    Row(
        "avg_pool",
        lambda x: gt.avg_pool(x, (3, 2), strides=2, pads=1),
        lambda x: naive_conv.pool(x, "avg", (3, 2), (2, 2), ((1, 1), (1, 1))),
        [((2, 2, 5, 4),)],
    ),
    # PyTorch's spellings (defaults: stride = kernel for pools, count_include_pad=True)
    Row(
        "conv1d",
        lambda x, w: gt.conv1d(x, w, stride=2, padding=1, dilation=2),
        lambda x, w: naive_conv.conv(x, w, None, (2,), ((1, 1),), (2,)),
        [((2, 3, 9), (2, 3, 3))],
    ),
    Row(
        "conv2d",
        lambda x, w, b: gt.conv2d(x, w, b, padding=(1, 0), groups=3),
        lambda x, w, b: naive_conv.conv(x, w, b, None, ((1, 1), (0, 0)), None, 3),
        [((2, 3, 4, 5), (6, 1, 3, 2), (6,))],
    ),
    Row(
        "max_pool2d",
        lambda x: gt.max_pool2d(x, 2, padding=1),
        lambda x: naive_conv.pool(x, "max", (2, 2), (2, 2), ((1, 1), (1, 1))),
        [((2, 2, 5, 4),), ((3, 4, 4),)],
        "distinct",
    ),
    Row(
        "avg_pool2d",
        lambda x: gt.avg_pool2d(x, (3, 2), stride=1, padding=1),
        lambda x: naive_conv.pool(
            x, "avg", (3, 2), (1, 1), ((1, 1), (1, 1)), count_include_pad=True
        ),
        [((2, 2, 5, 4),)],
    ),
    Row(
        "embedding",
        lambda t: gt.embedding(t, gt.constant(np.array([[0, 4, 4], [2, 1, 0]], np.int32))),
        lambda t: t[np.array([[0, 4, 4], [2, 1, 0]])],
        [((5, 3),), ((5,),)],
    ),
    Row(
        "scaled_dot_product_attention",
        lambda q, k, v: gt.scaled_dot_product_attention(q, k, v),
        naive_conv.attention,
        [((2, 3, 4), (2, 5, 4), (2, 5, 6)), ((3, 2), (4, 2), (1, 4, 3))],
    ),
    Row(
        "scaled_dot_product_attention_causal",
        lambda q, k, v: gt.scaled_dot_product_attention(q, k, v, causal=True),
        lambda q, k, v: naive_conv.attention(q, k, v, causal=True),
        [((2, 2, 4, 3), (2, 1, 4, 3), (2, 2, 4, 5)), ((5, 2), (3, 2), (3, 2))],
    ),
    Row(
        "avg_pool_include_pad_ceil",
        lambda x: gt.avg_pool(x, (3, 3), strides=2, pads=1, count_include_pad=True, ceil_mode=True),
        lambda x: naive_conv.pool(
            x, "avg", (3, 3), (2, 2), ((1, 1), (1, 1)), ceil_mode=True, count_include_pad=True
        ),
        [((1, 2, 6, 5),)],
    ),
]


def _sample(rng: np.random.Generator, shape: tuple, domain: str, index: int) -> np.ndarray:
    if domain == "positive":
        return rng.uniform(0.5, 2.0, shape)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, shape)
    if domain == "away_from_zero":
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.2, 2.0, shape)
    if domain == "away_from_clip":
        x = rng.uniform(-1.5, 1.5, shape)
        return np.where(
            np.abs(x + 0.5) < 0.05, x + 0.2, np.where(np.abs(x - 0.7) < 0.05, x + 0.2, x)
        )
    if domain in ("distinct", "distinct_by_delta"):
        # Well-separated values, so no tie or kink sits within the finite-difference step.
        size = int(np.prod(shape, dtype=int))
        values = rng.permutation(size).astype(np.float64) * 0.37 + 0.11 * index
        if domain == "distinct_by_delta":
            values = values * (1 + index)
        return values.reshape(shape)
    return rng.standard_normal(shape)


def _cases() -> list:
    cases = []
    for row in ROWS:
        for shapes in row.shapes:
            cases.append(pytest.param(row, shapes, id=f"{row.name}-{'x'.join(map(str, shapes))}"))
    return cases


def calls_the_op(row: Row) -> bool:
    """The row calls a public op directly (its shape rule can be checked on the row)."""
    info = gt.public_ops.get(row.name)
    return info is not None and row.fn is info.fn


RULE_ROWS = {row.name for row in ROWS if calls_the_op(row)}


def _args(row: Row, shapes: tuple, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_sample(rng, s, row.domain, i) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("row, shapes", _cases())
def test_forward_matches_numpy(row: Row, shapes: tuple) -> None:
    args = _args(row, shapes)
    out = row.fn(*[gt.constant(a) for a in args])
    np.testing.assert_allclose(out.numpy(), row.ref(*args), rtol=1e-10, atol=1e-12)
    assert out.dtype == np.float64, "float64 in, float64 out"


@pytest.mark.parametrize("row, shapes", [c for c in _cases() if calls_the_op(c.values[0])])
def test_shape_rule_matches_the_forward(row: Row, shapes: tuple) -> None:
    """The shape rule registered beside the op infers what the forward computes."""
    args = [np.asarray(a, dtype=np.float64) for a in _args(row, shapes)]
    names = [f"x{i}" for i in range(len(args))]
    defn = {"inputs": dict(zip(names, args)), "program": [f"y = {row.name}({', '.join(names)})"]}
    inferred = compile_definition(defn).types["y"]
    out = row.fn(*[gt.constant(a) for a in args])
    assert (inferred.shape, inferred.dtype) == (out.shape, out.dtype)


@pytest.mark.parametrize("row, shapes", _cases())
def test_gradients_match_finite_differences(row: Row, shapes: tuple) -> None:
    check_grads(
        row.fn, _args(row, shapes), order=row.order, modes=row.modes, atol=row.tol, rtol=row.tol
    )


@pytest.mark.parametrize("row, shapes", _cases())
def test_batched_cotangents_match_per_row_loop(row: Row, shapes: tuple) -> None:
    """VJP rules accept cotangents with a leading batch axis: one pass == K passes."""
    args = [gt.constant(a) for a in _args(row, shapes)]
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(args)
        out = row.fn(*args)
    cotangents = np.random.default_rng(1).standard_normal((3,) + out.shape)
    batched = tape._run([out], [gt.constant(cotangents)], args, batch_ndim=1)
    for k in range(3):
        single = tape.gradient(out, args, output_gradients=gt.constant(cotangents[k]))
        for a, g in zip(args, single):
            if g is None:
                assert id(a) not in batched
                continue
            np.testing.assert_allclose(batched[id(a)].numpy()[k], g.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("row, shapes", _cases())
def test_batched_tangents_match_per_row_loop(row: Row, shapes: tuple) -> None:
    """JVP rules accept tangents with a leading batch axis as well."""
    args = [gt.constant(a) for a in _args(row, shapes)]
    rng = np.random.default_rng(2)
    tangents = [rng.standard_normal((3,) + a.shape) for a in args]
    with gt.ForwardAccumulator(args, [gt.constant(t) for t in tangents], batch_ndim=1) as acc:
        out = row.fn(*args)
    batched = acc.jvp(out, unconnected_gradients="zero").numpy()
    assert batched.shape == (3,) + out.shape
    for k in range(3):
        _, single = gt.jvp(row.fn, args, [gt.constant(t[k]) for t in tangents])
        np.testing.assert_allclose(batched[k], single.numpy(), rtol=1e-10, atol=1e-12)


def test_float32_stays_float32() -> None:
    for row in ROWS:
        shapes = row.shapes[0]
        args = [gt.constant(a.astype(np.float32)) for a in _args(row, shapes)]
        if row.name == "solve":
            continue  # the row adds a float64 identity on purpose
        if row.name.startswith(("prod_zero", "xlogy_zero", "divide_no_nan_zero")):
            continue  # the row multiplies by a float64 constant on purpose
        with gt.GradientTape() as tape:
            tape.watch(args)
            out = gt.sum(row.fn(*args))
        assert out.dtype == np.float32, row.name
        for g in tape.gradient(out, args):
            assert g is None or g.dtype == np.float32, row.name


def test_every_public_differentiable_op_has_a_row() -> None:
    """Adding an op means adding a row: the table covers the catalogue."""
    covered = {row.name.split("_")[0] for row in ROWS} | {row.name for row in ROWS}
    exempt = {
        # no derivative: comparisons, logic, integer results
        "sign",
        "greater",
        "greater_equal",
        "less",
        "less_equal",
        "equal",
        "not_equal",
        "logical_and",
        "logical_or",
        "logical_not",
        "isfinite",
        "argmax",
        "argmin",
        "any",
        "all",
        "cast",
        "stop_gradient",
        "getitem",
        # covered under another row name
        "swapaxes",
        "moveaxis",
        "flatten",
        "sigmoid_cross_entropy",
        "softmax_cross_entropy",
        "mean_squared_error",
        "log_softmax",
        "log_sigmoid",
        "leaky_relu",
        "expand_dims",
        "broadcast_to",
        "batch_norm",
        "layer_norm",
        "clip_by_norm",
    }
    missing = set(gt.public_ops) - covered - exempt
    assert not missing, f"ops without a row in the table: {sorted(missing)}"


def test_swapaxes_moveaxis_flatten_and_cast() -> None:
    x = gt.constant(np.arange(24.0).reshape(2, 3, 4))
    np.testing.assert_array_equal(gt.swapaxes(x, 0, 2).numpy(), np.swapaxes(x.numpy(), 0, 2))
    np.testing.assert_array_equal(gt.moveaxis(x, 0, -1).numpy(), np.moveaxis(x.numpy(), 0, -1))
    np.testing.assert_array_equal(gt.flatten(x).numpy(), x.numpy().ravel())
    check_grads(
        lambda t: gt.moveaxis(t, 0, -1) * gt.swapaxes(gt.swapaxes(t, 0, 2), 0, 1),
        [x.numpy()],
        order=2,
    )
    y = gt.constant([1.5, 2.5], dtype="float64")
    with gt.GradientTape() as tape:
        tape.watch(y)
        z = gt.sum(gt.cast(y, "float32") ** 2)
    assert z.dtype == np.float32
    g = tape.gradient(z, y)
    assert g.dtype == np.float64
    np.testing.assert_allclose(g.numpy(), [3.0, 5.0])


def test_scatter_add_of_rows_matches_numpys_add_at() -> None:
    """backend.scatter_add's sorted-groups path (one integer array, other axes whole: an
    embedding's gradient) gives np.add.at's sums; other indices go to np.add.at."""
    from engine import backend

    rng = np.random.default_rng(0)
    table = (7, 5, 3)
    cases = [
        (Ellipsis, rng.integers(0, 7, (4, 6)), slice(None), slice(None)),  # rows, repeated
        (Ellipsis, rng.integers(-7, 7, (9,)), slice(None), slice(None)),  # negative ones
        (Ellipsis, slice(None), rng.integers(0, 5, (2, 3)), slice(None)),  # a middle axis
        (Ellipsis, slice(None), slice(None), np.array([2, 0, 2, 2])),  # the last axis
        (Ellipsis, np.array(3), slice(None), slice(None)),  # a 0-d index
        (Ellipsis, np.array([1, 1]), slice(None), slice(0, 3, 2)),  # a strided slice: add.at
        (Ellipsis, np.array([1, 2]), np.array([0, 4]), slice(None)),  # two arrays: add.at
    ]
    for lead in [(), (2,)]:  # batched cotangents carry leading axes
        for index in cases:
            probe = np.zeros(lead + table)[index]
            values = rng.standard_normal(probe.shape)
            expected = np.zeros(lead + table)
            np.add.at(expected, index, values)
            got = np.zeros(lead + table)
            backend.scatter_add(np, got, index, values)
            np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-14)
    with pytest.raises(IndexError):  # out of range: np.add.at's error
        backend.scatter_add(
            np,
            np.zeros(table),
            (Ellipsis, np.array([7]), slice(None), slice(None)),
            np.ones((1, 5, 3)),
        )
