"""Tapes (POST /v1/tapes and the calls on one: update, gradient, jacobian, HVP): requests
and answers, and the curvature a tape's algorithms apply."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    model_validator,
)

from service.api.schemas.base import (
    POINT_NOT_WITH_VARIABLES,
    CallOptions,
    DefinitionRequest,
    ShardOptions,
    ShardReduction,
    async_field,
    named,
    nonfinite_flag,
    point_or_variables,
)
from service.api.schemas.compute import (
    FLAT_JACOBIAN_DESCRIPTION,
    Execution,
    FlatAnswer,
    execution_field,
    one_vector_form,
)
from service.api.schemas.definitions import (
    Gradients,
    Inputs,
    NamedTensors,
    SourceMap,
    Sources,
    Tensors,
    Vector,
)
from service.api.schemas.operations import (
    CurvatureUsedModel,
    curvature_options,
    curvature_used_field,
)
from service.api.schemas.tensors import (
    Name,
    SchemaRules,
    Tensor,
    TensorValue,
    Unconnected,
    exactly_one_of,
    given,
)


class VectorsOptions(CallOptions):
    vector: Vector | None = Field(
        None, description="One vector: a tensor per source (keyed like the gradients)."
    )
    vectors: list[Vector] | None = Field(
        None, min_length=1, description="Several vectors, answered together in one batched pass."
    )
    flat_vector: TensorValue | None = Field(
        None, description="One vector as a flat vector over the sources (in `flat.order`)."
    )

    SCHEMA_RULES: ClassVar[SchemaRules] = (exactly_one_of("vector", "vectors", "flat_vector"),)

    @model_validator(mode="after")
    def _one_of(self) -> VectorsOptions:
        one_vector_form(self.vector, self.vectors, self.flat_vector)
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

    SCHEMA_RULES: ClassVar[SchemaRules] = (POINT_NOT_WITH_VARIABLES,)

    @model_validator(mode="after")
    def _point_or_variables(self) -> TapeCreateRequest:
        point_or_variables(self.point, self.variables)
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

    SCHEMA_RULES: ClassVar[SchemaRules] = (
        {"anyOf": [named("variables"), named("inputs"), given("point")]},
        POINT_NOT_WITH_VARIABLES,
    )

    @model_validator(mode="after")
    def _something(self) -> TapeUpdateRequest:
        if not self.variables and not self.inputs and self.point is None:
            raise ValueError("give new values in 'variables' and/or 'inputs', or 'point'")
        point_or_variables(self.point, self.variables)
        return self


# The curvature fields, declared once (service.core.operations.CurvatureChoice).
CurvatureOptions = curvature_options()


class TapeHVPRequest(VectorsOptions, CurvatureOptions):  # type: ignore[valid-type,misc]
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
    run_async: StrictBool = async_field()


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
    nonfinite: list[str] | None = nonfinite_flag()


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
    execution: Execution | None = execution_field()
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
    nonfinite: list[str] | None = nonfinite_flag()
