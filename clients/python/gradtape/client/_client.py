"""`Client` and `AsyncClient`: thin shells over the sans-I/O core.

Each API method is written once, in `ApiMethods`, as "run this core operation"; `Client`
runs operations with blocking httpx calls and answers values, `AsyncClient` with awaited
ones and answers awaitables. One `httpx.Client` / `httpx.AsyncClient` per client keeps
connections alive across calls.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Generator, Mapping
from typing import Any, Self
from urllib.parse import quote

import httpx
import numpy as np

from . import _core
from ._core import HTTPRequest, HTTPResponse, Retry, Sleep, flat_point
from .curvature import per_example_op
from .jobs import Job, JobStatus
from .models import Models
from .results import STRICT
from .tape import RemoteTape

# Long enough for a computation at the server's default max_time_limit (300 s).
DEFAULT_TIMEOUT = httpx.Timeout(330.0, connect=10.0)


class ApiMethods:
    """The API, once for both clients. `_run(op)` is the value (Client) or an awaitable
    of it (AsyncClient)."""

    _core: _core.Core
    is_async = False

    def _run(self, op: Generator[Any, Any, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    # --------------------------------------------------------------------- stateless

    def gradient(
        self,
        definition: Any = None,
        target: str = "",
        sources: Any = None,
        *,
        model: str | None = None,
        unconnected: str | None = None,
        allow_unused: bool | None = None,
        allow_nonfinite: bool | None = None,
        time_limit: float | None = None,
        shards: int | None = None,
        shard_by: Any = None,
        shard_reduction: str | None = None,
    ) -> Any:
        """The target's value and gradients (`Gradient`: `value, grads = ...`). `sources`:
        None (every trainable variable; a dict by name), a list of names (a dict by
        name), a dict alias -> name (a dict by alias) or one name (the array).
        `shards=n` splits the batch over n workers (see `tape`)."""
        options = {
            "unconnected": unconnected,
            "allow_unused": allow_unused,
            "allow_nonfinite": allow_nonfinite,
            "time_limit": time_limit,
            **_sharding(shards, shard_by, shard_reduction),
        }
        return self._run(_core.gradient(self._core, definition, target, sources, model, options))

    def per_example(
        self,
        definition: Any = None,
        target: str = "",
        sources: Any = None,
        *,
        output: str,
        gradients: bool = False,
        model: str | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """Per-example gradients' statistics (`PerExample`; the gradients too with
        `gradients=True`) of a definition or stored `model` whose `output` line holds the
        examples along its first axis, in one batched pass, nothing kept (as
        `tape.per_example()`)."""
        options = {"output": output, "gradients": gradients, "time_limit": time_limit}
        return self._run(
            per_example_op(self._core, definition, target, sources, model, options, progress)
        )

    def jacobian(
        self,
        definition: Any = None,
        target: str = "",
        sources: Any = None,
        *,
        batch: bool = False,
        model: str | None = None,
        unconnected: str | None = None,
        allow_unused: bool | None = None,
        allow_nonfinite: bool | None = None,
        time_limit: float | None = None,
        progress: Any = False,
        flat: bool = False,
    ) -> Any:
        """The target's value and jacobians (`Jacobian`), each of shape
        target.shape + source.shape (per example with batch=True). `flat=True`: one
        float64 matrix [target size, n] over the sources in `Jacobian.order` (SciPy's
        least_squares `jac`). `progress=True` runs it as a server-side job (see
        `RemoteTape.eigenvalues`)."""
        options = {
            "batch": batch or None,
            "flat": flat or None,
            "unconnected": unconnected,
            "allow_unused": allow_unused,
            "allow_nonfinite": allow_nonfinite,
            "time_limit": time_limit,
        }
        return self._run(
            _core.jacobian(self._core, definition, target, sources, model, options, progress)
        )

    def hessian(
        self,
        definition: Any = None,
        target: str = "",
        sources: Any = None,
        *,
        newton_damping: float | None = None,
        model: str | None = None,
        allow_unused: bool | None = None,
        allow_nonfinite: bool | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """Value, gradients and the Hessian blocks (`Hessian`; `.matrix()` is the dense
        float64 matrix); with newton_damping, also the damped Newton step. `progress=True`
        runs it as a server-side job with a bar of the Hessian's rows."""
        options = {
            "allow_unused": allow_unused,
            "allow_nonfinite": allow_nonfinite,
            "time_limit": time_limit,
        }
        return self._run(
            _core.hessian(
                self._core, definition, target, sources, model, newton_damping, options, progress
            )
        )

    def hvp(
        self,
        definition: Any = None,
        target: str = "",
        vector: Any = None,
        *,
        vectors: Any = None,
        sources: Any = None,
        model: str | None = None,
        allow_unused: bool | None = None,
        allow_nonfinite: bool | None = None,
        time_limit: float | None = None,
        shards: int | None = None,
        shard_by: Any = None,
        shard_reduction: str | None = None,
    ) -> Any:
        """H v without keeping a tape (`HVP`: `.hvp`), or [H v_i] for `vectors=` in one
        batched pass (`.hvps`). A vector is a tensor per source (a bare array with a
        single source name). `shards=n` splits the batch over n workers (see `tape`)."""
        options = {
            "allow_unused": allow_unused,
            "allow_nonfinite": allow_nonfinite,
            "time_limit": time_limit,
            **_sharding(shards, shard_by, shard_reduction),
        }
        return self._run(
            _core.hvp(self._core, definition, target, vector, vectors, sources, model, options)
        )

    # ------------------------------------------------------------------------- tapes

    def _tape_op(
        self, definition: Any, target: str, sources: Any, model: str | None, options: dict[str, Any]
    ) -> Generator[Any, Any, RemoteTape]:
        body = _core.compute_body(definition, target, sources, model, **options)
        answer = yield from self._core.call("POST", "/v1/tapes", body, definition=definition)
        tape = RemoteTape(self, answer, definition, target, sources)
        if options.get("point") is not None:  # recorded there: fun/jac/hessp start from it
            tape._x = options["point"]
        return tape

    def tape(
        self,
        definition: Any = None,
        target: str = "",
        sources: Any = None,
        *,
        ttl: float | None = None,
        model: str | None = None,
        variables: Mapping[str, Any] | None = None,
        point: Any = None,
        output: str | None = None,
        allow_nonfinite: bool | None = None,
        time_limit: float | None = None,
        shards: int | None = None,
        shard_by: Any = None,
        shard_reduction: str | None = None,
        loss: Any = None,
        data: Any = None,
        example_inputs: Any = None,
    ) -> Any:
        """Record a tape on the server (`RemoteTape`, a context manager that deletes it on
        exit): `with client.tape(d, "loss") as tape:` (async: `async with await
        client.tape(d, "loss") as tape:`). A stored `model` may be recorded at new values
        of some `variables` (by name), or of all its sources at once as one flat `point`
        (in the order `tape.sources` then lists). `output` names the program line of the
        model's output (the loss's lines follow it): the tape then answers the
        Gauss-Newton and Fisher curvatures (`curvature=` on its methods) and `influence`.
        `shards=n` splits the batch (the inputs `shard_by` names, default every input with
        an axis) over n workers; `shard_reduction` says how the parts add up ("mean" for a
        mean loss, "sum" for a sum; left out, the server reads it from the target's line,
        or asks for it): every answer equals the unsharded one.

        A PyTorch `nn.Module` (or a `TorchModel` from `models.put_torch`) in place of the
        definition: `client.tape(model, loss="cross_entropy", data=(X, y))` bridges it
        (`gradtape.client.pytorch`: every parameter kept as itself, the forward checked
        against torch's) and answers a `TorchTape` keyed by torch names; `output` then
        names the module output a built-in loss reads (needed when it has several)."""
        if loss is not None or data is not None or _is_torch_model(definition):
            from . import pytorch

            bridged = {
                "ttl": ttl,
                "output": output,
                "time_limit": time_limit,
                "allow_nonfinite": allow_nonfinite,
                **_sharding(shards, shard_by, shard_reduction),
            }
            return pytorch.tape_op(
                self,
                definition,
                loss=loss,
                data=data,
                example_inputs=example_inputs,
                **{k: v for k, v in bridged.items() if v is not None},
            )
        options = {
            "ttl": ttl,
            "allow_nonfinite": allow_nonfinite,
            "time_limit": time_limit,
            "output": output,
            "variables": None if variables is None else dict(variables),
            "point": flat_point(point),
            **_sharding(shards, shard_by, shard_reduction),
        }
        return self._run(self._tape_op(definition, target, sources, model, options))

    # ----------------------------------------------------------------------- datasets

    def _dataset_op(self, name: str, arrays: Mapping[str, Any]) -> Generator[Any, Any, Any]:
        body = {k: np.asarray(v) for k, v in arrays.items()}
        return (yield from self._core.call("PUT", f"/v1/datasets/{name}", body, options=False))

    def put_dataset(self, name: str, arrays: Mapping[str, Any]) -> Any:
        """Store (or replace) a dataset of named arrays on the server, in their own
        dtypes: definitions and tapes then bind inputs to it (`dataset(name, ...)`) and
        requests carry only the parameters. Answers its record (arrays, bytes, version)."""
        return self._run(self._dataset_op(name, arrays))

    def _delete_dataset_op(self, name: str) -> Generator[Any, Any, Any]:
        return (yield from self._core.call("DELETE", f"/v1/datasets/{name}"))

    def delete_dataset(self, name: str) -> Any:
        """Delete a stored dataset (tapes recorded on it keep the arrays they were bound
        to)."""
        return self._run(self._delete_dataset_op(name))

    def _get_op(self, path: str) -> Generator[Any, Any, Any]:
        return (yield from self._core.call("GET", path))

    def _list_datasets_op(self) -> Generator[Any, Any, list[Any]]:
        answer = yield from self._core.call("GET", "/v1/datasets")
        return list(answer["datasets"])

    def list_datasets(self) -> Any:
        """This key's stored datasets (name, version, bytes, arrays: dtype and shape)."""
        return self._run(self._list_datasets_op())

    def dataset_info(self, name: str) -> Any:
        """One stored dataset's record (GET /v1/datasets/{name})."""
        return self._run(self._get_op(f"/v1/datasets/{quote(name, safe='')}"))

    @property
    def models(self) -> Models:
        """The model store: `put`, `put_onnx`, `put_torch`, `get`, `list`, `delete`."""
        return Models(self)

    def tapes(self) -> Any:
        """This key's live tapes (GET /v1/tapes)."""
        return self._run(self._get_op("/v1/tapes"))

    # -------------------------------------------------------------------------- jobs

    def job(self, job_id: str) -> Job:
        """A server-side job by id (`Job`: `.status()`, `.wait(progress=True)`,
        `.cancel()`)."""
        return Job(self, job_id)

    def _jobs_op(self) -> Generator[Any, Any, list[JobStatus]]:
        answer = yield from self._core.call("GET", "/v1/jobs")
        return [JobStatus.of(doc) for doc in answer["jobs"]]

    def jobs(self) -> Any:
        """This key's jobs (`JobStatus` each, oldest first): running ones and those that
        ended recently."""
        return self._run(self._jobs_op())

    # ------------------------------------------------------------------ around them

    def ready(self) -> Any:
        """GET /readyz: every worker's state (raises ServiceBusy while not ready)."""
        return self._run(self._get_op("/readyz"))

    def ops(self) -> Any:
        """The op catalogue (GET /v1/ops)."""
        return self._run(self._get_op("/v1/ops"))


def _response(r: httpx.Response) -> HTTPResponse:
    return HTTPResponse(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)


def _client_options(url: str, timeout: Any) -> dict[str, Any]:
    return {"base_url": url.rstrip("/"), "timeout": timeout}


class Client(ApiMethods):
    """A synchronous gradtape client.

    `Client(url, api_key=None, transport="msgpack" | "json", timeout=..., retry=Retry())`;
    `with Client(...) as client:` closes its connections at the end. msgpack sends tensors
    as raw bytes; json as base64 (both exact). Every error answer raises a
    `GradtapeError`; a 503 is retried first as `retry` says. An answer whose `converged`
    is false warns (`UnconvergedWarning`, naming why it stopped); with `strict=True` it
    raises `Unconverged` instead.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        transport: str = "msgpack",
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        retry: Retry | None = None,
        http: httpx.Client | None = None,
        strict: bool = False,
    ):
        self._core = _core.Core(transport, api_key, retry or Retry())
        self._http = http or httpx.Client(**_client_options(url, timeout))
        self.strict = strict

    def _send(self, request: HTTPRequest) -> HTTPResponse:
        r = self._http.request(
            request.method, request.path, headers=request.headers, content=request.content
        )
        return _response(r)

    def _run(self, op: Generator[Any, Any, Any]) -> Any:
        reply: Any = None
        interrupt: BaseException | None = None
        strict = STRICT.set(self.strict)  # read where an answer is built (results.py)
        try:
            while True:
                # A Ctrl-C during I/O goes into the operation, so that it can clean up
                # (a job cancels itself on the server) before it propagates.
                step = op.throw(interrupt) if interrupt is not None else op.send(reply)
                interrupt = None
                try:
                    if isinstance(step, Sleep):
                        time.sleep(step.seconds)
                        reply = None
                    else:
                        reply = self._send(step)
                except KeyboardInterrupt as exc:
                    interrupt = exc
        except StopIteration as done:
            return done.value
        finally:
            STRICT.reset(strict)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(ApiMethods):
    """The asyncio twin of `Client`: the same methods, each answering an awaitable
    (`await client.gradient(...)`); `async with AsyncClient(...) as client:`."""

    is_async = True

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        transport: str = "msgpack",
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        retry: Retry | None = None,
        http: httpx.AsyncClient | None = None,
        strict: bool = False,
    ):
        self._core = _core.Core(transport, api_key, retry or Retry())
        self._http = http or httpx.AsyncClient(**_client_options(url, timeout))
        self.strict = strict

    async def _send(self, request: HTTPRequest) -> HTTPResponse:
        r = await self._http.request(
            request.method, request.path, headers=request.headers, content=request.content
        )
        return _response(r)

    async def _drive(self, op: Generator[Any, Any, Any]) -> Any:
        reply: Any = None
        interrupt: BaseException | None = None
        strict = STRICT.set(self.strict)  # this task's context only
        try:
            while True:
                # A cancelled task's CancelledError goes into the operation first (a job
                # cancels itself on the server), as Client does with Ctrl-C.
                step = op.throw(interrupt) if interrupt is not None else op.send(reply)
                interrupt = None
                try:
                    if isinstance(step, Sleep):
                        await asyncio.sleep(step.seconds)
                        reply = None
                    else:
                        reply = await self._send(step)
                except (asyncio.CancelledError, KeyboardInterrupt) as exc:
                    interrupt = exc
        except StopIteration as done:
            return done.value
        finally:
            STRICT.reset(strict)

    def _run(self, op: Generator[Any, Any, Any]) -> Any:
        return self._drive(op)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AsyncClient", "Client", "Retry"]


def _is_torch_model(obj: Any) -> bool:
    """A torch nn.Module (without importing torch when the caller has not) or a
    bridged TorchModel."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return True
    bridge = sys.modules.get(__package__ + ".pytorch")
    return bridge is not None and isinstance(obj, bridge.TorchModel)


def _sharding(shards: int | None, shard_by: Any, reduction: str | None) -> dict[str, Any]:
    """The request's sharding fields (None ones are left out of the body)."""
    return {
        "shards": shards,
        "shard_by": shard_by if shard_by is None or isinstance(shard_by, str) else list(shard_by),
        "shard_reduction": reduction,
    }
