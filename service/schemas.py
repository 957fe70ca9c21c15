"""Request and response models of the HTTP API (and nothing else).

Models are named by role (`GradientRequest` / `GradientResponse`) and forbid unknown
fields. They check structure only; tensor contents (element counts, dtypes, finiteness)
are checked by `service.api.payloads` when a request is turned into a worker payload,
with the same field paths in the errors.

A msgpack body (`Content-Type: application/msgpack`) holds the same structure; a
tensor's `data` may then be raw little-endian bytes (see service/TRANSPORT.md).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from service.tensors import DTYPES

# ----------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------

DType = StrEnum("DType", {name: name for name in DTYPES})  # type: ignore[misc]
DType.__doc__ = "Element type of a tensor."


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorData(_Strict):
    """A tensor with its elements listed: `{"dtype": "float32", "shape": [2], "data": [1, 2]}`."""

    dtype: DType = Field(DType["float32"], description="Element type.")
    shape: Shape | None = Field(
        None, description="Dimensions; when absent, taken from the nesting of data."
    )
    data: Annotated[Any, AfterValidator(_list_or_bytes), WithJsonSchema(_DATA_SCHEMA)]


class TensorBase64(_Strict):
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

# ----------------------------------------------------------------------------------------
# Definitions
# ----------------------------------------------------------------------------------------


class VariableSpec(_Strict):
    """A parameter of the definition."""

    value: TensorValue
    trainable: StrictBool = Field(
        True, description="Trainable variables are the default sources of a derivative."
    )


class FunctionSpec(_Strict):
    """A user function with a custom gradient (the analogue of tf.custom_gradient)."""

    params: list[str] = Field(description="Parameter names.")
    forward: list[str] = Field(description="Program lines computing the value from params.")
    backward: list[str] = Field(
        description="Program lines that see params, forward names and `upstream` and "
        "assign `grad_<param>` for each floating-point param."
    )
    output: str | None = Field(
        None, description="The forward name that is the value (default: the last assigned)."
    )


def _variable_form(value: Any) -> str:
    return "VariableSpec" if isinstance(value, dict) and "value" in value else "TensorValue"


Variable = TypeAliasType(
    "Variable",
    Annotated[
        Annotated[VariableSpec, Tag("VariableSpec")] | Annotated[TensorValue, Tag("TensorValue")],
        Discriminator(_variable_form),
        Field(description="{value, trainable}, or a bare tensor (a trainable variable)."),
    ],
)


class Definition(_Strict):
    """A model/loss: variables, inputs and program lines (`name = expression`)."""

    program: list[str] | str = Field(
        description="Lines of the program, one assignment each (a string is split at "
        "line breaks).",
        examples=[["h = relu(x @ w1 + b1)", "loss = mean((h @ w2 - y) ** 2)"]],
    )
    variables: dict[str, Variable] = Field(default_factory=dict)
    inputs: dict[str, TensorValue] = Field(
        default_factory=dict, description="Data: never a default source."
    )
    functions: dict[str, FunctionSpec] = Field(default_factory=dict)


Sources = TypeAliasType(
    "Sources",
    Annotated[
        str | list[str] | dict[str, str],
        Field(
            description="What to differentiate with respect to: a name, a list of names "
            "(answers keyed by name) or a mapping alias -> name (answers keyed by alias). "
            "Absent: every trainable variable."
        ),
    ],
)

# ----------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------

GRADIENT_EXAMPLE: dict[str, Any] = {
    "definition": {
        "variables": {
            "w1": {"value": 2.0},
            "w2": {"value": {"dtype": "float32", "shape": [], "data": [3.0]}, "trainable": True},
        },
        "inputs": {"x1": 5.0, "x2": 7.0},
        "program": ["s = w1 * x1 + w2 * x2"],
    },
    "target": "s",
    "sources": ["w1", "w2"],
}


class RequestModel(_Strict):
    """Base of request bodies: a msgpack body arrives as bytes and is unpacked here, so
    both encodings go through the same validation."""

    @model_validator(mode="before")
    @classmethod
    def _unpack_msgpack(cls, data: Any) -> Any:
        if isinstance(data, bytes | bytearray):
            try:
                return msgpack.unpackb(data, raw=False, strict_map_key=True)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                raise PydanticCustomError(
                    "msgpack_invalid", "the body is not valid msgpack: {reason}",
                    {"reason": str(exc) or type(exc).__name__},
                ) from None
        return data


class ComputeRequest(RequestModel):
    definition: Definition
    target: str = Field(description="The name (a program line, variable or input) to differentiate.")
    sources: Sources | None = None
    allow_unused: StrictBool = Field(
        False, description="Accept program lines the target does not use (they are skipped); "
        "by default such a line is reported as a likely mistake."
    )
    time_limit: StrictFloat | None = Field(
        None, ge=0.1, description="Compute seconds for this request, at least 0.1 (default "
        "and maximum: server settings). Past it the answer is 504 and the worker is replaced."
    )
    allow_nonfinite: StrictBool | None = Field(
        None, description="Accept NaN and infinite values in the inputs (default: server setting)."
    )
    response_encoding: TensorEncoding | None = Field(
        None, description="Tensor encoding of a JSON answer; default: base64 when the "
        "request used base64 or binary tensors, else data lists."
    )


UNCONNECTED_FIELD = Field(
    Unconnected.none,
    description="For a source the target does not depend on: null (none) or zeros (zero).",
)


class GradientRequest(ComputeRequest):
    """The target's value and its gradients with respect to the sources (a non-scalar
    target is differentiated as its sum)."""

    model_config = ConfigDict(json_schema_extra={"examples": [GRADIENT_EXAMPLE]})

    unconnected: Unconnected = UNCONNECTED_FIELD


class JacobianRequest(ComputeRequest):
    """The jacobian of a (tensor) target with respect to each source."""

    unconnected: Unconnected = UNCONNECTED_FIELD

    batch: StrictBool = Field(
        False, description="Per-example jacobians: target and source share their first "
        "(batch) axis and example b of the target depends only on example b of the source; "
        "the answer has shape target.shape + source.shape[1:]. Refused (422) when the "
        "examples are not independent."
    )


class NewtonOptions(_Strict):
    """Ask for the damped Newton step (H + damping * I)^-1 g over the sources."""

    damping: StrictFloat = Field(1e-3, ge=0, description="Added to the Hessian's diagonal.")


class HessianRequest(ComputeRequest):
    """The Hessian of a scalar target over the sources (refused above the server's size).
    Gradients and blocks of unconnected sources are zeros."""

    newton: NewtonOptions | None = Field(
        None, description="Also answer the damped Newton step (subtract it from the sources)."
    )


class HVPRequest(ComputeRequest):
    """Hessian-vector products of a scalar target: give `vector` or `vectors`. Gradients
    and products of unconnected sources are zeros."""

    vector: dict[str, TensorValue] | None = Field(
        None, description="One vector: a tensor per source (keyed like the gradients)."
    )
    vectors: list[dict[str, TensorValue]] | None = Field(
        None, description="Several vectors, answered together in one batched pass."
    )

    @model_validator(mode="after")
    def _one_of(self) -> HVPRequest:
        if (self.vector is None) == (self.vectors is None):
            raise ValueError("give exactly one of 'vector' (one) or 'vectors' (a list)")
        if self.vectors is not None and not self.vectors:
            raise ValueError("'vectors' is empty")
        return self


# ----------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------


class GradientResponse(BaseModel):
    """The target's value and one gradient per source (null when unconnected)."""

    value: Tensor
    gradients: dict[str, Tensor | None]


class JacobianResponse(BaseModel):
    """The target's value and one jacobian per source (shape target.shape + source.shape,
    or target.shape + source.shape[1:] for a batch jacobian; null when unconnected)."""

    value: Tensor
    jacobians: dict[str, Tensor | None]


class HessianResponse(BaseModel):
    """Value, gradients, and the Hessian as blocks: hessian[a][b] has shape
    a.shape + b.shape."""

    value: Tensor
    gradients: dict[str, Tensor | None]
    hessian: dict[str, dict[str, Tensor]]
    newton_step: dict[str, Tensor] | None = Field(
        None, description="(H + damping I)^-1 g per source, when asked."
    )


class HVPResponse(BaseModel):
    """Value, gradients and H @ v per vector (`hvp` for `vector`, `hvps` for `vectors`)."""

    value: Tensor
    gradients: dict[str, Tensor | None]
    hvp: dict[str, Tensor] | None = None
    hvps: list[dict[str, Tensor]] | None = None


class OpParam(BaseModel):
    name: str
    kind: str = Field(description="tensor, tensors (a list of them) or constant")
    type: str
    required: bool
    variadic: bool
    default: Any = None


class OpInfo(BaseModel):
    """One op a program can call."""

    name: str
    family: str
    signature: str
    doc: str
    operator: str | None = Field(None, description="The operator spelling, e.g. 'a + b'.")
    params: list[OpParam]


class OpCatalogue(BaseModel):
    """Every op and built-in a program can call."""

    ops: list[OpInfo]


class HealthResponse(BaseModel):
    status: str = Field(examples=["ok"])


class WorkerStatus(BaseModel):
    """One engine worker process."""

    index: int
    pid: int | None
    device: str
    state: str = Field(description="starting, idle, busy or down")
    generation: int = Field(description="How many times this worker has been (re)started.")
    restarts: int


class ReadinessResponse(BaseModel):
    status: str = Field(examples=["ready"])
    workers: list[WorkerStatus]


class ProblemItem(BaseModel):
    """One located error: a request field, or a line/column of the program."""

    message: str
    field: str | None = Field(None, description="Dotted path of the request field.")
    kind: str | None = Field(None, description="syntax, name, op, shape, dtype, limit, ...")
    section: str | None = Field(None, description="program, functions.<name>.forward, ...")
    line: int | None = None
    column: int | None = None
    op: str | None = None
    shapes: list[list[int]] | None = None


class Problem(BaseModel):
    """An error, as application/problem+json (RFC 9457)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field("about:blank", description="URI reference naming the kind of problem.")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[ProblemItem] | None = None
