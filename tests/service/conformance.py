"""Conformance helpers: send a request in one of the three encodings (JSON lists, base64,
msgpack), and check its answer against openapi/openapi.json: the status and content type
the spec declares, the response schema (jsonschema, $refs resolved against the spec's
components; a msgpack answer is decoded first, its tensors' raw bytes turned into lists),
and every tensor in it: it decodes to the shape it claims, in the encoding asked for.

Every answer checked is recorded as (METHOD, path template) so that a test can prove
that every operation in the spec was driven.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgpack
import numpy as np
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text())
SPEC_URI = "urn:gradtape:openapi"
REGISTRY: Registry = Registry().with_resource(
    SPEC_URI, Resource.from_contents(SPEC, default_specification=DRAFT202012)
)

JSON = "application/json"
MSGPACK = "application/msgpack"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
ENCODINGS = ("json", "base64", "msgpack")
TENSOR_KEYS = {"dtype", "shape", "data", "base64"}

# (METHOD, template) of every operation answered with a success that passed the checks.
COVERED: set[tuple[str, str]] = set()


def spec_operations() -> list[tuple[str, str]]:
    """Every (METHOD, path template) of the spec."""
    return sorted(
        (method.upper(), path)
        for path, item in SPEC["paths"].items()
        for method in item
        if method in METHODS
    )


_TEMPLATES = [(re.compile("^" + re.sub(r"\{[^/}]+\}", "[^/]+", p) + "$"), p) for p in SPEC["paths"]]


def template(path: str) -> str:
    """The spec's path template that this concrete path matches."""
    path = path.split("?", 1)[0]
    exact = [p for rx, p in _TEMPLATES if p == path]
    if exact:
        return exact[0]
    found = [p for rx, p in _TEMPLATES if rx.match(path)]
    assert found, f"{path} matches no path of openapi.json"
    return min(found, key=lambda p: p.count("{"))


def validate(instance: Any, schema: dict[str, Any], where: str) -> None:
    """Validate against a schema of the spec (its $refs resolved in the spec), then
    check that no object carries properties its schema does not document."""
    validator = _validator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [
            f"  at {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
            for e in errors[:8]
        ]
        raise AssertionError(
            f"{where}: the answer does not follow its schema:\n"
            + "\n".join(lines)
            + f"\nanswer: {_excerpt(instance)}"
        )
    extra = undocumented(instance, schema)
    assert not extra, (
        f"{where}: the answer carries properties its schema does not "
        f"document: {extra}\nanswer: {_excerpt(instance)}"
    )


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = SPEC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


_VALIDATORS: dict[int, tuple[Any, jsonschema.Draft202012Validator]] = {}


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """One validator per schema object (the spec's schemas live as long as the run)."""
    cached = _VALIDATORS.get(id(schema))
    if cached is None or cached[0] is not schema:
        cached = (
            schema,
            jsonschema.Draft202012Validator(
                _rebase(schema), registry=REGISTRY, format_checker=jsonschema.FormatChecker()
            ),
        )
        _VALIDATORS[id(schema)] = cached
    return cached[1]


def _matches(instance: Any, schema: dict[str, Any]) -> bool:
    return _validator(schema).is_valid(instance)


def undocumented(instance: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Properties an answer carries that its (valid) schema does not name: objects whose
    schema lists `properties` and says nothing of `additionalProperties`."""
    schema = _resolve(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            for sub in schema[key]:
                if _matches(instance, sub):
                    return undocumented(instance, sub, where)
            return []
    found: list[str] = []
    if isinstance(instance, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in instance.items():
            if k in props:
                found += undocumented(v, props[k], f"{where}/{k}")
            elif isinstance(extra, dict):
                found += undocumented(v, extra, f"{where}/{k}")
            elif extra is None and props:
                found.append(f"{where}/{k}")
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(instance):
            found += undocumented(v, schema["items"], f"{where}/{i}")
    return found


def _rebase(schema: Any) -> Any:
    """Point the spec's local refs ('#/components/...') at the registered spec."""
    if isinstance(schema, dict):
        return {
            k: (
                SPEC_URI + v
                if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rebase(v)
            )
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase(v) for v in schema]
    return schema


def _excerpt(value: Any, limit: int = 600) -> str:
    text = json.dumps(value, default=lambda b: f"<{len(b)} bytes>")
    return text if len(text) <= limit else text[:limit] + "..."


def response_spec(method: str, tmpl: str, status: int) -> dict[str, Any]:
    responses = SPEC["paths"][tmpl][method.lower()]["responses"]
    assert str(status) in responses, (
        f"{method} {tmpl} answered {status}, which openapi.json does not declare "
        f"(declared: {sorted(responses)})"
    )
    return responses[str(status)]


# -- tensors -------------------------------------------------------------------------


class Encoding:
    """How a test writes its tensors and bodies, and how it expects them answered."""

    def __init__(self, name: str):
        assert name in ENCODINGS, name
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def tensor(self, value: Any, dtype: str = "float64") -> dict[str, Any]:
        array = np.asarray(value, dtype=dtype)
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        out: dict[str, Any] = {"dtype": dtype, "shape": list(array.shape)}
        if self.name == "json":
            out["data"] = array.reshape(-1).tolist()
        elif self.name == "base64":
            out["base64"] = base64.b64encode(raw).decode()
        else:
            out["data"] = raw
        return out

    def tensors(self, values: dict[str, Any], dtype: str = "float64") -> dict[str, Any]:
        return {k: self.tensor(v, dtype) for k, v in values.items()}

    def request(
        self, client: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        """Send `body` in this encoding. A base64 body without a tensor in it asks for
        base64 answers with `response_encoding` where its schema has that field (the
        default answer to a body without tensors is data lists)."""
        headers = {"accept": MSGPACK if self.name == "msgpack" else JSON}
        if (
            self.name == "base64"
            and body is not None
            and not _has_tensor(body)
            and "response_encoding" in request_properties(method, path)
        ):
            body = {**body, "response_encoding": "base64"}
        if body is None:
            return client.request(method, path, headers=headers)
        if self.name == "msgpack":
            headers["content-type"] = MSGPACK
            return client.request(
                method, path, headers=headers, content=msgpack.packb(body, use_bin_type=True)
            )
        return client.request(method, path, headers=headers, json=body)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        return "base64" in value or any(_has_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor(v) for v in value)
    return False


def request_properties(method: str, path: str) -> set[str]:
    """The properties of the JSON request body of this operation."""
    operation = SPEC["paths"][template(path)][method.lower()]
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get(JSON, {}).get("schema", {})
    while "$ref" in schema:
        schema = SPEC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return set(schema.get("properties", {}))


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _flatten(data: Any) -> Iterator[Any]:
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data


def check_tensor(tensor: dict[str, Any], where: str, encoding: str | None) -> np.ndarray:
    """One answered tensor: it decodes to the shape it claims, in `encoding`'s form
    ('json': data lists, 'base64', 'msgpack': raw bytes; None: any). Returns it."""
    assert isinstance(tensor, dict), f"{where}: not a tensor object: {_excerpt(tensor)}"
    dtype = tensor.get("dtype", "float32")
    shape = tensor.get("shape")
    assert isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape), (
        f"{where}: a tensor must claim its shape: {_excerpt(tensor)}"
    )
    size = math.prod(shape)
    np_dtype = np.dtype(dtype).newbyteorder("<")
    if "base64" in tensor:
        assert encoding in (None, "base64"), (
            f"{where}: answered in base64 to a {encoding} request: {_excerpt(tensor)}"
        )
        try:
            raw = base64.b64decode(tensor["base64"], validate=True)
        except binascii.Error as exc:
            raise AssertionError(f"{where}: bad base64 ({exc})") from exc
        assert len(raw) == size * _itemsize(dtype), (
            f"{where}: base64 holds {len(raw)} bytes, shape {shape} of {dtype} needs "
            f"{size * _itemsize(dtype)}"
        )
        return np.frombuffer(raw, np_dtype).reshape(shape)
    assert "data" in tensor, f"{where}: a tensor with neither data nor base64"
    data = tensor["data"]
    if isinstance(data, bytes):
        assert encoding in (None, "msgpack"), f"{where}: raw bytes answered to a {encoding} request"
        assert len(data) == size * _itemsize(dtype), (
            f"{where}: {len(data)} bytes, shape {shape} of {dtype} needs {size * _itemsize(dtype)}"
        )
        return np.frombuffer(data, np_dtype).reshape(shape)
    assert encoding in (None, "json"), (
        f"{where}: data lists answered to a {encoding} request: {_excerpt(tensor)}"
    )
    assert isinstance(data, list), f"{where}: data is not a list: {_excerpt(tensor)}"
    flat = list(_flatten(data))
    assert len(flat) == size, (
        f"{where}: {len(flat)} elements, shape {shape} needs {size}: {_excerpt(tensor)}"
    )
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    values = [special.get(v, v) if isinstance(v, str) else v for v in flat]
    return (
        np.asarray(values, dtype=np.float64 if np_dtype.kind == "f" else np_dtype)
        .astype(np_dtype)
        .reshape(shape)
    )


def is_tensor(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and "shape" in value
        and ("data" in value or "base64" in value)
        and set(value) <= TENSOR_KEYS
    )


def _bytes_to_lists(value: Any, where: str) -> Any:
    """A decoded msgpack answer as the JSON document the schema describes: each tensor's
    raw bytes become the list of its elements (after checking their length)."""
    if is_tensor(value) and isinstance(value.get("data"), bytes):
        array = check_tensor(value, where, "msgpack")
        return {
            **value,
            "data": array.reshape(-1).astype(np.float64).tolist()
            if array.dtype.kind == "f"
            else array.reshape(-1).tolist(),
        }
    if isinstance(value, dict):
        return {k: _bytes_to_lists(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_bytes_to_lists(v, f"{where}[{i}]") for i, v in enumerate(value)]
    assert not isinstance(value, bytes), f"{where}: bytes outside a tensor"
    return value


def walk_tensors(value: Any, where: str = "answer") -> Iterator[tuple[str, dict]]:
    if is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from walk_tensors(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk_tensors(v, f"{where}[{i}]")


# -- answers -------------------------------------------------------------------------


def check(
    response: httpx.Response, status: int | tuple[int, ...] = 200, encoding: str | None = None
) -> Any:
    """Check an answer against the spec; return its decoded body (tensors as sent:
    lists, base64 or bytes). `encoding` is the tensor encoding the answer must use."""
    request = response.request
    method = request.method
    tmpl = template(request.url.path)
    where = f"{method} {request.url.path}"
    wanted = (status,) if isinstance(status, int) else status
    assert response.status_code in wanted, (
        f"{where}: {response.status_code} (expected {wanted}): {response.text[:800]}"
    )
    declared = response_spec(method, tmpl, response.status_code)
    content = declared.get("content")
    if not content:
        assert response.content == b"", f"{where}: a body where the spec declares none"
        if 200 <= response.status_code < 300:
            COVERED.add((method, tmpl))
        return None
    ctype = response.headers.get("content-type", "").split(";")[0].strip()
    assert ctype in content, (
        f"{where}: answered {ctype!r}, the spec declares {sorted(content)} for "
        f"{response.status_code}"
    )
    if encoding == "msgpack" and MSGPACK in content:
        assert ctype == MSGPACK, f"{where}: a msgpack request answered {ctype}"
    schema = content[ctype].get("schema", {})
    if ctype == MSGPACK:
        body = msgpack.unpackb(response.content)
        document = _bytes_to_lists(body, "answer")
    elif ctype.endswith("json"):
        body = document = response.json()
    else:
        body = document = response.text
    validate(document, schema, f"{where} -> {response.status_code} {ctype}")
    for path, tensor in walk_tensors(body):
        check_tensor(tensor, f"{where}: {path}", encoding)
    if 200 <= response.status_code < 300:
        COVERED.add((method, tmpl))
    return body


def decode(tensor: dict[str, Any]) -> np.ndarray:
    return check_tensor(tensor, "tensor", None)
