"""A model definition (variables, functions, imported models, inputs and dataset
references) and the named-tensor maps requests and answers share."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    StrictBool,
    StrictBytes,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from typing_extensions import TypeAliasType

from service.api.problems import ProblemError
from service.api.schemas.tensors import (
    BASE64_PATTERN,
    INT_MAX,
    MAX_NAME_CHARS,
    STORED_NAME_PATTERN,
    FloatDType,
    Index,
    Name,
    SchemaRules,
    StrictModel,
    Tensor,
    TensorValue,
    exactly_one_of,
)


class VariableSpec(StrictModel):
    """A parameter of the definition."""

    value: TensorValue
    trainable: StrictBool = Field(
        True, description="Trainable variables are the default sources of a derivative."
    )


class FunctionSpec(StrictModel):
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


class ImportedModel(StrictModel):
    """An ONNX model (torch.onnx.export, tf2onnx, jax2onnx, skl2onnx) the program calls
    as a function: `logits = net(x)`. Its floating-point initializers become variables
    named by their ONNX names, trainable unless listed in `frozen`."""

    # The schema speaks JSON: the file is a base64 string (msgpack's raw bytes have no
    # JSON Schema type; the description says so). The pattern is checked with the
    # decoding (service/api/payloads.py), whose error names the model.
    onnx: Annotated[
        StrictBytes | StrictStr | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "pattern": BASE64_PATTERN, "contentEncoding": "base64"},
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
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

    SCHEMA_RULES: ClassVar[SchemaRules] = (exactly_one_of("onnx", "stored"),)

    @model_validator(mode="after")
    def _onnx_or_stored(self) -> ImportedModel:
        if (self.onnx is None) == (self.stored is None):
            raise ValueError("give exactly one of 'onnx' (the file) or 'stored' (a name)")
        return self


NamedTensors = TypeAliasType(
    "NamedTensors",
    Annotated[dict[Name, TensorValue], Field(description="Tensors by name.")],
)
DatasetUpload = TypeAliasType(
    "DatasetUpload",
    Annotated[
        dict[Name, TensorValue],
        Field(min_length=1, description="A dataset's arrays by name (at least one)."),
    ],
)
# DatasetUpload's schema, a component of the document (service/api/openapi.py adds it: no
# model refers to it, PUT /v1/datasets/{name} declares its body by hand), so that a
# generated client names the type.
DATASET_UPLOAD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "DatasetUpload",
    "description": "A dataset's arrays by name (at least one).",
    "minProperties": 1,
    "additionalProperties": {"$ref": "#/components/schemas/TensorValue"},
    "propertyNames": {"minLength": 1, "maxLength": MAX_NAME_CHARS},
}
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


class RowSlice(StrictModel):
    """Rows start:stop:step of axis 0 (Python's slice; start and stop within 0..rows)."""

    start: StrictInt | None = Field(None, ge=0, le=INT_MAX)
    stop: StrictInt | None = Field(None, ge=0, le=INT_MAX)
    step: StrictInt | None = Field(None, ge=1, le=INT_MAX)


Rows = TypeAliasType(
    "Rows",
    Annotated[
        Annotated[list[Index], Field(min_length=1)] | RowSlice,
        Field(
            description="A mini-batch: row indices of axis 0 (at least one), or a slice "
            "{start, stop, step} selecting at least one; a row past the array's end is a "
            "422 naming the bound."
        ),
    ],
)


class DatasetArray(StrictModel):
    """An input bound to one array of a stored dataset (PUT /v1/datasets/{name})."""

    dataset: DatasetName
    array: Name = Field(description="The array's name in the dataset.")
    rows: Rows | None = None


class DatasetInputs(StrictModel):
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


class Definition(StrictModel):
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
        "error (use cast). float64 also runs the definition's float32 ONNX models in "
        "float64; another dtype than a model's own is refused, never applied by rounding.",
    )


Aliases = TypeAliasType(
    "Aliases",
    Annotated[
        dict[Name, Name],
        Field(
            description="Alias -> variable or input name: answers are keyed by alias.",
            min_length=1,
        ),
    ],
)


def _some_sources(value: Any, info: ValidationInfo) -> Any:
    """No source is no derivative: an answer of nothing that would look like success
    (absent: every trainable variable). Refused as the problem itself, naming the field:
    the union's arms would each say something else of it."""
    if isinstance(value, (list, dict)) and not value:
        field = info.field_name or "sources"
        message = (
            f"at least 1 name is needed, got {'[]' if isinstance(value, list) else '{}'} "
            "(leave it out for every trainable variable)"
        )
        raise ProblemError(
            "validation", f"{field}: {message}", errors=[{"field": field, "message": message}]
        )
    return value


Sources = TypeAliasType(
    "Sources",
    Annotated[
        # Never empty (the contract says so with minItems/minProperties).
        Name | Annotated[list[Name], Field(min_length=1)] | Aliases,
        BeforeValidator(_some_sources),
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
