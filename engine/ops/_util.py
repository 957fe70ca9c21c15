"""Small helpers shared by the op families: argument coercion and axis bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import backend, shapes
from engine.tensor import Tensor, as_tensor


def coerce_pair(opname: str, x: Any, y: Any) -> tuple[Tensor, Tensor]:
    """Two tensors of one dtype; a Python scalar takes the other side's dtype."""
    if isinstance(x, Tensor):
        if not isinstance(y, Tensor):
            y = as_tensor(y, like=x)
    elif isinstance(y, Tensor):
        x = as_tensor(x, like=y)
    else:
        x = as_tensor(x)
        y = as_tensor(y, like=x)
    if backend.gpu_loaded() and x.device != y.device:
        raise ValueError(f"{opname}: operands live on {x.device} and {y.device}; move one first")
    if x.dtype is not y.dtype and x.dtype != y.dtype:
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
    """Axes as a sorted tuple of *negative* ints (None means all axes): the check the
    shape rules make (engine/shapes.py), with the op's name on its error."""
    try:
        return shapes.normalize_axes(axis, ndim)
    except shapes.RuleError as exc:
        raise exc.error(f"{opname}: {exc.message}") from None


def normalize_axis(axis: int, ndim: int, opname: str) -> int:
    return normalize_axes(axis, ndim, opname)[0]


def batch_ndim(g: Tensor, ans: Tensor) -> int:
    """How many leading batch axes a cotangent (or tangent) carries beyond `ans`."""
    return g.ndim - ans.ndim
