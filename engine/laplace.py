"""The Laplace approximation of a trained model's posterior (laplace-torch's Laplace:
Daxberger et al. 2021; MacKay 1992; Immer et al. 2021 for the GLM predictive).

    curv = Curvature(model, loss, params, data, targets)   # at the trained point
    la = Laplace(curv, subset="all", structure="kron", curvature="ggn",
                 prior_precision=1.0, sigma_noise=0.3)
    la.log_marginal_likelihood()          # at the prior precision, or another
    la.tune_prior_precision()             # the marginal likelihood's maximiser (exact)
    la.predictive(model, test_inputs)     # GLM-linearised mean and (co)variance
    la.sample(10, seed=0)                 # parameters from the posterior

The likelihood is the one the loss is recognised as (curvature.py: a Gaussian for a
squared error, categorical for softmax cross-entropy, Bernoulli for sigmoid
cross-entropy), whatever its reduction: the loss is s x the summed negative
log-likelihood NLL, with s measured, so the answers are in natural units, as
laplace-torch's. For regression the noise is `sigma_noise` (given, default 1), and
    log p(D | theta) = -sum r^2 / (2 sigma^2) - N C log(sigma sqrt(2 pi));
for classification log p(D | theta) = -NLL.

The posterior precision on the chosen parameters (all, or the last layer: the matmul
layer nearest the output with its bias) is P = H / sigma^2 + lambda I, lambda the scalar
prior precision (prior mean 0), with H in one of three structures:

    diag   diag(H), exact (one per-example pass per output entry, curvature_diagonal)
    kron   KFAC (type-2, curvlinops' scaling, bias blocks separate, as laplace-torch);
           parameters outside matmul/conv layers keep their exact block
    full   H itself, from curvature products (at most `max_full` parameters)

and H the GGN of NLL (= the Fisher) or the empirical Fisher sum_i grad NLL_i grad
NLL_i^T. Convention: laplace-torch's empirical Fisher for regression is twice this
(it squares the gradients of the summed squared error, then halves once); we use the
natural one, the empirical Fisher of the Gaussian NLL (tests compare against theirs / 2).

Every structure is held as its eigenvalues (and eigenvectors where they are not the
unit ones), so the log marginal likelihood
    log p(D | theta) - (1/2) (sum_j log(e_j / sigma^2 + lambda) - n log lambda + lambda |theta|^2)
costs O(n) per lambda, and its maximiser over lambda > 0 is the root of
    sum_j e'_j / (lambda (e'_j + lambda)) = |theta|^2,   e' = e / sigma^2,
a strictly decreasing function of lambda: `tune_prior_precision` brackets it and
bisects in log lambda to the last bit (the exact optimum, relative error ~1e-15, where
laplace-torch's default of 100 Adam steps stops 0.02-0.45% short).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import backend
from engine.curvature import CurvatureError, _single_target
from engine.kfac import KFAC, curvature_diagonal, exact_block, find_layers
from engine.per_example import MixedExamplesError, PerExample
from engine.tensor import Tensor

STRUCTURES = ("diag", "kron", "full")
SUBSETS = ("all", "last_layer")
CURVATURES = ("ggn", "empirical_fisher")
LINKS = ("probit", "mc")
MAX_FULL = 4096


@dataclass
class Predictive:
    """The GLM predictive at M test inputs: `mean` (M, C) the model's output, `variance`
    (M, C, C) the functional covariance J Sigma J^T; for regression `noise` sigma^2 (the
    observation's variance is variance + noise I); for classification `probabilities`
    (M, C) by the probit approximation or Monte-Carlo (`samples` draws), as asked. C is
    the output's entries per example, flattened: an output (M, T, K) of T positions is
    C = T K, its probabilities a softmax over each position's K classes."""

    mean: np.ndarray
    variance: np.ndarray
    noise: float | None = None
    probabilities: np.ndarray | None = None
    link: str | None = None
    samples: int | None = None


class Laplace:
    """A Laplace approximation fitted on a Curvature recording (module doc)."""

    def __init__(
        self,
        curv: Any,
        *,
        subset: str = "all",
        structure: str = "kron",
        curvature: str = "ggn",
        prior_precision: float = 1.0,
        sigma_noise: float = 1.0,
        sharing: str = "expand",
        names: list[str] | None = None,
        max_full: int = MAX_FULL,
    ):
        for value, allowed, what in (
            (subset, SUBSETS, "subset"),
            (structure, STRUCTURES, "structure"),
            (curvature, CURVATURES, "curvature"),
        ):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
        _positive(prior_precision, "prior_precision")
        _positive(sigma_noise, "sigma_noise")
        self.curv, self.subset, self.structure, self.curvature = curv, subset, structure, curvature
        self.sharing = sharing  # (kron) KFAC-expand or -reduce, as the fit says
        params = curv._flat
        self.names = names or [f"param{i}" for i in range(len(params))]
        likelihood = curv.likelihood()
        self.family = likelihood.family
        self.regression = likelihood.family == "gaussian"
        if not self.regression and sigma_noise != 1.0:
            raise ValueError("sigma_noise is for regression (a Gaussian likelihood)")
        self.sigma_noise = float(sigma_noise)
        self.prior_precision = float(prior_precision)
        c = curv.scale()
        # loss = s x NLL (the Gaussian's NLL at unit variance: r^2 / 2)
        self.s = c / likelihood.variance if self.regression else likelihood.scale
        out = curv.output
        # The softmax's classes: the output's last axis (per example, per position).
        self.classes = out.shape[-1] if out.ndim >= 2 else 1
        self.indices = self._subset(params)
        self.theta = np.concatenate(
            [np.asarray(params[i].numpy(), np.float64).ravel() for i in self.indices]
        )
        self.n = self.theta.size
        self._log_likelihood_unit()
        self._fit(sharing, max_full)

    # Fitting ----------------------------------------------------------------------------
    def _subset(self, params: list[Tensor]) -> list[int]:
        if self.subset == "all":
            return list(range(len(params)))
        try:
            engine = PerExample.of(self.curv)
            layers, _ = find_layers(engine, params, self.names)
        except MixedExamplesError as exc:
            raise CurvatureError(str(exc)) from None
        if not layers:
            raise CurvatureError(
                "laplace: subset 'last_layer' needs a matmul layer (x @ W, a bias added to it "
                "optional) in the model; none was found"
            )
        last = layers[-1]
        # The matmul nearest the output must be that layer: one whose weight is in no
        # layer (tied to another layer, scaled or masked first, a grouped convolution)
        # would otherwise make an earlier layer "the last" without a word.
        nearest = [m for m in engine.flow.meetings if m.kind == "matmul"][-1]
        if nearest is not last.meeting:
            shapes = [list(t.shape) for t in nearest.record.inputs]
            raise CurvatureError(
                f"laplace: subset 'last_layer': the matmul nearest the output (inputs {shapes}) "
                "reads a weight that is no layer of its own (tied to another layer, computed "
                "from parameters, or a grouped convolution), so there is no last layer to take "
                f"alone; the last one found ({last.name}) is not nearest the output. Use "
                "subset 'all'"
            )
        return sorted(i for i in (last.weight, last.bias) if i is not None)

    def _log_likelihood_unit(self) -> None:
        """What log p(D | theta) needs: the sum of squared residuals (regression) or NLL."""
        if self.regression:
            out = np.asarray(self.curv.output.numpy(), np.float64)
            raw, _ = _single_target(self.curv.targets)
            target = np.asarray(backend.to_host(raw), np.float64)
            self._squares = float(((out - target) ** 2).sum())
            self._entries = out.size
        else:
            self._nll = float(self.curv.value.numpy()) / self.s

    def _fit(self, sharing: str, max_full: int) -> None:
        curv, kind = self.curv, self.curvature
        # H of NLL from the loss's curvature: the GGN scales by 1/s, the empirical Fisher
        # (c sum g_i g_i^T with g_i the gradient of l_i = NLL_i s / c) by c / s^2.
        factor = 1.0 / self.s if kind == "ggn" else curv.scale() / self.s**2
        self.kfac: KFAC | None = None
        self.vectors: np.ndarray | None = None
        if self.structure == "diag":
            diag = curvature_diagonal(curv, kind)
            self.eigenvalues = factor * np.concatenate([diag[i].ravel() for i in self.indices])
        elif self.structure == "kron":
            if kind != "ggn":
                raise CurvatureError(
                    "laplace: structure 'kron' is the type-2 KFAC of the GGN (as laplace-torch's); "
                    "use curvature 'ggn', or structure 'diag' or 'full' for the empirical Fisher"
                )
            self.kfac = KFAC(
                curv,
                "ggn",
                sharing=sharing,
                others="exact",
                names=self.names,
                subset=None if self.subset == "all" else self.indices,
            )
            self._kfac_factor = factor
            self.eigenvalues = factor * self.kfac.all_eigenvalues()
        else:
            if self.n > max_full:
                raise CurvatureError(
                    f"laplace: structure 'full' holds an n x n matrix; these parameters have "
                    f"n = {self.n} > {max_full}: use 'kron' or 'diag', or subset 'last_layer'"
                )
            h = factor * self._matrix(kind)
            self.eigenvalues, self.vectors = np.linalg.eigh(h)

    def _matrix(self, kind: str) -> np.ndarray:
        """The curvature's block on the subset, from as many products as it has entries."""
        return exact_block(self.curv, self.curv.operator(kind), self.indices)

    # The marginal likelihood ------------------------------------------------------------
    def log_likelihood(self) -> float:
        if self.regression:
            sigma = self.sigma_noise
            return -self._squares / (2 * sigma**2) - self._entries * math.log(
                sigma * math.sqrt(2 * math.pi)
            )
        return -self._nll

    def _precisions(self, prior_precision: float) -> np.ndarray:
        """The posterior precision's eigenvalues e / sigma^2 + lambda."""
        return self.eigenvalues / self.sigma_noise**2 + prior_precision

    def log_marginal_likelihood(self, prior_precision: float | None = None) -> float:
        """log p(D | theta) - (1/2)(log det P - log det P_0 + lambda |theta|^2)."""
        lam = self.prior_precision if prior_precision is None else float(prior_precision)
        _positive(lam, "prior_precision")
        posterior = self._precisions(lam)
        if (posterior <= 0).any():
            raise CurvatureError(
                "laplace: the posterior precision is not positive definite at this prior "
                "precision (the curvature has a negative eigenvalue)"
            )
        log_det_ratio = float(np.log(posterior).sum()) - self.n * math.log(lam)
        scatter = lam * float(self.theta @ self.theta)
        return self.log_likelihood() - 0.5 * (log_det_ratio + scatter)

    def tune_prior_precision(self) -> float:
        """Set and return the scalar prior precision that maximises the log marginal
        likelihood: the root of its derivative (module doc), bisected in log lambda until
        the bracket is one float apart."""
        target = float(self.theta @ self.theta)
        e = np.clip(self.eigenvalues / self.sigma_noise**2, 0.0, None)
        if target == 0.0:
            raise CurvatureError(
                "laplace: the parameters are all zero, so the marginal likelihood grows "
                "without bound in the prior precision; give one instead of tuning"
            )
        if not (e > 0).any():
            raise CurvatureError(
                "laplace: the curvature is zero, so the marginal likelihood grows as the "
                "prior precision falls to 0; give one instead of tuning"
            )

        def slope(log_lam: float) -> float:
            lam = math.exp(log_lam)
            return float((e / (lam * (e + lam))).sum()) - target

        lo, hi = -1.0, 1.0
        while slope(lo) < 0:
            lo -= 2.0
        while slope(hi) > 0:
            hi += 2.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            if slope(mid) > 0:
                lo = mid
            else:
                hi = mid
        self.prior_precision = math.exp(0.5 * (lo + hi))
        return self.prior_precision

    # The posterior ----------------------------------------------------------------------
    def _apply(self, vectors: np.ndarray, power: float) -> np.ndarray:
        """P^power V for V (K, n) over the subset: -1 the covariance, -1/2 its root."""
        lam = self.prior_precision
        if self.structure == "diag":
            return vectors * self._precisions(lam) ** power
        if self.structure == "full":
            q = self.vectors
            assert q is not None
            return ((vectors @ q) * self._precisions(lam) ** power) @ q.T
        assert self.kfac is not None
        # P = a K + lam I = a (K + (lam / a) I), a = factor / sigma^2
        a = self._kfac_factor / self.sigma_noise**2
        params = self.curv._flat
        k = vectors.shape[0]
        flat, lo = [], 0
        for i, p in enumerate(params):
            if i in self.indices:
                flat.append(vectors[:, lo : lo + p.size].reshape((k,) + tuple(p.shape)))
                lo += p.size
            else:
                flat.append(np.zeros((k,) + tuple(p.shape)))
        res = self.kfac.apply(flat, power=power, damping=lam / a)
        return a**power * np.concatenate([res[i].reshape(k, -1) for i in self.indices], axis=1)

    def covariance(self) -> np.ndarray:
        """Sigma = P^-1 on the subset, as an n x n matrix (small n only)."""
        return self._apply(np.eye(self.n), -1.0)

    def sample(self, count: int, seed: int | None = 0) -> np.ndarray:
        """`count` parameter vectors theta + P^(-1/2) z, z standard normal: (count, n),
        the subset's entries in the parameters' order."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        z = np.random.default_rng(seed).standard_normal((count, self.n))
        return self.theta + self._apply(z, -0.5)

    def jacobians(self, model: Any, inputs: Any) -> tuple[np.ndarray, np.ndarray]:
        """(f (M, C), J (M, C, n)): the model's output at `inputs` and its jacobian on
        the subset, one per-example pass per output entry (C passes in all)."""
        curv = self.curv
        engine = PerExample(model, curv._flat, curv._treedef, inputs)
        out = engine.output
        m = out.shape[0]
        width = out.size // m
        xp = backend.array_module(out.value)
        rows = []
        for j in range(width):
            seed = xp.zeros((m, width), out.dtype)
            seed[:, j] = 1.0
            cots = engine.meeting_cotangents(seed.reshape(out.shape))
            shares = engine.shares(cots, slice(0, m), m)
            rows.append(
                np.concatenate(
                    [
                        np.asarray(shares[i].numpy(), np.float64).reshape(m, -1)
                        for i in self.indices
                    ],
                    axis=1,
                )
            )
        f = np.asarray(out.numpy(), np.float64).reshape(m, width)
        return f, np.stack(rows, axis=1)

    def predictive(
        self,
        model: Any,
        inputs: Any,
        *,
        link: str = "probit",
        samples: int = 100,
        seed: int | None = 0,
    ) -> Predictive:
        """The GLM predictive at `inputs` (see Predictive); `model` the recording's."""
        if link not in LINKS:
            raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")
        f, jac = self.jacobians(model, inputs)
        m, width = f.shape
        flat = jac.reshape(m * width, self.n)
        var = (flat @ self._apply(flat, -1.0).T).reshape(m, width, m, width)
        var = var[np.arange(m), :, np.arange(m), :]  # (M, C, C): each input's own block
        var = (var + np.swapaxes(var, 1, 2)) / 2
        if self.regression:
            return Predictive(mean=f, variance=var, noise=self.sigma_noise**2)
        if link == "probit":
            kappa = 1.0 / np.sqrt(1.0 + math.pi / 8 * np.diagonal(var, axis1=1, axis2=2))
            probs = _link(self.family, kappa * f, self.classes)
            return Predictive(mean=f, variance=var, probabilities=probs, link="probit")
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        vals, vecs = np.linalg.eigh(var)
        root = vecs * np.sqrt(np.clip(vals, 0.0, None))[:, None, :]
        z = np.random.default_rng(seed).standard_normal((samples, m, width))
        draws = f[None] + np.einsum("mij,smj->smi", root, z)
        probs = _link(self.family, draws, self.classes).mean(axis=0)
        return Predictive(mean=f, variance=var, probabilities=probs, link="mc", samples=samples)


def _link(family: str, logits: np.ndarray, classes: int) -> np.ndarray:
    """Probabilities from logits (..., width): a sigmoid per entry, or a softmax over
    each group of `classes` entries (the output's last axis: a sequence's positions,
    flattened into the width, each get their own)."""
    if family == "bernoulli":
        return 1.0 / (1.0 + np.exp(-logits))
    grouped = logits.reshape(logits.shape[:-1] + (-1, classes))
    e = np.exp(grouped - grouped.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).reshape(logits.shape)


def _positive(value: float, what: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")


__all__ = ["CURVATURES", "LINKS", "STRUCTURES", "SUBSETS", "Laplace", "Predictive"]
