"""Request and response models of the HTTP API (and nothing else).

Models are named by role (`GradientRequest` / `GradientResponse`) and forbid unknown
fields. They check structure only; tensor contents (element counts, dtypes, finiteness)
are checked by `service.api.payloads` when a request is turned into a worker payload,
with the same field paths in the errors.

A msgpack body (`Content-Type: application/msgpack`) holds the same structure; a
tensor's `data` may then be raw little-endian bytes (see service/TRANSPORT.md).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictBytes,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    Tag,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from service.core import defaults
from service.core.wire import DTYPES

# ----------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------

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

# A name a client chooses (variable, input, function, target, source, alias, vector key):
# bounded so that no name is carried, stored or echoed at length. The language refuses
# program names past its own (smaller) limit with a located problem.
MAX_NAME_CHARS = 256
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]

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
    """A user function. Without `backward` it is a plain function, differentiated through
    (to any order); its body may call other functions (never itself) and use the variables
    it owns (`"<function>.<name>"` in `variables`, `<name>` in its body). With `backward`
    it has a custom gradient (the analogue of tf.custom_gradient)."""

    params: list[str] = Field(description="Parameter names.")
    forward: list[str] = Field(description="Program lines computing the value from params.")
    backward: list[str] | None = Field(
        None,
        description="Optional: program lines that see params, forward names and `upstream` "
        "and assign `grad_<param>` for each floating-point param (a custom gradient).",
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


class ImportedModel(_Strict):
    """An ONNX model (torch.onnx.export, tf2onnx, jax2onnx, skl2onnx) the program calls
    as a function: `logits = net(x)`. Its floating-point initializers become variables
    named by their ONNX names, trainable unless listed in `frozen`."""

    onnx: StrictBytes | StrictStr | None = Field(
        None,
        description="The .onnx file: bytes in a msgpack body, base64 in JSON. Give "
        "this or `stored`.",
    )
    stored: str | None = Field(
        None,
        pattern=STORED_NAME_PATTERN,
        description="The name of an ONNX model stored with PUT /v1/models/{name} "
        "(Content-Type: application/onnx).",
    )
    frozen: list[Name] = Field(
        default_factory=list,
        description="Initializers that are not trainable (batch-norm statistics, "
        "embeddings you keep fixed): never default sources.",
    )

    @model_validator(mode="after")
    def _onnx_or_stored(self) -> ImportedModel:
        if (self.onnx is None) == (self.stored is None):
            raise ValueError("give exactly one of 'onnx' (the file) or 'stored' (a name)")
        return self


NamedTensors = TypeAliasType(
    "NamedTensors",
    Annotated[dict[Name, TensorValue], Field(description="Tensors by name.")],
)
Variables = TypeAliasType(
    "Variables",
    Annotated[dict[Name, Variable], Field(description="Parameters by name.")],
)
Functions = TypeAliasType(
    "Functions",
    Annotated[dict[Name, FunctionSpec], Field(description="User functions by name.")],
)


Models = TypeAliasType(
    "Models", Annotated[dict[Name, ImportedModel], Field(description="ONNX models by name.")]
)


DatasetName = Annotated[
    str,
    Field(
        pattern=STORED_NAME_PATTERN,
        description="A stored dataset's name: letters, digits, '_', '.', '-' (at most 64, "
        "starting with a letter or digit).",
        examples=["breast_cancer"],
    ),
]


class RowSlice(_Strict):
    """Rows start:stop:step of axis 0 (Python's slice; start and stop within 0..rows)."""

    start: StrictInt | None = Field(None, ge=0)
    stop: StrictInt | None = Field(None, ge=0)
    step: StrictInt | None = Field(None, ge=1)


Rows = TypeAliasType(
    "Rows",
    Annotated[
        list[Annotated[StrictInt, Field(ge=0)]] | RowSlice,
        Field(
            description="A mini-batch: row indices of axis 0, or a slice {start, stop, "
            "step}; a row past the array's end is a 422 naming the bound."
        ),
    ],
)


class DatasetArray(_Strict):
    """An input bound to one array of a stored dataset (PUT /v1/datasets/{name})."""

    dataset: DatasetName
    array: Name = Field(description="The array's name in the dataset.")
    rows: Rows | None = None


class DatasetInputs(_Strict):
    """Every array of a stored dataset, each an input of the same name."""

    dataset: DatasetName
    rows: Rows | None = Field(None, description="The same rows of every array.")


def _input_form(value: Any) -> str:
    return "DatasetArray" if isinstance(value, dict) and "dataset" in value else "TensorValue"


InputValue = TypeAliasType(
    "InputValue",
    Annotated[
        Annotated[DatasetArray, Tag("DatasetArray")] | Annotated[TensorValue, Tag("TensorValue")],
        Discriminator(_input_form),
        Field(
            description="A tensor, or {dataset, array, rows} to bind a stored dataset's "
            "array without sending it."
        ),
    ],
)


InputMap = TypeAliasType(
    "InputMap",
    Annotated[dict[Name, InputValue], Field(description="Input name -> tensor or dataset array.")],
)


def _inputs_form(value: Any) -> str:
    bound = isinstance(value, dict) and isinstance(value.get("dataset"), str)
    return "DatasetInputs" if bound else "map"


Inputs = TypeAliasType(
    "Inputs",
    Annotated[
        Annotated[DatasetInputs, Tag("DatasetInputs")] | Annotated[InputMap, Tag("map")],
        Discriminator(_inputs_form),
        Field(
            description="Data (never a default source): name -> tensor or dataset array; "
            "or {dataset, rows} binding every array of a stored dataset by its name."
        ),
    ],
)


class Definition(_Strict):
    """A model/loss: variables, inputs and program lines (`name = expression`)."""

    program: list[str] | str = Field(
        description="Lines of the program, one assignment each (a string is split at line breaks).",
        examples=[["h = relu(x @ w1 + b1)", "loss = mean((h @ w2 - y) ** 2)"]],
    )
    variables: Variables = Field(
        default_factory=dict,
        description="Parameters by name; `<function>.<name>` is a "
        "variable the function owns (its body calls it `<name>`).",
    )
    inputs: Inputs = Field(default_factory=dict)
    functions: Functions = Field(default_factory=dict)
    models: Models = Field(
        default_factory=dict,
        description="Imported ONNX models, called from the program by these names.",
    )
    dtype: FloatDType | None = Field(
        None,
        description="The dtype of bare numbers and lists in this definition (default "
        "float32); tensors that name their dtype keep it. Mixing dtypes in an op stays an "
        "error (use cast).",
    )


Aliases = TypeAliasType(
    "Aliases",
    Annotated[
        dict[Name, Name],
        Field(description="Alias -> variable or input name: answers are keyed by alias."),
    ],
)

Sources = TypeAliasType(
    "Sources",
    Annotated[
        Name | list[Name] | Aliases,
        Field(
            description="What to differentiate with respect to: a name, a list of names "
            "(answers keyed by name) or a mapping alias -> name (answers keyed by alias). "
            "Absent: every trainable variable."
        ),
    ],
)

# Named maps, so that generated clients read like these docs (no `...Type0` classes).
Vector = TypeAliasType(
    "Vector",
    Annotated[
        dict[Name, TensorValue],
        Field(
            description="A vector in the sources' space: a tensor per source, keyed "
            "like the gradients."
        ),
    ],
)
Tensors = TypeAliasType(
    "Tensors",
    Annotated[
        dict[str, Tensor],
        Field(
            description="A tensor per source (an HVP, a solution, an eigenvector, a "
            "Newton step), keyed like the gradients."
        ),
    ],
)
Gradients = TypeAliasType(
    "Gradients",
    Annotated[
        dict[str, Tensor | None],
        Field(
            description="A tensor per source, keyed by name or alias as `sources` "
            "was given; null for a source the target does not depend on (unless "
            "zeros were asked for)."
        ),
    ],
)
HessianBlocks = TypeAliasType(
    "HessianBlocks",
    Annotated[
        dict[str, Tensors],
        Field(description="hessian[a][b]: the block of sources a and b, shape a.shape + b.shape."),
    ],
)
SourceMap = TypeAliasType(
    "SourceMap",
    Annotated[dict[str, str], Field(description="Answer key (alias) -> variable or input.")],
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


class UnpackedBody(bytes):
    """A msgpack body with its `value`, unpacked (and sized) once, off the event loop, by
    service/api/bodies.py: the request model takes the value instead of unpacking the
    bytes again."""

    value: Any


class RequestModel(_Strict):
    """Base of request bodies: a msgpack body arrives as bytes (over HTTP, unpacked
    already: an UnpackedBody), so both encodings go through the same validation."""

    @model_validator(mode="before")
    @classmethod
    def _unpack_msgpack(cls, data: Any) -> Any:
        if isinstance(data, UnpackedBody):
            return data.value
        if isinstance(data, bytes | bytearray):
            try:
                return msgpack.unpackb(data, raw=False, strict_map_key=True)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                raise PydanticCustomError(
                    "msgpack_invalid",
                    "the body is not valid msgpack: {reason}",
                    {"reason": str(exc) or type(exc).__name__},
                ) from None
        return data


ModelName = Annotated[
    str,
    Field(
        pattern=STORED_NAME_PATTERN,
        description="A stored model's name: letters, digits, '_', '.', '-' (at most 64, "
        "starting with a letter or digit).",
        examples=["mlp"],
    ),
]


def _time_limit_field() -> Any:
    return Field(
        None,
        ge=0.1,
        description="Compute seconds for this request, at least 0.1 (default "
        "and maximum: server settings). Past it the answer is 504 and the worker is replaced.",
    )


def _allow_nonfinite_field() -> Any:
    return Field(
        None, description="Accept NaN and infinite values in the inputs (default: server setting)."
    )


def _response_encoding_field() -> Any:
    return Field(
        None,
        description="Tensor encoding of a JSON answer; default: base64 when the "
        "request used base64 or binary tensors, else data lists.",
    )


def _async_field() -> Any:
    return Field(
        False,
        alias="async",
        description="Run as a job: answer 202 at once with "
        "`Location: /v1/jobs/{job_id}` and follow its progress there (as the header "
        "`Prefer: respond-async` asks).",
    )


class CallOptions(RequestModel):
    """Options every request on a tape takes."""

    time_limit: StrictFloat | None = _time_limit_field()
    allow_nonfinite: StrictBool | None = _allow_nonfinite_field()
    response_encoding: TensorEncoding | None = _response_encoding_field()


class DefinitionRequest(RequestModel):
    """A definition (or a stored model), a target and sources."""

    definition: Definition | None = Field(None, description="The model/loss. Give this or `model`.")
    model: ModelName | None = Field(
        None,
        description="The name of a stored model (POST /v1/models) to use instead of "
        "sending its definition.",
    )
    variables: NamedTensors | None = Field(
        None,
        description="With `model`: new values for some or all of its variables (the "
        "rest keep their stored values). Each keeps its stored shape and dtype: a bare "
        "number or list takes the variable's dtype, and a different shape or dtype is a 422 "
        "naming both.",
    )
    target: Name = Field(
        description="The name (a program line, variable or input) to differentiate."
    )
    sources: Sources | None = None
    time_limit: StrictFloat | None = _time_limit_field()
    allow_nonfinite: StrictBool | None = _allow_nonfinite_field()
    response_encoding: TensorEncoding | None = _response_encoding_field()

    @model_validator(mode="after")
    def _definition_or_model(self) -> DefinitionRequest:
        if (self.definition is None) == (self.model is None):
            raise ValueError("give exactly one of 'definition' or 'model' (a stored model's name)")
        if self.variables is not None and self.model is None:
            raise ValueError(
                "'variables' gives a stored model new values and goes with "
                "'model'; with a definition, set them in definition.variables"
            )
        return self


class ShardReduction(StrEnum):
    """How a sharded batch's parts add up to the loss."""

    mean = "mean"
    sum = "sum"


class ShardOptions(RequestModel):
    """Split the batch over several workers (issue 16): each records its part; answers
    are the parts' answers combined as `shard_reduction` says."""

    shards: StrictInt | None = Field(
        None,
        ge=1,
        description="Split the batch into this many parts, each recorded in "
        "its own worker (distinct workers while there are enough; with Ray, on other "
        "nodes); the loss, gradients, HVPs, curvature products and the tape's algorithms "
        "combine the parts, and equal the unsharded answers up to float rounding. At most "
        "the batch size and the server's max_shards. 1 or absent: not sharded. The parts' "
        "sizes differ by one at most.",
        examples=[2],
    )
    shard_by: list[Name] | Name | None = Field(
        None,
        description="The inputs split along their first axis (the batch), which "
        "must all have the same length; inputs bound to a stored dataset are split by their "
        "rows, so each worker reads only its part from the store. Default: every input "
        "that has an axis (a 422 asks you to name them when their first axes differ).",
        examples=[["x", "y"]],
    )
    shard_reduction: ShardReduction = Field(
        ShardReduction.mean,
        description="How the parts add up. `mean` (default): the "
        "target is a mean over the batch, the parts are weighted by their share n_i / N "
        "(terms that do not depend on the batch, such as a weight penalty, stay exact). "
        "`sum`: the target is a sum over the batch, the parts are added (a term that does "
        "not depend on the batch would count once per part: keep such terms out of a "
        "sum-reduced sharded target).",
    )

    @model_validator(mode="after")
    def _shards_named(self) -> ShardOptions:
        if self.shards is None and (
            self.shard_by is not None or "shard_reduction" in self.model_fields_set
        ):
            raise ValueError("'shard_by' and 'shard_reduction' need 'shards' (how many parts)")
        return self


class ComputeRequest(DefinitionRequest):
    allow_unused: StrictBool = Field(
        False,
        description="Accept program lines the target does not use (they are skipped); "
        "by default such a line is reported as a likely mistake.",
    )
    point: TensorValue | None = Field(
        None,
        description="New values for the sources as one flat vector, in the order "
        "`flat.order` lists (cast to each source's dtype): the point an optimizer asks "
        "about, without naming each variable.",
    )


FLAT_JACOBIAN_DESCRIPTION = (
    "Answer the jacobian as one float64 matrix in `flat.jacobian`: [target size, n], row i "
    "the target's element i (row-major), the columns the sources' elements in the order "
    "`flat.order` lists (SciPy's least_squares `jac`); with `batch`, [B, target size per "
    "example, n per example], the order over the sources' shapes without their batch "
    "axis. `jacobians` is then empty and unconnected sources hold zeros."
)

UNCONNECTED_FIELD = Field(
    Unconnected.none,
    description="For a source the target does not depend on: null (none) or zeros (zero).",
)


class GradientRequest(ComputeRequest, ShardOptions):
    """The target's value and its gradients with respect to the sources (a non-scalar
    target is differentiated as its sum)."""

    model_config = ConfigDict(json_schema_extra={"examples": [GRADIENT_EXAMPLE]})

    unconnected: Unconnected = UNCONNECTED_FIELD
    flat: StrictBool = Field(
        False,
        description="Answer gradients (and products) as one flat float64 vector in "
        "`flat`, in the order `flat.order` lists (the sources); the per-source forms are "
        "then empty. For SciPy's minimize, without unflattening.",
    )


class JacobianRequest(ComputeRequest):
    """The jacobian of a (tensor) target with respect to each source."""

    unconnected: Unconnected = UNCONNECTED_FIELD
    run_async: StrictBool = _async_field()
    flat: StrictBool = Field(False, description=FLAT_JACOBIAN_DESCRIPTION)

    batch: StrictBool = Field(
        False,
        description="Per-example jacobians: target and source share their first "
        "(batch) axis and example b of the target depends only on example b of the source; "
        "the answer has shape target.shape + source.shape[1:]. Refused (422) when the "
        "examples are not independent.",
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
    run_async: StrictBool = _async_field()


class HVPRequest(ComputeRequest, ShardOptions):
    """Hessian-vector products of a scalar target: give `vector` or `vectors`. Gradients
    and products of unconnected sources are zeros."""

    vector: Vector | None = Field(
        None, description="One vector: a tensor per source (keyed like the gradients)."
    )
    vectors: list[Vector] | None = Field(
        None, description="Several vectors, answered together in one batched pass."
    )
    flat_vector: TensorValue | None = Field(
        None, description="One vector as a flat vector over the sources (in `flat.order`)."
    )
    flat: StrictBool = Field(
        False,
        description="Answer gradients (and products) as one flat float64 vector in "
        "`flat`, in the order `flat.order` lists (the sources); the per-source forms are "
        "then empty. For SciPy's minimize, without unflattening.",
    )

    @model_validator(mode="after")
    def _one_of(self) -> HVPRequest:
        given = [self.vector, self.vectors, self.flat_vector]
        if sum(v is not None for v in given) != 1:
            raise ValueError(
                "give exactly one of 'vector' (one), 'vectors' (a list) or "
                "'flat_vector' (one, flat)"
            )
        if self.vectors is not None and not self.vectors:
            raise ValueError("'vectors' is empty")
        return self


class _Vectors(CallOptions):
    vector: Vector | None = Field(
        None, description="One vector: a tensor per source (keyed like the gradients)."
    )
    vectors: list[Vector] | None = Field(
        None, description="Several vectors, answered together in one batched pass."
    )
    flat_vector: TensorValue | None = Field(
        None, description="One vector as a flat vector over the sources (in `flat.order`)."
    )

    @model_validator(mode="after")
    def _one_of(self) -> _Vectors:
        given = [self.vector, self.vectors, self.flat_vector]
        if sum(v is not None for v in given) != 1:
            raise ValueError(
                "give exactly one of 'vector' (one), 'vectors' (a list) or "
                "'flat_vector' (one, flat)"
            )
        if self.vectors is not None and not self.vectors:
            raise ValueError("'vectors' is empty")
        return self


# Tapes ----------------------------------------------------------------------------------


class TapeCreateRequest(DefinitionRequest, ShardOptions):
    """Record a tape: the definition's forward pass and the gradient of its (scalar)
    target over the sources, kept in a worker for later requests. Lines the target does
    not use are recorded too (other targets can be asked of the tape)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "definition": {
                        "variables": {"w": [[0.5, -0.2], [0.1, 0.3]], "b": [0.0, 0.1]},
                        "inputs": {"x": [[1.0, 2.0], [3.0, -1.0]], "y": [[1.0, 0.0], [0.0, 1.0]]},
                        "program": ["out = tanh(x @ w + b)", "loss = mean((out - y) ** 2)"],
                    },
                    "target": "loss",
                }
            ]
        }
    )

    output: Name | None = Field(
        None,
        description="The program line that is the model's output (the logits, the "
        "predictions): the lines after it that the target needs form the loss, which must "
        "then read only the output and inputs (the targets; variables that are not sources "
        "are held fixed). Naming it lets the tape answer the Gauss-Newton and Fisher "
        "curvatures (`curvature` on its products and algorithms) and influence functions; "
        "the examples are along the output's first axis. Refused (422, naming the line) "
        "when a loss line reads a source or a line of the model.",
    )
    point: TensorValue | None = Field(
        None,
        description="Record the tape at new values for its sources given as one flat "
        "vector, in the order `flat.order` lists (cast to each source's dtype; PATCH takes "
        "the same): with `model`, a stored model at a new point without naming each "
        "variable. A length that does not fit the sources is a 422 naming both. The tape "
        "keeps these values (a rebuild records the same point).",
    )
    ttl: StrictFloat | None = Field(
        None,
        gt=0,
        description="Seconds the tape lives after its last use (default and "
        "maximum: server settings tape_ttl and tape_max_ttl).",
    )
    flat: StrictBool = Field(
        False,
        description="Answer gradients (and products) as one flat float64 vector in "
        "`flat`, in the order `flat.order` lists (the sources); the per-source forms are "
        "then empty. For SciPy's minimize, without unflattening.",
    )

    @model_validator(mode="after")
    def _point_or_variables(self) -> TapeCreateRequest:
        if self.point is not None and self.variables:
            raise ValueError("give 'point' (every source, flat) or 'variables' (by name), not both")
        return self


class CurvatureKind(StrEnum):
    """The matrix a tape's products and algorithms use: the Hessian of the target, or,
    on a tape that names its `output`, the generalized Gauss-Newton matrix J^T H_L J,
    the Fisher (exact for softmax/sigmoid cross-entropy and squared error, where it is
    the GGN; Monte-Carlo with `samples`), or the empirical Fisher c sum_i g_i g_i^T
    (c = 1/N for a mean loss, 1 for a sum)."""

    hessian = "hessian"
    ggn = "ggn"
    fisher = "fisher"
    empirical_fisher = "empirical_fisher"
    kfac = "kfac"  # the GGN's KFAC (expand; sources outside layers as an exact block)
    ekfac = "ekfac"


class CurvatureOptions(RequestModel):
    """The curvature options of a tape's products and algorithms."""

    curvature: CurvatureKind = Field(
        CurvatureKind.hessian,
        description="Which curvature matrix (see CurvatureKind); all "
        "but hessian need a tape recorded with `output`.",
    )
    samples: StrictInt | None = Field(
        None,
        ge=1,
        le=10_000,
        description="With curvature fisher: targets drawn per example "
        "from the model's predictive distribution (a Monte-Carlo Fisher, fixed by "
        "`fisher_seed`); absent: the exact Fisher.",
    )
    fisher_seed: StrictInt = Field(0, ge=0, description="Seed of the Monte-Carlo Fisher's targets.")

    @model_validator(mode="after")
    def _samples_for_fisher(self) -> CurvatureOptions:
        if self.samples is not None and self.curvature != CurvatureKind.fisher:
            raise ValueError(
                "'samples' draws a Monte-Carlo Fisher: it goes with curvature 'fisher'"
            )
        return self


class TapeUpdateRequest(CallOptions):
    """New values for some of the tape's variables and inputs (same names and shapes;
    values are cast to the recorded dtype): the tape is recorded again at them."""

    variables: NamedTensors = Field(
        default_factory=dict, description="New values by variable name."
    )
    inputs: Inputs = Field(
        default_factory=dict,
        description="New values by input name, as a definition takes "
        "them: a tensor (of the recorded shape; an input bound to a dataset may take any "
        "number of rows and is then bound no more), `{dataset, array, rows}` to bind the "
        "input to (other rows of) a stored dataset's array, or `{dataset, rows}` to bind "
        "every array of a dataset to the input of its name. Bound inputs may change their "
        "number of rows (a last, smaller mini-batch); the program's shape checks apply.",
    )
    point: TensorValue | None = Field(
        None,
        description="New values for the tape's sources as one flat vector, in the "
        "order `flat.order` lists (instead of naming them in `variables`; with `inputs`, "
        "new data and a new point in one request).",
    )
    flat: StrictBool = Field(
        False,
        description="Answer gradients (and products) as one flat float64 vector in "
        "`flat`, in the order `flat.order` lists (the sources); the per-source forms are "
        "then empty. For SciPy's minimize, without unflattening.",
    )

    @model_validator(mode="after")
    def _something(self) -> TapeUpdateRequest:
        if not self.variables and not self.inputs and self.point is None:
            raise ValueError("give new values in 'variables' and/or 'inputs', or 'point'")
        if self.point is not None and self.variables:
            raise ValueError("give 'point' (every source, flat) or 'variables' (by name), not both")
        return self


class TapeHVPRequest(_Vectors, CurvatureOptions):
    """Curvature-vector products over the tape's sources (the Hessian of its target by
    default; `curvature` picks another): `vector`, `vectors` or `flat_vector`. Only the
    passes over the recording run; nothing is recorded."""

    flat: StrictBool = Field(
        False,
        description="Answer the products as flat float64 vectors in `flat`, in the "
        "order `flat.order` lists (the tape's sources); `hvp`/`hvps` are then null.",
    )


class TapeGradientRequest(CallOptions):
    """The gradient of a name of the tape's program (default: the tape's target) over
    variables or inputs (default: the tape's sources), from the recording."""

    target: Name | None = Field(
        None, description="Any name of the program; default: the tape's target."
    )
    sources: Sources | None = Field(
        None,
        description="Variables or inputs (names, list or "
        "alias mapping); default: the tape's sources.",
    )
    unconnected: Unconnected = Field(
        Unconnected.none,
        description="For a source the target does not depend on: null (none) or zeros (zero).",
    )
    flat: StrictBool = Field(
        False,
        description="Answer the gradient as one flat float64 vector in "
        "`flat.gradient`, in the order `flat.order` lists (the sources as resolved: the "
        "list or mapping given, else the tape's sources); `gradients` is then empty and "
        "unconnected sources hold zeros. On /jacobian: " + FLAT_JACOBIAN_DESCRIPTION,
    )


class TapeJacobianRequest(TapeGradientRequest):
    """The jacobian of a name of the tape's program over variables or inputs, from the
    recording."""

    batch: StrictBool = Field(
        False,
        description="Per-example jacobians (target and sources share their first "
        "axis); refused (422) when the examples are not independent.",
    )
    run_async: StrictBool = _async_field()


class Which(StrEnum):
    """Which eigenvalues: largest algebraic (LA), largest magnitude (LM), smallest
    algebraic (SA)."""

    LA = "LA"
    LM = "LM"
    SA = "SA"


MAX_HVPS_DESCRIPTION = (
    "Most HVPs (vectors) the algorithm may use (at most the server's algorithm_max_hvps)."
)
MAX_SECONDS_DESCRIPTION = (
    "Seconds the algorithm may run; it then stops and answers what it has "
    "(default and maximum: 90% of the request's time limit; at least "
    f"{defaults.ALGORITHM_MIN_SECONDS}, smaller values are refused; after a tape rebuild "
    f"the algorithm still gets at least {defaults.ALGORITHM_MIN_SECONDS} s)."
)


class EigenMethod(StrEnum):
    """How eigenvalues are found: Lanczos with full reorthogonalization, or deflated
    (block) power iteration."""

    lanczos = "lanczos"
    power = "power"


class EigenvaluesRequest(CurvatureOptions, CallOptions):
    """Extreme eigenvalues (and optionally eigenvectors) of the tape's Hessian (or of the
    `curvature` asked): by Lanczos with full reorthogonalization (one HVP per iteration),
    or by deflated power iteration (k HVPs per step in one batched pass; largest
    magnitude only)."""

    k: StrictInt = Field(1, ge=1, le=1024, description="How many eigenvalues.")
    method: EigenMethod = Field(
        EigenMethod.lanczos,
        description="lanczos (fewest HVPs; any `which`) or power "
        "(deflated power iteration, as hessian-eigenthings and PyHessian run it: the k "
        "largest in magnitude, which = LM).",
    )
    which: Which | None = Field(
        None,
        description="LA: largest algebraic, LM: largest "
        "magnitude, SA: smallest algebraic. Default: LA for lanczos, "
        "LM for power (the only one it finds).",
    )
    tol: StrictFloat = Field(
        1e-6,
        gt=0,
        lt=1,
        description="Converged when each Ritz residual ||H y - theta y|| <= tol * max |theta|.",
    )
    max_hvps: StrictInt = Field(200, ge=1, description=MAX_HVPS_DESCRIPTION)
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    eigenvectors: StrictBool = Field(
        False,
        description="Also answer the eigenvectors, as "
        "tensors per source (unit norm over all sources).",
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random start vector (null: a fresh one)."
    )
    run_async: StrictBool = _async_field()


class TraceMethod(StrEnum):
    """How the trace is taken: exact (n unit vectors), Hutch++, Hutchinson, or auto."""

    auto = "auto"
    exact = "exact"
    hutchpp = "hutchpp"
    hutchinson = "hutchinson"


class DiagonalMethod(StrEnum):
    """How the diagonal is taken: exact (n unit vectors), Hutchinson, or auto; backprop:
    the GGN's, Fisher's or empirical Fisher's exactly (Monte-Carlo for the Fisher with
    `samples`) from per-example passes of the loss Hessian's square-root columns
    (BackPACK's DiagGGNExact and DiagGGNMC), as many as the output has entries per
    example, with no probe and no HVP."""

    auto = "auto"
    exact = "exact"
    hutchinson = "hutchinson"
    backprop = "backprop"


TOLERANCE_DESCRIPTION = (
    "Stop early once the standard error is at most rtol * |estimate| + atol (from 30 "
    "samples on, whatever the batch size: fewer give no standard error; stochastic "
    "methods only)."
)


class TraceRequest(CurvatureOptions, CallOptions):
    """The trace of the tape's Hessian (or of the `curvature` asked): exact from the n
    unit vectors (in batched passes of up to 64), or estimated by Hutch++ (the top of the
    spectrum taken exactly from a sketch, Hutchinson on the rest) or Hutchinson (the mean
    of z^T H z over Rademacher vectors z), with its standard error."""

    method: TraceMethod = Field(
        TraceMethod.auto,
        description="auto: exact when max_hvps covers the n HVPs it "
        "takes (n = the tape's parameters), else hutchpp; exact; hutchpp; hutchinson.",
    )
    batch_size: StrictInt = Field(
        16,
        ge=1,
        description="Random vectors per batched HVP pass "
        "(at most the server's hvp_max_vectors); exact passes take "
        "up to 64 unit vectors (fewer when hvp_max_vectors or the "
        "memory budget is tighter).",
    )
    max_hvps: StrictInt = Field(
        256, ge=2, description="Most HVPs to use (at most the server's algorithm_max_hvps)."
    )
    rtol: StrictFloat | None = Field(None, gt=0, description=TOLERANCE_DESCRIPTION)
    atol: StrictFloat = Field(
        0.0, ge=0, allow_inf_nan=False, description="Absolute part of the stopping tolerance."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random vectors (null: fresh ones)."
    )
    run_async: StrictBool = _async_field()


class DiagonalRequest(CurvatureOptions, CallOptions):
    """The diagonal of the tape's Hessian, as tensors per source: exact from the n unit
    vectors (in batched passes of up to 64), or Hutchinson's estimate (the
    mean of z * Hz over Rademacher vectors z) with a standard error per entry."""

    method: DiagonalMethod = Field(
        DiagonalMethod.auto,
        description="auto: exact when max_hvps covers the n HVPs it "
        "takes (n = the tape's parameters), else hutchinson; exact; hutchinson.",
    )
    batch_size: StrictInt = Field(
        16,
        ge=1,
        description="Random vectors per batched HVP pass "
        "(at most the server's hvp_max_vectors); exact passes take "
        "up to 64 unit vectors (fewer when hvp_max_vectors or the "
        "memory budget is tighter).",
    )
    max_hvps: StrictInt = Field(
        256, ge=2, description="Most HVPs to use (at most the server's algorithm_max_hvps)."
    )
    rtol: StrictFloat | None = Field(
        None,
        gt=0,
        description="Stop early once the root-mean-square standard error is at "
        "most rtol * rms(diagonal) + atol (from 30 probes on, whatever the batch size: "
        "fewer give no standard error; hutchinson only).",
    )
    atol: StrictFloat = Field(
        0.0, ge=0, allow_inf_nan=False, description="Absolute part of the stopping tolerance."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(
        0, ge=0, description="Seed of the random vectors (null: fresh ones)."
    )
    run_async: StrictBool = _async_field()


class SpectralDensityRequest(CurvatureOptions, CallOptions):
    """The eigenvalue density of the tape's Hessian by stochastic Lanczos quadrature:
    `steps` Lanczos steps from each of `probes` random vectors (run side by side, one
    batched pass per step) give Ritz nodes and weights; smoothed by a Gaussian of width
    `sigma`, they are a density to plot."""

    probes: StrictInt = Field(
        8,
        ge=1,
        le=1024,
        description="Random start vectors (more: a smaller standard error of the density).",
    )
    steps: StrictInt = Field(
        64,
        ge=1,
        le=4096,
        description="Lanczos steps per probe (capped "
        "at the tape's parameter count): the nodes per probe, i.e. the "
        "resolution.",
    )
    sigma: StrictFloat | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Width (standard deviation) of the "
        "Gaussian that smooths the nodes into a density, in eigenvalue units. Default: the "
        "span of the nodes / steps.",
    )
    points: StrictInt = Field(
        256,
        ge=2,
        le=10_000,
        description="Grid points spanning the nodes +- 3 sigma (ignored when `grid` is given).",
    )
    grid: list[Annotated[StrictFloat, Field(allow_inf_nan=False)]] | None = Field(
        None,
        min_length=1,
        max_length=10_000,
        description="Where to evaluate the density "
        "(eigenvalues, finite); default: `points` points spanning the nodes +- 3 sigma.",
    )
    max_hvps: StrictInt | None = Field(
        None,
        ge=1,
        description=MAX_HVPS_DESCRIPTION + " Default: probes x steps, within algorithm_max_hvps.",
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    seed: StrictInt | None = Field(0, ge=0, description="Seed of the probes (null: fresh ones).")
    run_async: StrictBool = _async_field()


class SolveRequest(CurvatureOptions, CallOptions):
    """Solve (H + damping I) x = b by conjugate gradient on the tape's Hessian. b
    defaults to the recorded gradient: x is then the damped Newton step (subtract it
    from the sources)."""

    vector: Vector | None = Field(
        None,
        description="b, a tensor per source (keyed like the gradients); default: the gradient.",
    )
    damping: StrictFloat = Field(1e-3, ge=0, description="Added to the Hessian's diagonal.")
    tol: StrictFloat = Field(
        1e-6, gt=0, lt=1, description="Converged when ||b - (H + damping I) x|| <= tol * ||b||."
    )
    max_iterations: StrictInt = Field(100, ge=1, description="Most CG iterations.")
    max_hvps: StrictInt | None = Field(
        None, ge=1, description=MAX_HVPS_DESCRIPTION + " Default: max_iterations."
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    run_async: StrictBool = _async_field()


class InfluenceRequest(CurvatureOptions, CallOptions):
    """Influence functions (Koh and Liang, 2017) on a tape recorded with `output`: the
    effect of every training example (a row along the output's first axis) on the loss
    at test points."""

    test_inputs: Inputs | None = Field(
        None,
        description="The test points: new values for the inputs the model and the loss "
        "read along the examples axis (the data and the targets; same trailing shapes, any "
        "number of rows), as tensors, stored dataset arrays ({dataset, array, rows}) or a "
        "whole dataset ({dataset, rows}: each array the input of its name). The test loss "
        "is the tape's loss on them.",
    )
    rows: list[StrictInt] | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="Or: training rows (indices "
        "along the examples axis) whose loss is the test loss.",
    )
    damping: StrictFloat = Field(
        1e-3,
        ge=0,
        description="Added to the curvature's diagonal "
        "(an L2 term (lam/2)|w|^2 of the training loss is damping "
        "lam).",
    )
    top_k: StrictInt = Field(
        10,
        ge=0,
        le=10_000,
        description="At most how many helpful "
        "(negative score) and harmful (positive score) examples to list "
        "each; fewer when fewer examples have that sign.",
    )
    tol: StrictFloat = Field(
        1e-6, gt=0, lt=1, description="CG converged when ||b - (C + damping I) s|| <= tol * ||b||."
    )
    max_iterations: StrictInt = Field(100, ge=1, description="Most CG iterations.")
    max_hvps: StrictInt | None = Field(
        None,
        ge=1,
        description=MAX_HVPS_DESCRIPTION + " "
        "Default: max_iterations. It bounds the CG solve's "
        "curvature products only; the passes around it are "
        "fixed (see the answer's `hvps`).",
    )
    max_seconds: StrictFloat | None = Field(
        None, ge=defaults.ALGORITHM_MIN_SECONDS, description=MAX_SECONDS_DESCRIPTION
    )
    run_async: StrictBool = _async_field()

    @model_validator(mode="after")
    def _test_points(self) -> InfluenceRequest:
        if (self.test_inputs is None) == (self.rows is None):
            raise ValueError(
                "give the test points as 'test_inputs' or as training 'rows' (exactly one of them)"
            )
        return self


# Stored models --------------------------------------------------------------------------


class ModelCreateRequest(RequestModel):
    """Store a definition (with its custom-gradient functions) under a name; requests
    then name it with `"model"` instead of sending the definition."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "clipped-square",
                    "description": "SCENARIOS.md 4: a custom gradient that clips to norm 0.5",
                    "definition": {
                        "variables": {"v": 2.0},
                        "functions": {
                            "clipped": {
                                "params": ["x"],
                                "forward": ["y = x"],
                                "backward": ["grad_x = clip_by_norm(upstream, 0.5)"],
                            }
                        },
                        "program": ["output = clipped(v * v)"],
                    },
                }
            ]
        }
    )

    name: ModelName
    definition: Definition
    description: str | None = Field(None, max_length=1000)
    replace: StrictBool = Field(False, description="Replace a model of the same name.")
    allow_nonfinite: StrictBool | None = _allow_nonfinite_field()


# ----------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------


def _nonfinite_flag() -> Any:
    return Field(
        None,
        description="Only with allow_nonfinite, when the answer holds NaN or infinite "
        "values: the dotted fields that hold them (without allow_nonfinite such an answer "
        "is a 422 naming the op where the first one appeared).",
    )


class FlatSlot(BaseModel):
    source: str = Field(description="The source (its answer key).")
    shape: list[int]
    offset: int = Field(description="Where its elements start in the flat vectors.")
    size: int


class FlatAnswer(BaseModel):
    """With `flat: true`: the answer as flat float64 vectors over the sources."""

    order: list[FlatSlot] = Field(description="The sources, in the flat vectors' order.")
    gradient: Tensor | None = None
    hvp: Tensor | None = None
    hvps: Tensor | None = Field(None, description="One row per vector.")
    jacobian: Tensor | None = Field(
        None,
        description="The jacobian: [target size, n], or [B, target size per example, "
        "n per example] for a batch jacobian.",
    )


class GradientResponse(BaseModel):
    """The target's value and one gradient per source (null when unconnected)."""

    value: Tensor
    gradients: Gradients
    flat: FlatAnswer | None = None
    nonfinite: list[str] | None = _nonfinite_flag()


class JacobianResponse(BaseModel):
    """The target's value and one jacobian per source (shape target.shape + source.shape,
    or target.shape + source.shape[1:] for a batch jacobian; null when unconnected)."""

    value: Tensor
    jacobians: Gradients
    flat: FlatAnswer | None = None
    nonfinite: list[str] | None = _nonfinite_flag()


class HessianResponse(BaseModel):
    """Value, gradients, and the Hessian as blocks: hessian[a][b] has shape
    a.shape + b.shape."""

    value: Tensor
    gradients: Gradients
    hessian: HessianBlocks
    newton_step: Tensors | None = Field(
        None, description="(H + damping I)^-1 g per source, when asked."
    )
    nonfinite: list[str] | None = _nonfinite_flag()


class HVPResponse(BaseModel):
    """Value, gradients and H @ v per vector (`hvp` for `vector`, `hvps` for `vectors`)."""

    value: Tensor
    gradients: Gradients
    hvp: Tensors | None = None
    hvps: list[Tensors] | None = None
    flat: FlatAnswer | None = None
    nonfinite: list[str] | None = _nonfinite_flag()


# Tapes ----------------------------------------------------------------------------------


class TapeCreateResponse(BaseModel):
    """The recorded value and gradients, and the new tape's id (send it to
    /v1/tapes/{tape_id}/...)."""

    tape_id: str = Field(description="Unguessable (192 random bits): keep it secret.")
    value: Tensor
    gradients: Gradients
    bytes: int = Field(
        description="Bytes of the arrays the tape holds in its worker (a "
        "sharded tape: its parts, in theirs)."
    )
    ttl: float = Field(description="Seconds the tape lives after its last use.")
    expires_at: datetime = Field(description="When it expires unless used before.")
    device: str
    worker: int = Field(
        description="The worker holding it (a sharded tape: its "
        "coordinator, which holds its first part)."
    )
    flat: FlatAnswer | None = None
    nonfinite: list[str] | None = _nonfinite_flag()


class ShardInfo(BaseModel):
    """One part of a sharded tape."""

    rows: int = Field(description="Its part of the batch (examples).")
    worker: int
    bytes: int = Field(description="Bytes of the arrays it holds in its worker.")
    rebuilds: int = Field(
        description="Times it was recorded again (a lost worker's part is recorded again alone)."
    )
    hits: int


class TapeInfo(BaseModel):
    """A tape: what it records, where it lives, how much it costs, when it expires."""

    tape_id: str
    target: str
    output: str | None = Field(
        None, description="The model output it names, if any (curvatures beyond the Hessian)."
    )
    sources: SourceMap
    model: str | None = Field(None, description="The stored model it was recorded from.")
    created_at: datetime
    last_used_at: datetime
    expires_at: datetime
    ttl: float
    hits: int = Field(description="Requests answered from the tape.")
    bytes: int = Field(
        description="Bytes of the arrays the tape holds in its worker (a "
        "sharded tape: its parts, in theirs)."
    )
    device: str
    worker: int = Field(
        description="The worker holding it (a sharded tape: its "
        "coordinator, which holds its first part)."
    )
    loaded: bool = Field(
        description="Held in the worker's memory now (false: recorded "
        "again, transparently, on the next request)."
    )
    rebuilds: int = Field(
        description="Times it was recorded again after a worker or "
        "service restart (of a sharded tape: of all its shards)."
    )
    shard_reduction: ShardReduction | None = Field(
        None, description="A sharded tape: how its parts add up (absent otherwise)."
    )
    shard_by: list[str] | None = Field(None, description="A sharded tape: the inputs split.")
    shards: list[ShardInfo] | None = Field(
        None, description="A sharded tape: its parts, each an ordinary tape in a worker."
    )


class TapeList(BaseModel):
    """The caller's live tapes, oldest first."""

    tapes: list[TapeInfo]


class TapeHVPResponse(BaseModel):
    """H @ v per vector (`hvp` for `vector`, `hvps` for `vectors`)."""

    hvp: Tensors | None = None
    hvps: list[Tensors] | None = None
    flat: FlatAnswer | None = None
    nonfinite: list[str] | None = _nonfinite_flag()


class Stopped(StrEnum):
    """Why an algorithm stopped."""

    converged = "converged"
    exhausted = "exhausted"
    complete = "complete"
    tolerance = "tolerance"
    max_hvps = "max_hvps"
    max_iterations = "max_iterations"
    time_limit = "time_limit"
    negative_curvature = "negative_curvature"


class EigenvaluesResponse(BaseModel):
    """Ritz values sorted as asked (LA: descending; SA: ascending; LM: by magnitude)."""

    eigenvalues: list[float]
    residuals: list[float] = Field(
        description="||H y - theta y|| per Ritz pair (lanczos: "
        "estimates from the recurrence; power: computed)."
    )
    eigenvectors: list[Tensors] | None = None
    method: EigenMethod
    converged: bool
    stopped: Stopped = Field(
        description="converged; exhausted (every direction was spanned: "
        "exact); max_hvps; time_limit."
    )
    iterations: int = Field(description="Lanczos iterations, or power steps (batched passes).")
    hvps: int = Field(description="HVPs used.")
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


class TraceResponse(BaseModel):
    """The trace and its standard error, with what it cost and why it stopped."""

    trace: float
    stderr: float | None = Field(
        description="Standard error of the estimate: 0 when exact; "
        "hutchinson: sample std / sqrt(samples); hutchpp: that of the "
        "probes of the remainder; exact stopped by max_seconds: that "
        "of n x the mean diagonal entry seen (they are visited in a "
        "random order); null (unknown) from fewer than 30 samples, "
        "which are too few for one."
    )
    method: TraceMethod = Field(
        description="The method that ran (auto resolved; hutchpp "
        "hands over to exact once its sketch would span a third of "
        "the parameters with n HVPs still in the budget: then exact, "
        "and hvps count both)."
    )
    samples: int = Field(description="Random probes averaged, or unit vectors visited (exact).")
    sketch: int = Field(0, description="hutchpp: the rank of the part taken exactly.")
    batches: int = Field(description="Batched passes (exact, hutchinson) or rounds (hutchpp).")
    batch_size: int = Field(description="Vectors per batched pass.")
    converged: bool = Field(
        description="Exact, or the tolerance was met (without one: every "
        "sample asked for was drawn, and a standard error is known). "
        "The tolerance is checked from 30 samples on, whatever the "
        "batch size."
    )
    stopped: Stopped = Field(
        description="exhausted (exact: every direction was taken), "
        "tolerance, max_hvps or time_limit."
    )
    hvps: int
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


class DiagonalResponse(BaseModel):
    """The diagonal, as tensors per source, and its standard error."""

    diagonal: Tensors | None = Field(
        description="The diagonal per source; null when an "
        "exact run was stopped by max_seconds before reaching "
        "every entry (see `partial`)."
    )
    partial: Tensor | None = Field(
        None,
        description="Only when an exact run was stopped by "
        "max_seconds: the `reached` entries computed, flat, in the "
        "order of the sources (as the tape lists them), each "
        "row-major; the entries past them are unknown.",
    )
    stderr: Tensors | None = Field(
        description="Standard error per entry (hutchinson); null "
        "when exact, and when it is unknown (fewer than 30 probes)."
    )
    error: float | None = Field(
        description="Root-mean-square standard error over the "
        "entries (what rtol is compared with); 0 when exact; null "
        "when unknown."
    )
    method: DiagonalMethod = Field(description="The method that ran (auto resolved).")
    reached: int = Field(
        description="Entries computed, counted over the sources in their "
        "order, each row-major: all n unless an exact run was stopped by "
        "max_seconds (then `diagonal` is null and `partial` holds them)."
    )
    samples: int = Field(description="Random probes averaged, or unit vectors visited (exact).")
    batches: int
    batch_size: int = Field(description="Vectors per batched pass.")
    converged: bool
    stopped: Stopped = Field(description="exhausted (exact), tolerance, max_hvps or time_limit.")
    hvps: int
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


class SpectralDensityResponse(BaseModel):
    """The smoothed eigenvalue density on a grid, and the raw quadrature it comes from."""

    grid: list[float] = Field(description="Eigenvalues where the density is given.")
    density: list[float] = Field(
        description="The density of eigenvalues, normalized to "
        "integrate to 1 (times the parameter count: eigenvalues per "
        "unit)."
    )
    stderr: list[float] | None = Field(
        description="Pointwise standard error of the density across probes (null with one probe)."
    )
    nodes: list[list[float]] = Field(
        description="Per probe, its Ritz values (the quadrature's nodes)."
    )
    weights: list[list[float]] = Field(
        description="Per probe, its nodes' weights (squared first components; they sum to 1)."
    )
    sigma: float = Field(description="The smoothing width used.")
    probes: int = Field(description="Probes that ran.")
    steps: int = Field(
        description="Lanczos steps per probe asked (capped at the parameter "
        "count); a probe whose Krylov space closes sooner has fewer nodes, "
        "and its quadrature is then exact."
    )
    parameters: int = Field(description="n, the tape's parameter count.")
    converged: bool = Field(description="Every probe ran its steps.")
    stopped: Stopped = Field(
        description="complete, max_hvps or time_limit (the probes run "
        "so far, each with the steps it reached)."
    )
    hvps: int
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


class SolveResponse(BaseModel):
    solution: Tensors = Field(description="x, per source.")
    rhs: str = Field(description="gradient (x is the damped Newton step) or vector.")
    converged: bool
    stopped: Stopped = Field(
        description="converged, max_iterations, max_hvps, time_limit, "
        "or negative_curvature (H + damping I is not positive definite "
        "along a direction CG met: raise the damping)."
    )
    iterations: int
    hvps: int
    residuals: list[float] = Field(
        description="||b - (H + damping I) x|| / ||b|| from x = 0 and after each iteration."
    )
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


class InfluenceResponse(BaseModel):
    """Per training example i: `scores[i]` = I_up,loss(z_i, z_test) = -g_i . s_test with
    s_test = (C + damping I)^-1 grad L_test (positive: harmful, up-weighting it raises the
    test loss; negative: helpful), and `removal[i]`, the predicted change of the test
    loss if example i were left out of the training loss (-c * scores[i], c = 1/N for a
    mean loss, 1 for a sum)."""

    scores: list[float]
    removal: list[float]
    helpful: list[int] = Field(
        description="Examples with a negative score, most negative "
        "first: at most top_k, fewer (even none) when fewer are "
        "negative."
    )
    harmful: list[int] = Field(
        description="Examples with a positive score, largest first: "
        "at most top_k, fewer (even none) when fewer are positive; "
        "never one of `helpful`."
    )
    test_loss: float
    s_test: Tensors = Field(description="(C + damping I)^-1 grad L_test, per source.")
    curvature: CurvatureKind
    converged: bool
    stopped: Stopped = Field(
        description="Of the CG solve: converged, max_iterations, "
        "max_hvps, time_limit or negative_curvature (raise the damping)."
    )
    iterations: int
    hvps: int = Field(
        description="Curvature-vector products of the CG solve (what max_hvps "
        "bounds). Besides them every request takes a fixed few passes, not "
        "counted here: the test loss's gradient (one forward and backward pass "
        "over the model at the test points), the scores (one JVP through the "
        "model at the training data), the per-example scale (two loss gradients "
        "on the output, no pass over the model), and for the Monte-Carlo Fisher "
        "`samples` loss gradients on the output (no pass over the model)."
    )
    residuals: list[float]
    seconds: float
    nonfinite: list[str] | None = _nonfinite_flag()


# Stored models --------------------------------------------------------------------------


class TypeInfo(BaseModel):
    dtype: str
    shape: list[int]


class VariableInfo(TypeInfo):
    trainable: bool


Types = TypeAliasType(
    "Types", Annotated[dict[str, TypeInfo], Field(description="Shape and dtype by name.")]
)


VariableTypes = TypeAliasType(
    "VariableTypes",
    Annotated[
        dict[str, VariableInfo], Field(description="Shape, dtype and trainable by variable name.")
    ],
)


class ModelInfo(BaseModel):
    """A stored model: what its program defines."""

    name: str
    description: str | None = None
    digest: str = Field(description="SHA-256 of the stored definition (values included).")
    created_at: datetime
    updated_at: datetime
    variables: VariableTypes
    inputs: Types
    names: Types = Field(description="Every program line's name, shape, dtype.")
    functions: list[str]
    trainable: list[str] = Field(description="The default sources.")


class ModelList(BaseModel):
    models: list[ModelInfo]


class DatasetArrayInfo(TypeInfo):
    bytes: int


DatasetArrays = TypeAliasType(
    "DatasetArrays",
    Annotated[dict[str, DatasetArrayInfo], Field(description="The arrays by name.")],
)


class DatasetInfo(BaseModel):
    """A stored dataset: its arrays (name, dtype, shape, bytes)."""

    name: str
    version: str = Field(description="SHA-256 over its arrays: changes whenever they do.")
    bytes: int = Field(description="Bytes of all its arrays.")
    arrays: DatasetArrays
    created_at: datetime
    updated_at: datetime


class DatasetList(BaseModel):
    datasets: list[DatasetInfo]


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
    omitted: int | None = Field(
        None,
        description="Problems found beyond those listed in `errors` (the server lists "
        "at most max_reported_problems).",
    )


# Jobs ------------------------------------------------------------------------------------


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


# The answer of a request that may run as a job: what the synchronous request answers.
JobResult = TypeAliasType(
    "JobResult",
    EigenvaluesResponse
    | TraceResponse
    | DiagonalResponse
    | SpectralDensityResponse
    | SolveResponse
    | JacobianResponse
    | HessianResponse,
)


class JobProgress(BaseModel):
    """Where a running job stands (the last report of its worker)."""

    done: int = Field(
        description="Units of work done: HVPs (vectors) for eigenvalues, trace, "
        "diagonal, spectral density and solve; rows for a Hessian."
    )
    total: int | None = Field(
        None,
        description="The budget of units (max_hvps, rows), when "
        "known; an algorithm may stop sooner, on convergence.",
    )
    unit: str = Field(description="hvps or rows.", examples=["hvps"])
    estimate: float | list[float | None] | None = Field(
        None,
        description="What the algorithm would answer now: the Ritz values (eigenvalues), "
        "the trace estimate; exact diagonal: the fraction of entries done; spectral density: "
        "the probes finished; null when there is none yet (solve, hutchinson diagonal: see "
        "error).",
    )
    error: float | list[float | None] | None = Field(
        None,
        description="The estimate's error: Ritz residuals, the trace's standard error, "
        "the diagonal's relative error rms(stderr) / rms(diagonal), the solve's relative "
        "residual ||b - A x|| / ||b||.",
    )
    seconds: float = Field(description="Seconds the computation has run in its worker.")
    eta: float | None = Field(
        None,
        description="Seconds left at the current pace if the whole budget is used "
        "(within max_seconds); null when unknown.",
    )


class JobInfo(BaseModel):
    """A job: a long computation run in the background (`"async": true` or `Prefer:
    respond-async`)."""

    job_id: str
    state: JobState = Field(description="queued, running, succeeded, failed or cancelled.")
    operation: str = Field(
        description="The request that started it.", examples=["POST /v1/tapes/{tape_id}/trace"]
    )
    tape_id: str | None = Field(None, description="The tape it runs on, if any.")
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    expires_at: str | None = Field(
        None, description="When a finished job is forgotten (job_ttl after it ended)."
    )
    elapsed: float = Field(description="Seconds since it started running (until it ended).")
    progress: JobProgress | None = None
    result: JobResult | None = Field(
        None,
        description="When succeeded: the answer the synchronous request gives (also at "
        "GET /v1/jobs/{job_id}/result).",
    )
    error: Problem | None = Field(
        None, description="When failed: the problem the synchronous request would have answered."
    )


class JobList(BaseModel):
    jobs: list[JobInfo] = Field(description="The caller's jobs, oldest first (without results).")
