"""Test helpers: tensors to and from the wire, and posting a request."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import msgpack
import numpy as np

PROBLEM_JSON = "application/problem+json"
MSGPACK = "application/msgpack"


def t(value: Any, dtype: str = "float32") -> dict[str, Any]:
    """A {dtype, shape, data} tensor (flat data)."""
    array = np.asarray(value, dtype=dtype)
    return {"dtype": dtype, "shape": list(array.shape), "data": array.reshape(-1).tolist()}


def t64(value: Any, dtype: str = "float32") -> dict[str, Any]:
    """A {dtype, shape, base64} tensor."""
    array = np.asarray(value, dtype=dtype)
    raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return {"dtype": dtype, "shape": list(array.shape), "base64": base64.b64encode(raw).decode()}


def tbin(value: Any, dtype: str = "float32") -> dict[str, Any]:
    """A {dtype, shape, data: bytes} tensor, for msgpack bodies."""
    array = np.asarray(value, dtype=dtype)
    return {
        "dtype": dtype,
        "shape": list(array.shape),
        "data": array.astype(array.dtype.newbyteorder("<")).tobytes(),
    }


def arr(tensor: dict[str, Any] | None) -> np.ndarray | None:
    """A wire tensor (any encoding) as a NumPy array."""
    if tensor is None:
        return None
    dtype = np.dtype(tensor["dtype"]).newbyteorder("<")
    if "base64" in tensor:
        return np.frombuffer(base64.b64decode(tensor["base64"]), dtype).reshape(tensor["shape"])
    data = tensor["data"]
    if isinstance(data, bytes):
        return np.frombuffer(data, dtype).reshape(tensor["shape"])
    return (
        np.asarray(data, dtype=np.float64 if dtype.kind == "f" else dtype)
        .astype(dtype)
        .reshape(tensor["shape"])
    )


def num(tensor: dict[str, Any] | None) -> float | None:
    return None if tensor is None else float(arr(tensor).reshape(()))


def nums(tensors: dict[str, Any]) -> dict[str, float | None]:
    return {k: num(v) for k, v in tensors.items()}


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith(MSGPACK):
        return msgpack.unpackb(response.content)
    return response.json()


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return ok(client.post(path, json=body))


def post_msgpack(
    client: httpx.Client, path: str, body: dict[str, Any], accept: str = MSGPACK
) -> httpx.Response:
    return client.post(
        path,
        content=msgpack.packb(body, use_bin_type=True),
        headers={"content-type": MSGPACK, "accept": accept},
    )


def problem(response: httpx.Response, status: int, type_: str | None = None) -> dict[str, Any]:
    """Assert an RFC 9457 problem response and return its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    body = response.json()
    assert body["status"] == status
    assert body["title"] and body["detail"]
    assert "type" in body and "instance" in body
    if type_ is not None:
        assert body["type"] == f"/problems/{type_}", body
    return body


def dense(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray, act: str = "relu") -> np.ndarray:
    """act(x @ kernel + bias) in NumPy, for reference values."""
    z = x @ kernel + bias
    if act == "relu":
        return np.maximum(z, 0)
    if act == "elu":
        return np.where(z > 0, z, np.expm1(np.minimum(z, 0)))
    if act == "tanh":
        return np.tanh(z)
    raise ValueError(act)


def without_execution(answer: dict) -> dict:
    """An answer but its `execution`, which says how the worker that answered ran its
    passes: the second request of a layout on a worker is captured where the first ran
    dynamically, so two equal answers may differ there (which worker answers, and what it
    ran before, is the scheduler's). (A Hessian's answer has none.)"""
    return {k: v for k, v in answer.items() if k != "execution"}


def tape_and_hvp(base_url: str, body: dict, vector: dict) -> tuple[float, dict, dict]:
    """Record a tape from `body` over HTTP (base64 answers), ask one HVP of `vector`,
    delete the tape: (value, gradients, hvp) as float64 arrays by source."""
    with httpx.Client(base_url=base_url, timeout=120) as http:
        made = http.post("/v1/tapes", json={**body, "response_encoding": "base64"})
        assert made.status_code == 201, made.text
        tape = made.json()
        hvp = http.post(
            f"/v1/tapes/{tape['tape_id']}/hvp",
            json={"vector": vector, "response_encoding": "base64"},
        )
        assert hvp.status_code == 200, hvp.text
        http.delete(f"/v1/tapes/{tape['tape_id']}")
    grads = {n: arr(g) for n, g in tape["gradients"].items()}
    return float(arr(tape["value"])), grads, {n: arr(h) for n, h in hvp.json()["hvp"].items()}
