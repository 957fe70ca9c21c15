"""Tensors on the wire: dtypes, the data / base64 / binary forms, shapes, names."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    StringConstraints,
    Tag,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from service.core.defaults import INT_MAX  # noqa: F401 (re-exported: the schemas bound integers by it)
from service.core.wire import DTYPES

DType = StrEnum("DType", {name: name for name in DTYPES})  # type: ignore[misc]
DType.__doc__ = "Element type of a tensor."
# What a stored model or dataset may be called (a path segment, never an id's shape).
STORED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
# Named, so that generated clients get one FloatDType enum (not a `...DtypeType0`).
FloatDType = TypeAliasType("FloatDType", Literal["float16", "float32", "float64"])


class TensorEncoding(StrEnum):
    """How a JSON answer writes its tensors: `data` lists or `base64` bytes."""

    data = "data"
    base64 = "base64"


class Unconnected(StrEnum):
    """What a source the target does not depend on gets: `null`, or zeros."""

    none = "none"
    zero = "zero"


_DATA_SCHEMA = {
    "type": "array",
    "description": "Elements in row-major order, flat or nested to match the shape. "
    "Non-finite values are the strings 'NaN', 'Infinity', '-Infinity' (accepted only "
    "with allow_nonfinite). In a msgpack body: the raw little-endian bytes instead.",
    "items": {
        "anyOf": [
            {"type": "number"},
            {"type": "boolean"},
            {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]},
            {"type": "array", "items": {}},
        ]
    },
}

Shape = Annotated[
    list[Annotated[StrictInt, Field(ge=0)]],
    Field(max_length=32, description="Dimensions; [] for a scalar."),
]


def _list_or_bytes(value: Any) -> Any:
    if not isinstance(value, list | bytes):
        raise PydanticCustomError(
            "tensor_data", "data must be a (nested) list of numbers, or bytes in a msgpack body"
        )
    return value


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorData(StrictModel):
    """A tensor with its elements listed: `{"dtype": "float32", "shape": [2], "data": [1, 2]}`."""

    dtype: DType = Field(DType["float32"], description="Element type.")
    shape: Shape | None = Field(
        None, description="Dimensions; when absent, taken from the nesting of data."
    )
    data: Annotated[Any, AfterValidator(_list_or_bytes), WithJsonSchema(_DATA_SCHEMA)]


class TensorBase64(StrictModel):
    """A tensor as base64 of its little-endian, row-major bytes."""

    dtype: DType = Field(DType["float32"], description="Element type.")
    shape: Shape
    base64: str = Field(description="base64 (RFC 4648, with padding) of the bytes.")


def _tensor_form(value: Any) -> str | None:
    """Which form a tensor takes, so that an error speaks of that form only."""
    if isinstance(value, dict):
        return "TensorBase64" if "base64" in value else "TensorData"
    if isinstance(value, list):
        return "list"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "number"
    return None


TensorValue = TypeAliasType(
    "TensorValue",
    Annotated[
        Annotated[TensorData, Tag("TensorData")]
        | Annotated[TensorBase64, Tag("TensorBase64")]
        | Annotated[float, Tag("number")]
        | Annotated[list[Any], Tag("list")],
        Discriminator(
            _tensor_form,
            custom_error_type="tensor",
            custom_error_message="a tensor is {dtype, shape, data}, {dtype, shape, base64}, "
            "a number or a nested list of numbers",
        ),
        Field(
            description="A tensor: {dtype, shape, data}, {dtype, shape, base64}, or a bare "
            "number or nested list of numbers (float32)."
        ),
    ],
)

Tensor = TypeAliasType("Tensor", TensorData | TensorBase64)

# A name a client chooses (variable, input, function, target, source, alias, vector key):
# bounded so that no name is carried, stored or echoed at length. The language refuses
# program names past its own (smaller) limit with a located problem.
MAX_NAME_CHARS = 256
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
