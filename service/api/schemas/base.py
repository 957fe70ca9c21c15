"""What every request shares: msgpack bodies, the call options (time limit, non-finite
inputs, answer encoding, async), a definition or stored model with target and sources,
and a sharded tape's options."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar

import msgpack
from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.api.schemas.definitions import Definition, NamedTensors, Sources
from service.api.schemas.tensors import (
    INT_MAX,
    STORED_NAME_PATTERN,
    Name,
    SchemaRules,
    StrictModel,
    TensorEncoding,
    TensorValue,
    exactly_one_of,
    given,
)


class UnpackedBody(bytes):
    """A msgpack body with its `value`, unpacked (and sized) once, off the event loop, by
    service/api/bodies.py: the request model takes the value instead of unpacking the
    bytes again."""

    value: Any


class RequestModel(StrictModel):
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


def time_limit_field() -> Any:
    return Field(
        None,
        ge=0.1,
        description="Compute seconds for this request, at least 0.1 (default "
        "and maximum: server settings). Past it the answer is 504 and the worker is replaced.",
    )


def allow_nonfinite_field() -> Any:
    return Field(
        None, description="Accept NaN and infinite values in the inputs (default: server setting)."
    )


def response_encoding_field() -> Any:
    return Field(
        None,
        description="Tensor encoding of a JSON answer; default: base64 when the "
        "request used base64 or binary tensors, else data lists.",
    )


def async_field() -> Any:
    return Field(
        False,
        alias="async",
        description="Run as a job: answer 202 at once with "
        "`Location: /v1/jobs/{job_id}` and follow its progress there (as the header "
        "`Prefer: respond-async` asks).",
    )


class CallOptions(RequestModel):
    """Options every request on a tape takes."""

    time_limit: StrictFloat | None = time_limit_field()
    allow_nonfinite: StrictBool | None = allow_nonfinite_field()
    response_encoding: TensorEncoding | None = response_encoding_field()


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
    time_limit: StrictFloat | None = time_limit_field()
    allow_nonfinite: StrictBool | None = allow_nonfinite_field()
    response_encoding: TensorEncoding | None = response_encoding_field()

    SCHEMA_RULES: ClassVar[SchemaRules] = (
        exactly_one_of("definition", "model"),
        {"anyOf": [given("model"), {"not": given("variables")}]},
    )

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
        le=INT_MAX,
    )
    shard_by: list[Name] | Name | None = Field(
        None,
        description="The inputs split along their first axis (the batch), which "
        "must all have the same length; inputs bound to a stored dataset are split by their "
        "rows, so each worker reads only its part from the store. Default: every input "
        "that has an axis (a 422 asks you to name them when their first axes differ).",
        examples=[["x", "y"]],
    )
    shard_reduction: ShardReduction | None = Field(
        None,
        description="How the parts add up. `mean`: the "
        "target is a mean over the batch, the parts are weighted by their share n_i / N "
        "(terms that do not depend on the batch, such as a weight penalty, stay exact). "
        "`sum`: the target is a sum over the batch, the parts are added (a term that does "
        "not depend on the batch would count once per part: keep such terms out of a "
        "sum-reduced sharded target). Absent: read from the program where the target's "
        "line says it plainly (`sum(...)`, `mean(...)`, a loss op's `reduction`, possibly "
        "scaled); where it does not (a sum of terms, say), a 422 asks for it. One given "
        "that contradicts the program is a 422 too: never a silently wrong total.",
    )

    # shard_by (not null) or shard_reduction (even null) need shards.
    SCHEMA_RULES: ClassVar[SchemaRules] = (
        {
            "anyOf": [
                given("shards"),
                {"not": {"anyOf": [given("shard_by"), {"required": ["shard_reduction"]}]}},
            ]
        },
    )

    @model_validator(mode="after")
    def _shards_named(self) -> ShardOptions:
        if self.shards is None and (
            self.shard_by is not None or "shard_reduction" in self.model_fields_set
        ):
            raise ValueError("'shard_by' and 'shard_reduction' need 'shards' (how many parts)")
        return self


def named(name: str) -> dict[str, Any]:
    """JSON Schema for "the field `name` holds a non-empty object" (what the validators
    read as given: an empty or null `variables` is none)."""
    return {"required": [name], "properties": {name: {"type": "object", "minProperties": 1}}}


# "'point' or 'variables', not both" (the requests' validators), stated to the document too.
POINT_NOT_WITH_VARIABLES: dict[str, Any] = {"not": {"allOf": [given("point"), named("variables")]}}
POINT_OR_VARIABLES = "give 'point' (every source, flat) or 'variables' (by name), not both"


def point_or_variables(point: Any, variables: Any) -> None:
    """The validators' side of POINT_NOT_WITH_VARIABLES: both given, the point would move
    every source and `variables` be dropped unread."""
    if point is not None and variables:
        raise ValueError(POINT_OR_VARIABLES)


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
        "about, without naming each variable. Not together with `variables`.",
    )

    SCHEMA_RULES: ClassVar[SchemaRules] = (POINT_NOT_WITH_VARIABLES,)

    @model_validator(mode="after")
    def _point_or_variables(self) -> ComputeRequest:
        point_or_variables(self.point, self.variables)
        return self


def nonfinite_flag() -> Any:
    return Field(
        None,
        description="Only with allow_nonfinite, when the answer holds NaN or infinite "
        "values: the dotted fields that hold them (without allow_nonfinite such an answer "
        "is a 422 naming the op where the first one appeared).",
    )
