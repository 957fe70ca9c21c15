"""The model store (`client.models`): definitions and ONNX files kept on the server
under a name, which requests then name with `model=` (a definition) or a definition's
`"models": {"net": {"stored": name}}` (an ONNX file).

    client.models.put("mlp", definition)             # POST /v1/models
    client.models.put_onnx("lenet", onnx_bytes)      # PUT /v1/models/lenet
    net = client.models.put_torch("resnet", module, example_inputs)   # gradtape.client.pytorch
    client.models.get("lenet")["trainable"]          # its parameters
    [m["name"] for m in client.models.list()]
    client.models.delete("lenet")
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from . import _wire
from ._core import HTTPRequest, HTTPResponse, Sleep
from .errors import parse_retry_after

if TYPE_CHECKING:
    from ._client import ApiMethods

ONNX = "application/onnx"


class Models:
    """The stored models of the client's API key (`client.models`)."""

    def __init__(self, client: ApiMethods):
        self._client = client
        self._core = client._core

    def _path(self, name: str) -> str:
        return f"/v1/models/{quote(name, safe='')}"

    def put(
        self, name: str, definition: Any, *, description: str | None = None, replace: bool = True
    ) -> Any:
        """Store a definition under `name` (replacing one of that name unless
        `replace=False`, then a `Conflict`); answers its record (variables, inputs,
        trainable). Requests then send `model=name` instead of the definition."""
        body = {"name": name, "definition": definition, "replace": replace}
        if description is not None:
            body["description"] = description
        op = self._core.call("POST", "/v1/models", body, definition=definition)
        return self._client._run(op)

    def _put_onnx_op(
        self, name: str, data: bytes, description: str | None
    ) -> Generator[Any, Any, Any]:
        path = self._path(name)
        if description is not None:
            path += "?" + urlencode({"description": description})
        headers = {**self._core.headers(), "content-type": ONNX}
        request = HTTPRequest("PUT", path, headers, bytes(data))
        waited, retry = 0.0, 0
        while True:  # 503: retried as the client's Retry says, like every other call
            response: HTTPResponse = yield request
            if response.status != 503:
                break
            wait = self._core.retry.delay(
                retry, parse_retry_after(response.headers.get("retry-after")), waited
            )
            if wait is None:
                break
            yield Sleep(wait)
            waited += wait
            retry += 1
        if response.status >= 400:
            raise self._core.problem(response)
        return _wire.from_wire(
            _wire.decode_body(response.content, response.headers.get("content-type", ""))
        )

    def put_onnx(self, name: str, data: bytes, *, description: str | None = None) -> Any:
        """Store an .onnx file under `name` (replacing one of that name); the server
        checks it first (an unsupported node or an invalid file is an `InvalidRequest`
        listing them). Answers its record: `trainable` lists the initializers that are
        parameters."""
        return self._client._run(self._put_onnx_op(name, data, description))

    def put_torch(self, name: str, module: Any, example_inputs: Any, **options: Any) -> Any:
        """Export a PyTorch module with every parameter kept as itself, check the
        server's forward against the module's, and store it under `name`: a
        `TorchModel` that `client.tape(...)` takes in place of the module (see
        `gradtape.client.pytorch`). Needs the `torch` extra."""
        from .pytorch import put_torch

        return put_torch(self._client, name, module, example_inputs, **options)

    def get(self, name: str) -> Any:
        """A stored model's record: variables, inputs, line types, `trainable`."""
        return self._client._run(self._core.call("GET", self._path(name)))

    def _list_op(self) -> Generator[Any, Any, list[Any]]:
        answer = yield from self._core.call("GET", "/v1/models")
        return list(answer["models"])

    def list(self) -> Any:
        """This key's stored models (their records, by name)."""
        return self._client._run(self._list_op())

    def delete(self, name: str) -> Any:
        """Forget a stored model (tapes recorded from it keep their copy); a
        `ModelNotFound` when there is none of that name."""
        return self._client._run(self._core.call("DELETE", self._path(name)))
