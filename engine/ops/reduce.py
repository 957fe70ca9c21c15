"""Reductions: sum, max, min, prod (primitives); mean, logsumexp, var, std, norm.

Axes are normalized to negative ints by the wrappers, so the same `axis` reduces a
tangent with leading batch axes correctly.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

from engine import backend
from engine.backend import host
from engine.ops._util import batch_ndim, keepdims_shape, normalize_axes
from engine.ops.elementwise import (
    abs,
    add,
    cast,
    divide,
    equal,
    exp,
    log,
    logical_not,
    multiply,
    not_equal,
    sqrt,
    subtract,
    where,
)
from engine.ops.shape import broadcast_to, reshape
from engine.registry import defjvp, defnondiff, defvjp, primitive, public
from engine.tensor import Tensor, as_tensor, bind, unaliased

Axis = int | Sequence[int] | None


def _expand_cotangent(g: Tensor, ans: Tensor, x: Tensor, axes: tuple, keepdims: bool) -> Tensor:
    """Bring a reduced cotangent (with its batch axes) back to x's shape."""
    lead = g.shape[: batch_ndim(g, ans)]
    if not keepdims:
        g = reshape(g, lead + keepdims_shape(x.shape, axes))
    return broadcast_to(g, lead + x.shape)


# ---- sum ----
def _sum_impl(xp: Any, x: Any, *, axes: tuple, keepdims: bool) -> Any:
    # Integers keep their dtype (NumPy would widen int32 to int64); bools count as int32.
    dtype = None if x.dtype.kind == "f" else (host.int32 if x.dtype.kind == "b" else x.dtype)
    return xp.sum(x, axis=axes, keepdims=keepdims, dtype=dtype)


sum_p = primitive("sum", _sum_impl)
defvjp(
    sum_p,
    lambda ans, x, *, axes, keepdims: lambda g: _expand_cotangent(g, ans, x, axes, keepdims),
)
defjvp(sum_p, lambda t, ans, x, *, axes, keepdims: bind(sum_p, t[0], axes=axes, keepdims=keepdims))


@public("reduction")
def sum(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over `axis` (all axes when None)."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "sum")
    if not axes and not keepdims:
        return unaliased(x)
    return bind(sum_p, x, axes=axes, keepdims=bool(keepdims))


# ---- max / min ----
# The gradient is shared equally among tied maxima (as JAX and autograd do), so the
# rule stays a valid subgradient whatever the ties.
def _extremum_weights(ans: Tensor, x: Tensor, axes: tuple, keepdims: bool) -> Tensor:
    ans_kd = ans if keepdims else reshape(ans, keepdims_shape(x.shape, axes))
    hits = cast(equal(x, ans_kd), x.dtype)
    return divide(hits, bind(sum_p, hits, axes=axes, keepdims=True))


def extremum_vjp(ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Any:
    weights = _extremum_weights(ans, x, axes, keepdims)
    return lambda g: multiply(_expand_cotangent(g, ans, x, axes, keepdims), weights)


def extremum_jvp(t: list, ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Tensor:
    weighted = multiply(t[0], _extremum_weights(ans, x, axes, keepdims))
    return bind(sum_p, weighted, axes=axes, keepdims=keepdims)


max_p = primitive("max", lambda xp, x, *, axes, keepdims: xp.max(x, axis=axes, keepdims=keepdims))
min_p = primitive("min", lambda xp, x, *, axes, keepdims: xp.min(x, axis=axes, keepdims=keepdims))
for _p in (max_p, min_p):
    defvjp(_p, extremum_vjp)
    defjvp(_p, extremum_jvp)


def _check_nonempty(x: Tensor, axes: tuple, opname: str) -> None:
    if builtins.any(x.shape[a] == 0 for a in axes):
        raise ValueError(f"{opname}: reduction over an empty axis of shape {x.shape}")


@public("reduction")
def max(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Largest element over `axis`; ties share the gradient."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "max")
    _check_nonempty(x, axes, "max")
    return bind(max_p, x, axes=axes, keepdims=bool(keepdims))


@public("reduction")
def min(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Smallest element over `axis`; ties share the gradient."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "min")
    _check_nonempty(x, axes, "min")
    return bind(min_p, x, axes=axes, keepdims=bool(keepdims))


# ---- prod ----
def _product_of_others(ans: Tensor, x: Tensor, axes: tuple, keepdims: bool) -> Tensor:
    """For each element, the product of the other elements in its reduction group.

    ans / x where x is not zero. Where x is zero, the others' product is the product of
    the group's non-zero elements if x is the group's only zero, and 0 otherwise. Both
    pieces are made of recorded ops, so higher derivatives stay right (d(ans / x)
    carries the dependence on a zero elsewhere in the group through ans).
    """
    ans_kd = ans if keepdims else reshape(ans, keepdims_shape(x.shape, axes))
    nonzero = not_equal(x, 0)
    safe_x = where(nonzero, x, 1)
    zeros = bind(sum_p, cast(logical_not(nonzero), x.dtype), axes=axes, keepdims=True)
    prod_nonzero = bind(prod_p, safe_x, axes=axes, keepdims=True)
    lone_zero = multiply(prod_nonzero, cast(equal(zeros, 1), x.dtype))
    return where(nonzero, divide(ans_kd, safe_x), lone_zero)


def prod_vjp(ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Any:
    others = _product_of_others(ans, x, axes, keepdims)
    return lambda g: multiply(_expand_cotangent(g, ans, x, axes, keepdims), others)


def prod_jvp(t: list, ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Tensor:
    weighted = multiply(t[0], _product_of_others(ans, x, axes, keepdims))
    return bind(sum_p, weighted, axes=axes, keepdims=keepdims)


def _prod_impl(xp: Any, x: Any, *, axes: tuple, keepdims: bool) -> Any:
    dtype = None if x.dtype.kind == "f" else (host.int32 if x.dtype.kind == "b" else x.dtype)
    return xp.prod(x, axis=axes, keepdims=keepdims, dtype=dtype)


prod_p = primitive("prod", _prod_impl)
defvjp(prod_p, prod_vjp)
defjvp(prod_p, prod_jvp)


@public("reduction")
def prod(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Product over `axis`; the gradient is exact where elements are zero."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "prod")
    if not axes and not keepdims:
        return unaliased(x)
    return bind(prod_p, x, axes=axes, keepdims=bool(keepdims))


# ---- cumsum ----
# Its transpose is the cumulative sum the other way round, so both rules are cumsums.
def _cumsum_impl(xp: Any, x: Any, *, axis: int, exclusive: bool, reverse: bool) -> Any:
    if reverse:
        x = xp.flip(x, axis)
    out = xp.cumsum(x, axis=axis, dtype=x.dtype)  # NumPy would widen int32
    if exclusive:
        out = xp.roll(out, 1, axis=axis)
        first = [slice(None)] * out.ndim
        first[axis] = 0
        out[tuple(first)] = 0
    return xp.flip(out, axis) if reverse else out


cumsum_p = primitive("cumsum", _cumsum_impl)
defvjp(
    cumsum_p,
    lambda ans, x, *, axis, exclusive, reverse: (
        lambda g: bind(cumsum_p, g, axis=axis, exclusive=exclusive, reverse=not reverse)
    ),
)
defjvp(cumsum_p, lambda t, ans, x, **params: bind(cumsum_p, t[0], **params))


@public("reduction")
def cumsum(x: Any, axis: int = 0, exclusive: bool = False, reverse: bool = False) -> Tensor:
    """Cumulative sum along `axis` (TensorFlow's exclusive and reverse options)."""
    x = as_tensor(x)
    if x.ndim == 0:
        raise ValueError("cumsum: needs a tensor of rank >= 1")
    axis = normalize_axes(axis, x.ndim, "cumsum")[0]
    return bind(cumsum_p, x, axis=axis, exclusive=bool(exclusive), reverse=bool(reverse))


# ---- non-differentiable reductions ----
argmax_p = primitive("argmax", lambda xp, x, *, axis: xp.argmax(x, axis=axis))
argmin_p = primitive("argmin", lambda xp, x, *, axis: xp.argmin(x, axis=axis))
any_p = primitive("any", lambda xp, x, *, axes, keepdims: xp.any(x, axis=axes, keepdims=keepdims))
all_p = primitive("all", lambda xp, x, *, axes, keepdims: xp.all(x, axis=axes, keepdims=keepdims))
for _p in (argmax_p, argmin_p, any_p, all_p):
    defnondiff(_p)


@public("reduction")
def argmax(x: Any, axis: int | None = None) -> Tensor:
    """Index of the largest element (over the flattened tensor when axis is None)."""
    x = as_tensor(x)
    if axis is not None and not isinstance(axis, int):
        raise TypeError(f"argmax: axis must be an int or None, got {axis!r}")
    axis = None if axis is None else normalize_axes(axis, x.ndim, "argmax")[0]
    return bind(argmax_p, x, axis=axis)


@public("reduction")
def argmin(x: Any, axis: int | None = None) -> Tensor:
    """Index of the smallest element (over the flattened tensor when axis is None)."""
    x = as_tensor(x)
    if axis is not None and not isinstance(axis, int):
        raise TypeError(f"argmin: axis must be an int or None, got {axis!r}")
    axis = None if axis is None else normalize_axes(axis, x.ndim, "argmin")[0]
    return bind(argmin_p, x, axis=axis)


@public("reduction")
def any(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """True where any element over `axis` is true."""
    x = as_tensor(x)
    return bind(any_p, x, axes=normalize_axes(axis, x.ndim, "any"), keepdims=bool(keepdims))


@public("reduction")
def all(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """True where every element over `axis` is true."""
    x = as_tensor(x)
    return bind(all_p, x, axes=normalize_axes(axis, x.ndim, "all"), keepdims=bool(keepdims))


# ---- composites ----
def _count(x: Tensor, axes: tuple) -> int:
    return math.prod(x.shape[a] for a in axes)


@public("reduction")
def mean(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over `axis`."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "mean")
    _check_nonempty(x, axes, "mean")
    return divide(sum(x, axes, keepdims), as_tensor(float(_count(x, axes)), like=x))


@public("reduction")
def var(x: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Variance over `axis` (divisor n - ddof)."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "var")
    n = _count(x, axes)
    if n - ddof <= 0:
        raise ValueError(f"var: {n} elements with ddof={ddof} leave no degrees of freedom")
    centered = subtract(x, mean(x, axes, keepdims=True))
    return divide(sum(multiply(centered, centered), axes, keepdims), float(n - ddof))


@public("reduction")
def std(x: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Standard deviation over `axis`."""
    return sqrt(var(x, axis, keepdims, ddof))


@public("reduction")
def logsumexp(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """log(sum(exp(x))) over `axis`, without overflow."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "logsumexp")
    _check_nonempty(x, axes, "logsumexp")
    # The shift is a constant: its derivative cancels exactly, so it is computed on the
    # raw array, outside every tape and accumulator.
    xp = backend.array_module(x.value)
    shift = xp.max(x.value, axis=axes, keepdims=True)
    shift = Tensor(xp.where(xp.isfinite(shift), shift, 0).astype(x.dtype, copy=False))
    out = add(log(sum(exp(subtract(x, shift)), axes, keepdims=True)), shift)
    return (
        out
        if keepdims
        else reshape(out, tuple(d for i, d in enumerate(out.shape) if i - out.ndim not in axes))
    )


@public("reduction")
def norm(x: Any, ord: Any = None, axis: Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A002
    """Vector norm over `axis`: ord None or 2 (Euclidean), 1, or inf.

    The Euclidean norm has no derivative at 0 (it gives NaN there, as in TensorFlow).
    """
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "norm")
    if ord in (None, 2, "euclidean", "fro"):
        return sqrt(sum(multiply(x, x), axes, keepdims))
    if ord == 1:
        return sum(abs(x), axes, keepdims)
    if ord in (host.inf, "inf"):
        return max(abs(x), axes, keepdims)
    raise ValueError(f"norm: unsupported ord {ord!r}; use None/2, 1 or inf")
