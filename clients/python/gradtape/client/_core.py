"""The sans-I/O core shared by `Client` and `AsyncClient`.

Every operation is written once, as a generator that yields what it needs done (an
`HTTPRequest` to send, or a `Sleep` before a retry) and is sent back the `HTTPResponse`;
its return value is the decoded answer. The sync and async shells only drive these
generators with blocking or awaited I/O, so request building, retries, answer decoding
and error mapping exist in one place.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from . import _wire
from .errors import DefinitionError, GradtapeError, ServiceBusy, error_class, parse_retry_after
from .results import HVP, Execution, Gradient, Hessian, Jacobian, shaped

T = TypeVar("T")


@dataclass(frozen=True)
class HTTPRequest:
    method: str
    path: str
    headers: dict[str, str]
    content: bytes | None = None


@dataclass(frozen=True)
class HTTPResponse:
    status: int
    headers: Mapping[str, str]  # lower-case names
    content: bytes


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = HTTPRequest | Sleep
Op = Generator[Step, Any, T]


@dataclass(frozen=True)
class Retry:
    """How a 503 (every worker busy, the service starting) is retried: at most `attempts`
    requests in all; before each retry the client waits `backoff * 2**n` seconds (n = 0,
    1, ...), at least the server's Retry-After, at most `max_delay`, plus up to `jitter`
    of that at random; and it gives up (raising `ServiceBusy`) rather than wait past
    `max_wait` seconds in all. `Retry(attempts=1)` never retries."""

    attempts: int = 5
    backoff: float = 0.5
    max_delay: float = 30.0
    max_wait: float = 120.0
    jitter: float = 0.1

    def delay(self, retry: int, retry_after: float | None, waited: float) -> float | None:
        """Seconds to wait before retry number `retry` (0-based), or None to give up."""
        if retry + 1 >= self.attempts:
            return None
        wait = min(self.max_delay, max(self.backoff * 2**retry, retry_after or 0.0))
        wait *= 1.0 + self.jitter * random.random()
        if waited + wait > self.max_wait:
            return None
        return wait


@dataclass
class Core:
    """Builds requests and decodes answers; knows nothing of sockets."""

    transport: str = "msgpack"
    api_key: str | None = None
    retry: Retry = field(default_factory=Retry)
    # The most vectors the server takes in one product request (its hvp_max_vectors),
    # learned from its first refusal (a 422 too-large on `vectors` with `limit`); None
    # until then. RemoteTape splits larger blocks into chunks of it.
    hvp_max_vectors: int | None = None
    # The server's body limit (max_body_bytes), learned from its first 413 on a block of
    # product vectors (its `limit`); None until then. Blocks are then also split so each
    # request's vectors fit in it.
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("msgpack", "json"):
            raise ValueError(f"transport must be 'msgpack' or 'json', not {self.transport!r}")

    @property
    def binary(self) -> bool:
        return self.transport == "msgpack"

    def headers(self) -> dict[str, str]:
        out = {"accept": _wire.MSGPACK if self.binary else _wire.JSON}
        if self.api_key is not None:
            out["authorization"] = f"Bearer {self.api_key}"
        return out

    def request(
        self, method: str, path: str, body: Any = None, *, options: bool = True
    ) -> HTTPRequest:
        """`options`: the body takes request options (not so a dataset's map of arrays)."""
        headers = self.headers()
        content = None
        if body is not None:
            if options and not self.binary and isinstance(body, dict):
                body = {"response_encoding": "base64", **body}  # exact floats, fast
            content, headers["content-type"] = _wire.encode_body(body, self.binary)
        return HTTPRequest(method, path, headers, content)

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        definition: Any = None,
        options: bool = True,
    ) -> Op[Any]:
        """One API call, retried on 503 as `self.retry` says; the answer with its tensors
        as arrays, or the problem raised. `definition` (what was sent) lets a
        DefinitionError show the offending lines; `options` as in `request`."""
        request = self.request(method, path, body, options=options)
        waited = 0.0
        retry = 0
        while True:
            response: HTTPResponse = yield request
            if response.status != 503:
                break
            wait = self.retry.delay(
                retry, parse_retry_after(response.headers.get("retry-after")), waited
            )
            if wait is None:
                break
            yield Sleep(wait)
            waited += wait
            retry += 1
        if response.status >= 400:
            error = self.problem(response, definition)
            if isinstance(error, ServiceBusy):
                error.attempts = retry + 1
            raise error
        if response.status == 204 or not response.content:
            return None
        return _wire.from_wire(
            _wire.decode_body(response.content, response.headers.get("content-type", ""))
        )

    def compute(
        self,
        method: str,
        path: str,
        body: dict[str, Any],
        *,
        definition: Any = None,
        progress: Any = None,
        description: str = "",
    ) -> Op[Any]:
        """`call`, or with `progress` (True: a tqdm bar; a callable taking a JobStatus) the
        same request run as a server-side job, followed until it ends (jobs.follow); the
        answer is the same either way."""
        if progress is None or progress is False:
            return (yield from self.call(method, path, body, definition=definition))
        from .jobs import follow, reporter

        report, close = reporter(progress, description)
        try:
            doc = yield from self.call(method, path, {**body, "async": True}, definition=definition)
            return (yield from follow(self, doc, report))
        finally:
            close()

    @staticmethod
    def problem(response: HTTPResponse, definition: Any = None) -> GradtapeError:
        try:
            problem = _wire.decode_body(
                response.content, response.headers.get("content-type", "application/json")
            )
        except (ValueError, TypeError):  # not a problem document (a proxy's HTML page, ...)
            problem = None
        if not isinstance(problem, dict):
            text = response.content[:500].decode("utf-8", "replace")
            problem = {"status": response.status, "title": "HTTP error", "detail": text}
        problem.setdefault("status", response.status)
        cls = error_class(response.status, problem.get("type"))
        if cls is DefinitionError:
            definition = definition if isinstance(definition, Mapping) else {}
            program = definition.get("program")
            if isinstance(program, str):
                program = program.splitlines()
            return DefinitionError(
                problem,
                headers=response.headers,
                program=program,
                functions=definition.get("functions"),
            )
        return cls(problem, headers=response.headers)


# ------------------------------------------------------------------------------ bodies


def as_definition(definition: Any) -> dict[str, Any]:
    """A definition as a request body part: a dict (or a `Definition`, which is one)."""
    if not isinstance(definition, Mapping):
        raise TypeError(
            f"a definition is a dict (or gradtape.client.Definition), "
            f"not {type(definition).__name__}"
        )
    return dict(definition)


def compute_body(
    definition: Any, target: str, sources: Any, model: str | None, **options: Any
) -> dict[str, Any]:
    """The body of a stateless compute request (and of POST /v1/tapes)."""
    if (definition is None) == (model is None):
        raise TypeError("give a definition or a stored model's name (model=...), not both")
    body: dict[str, Any] = {"target": target}
    if definition is not None:
        body["definition"] = as_definition(definition)
    if model is not None:
        body["model"] = model
    if sources is not None:
        body["sources"] = list(sources) if isinstance(sources, tuple) else sources
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def flat_point(point: Any) -> np.ndarray | None:
    """A flat point over the sources as sent: one float64 vector (None stays None)."""
    return None if point is None else np.asarray(point, dtype=np.float64).reshape(-1)


def vector_of(vector: Any, sources: Any) -> dict[str, Any]:
    """A vector keyed by source: a dict as is; a bare array for a single source (str)."""
    if isinstance(vector, Mapping):
        return dict(vector)
    if isinstance(sources, str):
        return {sources: vector}
    raise TypeError(
        "a vector is a dict {source: array} (a bare array only with a single source name)"
    )


# ------------------------------------------------------------------ stateless operations


def gradient(
    core: Core,
    definition: Any,
    target: str,
    sources: Any,
    model: str | None,
    options: dict[str, Any],
) -> Op[Gradient]:
    body = compute_body(definition, target, sources, model, **options)
    a = yield from core.call("POST", "/v1/gradient", body, definition=definition)
    return Gradient.of(a, sources)


def jacobian(
    core: Core,
    definition: Any,
    target: str,
    sources: Any,
    model: str | None,
    options: dict[str, Any],
    progress: Any = None,
) -> Op[Jacobian]:
    body = compute_body(definition, target, sources, model, **options)
    a = yield from core.compute(
        "POST",
        "/v1/jacobian",
        body,
        definition=definition,
        progress=progress,
        description="jacobian",
    )
    return Jacobian.of(a, sources)


def hessian(
    core: Core,
    definition: Any,
    target: str,
    sources: Any,
    model: str | None,
    damping: float | None,
    options: dict[str, Any],
    progress: Any = None,
) -> Op[Hessian]:
    body = compute_body(definition, target, sources, model, **options)
    if damping is not None:
        body["newton"] = {"damping": damping}
    a = yield from core.compute(
        "POST", "/v1/hessian", body, definition=definition, progress=progress, description="hessian"
    )
    blocks = a["hessian"]
    if isinstance(sources, str):
        matrix = shaped({k: shaped(v, sources) for k, v in blocks.items()}, sources)
    else:
        matrix = blocks
    return Hessian(
        a["value"],
        shaped(a["gradients"], sources),
        matrix,
        shaped(a.get("newton_step"), sources),
        a.get("nonfinite"),
        blocks,
    )


def hvp(
    core: Core,
    definition: Any,
    target: str,
    vector: Any,
    vectors: Any,
    sources: Any,
    model: str | None,
    options: dict[str, Any],
) -> Op[HVP]:
    if (vector is None) == (vectors is None):
        raise TypeError("give vector= (one) or vectors= (several), not both")
    body = compute_body(definition, target, sources, model, **options)
    if vector is not None:
        body["vector"] = vector_of(vector, sources)
    else:
        body["vectors"] = [vector_of(v, sources) for v in vectors]
    a = yield from core.call("POST", "/v1/hvp", body, definition=definition)
    hvps = a.get("hvps")
    return HVP(
        a.get("value"),
        shaped(a.get("gradients"), sources),
        shaped(a.get("hvp"), sources),
        None if hvps is None else [shaped(h, sources) for h in hvps],
        a.get("nonfinite"),
        Execution.of(a),
    )


def arrays_equal(a: np.ndarray | None, b: np.ndarray) -> bool:
    return a is not None and a.shape == b.shape and bool(np.array_equal(a, b))
