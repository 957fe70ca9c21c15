"""Request models -> worker payloads: every wire tensor becomes a NumPy array (element
count, dtype range and finiteness checked here, with the field path in the error), and
the server's limits on the request are applied. Nothing here computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.api.problems import ProblemError
from service.core.config import Settings
from service.schemas import (
    ComputeRequest,
    Definition,
    GradientRequest,
    HessianRequest,
    HVPRequest,
    JacobianRequest,
    TensorBase64,
    TensorData,
    VariableSpec,
)
from service.tensors import (
    Encoding,
    TensorError,
    from_base64,
    from_bytes,
    from_data,
    nonfinite_count,
)


@dataclass(frozen=True)
class Prepared:
    """What a route hands the pool, and how to write the answer's tensors."""

    payload: dict[str, Any]
    time_limit: float
    encoding: Encoding


class _Decoder:
    """Decodes the tensors of one request, collecting every problem before failing."""

    def __init__(self, allow_nonfinite: bool):
        self.allow_nonfinite = allow_nonfinite
        self.errors: list[dict[str, Any]] = []
        self.binary = False  # some tensor came as base64 or raw bytes

    def tensor(self, value: Any, field: str) -> np.ndarray | None:
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
            else:  # a bare number or nested list: float32
                array = from_data(value, "float32", None)
        except TensorError as exc:
            self.errors.append({"field": field, "message": str(exc), "kind": "value"})
            return None
        if not self.allow_nonfinite:
            bad = nonfinite_count(array)
            if bad:
                self.errors.append({
                    "field": field,
                    "kind": "value",
                    "message": f"{bad} of {array.size} element(s) are NaN or infinite; set "
                    "allow_nonfinite: true to send them anyway",
                })
        return array

    def tensors(self, values: dict[str, Any], field: str) -> dict[str, np.ndarray | None]:
        return {name: self.tensor(v, f"{field}.{name}") for name, v in values.items()}

    def variable(self, var: Any, field: str) -> dict[str, Any]:
        if isinstance(var, VariableSpec):
            return {"value": self.tensor(var.value, f"{field}.value"), "trainable": var.trainable}
        return {"value": self.tensor(var, field), "trainable": True}

    def definition(self, d: Definition) -> dict[str, Any]:
        return {
            "program": d.program,
            "variables": {
                name: self.variable(var, f"definition.variables.{name}")
                for name, var in d.variables.items()
            },
            "inputs": self.tensors(d.inputs, "definition.inputs"),
            "functions": {name: fn.model_dump() for name, fn in d.functions.items()},
        }

    def check(self) -> None:
        if self.errors:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise ProblemError(
                "validation", f"{first['field']}: {first['message']}{more}", errors=self.errors
            )


def _common(body: ComputeRequest, settings: Settings) -> tuple[_Decoder, dict[str, Any], float]:
    limit = settings.time_limit if body.time_limit is None else body.time_limit
    if limit > settings.max_time_limit:
        raise ProblemError(
            "too-large",
            f"time_limit: {limit:g} s is above this server's maximum of "
            f"{settings.max_time_limit:g} s",
            errors=[{"field": "time_limit", "message": f"at most {settings.max_time_limit:g}"}],
        )
    allow = settings.allow_nonfinite if body.allow_nonfinite is None else body.allow_nonfinite
    decoder = _Decoder(allow)
    payload = {
        "definition": decoder.definition(body.definition),
        "target": body.target,
        "sources": body.sources,
        "allow_unused": body.allow_unused,
    }
    return decoder, payload, limit


def _prepared(body: ComputeRequest, decoder: _Decoder, payload: dict[str, Any], limit: float
              ) -> Prepared:
    decoder.check()
    if body.response_encoding is not None:
        encoding = Encoding(body.response_encoding.value)
    else:
        encoding = Encoding.BASE64 if decoder.binary else Encoding.DATA
    return Prepared(payload, limit, encoding)


def gradient(body: GradientRequest, settings: Settings) -> Prepared:
    decoder, payload, limit = _common(body, settings)
    payload["unconnected"] = body.unconnected.value
    return _prepared(body, decoder, payload, limit)


def jacobian(body: JacobianRequest, settings: Settings) -> Prepared:
    decoder, payload, limit = _common(body, settings)
    payload["unconnected"] = body.unconnected.value
    payload["batch"] = body.batch
    return _prepared(body, decoder, payload, limit)


def hessian(body: HessianRequest, settings: Settings) -> Prepared:
    decoder, payload, limit = _common(body, settings)
    payload["newton"] = None if body.newton is None else body.newton.model_dump()
    return _prepared(body, decoder, payload, limit)


def hvp(body: HVPRequest, settings: Settings) -> Prepared:
    decoder, payload, limit = _common(body, settings)
    if body.vectors is not None and len(body.vectors) > settings.hvp_max_vectors:
        raise ProblemError(
            "too-large",
            f"vectors: {len(body.vectors)} vectors; this server answers up to "
            f"{settings.hvp_max_vectors} in one request",
            errors=[{"field": "vectors", "message": f"at most {settings.hvp_max_vectors}"}],
        )
    if body.vector is not None:
        payload["vector"] = decoder.tensors(body.vector, "vector")
        payload["vectors"] = None
    else:
        assert body.vectors is not None
        payload["vector"] = None
        payload["vectors"] = [
            decoder.tensors(v, f"vectors.{i}") for i, v in enumerate(body.vectors)
        ]
    return _prepared(body, decoder, payload, limit)
