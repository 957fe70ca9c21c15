"""Python operators and NumPy-style methods on Tensor, bound to the ops.

They are attached here, not in tensor.py, because the ops import the tensor module and
imports only run downward.
"""

from __future__ import annotations

from typing import Any

from engine.ops import elementwise as el
from engine.ops import linalg, reduce, shape
from engine.tensor import Tensor


def _reflected(op: Any) -> Any:
    return lambda self, other: op(other, self)


_OPERATORS = {
    "__add__": el.add,
    "__radd__": _reflected(el.add),
    "__sub__": el.subtract,
    "__rsub__": _reflected(el.subtract),
    "__mul__": el.multiply,
    "__rmul__": _reflected(el.multiply),
    "__truediv__": el.divide,
    "__rtruediv__": _reflected(el.divide),
    "__pow__": el.power,
    "__rpow__": _reflected(el.power),
    "__matmul__": linalg.matmul,
    "__rmatmul__": _reflected(linalg.matmul),
    "__neg__": el.negative,
    "__pos__": lambda self: self,
    "__abs__": el.abs,
    "__gt__": el.greater,
    "__ge__": el.greater_equal,
    "__lt__": el.less,
    "__le__": el.less_equal,
    "__getitem__": shape.getitem,
    # NumPy-style methods
    "reshape": lambda self, *shape_: shape.reshape(
        self, shape_[0] if len(shape_) == 1 and not isinstance(shape_[0], int) else shape_
    ),
    "transpose": lambda self, *axes: shape.transpose(self, axes or None),
    "sum": reduce.sum,
    "mean": reduce.mean,
    "max": reduce.max,
    "min": reduce.min,
    "prod": reduce.prod,
    "astype": el.cast,
    "T": property(lambda self: shape.transpose(self)),
    "mT": property(lambda self: shape.swapaxes(self, -1, -2)),
}

for _name, _fn in _OPERATORS.items():
    setattr(Tensor, _name, _fn)

# Tensors compare by identity (they are dict keys on tapes); use gt.equal for values.
Tensor.__hash__ = object.__hash__  # type: ignore[method-assign]
