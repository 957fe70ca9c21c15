"""Curvature beyond products on a tape recorded with `output=` (issue 30): per-example
gradients and their statistics, Kronecker factors (KFAC, EKFAC), and Laplace
approximations kept on the server (`RemoteLaplace`). RemoteTape takes these methods from
`CurvatureMethods`; with an AsyncClient they answer awaitables, as the tape's others."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from .results import (
    CURVATURE_DEPRECATED,
    CurvatureUsed,
    _Unpack,
    check_approximate,
    shaped,
    warn_deprecated,
)

if TYPE_CHECKING:
    from .tape import RemoteTape


@dataclass(frozen=True)
class PerExample(_Unpack):
    """g_i, the gradient of example i's loss alone (the batch gradient is
    scale * sum_i g_i): their norms (overall, per source), mean, variance and sum of
    squares per source, and the gradients themselves when asked (N first)."""

    examples: int
    scale: float
    norms: np.ndarray
    norms_by_source: Any
    mean: Any
    variance: Any
    sum_squares: Any
    gradients: Any
    chunks: int
    _unpack = ("norms", "mean", "variance")


@dataclass(frozen=True)
class KFACLayer:
    kind: str
    weight: str
    bias: str | None
    joint: bool
    eigenvalues: np.ndarray
    A: np.ndarray | None
    G: np.ndarray | None


@dataclass(frozen=True)
class KFAC(_Unpack):
    """A Kronecker-factored approximation of the curvature: its layers (eigenvalues,
    factors when asked), the sources kept as an exact block, trace, log-determinant
    (None: -inf, a singular block at this damping) and the product asked for."""

    layers: list[KFACLayer]
    others: list[str]
    trace: float
    logdet: float | None
    damping: float
    product: Any
    curvature_used: CurvatureUsed | None = None  # the KFAC of which curvature (see its kind)
    # Sources the loss does not reach: an exact zero block (products zero).
    unreached: list[str] = field(default_factory=list)
    _unpack = ("layers", "product")


@dataclass(frozen=True)
class Predictive(_Unpack):
    """The GLM predictive: the output (M, C), its functional covariance (M, C, C), for
    regression the noise variance, for classification the probabilities."""

    mean: np.ndarray
    variance: np.ndarray
    noise: float | None
    probabilities: np.ndarray | None
    link: str | None
    samples: int | None
    curvature_used: CurvatureUsed | None = None  # the fit's (its structure: kfac, ...)
    _unpack = ("mean", "variance")


class RemoteLaplace:
    """A Laplace fit kept with its tape on the server (made by `tape.laplace(...)`,
    listed by `tape.laplaces()`, read again by `tape.laplace_fit(id)`; `delete()` frees
    its memory on the server)."""

    def __init__(self, tape: RemoteTape, answer: Mapping[str, Any]):
        self.tape = tape
        self.id: str = answer["laplace_id"]
        # The bytes it holds on the server and when it was made: read from a listing or
        # a `refresh()` (None when it comes from its fit's answer).
        self.bytes: int | None = None
        self.created_at: str | None = None
        self._set(answer)

    def _set(self, a: Mapping[str, Any]) -> None:
        if "bytes" in a:
            self.bytes, self.created_at = int(a["bytes"]), str(a["created_at"])
        self.subset: str = a["subset"]
        self.structure: str = a["structure"]
        self._curvature: str | None = a.get("curvature")  # deprecated: see `curvature`
        self.likelihood: str = a["likelihood"]
        self.parameters: int = a["parameters"]
        self.prior_precision: float = a["prior_precision"]
        self.tuned: bool = a["tuned"]
        self.sigma_noise: float | None = a["sigma_noise"]
        self.log_marginal_likelihood_value: float = a["log_marginal_likelihood"]
        self.log_likelihood: float = a["log_likelihood"]
        # The curvature the fit holds: its kind, and its structure (kfac, diagonal).
        self.curvature_used: CurvatureUsed | None = CurvatureUsed.of(a)

    @property
    def curvature(self) -> str | None:
        """Deprecated: read `curvature_used` (results.CURVATURE_DEPRECATED)."""
        warn_deprecated(CURVATURE_DEPRECATED.format(what="RemoteLaplace.curvature"))
        return self._curvature

    def _path(self, tail: str) -> str:
        return self.tape._path(f"/laplace/{self.id}/{tail}")

    def _refresh_op(self) -> _core.Op[RemoteLaplace]:
        self._set((yield from self.tape._core.call("GET", self.tape._path(f"/laplace/{self.id}"))))
        return self

    def refresh(self) -> Any:
        """Read the fit's description again (prior precision, log marginal likelihood,
        `bytes`, `created_at`); NotFound (laplace-not-found) once it is gone."""
        return self.tape._run(self._refresh_op())

    def delete(self) -> Any:
        """Drop the fit on the server, freeing its memory (a full fit holds parameters^2
        values); NotFound (laplace-not-found) if it was gone already."""
        return self.tape._run(
            self.tape._core.call("DELETE", self.tape._path(f"/laplace/{self.id}"))
        )

    def _evidence_op(self, body: dict[str, Any]) -> _core.Op[float]:
        a = yield from self.tape._core.call("POST", self._path("log-marginal-likelihood"), body)
        self._set(a)
        return float(a["log_marginal_likelihood"])

    def log_marginal_likelihood(self, prior_precision: float | str | None = None) -> Any:
        """The log marginal likelihood at `prior_precision` (kept from then on), at
        'tune' (the exact maximiser), or at the current one (None)."""
        body = {} if prior_precision is None else {"prior_precision": prior_precision}
        return self.tape._run(self._evidence_op(body))

    def _predictive_op(self, body: dict[str, Any], progress: Any) -> _core.Op[Predictive]:
        a = yield from self.tape._core.compute(
            "POST", self._path("predictive"), body, progress=progress, description="predictive"
        )
        probs = a.get("probabilities")
        return Predictive(
            mean=np.asarray(a["mean"], np.float64),
            variance=np.asarray(a["variance"], np.float64),
            noise=a.get("noise"),
            probabilities=None if probs is None else np.asarray(probs, np.float64),
            link=a.get("link"),
            samples=a.get("samples"),
            curvature_used=CurvatureUsed.of(a),
        )

    def predictive(
        self,
        test_inputs: Mapping[str, Any],
        *,
        link: str | None = None,
        samples: int | None = None,
        seed: int | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """The GLM-linearised predictive at `test_inputs` (new rows for the inputs the
        model reads along the examples axis); classification: `link` "probit" (default)
        or "mc" with `samples` draws."""
        body = _options(link=link, samples=samples, seed=seed, time_limit=time_limit)
        body["test_inputs"] = {
            k: v if isinstance(v, Mapping) else np.asarray(v) for k, v in test_inputs.items()
        }
        return self.tape._run(self._predictive_op(body, progress))

    def _samples_op(self, body: dict[str, Any]) -> _core.Op[Any]:
        a = yield from self.tape._core.call("POST", self._path("samples"), body)
        return shaped(a["samples"], None)

    def sample(self, count: int = 10, *, seed: int | None = None) -> Any:
        """`count` parameter draws from the posterior, per source of the fit's subset
        ((count, *shape) each)."""
        return self.tape._run(self._samples_op(_options(count=count, seed=seed)))

    def __repr__(self) -> str:
        kind = self.curvature_used.kind if self.curvature_used else self._curvature
        return (
            f"RemoteLaplace({self.id!r}, {self.subset}/{self.structure}/{kind}, "
            f"prior_precision={self.prior_precision:g})"
        )


def _options(**options: Any) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def _per_example_result(a: Mapping[str, Any], sources: Any) -> PerExample:
    return PerExample(
        examples=a["examples"],
        scale=a["scale"],
        norms=np.asarray(a["norms"], np.float64),
        norms_by_source=shaped(a["norms_by_source"], sources),
        mean=shaped(a["mean"], sources),
        variance=shaped(a["variance"], sources),
        sum_squares=shaped(a["sum_squares"], sources),
        gradients=shaped(a.get("gradients"), sources),
        chunks=a["chunks"],
    )


def per_example_op(
    core: _core.Core,
    definition: Any,
    target: str,
    sources: Any,
    model: str | None,
    options: dict[str, Any],
    progress: Any = False,
) -> _core.Op[PerExample]:
    """POST /v1/per-example: a definition's (or stored model's) per-example gradients."""
    body = _core.compute_body(definition, target, sources, model, **_options(**options))
    a = yield from core.compute(
        "POST",
        "/v1/per-example",
        body,
        definition=definition,
        progress=progress,
        description="per-example",
    )
    return _per_example_result(a, sources)


class CurvatureMethods:
    """The tape's methods for per-example gradients, KFAC and Laplace fits."""

    def _per_example_op(self: Any, body: dict[str, Any], progress: Any) -> _core.Op[PerExample]:
        a = yield from self._core.compute(
            "POST", self._path("/per-example"), body, progress=progress, description="per-example"
        )
        return _per_example_result(a, self._sources)

    def per_example(
        self: Any,
        *,
        gradients: bool = False,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """Per-example gradients' statistics (and, with `gradients=True`, the gradients)
        in one batched pass on the server. Needs a tape recorded with `output=`; a model
        that mixes examples is refused (BatchDependence-type error naming the line)."""
        body = _options(gradients=gradients, time_limit=time_limit)
        return self._run(self._per_example_op(body, progress))

    def _kfac_op(self: Any, body: dict[str, Any], progress: Any) -> _core.Op[KFAC]:
        a = yield from self._core.compute(
            "POST", self._path("/kfac"), body, progress=progress, description="kfac"
        )
        check_approximate("the KFAC", a)  # (a Monte-Carlo Fisher's: the KFAC is by name)
        layers = [
            KFACLayer(
                kind=x["kind"],
                weight=x["weight"],
                bias=x.get("bias"),
                joint=x["joint"],
                eigenvalues=np.asarray(x["eigenvalues"], np.float64),
                A=None if x.get("A") is None else np.asarray(x["A"], np.float64),
                G=None if x.get("G") is None else np.asarray(x["G"], np.float64),
            )
            for x in a["layers"]
        ]
        product = a.get("product")
        return KFAC(
            layers=layers,
            others=list(a["others"]),
            trace=a["trace"],
            logdet=a.get("logdet"),
            damping=a["damping"],
            product=None if product is None else shaped(product, self._sources),
            curvature_used=CurvatureUsed.of(a),
            unreached=list(a.get("unreached") or []),
        )

    def kfac(
        self: Any,
        vector: Mapping[str, Any] | None = None,
        *,
        curvature: str | None = None,
        samples: int | None = None,
        fisher_seed: int | None = None,
        sharing: str | None = None,
        ekfac: bool | None = None,
        others: str | None = None,
        separate_bias: bool | None = None,
        factors: bool | None = None,
        damping: float | None = None,
        inverse: bool | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """KFAC (or `ekfac=True`) of the tape's `curvature` ("ggn", "fisher" with
        optional `samples`, "empirical_fisher") on its matmul and convolution layers:
        eigenvalues per block, `factors`, trace, log-determinant, and the product of
        `vector` (a dict per source) with it or, `inverse=True`, with its damped
        inverse. `curvature="kfac"` on eigenvalues/trace/solve/influence runs those on it."""
        body = _options(
            curvature=curvature,
            samples=samples,
            fisher_seed=fisher_seed,
            sharing=sharing,
            ekfac=ekfac,
            others=others,
            separate_bias=separate_bias,
            factors=factors,
            damping=damping,
            inverse=inverse,
            time_limit=time_limit,
        )
        if vector is not None:
            body["vector"] = {k: np.asarray(x) for k, x in vector.items()}
        return self._run(self._kfac_op(body, progress))

    def _laplace_op(self: Any, body: dict[str, Any], progress: Any) -> _core.Op[RemoteLaplace]:
        a = yield from self._core.compute(
            "POST", self._path("/laplace"), body, progress=progress, description="laplace"
        )
        check_approximate("the Laplace fit", a)
        return RemoteLaplace(self, a)

    def _laplaces_op(self: Any) -> _core.Op[list[RemoteLaplace]]:
        a = yield from self._core.call("GET", self._path("/laplace"))
        return [RemoteLaplace(self, fit) for fit in a["fits"]]

    def laplaces(self: Any) -> Any:
        """The Laplace fits kept with the tape on the server, oldest first (each with its
        `bytes` and `created_at`)."""
        return self._run(self._laplaces_op())

    def _laplace_fit_op(self: Any, laplace_id: str) -> _core.Op[RemoteLaplace]:
        a = yield from self._core.call("GET", self._path(f"/laplace/{laplace_id}"))
        return RemoteLaplace(self, a)

    def laplace_fit(self: Any, laplace_id: str) -> Any:
        """The tape's Laplace fit of this id (as `tape.laplace(...)` answered it, or
        another process made it); NotFound (laplace-not-found) when the tape holds none."""
        return self._run(self._laplace_fit_op(laplace_id))

    def laplace(
        self: Any,
        *,
        subset: str | None = None,
        structure: str | None = None,
        curvature: str | None = None,
        prior_precision: float | str | None = None,
        sigma_noise: float | None = None,
        sharing: str | None = None,
        time_limit: float | None = None,
        progress: Any = False,
    ) -> Any:
        """Fit a Laplace approximation at the tape's point, kept on the server: `subset`
        "all" or "last_layer", `structure` "diag", "kron" (default) or "full" ("diagonal"
        and "kfac", as `curvature_used` names them, are diag and kron),
        `curvature` "ggn" or "empirical_fisher", `prior_precision` a number or "tune"
        (the marginal likelihood's exact maximiser), `sigma_noise` for regression.
        Answers a RemoteLaplace (log marginal likelihood, predictive, samples)."""
        body = _options(
            subset=subset,
            structure=structure,
            curvature=curvature,
            prior_precision=prior_precision,
            sigma_noise=sigma_noise,
            sharing=sharing,
            time_limit=time_limit,
        )
        if prior_precision == "tune":  # the server's flag: the exact maximiser
            del body["prior_precision"]
            body["tune"] = True
        return self._run(self._laplace_op(body, progress))


__all__ = ["KFAC", "CurvatureMethods", "KFACLayer", "PerExample", "Predictive", "RemoteLaplace"]
