"""Request models -> worker payloads: every wire tensor becomes a NumPy array (element
count, dtype range and finiteness checked here, with the field path in the error), and
the server's limits on the request are applied. Nothing here computes."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from service.api.problems import ProblemError
from service.api.schemas import (
    CallOptions,
    DatasetArray,
    DatasetInputs,
    Definition,
    DefinitionRequest,
    GradientRequest,
    HessianRequest,
    HVPRequest,
    ImportedModel,
    JacobianRequest,
    ModelCreateRequest,
    ShardOptions,
    TapeCreateRequest,
    TapeGradientRequest,
    TapeHVPRequest,
    TapeJacobianRequest,
    TapeUpdateRequest,
    TensorBase64,
    TensorData,
    VariableSpec,
)
from service.api.schemas.operations import OperationRequest
from service.api.tensors import BASE64_PATTERN, from_base64, from_data, nonfinite_count
from service.core.config import Settings
from service.core.operations import CURVATURE_FIELDS, OnePass, encode_options
from service.core.wire import Encoding, TensorError, from_bytes
from service.domain.jobs import time_limit_of
from service.domain.requests import Binding, Prepared


class TensorDecoder:
    """Decodes the tensors of one request, collecting every problem before failing."""

    def __init__(self, allow_nonfinite: bool, max_onnx_bytes: int = 0):
        self.allow_nonfinite = allow_nonfinite
        self.max_onnx_bytes = max_onnx_bytes
        self.errors: list[dict[str, Any]] = []
        self.binary = False  # some tensor came as base64 or raw bytes
        self.bindings: list[Binding] = []

    def tensor(self, value: Any, field: str, default: str = "float32") -> np.ndarray | None:
        """The array of a wire tensor; a bare number or list has dtype `default` (the
        definition's dtype)."""
        try:
            if isinstance(value, TensorData):
                shape = value.shape
                if isinstance(value.data, bytes):
                    self.binary = True
                    if shape is None:
                        raise TensorError("a tensor given as bytes needs its shape")
                    array = from_bytes(value.data, value.dtype.value, shape)
                else:
                    array = from_data(value.data, value.dtype.value, shape)
            elif isinstance(value, TensorBase64):
                self.binary = True
                array = from_base64(value.base64, value.dtype.value, value.shape)
            else:  # a bare number or nested list
                array = from_data(value, default, None)
        except TensorError as exc:
            self.errors.append({"field": field, "message": str(exc), "kind": "value"})
            return None
        if not self.allow_nonfinite:
            bad = nonfinite_count(array)
            if bad:
                self.errors.append(
                    {
                        "field": field,
                        "kind": "value",
                        "message": f"{bad} of {array.size} element(s) are NaN or infinite; set "
                        "allow_nonfinite: true to send them anyway",
                    }
                )
        return array

    def tensors(
        self, values: dict[str, Any], field: str, default: str = "float32"
    ) -> dict[str, np.ndarray | None]:
        return {name: self.tensor(v, f"{field}.{name}", default) for name, v in values.items()}

    def variable(self, var: Any, field: str, default: str) -> dict[str, Any]:
        if isinstance(var, VariableSpec):
            return {
                "value": self.tensor(var.value, f"{field}.value", default),
                "trainable": var.trainable,
            }
        return {"value": self.tensor(var, field, default), "trainable": True}

    def definition(self, d: Definition) -> dict[str, Any]:
        # The worker form carries typed arrays only: the default dtype is applied here.
        default = d.dtype or "float32"
        return {
            "program": d.program,
            "variables": {
                name: self.variable(var, f"definition.variables.{name}", default)
                for name, var in d.variables.items()
            },
            "inputs": self.inputs(d.inputs, default),
            # Kept for the engine: an ONNX model runs in the dtype asked (float64), or the
            # definition is refused saying it cannot (definition.py, _model).
            **({"dtype": d.dtype} if d.dtype else {}),
            "functions": {
                name: fn.model_dump(exclude_none=True) for name, fn in d.functions.items()
            },
            **(
                {
                    "models": {
                        name: self.onnx_model(m, f"definition.models.{name}")
                        for name, m in d.models.items()
                    }
                }
                if d.models
                else {}
            ),
        }

    def onnx_model(self, m: ImportedModel, field: str) -> dict[str, Any]:
        """{onnx: the file's bytes, frozen}: base64 decoded and the size bounded here;
        the file itself is loaded and checked in the worker. A `stored` reference was
        replaced by the stored file's bytes (routes/_compute.py) before this."""
        data = m.onnx
        if isinstance(data, str):
            try:
                if BASE64_PATTERN.fullmatch(data) is None:  # the schema's pattern, exactly
                    raise ValueError("only A-Z, a-z, 0-9, '+', '/', in groups of 4, '=' padded")
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                self.errors.append(
                    {"field": f"{field}.onnx", "kind": "value", "message": f"not base64: {exc}"}
                )
                data = b""
        if data is None:  # an unresolved reference: a bug in the route, not the client
            raise ProblemError("internal", f"{field}: the stored model was not resolved")
        if len(data) > self.max_onnx_bytes:
            raise ProblemError(
                "body-too-large",
                f"{field}.onnx: {len(data):,} bytes; this server takes ONNX files of at most "
                f"{self.max_onnx_bytes:,} bytes (max_onnx_bytes)",
                errors=[{"field": f"{field}.onnx", "message": "too large"}],
            )
        return {"onnx": bytes(data), "frozen": list(m.frozen)}

    def inputs(self, inputs: Any, default: str, field: str = "definition.inputs") -> dict[str, Any]:
        """The arrays of the inputs; those bound to datasets are left to the bindings."""
        if isinstance(inputs, DatasetInputs):
            self.bindings.append(Binding(inputs.dataset, None, None, rows(inputs.rows), field))
            return {}
        out: dict[str, Any] = {}
        for name, value in inputs.items():
            if isinstance(value, DatasetArray):
                self.bindings.append(
                    Binding(value.dataset, name, value.array, rows(value.rows), f"{field}.{name}")
                )
                out[name] = None  # keeps the input's place; bound before the pool sees it
            else:
                out[name] = self.tensor(value, f"{field}.{name}", default)
        return out

    def check(self) -> None:
        if self.errors:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise ProblemError(
                "validation", f"{first['field']}: {first['message']}{more}", errors=self.errors
            )


def _at_new_point(
    stored: dict[str, Any], values: dict[str, Any], decoder: TensorDecoder
) -> dict[str, Any]:
    """The stored model's definition with new values for some of its variables (each of
    its stored shape and dtype; a bare number or list takes the stored dtype)."""
    variables = dict(stored["variables"])
    for name, raw in values.items():
        field = f"variables.{name}"
        if name not in variables:
            known = ", ".join(variables) or "none"
            decoder.errors.append(
                {
                    "field": field,
                    "kind": "name",
                    "message": f"the model has no variable {name!r} (its variables: {known})",
                }
            )
            continue
        old = variables[name]["value"]
        array = decoder.tensor(raw, field, old.dtype.name)
        if array is None:
            continue
        if array.shape != old.shape or array.dtype != old.dtype:
            decoder.errors.append(
                {
                    "field": field,
                    "kind": "shape",
                    "message": f"{array.dtype.name}{list(array.shape)} given, but the "
                    f"model's variable is {old.dtype.name}{list(old.shape)}",
                }
            )
            continue
        variables[name] = {**variables[name], "value": array}
    return {**stored, "variables": variables}


def rows(value: Any) -> Any:
    """Rows as the worker takes them: a list of indices, or {start, stop, step}."""
    return value if value is None or isinstance(value, list) else value.model_dump()


def _time_limit(body: Any, settings: Settings) -> float:
    """The request's compute seconds; a job's (body.run_async, which the route sets for
    Prefer: respond-async too) come from its own budget (jobs.time_limit_of)."""
    return time_limit_of(body.time_limit, bool(getattr(body, "run_async", False)), settings)


def _decoder(
    body: CallOptions | DefinitionRequest | ModelCreateRequest, settings: Settings
) -> TensorDecoder:
    allow = settings.allow_nonfinite if body.allow_nonfinite is None else body.allow_nonfinite
    return TensorDecoder(allow, settings.max_onnx_bytes)


def _common(
    body: DefinitionRequest, settings: Settings, stored: dict[str, Any] | None = None
) -> tuple[TensorDecoder, dict[str, Any], float]:
    """The payload of a definition request; `stored` is the definition of the stored
    model the request names (body.model), in the worker form already."""
    limit = _time_limit(body, settings)
    decoder = _decoder(body, settings)
    if body.definition is not None:
        definition = decoder.definition(body.definition)
    else:
        assert stored is not None, "a request naming a model needs its stored definition"
        definition = stored
        if body.variables:
            definition = _at_new_point(stored, body.variables, decoder)
    payload = {
        "definition": definition,
        "target": body.target,
        "sources": body.sources,
        "allow_unused": getattr(body, "allow_unused", False),
        "flat": getattr(body, "flat", False),
    }
    point = getattr(body, "point", None)
    if point is not None:  # split by the sources' shapes in the worker, which knows them
        payload["point"] = decoder.tensor(point, "point", "float64")
    return decoder, payload, limit


def _prepared(
    body: CallOptions | DefinitionRequest,
    decoder: TensorDecoder,
    payload: dict[str, Any],
    limit: float,
) -> Prepared:
    decoder.check()
    # The worker refuses a non-finite answer unless non-finite values are allowed.
    payload["allow_nonfinite"] = decoder.allow_nonfinite
    if body.response_encoding is not None:
        encoding = Encoding(body.response_encoding.value)
    else:
        encoding = Encoding.BASE64 if decoder.binary else Encoding.DATA
    return Prepared(payload, limit, encoding, decoder.bindings)


def gradient(
    body: GradientRequest, settings: Settings, stored: dict[str, Any] | None = None
) -> Prepared:
    decoder, payload, limit = _common(body, settings, stored)
    # a flat vector has a place for every source: an unconnected one holds zeros
    payload["unconnected"] = "zero" if body.flat else body.unconnected.value
    return _prepared(body, decoder, payload, limit)


def jacobian(
    body: JacobianRequest, settings: Settings, stored: dict[str, Any] | None = None
) -> Prepared:
    decoder, payload, limit = _common(body, settings, stored)
    payload["unconnected"] = "zero" if body.flat else body.unconnected.value
    payload["batch"] = body.batch
    return _prepared(body, decoder, payload, limit)


def hessian(
    body: HessianRequest, settings: Settings, stored: dict[str, Any] | None = None
) -> Prepared:
    decoder, payload, limit = _common(body, settings, stored)
    payload["newton"] = None if body.newton is None else body.newton.model_dump()
    return _prepared(body, decoder, payload, limit)


def hvp(body: HVPRequest, settings: Settings, stored: dict[str, Any] | None = None) -> Prepared:
    decoder, payload, limit = _common(body, settings, stored)
    _vectors(body, decoder, payload, settings)
    return _prepared(body, decoder, payload, limit)


def _vectors(
    body: HVPRequest | TapeHVPRequest,
    decoder: TensorDecoder,
    payload: dict[str, Any],
    settings: Settings,
) -> None:
    if body.vectors is not None and len(body.vectors) > settings.hvp_max_vectors:
        raise ProblemError(
            "too-large",
            f"vectors: {len(body.vectors)} vectors; this server answers up to "
            f"{settings.hvp_max_vectors} in one request",
            errors=[{"field": "vectors", "message": f"at most {settings.hvp_max_vectors}"}],
            limit=settings.hvp_max_vectors,  # (the SDK splits a block into such chunks)
        )
    # Bare numbers take the dtype of the tensor they stand for: read as float64 here, cast
    # to each source's dtype in the worker (as a float32 parse would round them), so a
    # float64 source loses no digits. Typed tensors keep their dtype.
    payload["flat_vector"] = None
    if body.flat_vector is not None:
        payload["flat_vector"] = decoder.tensor(body.flat_vector, "flat_vector", "float64")
        payload["vector"] = payload["vectors"] = None
    elif body.vector is not None:
        payload["vector"] = decoder.tensors(body.vector, "vector", "float64")
        payload["vectors"] = None
    else:
        assert body.vectors is not None
        payload["vector"] = None
        payload["vectors"] = [
            decoder.tensors(v, f"vectors.{i}", "float64") for i, v in enumerate(body.vectors)
        ]


# ----------------------------------------------------------------------------------------
# Tapes
# ----------------------------------------------------------------------------------------


def tape_create(
    body: TapeCreateRequest, settings: Settings, stored: dict[str, Any] | None = None
) -> tuple[Prepared, float]:
    """The payload recording a tape, and its ttl."""
    decoder, payload, limit = _common(body, settings, stored)
    del payload["allow_unused"]  # a tape records every line: other targets may use them
    payload["output"] = body.output
    ttl = settings.tape_ttl if body.ttl is None else body.ttl
    if ttl > settings.tape_max_ttl:
        raise ProblemError(
            "too-large",
            f"ttl: {ttl:g} s is above this server's maximum of {settings.tape_max_ttl:g} s",
            errors=[{"field": "ttl", "message": f"at most {settings.tape_max_ttl:g}"}],
        )
    return _prepared(body, decoder, payload, limit), ttl


def sharding(body: ShardOptions, settings: Settings) -> dict[str, Any] | None:
    """How a request splits its batch (service/domain/shards.py), or None: not sharded.
    The inputs it names are checked against the definition there, once bound."""
    if body.shards is None or body.shards == 1:
        return None
    if body.shards > settings.max_shards:
        raise ProblemError(
            "validation",
            f"shards: {body.shards} is above this server's max_shards of {settings.max_shards}",
            errors=[{"field": "shards", "message": f"at most {settings.max_shards}"}],
        )
    shard_by = [body.shard_by] if isinstance(body.shard_by, str) else body.shard_by
    reduction = None if body.shard_reduction is None else body.shard_reduction.value
    return {"shards": body.shards, "shard_by": shard_by, "reduction": reduction}


def tape_hvp(body: TapeHVPRequest, settings: Settings) -> Prepared:
    decoder = _decoder(body, settings)
    payload: dict[str, Any] = {
        "flat": body.flat,
        "curvature": {k: getattr(body, k) for k in CURVATURE_FIELDS},
    }
    _vectors(body, decoder, payload, settings)
    return _prepared(body, decoder, payload, _time_limit(body, settings))


def tape_gradient(body: TapeGradientRequest, settings: Settings) -> Prepared:
    # a flat vector has a place for every source: an unconnected one holds zeros
    payload: dict[str, Any] = {
        "target": body.target,
        "sources": body.sources,
        "flat": body.flat,
        "unconnected": "zero" if body.flat else body.unconnected.value,
    }
    if isinstance(body, TapeJacobianRequest):
        payload["batch"] = body.batch
    return _prepared(body, _decoder(body, settings), payload, _time_limit(body, settings))


def tape_update(
    body: TapeUpdateRequest, settings: Settings
) -> tuple[dict[str, np.ndarray], dict[str, Any], frozenset[str], Prepared]:
    """(variables, inputs, bare, prepared): the inputs bound to datasets are None until
    the route binds them (prepared.bindings, as for a definition); `bare`, the fields
    ("variables.w", "inputs.y") given as bare numbers or lists, which take the recorded
    dtype whatever its kind (an int64 label input from [0, 1, 1])."""
    decoder = _decoder(body, settings)
    # Bare numbers and lists are read as float64, then cast to the recorded dtype (as
    # float32 reads them, for a float32 tape): a float64 tape loses no digits.
    variables = decoder.tensors(body.variables, "variables", "float64")
    inputs = decoder.inputs(body.inputs, "float64", field="inputs")
    bare = frozenset(
        f"{section}.{name}"
        for section, values in (("variables", body.variables), ("inputs", body.inputs))
        if isinstance(values, dict)
        for name, value in values.items()
        if _is_bare(value)
    )
    payload: dict[str, Any] = {"flat": body.flat}
    if body.point is not None:
        payload["point"] = decoder.tensor(body.point, "point", "float64")
    prepared = _prepared(body, decoder, payload, _time_limit(body, settings))
    return {k: v for k, v in variables.items() if v is not None}, inputs, bare, prepared


def _is_bare(value: Any) -> bool:
    """A bare number or nested list: no dtype of its own (not a tensor, not a binding)."""
    return not isinstance(value, TensorData | TensorBase64 | DatasetArray)


def operation(body: OperationRequest, settings: Settings) -> Prepared:
    """The payload of a table operation (service/core/operations.py): its typed options,
    with the server's limits applied (the HVP budget checked, the time budget set), and
    its tensor fields decoded."""
    op = body.operation
    limit = _time_limit(body, settings)
    decoder = _decoder(body, settings)
    options = body.options()
    # An operation without an HVP budget (per-example gradients, KFAC, a Laplace fit:
    # service/core/operations.py) has only the time budget set below.
    counted = "max_hvps" in options.__struct_fields__
    max_hvps = options.hvp_budget(settings.algorithm_max_hvps) if counted else 0
    if max_hvps > settings.algorithm_max_hvps:
        raise ProblemError(
            "too-large",
            f"max_hvps: {max_hvps:,} is above this server's algorithm_max_hvps of "
            f"{settings.algorithm_max_hvps:,}",
            errors=[{"field": "max_hvps", "message": f"at most {settings.algorithm_max_hvps}"}],
        )
    # The algorithm stops itself (and answers what it has) before the pool's hard limit.
    budget = 0.9 * limit
    if counted:
        options.max_hvps = max_hvps  # type: ignore[attr-defined]
    if not isinstance(options, OnePass):  # one pass has no partial answer to stop with
        options.max_seconds = (
            budget if options.max_seconds is None else min(options.max_seconds, budget)
        )
    payload: dict[str, Any] = {"options": encode_options(options)}
    for name, spec in op.tensors.items():
        value = getattr(body, name)
        if value is None:
            payload[name] = None
        # Bare numbers take the dtype of the tensor they stand for: read as float64
        # here, cast to the source's or input's recorded dtype in the worker.
        elif spec["kind"] == "vector":
            payload[name] = decoder.tensors(value, name, "float64")
        elif spec["kind"] == "inputs":
            payload[name] = decoder.inputs(value, "float64", field=name)
        else:  # rows: indices, as sent
            payload[name] = value
    return _prepared(body, decoder, payload, limit)


def model_definition(
    body: ModelCreateRequest, settings: Settings
) -> tuple[dict[str, Any], list[Binding]]:
    decoder = _decoder(body, settings)
    definition = decoder.definition(body.definition)
    decoder.check()
    return definition, decoder.bindings
