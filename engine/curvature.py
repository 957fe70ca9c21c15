"""Curvature of a model and its loss, recorded once: the Hessian, the generalized
Gauss-Newton matrix (GGN), the Fisher and the empirical Fisher as linear operators, and
influence functions (Koh and Liang, 2017) on any of them.

    curv = Curvature(model, loss, params, data, targets)  # forward + gradient, once
    ggn = curv.operator("ggn")          # a HessianOperator: hvp, hvp_many, size, primals
    top = lanczos(FlatOperator(ggn).matvec, ggn.size, k=5)
    found = curv.influence(test_data, test_targets, curvature="ggn", damping=1e-3)

`model(params, data) -> output` (examples along axis 0) and `loss(output, targets) ->`
a scalar that is a sum or mean of per-example terms. With J = d output / d params and
H_L = d^2 loss / d output^2, every curvature but the Hessian is J^T M J for a matrix M
on the output, applied as a JVP (J v), M, then a VJP (J^T u), batched over the K vectors
of `hvp_many` in one pass each, never forming J:

    hessian           the Hessian of loss(model(params)): the second-order pass over the
                      recording, as HessianOperator
    ggn               M = H_L
    fisher            exact (samples=None): M = H_L, allowed when the loss is recognised
                      as the negative log-likelihood of a categorical (softmax
                      cross-entropy), Bernoulli (sigmoid cross-entropy) or Gaussian
                      (squared error) model of the targets, where the Fisher is the GGN;
                      the loss may average over examples and over each example's labels
                      or positions (multi-label sigmoids over (N, D), a softmax over
                      (N, T, C)): the Fisher is then scaled like the loss, as curvlinops
                      does; Monte-Carlo (samples=S, seed): M = (1/(k S)) sum_s
                      blockdiag_i(G_si G_si^T), G_s = d loss(output, y_s) / d output for
                      targets y_s drawn from that predictive distribution, k the
                      likelihood's scale (curvlinops' FisherMC)
    empirical_fisher  M = (1/c) blockdiag_i(G_i G_i^T), G = d loss(output, targets) / d output
                      (one gradient per example: see the conventions below)
    empirical_fisher_terms
                      curvlinops' convention (EFLinearOperator): M = R blockdiag_n(G_n G_n^T)
                      over the loss's terms n, the rows along the output's last axis
                      (an example's positions are terms of their own), with L = (1/R)
                      sum_n l_n and l_n the term's summed loss (R = N x T for a softmax
                      over (N, T, C) averaged; N x C for squared error or sigmoids over
                      (N, C) averaged; 1 for a sum); for a recognised likelihood only

Per-example conventions. The loss of example i is that of a batch of it alone,
l_i = loss(output[i:i+1], targets[i:i+1]), and g_i = d l_i / d params. The batch's loss
is c * sum_i l_i, with c measured at record time (1/N for a mean over examples, 1 for a
sum). Then the empirical Fisher is c * sum_i g_i g_i^T: (1/N) sum_i g_i g_i^T for a mean
loss, sum_i g_i g_i^T for a summed one (the loss's own reduction, as curvlinops), and the
Fisher is c * sum_i E_y[g_i g_i^T]; both are on the Hessian's and the GGN's scale.

The two empirical Fishers. `empirical_fisher` (the default, ours) takes one gradient per
example, whatever the example holds; curvlinops (`empirical_fisher_terms`) one per loss
term. They agree where each example is one term of a summed loss or of a cross-entropy
averaged over examples only. Where an example holds several terms they differ: squared
error averaged over C outputs gives curvlinops' matrix C times ours (its terms' gradients
are of the summed squared error, ours of the example's mean); a softmax per position
gives a different matrix (ours has the cross-position products g_t g_s^T, curvlinops' only
the per-position blocks). tests/engine/test_fisher_conventions.py checks both against a
reference: ours against per-example gradients taken one example at a time, curvlinops'
against its own recorded answers (fixtures/make_curvlinops_ef.py).
Regularisers of the parameters are no function of the output: add them as `damping`
(an L2 term (lam/2)|w|^2 is damping lam).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import backend, replay, trace, tree
from engine.hessian_algorithms import Callback, FlatOperator, SolveResult, conjugate_gradient
from engine.ops.elementwise import cast, divide
from engine.ops.linalg import einsum
from engine.ops.shape import expand_dims, reshape
from engine.tape import GradientTape, check_source
from engine.tensor import Tensor, as_tensor
from engine.transforms import HessianOperator, scalar_output, value_and_grad, zeros_with_lead

KINDS = ("hessian", "ggn", "fisher", "empirical_fisher", "empirical_fisher_terms")
LIKELIHOODS = ("categorical", "bernoulli", "gaussian")


class CurvatureError(ValueError):
    """The model and loss cannot give this curvature (the message says why)."""


def _tensorize(arg: Any) -> Any:
    leaves, treedef = tree.flatten(arg)
    return tree.unflatten(treedef, [None if x is None else as_tensor(x) for x in leaves])


def _rows(structure: Any, index: Any) -> Any:
    """The examples `index` (a slice or integer array) of every leaf (axis 0)."""
    leaves, treedef = tree.flatten(structure)
    picked: list[Tensor | None] = []
    for leaf in leaves:
        if leaf is None:
            picked.append(None)
            continue
        t = as_tensor(leaf)
        picked.append(Tensor(t.value[index]))
    return tree.unflatten(treedef, picked)


def _relative(a: Any, b: Any) -> float:
    """|a - b| / max(|a|, |b|) in the 2-norm (0 when both are zero)."""
    xp = backend.array_module(a)
    scale = max(float(xp.linalg.norm(a)), float(xp.linalg.norm(b)))
    return 0.0 if scale == 0.0 else float(xp.linalg.norm(a - b)) / scale


@dataclass(frozen=True)
class Likelihood:
    """The predictive distribution the loss was recognised as the negative log-likelihood
    of: `family` (categorical, bernoulli, gaussian), `scale` (the loss is scale x that
    negative log-likelihood summed over examples and over each example's independent
    terms: c for a sum or a mean over examples, c/m for a mean over the m sigmoids or
    softmaxes of each example too, as curvlinops scales it) and, for the Gaussian, the
    variance that makes the squared error its negative log-likelihood (scale c)."""

    family: str
    scale: float = 1.0
    variance: float | None = None


@dataclass
class InfluenceResult:
    """Influence of every training example on the test loss (Koh and Liang, 2017).

    `scores[i]` = I_up,loss(z_i, z_test) = -g_i . s_test with s_test = (C + damping I)^-1
    grad L_test: the rate of change of the test loss when example i is up-weighted.
    Positive: harmful (up-weighting it raises the test loss); negative: helpful.
    `removal[i]` = -c * scores[i], the predicted change of the test loss when example i
    is left out of the training loss (c = 1/N for a mean loss, 1 for a sum).
    `helpful`: the indices of negative scores, most negative first; `harmful`: those of
    positive scores, largest first; at most top_k each, fewer when fewer examples have
    that sign (a zero score is neither), so the two never share an index.
    """

    scores: np.ndarray
    removal: np.ndarray
    helpful: np.ndarray
    harmful: np.ndarray
    test_loss: float
    s_test: Any  # in the parameters' structure, host arrays
    solve: SolveResult


class Curvature:
    """A model and its loss at one point, recorded once, for curvature products.

    model(params, data) -> output; loss(output, targets) -> scalar. `params` is a tensor
    or a structure of them (the differentiated arguments); `data` and `targets` anything
    the two functions take (for the Fisher, the empirical Fisher and influence, the
    targets' leaves and the output have the examples along axis 0).

    Recording: one forward pass on a persistent tape, with the loss's gradient recorded
    for the Hessian (with `hessian=False` the gradient is not recorded, which halves what
    is kept when only the other curvatures are wanted; a Hessian asked for later then
    records the forward once more). What the other curvatures need is added on first use
    and kept: the transposed VJP of the model (for J v without a second forward), the
    loss on the output (its gradient G and Hessian H_L), the per-example scale c, the
    recognised likelihood, Monte-Carlo target gradients. `operator(kind)` views share it
    all.
    """

    # The per-example walk of this recording (engine/per_example.py), built on first use.
    _per_example: Any = None

    def __init__(
        self,
        model: Callable[..., Any],
        loss: Callable[..., Any],
        params: Any,
        data: Any = None,
        targets: Any = None,
        *,
        max_batch: int | None = None,
        hessian: bool = True,
    ):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._model, self._loss = model, loss
        self._record_hessian = hessian
        self.data = data
        self.targets = targets
        self.max_batch = max_batch
        self._operators: dict[tuple, CurvatureOperator] = {}
        self._record(params)

    # Recording ---------------------------------------------------------------------------
    def _record(self, params: Any) -> None:
        params = _tensorize(params)
        flat, treedef = tree.flatten(params)
        flat = [check_source(p, "curvature") for p in flat]
        inner = GradientTape(persistent=True, watch_accessed_variables=False)
        rebuilt = tree.unflatten(treedef, flat)
        # The outer tape records the forward and the gradient's backward pass: the
        # Hessian's second-order pass runs over it.
        outer = None
        if self._record_hessian:
            outer = GradientTape(persistent=True, watch_accessed_variables=False)
            outer.watch(flat)
        with outer if outer is not None else contextlib.nullcontext():
            with inner:
                inner.watch(flat)
                # Data given as floating-point tensors is watched too (its ops are
                # recorded; gradients over the parameters are unchanged): the
                # per-example walk (engine/per_example.py) then reads this recording.
                self._watched_data = [
                    x
                    for x in tree.flatten(self.data)[0]
                    if isinstance(x, Tensor) and x.dtype.kind == "f"
                ]
                inner.watch(self._watched_data)
                output = self._model(rebuilt, self.data)
                if not isinstance(output, Tensor) or output.dtype.kind != "f":
                    raise CurvatureError(
                        "curvature: the model must return one floating-point tensor, got "
                        f"{type(output).__name__ if not isinstance(output, Tensor) else output.dtype}"
                    )
                value = scalar_output(self._loss(output, self.targets), "curvature")
            grads = inner.gradient(value, flat, unconnected_gradients="zero")
        self._outer, self._inner = outer, inner
        self._hessian: HessianOperator | None = None  # hessian=False: recorded when asked
        self._flat, self._treedef = flat, treedef
        self._defs = [(treedef, len(flat))]
        self.output, self._value, self._grads = output, value, grads
        self.primals = (rebuilt,)
        self.point: np.ndarray | None = None
        # Built on first use (see the class docstring); a new point drops them.
        self._transposed: tuple | None = None
        self._loss_operator: HessianOperator | None = None
        self._scale: float | None = None
        self._likelihood: Likelihood | None = None
        self._likelihood_problem: str | None = None
        self._samples: dict[tuple, Any] = {}
        self._output_gradient: Tensor | None = None
        self._per_example = None  # the walk is of this recording
        for op in self._operators.values():  # compiled products read the old recording
            op._passes = replay.Passes(limit=8)

    @property
    def value(self) -> Tensor:
        """The loss at the point."""
        return self._value

    @property
    def grad(self) -> Any:
        """The loss's gradient, in the parameters' structure."""
        return tree.unflatten(self._treedef, self._grads)

    @property
    def size(self) -> int:
        return sum(p.size for p in self._flat)

    @property
    def examples(self) -> int:
        """N: the output's first axis."""
        if self.output.ndim < 1:
            raise CurvatureError(
                "curvature: the output is a scalar; per-example curvatures need the examples "
                "along its first axis"
            )
        return self.output.shape[0]

    def operator(
        self, kind: str = "hessian", *, samples: int | None = None, seed: int | None = 0
    ) -> CurvatureOperator:
        """The curvature `kind` (hessian, ggn, fisher, empirical_fisher,
        empirical_fisher_terms) as a
        HessianOperator (hvp, hvp_many, size, primals; the scipy adapter). `samples`
        (fisher only): Monte-Carlo targets per example, drawn with `seed`; None is the
        exact Fisher."""
        if kind not in KINDS:
            raise ValueError(f"curvature must be one of {', '.join(KINDS)}, got {kind!r}")
        if samples is not None:
            if kind != "fisher":
                raise ValueError(f"samples is for the Monte-Carlo Fisher, not {kind!r}")
            if samples < 1:
                raise ValueError(f"samples must be at least 1, got {samples}")
        key = (kind, samples, seed if samples is not None else None)
        if key not in self._operators:
            op = CurvatureOperator(self, kind, samples, seed)
            self._prepare(op)
            self._operators[key] = op
        return self._operators[key]

    def _prepare(self, op: CurvatureOperator) -> None:
        """Refuse a curvature this model and loss cannot give, before any product."""
        if op.kind == "hessian":
            return
        self._output_loss()
        if op.kind in ("empirical_fisher", "fisher", "empirical_fisher_terms"):
            self.scale()
        if op.kind in ("fisher", "empirical_fisher_terms"):
            self.likelihood()

    def _hessian_operator(self) -> HessianOperator:
        """Without the recorded gradient (hessian=False): the forward and gradient
        recorded once more, on first use."""
        if self._hessian is None:
            with trace.nothing_recording():
                self._hessian = HessianOperator(
                    lambda params: self._loss(self._model(params, self.data), self.targets),
                    self.primals[0],
                )
        return self._hessian

    # The pieces on the output ------------------------------------------------------------
    def _output_loss(self) -> HessianOperator:
        """The loss as a function of the output alone, recorded once: its gradient G and
        its Hessian H_L (the loss is cheap beside the model; the model is not re-run)."""
        if self._loss_operator is None:
            detached = Tensor(self.output.value)
            with trace.nothing_recording():
                self._loss_operator = HessianOperator(
                    lambda out: self._loss(out, self.targets), detached
                )
        return self._loss_operator

    @property
    def output_grad(self) -> Tensor:
        """G = d loss / d output (one backward pass of the loss alone, until its Hessian
        operator is recorded for H_L, which has it too)."""
        if self._loss_operator is not None:
            return self._loss_operator.grad[0]
        if self._output_gradient is None:
            detached = Tensor(self.output.value)
            with trace.nothing_recording():
                _, g = value_and_grad(lambda out: self._loss(out, self.targets))(detached)
            self._output_gradient = g
        return self._output_gradient

    def _output_vjp(self) -> tuple:
        """The model's VJP recorded once with a placeholder cotangent, so that J v is one
        backward pass over it (its transpose), as `linearize` does."""
        if self._transposed is None:
            xp = backend.array_module(self.output.value)
            dummy = Tensor(xp.zeros_like(self.output.value))
            tape = GradientTape(persistent=True, watch_accessed_variables=False)
            with trace.nothing_recording(), tape:
                tape.watch(dummy)
                vjps = self._inner.gradient(self.output, self._flat, output_gradients=dummy)
            connected = [i for i, g in enumerate(vjps) if g is not None]
            self._transposed = (tape, dummy, [vjps[i] for i in connected], connected)
        return self._transposed

    def scale(self) -> float:
        """c, with loss = c * sum_i l_i: measured on the two examples with the largest
        output gradients, each against its loss alone (both must give the same c)."""
        if self._scale is None:
            n = self.examples
            g = self.output_grad.value
            xp = backend.array_module(g)
            norms = backend.to_host(xp.sqrt((g.reshape(n, -1) ** 2).sum(axis=1)))
            if n == 0 or float(norms.max()) == 0.0:
                raise CurvatureError(
                    "curvature: the loss's gradient on the output is zero for every example, "
                    "so its per-example scale (a mean or a sum) cannot be measured"
                )
            tol = 1e-3 if g.dtype.itemsize <= 4 else 1e-7
            found: list[Any] = []
            for i in [int(i) for i in np.argsort(-norms, kind="stable")[:2] if norms[i] > 0]:
                single = Tensor(self.output.value[i : i + 1])
                one = _rows(self.targets, slice(i, i + 1))
                with trace.nothing_recording():
                    _, g_one = value_and_grad(lambda out, one=one: self._loss(out, one))(single)
                g_one, g_i = g_one.value, g[i : i + 1]
                denominator = float((g_one * g_one).sum())
                c = float((g_i * g_one).sum()) / denominator if denominator else 0.0
                if (
                    c <= 0
                    or _relative(g_i, c * g_one) > tol
                    or (found and abs(c - found[0]) > tol * found[0])
                ):
                    raise CurvatureError(
                        "curvature: the loss is not a sum or mean of per-example terms along "
                        f"axis 0 (example {i}'s gradient in the batch is not the same positive "
                        "multiple of its gradient alone as the others'); per-example "
                        "curvatures (fisher, empirical_fisher, influence) need such a loss"
                    )
                found.append(c)
            self._scale = found[0]
        return self._scale

    def _loss_terms(self) -> tuple[Any, float]:
        """curvlinops' terms: G as (1, rows, width), a row per term along the output's
        last axis (width 1 for a vector output), and R with loss = (1/R) sum_n l_n, l_n
        the term's summed loss: 1 / scale for a categorical or Bernoulli likelihood; for
        squared error loss = a sum (o - y)^2 with a = c / (2 variance), so R = 1 / a."""
        likelihood = self.likelihood()
        g = self.output_grad  # a Tensor: a compiled product replays this step too
        width = g.shape[-1] if g.ndim >= 2 else 1
        if likelihood.family == "gaussian":
            assert likelihood.variance is not None
            factor = 2.0 * likelihood.variance / likelihood.scale
        else:
            factor = 1.0 / likelihood.scale
        return reshape(g, (1, -1, width)), factor

    def likelihood(self) -> Likelihood:
        """The distribution the loss is the negative log-likelihood of (see LIKELIHOODS),
        recognised from the loss's gradient and Hessian on the output at this point.
        CurvatureError when it is none of them: then the Fisher is not the GGN."""
        if self._likelihood is None and self._likelihood_problem is None:
            self._likelihood, self._likelihood_problem = _recognise(self)
        if self._likelihood is None:
            raise CurvatureError(self._likelihood_problem)
        return self._likelihood

    def _sample_gradients(self, samples: int, seed: int | None) -> Any:
        """G_s = d loss(output, y_s) / d output for S target draws y_s ~ p(y | output):
        an array (S, *output.shape)."""
        key = (samples, seed)
        if key not in self._samples:
            likelihood = self.likelihood()
            rng = np.random.default_rng(seed)
            out = backend.to_host(self.output.value)
            raw_targets, rebuild = _single_target(self.targets)
            targets = backend.to_host(raw_targets)
            detached = Tensor(self.output.value)
            grads = []
            for _ in range(samples):
                drawn = _draw(likelihood, out, targets, rng)
                y = rebuild(Tensor(backend.asarray(drawn, drawn.dtype, self.output.device)))
                with trace.nothing_recording():
                    _, g = value_and_grad(lambda o, y=y: self._loss(o, y))(detached)
                grads.append(g.value)
            xp = backend.array_module(self.output.value)
            self._samples[key] = xp.stack(grads)
        return self._samples[key]

    # Products ----------------------------------------------------------------------------
    def jvp(self, flat_v: list[Tensor], batch_ndim: int, lead: tuple) -> Tensor:
        """J v: (*lead, *output.shape), one backward pass over the transposed VJP."""
        tape, dummy, vjps, connected = self._output_vjp()
        if not connected:
            return zeros_with_lead(self.output, lead)
        cts = tape._run(vjps, [flat_v[i] for i in connected], [dummy], batch_ndim)
        jv = cts.get(id(dummy))
        return zeros_with_lead(self.output, lead) if jv is None else jv

    def vjp(self, u: Tensor, batch_ndim: int, lead: tuple) -> list[Tensor]:
        """J^T u for u of shape (*lead, *output.shape): one pass over the forward's record."""
        cts = self._inner._run([self.output], [u], self._flat, batch_ndim)
        return [
            zeros_with_lead(p, lead) if cts.get(id(p)) is None else cts[id(p)] for p in self._flat
        ]

    def _product(
        self, op: CurvatureOperator, flat_v: list[Tensor], batch_ndim: int, lead: tuple
    ) -> list[Tensor]:
        if op.kind == "hessian":
            if self._outer is None:
                return self._hessian_operator()._product(flat_v, batch_ndim, lead)
            cts = self._outer._run(self._grads, flat_v, self._flat, batch_ndim)
            return [
                zeros_with_lead(p, lead) if cts.get(id(p)) is None else cts[id(p)]
                for p in self._flat
            ]
        jv = self.jvp(flat_v, batch_ndim, lead)
        # (Engine ops throughout, on tensors the recording holds: a compiled product
        # replays every step; see CurvatureOperator._product.)
        if op.kind == "empirical_fisher":
            gs = expand_dims(self.output_grad, 0)
            mjv = _outer_products(gs, jv, self.scale())
        elif op.kind == "empirical_fisher_terms":
            terms, factor = self._loss_terms()
            u = reshape(jv, tuple(lead) + tuple(terms.shape[1:]))
            mjv = reshape(_outer_products(terms, u, 1.0 / factor), jv.shape)
        elif op.kind == "fisher" and op.samples is not None:
            gs = Tensor(self._sample_gradients(op.samples, op.seed))
            mjv = _outer_products(gs, jv, self.likelihood().scale * op.samples)
        else:  # ggn, and the exact Fisher (the GGN of a recognised likelihood)
            mjv = self._output_loss()._apply((jv,), batch_ndim)[0]
        return self.vjp(mjv, batch_ndim, lead)

    # Per-example gradients and influence -------------------------------------------------
    def per_example_gradients(self, chunk_size: int | None = None) -> Any:
        """g_i = d l_i / d params for every example, in the parameters' structure with a
        leading axis N: one batched backward pass whose cotangent row i is example i's
        share of G (in chunks of chunk_size rows, to bound memory)."""
        n, c = self.examples, self.scale()
        g = self.output_grad.value
        xp = backend.array_module(g)
        step = n if chunk_size is None else max(1, chunk_size)
        parts: list[list[Tensor]] = [[] for _ in self._flat]
        with trace.nothing_recording():
            for start in range(0, n, step):
                stop = min(n, start + step)
                seeds = xp.zeros((stop - start,) + g.shape, dtype=g.dtype)
                rows = xp.arange(stop - start)
                seeds[rows, rows + start] = g[start:stop] / c
                for k, piece in enumerate(self.vjp(Tensor(seeds), 1, (stop - start,))):
                    parts[k].append(piece.value)
        flat = [
            Tensor(xp.concatenate(p, axis=0)) if p else zeros_with_lead(q, (0,))
            for p, q in zip(parts, self._flat, strict=True)
        ]
        return tree.unflatten(self._treedef, flat)

    def example_dots(self, vectors: Any) -> np.ndarray:
        """g_i . v for every example i and each vector v: (K, N) for K vectors in the
        parameters' structure with a leading axis K. One batched JVP, no per-example
        gradient formed: g_i . v = (1/c) G_i . (J v)_i."""
        flat_v = [as_tensor(v) for v in tree.flatten(vectors)[0]]
        k = flat_v[0].shape[0]
        with trace.nothing_recording():
            jv = self.jvp(flat_v, 1, (k,)).value
        g = self.output_grad.value
        n = self.examples
        dots = (jv.reshape(k, n, -1) * g.reshape(1, n, -1)).sum(axis=2) / self.scale()
        return np.asarray(backend.to_host(dots), dtype=np.float64)

    def test_gradient(
        self, test_data: Any = None, test_targets: Any = None, *, rows: Any = None
    ) -> tuple[Tensor, Any]:
        """(L_test, grad L_test) at the recorded parameters, L_test = loss(model(params,
        test_data), test_targets) or, with `rows`, the loss of those training examples:
        the right-hand side of influence's solve (a sharded tape sums its parts')."""
        if rows is not None:
            if test_data is not None or test_targets is not None:
                raise ValueError("influence: give test data and targets, or rows, not both")
            index = np.asarray(rows, dtype=np.int64).reshape(-1)
            n = self.examples
            if index.size == 0 or index.min() < -n or index.max() >= n:
                raise ValueError(f"influence: rows must be non-empty indices below {n}")
            test_data, test_targets = _rows(self.data, index), _rows(self.targets, index)

        def test_loss(params: Any) -> Tensor:
            return self._loss(self._model(params, test_data), test_targets)

        with trace.nothing_recording():
            value, grad = value_and_grad(test_loss)(self.primals[0])
        return value, grad

    def influence(
        self,
        test_data: Any = None,
        test_targets: Any = None,
        *,
        rows: Any = None,
        curvature: str = "ggn",
        damping: float = 0.0,
        samples: int | None = None,
        seed: int | None = 0,
        top_k: int = 10,
        tol: float = 1e-6,
        max_iterations: int | None = None,
        max_hvps: int | None = None,
        max_seconds: float | None = None,
        callback: Callback | None = None,
        operator: HessianOperator | None = None,
        preconditioner: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> InfluenceResult:
        """Koh and Liang's influence of every training example on the test loss
        L_test = loss(model(params, test_data), test_targets) (or, with `rows`, on the
        loss of those training rows): s_test = (C + damping I)^-1 grad L_test by
        conjugate gradient on the curvature C (the GGN by default: positive
        semi-definite for convex losses of the output, where a trained non-convex model's
        Hessian is often indefinite and CG on it stops at negative curvature), then the
        scores -g_i . s_test of all examples in one batched pass. See InfluenceResult. `max_hvps` bounds the CG
        products (solve.hvps); besides them it takes the test loss's gradient (a forward
        and backward pass), one JVP for the scores, and, once per recording, the
        per-example scale's and (Monte-Carlo Fisher) the samples' loss gradients on the
        output, which pass over the output only. `operator`: C given as another
        HessianOperator over the same parameters in the same flat order (a Hessian
        recorded elsewhere), instead of `curvature`'s. `preconditioner`: z = M^-1 r on flat
        vectors for preconditioned CG (a damped KFAC inverse: KFAC.preconditioner)."""
        if top_k < 0:
            raise ValueError(f"top_k must be non-negative, got {top_k}")
        op = self.operator(curvature, samples=samples, seed=seed) if operator is None else operator
        self.scale()  # the scores need the per-example split of G
        value, grad_test = self.test_gradient(test_data, test_targets, rows=rows)
        flat = FlatOperator(op)
        if flat.shapes != [tuple(p.shape) for p in self._flat]:
            raise ValueError(
                f"influence: the operator's parameters have shapes {flat.shapes}, the "
                f"model's {[tuple(p.shape) for p in self._flat]}"
            )
        solve = conjugate_gradient(
            flat.matvec,
            flat.flatten(grad_test),
            damping=damping,
            tol=tol,
            max_iterations=max_iterations,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            callback=callback,
            preconditioner=preconditioner,
        )
        s_test = flat.unflatten(solve.x)
        batched = [
            Tensor(backend.asarray(s[None], p.dtype, p.device))
            for s, p in zip(s_test, self._flat, strict=True)
        ]
        scores = -self.example_dots(tree.unflatten(self._treedef, batched))[0]
        helpful, harmful = top_by_sign(scores, top_k)
        return InfluenceResult(
            scores=scores,
            removal=-self.scale() * scores,
            helpful=helpful,
            harmful=harmful,
            test_loss=float(value.numpy()),
            s_test=tree.unflatten(self._treedef, s_test),
            solve=solve,
        )


def top_by_sign(scores: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(helpful, harmful): the indices of the at most top_k most negative scores, most
    negative first, and of the at most top_k most positive, largest first (ties in index
    order)."""
    order = np.argsort(scores, kind="stable")
    helpful = order[scores[order] < 0][:top_k]
    descending = np.argsort(-scores, kind="stable")
    harmful = descending[scores[descending] > 0][:top_k]
    return helpful, harmful


class CurvatureOperator(HessianOperator):
    """One curvature of a Curvature recording, as a HessianOperator: `hvp(v)` and
    `hvp_many(V)` in the parameters' structure (one positional primal: the params), the
    `max_batch` split, `size`, `primals`, and the scipy adapter (`fun`, `jac`, `hessp`:
    a new point re-records the shared Curvature). The existing algorithms (lanczos,
    hutchinson_trace, conjugate_gradient through FlatOperator) run on it unchanged."""

    def __init__(self, curvature: Curvature, kind: str, samples: int | None, seed: int | None):
        self.curvature = curvature
        self.kind = kind
        self.samples = samples
        self.seed = seed
        self.max_batch = curvature.max_batch
        # Its products are the Curvature's (_product below), compiled per vector layout
        # as a HessianOperator's are: the whole product (J v, H_L or the outer products,
        # J^T u; or the second-order pass) is one replayed schedule from its third call.
        self.compiled = True
        self._passes = replay.Passes(limit=8)

    # The recording is the Curvature's: read through, so every view sees a new point.
    _flat = property(lambda self: self.curvature._flat)
    _defs = property(lambda self: self.curvature._defs)
    _value = property(lambda self: self.curvature._value)
    _grads = property(lambda self: self.curvature._grads)
    primals = property(lambda self: self.curvature.primals)

    @property
    def _point(self) -> np.ndarray | None:
        return self.curvature.point

    @_point.setter
    def _point(self, x: np.ndarray | None) -> None:
        self.curvature.point = x

    def _record(self, primals: tuple) -> None:
        self.curvature._record(primals[0])
        self.curvature._prepare(self)

    def _product(self, flat_v: list[Tensor], batch_ndim: int, lead: tuple) -> list[Tensor]:
        def dynamic(seeds: list[Tensor]) -> list[Tensor | None]:
            return list(self.curvature._product(self, seeds, batch_ndim, lead))

        arrays = [v.value for v in flat_v]
        if not self.compiled or not all(type(a) is np.ndarray for a in arrays):
            return replay.run_dynamic(
                replay.why_dynamic(self.compiled),
                lambda: self.curvature._product(self, flat_v, batch_ndim, lead),
            )
        key = (batch_ndim, tuple((a.shape, a.strides) for a in arrays))  # (dtypes: checked)
        products = self._passes.run(
            key, flat_v, dynamic, lambda: replay.known_tensors(self.curvature)
        )
        return [
            zeros_with_lead(p, lead) if h is None else h
            for h, p in zip(products, self._flat, strict=True)
        ]


def curvature_operator(
    model: Callable[..., Any],
    loss: Callable[..., Any],
    params: Any,
    data: Any = None,
    targets: Any = None,
    curvature: str = "ggn",
    *,
    samples: int | None = None,
    seed: int | None = 0,
    max_batch: int | None = None,
) -> CurvatureOperator:
    """Record model and loss once and return the operator of one curvature."""
    recorded = Curvature(model, loss, params, data, targets, max_batch=max_batch)
    return recorded.operator(curvature, samples=samples, seed=seed)


# ----------------------------------------------------------------------------------------
# Output-space pieces (host-side bookkeeping on arrays; no tape sees them)
# ----------------------------------------------------------------------------------------


def _outer_products(gs: Tensor, u: Tensor, divisor: float) -> Tensor:
    """sum_s blockdiag_i(G_si G_si^T) u / divisor for G (S, N, ...) and u (*lead, N, ...):
    per example, the inner products with u, then those multiples of G."""
    s, n = gs.shape[0], gs.shape[1]
    batched = reshape(u, (-1, n, math.prod(gs.shape[2:])))
    g = reshape(gs, (s, n, -1))
    if g.dtype != u.dtype:
        g = cast(g, u.dtype)
    dots = einsum("snr,knr->ksn", g, batched)
    out = divide(einsum("ksn,snr->knr", dots, g), divisor)
    return reshape(out, u.shape)


def _softmax(o: np.ndarray) -> np.ndarray:
    e = np.exp(o - o.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _candidates(out: np.ndarray, targets: np.ndarray | None) -> list[tuple]:
    """(family, NLL gradient direction d with loss gradient = k d, Fisher on the output
    per unit k as a function of u) for each family the targets' form allows."""
    if targets is None:
        return []
    found = []
    if out.ndim >= 2:
        p = _softmax(out)
        onehot = None
        if targets.dtype.kind in "iu" and targets.shape == out.shape[:-1]:
            if targets.size and (targets.min() < 0 or targets.max() >= out.shape[-1]):
                return []
            onehot = np.eye(out.shape[-1])[targets]
        elif (
            targets.dtype.kind == "f"
            and targets.shape == out.shape
            and (
                targets.size == 0
                or (targets.min() >= 0 and np.allclose(targets.sum(axis=-1), 1.0, atol=1e-4))
            )
        ):
            onehot = targets
        if onehot is not None:
            found.append(
                (
                    "categorical",
                    p - onehot,
                    lambda u: p * u - p * (p * u).sum(axis=-1, keepdims=True),
                )
            )
    if targets.dtype.kind == "f" and targets.shape == out.shape:
        if targets.size == 0 or (targets.min() >= 0 and targets.max() <= 1):
            s = 1.0 / (1.0 + np.exp(-out))
            found.append(("bernoulli", s - targets, lambda u: s * (1 - s) * u))
        found.append(("gaussian", out - targets, lambda u: u))
    return found


def _recognise(curv: Curvature) -> tuple[Likelihood | None, str | None]:
    out = np.asarray(backend.to_host(curv.output.value), np.float64)
    raw_targets, _ = _single_target(curv.targets)
    targets = None if raw_targets is None else np.asarray(backend.to_host(raw_targets))
    if targets is not None and targets.dtype.kind == "f":
        targets = targets.astype(np.float64)
    g = np.asarray(backend.to_host(curv.output_grad.value), np.float64)
    c = curv.scale()
    rng = np.random.default_rng(0x15)
    u = rng.standard_normal(out.shape)
    loss_op = curv._output_loss()
    hu = np.asarray(
        loss_op.hvp(Tensor(backend.asarray(u, curv.output.dtype, curv.output.device)))[0].numpy(),
        np.float64,
    )
    tol = 1e-3 if curv.output.dtype.itemsize <= 4 else 1e-6
    for family, direction, fisher in _candidates(out, targets):
        fu = fisher(u)
        denominator = float((fu * fu).sum())
        if denominator == 0.0:
            continue
        k = float((hu * fu).sum()) / denominator
        if k <= 0 or _relative(hu, k * fu) > tol or _relative(g, k * direction) > tol:
            continue
        if family == "gaussian":
            return Likelihood(family, scale=c, variance=c / k), None
        # The loss is k x the summed NLL: k = c for a sum or mean over examples, c / m
        # when it also averages over the m terms of each example (multi-label sigmoids,
        # a softmax per sequence position). Either way the Fisher of k x NLL is the GGN.
        terms = out[0].size if family == "bernoulli" else out[0].size // out.shape[-1]
        for scale in {c, c / max(terms, 1)}:
            if abs(k - scale) <= tol * scale:
                return Likelihood(family, scale=scale), None
    return None, (
        "fisher: the loss is not recognised as the negative log-likelihood of the targets "
        "under a categorical (softmax cross-entropy on logits, with class indices or "
        "probabilities as targets), Bernoulli (sigmoid cross-entropy on logits) or "
        "Gaussian (squared error) model, summed or averaged over examples (and over each "
        "example's labels or positions): only there is the Fisher defined from the loss (and "
        "equal to the GGN); use curvature 'ggn' or 'empirical_fisher'"
    )


def _single_target(targets: Any) -> tuple[Any, Callable[[Tensor], Any]]:
    """The one array among the targets' leaves (a tensor, or a structure holding one),
    and how to put a replacement back in that structure; (None, ...) otherwise."""
    leaves, treedef = tree.flatten(targets)
    if len(leaves) != 1 or leaves[0] is None:
        return None, lambda t: t
    try:
        value = as_tensor(leaves[0]).value
    except (TypeError, ValueError):
        return None, lambda t: t
    return value, lambda t: tree.unflatten(treedef, [t])


def _draw(
    likelihood: Likelihood, out: np.ndarray, targets: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Targets drawn from the predictive distribution, in the given targets' form."""
    out = out.astype(np.float64)
    if likelihood.family == "categorical":
        p = _softmax(out)
        u = rng.random(out.shape[:-1] + (1,))
        labels = np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), out.shape[-1] - 1)
        if targets.dtype.kind in "iu":
            return labels.astype(targets.dtype)
        return np.eye(out.shape[-1], dtype=targets.dtype)[labels]
    if likelihood.family == "bernoulli":
        s = 1.0 / (1.0 + np.exp(-out))
        return (rng.random(out.shape) < s).astype(targets.dtype)
    assert likelihood.variance is not None
    noise = rng.standard_normal(out.shape) * math.sqrt(likelihood.variance)
    return (out + noise).astype(targets.dtype)


__all__ = [
    "KINDS",
    "LIKELIHOODS",
    "Curvature",
    "CurvatureError",
    "CurvatureOperator",
    "InfluenceResult",
    "Likelihood",
    "curvature_operator",
]
