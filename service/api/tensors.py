"""Tensors on the wire <-> NumPy arrays, on the HTTP side (no engine here).

Three encodings of the same tensor `{"dtype", "shape", ...}`:

- "data": a JSON list, flat (row-major) or nested to match the shape. Non-finite values
  are the strings "NaN", "Infinity" and "-Infinity" (JSON has no literal for them).
- "base64": the little-endian, row-major bytes in base64.
- "binary": the same bytes raw, inside a msgpack body (`Content-Type: application/msgpack`).

A bare JSON number or nested list is a float32 tensor.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from service.api.schemas.tensors import BASE64_PATTERN as BASE64_TEXT
from service.core.wire import (
    MAX_NESTING,
    Encoding,
    TensorError,
    dtype_name,
    expected_size,
    from_bytes,
    little_endian,
)

BASE64_PATTERN = re.compile(BASE64_TEXT)
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# ----------------------------------------------------------------------------------------
# Wire -> array
# ----------------------------------------------------------------------------------------


# The largest finite value of each float dtype, and the largest whole number a double
# holds exactly: the bounds of from_data's short way for a bare number.
_FLOAT_MAX = {name: float(np.finfo(name).max) for name in ("float16", "float32", "float64")}
_EXACT_INT = {name: min(top, 2**53) for name, top in _FLOAT_MAX.items()}


def from_data(data: Any, dtype: str, shape: Sequence[int] | None) -> np.ndarray:
    """A JSON number or (nested) list -> array of `dtype`; `shape` None takes the nesting."""
    kind = type(data)
    if shape is None and (kind is float or kind is int) and dtype in _FLOAT_MAX:
        # A bare number of a float tensor, finite in it: the array the long way below makes
        # (a double rounded once to the dtype), without its checks (~5 us a scalar).
        if abs(data) <= (_FLOAT_MAX[dtype] if kind is float else _EXACT_INT[dtype]):
            return np.array(data, dtype=dtype)
    target = np.dtype(dtype)
    try:
        raw = np.asarray(data)
    except ValueError as exc:  # ragged nesting
        raise TensorError(f"data is not a regular (nested) list of numbers: {exc}") from None
    if raw.ndim > MAX_NESTING:  # as the document states it (its NestedNumbers levels)
        raise TensorError(
            f"data is nested {raw.ndim} lists deep; at most {MAX_NESTING} are allowed "
            "(send the elements flat, with the shape)"
        )
    if raw.dtype.kind == "U":
        raw = _from_strings(data, target)
    elif raw.dtype.kind not in "biuf":
        raise TensorError("data must hold only numbers (or true/false for bool) in range")
    array = _cast(raw, target)
    if shape is None:
        return array
    shape = tuple(shape)
    expected_size(shape)  # a shape NumPy can make, before it is compared or used
    if array.shape != shape:
        if array.ndim > 1 or array.size != expected_size(shape):
            raise TensorError(
                f"data has {array.size} element(s) in shape {list(array.shape)}, "
                f"which does not fit shape {list(shape)} ({expected_size(shape)} element(s))"
            )
        array = array.reshape(shape)
    return array


def _from_strings(data: Any, target: np.dtype) -> np.ndarray:
    """A list mixing numbers (or true/false) with "NaN"/"Infinity"/"-Infinity", which
    NumPy made all text: read from the list itself, where True is 1 (not the text
    'True') and only those three strings stand for numbers ("1.5" and "nan" are
    refused, as the schema's enum says)."""
    if target.kind != "f":
        raise TensorError(f"data for a {target} tensor must hold only numbers")

    def numbers(value: Any) -> Any:
        if isinstance(value, list):
            return [numbers(v) for v in value]
        if isinstance(value, str):
            if value not in NONFINITE:
                raise TensorError(
                    f"data holds the string {value!r}; only numbers, and the strings 'NaN', "
                    "'Infinity' and '-Infinity' for non-finite values, are allowed"
                )
            return NONFINITE[value]
        return value

    listed = numbers(data)  # a TensorError (a ValueError) names the string
    try:
        return np.asarray(listed, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise TensorError("data must hold only numbers (or true/false for bool) in range") from None


def _cast(raw: np.ndarray, target: np.dtype) -> np.ndarray:
    if target.kind == "f" or raw.dtype == target:
        with np.errstate(over="ignore"):  # 1e39 as float32 is inf: the finite check says so
            return raw.astype(target, copy=False)
    if target.kind == "b":
        if raw.dtype.kind != "b" and not np.isin(raw, (0, 1)).all():
            raise TensorError("data for a bool tensor must hold true/false (or 0/1)")
        return raw.astype(target)
    if raw.dtype.kind == "f" and not (np.isfinite(raw).all() and (raw == np.round(raw)).all()):
        raise TensorError(f"data for a {target} tensor must hold whole numbers")
    info = np.iinfo(target)
    # As Python ints: NumPy would convert uint64's bound to a C long and overflow.
    if raw.size and (int(raw.min()) < info.min or int(raw.max()) > info.max):
        raise TensorError(f"data holds values outside the range of {target}")
    return raw.astype(target)


def from_base64(text: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    # The schema's pattern, exactly (b64decode alone takes excess padding: "AAAA==").
    if BASE64_PATTERN.fullmatch(text) is None:
        raise TensorError(
            "base64 is not valid base64: only A-Z, a-z, 0-9, '+', '/', in groups of 4 with "
            "'=' padding the last"
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TensorError(f"base64 is not valid base64: {exc}") from None
    return from_bytes(raw, dtype, shape)


def nonfinite_count(array: np.ndarray) -> int:
    if array.dtype.kind != "f":
        return 0
    if array.ndim == 0 and array.itemsize <= 8:  # a scalar: exact as a Python float
        return 0 if math.isfinite(array) else 1
    return int(array.size - np.count_nonzero(np.isfinite(array)))


# ----------------------------------------------------------------------------------------
# Array -> wire
# ----------------------------------------------------------------------------------------


def to_wire(array: np.ndarray, encoding: Encoding) -> dict[str, Any]:
    """The wire form of an array. For "data" the list is flat and may be a NumPy array
    (the JSON encoder writes it); for "binary" the bytes are a memoryview."""
    array = np.asarray(array)
    out: dict[str, Any] = {"dtype": dtype_name(array), "shape": list(array.shape)}
    flat = np.ascontiguousarray(array.reshape(-1))
    if encoding is Encoding.DATA:
        out["data"] = flat if nonfinite_count(flat) == 0 else _with_nonfinite_strings(flat)
    else:
        raw = flat.astype(little_endian(array.dtype.str), copy=False)
        if encoding is Encoding.BASE64:
            out["base64"] = base64.b64encode(raw.tobytes()).decode("ascii")
        else:
            out["data"] = raw.view(np.uint8).data
    return out


def _with_nonfinite_strings(flat: np.ndarray) -> list[Any]:
    values: list[Any] = flat.astype(np.float64).tolist()
    for i, v in enumerate(values):
        if not math.isfinite(v):
            values[i] = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return values
