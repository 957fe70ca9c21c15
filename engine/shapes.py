"""Shapes and dtypes without arrays: what every public op's shape rule works on, and the
checks that an op's wrapper and its rule share.

A shape rule is registered beside its op (`public(..., shape_rule=rule)`, see
registry.py). It maps the call's bound arguments (`TensorType`s for tensors, Python
values for constants) to the result's `TensorType`, or raises `RuleError`; the definition
language runs it to infer every intermediate before anything is allocated.

A check that the wrapper makes too (an axis in range, inner dimensions that agree) is
one function here or in the op's block, raising RuleError with a message that does not
name the op. The rule lets it through (the language reports it at the call's line and
column); the wrapper runs it through `checked`, which puts the op's name in front and
raises the exception the engine always raised for it (ValueError, TypeError or
IndexError).

The rules follow the wrappers' dtype policy: a Python number takes the dtype of the
tensor it meets, two tensors of different dtypes are an error. They are stricter in one
way: an op that needs floats refuses integer tensors (NumPy would silently compute
exp(int32) in float64). tests/language checks every rule against the engine's real
output on random programs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.backend import host

INT32, FLOAT32, BOOL = (host.dtype(d) for d in ("int32", "float32", "bool"))
INDEX = host.dtype(host.intp)  # what argmax returns


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape and dtype. `literal` is set for a Python number that has not met
    a tensor yet (its dtype is the engine's default for it: int32 or float32)."""

    shape: tuple[int, ...]
    dtype: Any  # a NumPy dtype
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


class RuleError(ValueError):
    """A call an op refuses. `message` does not name the op; `kind` is how the language
    classes it ("shape", "dtype", "op"); `error` is the exception the wrapper raises;
    `hint` is advice for engine users only (it names Python API the language lacks)."""

    def __init__(
        self,
        message: str,
        kind: str = "shape",
        error: type[Exception] = ValueError,
        hint: str = "",
    ):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.error = error
        self.hint = hint


def checked(opname: str, check: Callable[..., Any], *args: Any) -> Any:
    """Run a shared check for a wrapper: its RuleError becomes the engine's own error,
    with the op's name in front."""
    try:
        return check(*args)
    except RuleError as exc:
        hint = f"; {exc.hint}" if exc.hint else ""
        raise exc.error(f"{opname}: {exc.message}{hint}") from None


Rule = Callable[[dict[str, Any]], TensorType]

# ----------------------------------------------------------------------------------------
# Dtypes
# ----------------------------------------------------------------------------------------

CATEGORIES = {
    "float": ("f", "a floating-point tensor"),
    "numeric": ("iuf", "a numeric (int or float, not bool) tensor"),
    "bool": ("b", "a bool tensor"),
    "any": ("biuf", "a tensor"),
}


def require(t: Any, category: str, what: str = "x") -> None:
    """t (a TensorType or a Tensor) has a dtype of `category` (CATEGORIES)."""
    kinds, description = CATEGORIES[category]
    if t.dtype.kind not in kinds:
        hint = "; cast it first" if category == "float" else ""
        raise RuleError(f"{what} must be {description}, got {t.dtype}{hint}", "dtype", TypeError)


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
        info = host.iinfo(dtype)
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


def same_dtypes(xs: list[TensorType]) -> list[TensorType]:
    """The engine's coerce_all: every tensor on its own, then one dtype for all."""
    xs = [concrete(x) for x in xs]
    dtypes = sorted({str(x.dtype) for x in xs})
    if len(dtypes) > 1:
        raise RuleError(f"dtypes differ ({', '.join(dtypes)}); use cast first", "dtype")
    return xs


# ----------------------------------------------------------------------------------------
# Shapes and axes
# ----------------------------------------------------------------------------------------


def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's broadcast of the shapes."""
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(-ndim, 0):
        dims = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(dims) > 1:
            listed = " and ".join(str(s) for s in shapes)
            raise RuleError(f"shapes {listed} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Axes as a sorted tuple of *negative* ints (None means all axes).

    Negative axes count from the end, so they stay right when leading batch axes are
    prepended to a cotangent or tangent.
    """
    if axis is None:
        return tuple(range(-ndim, 0))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int) or isinstance(a, bool):
            raise RuleError(
                f"axis must be an int or a tuple of ints, got {a!r}", "op", error=TypeError
            )
        if not -ndim <= a < ndim:
            raise RuleError(f"axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a - ndim if a >= 0 else a)
    if len(set(out)) != len(out):
        raise RuleError(f"repeated axis in {axis!r}")
    return tuple(sorted(out))


def normalize_axis(axis: int, ndim: int) -> int:
    """One axis as a negative int."""
    return normalize_axes(axis, ndim)[0]


def axis_index(axis: int, ndim: int) -> int:
    """One axis as a non-negative index."""
    return normalize_axes(axis, ndim)[0] + ndim


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple:
    """`shape` reduced over the (negative) axes: dropped, or set to 1 with keepdims."""
    ndim = len(shape)
    reduced = {a + ndim for a in axes}
    if keepdims:
        return tuple(1 if i in reduced else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in reduced)


def check_nonempty(shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
    """A reduction with no identity (max, mean) needs elements on every reduced axis."""
    if any(shape[a] == 0 for a in axes):
        raise RuleError(f"reduction over an empty axis of shape {shape}")


def check_same_shape(
    a: tuple[int, ...], b: tuple[int, ...], names: str = "predictions and targets"
) -> None:
    if a != b:
        first, second = names.split(" and ")
        raise RuleError(f"{first} {a} and {second} {b} differ in shape")


def check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise RuleError(f"{name} must be positive, got {value}", "op")


# ----------------------------------------------------------------------------------------
# Rule families shared by many ops
# ----------------------------------------------------------------------------------------


def unary(category: str) -> Rule:
    """An elementwise op of one tensor of `category`; the result is x's type."""

    def infer(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, category)
        return x

    return infer


def binary(category: str, result: Any = None, names: tuple[str, str] = ("x", "y")) -> Rule:
    """An elementwise op of two broadcast tensors (parameters `names`); the result has
    their dtype, or `result` (comparisons give bool)."""

    def infer(b: dict[str, Any]) -> TensorType:
        x, y = pair(b[names[0]], b[names[1]])
        require(x, category, "the operands")
        return TensorType(broadcast(x.shape, y.shape), result or x.dtype)

    return infer


def same_type(b: dict[str, Any]) -> TensorType:
    """The result is x's type whatever its dtype (stop_gradient)."""
    return concrete(b["x"])
