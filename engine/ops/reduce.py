"""Reductions: sum, max, min, prod (primitives); mean, logsumexp, var, std, norm.

Axes are normalized to negative ints by the wrappers, so the same `axis` reduces a
tangent with leading batch axes correctly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from engine.backend import host
from engine.ops._util import batch_ndim, normalize_axes
from engine.ops.elementwise import (
    abs,
    add,
    cast,
    divide,
    equal,
    exp,
    isfinite,
    log,
    logical_not,
    multiply,
    not_equal,
    sqrt,
    stop,
    subtract,
    where,
)
from engine.ops.shape import broadcast_to_p, reshape
from engine.registry import defjvp, defnondiff, defvjp, primitive, public
from engine.shapes import (
    BOOL,
    INDEX,
    INT32,
    RuleError,
    TensorType,
    axis_index,
    check_nonempty,
    checked,
    concrete,
    reduced_shape,
    require,
)
from engine.shapes import normalize_axes as axes_of  # the rules' (RuleError, no op name)
from engine.tensor import Tensor, as_tensor, bind, unaliased

Axis = int | Sequence[int] | None
REDUCE = {"axis": "axes", "keepdims": "bool"}  # the constants of every sum-like op


def reduction(
    category: str,
    *,
    empty_ok: bool = True,
    result: Any = None,
    identity: bool = False,
) -> Any:
    """The shape rule of a sum-like op: `axis` (None, int or tuple) and `keepdims`.

    empty_ok: False for reductions without an identity (max, mean). result: the output
    dtype from the input's. identity: no axes and no keepdims give x itself (sum, prod).
    """

    def rule(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, category)
        axes = axes_of(b.get("axis"), x.ndim)
        keepdims = b.get("keepdims", False)
        if not empty_ok:
            check_nonempty(x.shape, axes)
        if identity and not axes and not keepdims:
            return x
        dtype = result(x.dtype) if result else x.dtype
        return TensorType(reduced_shape(x.shape, axes, keepdims), dtype)

    return rule


def _sum_dtype(dtype: Any) -> Any:
    """Sums keep integer dtypes and count bools in int32 (NumPy would widen to int64)."""
    return INT32 if dtype.kind == "b" else dtype


def _keepdims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return reduced_shape(shape, axes, keepdims=True)


def _expand_cotangent(g: Tensor, ans: Tensor, x: Tensor, axes: tuple, keepdims: bool) -> Tensor:
    """Bring a reduced cotangent (with its batch axes) back to x's shape."""
    lead = g.shape[: batch_ndim(g, ans)]
    if not keepdims and (lead or axes != tuple(range(-x.ndim, len(axes) - x.ndim))):
        # (With no batch axes and the leading axes reduced, g already broadcasts to x.)
        g = reshape(g, lead + _keepdims_shape(x.shape, axes))
    target = lead + x.shape
    # (broadcast_to's check is for callers' shapes: this one fits by construction)
    return unaliased(g) if g.shape == target else bind(broadcast_to_p, g, shape=target)


# ---- sum ----
# (typed loosely: NumPy's overloads want keepdims as a literal True or False)
_host_add_reduce: Callable[..., Any] = host.add.reduce


# Sums over a short last axis (LayerNorm's and softmax's statistics: rows of 16-256) are
# a matrix-vector product with ones: np.add.reduce runs its inner loop once per row
# (0.104 ms for 4,096 rows of 16 float32, 0.037 ms for 1,024 rows of 64, against 0.011
# and 0.007 ms for the GEMV). Only C-contiguous float32/float64 arrays; rows longer
# than ROW_SUM_MAX keep NumPy's pairwise summation (its error grows as log n, a GEMV's
# as n). The compiled replay's sum (engine/replay.py) takes the same decision.
ROW_SUM_MAX = 256
_row_ones: dict[tuple[int, Any], Any] = {}


def sums_rows(shape: tuple[int, ...], c_contiguous: bool, dtype: Any, axes: tuple) -> bool:
    """Whether a host sum over `axes` is computed by row_sum."""
    return (
        c_contiguous
        and len(shape) >= 2
        and (axes == (-1,) or axes == (len(shape) - 1,))
        and 1 < shape[-1] <= ROW_SUM_MAX
        and 0 not in shape
        and (dtype == host.float32 or dtype == host.float64)
    )


def row_sum(x: Any, keepdims: bool, out: Any = None) -> Any:
    """x summed over its last axis as (rows, k) @ ones(k) (see sums_rows); into `out`
    (C-contiguous, the result's shape) when given."""
    k = x.shape[-1]
    ones = _row_ones.get((k, x.dtype))
    if ones is None:
        ones = _row_ones[(k, x.dtype)] = host.ones(k, x.dtype)
    rows = x.reshape(-1, k)
    if out is not None:
        host.matmul(rows, ones, out=out.reshape(-1))
        return out
    return (rows @ ones).reshape(x.shape[:-1] + (1,) if keepdims else x.shape[:-1])


# Sums over the leading axes of a C-contiguous float array (a bias's gradient: (batch,
# tokens, features) -> (features,)) are ones(rows) @ x(rows, cols), a GEMV, where
# np.add.reduce adds the rows one by one (0.024 against 0.004 ms for (64, 16, 64)
# float32, 0.039 against 0.011 for (64, 16, 192)); both add each column's elements in
# sequence (NumPy's pairwise summation is along a contiguous axis only), so the error
# is of the same order. From LEADING_SUM_MIN_ROWS rows: below it the GEMV's call costs
# more than the rows' adds ((32, 32) float32: 2.3 against 1.9 us alone, and ~5 us a sum
# in bench_small_step's step, whose three bias sums it made 7% slower); up to
# LEADING_SUM_MAX_ROWS (one vector of ones per dtype, 256 or 512 KiB). The compiled
# replay's sum takes the same decision.
LEADING_SUM_MIN_ROWS = 64
LEADING_SUM_MAX_ROWS = 1 << 16
_leading_ones: dict[Any, Any] = {}


def sums_leading(shape: tuple[int, ...], c_contiguous: bool, dtype: Any, axes: tuple) -> bool:
    """Whether a host sum over `axes` is computed by leading_sum."""
    n = len(axes)
    return (
        c_contiguous
        and 0 < n < len(shape)
        and LEADING_SUM_MIN_ROWS <= math.prod(shape[:n]) <= LEADING_SUM_MAX_ROWS
        and tuple(a % len(shape) for a in axes) == tuple(range(n))
        and 0 not in shape
        and (dtype == host.float32 or dtype == host.float64)
    )


def leading_sum(x: Any, n_axes: int, keepdims: bool, out: Any = None) -> Any:
    """x summed over its first n_axes axes as ones(rows) @ (rows, cols) (see
    sums_leading); into `out` (C-contiguous, the result's shape) when given."""
    rest = x.shape[n_axes:]
    rows = x.size // math.prod(rest)
    ones = _leading_ones.get(x.dtype)
    if ones is None:  # one vector per dtype, sliced: not one per batch size
        ones = _leading_ones[x.dtype] = host.ones(LEADING_SUM_MAX_ROWS, x.dtype)
    ones = ones[:rows]
    matrix = x.reshape(rows, -1)
    if out is not None:
        host.matmul(ones, matrix, out=out.reshape(-1))
        return out
    return (ones @ matrix).reshape((1,) * n_axes + rest if keepdims else rest)


# A convolution's result and the cotangents of its input (engine/ops/conv.py) are (*lead,
# N, C, *spatial) over memory ordered (*lead, C, N, *spatial). Summed over N and the
# spatial axes (BatchNorm's parameter gradients), np.add.reduce would run one pairwise sum
# over each channel's N * P contiguous cells, where an array of the same values in
# C-contiguous memory is summed plane by plane (each plane's P cells pairwise, the planes
# added in order of N). channel_sum does the latter on the swapped layout: a sum does not
# depend on which of the two layouts an op gave its operand (the same bits either way).
def channel_axes(
    shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, axes: tuple
) -> tuple[int, tuple[int, ...]] | None:
    """(the N axis, the spatial axes) when a host sum over `axes` is computed by
    channel_sum: float32/float64 of that swapped layout (axes of size 1 aside, which
    neither order sees), summed over N and the axes after C (none when they are all of
    size 1); None otherwise."""
    nd = len(shape)
    if 0 in shape or not (dtype == host.float32 or dtype == host.float64):
        return None
    summed = {a % nd for a in axes}
    big = [a for a in range(nd) if shape[a] > 1]
    kept = [a for a in big if a not in summed]
    if not kept:
        return None
    c, lead = kept[-1], kept[:-1]
    before = [a for a in big if a in summed and a < c]
    after = tuple(a for a in big if a > c)
    # Spatial axes all of size 1 (a 1 x 1 map, a 1-d length of 1) leave no cell after C,
    # yet NumPy would still add each channel's N contiguous cells pairwise where the C
    # order adds them in sequence; without any axis after C (a matrix in F order) it is
    # not a convolution's layout.
    if len(before) != 1 or c == nd - 1 or not summed.issuperset(after):
        return None
    n = before[0]
    if lead and lead[-1] > n:
        return None
    step = host.dtype(dtype).itemsize
    for axis in (*after[::-1], n, c, *lead[::-1]):  # innermost first
        if strides[axis] != step:
            return None
        step *= shape[axis]
    return n, after


def channel_sum(
    x: Any, n: int, spatial: tuple, axes: tuple, keepdims: bool, out: Any = None
) -> Any:
    """x summed over `axes` as NumPy sums a C-contiguous array of its values (see
    channel_axes: n and spatial are its answer); into `out` (the result's shape) when
    given."""
    if not spatial:  # no cells to sum per plane: the values in C order, summed as
        # _sum_impl sums them there (over N alone: leading_sum's GEMV)
        planes = host.ascontiguousarray(x)
        if sums_leading(planes.shape, True, planes.dtype, axes):
            return leading_sum(planes, len(axes), keepdims, out)
    else:
        planes = host.ascontiguousarray(_host_add_reduce(x, axis=spatial, keepdims=True))
    # the planes' sums in order of N (the spatial axes, of size 1 now, go with them)
    return _host_add_reduce(planes, axis=axes, out=out, keepdims=keepdims)


def _sum_impl(xp: Any, x: Any, *, axes: tuple, keepdims: bool) -> Any:
    # Integers keep their dtype (NumPy would widen int32 to int64); bools count as int32.
    dtype = None if x.dtype.kind == "f" else (host.int32 if x.dtype.kind == "b" else x.dtype)
    if xp is host:  # the ufunc's own reduce: np.sum's Python wrappers cost more than a small sum
        if x.flags.c_contiguous:  # (never a convolution's swapped layout: no channel_axes,
            # whose Python took ~5 us of each small bias sum)
            if sums_rows(x.shape, True, x.dtype, axes):
                return row_sum(x, keepdims)
            if sums_leading(x.shape, True, x.dtype, axes):
                return leading_sum(x, len(axes), keepdims)
        else:
            found = channel_axes(x.shape, x.strides, x.dtype, axes)
            if found is not None:
                return channel_sum(x, *found, axes, keepdims)
        return _host_add_reduce(x, axis=axes, dtype=dtype, keepdims=keepdims)
    return xp.sum(x, axis=axes, keepdims=keepdims, dtype=dtype)


sum_p = primitive("sum", _sum_impl, flow="reduces")
defvjp(
    sum_p,
    lambda ans, x, *, axes, keepdims: lambda g: _expand_cotangent(g, ans, x, axes, keepdims),
)
defjvp(sum_p, lambda t, ans, x, *, axes, keepdims: bind(sum_p, t[0], axes=axes, keepdims=keepdims))


@public(
    "reduction", shape_rule=reduction("numeric", result=_sum_dtype, identity=True), kinds=REDUCE
)
def sum(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
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
    ans_kd = ans if keepdims else reshape(ans, _keepdims_shape(x.shape, axes))
    hits = cast(equal(x, ans_kd), x.dtype)
    return divide(hits, bind(sum_p, hits, axes=axes, keepdims=True))


def extremum_vjp(ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Any:
    weights = _extremum_weights(ans, x, axes, keepdims)
    return lambda g: multiply(_expand_cotangent(g, ans, x, axes, keepdims), weights)


def extremum_jvp(t: list, ans: Tensor, x: Tensor, *, axes: tuple, keepdims: bool) -> Tensor:
    weighted = multiply(t[0], _extremum_weights(ans, x, axes, keepdims))
    return bind(sum_p, weighted, axes=axes, keepdims=keepdims)


max_p = primitive(
    "max", lambda xp, x, *, axes, keepdims: xp.max(x, axis=axes, keepdims=keepdims), flow="reduces"
)
min_p = primitive(
    "min", lambda xp, x, *, axes, keepdims: xp.min(x, axis=axes, keepdims=keepdims), flow="reduces"
)
for _p in (max_p, min_p):
    defvjp(_p, extremum_vjp)
    defjvp(_p, extremum_jvp)


def _check_nonempty(x: Tensor, axes: tuple, opname: str) -> None:
    checked(opname, check_nonempty, x.shape, axes)


@public("reduction", shape_rule=reduction("numeric", empty_ok=False), kinds=REDUCE)
def max(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Largest element over `axis`; ties share the gradient."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "max")
    _check_nonempty(x, axes, "max")
    return bind(max_p, x, axes=axes, keepdims=bool(keepdims))


@public("reduction", shape_rule=reduction("numeric", empty_ok=False), kinds=REDUCE)
def min(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
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
    ans_kd = ans if keepdims else reshape(ans, _keepdims_shape(x.shape, axes))
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


prod_p = primitive("prod", _prod_impl, flow="reduces")
defvjp(prod_p, prod_vjp)
defjvp(prod_p, prod_jvp)


def prod_workspace(b: dict[str, Any], out: TensorType) -> int:
    """prod's gradient lays each reduction group of n elements out as an (n, n) matrix."""
    x = concrete(b["x"])
    axes = axes_of(b.get("axis"), x.ndim)
    return x.size * math.prod(x.shape[a] for a in axes)


@public(
    "reduction",
    shape_rule=reduction("numeric", result=_sum_dtype, identity=True),
    kinds=REDUCE,
    workspace=prod_workspace,
)
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
        first: list[Any] = [slice(None)] * out.ndim
        first[axis] = 0
        out[tuple(first)] = 0
    return xp.flip(out, axis) if reverse else out


cumsum_p = primitive("cumsum", _cumsum_impl, flow="scans")
defvjp(
    cumsum_p,
    lambda ans, x, *, axis, exclusive, reverse: (
        lambda g: bind(cumsum_p, g, axis=axis, exclusive=exclusive, reverse=not reverse)
    ),
)
defjvp(cumsum_p, lambda t, ans, x, **params: bind(cumsum_p, t[0], **params))


def cumsum_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if x.ndim == 0:
        raise RuleError("cumsum needs a tensor of rank >= 1", "op")
    axes_of(b.get("axis", 0), x.ndim)
    return x


@public(
    "reduction",
    shape_rule=cumsum_rule,
    kinds={"axis": "axis", "exclusive": "bool", "reverse": "bool"},
)
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


def arg_extremum_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if b.get("axis") is None:
        if x.size == 0:
            raise RuleError(f"no elements to choose from in shape {x.shape}")
        return TensorType((), INDEX)
    axis = axis_index(b["axis"], x.ndim)
    if x.shape[axis] == 0:
        raise RuleError(f"axis {axis} of shape {x.shape} is empty")
    return TensorType(x.shape[:axis] + x.shape[axis + 1 :], INDEX)


@public("reduction", shape_rule=arg_extremum_rule, kinds={"axis": "axis?"})
def argmax(x: Any, axis: int | None = None) -> Tensor:
    """Index of the largest element (over the flattened tensor when axis is None)."""
    x = as_tensor(x)
    if axis is not None and not isinstance(axis, int):
        raise TypeError(f"argmax: axis must be an int or None, got {axis!r}")
    axis = None if axis is None else normalize_axes(axis, x.ndim, "argmax")[0]
    return bind(argmax_p, x, axis=axis)


@public("reduction", shape_rule=arg_extremum_rule, kinds={"axis": "axis?"})
def argmin(x: Any, axis: int | None = None) -> Tensor:
    """Index of the smallest element (over the flattened tensor when axis is None)."""
    x = as_tensor(x)
    if axis is not None and not isinstance(axis, int):
        raise TypeError(f"argmin: axis must be an int or None, got {axis!r}")
    axis = None if axis is None else normalize_axes(axis, x.ndim, "argmin")[0]
    return bind(argmin_p, x, axis=axis)


@public("reduction", shape_rule=reduction("any", result=lambda d: BOOL), kinds=REDUCE)
def any(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """True where any element over `axis` is true."""
    x = as_tensor(x)
    return bind(any_p, x, axes=normalize_axes(axis, x.ndim, "any"), keepdims=bool(keepdims))


@public("reduction", shape_rule=reduction("any", result=lambda d: BOOL), kinds=REDUCE)
def all(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """True where every element over `axis` is true."""
    x = as_tensor(x)
    return bind(all_p, x, axes=normalize_axes(axis, x.ndim, "all"), keepdims=bool(keepdims))


# ---- composites ----
def _count(x: Tensor, axes: tuple) -> int:
    return math.prod(x.shape[a] for a in axes)


@public("reduction", shape_rule=reduction("float", empty_ok=False), kinds=REDUCE)
def mean(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over `axis`."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "mean")
    _check_nonempty(x, axes, "mean")
    return divide(sum(x, axes, keepdims), as_tensor(float(_count(x, axes)), like=x))


def check_degrees_of_freedom(n: int, ddof: int) -> None:
    if n - ddof <= 0:
        raise RuleError(f"{n} elements with ddof={ddof} leave no degrees of freedom")


def statistics_rule(b: dict[str, Any]) -> TensorType:
    """var and std: divisor n - ddof must stay positive."""
    x = concrete(b["x"])
    require(x, "float")
    axes = axes_of(b.get("axis"), x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    check_nonempty(x.shape, axes)
    check_degrees_of_freedom(n, b.get("ddof", 0))
    return TensorType(reduced_shape(x.shape, axes, b.get("keepdims", False)), x.dtype)


@public("reduction", shape_rule=statistics_rule, kinds={**REDUCE, "ddof": "int"})
def var(x: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Variance over `axis` (divisor n - ddof)."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "var")
    n = _count(x, axes)
    checked("var", check_degrees_of_freedom, n, ddof)
    centered = subtract(x, mean(x, axes, keepdims=True))
    return divide(sum(multiply(centered, centered), axes, keepdims), float(n - ddof))


@public("reduction", shape_rule=statistics_rule, kinds={**REDUCE, "ddof": "int"})
def std(x: Any, axis: Axis = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    """Standard deviation over `axis`."""
    return sqrt(var(x, axis, keepdims, ddof))


@public("reduction", shape_rule=reduction("float", empty_ok=False), kinds=REDUCE)
def logsumexp(x: Any, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """log(sum(exp(x))) over `axis`, without overflow."""
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "logsumexp")
    _check_nonempty(x, axes, "logsumexp")
    # The shift is a constant: its derivative cancels exactly, so it is computed from
    # stop(x), outside every tape and accumulator; with ops, so a captured pass
    # (engine/replay.py) replays it from the new x instead of freezing it.
    shift = bind(max_p, stop(x), axes=axes, keepdims=True)
    shift = where(isfinite(shift), shift, 0)
    out = add(log(sum(exp(subtract(x, shift)), axes, keepdims=True)), shift)
    return (
        out
        if keepdims
        else reshape(out, tuple(d for i, d in enumerate(out.shape) if i - out.ndim not in axes))
    )


NORM_ORDS = (None, 1, 2, "euclidean", "fro", "inf", host.inf)


def check_ord(ord: Any) -> None:
    if ord not in NORM_ORDS:
        raise RuleError(f"unsupported ord {ord!r}; use None/2, 1 or 'inf'", "op")


def norm_rule(b: dict[str, Any]) -> TensorType:
    check_ord(b.get("ord"))
    return reduction("float")(b)


@public("reduction", shape_rule=norm_rule, kinds={**REDUCE, "ord": "ord"})
def norm(x: Any, ord: Any = None, axis: Axis = None, keepdims: bool = False) -> Tensor:
    """Vector norm over `axis`: ord None or 2 (Euclidean), 1, or inf.

    The Euclidean norm has no derivative at 0 (it gives NaN there, as in TensorFlow).
    """
    x = as_tensor(x)
    axes = normalize_axes(axis, x.ndim, "norm")
    checked("norm", check_ord, ord)
    if ord in (None, 2, "euclidean", "fro"):
        return sqrt(sum(multiply(x, x), axes, keepdims))
    if ord == 1:
        return sum(abs(x), axes, keepdims)
    return max(abs(x), axes, keepdims)  # ord inf
