"""Shape and dtype inference, one rule per op, on shapes alone (nothing is allocated).

`RULES` maps every public op's name to an `OpRule`: the kinds of its constant
parameters (everything else is a tensor) and `infer(bound) -> TensorType`, where
`bound` maps parameter names to TensorTypes (tensor parameters) or Python constants.
A rule raises RuleError with a message in the engine's words when the op would fail.

The rules mirror the engine's wrappers, including their dtype policy: a Python number
takes the dtype of the tensor it meets, two tensors of different dtypes are an error.
They are stricter in one way: an op that needs floats refuses integer tensors (NumPy
would silently compute exp(int32) in float64). tests/language checks every rule against
the engine's real output on random programs.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.ops.conv import conv_rank, conv_shape, pool2d_window, pool_shape
from engine.ops.nn import attention_shape
from engine.ops.shape import check_pad_mode, resolve_shape

INT32, FLOAT32, BOOL = (np.dtype(d) for d in ("int32", "float32", "bool"))
INDEX = np.dtype(np.intp)  # what argmax returns


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape and dtype. `literal` is set for a Python number that has not met
    a tensor yet (its dtype is the engine's default for it: int32 or float32)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    literal: int | float | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def literal_type(value: float) -> TensorType:
    return TensorType((), INT32 if isinstance(value, int) else FLOAT32, value)


def concrete(t: TensorType) -> TensorType:
    """A literal made a tensor on its own (the engine's as_tensor without `like`)."""
    return t if t.literal is None else TensorType((), t.dtype)


class RuleError(Exception):
    def __init__(self, message: str, kind: str = "shape"):
        super().__init__(message)
        self.message = message
        self.kind = kind


# ----------------------------------------------------------------------------------------
# Helpers shared by the rules
# ----------------------------------------------------------------------------------------

CATEGORIES = {
    "float": ("f", "a floating-point tensor"),
    "numeric": ("iuf", "a numeric (int or float, not bool) tensor"),
    "bool": ("b", "a bool tensor"),
    "any": ("biuf", "a tensor"),
}


def require(t: TensorType, category: str, what: str = "x") -> None:
    kinds, description = CATEGORIES[category]
    if t.dtype.kind not in kinds:
        hint = "; cast it first" if category == "float" else ""
        raise RuleError(f"{what} must be {description}, got {t.dtype}{hint}", "dtype")


def like(v: TensorType, other: TensorType) -> TensorType:
    """A literal takes `other`'s dtype (the engine's as_tensor(value, like=other))."""
    if v.literal is None:
        return v
    dtype = other.dtype
    if dtype.kind in "iub" and isinstance(v.literal, float) and not v.literal.is_integer():
        raise RuleError(
            f"cannot combine a {dtype} tensor with the float {v.literal!r}; cast the tensor first",
            "dtype",
        )
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not info.min <= v.literal <= info.max:
            raise RuleError(f"the constant {v.literal} does not fit in {dtype}", "dtype")
    return TensorType((), dtype)


def pair(x: TensorType, y: TensorType) -> tuple[TensorType, TensorType]:
    """The engine's coerce_pair: one dtype for both; a literal takes the other's."""
    if x.literal is None:
        y = like(y, x)
    elif y.literal is None:
        x = like(x, y)
    else:
        x = concrete(x)
        y = like(y, x)
    if x.dtype != y.dtype:
        raise RuleError(
            f"dtypes differ ({x.dtype} and {y.dtype}); gradtape never casts silently, use "
            "cast on one side",
            "dtype",
        )
    return x, y


def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(-ndim, 0):
        dims = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(dims) > 1:
            listed = " and ".join(str(s) for s in shapes)
            raise RuleError(f"shapes {listed} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def axes_of(axis: Any, ndim: int) -> tuple[int, ...]:
    """The engine's normalize_axes: sorted negative axes; None means all."""
    if axis is None:
        return tuple(range(-ndim, 0))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise RuleError(f"axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a - ndim if a >= 0 else a)
    if len(set(out)) != len(out):
        raise RuleError(f"repeated axis in {axis!r}")
    return tuple(sorted(out))


def axis_of(axis: int, ndim: int) -> int:
    """One axis as a non-negative index."""
    return axes_of(axis, ndim)[0] + ndim


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple:
    ndim = len(shape)
    reduced = {a + ndim for a in axes}
    if keepdims:
        return tuple(1 if i in reduced else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in reduced)


def nonempty(x: TensorType, axes: tuple[int, ...]) -> None:
    if any(x.shape[a] == 0 for a in axes):
        raise RuleError(f"reduction over an empty axis of shape {x.shape}")


def same_shape(a: TensorType, b: TensorType, names: str = "predictions and targets") -> None:
    if a.shape != b.shape:
        first, second = names.split(" and ")
        raise RuleError(f"{first} {a.shape} and {second} {b.shape} differ in shape")


# ----------------------------------------------------------------------------------------
# Rule families
# ----------------------------------------------------------------------------------------

Rule = Callable[[dict[str, Any]], TensorType]


def unary(category: str) -> Rule:
    def infer(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, category)
        return x

    return infer


def binary(category: str, result: np.dtype | None = None) -> Rule:
    def infer(b: dict[str, Any]) -> TensorType:
        x, y = pair(b["x"], b["y"])
        require(x, category, "the operands")
        return TensorType(broadcast(x.shape, y.shape), result or x.dtype)

    return infer


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The engine's sums keep integer dtypes and count bools in int32."""
    return INT32 if dtype.kind == "b" else dtype


def reduction(
    category: str,
    *,
    empty_ok: bool = True,
    result: Callable[[np.dtype], np.dtype] | None = None,
    identity: bool = False,
) -> Rule:
    """sum-like: `axis` (None, int or tuple) and `keepdims`."""

    def infer(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, category)
        axes = axes_of(b.get("axis"), x.ndim)
        keepdims = b.get("keepdims", False)
        if not empty_ok:
            nonempty(x, axes)
        if identity and not axes and not keepdims:  # the engine returns x itself
            return x
        dtype = result(x.dtype) if result else x.dtype
        return TensorType(reduced_shape(x.shape, axes, keepdims), dtype)

    return infer


def _arg_extremum(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if b.get("axis") is None:
        if x.size == 0:
            raise RuleError(f"no elements to choose from in shape {x.shape}")
        return TensorType((), INDEX)
    axis = axis_of(b["axis"], x.ndim)
    if x.shape[axis] == 0:
        raise RuleError(f"axis {axis} of shape {x.shape} is empty")
    return TensorType(x.shape[:axis] + x.shape[axis + 1 :], INDEX)


def _statistics(b: dict[str, Any]) -> TensorType:
    """var and std: divisor n - ddof must stay positive."""
    x = concrete(b["x"])
    require(x, "float")
    axes = axes_of(b.get("axis"), x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    ddof = b.get("ddof", 0)
    nonempty(x, axes)
    if n - ddof <= 0:
        raise RuleError(f"{n} elements with ddof={ddof} leave no degrees of freedom")
    return TensorType(reduced_shape(x.shape, axes, b.get("keepdims", False)), x.dtype)


def _norm(b: dict[str, Any]) -> TensorType:
    if b.get("ord") not in (None, 1, 2, "euclidean", "fro", "inf"):
        raise RuleError(f"unsupported ord {b['ord']!r}; use None/2, 1 or 'inf'", "op")
    return reduction("float")(b)


def _prod_workspace(b: dict[str, Any], out: TensorType) -> int:
    """prod's gradient lays each reduction group of n elements out as an (n, n) matrix."""
    x = concrete(b["x"])
    axes = axes_of(b.get("axis"), x.ndim)
    return x.size * math.prod(x.shape[a] for a in axes)


# ---- elementwise specials ----
def _power(b: dict[str, Any]) -> TensorType:
    out = binary("numeric")(b)
    exponent = b["y"].literal
    if out.dtype.kind in "iu" and exponent is not None and exponent < 0:
        raise RuleError(
            f"an integer to a negative power ({exponent}); cast to a float first", "dtype"
        )
    return out


def _cast(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    return TensorType(x.shape, np.dtype(b.get("dtype", "float32")))


def _clip(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    low, high = b["min_value"], b["max_value"]
    if low > high:
        raise RuleError(f"min_value {low} is greater than max_value {high}", "op")
    for bound in (low, high):
        like(TensorType((), FLOAT32, bound), x)
    return x


def _where(b: dict[str, Any]) -> TensorType:
    condition = concrete(b["condition"])
    if condition.dtype != BOOL:
        raise RuleError(f"condition must be bool, got {condition.dtype}", "dtype")
    x, y = pair(b["x"], b["y"])
    return TensorType(broadcast(condition.shape, x.shape, y.shape), x.dtype)


# ---- shape ----
def _reshape(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    try:
        return TensorType(resolve_shape(x.shape, b.get("shape", ())), x.dtype)
    except ValueError as exc:
        raise RuleError(str(exc)) from None


def _transpose(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    axes = b.get("axes")
    axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(axes)
    axes = tuple(a + x.ndim if a < 0 else a for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise RuleError(f"axes {axes} are not a permutation of a rank-{x.ndim} tensor")
    return TensorType(tuple(x.shape[a] for a in axes), x.dtype)


def _swapaxes(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    perm = list(range(x.ndim))
    a, c = axis_of(b.get("axis1", -2), x.ndim), axis_of(b.get("axis2", -1), x.ndim)
    perm[a], perm[c] = perm[c], perm[a]
    return TensorType(tuple(x.shape[i] for i in perm), x.dtype)


def _moveaxis(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    src = axis_of(b.get("source", 0), x.ndim)
    dst = axis_of(b.get("destination", -1), x.ndim)
    perm = [i for i in range(x.ndim) if i != src]
    perm.insert(dst, src)
    return TensorType(tuple(x.shape[i] for i in perm), x.dtype)


def _broadcast_to(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    shape = tuple(b.get("shape", ()))
    if any(d < 0 for d in shape):
        raise RuleError(f"negative dimension in shape {shape}")
    try:
        ok = broadcast(x.shape, shape) == shape
    except RuleError:
        ok = False
    if not ok:
        raise RuleError(f"cannot broadcast {x.shape} to {shape}")
    return TensorType(shape, x.dtype)


def _expand_dims(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    axis = b.get("axis", 0)
    if not -x.ndim - 1 <= axis <= x.ndim:
        raise RuleError(f"axis {axis} out of range for rank {x.ndim}")
    position = axis if axis >= 0 else x.ndim + 1 + axis
    return TensorType(x.shape[:position] + (1,) + x.shape[position:], x.dtype)


def _squeeze(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    axis = b.get("axis")
    if axis is None:
        return TensorType(tuple(d for d in x.shape if d != 1), x.dtype)
    axes = {axis_of(a, x.ndim) for a in ((axis,) if isinstance(axis, int) else axis)}
    for a in sorted(axes):
        if x.shape[a] != 1:
            raise RuleError(f"axis {a} of shape {x.shape} has size {x.shape[a]}, not 1")
    return TensorType(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)


def _flatten(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    return TensorType((x.size,), x.dtype)


def _same_dtypes(xs: list[TensorType]) -> list[TensorType]:
    """The engine's coerce_all: every tensor on its own, then one dtype for all."""
    xs = [concrete(x) for x in xs]
    dtypes = sorted({str(x.dtype) for x in xs})
    if len(dtypes) > 1:
        raise RuleError(f"dtypes differ ({', '.join(dtypes)}); use cast first", "dtype")
    return xs


def _concatenate(b: dict[str, Any]) -> TensorType:
    xs = _same_dtypes(b["xs"])
    if not xs:
        raise RuleError("needs at least one tensor", "op")
    first = xs[0]
    if first.ndim == 0:
        raise RuleError("zero-rank tensors cannot be concatenated; use stack")
    axis = axis_of(b.get("axis", 0), first.ndim)
    for x in xs[1:]:
        if x.ndim != first.ndim or any(
            d != e for i, (d, e) in enumerate(zip(x.shape, first.shape)) if i != axis
        ):
            shapes = ", ".join(str(u.shape) for u in xs)
            raise RuleError(f"shapes {shapes} differ off axis {axis}")
    total = sum(x.shape[axis] for x in xs)
    return TensorType(first.shape[:axis] + (total,) + first.shape[axis + 1 :], first.dtype)


def _stack(b: dict[str, Any]) -> TensorType:
    xs = _same_dtypes(b["xs"])
    if not xs:
        raise RuleError("needs at least one tensor", "op")
    if len({x.shape for x in xs}) > 1:
        raise RuleError(f"shapes differ: {[x.shape for x in xs]}")
    axis = b.get("axis", 0)
    _expand_dims({"x": xs[0], "axis": axis})  # the same range check
    position = axis if axis >= 0 else xs[0].ndim + 1 + axis
    shape = xs[0].shape[:position] + (len(xs),) + xs[0].shape[position:]
    return TensorType(shape, xs[0].dtype)


def index_shape(shape: tuple[int, ...], index: Any) -> tuple[int, ...]:
    """The shape of x[index] for a basic index (the engine's normalize_index)."""
    items = list(index) if isinstance(index, tuple) else [index]
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        raise RuleError("an index can only have a single Ellipsis")
    if consumed > len(shape):
        raise RuleError(f"too many indices ({consumed}) for a tensor of shape {shape}")
    fill = [slice(None)] * (len(shape) - consumed)
    if ellipses:
        items[ellipses[0] : ellipses[0] + 1] = fill
    else:
        items.extend(fill)
    out, axis = [], 0
    for item in items:
        if item is None:
            out.append(1)
            continue
        size = shape[axis]
        if isinstance(item, slice):
            out.append(len(range(*item.indices(size))))
        elif not -size <= item < size:
            raise RuleError(f"index {item} is out of bounds for axis {axis} of size {size}")
        axis += 1
    return tuple(out)


def _getitem(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    return TensorType(index_shape(x.shape, b.get("index", ())), x.dtype)


def _take(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    axis = axis_of(b.get("axis", 0), x.ndim)
    indices = b.get("indices", ())
    if isinstance(indices, TensorType):
        if indices.dtype.kind not in "iu":
            raise RuleError(f"indices must be integers, got {indices.dtype}", "dtype")
        index_shape_ = indices.shape
    else:
        values = np.asarray(indices)
        if values.dtype.kind not in "iu":
            raise RuleError("indices must be integers", "op")
        size = x.shape[axis]
        if values.size and (values.max() >= size or values.min() < -size):
            raise RuleError(f"an index is out of bounds for axis {axis} of size {size}")
        index_shape_ = values.shape
    return TensorType(x.shape[:axis] + index_shape_ + x.shape[axis + 1 :], x.dtype)


# ---- linear algebra ----
def _matmul(b: dict[str, Any]) -> TensorType:
    x, y = pair(b["x"], b["y"])
    require(x, "numeric", "the operands")
    if x.ndim == 0 or y.ndim == 0:
        raise RuleError(f"operands must not be scalars (shapes {x.shape} and {y.shape})")
    k_x = x.shape[-1]
    k_y = y.shape[0] if y.ndim == 1 else y.shape[-2]
    if k_x != k_y:
        raise RuleError(f"inner dimensions differ: {x.shape} @ {y.shape} ({k_x} != {k_y})")
    if x.ndim == 1 and y.ndim == 1:
        shape: tuple[int, ...] = ()
    elif x.ndim == 1:
        shape = y.shape[:-2] + y.shape[-1:]
    elif y.ndim == 1:
        shape = x.shape[:-1]
    else:
        try:
            stack = broadcast(x.shape[:-2], y.shape[:-2])
        except RuleError:
            raise RuleError(f"stacked shapes {x.shape} and {y.shape} do not broadcast") from None
        shape = stack + (x.shape[-2], y.shape[-1])
    return TensorType(shape, x.dtype)


def _outer(b: dict[str, Any]) -> TensorType:
    x, y = pair(b["x"], b["y"])
    require(x, "numeric", "the operands")
    return TensorType((x.size, y.size), x.dtype)


def _solve(b: dict[str, Any]) -> TensorType:
    a, rhs = pair(b["a"], b["b"])
    require(a, "float", "a and b")
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise RuleError(f"a must be a square matrix, got shape {a.shape}")
    if rhs.ndim not in (1, 2) or rhs.shape[0] != a.shape[0]:
        raise RuleError(f"b must be ({a.shape[0]},) or ({a.shape[0]}, k), got {rhs.shape}")
    return rhs


def _einsum(b: dict[str, Any]) -> TensorType:
    """The engine's einsum: ellipses spelled out, implicit output named, size-1 axes
    broadcast, no repeated subscripts within an operand."""
    ops = _same_dtypes(list(b.get("operands", ())))
    if not ops:
        raise RuleError("needs at least one operand", "op")
    require(ops[0], "numeric", "the operands")
    spec = b["spec"].replace(" ", "")
    if spec.count("->") > 1:
        raise RuleError(f"invalid spec {spec!r}", "op")
    inputs_part, output = spec.split("->") if "->" in spec else (spec, None)
    inputs = inputs_part.split(",")
    if len(inputs) != len(ops):
        raise RuleError(f"spec {spec!r} names {len(inputs)} operands, got {len(ops)}", "op")
    used = set(spec) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    ell_rank = 0
    for s, op in zip(inputs, ops):
        if "..." in s:
            ell_rank = max(ell_rank, op.ndim - (len(s) - 3))
    ell = "".join(spare[:ell_rank])
    resolved = []
    for s, op in zip(inputs, ops):
        if "..." in s:
            n = op.ndim - (len(s) - 3)
            if n < 0:
                raise RuleError(f"subscripts {s!r} do not match an operand of shape {op.shape}")
            s = s.replace("...", ell[ell_rank - n :] if n else "", 1)
        if s and not s.isalpha() or not s.isascii():
            raise RuleError(f"invalid subscripts {s!r}", "op")
        if len(s) != op.ndim:
            raise RuleError(f"subscripts {s!r} do not match an operand of shape {op.shape}")
        if len(set(s)) != len(s):
            raise RuleError(f"repeated subscript in {s!r} (a diagonal or trace) is not supported")
        resolved.append(s)
    if output is None:
        joined = "".join(resolved)
        output = ell + "".join(
            sorted(c for c in set(joined) if joined.count(c) == 1 and c not in ell)
        )
    else:
        output = output.replace("...", ell, 1)
    if output and not (output.isalpha() and output.isascii()) or len(set(output)) != len(output):
        raise RuleError(f"invalid output subscripts {output!r}", "op")
    sizes: dict[str, int] = {}
    for s, op in zip(resolved, ops):
        for c, d in zip(s, op.shape):
            if sizes.setdefault(c, d) != d and 1 not in (d, sizes[c]):
                raise RuleError(f"index {c!r} has sizes {sizes[c]} and {d}")
            if sizes[c] == 1:
                sizes[c] = d
    for c in output:
        if c not in sizes:
            raise RuleError(f"output index {c!r} does not appear in the inputs", "op")
    return TensorType(tuple(sizes[c] for c in output), ops[0].dtype)


# ---- nn and losses ----
def _softmax(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    nonempty(x, axes_of(b.get("axis", -1), x.ndim))
    return x


def _reduce_loss(losses: TensorType, reduction: str) -> TensorType:
    if reduction == "none":
        return losses
    if reduction == "mean":
        nonempty(losses, axes_of(None, losses.ndim))
    return TensorType((), losses.dtype)


def _pointwise_loss(b: dict[str, Any]) -> TensorType:
    p, t = concrete(b["predictions"]), concrete(b["targets"])
    same_shape(p, t)
    p, t = pair(p, t)
    require(p, "float", "predictions")
    if b.get("delta", 1.0) <= 0:
        raise RuleError(f"delta must be positive, got {b['delta']}", "op")
    return _reduce_loss(p, b.get("reduction", "mean"))


def _softmax_cross_entropy(b: dict[str, Any]) -> TensorType:
    logits, labels = concrete(b["logits"]), concrete(b["labels"])
    require(logits, "float", "logits")
    axis = axis_of(b.get("axis", -1), logits.ndim)
    nonempty(logits, (axis - logits.ndim,))
    rest = logits.shape[:axis] + logits.shape[axis + 1 :]
    if labels.dtype.kind in "iu":
        if labels.shape != rest:
            raise RuleError(
                f"integer labels must have shape {rest} for logits {logits.shape}, got "
                f"{labels.shape}"
            )
    else:
        same_shape(logits, labels, "logits and labels")
        pair(logits, labels)
    return _reduce_loss(TensorType(rest, logits.dtype), b.get("reduction", "mean"))


def _sigmoid_cross_entropy(b: dict[str, Any]) -> TensorType:
    logits, labels = concrete(b["logits"]), concrete(b["labels"])
    same_shape(logits, labels, "logits and labels")
    logits, _ = pair(logits, labels)
    require(logits, "float", "logits")
    return _reduce_loss(logits, b.get("reduction", "mean"))


def _normalization(batch: bool) -> Rule:
    def infer(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, "float")
        if batch and x.ndim < 2:
            raise RuleError(f"needs a batch axis and a feature axis, got shape {x.shape}")
        axes = tuple(range(-x.ndim, -1)) if batch else axes_of(-1, x.ndim)
        nonempty(x, axes)
        out = x
        for name in ("gamma", "beta"):
            if b.get(name) is not None:
                out, other = pair(out, concrete(b[name]))
                out = TensorType(broadcast(out.shape, other.shape), out.dtype)
        return out

    return infer


def _clip_by_norm(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    if b.get("clip_norm", 1.0) <= 0:
        raise RuleError(f"clip_norm must be positive, got {b['clip_norm']}", "op")
    axes_of(b.get("axis"), x.ndim)
    return x


# ---- issue 19's ops (self-contained, to port into the registry with the rest) ----
def _cumsum(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if x.ndim == 0:
        raise RuleError("cumsum needs a tensor of rank >= 1", "op")
    axis_of(b.get("axis", 0), x.ndim)
    return x


def _sort(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if x.ndim:
        axis_of(b.get("axis", -1), x.ndim)
    return x


def _pad(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    pairs = tuple(b.get("paddings", ()))
    if len(pairs) != x.ndim or any(lo < 0 or hi < 0 for lo, hi in pairs):
        raise RuleError(f"paddings {pairs} for a tensor of shape {x.shape}", "op")
    _shared(check_pad_mode, x.shape, pairs, b.get("mode", "CONSTANT"))
    return TensorType(tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, pairs)), x.dtype)


def _tile(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    multiples = b.get("multiples", ())
    multiples = (multiples,) if isinstance(multiples, int) else tuple(multiples)
    if len(multiples) != x.ndim or any(m < 0 for m in multiples):
        raise RuleError(f"multiples {multiples} for a tensor of shape {x.shape}", "op")
    return TensorType(tuple(m * d for m, d in zip(multiples, x.shape)), x.dtype)


def _nd_indices(indices: TensorType, shape: tuple[int, ...]) -> int:
    indices = concrete(indices)
    if indices.dtype.kind not in "iu" or indices.ndim < 1:
        raise RuleError(f"indices must be an integer tensor of rank >= 1, got {indices}", "dtype")
    depth = indices.shape[-1]
    if depth > len(shape):
        raise RuleError(f"indices of depth {depth} for a tensor of shape {shape}", "shape")
    return depth


def _gather_nd(b: dict[str, Any]) -> TensorType:
    params = concrete(b["params"])
    depth = _nd_indices(b["indices"], params.shape)
    return TensorType(b["indices"].shape[:-1] + params.shape[depth:], params.dtype)


def _scatter_nd(b: dict[str, Any]) -> TensorType:
    updates = concrete(b["updates"])
    shape = b.get("shape", ())
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    depth = _nd_indices(b["indices"], shape)
    expected = b["indices"].shape[:-1] + shape[depth:]
    if updates.shape != expected:
        raise RuleError(f"updates must have shape {expected}, got {updates.shape}", "shape")
    return TensorType(shape, updates.dtype)


# ---- issue 13: convolution, pooling, embedding, attention ----
# The shape checks are the engine's own (engine/ops/conv.py, nn.py), so the two agree.
def _shared(check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except ValueError as exc:
        raise RuleError(str(exc), "shape") from None


def _conv_types(b: dict[str, Any]) -> tuple[TensorType, TensorType, TensorType | None]:
    x, w = pair(b["x"], b["w"])
    require(x, "float")
    bias = b.get("b")
    if bias is not None:
        bias = like(bias, x)
        if bias.dtype != x.dtype:
            raise RuleError(f"bias dtype {bias.dtype} differs from the input's {x.dtype}", "dtype")
    return x, w, bias


def _conv(b: dict[str, Any]) -> TensorType:
    x, w, bias = _conv_types(b)
    bias_shape = None if bias is None else bias.shape
    shape = _shared(
        conv_shape,
        x.shape,
        w.shape,
        bias_shape,
        b.get("strides"),
        b.get("pads"),
        b.get("dilations"),
        b.get("groups", 1),
    )[0]
    return TensorType(shape, x.dtype)


def _conv_nd(nd: int) -> Rule:
    def rule(b: dict[str, Any]) -> TensorType:
        _shared(conv_rank, nd, concrete(b["w"]).shape)
        renamed = {"strides": b["stride"], "pads": b["padding"], "dilations": b["dilation"]}
        return _conv({**b, **renamed})

    return rule


def _conv_workspace(b: dict[str, Any], out: TensorType) -> int:
    """The im2col patches: every input channel times every kernel cell, per output cell."""
    x, w = b["x"], b["w"]
    return x.shape[0] * x.shape[1] * math.prod(w.shape[2:]) * math.prod(out.shape[2:])


def _pool_input(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    return x


def _max_pool(b: dict[str, Any]) -> TensorType:
    x = _pool_input(b)
    window = _shared(
        pool_shape,
        x.shape,
        b["kernel_shape"],
        b.get("strides"),
        b.get("pads"),
        b.get("dilations"),
        b.get("ceil_mode", False),
    )
    return TensorType(window.out, x.dtype)


def _avg_pool(b: dict[str, Any]) -> TensorType:
    return _max_pool({**b, "dilations": None})


def _pool2d(b: dict[str, Any]) -> TensorType:
    kernel, stride = _shared(pool2d_window, b["kernel_size"], b.get("stride"))
    return _max_pool(
        {
            "x": b["x"],
            "kernel_shape": kernel,
            "strides": stride,
            "pads": b.get("padding", 0),
            "dilations": b.get("dilation", 1),
            "ceil_mode": b.get("ceil_mode", False),
        }
    )


def _pool_workspace(b: dict[str, Any], out: TensorType) -> int:
    kernel = b.get("kernel_shape")
    if kernel is None:
        kernel = pool2d_window(b["kernel_size"], None)[0]
    return out.size * math.prod(kernel)


def _embedding(b: dict[str, Any]) -> TensorType:
    table, ids = concrete(b["table"]), concrete(b["ids"])
    if ids.dtype.kind not in "iu":
        raise RuleError(f"ids must be an integer tensor, got {ids.dtype}", "dtype")
    if table.ndim < 1:
        raise RuleError(f"table must have rank >= 1, got shape {table.shape}", "shape")
    return TensorType(ids.shape + table.shape[1:], table.dtype)


def _attention(b: dict[str, Any]) -> TensorType:
    q, k, v = (concrete(b[n]) for n in ("q", "k", "v"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        require(t, "float", name)
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise RuleError(f"dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); use cast first", "dtype")
    return TensorType(_shared(attention_shape, q.shape, k.shape, v.shape), q.dtype)


def _attention_workspace(b: dict[str, Any], out: TensorType) -> int:
    """The score matrix (and its softmax): [..., Lq, Lk]."""
    return out.size // max(b["v"].shape[-1], 1) * b["k"].shape[-2]


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRule:
    """kinds: the constant parameters and their kinds (see constants.py); every other
    parameter is a tensor. workspace: elements an op needs beyond its output (checked
    against the same per-tensor limit)."""

    infer: Rule
    kinds: Mapping[str, str] = field(default_factory=dict)
    workspace: Callable[[dict[str, Any], TensorType], int] | None = None


REDUCE = {"axis": "axes", "keepdims": "bool"}
CONV = {"strides": "window?", "pads": "pads", "dilations": "window?", "groups": "int"}
CONV_TORCH = {"stride": "window", "padding": "pads", "dilation": "window", "groups": "int"}
POOL = {"kernel_shape": "ints", "strides": "window?", "pads": "pads", "ceil_mode": "bool"}
POOL_TORCH = {"kernel_size": "window", "stride": "window?", "padding": "pads", "ceil_mode": "bool"}
FLOAT_UNARY = [
    "exp",
    "log",
    "log1p",
    "expm1",
    "sqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sigmoid",
    "relu",
    "reciprocal",
    "softplus",
    "log_sigmoid",
    "silu",
    "erf",
    "rsqrt",
]

RULES: dict[str, OpRule] = {
    **{
        name: OpRule(binary("numeric"))
        for name in ("add", "subtract", "multiply", "maximum", "minimum")
    },
    "power": OpRule(_power),
    "divide": OpRule(binary("float")),
    **{name: OpRule(unary("float")) for name in FLOAT_UNARY},
    **{name: OpRule(unary("numeric")) for name in ("negative", "abs", "square", "sign")},
    "elu": OpRule(unary("float"), {"alpha": "float"}),
    "leaky_relu": OpRule(unary("float"), {"alpha": "float"}),
    "cast": OpRule(_cast, {"dtype": "dtype"}),
    "clip": OpRule(_clip, {"min_value": "float", "max_value": "float"}),
    "where": OpRule(_where),
    **{
        name: OpRule(binary("numeric", BOOL))
        for name in ("greater", "greater_equal", "less", "less_equal")
    },
    "equal": OpRule(binary("any", BOOL)),
    "not_equal": OpRule(binary("any", BOOL)),
    "logical_and": OpRule(binary("bool", BOOL)),
    "logical_or": OpRule(binary("bool", BOOL)),
    "logical_not": OpRule(unary("bool")),
    "isfinite": OpRule(lambda b: TensorType(unary("numeric")(b).shape, BOOL)),
    # reductions
    "sum": OpRule(reduction("numeric", result=_sum_dtype, identity=True), REDUCE),
    "prod": OpRule(
        reduction("numeric", result=_sum_dtype, identity=True), REDUCE, workspace=_prod_workspace
    ),
    "max": OpRule(reduction("numeric", empty_ok=False), REDUCE),
    "min": OpRule(reduction("numeric", empty_ok=False), REDUCE),
    "mean": OpRule(reduction("float", empty_ok=False), REDUCE),
    "logsumexp": OpRule(reduction("float", empty_ok=False), REDUCE),
    "any": OpRule(reduction("any", result=lambda d: BOOL), REDUCE),
    "all": OpRule(reduction("any", result=lambda d: BOOL), REDUCE),
    "argmax": OpRule(_arg_extremum, {"axis": "axis?"}),
    "argmin": OpRule(_arg_extremum, {"axis": "axis?"}),
    "var": OpRule(_statistics, {**REDUCE, "ddof": "int"}),
    "std": OpRule(_statistics, {**REDUCE, "ddof": "int"}),
    "norm": OpRule(_norm, {**REDUCE, "ord": "ord"}),
    # shape
    "reshape": OpRule(_reshape, {"shape": "shape"}),
    "transpose": OpRule(_transpose, {"axes": "perm"}),
    "swapaxes": OpRule(_swapaxes, {"axis1": "axis", "axis2": "axis"}),
    "moveaxis": OpRule(_moveaxis, {"source": "axis", "destination": "axis"}),
    "broadcast_to": OpRule(_broadcast_to, {"shape": "shape"}),
    "expand_dims": OpRule(_expand_dims, {"axis": "axis"}),
    "squeeze": OpRule(_squeeze, {"axis": "axes"}),
    "flatten": OpRule(_flatten),
    "concatenate": OpRule(_concatenate, {"xs": "tensors", "axis": "axis"}),
    "stack": OpRule(_stack, {"xs": "tensors", "axis": "axis"}),
    "getitem": OpRule(_getitem, {"index": "index"}),
    "take": OpRule(_take, {"indices": "indices", "axis": "axis"}),
    # linear algebra
    "matmul": OpRule(_matmul),
    "outer": OpRule(_outer),
    "einsum": OpRule(_einsum, {"spec": "spec"}),
    "solve": OpRule(_solve),
    # nn and losses
    "stop_gradient": OpRule(lambda b: concrete(b["x"])),
    "log_softmax": OpRule(_softmax, {"axis": "axis"}),
    "softmax": OpRule(_softmax, {"axis": "axis"}),
    "mean_squared_error": OpRule(_pointwise_loss, {"reduction": "reduction"}),
    "huber": OpRule(_pointwise_loss, {"delta": "float", "reduction": "reduction"}),
    "softmax_cross_entropy": OpRule(
        _softmax_cross_entropy, {"axis": "axis", "reduction": "reduction"}
    ),
    "sigmoid_cross_entropy": OpRule(_sigmoid_cross_entropy, {"reduction": "reduction"}),
    "batch_norm": OpRule(_normalization(batch=True), {"eps": "float"}),
    "layer_norm": OpRule(_normalization(batch=False), {"eps": "float"}),
    "clip_by_norm": OpRule(_clip_by_norm, {"clip_norm": "float", "axis": "axes"}),
    # issue 19 (TensorFlow's ops)
    "gelu": OpRule(unary("float"), {"approximate": "bool"}),
    "identity": OpRule(unary("any")),
    "xlogy": OpRule(binary("float")),
    "divide_no_nan": OpRule(binary("float")),
    "cumsum": OpRule(_cumsum, {"axis": "axis", "exclusive": "bool", "reverse": "bool"}),
    "sort": OpRule(_sort, {"axis": "axis", "direction": "direction"}),
    "pad": OpRule(_pad, {"paddings": "paddings", "mode": "pad_mode", "constant_values": "float"}),
    "tile": OpRule(_tile, {"multiples": "shape"}),
    "gather_nd": OpRule(_gather_nd),
    "scatter_nd": OpRule(_scatter_nd, {"shape": "shape"}),
    # issue 13 (convolutional networks and transformers)
    "conv": OpRule(_conv, CONV, workspace=_conv_workspace),
    "conv1d": OpRule(_conv_nd(1), CONV_TORCH, workspace=_conv_workspace),
    "conv2d": OpRule(_conv_nd(2), CONV_TORCH, workspace=_conv_workspace),
    "max_pool": OpRule(
        _max_pool,
        {**POOL, "dilations": "window?"},
        workspace=_pool_workspace,
    ),
    "avg_pool": OpRule(_avg_pool, {**POOL, "count_include_pad": "bool"}, workspace=_pool_workspace),
    "max_pool2d": OpRule(_pool2d, {**POOL_TORCH, "dilation": "window"}, workspace=_pool_workspace),
    "avg_pool2d": OpRule(
        _pool2d, {**POOL_TORCH, "count_include_pad": "bool"}, workspace=_pool_workspace
    ),
    "embedding": OpRule(_embedding),
    "scaled_dot_product_attention": OpRule(
        _attention, {"causal": "bool"}, workspace=_attention_workspace
    ),
}
