"""Tensors and bodies on the wire <-> NumPy arrays and Python values (no I/O here).

Requests: every NumPy array (or NumPy scalar) anywhere in a body becomes a tensor
`{"dtype", "shape", ...}` of its own dtype, never cast: raw little-endian bytes in a
msgpack body, base64 of the same bytes in a JSON body. Plain Python numbers and lists pass
through untouched, so they mean what the API says they mean (float32).

Answers: every tensor in an answer (`data` as a list, as raw bytes, or `base64`) becomes a
writable NumPy array of its dtype and shape.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

# The dtypes the API knows (the contract's DType enum).
DTYPES = frozenset({
    "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
})  # fmt: skip
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

JSON = "application/json"
MSGPACK = "application/msgpack"


def _tensor(array: np.ndarray, binary: bool) -> dict[str, Any]:
    name = array.dtype.name
    if name not in DTYPES:
        raise TypeError(
            f"gradtape cannot send a tensor of dtype {name}; use one of {sorted(DTYPES)}"
        )
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    out: dict[str, Any] = {"dtype": name, "shape": list(array.shape)}
    if binary:
        out["data"] = raw
    else:
        out["base64"] = base64.b64encode(raw).decode("ascii")
    return out


def to_wire(value: Any, binary: bool) -> Any:
    """`value` with every NumPy array (and NumPy scalar) replaced by its wire tensor."""
    if isinstance(value, np.ndarray | np.generic):
        return _tensor(np.asarray(value), binary)
    if isinstance(value, bytes | bytearray | memoryview) and not binary:
        # Bytes (an ONNX file in a definition's `models`) are base64 in JSON, as the
        # API takes them; msgpack carries them as they are.
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {k: to_wire(v, binary) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v, binary) for v in value]
    return value


def is_tensor(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and "dtype" in value
        and "shape" in value
        and ("data" in value or "base64" in value)
    )


def from_tensor(tensor: Mapping[str, Any]) -> np.ndarray:
    """A wire tensor -> a writable array of its dtype (native byte order) and shape."""
    dtype = np.dtype(tensor["dtype"])
    shape = tuple(tensor["shape"])
    if "base64" in tensor:
        raw: Any = base64.b64decode(tensor["base64"])
    else:
        raw = tensor["data"]
    if isinstance(raw, bytes | bytearray | memoryview):
        array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)
        return array.astype(dtype.newbyteorder("="), copy=True)
    data = np.asarray(raw, dtype=object if dtype.kind == "f" else None)
    if dtype.kind == "f" and data.size:
        data = np.vectorize(
            lambda v: NONFINITE.get(v, v) if isinstance(v, str) else v, otypes=[np.float64]
        )(data)
    return np.asarray(data, dtype=dtype).reshape(shape)


def from_wire(value: Any) -> Any:
    """An answer with every tensor in it replaced by a NumPy array."""
    if isinstance(value, dict):
        if is_tensor(value):
            return from_tensor(value)
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


def encode_body(body: Any, binary: bool) -> tuple[bytes, str]:
    """The request body's bytes and content type."""
    wire = to_wire(body, binary)
    if binary:
        return msgpack.packb(wire, use_bin_type=True), MSGPACK
    return json.dumps(wire, separators=(",", ":")).encode(), JSON


def decode_body(content: bytes, content_type: str) -> Any:
    """An answer's document (tensors still on the wire) by its content type."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == MSGPACK:
        return msgpack.unpackb(content, raw=False)
    if not content:
        return None
    return json.loads(content)
