"""The request models of the operations on a tape, made from their table rows
(service/core/operations.py): the call options every tape request takes, the row's
tensor fields, and its options Struct's fields as pydantic fields (the Struct's
constraints and descriptions become the schema's). Validation that needs only the
request runs once, on the Struct, when the model is validated (`options()` builds it).
"""

from __future__ import annotations

import contextlib
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Union

import msgspec
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)

from service.api.problems import ProblemError
from service.api.schemas.base import CallOptions, RequestModel, async_field, nonfinite_flag
from service.api.schemas.definitions import Inputs, Vector
from service.api.schemas.tensors import exactly_one_of, whole_float
from service.core.defaults import INT_MAX
from service.core.operations import (
    CURVATURE_FIELDS,
    DEPRECATED_CURVATURE_DESCRIPTION,
    OPERATIONS,
    Budget,
    CurvatureChoice,
    CurvatureUsed,
    Operation,
    OptionError,
)

_STRICT = {int: StrictInt, float: StrictFloat, bool: StrictBool, str: StrictStr}
_CONSTRAINTS = ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern")


def _pydantic_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """(the pydantic type, the Field keywords) of a Struct field's annotation: its
    msgspec Meta becomes Field constraints and description; floats must be finite."""
    found: dict[str, Any] = {}
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extras = typing.get_args(annotation)
        for meta in extras:
            if isinstance(meta, msgspec.Meta):
                found.update(
                    {k: getattr(meta, k) for k in _CONSTRAINTS if getattr(meta, k) is not None}
                )
                if meta.description is not None:
                    found["description"] = meta.description
                if (meta.extra_json_schema or {}).get("deprecated"):
                    # pydantic's own mark: `deprecated: true` in the schema (the
                    # description says since when, until when, and what instead)
                    found["deprecated"] = meta.description or True
        tp, more = _pydantic_type(inner)
        return tp, {**more, **found}
    if origin in (Union, types.UnionType):
        arms = [_pydantic_type(a) for a in typing.get_args(annotation)]
        for _, more in arms:
            found.update(more)
        merged: Any = arms[0][0]
        for tp, _ in arms[1:]:
            merged = merged | tp
        return merged, found
    if origin is list:
        (item,) = typing.get_args(annotation)
        tp, _ = _pydantic_type(item)
        if tp is StrictFloat:  # a grid of finite floats
            tp = Annotated[StrictFloat, Field(allow_inf_nan=False)]
        return list[tp], found  # type: ignore[valid-type]
    if annotation is float:
        return StrictFloat, {"allow_inf_nan": False}
    return _STRICT.get(annotation, annotation), found


def struct_fields(options: type[msgspec.Struct], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Struct's fields as create_model takes them (name -> (type, FieldInfo)): the
    curvature choice first, then the operation's own fields, then its bases'."""
    hints = typing.get_type_hints(options, include_extras=True)
    defaults = {
        f.name: ... if f.default is msgspec.NODEFAULT else f.default
        for f in msgspec.structs.fields(options)
    }
    chain = [c for c in options.__mro__ if isinstance(c, type) and issubclass(c, msgspec.Struct)]
    order: list[str] = []
    for cls in [CurvatureChoice, *[c for c in chain if c is not CurvatureChoice]]:
        if cls not in chain:
            continue
        own = [n for n in cls.__annotations__ if n in hints]
        order += [n for n in own if n not in order]
    if "max_seconds" in order and any(n in order for n in ("max_hvps", "rtol", "atol")):
        # the time budget beside the HVP budget and tolerances (where the row has them)
        order.remove("max_seconds")
        after = max(order.index(n) for n in ("max_hvps", "rtol", "atol") if n in order)
        order.insert(after + 1, "max_seconds")
    out: dict[str, Any] = {}
    for name in order:
        if name in skip:
            continue
        tp, keywords = _pydantic_type(hints[name])
        default = defaults[name]
        out[name] = (tp, Field(default, **keywords))
    return out


@contextlib.contextmanager
def _options_named() -> Iterator[None]:
    """A Struct's own check (OptionError) as the problem it names, with its field: raised
    through pydantic as a ValueError it would be a model-level error, `body: Value
    error, ...`, naming no field."""
    try:
        yield
    except msgspec.ValidationError as exc:
        cause = exc.__cause__
        if not isinstance(cause, OptionError):
            raise
        raise ProblemError(
            cause.problem,
            f"{cause.field}: {cause}"
            if not str(cause).startswith(f"{cause.field}:")
            else str(cause),
            errors=[{"field": cause.field, "message": str(cause)}],
        ) from None


_TENSOR_FIELDS: dict[str, Any] = {
    "vector": Vector | None,
    "inputs": Inputs | None,
    "rows": list[Annotated[StrictInt, Field(ge=-INT_MAX, le=INT_MAX), BeforeValidator(whole_float)]]
    | None,
}


class OperationRequest(CallOptions):
    """Base of the table's request models; `operation` is set on each."""

    operation: typing.ClassVar[Operation]

    @model_validator(mode="after")
    def _options_agree(self) -> OperationRequest:
        with _options_named():
            self.options()  # the Struct's own checks (__post_init__), once, on the request
        tensors = self.operation.tensors
        one_of = [name for name, spec in tensors.items() if spec.get("one_of")]
        if one_of and sum(getattr(self, n) is not None for n in one_of) != 1:
            raise ValueError(
                "give the test points as 'test_inputs' or as training 'rows' (exactly one of them)"
                if one_of == ["test_inputs", "rows"]
                else f"give exactly one of {', '.join(repr(n) for n in one_of)}"
            )
        return self

    def options(self) -> Budget:
        """The operation's typed options (a msgspec Struct) from this request."""
        # __struct_fields__, not msgspec.structs.fields: that one evaluates the Struct's
        # string annotations again on every call (~0.1 ms a request).
        values = {n: getattr(self, n) for n in self.operation.options.__struct_fields__}
        return msgspec.convert(values, self.operation.options, strict=False)


def request_model(op: Operation) -> type[OperationRequest]:
    """The pydantic request model of one table row (named as the row says)."""
    options = struct_fields(op.options)
    curvature = [n for n in options if n in CURVATURE_FIELDS]
    fields: dict[str, Any] = {n: options.pop(n) for n in curvature}  # first, as on every tape
    for name, spec in op.tensors.items():
        annotation = _TENSOR_FIELDS[spec["kind"]]
        keywords = {k: spec[k] for k in ("min_length", "max_length") if k in spec}
        fields[name] = (annotation, Field(None, description=spec["description"], **keywords))
    fields.update(options)
    if op.job:
        fields["run_async"] = (StrictBool, async_field())
    model = create_model(
        op.request,
        __base__=OperationRequest,
        __doc__=op.options.__doc__,
        __module__=__name__,
        **fields,
    )
    model.operation = op
    one_of = [name for name, spec in op.tensors.items() if spec.get("one_of")]
    if one_of:  # _options_agree's "exactly one of", in the schema too
        model.SCHEMA_RULES = (exactly_one_of(*one_of),)
    return model


# The matrix a curvature answer used (service.core.operations.CurvatureUsed), declared once.
CurvatureUsedModel: type[BaseModel] = create_model(
    "CurvatureUsed",
    __doc__=CurvatureUsed.__doc__,
    __module__=__name__,
    **struct_fields(CurvatureUsed),
)


def curvature_used_field() -> Any:
    return Field(
        description="The matrix the answer is of: its kind, for a Monte-Carlo Fisher its "
        "samples and seed, for an approximation its structure, and `approximate` with the "
        "reason (service.core.operations.CurvatureUsed)."
    )


def deprecated_curvature_field() -> Any:
    """The plain `curvature` string some answers still carry beside `curvature_used`
    (service.core.operations.CURVATURE_DEPRECATED)."""
    return Field(
        description=DEPRECATED_CURVATURE_DESCRIPTION, deprecated=DEPRECATED_CURVATURE_DESCRIPTION
    )


def result_model(op: Operation) -> type[BaseModel]:
    """The response model of a result Struct declared in the table (its fields, the
    `curvature_used` of a row that answers a curvature, and the `nonfinite` flag every
    answer carries), named `op.result_name`."""
    assert not isinstance(op.result, str)
    fields = struct_fields(op.result)
    if op.answers_curvature:
        fields["curvature_used"] = (CurvatureUsedModel, curvature_used_field())
    fields["nonfinite"] = (list[str] | None, nonfinite_flag())
    model: type[BaseModel] = create_model(
        op.result_name, __doc__=op.result.__doc__, __module__=__name__, **fields
    )
    return model


def curvature_options() -> type[BaseModel]:
    """The curvature fields (service.core.operations.CurvatureChoice) as a pydantic base,
    for the tape requests outside the table (HVPs)."""

    class Base(RequestModel):
        @model_validator(mode="after")
        def _curvature_agrees(self) -> Base:
            names = CurvatureChoice.__struct_fields__  # (see OperationRequest.options)
            with _options_named():
                msgspec.convert({n: getattr(self, n) for n in names}, CurvatureChoice, strict=False)
            return self

    model = create_model(
        "CurvatureOptions",
        __base__=Base,
        __doc__="The curvature options of a tape's products and algorithms.",
        __module__=__name__,
        **struct_fields(CurvatureChoice),
    )
    return typing.cast(type[BaseModel], model)


REQUEST_MODELS: dict[str, type[OperationRequest]] = {
    op.kind: request_model(op) for op in OPERATIONS
}
# The answers declared in the table (the others are models of schemas/algorithms.py).
RESPONSE_MODELS: dict[str, type[BaseModel]] = {
    op.kind: result_model(op) for op in OPERATIONS if not isinstance(op.result, str)
}
