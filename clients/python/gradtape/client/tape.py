"""A tape kept on the server: its forward pass and gradient recorded once, then HVPs,
curvature estimates, influence functions and SciPy operators over it.

Every product and estimate takes `curvature`: "hessian" (the default), or, on a tape
recorded with `output=`, "ggn" (Gauss-Newton), "fisher" (exact for cross-entropy and
squared error; Monte-Carlo with `samples=`) or "empirical_fisher".

`RemoteTape` serves both clients: with a `Client` its methods answer values, with an
`AsyncClient` awaitables (`await tape.hvp(v)`), and it is a context manager of both kinds
(`with` / `async with`) that deletes the tape on exit.

The parameters, flattened: the tape's sources in the order of `tape.sources` (the order
the server answered its gradients: the `sources` as given, or the definition's trainable
variables in definition order), each raveled row-major, as one float64 vector.
`flatten`, `unflatten`, `linear_operator`, `fun`, `jac` and `hessp` use that order.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self, TypedDict, Unpack

import numpy as np

from . import _core, _wire
from .curvature import CurvatureMethods
from .errors import TapeGone, TooLarge
from .results import (
    CurvatureUsed,
    Diagonal,
    Eigenvalues,
    Execution,
    Gradient,
    Influence,
    Jacobian,
    Solve,
    SpectralDensity,
    Trace,
    check_approximate,
    check_converged,
    check_estimated,
    shaped,
)

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

    from ._client import ApiMethods


class CurvatureOptions(TypedDict, total=False):
    """Which matrix a product or estimate uses (the module's docstring), and the
    request's time limit."""

    curvature: str
    samples: int
    fisher_seed: int
    time_limit: float


class EstimatorOptions(CurvatureOptions, total=False):
    """The options of the stochastic estimators (trace, diagonal, Frobenius norm), each
    the server's default when left out: `batch_size` random vectors per batched pass,
    at most `max_hvps` HVPs and `max_seconds`, stopping once the standard error is within
    `rtol` * |estimate| + `atol`; `seed` of the random vectors (None: fresh ones; default
    0)."""

    batch_size: int
    max_hvps: int
    rtol: float
    atol: float
    max_seconds: float
    seed: int | None


class RemoteTape(CurvatureMethods):
    """A recorded tape on the server (made by `client.tape(...)`); per-example
    gradients, KFAC and Laplace fits come from CurvatureMethods (curvature.py)."""

    def __init__(
        self, client: ApiMethods, answer: dict[str, Any], definition: Any, target: str, sources: Any
    ):
        self._client = client
        self._core: _core.Core = client._core
        self.id: str = answer["tape_id"]
        self.target = target
        self._definition = definition
        self._sources = sources
        self._deleted = False
        self._x: np.ndarray | None = None
        self._set(answer)
        keys = list(answer["gradients"])
        if isinstance(sources, Mapping):
            self._names = {k: sources.get(k, k) for k in keys}
        else:
            self._names = {k: k for k in keys}
        self._x = self._initial_point()

    # ------------------------------------------------------------------ state and shape

    def _set(self, answer: dict[str, Any]) -> None:
        self._answer = answer
        self.value: np.ndarray = answer["value"]
        self._gradients: dict[str, np.ndarray] = answer["gradients"]
        self.bytes: int = answer.get("bytes", 0)
        self.ttl: float = answer.get("ttl", 0.0)
        self.expires_at: str = answer.get("expires_at", "")
        self.device: str = answer.get("device", "")
        self.nonfinite: list[str] | None = answer.get("nonfinite")
        # How the server ran the last HVP's passes (hvp, hvp_many, linear_operator).
        self.execution: Execution | None = None

    @property
    def gradients(self) -> Any:
        """The gradients at the recorded point, in the sources' structure."""
        return shaped(self._gradients, self._sources)

    @property
    def sources(self) -> list[str]:
        """The source keys (names, or aliases) in flattening order."""
        return list(self._gradients)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(g.shape) for k, g in self._gradients.items()}

    @property
    def size(self) -> int:
        """n: the number of parameters, flattened."""
        return sum(int(g.size) for g in self._gradients.values())

    def flatten(self, values: Mapping[str, Any]) -> np.ndarray:
        """A tensor per source -> one float64 vector (in `sources` order)."""
        return np.concatenate(
            [np.asarray(values[k], dtype=np.float64).reshape(-1) for k in self._gradients]
            or [np.zeros(0)]
        )

    def unflatten(self, x: Any, dtype: Any = np.float64) -> dict[str, np.ndarray]:
        """One vector (length `size`) -> a tensor per source, of `dtype` (None: each
        source's own dtype)."""
        x = np.asarray(x).reshape(-1)
        if x.size != self.size:
            raise ValueError(f"expected {self.size} parameters, got {x.size}")
        out, start = {}, 0
        for k, g in self._gradients.items():
            part = x[start : start + g.size].reshape(g.shape)
            out[k] = part.astype(g.dtype if dtype is None else dtype)
            start += g.size
        return out

    def _vector(self, v: Any) -> dict[str, Any]:
        return _core.vector_of(v, self._sources)

    def _initial_point(self) -> np.ndarray | None:
        """The recorded point, flattened, where the definition sent shows it."""
        definition = self._definition
        if not isinstance(definition, Mapping):
            return None
        values = {}
        for key, name in self._names.items():
            for section in ("variables", "inputs"):
                spec = (definition.get(section) or {}).get(name)
                if spec is not None:
                    break
            else:
                return None
            if isinstance(spec, Mapping) and "value" in spec:
                spec = spec["value"]
            if isinstance(spec, Mapping):
                if not _wire.is_tensor(spec):
                    return None
                spec = _wire.from_tensor(spec)
            values[key] = spec
        try:
            return self.flatten(values)
        except (ValueError, TypeError):
            return None

    def _split_names(self, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """New values by name (or alias) -> {"variables": ..., "inputs": ...} as the
        definition sent has them (unknown names go to variables: the server says)."""
        inputs = set()
        if isinstance(self._definition, Mapping):
            inputs = set(self._definition.get("inputs") or {})
        body: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            name = self._names.get(key, key)
            section = "inputs" if name in inputs else "variables"
            body.setdefault(section, {})[name] = value
        return body

    def _run(self, op: Any) -> Any:
        return self._client._run(op)

    def _path(self, tail: str = "") -> str:
        return f"/v1/tapes/{self.id}{tail}"

    @staticmethod
    def _options(**options: Any) -> dict[str, Any]:
        return {k: v for k, v in options.items() if v is not None}

    # -------------------------------------------------------------------------- calls

    def call(self, operation: str, *, progress: Any = False, **options: Any) -> Any:
        """Any operation on the tape by its path: POST /v1/tapes/{id}/<operation> (e.g.
        "trace", "frobenius-norm") with `options` as its body (None ones left out, but an
        explicit `seed=None`: fresh random vectors), run as a job with `progress` as in
        `eigenvalues`. Answers the JSON answer as a dict (one whose `converged` is false
        warns, or raises under strict, as the typed results do). The named methods below
        are this call with their options named and their answers typed."""
        return self._run(self._call_op(operation, self._body(options), progress))

    def _call_op(self, operation: str, body: dict[str, Any], progress: Any) -> _core.Op[Any]:
        answer = yield from self._ask(operation, body, progress)
        check_converged(operation, answer)  # the dict warns as typed results do
        return answer

    def _ask(self, operation: str, body: dict[str, Any], progress: Any = None) -> _core.Op[Any]:
        answer = yield from self._core.compute(
            "POST",
            self._path("/" + operation),
            body,
            progress=progress,
            description=operation.replace("-", " "),
        )
        check_approximate(f"the {operation.replace('-', ' ')}", answer)
        check_estimated(f"the {operation}", answer)  # (a trace's or diagonal's)
        return answer

    @staticmethod
    def _body(options: Mapping[str, Any]) -> dict[str, Any]:
        body = RemoteTape._options(**options)
        if "seed" in options:  # None asks for fresh random vectors: sent as null
            body["seed"] = options["seed"]
        return body

    def _hvp_op(self, body: dict[str, Any], shape: bool = True) -> _core.Op[Any]:
        a = yield from self._core.call("POST", self._path("/hvp"), body)
        self.execution = Execution.of(a)
        check_approximate("the product", a)
        sources = self._sources if shape else None
        if a.get("hvps") is not None:
            return [shaped(h, sources) for h in a["hvps"]]
        return shaped(a["hvp"], sources)

    def _hvp_chunks_op(
        self, vectors: list[Any], extra: dict[str, Any], shape: bool = True
    ) -> _core.Op[list[Any]]:
        """[H v_i] for any number of vectors: one request while the server takes them
        all, else chunks of its hvp_max_vectors (learned from its 422, kept on the core
        for later calls) and of as many vectors as fit its body limit (learned from its
        413: `linear_operator() @ np.eye(n)` of a few thousand parameters is more than
        64 MiB of vectors), their answers in order."""
        out: list[Any] = []
        while len(out) < len(vectors):
            rest = vectors[len(out) :]
            size = min(len(rest), self._chunk_size(rest[0]))
            chunk = rest[:size]
            try:
                answers = yield from self._hvp_op({"vectors": chunk, **extra}, shape)
            except TooLarge as exc:
                learned = _vectors_limit(exc)
                if learned is not None and learned < len(chunk):
                    self._core.hvp_max_vectors = learned
                    continue
                body_limit = exc.problem.get("limit")
                if exc.slug == "body-too-large" and isinstance(body_limit, int) and size > 1:
                    fewer = self._core.max_body_bytes is not None
                    self._core.max_body_bytes = body_limit
                    if fewer or self._chunk_size(chunk[0]) >= size:  # the estimate is off:
                        self._core.max_body_bytes = _vector_bytes(chunk[0]) * (size // 2)
                    continue
                raise
            out.extend(answers)
        return out

    def _chunk_size(self, vector: Any) -> int:
        """The most vectors like this one a request may carry: the server's
        hvp_max_vectors and, once learned, its body limit (with room for the rest of
        the body and base64's third under JSON)."""
        limit = self._core.hvp_max_vectors or sys.maxsize
        if self._core.max_body_bytes is not None:
            each = _vector_bytes(vector) * (1 if self._core.binary else 4 / 3) + 256
            limit = min(limit, int(0.9 * self._core.max_body_bytes / each))
        return max(1, limit)

    @staticmethod
    def _curvature(
        curvature: str | None, samples: int | None, fisher_seed: int | None
    ) -> dict[str, Any]:
        return RemoteTape._options(curvature=curvature, samples=samples, fisher_seed=fisher_seed)

    def hvp(
        self,
        v: Any,
        *,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        time_limit: float | None = None,
    ) -> Any:
        """H v at the recorded point: one second-order pass (or the product with another
        `curvature`, see the module). `v` is a tensor per source (a bare array with a
        single source name); the answer is in the same structure."""
        return self._run(
            self._hvp_op(
                {
                    "vector": self._vector(v),
                    **self._curvature(curvature, samples, fisher_seed),
                    **self._options(time_limit=time_limit),
                }
            )
        )

    def hvp_many(
        self,
        vectors: Any,
        *,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        time_limit: float | None = None,
    ) -> list[Any]:
        """[H v_i] for several vectors in one batched pass (one request; more vectors
        than the server's hvp_max_vectors, or than fit in its body limit, go in chunks,
        one request each)."""
        return self._run(
            self._hvp_chunks_op(
                [self._vector(v) for v in vectors],
                {
                    **self._curvature(curvature, samples, fisher_seed),
                    **self._options(time_limit=time_limit),
                },
            )
        )

    def _update_op(self, body: dict[str, Any], x: np.ndarray | None) -> _core.Op[RemoteTape]:
        a = yield from self._core.call("PATCH", self._path(), body, definition=self._definition)
        self._set(a)
        self._x = x
        return self

    def update(
        self,
        values: Mapping[str, Any] | None = None,
        /,
        *,
        point: Any = None,
        inputs: Mapping[str, Any] | None = None,
        time_limit: float | None = None,
        **new_values: Any,
    ) -> Any:
        """Record the tape again at new values of some variables (or inputs), by name:
        `tape.update(w=w_new)`, or of every source as one flat `point` (in `sources`
        order); value and gradients are then the new ones. Values are cast to the
        recorded dtypes by the server. `inputs`: new data by input name, or bindings to
        stored datasets (`dataset("d", "X", rows=...)` per input, or `dataset("d",
        rows=...)` for every array of a dataset): the next mini-batch without sending
        it. Answers the tape."""
        merged = {**(values or {}), **new_values}
        body: dict[str, Any] = {**self._split_names(merged), **self._options(time_limit=time_limit)}
        if inputs is not None:
            if "dataset" in inputs:  # every array of a dataset: the form is the binding
                if body.get("inputs"):
                    raise TypeError(
                        "inputs=dataset(...) binds every input of a dataset; give "
                        "other inputs as dataset(..., array) per input instead"
                    )
                body["inputs"] = dict(inputs)
            else:
                body["inputs"] = {**body.get("inputs", {}), **inputs}
        x = None
        if point is not None:
            if merged:
                raise TypeError("give a flat point or values by name, not both")
            x = body["point"] = _core.flat_point(point)
        elif not merged:  # only data moved: the parameters are where they were
            x = self._x
        elif self._x is not None and set(merged) >= set(self._gradients):
            try:
                x = self.flatten(merged)
            except (ValueError, TypeError):
                x = None
        return self._run(self._update_op(body, x))

    def _info_op(self) -> _core.Op[dict[str, Any]]:
        return (yield from self._core.call("GET", self._path()))

    def info(self) -> Any:
        """The tape's record on the server (GET): hits, bytes, expiry, worker, ..."""
        return self._run(self._info_op())

    def _gradient_op(self, body: dict[str, Any], sources: Any) -> _core.Op[Gradient]:
        a = yield from self._core.call("POST", self._path("/gradient"), body)
        return Gradient.of(a, sources)

    def gradient(
        self,
        target: str | None = None,
        sources: Any = None,
        *,
        unconnected: str | None = None,
        flat: bool = False,
        time_limit: float | None = None,
    ) -> Any:
        """The gradient of any target of the recording (default: the tape's) over any
        variables or inputs (default: its sources), from the recording. `flat=True`: one
        float64 vector over the sources in `Gradient.order` (unconnected ones zeros)."""
        body = self._options(
            target=target,
            sources=sources,
            unconnected=unconnected,
            time_limit=time_limit,
            flat=flat or None,
        )
        return self._run(self._gradient_op(body, sources if sources is not None else self._sources))

    def _jacobian_op(
        self, body: dict[str, Any], sources: Any, progress: Any = None
    ) -> _core.Op[Jacobian]:
        a = yield from self._core.compute(
            "POST", self._path("/jacobian"), body, progress=progress, description="jacobian"
        )
        return Jacobian.of(a, sources)

    def jacobian(
        self,
        target: str | None = None,
        sources: Any = None,
        *,
        batch: bool = False,
        unconnected: str | None = None,
        flat: bool = False,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """The jacobian of any target of the recording over any sources (per example with
        batch=True). `flat=True`: one float64 matrix [target size, n] (per example: [B,
        target size per example, n per example]) over the sources in `Jacobian.order`.
        `progress=True` runs it as a server-side job (as `eigenvalues`)."""
        body = self._options(
            target=target,
            sources=sources,
            unconnected=unconnected,
            batch=batch or None,
            flat=flat or None,
            time_limit=time_limit,
        )
        return self._run(
            self._jacobian_op(body, sources if sources is not None else self._sources, progress)
        )

    def _eigen_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[Eigenvalues]:
        a = yield from self._ask("eigenvalues", body, progress)
        vectors = a.get("eigenvectors")
        return Eigenvalues(
            np.asarray(a["eigenvalues"], dtype=np.float64),
            np.asarray(a["residuals"], dtype=np.float64),
            None if vectors is None else [shaped(v, self._sources) for v in vectors],
            a["converged"],
            a["stopped"],
            a["iterations"],
            a["hvps"],
            a["seconds"],
            a.get("method", "lanczos"),
            CurvatureUsed.of(a),
        )

    def eigenvalues(
        self,
        k: int = 1,
        which: str | None = None,
        *,
        method: str | None = None,
        tol: float | None = None,
        max_hvps: int | None = None,
        max_seconds: float | None = None,
        eigenvectors: bool = False,
        seed: int | None = 0,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """The k extreme eigenvalues of the Hessian (or of `curvature`) at the recorded
        point, on the server: `method` "lanczos" (the default; one HVP per iteration) or
        "power" (deflated power iteration, k HVPs per batched step, largest magnitude only). `which`: "LA"
        largest (Lanczos' default), "SA" smallest, "LM" largest magnitude. With
        `eigenvectors=True`, one eigenvector per eigenvalue in the tape's source
        structure.

        `progress=True` runs it as a server-side job and shows a tqdm bar (HVPs of the
        budget, the current Ritz values and residuals; `pip install
        'gradtape-client[progress]'`); a callable instead receives each `JobStatus`.
        Ctrl-C (or cancelling the awaiting task) cancels the job on the server."""
        body = self._options(
            k=k,
            method=method,
            which=which,
            tol=tol,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            eigenvectors=eigenvectors or None,
            time_limit=time_limit,
        )
        body.update(self._curvature(curvature, samples, fisher_seed))
        body["seed"] = seed
        return self._run(self._eigen_op(body, progress))

    def _trace_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[Trace]:
        a = yield from self._ask("trace", body, progress)
        return Trace(
            trace=a["trace"],
            stderr=a.get("stderr"),
            samples=a["samples"],
            batches=a["batches"],
            batch_size=a["batch_size"],
            converged=a["converged"],
            stopped=a["stopped"],
            hvps=a["hvps"],
            seconds=a["seconds"],
            method=a.get("method", "hutchinson"),
            sketch=a.get("sketch", 0),
            partial=a.get("partial", False),
            curvature_used=CurvatureUsed.of(a),
        )

    def trace(
        self,
        *,
        method: str | None = None,
        progress: Any = False,
        **options: Unpack[EstimatorOptions],
    ) -> Any:
        """The Hessian's (or `curvature`'s) trace on the server: `method` "auto" (the
        server's default: exact when `max_hvps` covers the parameter count, else Hutch++),
        "exact", "hutchpp" or "hutchinson", with its standard error; the stochastic methods
        stop once it is within `rtol`/`atol`. `options`: EstimatorOptions. `progress` as in
        `eigenvalues`."""
        body = self._body({"method": method, "seed": 0, **options})
        return self._run(self._trace_op(body, progress))

    def _diagonal_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[Diagonal]:
        a = yield from self._ask("diagonal", body, progress)
        stderr = a.get("stderr")
        return Diagonal(
            diagonal=shaped(a["diagonal"], self._sources),
            stderr=None if stderr is None else shaped(stderr, self._sources),
            error=a.get("error"),
            method=a["method"],
            reached=a["reached"],
            samples=a["samples"],
            batches=a["batches"],
            batch_size=a["batch_size"],
            converged=a["converged"],
            stopped=a["stopped"],
            hvps=a["hvps"],
            seconds=a["seconds"],
            partial=(
                None if a.get("partial") is None else np.asarray(a["partial"], dtype=np.float64)
            ),
            curvature_used=CurvatureUsed.of(a),
        )

    def diagonal(
        self,
        *,
        method: str | None = None,
        progress: Any = False,
        **options: Unpack[EstimatorOptions],
    ) -> Any:
        """The Hessian's (or `curvature`'s) diagonal on the server, in the tape's source
        structure: `method` "auto" (the server's default: exact when `max_hvps` covers the
        parameter count, else Hutchinson), "exact" or "hutchinson" (with a standard error
        per entry; it stops once the root-mean-square error is within `rtol`/`atol`).
        `options`: EstimatorOptions. `progress` as in `eigenvalues`."""
        body = self._body({"method": method, "seed": 0, **options})
        return self._run(self._diagonal_op(body, progress))

    def frobenius_norm(self, *, progress: Any = False, **options: Unpack[EstimatorOptions]) -> Any:
        """||C||_F^2 of the Hessian (or `curvature`) on the server, by Hutchinson on C^2,
        as the answer's dict: `frobenius_norm_squared`, its `stderr` (None from fewer than
        30 probes), `converged`, `stopped`, `samples`, `hvps`, `curvature_used` (its
        `curvature` key is deprecated: read `curvature_used`). `options`:
        EstimatorOptions. `progress` as in `eigenvalues`."""
        return self.call("frobenius-norm", progress=progress, **{"seed": 0, **options})

    def _density_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[SpectralDensity]:
        a = yield from self._ask("spectral-density", body, progress)
        stderr = a.get("stderr")
        return SpectralDensity(
            grid=np.asarray(a["grid"], dtype=np.float64),
            density=np.asarray(a["density"], dtype=np.float64),
            stderr=None if stderr is None else np.asarray(stderr, dtype=np.float64),
            nodes=[np.asarray(t, dtype=np.float64) for t in a["nodes"]],
            weights=[np.asarray(w, dtype=np.float64) for w in a["weights"]],
            sigma=a["sigma"],
            probes=a["probes"],
            steps=a["steps"],
            parameters=a["parameters"],
            converged=a["converged"],
            stopped=a["stopped"],
            hvps=a["hvps"],
            seconds=a["seconds"],
            curvature_used=CurvatureUsed.of(a),
        )

    def spectral_density(
        self,
        *,
        probes: int | None = None,
        steps: int | None = None,
        sigma: float | None = None,
        points: int | None = None,
        grid: Any = None,
        max_hvps: int | None = None,
        max_seconds: float | None = None,
        seed: int | None = 0,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """The density of the Hessian's (or `curvature`'s) eigenvalues by stochastic
        Lanczos quadrature on the server (`probes` random vectors, `steps` Lanczos steps each; server defaults
        8 and 64): the density smoothed with `sigma` on `grid` (or `points` points), and
        the raw Ritz nodes and weights (`SpectralDensity.smoothed` re-smooths them
        locally). `progress` as in `eigenvalues`."""
        body = self._options(
            probes=probes,
            steps=steps,
            sigma=sigma,
            points=points,
            grid=None if grid is None else [float(x) for x in np.asarray(grid).reshape(-1)],
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            time_limit=time_limit,
        )
        body.update(self._curvature(curvature, samples, fisher_seed))
        body["seed"] = seed
        return self._run(self._density_op(body, progress))

    def _solve_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[Solve]:
        a = yield from self._ask("solve", body, progress)
        return Solve(
            shaped(a["solution"], self._sources),
            a["rhs"],
            a["converged"],
            a["stopped"],
            a["iterations"],
            a["hvps"],
            np.asarray(a["residuals"], dtype=np.float64),
            a["seconds"],
            CurvatureUsed.of(a),
        )

    def solve(
        self,
        b: Any = None,
        *,
        damping: float | None = None,
        tol: float | None = None,
        max_iterations: int | None = None,
        max_hvps: int | None = None,
        max_seconds: float | None = None,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """x of (H + damping I) x = b by conjugate gradient on the server (b: a tensor
        per source; default the gradient, making x the damped Newton step; the server's
        default damping is 1e-3). `progress` as in `eigenvalues`."""
        body = self._options(
            damping=damping,
            tol=tol,
            max_iterations=max_iterations,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            time_limit=time_limit,
        )
        body.update(self._curvature(curvature, samples, fisher_seed))
        if b is not None:
            body["vector"] = self._vector(b)
        return self._run(self._solve_op(body, progress))

    def _influence_op(self, body: dict[str, Any], progress: Any = None) -> _core.Op[Influence]:
        a = yield from self._ask("influence", body, progress)
        return Influence(
            scores=np.asarray(a["scores"], dtype=np.float64),
            removal=np.asarray(a["removal"], dtype=np.float64),
            helpful=np.asarray(a["helpful"], dtype=np.int64),
            harmful=np.asarray(a["harmful"], dtype=np.int64),
            test_loss=a["test_loss"],
            s_test=shaped(a["s_test"], self._sources),
            converged=a["converged"],
            stopped=a["stopped"],
            iterations=a["iterations"],
            hvps=a["hvps"],
            residuals=np.asarray(a["residuals"], dtype=np.float64),
            seconds=a["seconds"],
            curvature_used=CurvatureUsed.of(a),
            _curvature=a.get("curvature"),  # deprecated (a server past 0.2.0 has none)
        )

    def influence(
        self,
        test_inputs: Mapping[str, Any] | None = None,
        *,
        rows: Any = None,
        curvature: str | None = None,
        damping: float | None = None,
        top_k: int | None = None,
        tol: float | None = None,
        max_iterations: int | None = None,
        max_hvps: int | None = None,
        max_seconds: float | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        preconditioner: str | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """The influence of every training example (a row of the output's first axis) on
        the loss at test points: `test_inputs` (new rows for the inputs the model and loss
        read along the examples axis, e.g. {"x": ..., "y": ...}; arrays, or stored dataset
        arrays as in definitions) or training `rows`.
        s_test = (C + damping I)^-1 grad L_test by CG on the server's curvature C
        (the GGN by default, positive semi-definite for convex losses; with "hessian" on a
        non-convex model CG may stop at negative curvature, and the SDK warns), then
        every example's score in one batched pass (`Influence`). Needs a tape recorded
        with `output=`. `preconditioner` "kfac" or "ekfac": CG preconditioned with the
        damped inverse of the GGN's KFAC. `progress` as in `eigenvalues`."""
        body = self._options(
            rows=None if rows is None else [int(r) for r in np.asarray(rows).reshape(-1)],
            damping=damping,
            top_k=top_k,
            tol=tol,
            max_iterations=max_iterations,
            preconditioner=preconditioner,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            time_limit=time_limit,
        )
        if test_inputs is not None:
            # Arrays, or stored dataset arrays ({"dataset", "array", "rows"}) as they are;
            # {"dataset": ..., "rows": ...} binds every array of a dataset.
            body["test_inputs"] = (
                dict(test_inputs)
                if "dataset" in test_inputs
                else {
                    name: v if isinstance(v, Mapping) else np.asarray(v)
                    for name, v in test_inputs.items()
                }
            )
        body.update(self._curvature(curvature, samples, fisher_seed))
        return self._run(self._influence_op(body, progress))

    def _delete_op(self, missing_ok: bool) -> _core.Op[None]:
        try:
            yield from self._core.call("DELETE", self._path())
        except TapeGone:
            if not missing_ok:
                raise
        self._deleted = True

    def delete(self, *, missing_ok: bool = False) -> Any:
        """Delete the tape on the server (its id then answers TapeGone, reason
        "deleted"). With missing_ok, a tape already gone is no error."""
        return self._run(self._delete_op(missing_ok))

    # ------------------------------------------------------------- context managers

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._deleted:
            self.delete(missing_ok=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._deleted:
            await self.delete(missing_ok=True)

    def __repr__(self) -> str:
        return f"RemoteTape({self.id!r}, target={self.target!r}, sources={self.sources})"

    # ---------------------------------------------------------------- SciPy (sync only)

    def _sync(self, what: str) -> None:
        if getattr(self._client, "is_async", False):
            raise TypeError(
                f"{what} needs a tape of the synchronous Client (SciPy calls it synchronously)"
            )

    def _hvp_flat(self, X: np.ndarray, options: dict[str, Any] | None = None) -> np.ndarray:
        """H X for X of shape (n,) or (n, k): one request (batched for k columns);
        `options`: the curvature ones of the request."""
        single = X.ndim == 1
        columns = X.reshape(self.size, 1) if single else X
        vectors = [self.unflatten(columns[:, j], dtype=None) for j in range(columns.shape[1])]
        extra = options or {}
        if single:
            answer = self._run(self._hvp_op({"vector": vectors[0], **extra}, shape=False))
            return self.flatten(answer)
        answers = self._run(self._hvp_chunks_op(vectors, extra, shape=False))
        return np.stack([self.flatten(h) for h in answers], axis=1)

    def linear_operator(
        self,
        *,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
    ) -> LinearOperator:
        """The Hessian (or `curvature`: "ggn", "fisher", "empirical_fisher" on a tape
        recorded with `output=`) at the recorded point as a
        `scipy.sparse.linalg.LinearOperator` (n x n, float64, symmetric) over the flattened
        parameters (`sources` order): matvec is one product request, matmat one batched
        request (a block wider than the server's hvp_max_vectors, or larger than its body
        limit, in chunks, each limit learned from its first refusal). Vectors are sent in each
        source's own dtype, the precision the tape computes in. Needs scipy (`pip install
        gradtape-client[scipy]`)."""
        self._sync("linear_operator()")
        return _operator_class()(self, self._curvature(curvature, samples, fisher_seed))

    def _at(self, x: Any) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if not _core.arrays_equal(self._x, x):
            self.update(self.unflatten(x, dtype=None))
            self._x = x.copy()

    def fun(self, x: Any) -> float:
        """The target's value at the flattened parameters x (re-recording the tape there
        when x moved): for `scipy.optimize.minimize(tape.fun, x0, jac=tape.jac,
        hessp=tape.hessp, method="Newton-CG" / "trust-krylov" / ...)`."""
        self._sync("fun()")
        self._at(x)
        return float(self.value)

    def jac(self, x: Any) -> np.ndarray:
        """The gradient at x, flattened (float64)."""
        self._sync("jac()")
        self._at(x)
        return self.flatten(self._gradients)

    def hessp(self, x: Any, p: Any) -> np.ndarray:
        """H(x) p, flattened (float64): one HVP request (after re-recording at x if it
        moved)."""
        self._sync("hessp()")
        self._at(x)
        return self._hvp_flat(np.asarray(p, dtype=np.float64).reshape(-1))


def _vector_bytes(vector: Any) -> int:
    """The bytes of a vector's arrays (a dict by source, or one array)."""
    arrays = vector.values() if isinstance(vector, Mapping) else [vector]
    return int(sum(np.asarray(a).nbytes for a in arrays))


def _vectors_limit(exc: TooLarge) -> int | None:
    """The server's hvp_max_vectors from its refusal of too many `vectors` (its `limit`;
    a server without it says "at most N" for the field), else None."""
    if exc.slug != "too-large" or not any(e.get("field") == "vectors" for e in exc.errors):
        return None
    limit = exc.problem.get("limit")
    if isinstance(limit, int) and limit >= 1:
        return limit
    for e in exc.errors:
        found = re.search(r"at most (\d+)", str(e.get("message", "")))
        if e.get("field") == "vectors" and found and int(found.group(1)) >= 1:
            return int(found.group(1))
    return None


@functools.cache
def _operator_class() -> type:
    from scipy.sparse.linalg import LinearOperator

    class HessianOperator(LinearOperator):
        """A remote tape's Hessian (or other curvature): H x by product requests."""

        def __init__(self, tape: RemoteTape, options: dict[str, Any]):
            self.tape = tape
            self.options = options
            super().__init__(dtype=np.dtype(np.float64), shape=(tape.size, tape.size))

        def _matvec(self, x: np.ndarray) -> np.ndarray:
            return self.tape._hvp_flat(np.asarray(x).reshape(-1), self.options)

        def _rmatvec(self, x: np.ndarray) -> np.ndarray:
            return self._matvec(x)

        def _matmat(self, X: np.ndarray) -> np.ndarray:
            return self.tape._hvp_flat(np.asarray(X).reshape(self.shape[1], -1), self.options)

        def _rmatmat(self, X: np.ndarray) -> np.ndarray:
            return self._matmat(X)

        def _adjoint(self) -> HessianOperator:
            return self

    return HessianOperator
