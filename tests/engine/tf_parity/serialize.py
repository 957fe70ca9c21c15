"""Answers as JSON: tensors become {"shape", "dtype", "data"} (NaN and infinities as
strings), None stays null, structures stay structures. Shared by record.py (TensorFlow)
and the test (the engine), so both sides are written the same way."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _number(v: float) -> Any:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def to_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return _number(float(value))
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": [_number(float(v)) for v in array.ravel()],
    }


def from_json_data(data: list) -> np.ndarray:
    return np.array([float(v) if isinstance(v, str) else v for v in data], dtype=np.float64)
