"""Small helpers shared by the op families: argument coercion and axis bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import backend
from engine.tensor import Tensor, as_tensor


def coerce_pair(opname: str, x: Any, y: Any) -> tuple[Tensor, Tensor]:
    """Two tensors of one dtype; a Python scalar takes the other side's dtype."""
    if isinstance(x, Tensor):
        y = as_tensor(y, like=x)
    elif isinstance(y, Tensor):
        x = as_tensor(x, like=y)
    else:
        x = as_tensor(x)
        y = as_tensor(y, like=x)
    if backend.gpu_loaded() and x.device != y.device:
        raise ValueError(f"{opname}: operands live on {x.device} and {y.device}; move one first")
    if x.dtype != y.dtype:
        raise TypeError(
            f"{opname}: dtypes differ ({x.dtype} and {y.dtype}); gradtape never casts "
            "silently, use gt.cast on one side"
        )
    return x, y


def coerce_all(opname: str, xs: Sequence[Any]) -> list[Tensor]:
    tensors = [as_tensor(x) for x in xs]
    if backend.gpu_loaded() and len({t.device for t in tensors}) > 1:
        places = ", ".join(t.device for t in tensors)
        raise ValueError(f"{opname}: operands live on different devices ({places})")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise TypeError(f"{opname}: dtypes differ ({names}); use gt.cast first")
    return tensors


def normalize_axes(axis: int | Sequence[int] | None, ndim: int, opname: str) -> tuple[int, ...]:
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
            raise TypeError(f"{opname}: axis must be an int or a tuple of ints, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{opname}: axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a - ndim if a >= 0 else a)
    if len(set(out)) != len(out):
        raise ValueError(f"{opname}: repeated axis in {axis!r}")
    return tuple(sorted(out))


def normalize_axis(axis: int, ndim: int, opname: str) -> int:
    return normalize_axes(axis, ndim, opname)[0]


def batch_ndim(g: Tensor, ans: Tensor) -> int:
    """How many leading batch axes a cotangent (or tangent) carries beyond `ans`."""
    return g.ndim - ans.ndim


def keepdims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with the (negative) reduced axes set to 1."""
    ndim = len(shape)
    reduced = {a + ndim for a in axes}
    return tuple(1 if i in reduced else d for i, d in enumerate(shape))
