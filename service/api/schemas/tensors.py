"""Tensors on the wire: dtypes, the data / base64 / binary forms, shapes, names."""

from __future__ import annotations

import functools
import typing
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    StrictInt,
    StringConstraints,
    Tag,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError
from typing_extensions import TypeAliasType

from service.core.defaults import INT_MAX  # the schemas bound integers by it (re-exported too)
from service.core.wire import DTYPES, MAX_DIMENSION, MAX_NESTING

DType = StrEnum("DType", {name: name for name in DTYPES})  # type: ignore[misc]
DType.__doc__ = "Element type of a tensor."
# What a stored model or dataset may be called (a path segment, never an id's shape).
STORED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
# RFC 4648 base64 with its padding, as the decoder (b64decode, validate=True) reads it:
# stated in the schema so that a generated string the decoder refuses is not "valid".
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
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


# Elements, flat or nested: numbers, true/false, or the non-finite strings. Components of
# the document (service/api/openapi.py adds them): one per level of nesting, each level's
# lists holding numbers or the next level's, down to MAX_NESTING (the Python client's
# generator cannot follow an array schema that refers to itself). That the nesting is
# regular (every row as long) is what JSON Schema cannot say: a ragged list stays a 422
# the schema allows (tests/service/test_schemathesis.py's exclusions).
def _level_name(level: int) -> str:
    return "NestedNumbers" if level == 1 else f"NestedNumbersLevel{level}"


def _nested_numbers_components() -> dict[str, dict[str, Any]]:
    components: dict[str, dict[str, Any]] = {
        "NonFiniteNumber": {
            "type": "string",
            "enum": ["NaN", "Infinity", "-Infinity"],
            "title": "NonFiniteNumber",
            "description": "A non-finite value in a data list (JSON has no literal for it).",
        }
    }
    for level in range(1, MAX_NESTING + 1):
        elements: list[dict[str, Any]] = [
            {"type": "number"},
            {"type": "boolean"},
            {"$ref": "#/components/schemas/NonFiniteNumber"},
        ]
        if level < MAX_NESTING:
            elements.append({"$ref": f"#/components/schemas/{_level_name(level + 1)}"})
        components[_level_name(level)] = {
            "type": "array",
            "title": _level_name(level),
            "description": f"Numbers (true/false count as 1/0) in a list, or lists of such "
            f"lists, nested at most {MAX_NESTING - level + 1} deep; non-finite values are "
            "the strings 'NaN', 'Infinity', '-Infinity'."
            if level == 1
            else f"Level {level} of a NestedNumbers list.",
            "items": {"anyOf": elements},
        }
    return components


NESTED_NUMBERS_COMPONENTS = _nested_numbers_components()
_NESTED_NUMBERS_REF = {"$ref": "#/components/schemas/NestedNumbers"}

_DATA_SCHEMA = {
    "allOf": [_NESTED_NUMBERS_REF],
    "description": "Elements in row-major order, flat or nested to match the shape "
    f"(at most {MAX_NESTING} levels deep). "
    "Non-finite values are the strings 'NaN', 'Infinity', '-Infinity' (accepted only "
    "with allow_nonfinite). In a msgpack body: the raw little-endian bytes instead.",
}


def whole_float(value: Any) -> Any:
    """JSON Schema's "integer" includes 3.0 (a number with no fraction): a dimension
    written so is 3 (issue 25); 3.5, "3" and true stay refused."""
    return int(value) if type(value) is float and value.is_integer() else value


# An index or dimension in a list (a model's own integer fields take whole floats by
# StrictModel's validator; list items, by this one).
Index = Annotated[StrictInt, Field(ge=0, le=INT_MAX), BeforeValidator(whole_float)]

# NumPy's bound on a dimension (service.core.wire checks it again, for every encoding).
Dimension = Annotated[StrictInt, Field(ge=0, le=MAX_DIMENSION), BeforeValidator(whole_float)]

Shape = Annotated[
    list[Dimension],
    Field(max_length=32, description="Dimensions; [] for a scalar."),
]


def _list_or_bytes(value: Any) -> Any:
    if not isinstance(value, list | bytes):
        raise PydanticCustomError(
            "tensor_data", "data must be a (nested) list of numbers, or bytes in a msgpack body"
        )
    return value


SchemaRules = tuple[dict[str, Any], ...]  # JSON Schema objects a model's body also meets


class StrictModel(BaseModel):
    """A body object: unknown keys are refused. A class whose model validator ties fields
    together ("exactly one of ...") states the same rule in JSON Schema in its
    `SCHEMA_RULES`, beside that validator: the document then allows what the validator
    accepts, and no more (issue 25). Every class's rules along the MRO apply (allOf)."""

    model_config = ConfigDict(extra="forbid")
    SCHEMA_RULES: ClassVar[SchemaRules] = ()

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema's "integer" includes 703.0 (a number with no fraction): a model's
        integer fields accept it as 703, so that the schema and the validator agree
        (issue 25). Strict otherwise: 703.5, "703" and true stay refused. (A request's
        msgpack body is unpacked before this runs: RequestModel's validator comes first.)"""
        if not isinstance(data, dict):
            return data
        ints = _integer_fields(cls)
        if not ints.intersection(data):
            return data
        return {
            k: int(v) if k in ints and type(v) is float and v.is_integer() else v
            for k, v in data.items()
        }

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        rules = [r for k in reversed(cls.__mro__) for r in vars(k).get("SCHEMA_RULES", ())]
        if rules:
            target = handler.resolve_ref_schema(schema)
            target["allOf"] = [*target.get("allOf", []), *rules]
        return schema


@functools.cache
def _integer_fields(model: type[StrictModel]) -> frozenset[str]:
    """The body keys (aliases) of the model's integer fields (int, or int | None)."""
    keys = set()
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        args = tuple(
            typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args
        )
        if int in args and bool not in args:
            keys.add(field.alias or name)
    return frozenset(keys)


def given(name: str) -> dict[str, Any]:
    """JSON Schema for "the field `name` is present and not null" (a validator reads a
    null option as absent)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def exactly_one_of(*names: str) -> dict[str, Any]:
    """JSON Schema for "exactly one of these fields is given (present, not null)"."""
    return {"oneOf": [given(name) for name in names]}


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
    # The pattern is checked with the decoding (service/api/tensors.py), whose error
    # names the tensor.
    base64: str = Field(
        description="base64 (RFC 4648, with padding) of the bytes.",
        json_schema_extra={"pattern": BASE64_PATTERN},
    )


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
        | Annotated[list[Any], Tag("list"), WithJsonSchema(_NESTED_NUMBERS_REF)],
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
