"""Stateless derivatives (POST /v1/gradient, /jacobian, /hessian, /hvp): requests and answers."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    model_validator,
)

from service.api.problems import ProblemError
from service.api.schemas.base import ComputeRequest, ShardOptions, async_field, nonfinite_flag
from service.api.schemas.definitions import Gradients, HessianBlocks, Tensors, Vector
from service.api.schemas.tensors import (
    SchemaRules,
    StrictModel,
    Tensor,
    TensorValue,
    Unconnected,
    exactly_one_of,
)

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
    run_async: StrictBool = async_field()
    flat: StrictBool = Field(False, description=FLAT_JACOBIAN_DESCRIPTION)

    batch: StrictBool = Field(
        False,
        description="Per-example jacobians: target and source share their first "
        "(batch) axis and example b of the target depends only on example b of the source; "
        "the answer has shape target.shape + source.shape[1:]. Refused (422) when the "
        "examples are not independent.",
    )


class NewtonOptions(StrictModel):
    """Ask for the damped Newton step (H + damping * I)^-1 g over the sources."""

    damping: StrictFloat = Field(1e-3, ge=0, description="Added to the Hessian's diagonal.")


class HessianRequest(ComputeRequest):
    """The Hessian of a scalar target over the sources (refused above the server's size).
    Gradients and blocks of unconnected sources are zeros."""

    newton: NewtonOptions | None = Field(
        None, description="Also answer the damped Newton step (subtract it from the sources)."
    )
    run_async: StrictBool = async_field()


def one_vector_form(vector: Any, vectors: Any, flat_vector: Any) -> None:
    """An HVP's vector(s), given exactly one way; refused as the problem itself, naming
    the fields (a model's own ValueError would name no field: 'body')."""
    given = [
        name
        for name, value in (("vector", vector), ("vectors", vectors), ("flat_vector", flat_vector))
        if value is not None
    ]
    if len(given) == 1:
        return
    message = "give exactly one of 'vector' (one), 'vectors' (a list) or 'flat_vector' (one, flat)"
    if given:
        message += f"; got {' and '.join(map(repr, given))}"
    fields = given or ["vector"]
    raise ProblemError(
        "validation",
        f"{fields[0]}: {message}",
        errors=[{"field": field, "message": message} for field in fields],
    )


class HVPRequest(ComputeRequest, ShardOptions):
    """Hessian-vector products of a scalar target: give `vector` or `vectors`. Gradients
    and products of unconnected sources are zeros."""

    vector: Vector | None = Field(
        None, description="One vector: a tensor per source (keyed like the gradients)."
    )
    vectors: list[Vector] | None = Field(
        None, min_length=1, description="Several vectors, answered together in one batched pass."
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

    SCHEMA_RULES: ClassVar[SchemaRules] = (exactly_one_of("vector", "vectors", "flat_vector"),)

    @model_validator(mode="after")
    def _one_of(self) -> HVPRequest:
        one_vector_form(self.vector, self.vectors, self.flat_vector)
        return self


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


class Execution(BaseModel):
    """How the worker ran this answer's passes. A definition's gradient, HVP and
    jacobian passes (a stored ONNX model's included) are compiled per request layout
    (target, sources, the leaves' shapes and dtypes, the vectors'), and a tape's HVP
    passes per vector layout: the first request of a layout runs dynamically, the second
    is captured, and later ones replay the captured array calls, with the same answers.
    Each worker keeps its own compiled passes (up to 16 layouts of each kind for
    definitions, 8 per tape)."""

    compiled: bool = Field(
        description="True when every pass of the answer replayed its compiled form."
    )
    reason: str | None = Field(
        None,
        description="Why a pass ran dynamically (null when compiled): the first or "
        "captured pass of its layout, or what keeps it from being compiled (e.g. an op "
        "that reads the data on the host, an array on a GPU).",
        examples=["a rule read a value of the pass on the host (data-dependent)"],
    )


def execution_field() -> Any:
    return Field(
        None,
        description="How the worker ran the passes (compiled or dynamically, and why); "
        "null for a sharded request or tape, whose parts ran on several workers.",
    )


class GradientResponse(BaseModel):
    """The target's value and one gradient per source (null when unconnected)."""

    value: Tensor
    gradients: Gradients
    flat: FlatAnswer | None = None
    execution: Execution | None = execution_field()
    nonfinite: list[str] | None = nonfinite_flag()


class JacobianResponse(BaseModel):
    """The target's value and one jacobian per source (shape target.shape + source.shape,
    or target.shape + source.shape[1:] for a batch jacobian; null when unconnected)."""

    value: Tensor
    jacobians: Gradients
    flat: FlatAnswer | None = None
    execution: Execution | None = execution_field()
    nonfinite: list[str] | None = nonfinite_flag()


class HessianResponse(BaseModel):
    """Value, gradients, and the Hessian as blocks: hessian[a][b] has shape
    a.shape + b.shape."""

    value: Tensor
    gradients: Gradients
    hessian: HessianBlocks
    newton_step: Tensors | None = Field(
        None, description="(H + damping I)^-1 g per source, when asked."
    )
    nonfinite: list[str] | None = nonfinite_flag()


class HVPResponse(BaseModel):
    """Value, gradients and H @ v per vector (`hvp` for `vector`, `hvps` for `vectors`)."""

    value: Tensor
    gradients: Gradients
    hvp: Tensors | None = None
    hvps: list[Tensors] | None = None
    flat: FlatAnswer | None = None
    execution: Execution | None = execution_field()
    nonfinite: list[str] | None = nonfinite_flag()
