"""Arrays as bytes, the one codec of the service: the HTTP bodies (base64 and msgpack
tensors, service/api/tensors.py), the worker protocol (service/core/ipc.py) and the store
(service/core/store.py) all write an array as its dtype name, its shape and its raw
little-endian, row-major bytes, and read it back here, checked.

DTYPES is the wire's dtype vocabulary. It equals the definition language's
(engine.language.definition.ALLOWED_DTYPES; tests/test_architecture.py pins the
two together): the HTTP process must not import the engine, so it cannot ask it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import numpy as np

DTYPES: tuple[str, ...] = (
    "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
)  # fmt: skip


class Encoding(StrEnum):
    """How tensors travel in a body: a JSON list, base64 bytes, or raw msgpack bytes."""

    DATA = "data"
    BASE64 = "base64"
    BINARY = "binary"


class TensorError(ValueError):
    """Bytes, a shape or a dtype that do not describe an array (the message says how)."""


_LITTLE_ENDIAN: dict[str | np.dtype, np.dtype] = {}


def little_endian(dtype: str | np.dtype) -> np.dtype:
    found = _LITTLE_ENDIAN.get(dtype)
    if found is None:  # ~1 us each time: kept, for the few dtypes there are
        found = _LITTLE_ENDIAN[dtype] = np.dtype(dtype).newbyteorder("<")
    return found


# NumPy's own bounds on an array's shape: past them it raises ValueError mid-request.
MAX_DIMENSION = 2**31 - 1
MAX_RANK = 32
# ... and on the product of its nonzero dimensions: their bytes, at 8 for the widest dtype
# of DTYPES, must fit NumPy's signed 64-bit index.
MAX_ELEMENTS_OF_ANY_SHAPE = (2**63 - 1) // 8
# How deep a JSON `data` list may nest. The document spells every level out (the client
# generators cannot follow a recursive array schema), so the levels are bounded; a tensor
# of more dimensions sends its data flat beside its shape.
MAX_NESTING = 8


def expected_size(shape: Sequence[int]) -> int:
    """Elements of `shape`, once it is known to be a shape NumPy can make."""
    if len(shape) > MAX_RANK:
        raise TensorError(f"shape has {len(shape)} dimensions; at most {MAX_RANK} are allowed")
    for d in shape:
        if not 0 <= d <= MAX_DIMENSION:
            raise TensorError(
                f"shape {short_shape(shape)} has a dimension of {d}; each must be within "
                f"0..{MAX_DIMENSION}"
            )
    # NumPy refuses a shape whose nonzero dimensions multiply past what its byte counts
    # hold, even when a 0 among them makes the array empty: bounded for the widest dtype.
    if math.prod(d for d in shape if d) > MAX_ELEMENTS_OF_ANY_SHAPE:
        raise TensorError(
            f"shape {short_shape(shape)} multiplies out past {MAX_ELEMENTS_OF_ANY_SHAPE:,} "
            "elements (its nonzero dimensions alone: NumPy makes no such array, even empty)"
        )
    return math.prod(shape)


def short_shape(shape: Sequence[int]) -> str:
    """A shape for a message, never longer than a line whatever the client sent."""
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "...]"


def from_bytes(raw: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Little-endian row-major bytes -> array (zero-copy where the bytes allow: a view of
    `raw`, read-only when `raw` is)."""
    if dtype not in DTYPES:
        raise TensorError(f"dtype {dtype!r} is none of {', '.join(DTYPES)}")
    dt = little_endian(dtype)
    count = expected_size(shape)
    if len(raw) != count * dt.itemsize:
        raise TensorError(
            f"{len(raw)} byte(s) do not hold shape {list(shape)} of {dtype} "
            f"({count} x {dt.itemsize} = {count * dt.itemsize} bytes)"
        )
    array = np.frombuffer(raw, dtype=dt).reshape(tuple(shape))
    if dtype == "bool" and array.size and array.view(np.uint8).max() > 1:
        raise TensorError("bool bytes must be 0 or 1")
    native = _NATIVE.get(dt)
    if native is None:  # (newbyteorder makes a new dtype, ~1 us: kept)
        native = _NATIVE[dt] = dt.newbyteorder("=")
    return array if native == dt else array.astype(native, copy=False)


_NATIVE: dict[np.dtype, np.dtype] = {}


# NumPy's dtype.name is a Python property that costs ~2.5 us, paid for every array of
# every request (and twice on the way to a worker and back): looked up here instead.
_NATIVE_NAMES = {np.dtype(name): name for name in DTYPES}


def dtype_name(array: np.ndarray) -> str:
    name = _NATIVE_NAMES.get(array.dtype)
    if name is not None:
        return name
    name = array.dtype.name
    if name not in DTYPES:
        raise TensorError(f"cannot send a tensor of dtype {name}")
    return name


def raw_view(array: Any) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, its little-endian row-major bytes): what from_bytes reads back,
    as a view of the array's own memory where it already is that (no copy)."""
    array = np.asarray(array)
    name = dtype_name(array)
    raw = np.ascontiguousarray(array.astype(little_endian(array.dtype), copy=False))
    return name, list(array.shape), raw.reshape(-1).view(np.uint8).data


def to_bytes(array: Any) -> tuple[str, list[int], bytes]:
    """raw_view's bytes as an immutable copy (what a store keeps)."""
    name, shape, raw = raw_view(array)
    return name, shape, bytes(raw)


def array_bytes(tree: Any) -> int:
    """The bytes of the arrays in a message (dicts, lists): what a hop moves, give or take
    its msgpack envelope."""
    if isinstance(tree, dict):
        return sum(array_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(array_bytes(v) for v in tree)
    nbytes = getattr(tree, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0
