"""Curvature beyond products, on a tape recorded with `output` (issue 30): per-example
gradients and their statistics, Kronecker factors (KFAC, EKFAC), and Laplace
approximations kept with the tape. The math is the engine's (engine/per_example.py,
engine/kfac.py, engine/laplace.py); this module turns payloads into its calls and its
answers into results keyed by the tape's source keys."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from engine.curvature import Curvature, CurvatureError
from engine.footprint import held_bytes
from engine.hessian_algorithms import FlatOperator
from engine.hessian_algorithms.hutchinson import MIN_STDERR_SAMPLES, tolerance_met
from engine.kfac import KFAC, curvature_diagonal, fisher_diagonal_draws
from engine.laplace import Laplace
from engine.per_example import MixedExamplesError, PerExample, per_example
from service.core.operations import CurvatureKind, LaplaceOptions, LaplaceStructure, Sharing
from service.worker import tapes
from service.worker.compute import RequestError, WorkerContext

DEFAULT_BUDGET = 1 << 30  # bytes of per-example gradients held at once, without a budget
MAX_LAPLACES = 8  # fits kept per tape (the oldest goes first)


def _names(session: tapes.TapeSession) -> dict[str, str]:
    """source name -> answer key."""
    return {name: key for key, name in session.request.sources.items()}


def _keyed(session: tapes.TapeSession, by_name: Mapping[str, Any]) -> dict[str, Any]:
    names = _names(session)
    return {names[n]: v for n, v in by_name.items()}


def _examples(session: tapes.TapeSession, what: str) -> tuple[Curvature, PerExample]:
    """The tape's curvature recording and its per-example walk, built once and kept;
    a model that mixes examples is refused naming the line where it does."""
    curvature = tapes.session_curvature(session)
    tapes.check_batched_targets(session, what)
    if getattr(curvature, "_per_example", None) is None:
        assert session.split is not None
        seen: dict[str, Any] = {}
        model, _ = session.split.functions(session.leaves, seen)
        try:
            curvature._per_example = PerExample(
                model, curvature._flat, curvature._treedef, curvature.data
            )
        except MixedExamplesError as exc:
            message = _at_line(str(exc), exc, seen)
            raise RequestError("batch-dependence", message, field="output") from None
    return curvature, curvature._per_example


def _at_line(message: str, exc: MixedExamplesError, seen: Mapping[str, Any]) -> str:
    """The message with the program line where the mixing op sits: the first line
    whose value was recorded at or after that op."""
    if exc.record is None or exc.records is None:
        return message
    position = {id(o): i for i, r in enumerate(exc.records) for o in r.outputs}
    at = next((i for i, r in enumerate(exc.records) if r is exc.record), None)
    if at is None:
        return message
    lines = sorted((position[id(v)], name) for name, v in seen.items() if id(v) in position)
    for index, name in lines:
        if index >= at:
            return message.replace("per-example: ", f"per-example: at line {name!r}, ", 1)
    return message


# The options a Laplace fit's errors begin with (engine/laplace.py): each names its own.
LAPLACE_FIELDS = ("sigma_noise", "prior_precision", "structure", "subset", "count", "link")


def _laplace_error(exc: Exception, field: str) -> RequestError:
    """A Laplace fit's refusal, naming the option its message begins with (else `field`):
    'sigma_noise is for regression' is about sigma_noise, not the curvature."""
    text = str(exc).removeprefix("laplace: ")
    named = next((f for f in LAPLACE_FIELDS if text.startswith(f)), field)
    return _curvature_error(exc, named)


def _curvature_error(exc: Exception, field: str = "curvature") -> RequestError:
    if isinstance(exc, MixedExamplesError):
        return RequestError("batch-dependence", str(exc), field="output")
    return RequestError("request", str(exc), field=field)


def _check_seed_bytes(
    curvature: Curvature,
    kind: str,
    samples: int | None,
    context: WorkerContext | None,
    what: str,
    meetings: PerExample | None = None,
) -> None:
    """Refuse, before anything is allocated, what the loss Hessian's square-root columns
    (or the Monte-Carlo draws) would hold: the exact GGN/Fisher takes R columns of the
    output (R entries per example) and the square roots' N R x R matrices, several
    copies while they are formed; KFAC (`meetings` given) also one copy of every
    layer's output cotangent per column."""
    out = curvature.output
    n = out.shape[0] if out.ndim else 1
    width = out.size // max(n, 1)
    itemsize = 8  # float64 on the host
    if kind == "empirical_fisher":
        columns, per_column = 1, out.size * itemsize
    elif samples is not None:
        columns, per_column = samples, out.size * itemsize
    else:
        columns, per_column = width, 5 * out.size * itemsize  # units, H columns, eigh
    if meetings is not None:
        per_column += sum(m.record.outputs[0].size for m in meetings.flow.meetings) * itemsize
    held = columns * per_column
    budget = (context.memory_budget if context is not None else None) or DEFAULT_BUDGET
    if held > budget:
        source = f"{samples} Monte-Carlo draws" if samples else f"{columns} columns"
        raise RequestError(
            "too-large",
            f"{what}: {source} of the output {list(out.shape)} (the loss Hessian's square "
            f"root{', and each layer output per column' if meetings is not None else ''}) "
            f"hold {held:,} bytes, above this server's {budget:,}; use fewer examples per "
            "tape, fewer samples, or the empirical Fisher",
            field="samples" if samples else "curvature",
            limit=budget,
        )


# ----------------------------------------------------------------------------------------
# Per-example gradients
# ----------------------------------------------------------------------------------------


def _as_dict(options: Any) -> dict[str, Any]:
    """A row's typed options (a msgspec Struct) as the plain values these functions read."""
    values: dict[str, Any] = msgspec.to_builtins(options)
    return values


@tapes.operation("tape_per_example")
def per_example_row(flat: Any, keys: list[str], asked: tapes.Asked) -> dict[str, Any]:
    assert asked.session is not None, "a sharded tape refuses per-example gradients"
    return per_example_of(asked.session, _as_dict(asked.options), asked.context)


def definition_per_example(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The stateless form: the definition recorded as a tape for this request only."""
    session = tapes.record(f"per-example-{secrets.token_hex(4)}", payload, context)
    return per_example_of(session, payload, context)


def per_example_of(
    session: tapes.TapeSession, payload: Mapping[str, Any], context: WorkerContext
) -> dict[str, Any]:
    curvature, _ = _examples(session, "per-example gradients")
    n = curvature.examples
    budget = context.memory_budget or DEFAULT_BUDGET
    per_row = sum(p.size * p.dtype.itemsize for p in curvature._flat)
    keep = bool(payload.get("gradients"))
    if keep and n * per_row > budget:
        raise RequestError(
            "too-large",
            f"gradients: {n} per-example gradients of {per_row:,} bytes each hold "
            f"{n * per_row:,} bytes, above this server's {budget:,}; ask for the "
            "statistics alone (gradients: false), which run in chunks",
            field="gradients",
            limit=budget,
        )
    try:
        found = per_example(curvature, keep_gradients=keep, max_bytes=max(per_row, budget // 4))
    except (MixedExamplesError, CurvatureError) as exc:
        raise _curvature_error(exc, "output") from None
    return {
        "examples": n,
        "scale": found.scale,
        "norms": np.asarray(found.norms).tolist(),
        "norms_by_source": _keyed(session, found.norms_by_source),
        "mean": _keyed(session, found.mean),
        "variance": _keyed(session, found.variance),
        "sum_squares": _keyed(session, found.sum_squares),
        "gradients": _keyed(session, found.gradients) if keep else None,
        "chunks": found.chunks,
    }


# ----------------------------------------------------------------------------------------
# KFAC and EKFAC
# ----------------------------------------------------------------------------------------


def kfac_of(
    session: tapes.TapeSession, options: Mapping[str, Any], context: WorkerContext | None = None
) -> KFAC:
    """The tape's KFAC for these options, fitted once and kept with the tape."""
    curvature, engine = _examples(session, "kfac")
    key = (
        "kfac",
        options.get("curvature") or "ggn",
        options.get("sharing") or "expand",
        options.get("samples"),
        options.get("fisher_seed") or 0,
        bool(options.get("ekfac")),
        options.get("others") or "refuse",
        bool(options.get("separate_bias", True)),
    )
    cache = session.kfacs
    if key not in cache:
        _check_seed_bytes(
            curvature,
            "empirical_fisher" if key[1] == "empirical_fisher" else "ggn",
            key[3] if key[1] == "fisher" else None,
            context,
            "kfac",
            engine,
        )
        try:
            cache[key] = KFAC(
                curvature,
                key[1],
                sharing=key[2],
                samples=key[3],
                seed=key[4],
                ekfac=key[5],
                others=key[6],
                separate_bias=key[7],
                names=list(_names(session)),
            )
        except (MixedExamplesError, CurvatureError, ValueError) as exc:
            raise _curvature_error(exc) from None
        session.remeasure = True
    return cache[key]


def kfac_operator(session: tapes.TapeSession, choice: Any) -> tuple[Any, Any]:
    """curvature kfac / ekfac on the tape's estimators: the GGN's KFAC (expand, sources
    outside layers as their exact block) as an operator and its flat view."""
    kind = str(choice.curvature)
    fitted = kfac_of(session, {"curvature": "ggn", "ekfac": kind == "ekfac", "others": "exact"})
    assert session.flats is not None
    key = (kind, id(fitted))
    if key not in session.flats:
        operator = fitted.operator()
        session.flats[key] = FlatOperator(operator)
    flat = session.flats[key]
    return flat.operator, flat


@tapes.operation("tape_kfac")
def kfac_row(flat: Any, keys: list[str], asked: tapes.Asked) -> dict[str, Any]:
    assert asked.session is not None, "a sharded tape refuses KFAC"
    vector = asked.tensors.get("vector")
    payload = {**_as_dict(asked.options), "vectors": None if vector is None else [vector]}
    return kfac_answer(asked.session, payload, asked.context)


def kfac_answer(
    session: tapes.TapeSession, payload: Mapping[str, Any], context: WorkerContext | None = None
) -> dict[str, Any]:
    fitted = kfac_of(session, payload, context)
    names = list(_names(session))
    damping = float(payload.get("damping") or 0.0)
    layers = []
    for layer in fitted.layers:
        entry: dict[str, Any] = {
            "kind": layer.kind,
            "weight": _names(session)[names[layer.weight]],
            "bias": None if layer.bias is None else _names(session)[names[layer.bias]],
            "joint": layer.joint,
            "eigenvalues": fitted.eigenvalues(layer),
        }
        if payload.get("factors"):
            entry["A"], entry["G"] = layer.A, layer.G
        layers.append(entry)
    result: dict[str, Any] = {
        "layers": layers,
        "others": [_names(session)[names[i]] for i in fitted.others],
        "unreached": [_names(session)[names[i]] for i in fitted.unreached],
        "trace": fitted.trace(),
        "logdet": _finite_or_none(fitted.logdet(damping)),
        "damping": damping,
        "product": None,
    }
    vectors = payload.get("vectors")
    if payload.get("inverse") and not vectors:  # nothing to multiply: not a silent no-op
        raise RequestError(
            "request",
            "inverse: multiplies `vector` by (KFAC + damping I)^-1; give `vector` (a tensor "
            "per source)",
            field="inverse",
        )
    if vectors:
        power = -1.0 if payload.get("inverse") else 1.0
        if power == -1.0 and damping <= 0.0 and min(fitted.all_eigenvalues()) <= 0.0:
            raise RequestError(
                "request",
                "inverse: the KFAC is singular (a Kronecker factor has a zero eigenvalue, as "
                "a softmax's always does); give a positive damping",
                field="damping",
            )
        by_key = session.request.sources
        for v in vectors:
            if set(v) != set(by_key):
                raise RequestError(
                    "request",
                    f"vector has the keys {sorted(v)}; the tape's sources are "
                    f"{sorted(by_key)}: give a tensor for each",
                    field="vector",
                )
        flat = [np.stack([np.asarray(v[key], np.float64) for v in vectors]) for key in by_key]
        shapes = [tuple(p.shape) for p in fitted.curv._flat]
        for key, array, shape in zip(by_key, flat, shapes, strict=True):
            if array.shape[1:] != shape:
                raise RequestError(
                    "request",
                    f"vector: source {key!r} has shape {list(array.shape[1:])}, the tape's "
                    f"{list(shape)}",
                    field="vector",
                )
        out = fitted.apply(flat, power=power, damping=damping if power == -1.0 else 0.0)
        result["product"] = {key: out[j][0] for j, key in enumerate(by_key)}
    return result


def _finite_or_none(x: float) -> float | None:
    return x if np.isfinite(x) else None


# ----------------------------------------------------------------------------------------
# The GGN's diagonal by backpropagated square-root columns
# ----------------------------------------------------------------------------------------


def backprop_diagonal(
    session: tapes.TapeSession, options: Any, context: WorkerContext
) -> dict[str, Any]:
    """diag of the GGN (exact), of the Monte-Carlo Fisher (`samples`) or of the
    empirical Fisher, from per-example passes of the loss Hessian's square-root columns
    (BackPACK's DiagGGNExact / DiagGGNMC): no Hutchinson probes. Exact but for the
    Monte-Carlo Fisher, which answers its draws' standard error."""
    started = time.perf_counter()
    payload = _as_dict(options)
    kind = payload.get("curvature") or "hessian"
    if kind == "hessian":
        raise RequestError(
            "request",
            "method 'backprop' is the diagonal of the GGN, Fisher or empirical Fisher (the "
            "loss Hessian's square-root columns backpropagated); for the Hessian use "
            "exact or hutchinson",
            field="method",
        )
    curvature, _ = _examples(session, "method 'backprop'")
    samples = payload.get("samples")
    _check_seed_bytes(curvature, kind, samples, context, "method 'backprop'")
    max_bytes = context.memory_budget or DEFAULT_BUDGET
    stderr: list[np.ndarray] | None = None
    try:
        if samples is None:  # exact: R square-root columns (one for the empirical Fisher)
            diag = curvature_diagonal(curvature, kind, max_bytes=max_bytes)
        else:  # Monte-Carlo: the draws' mean, and their spread as its standard error
            diag, stderr = _monte_carlo_diagonal(
                curvature, samples, payload.get("fisher_seed") or 0, max_bytes
            )
    except (MixedExamplesError, CurvatureError) as exc:
        raise _curvature_error(exc) from None
    names = list(_names(session))
    n = sum(d.size for d in diag)
    out = curvature.output
    passes = 1 if kind == "empirical_fisher" else samples or out.size // out.shape[0]
    keyed = _names(session)
    error: float | None = 0.0
    converged = True
    if samples is not None:
        # An estimate of the Fisher's diagonal: its Monte-Carlo standard error (unknown
        # from fewer than MIN_STDERR_SAMPLES draws), converged only where a tolerance
        # asked for is met, as every stochastic estimator answers.
        flat_diag = np.concatenate([d.ravel() for d in diag])
        error = None
        if stderr is not None:
            error = float(np.sqrt(np.mean(np.concatenate([e.ravel() for e in stderr]) ** 2)))
        scale = float(np.sqrt(np.mean(flat_diag**2))) if flat_diag.size else 0.0
        converged = error is not None and tolerance_met(
            error, scale, payload.get("rtol"), float(payload.get("atol") or 0.0)
        )
    return {
        "diagonal": {keyed[name]: d for name, d in zip(names, diag, strict=True)},
        "partial": None,
        "stderr": None
        if stderr is None
        else {keyed[name]: e for name, e in zip(names, stderr, strict=True)},
        "error": error,
        "method": "backprop",
        "reached": n,
        "samples": int(passes),
        "batches": int(passes),
        "batch_size": 1,
        "converged": converged,
        "stopped": "tolerance" if samples is not None and converged else "exhausted",
        "hvps": 0,
        "seconds": time.perf_counter() - started,
    }


def _monte_carlo_diagonal(
    curvature: Curvature, samples: int, seed: int | None, max_bytes: int
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The mean of the draws' diagonals and its standard error per entry (None from
    fewer than MIN_STDERR_SAMPLES draws), reduced as the draws come (Welford)."""
    mean: list[np.ndarray] = []
    m2: list[np.ndarray] = []
    count = 0
    for draw in fisher_diagonal_draws(curvature, samples, seed, max_bytes):
        count += 1
        if not mean:
            mean = [d.copy() for d in draw]
            m2 = [np.zeros_like(d) for d in draw]
            continue
        for k, d in enumerate(draw):
            delta = d - mean[k]
            mean[k] += delta / count
            m2[k] += delta * (d - mean[k])
    if count < MIN_STDERR_SAMPLES:
        return mean, None
    return mean, [np.sqrt(m / (count - 1) / count) for m in m2]


# ----------------------------------------------------------------------------------------
# Laplace
# ----------------------------------------------------------------------------------------


@dataclass
class HeldFit:
    """A Laplace fit kept with its tape: the fit, when it was made (seconds since the
    epoch), the array bytes it holds beyond the tape's recording, whether its prior
    precision is the marginal likelihood's maximiser."""

    laplace: Laplace
    created: float
    bytes: int
    tuned: bool


def _laplaces(session: tapes.TapeSession) -> dict[str, HeldFit]:
    return session.laplaces


def _unknown_fit(laplace_id: str, why: str) -> RequestError:
    return RequestError(
        "laplace-not-found",
        f"laplace_id: no Laplace fit {laplace_id!r} on this tape ({why}); GET "
        "/v1/tapes/{id}/laplace lists its fits, POST /v1/tapes/{id}/laplace makes one",
        field="laplace_id",
    )


NOT_HELD = (
    "a fit lives with the tape's recording: deleted, or dropped by an update, a rebuilt "
    "worker or an evicted tape"
)


def _held(session: tapes.TapeSession, payload: Mapping[str, Any]) -> HeldFit:
    laplace_id = payload["laplace_id"]
    found = _laplaces(session).get(laplace_id)
    if found is None:
        raise _unknown_fit(laplace_id, NOT_HELD)
    return found


def _fitted(session: tapes.TapeSession, payload: Mapping[str, Any]) -> Laplace:
    return _held(session, payload).laplace


def _summary(laplace_id: str, la: Laplace, tuned: bool) -> dict[str, Any]:
    return {
        "laplace_id": laplace_id,
        "subset": la.subset,
        "structure": la.structure,
        "curvature": la.curvature,
        "likelihood": la.family,
        "parameters": int(la.n),
        "prior_precision": la.prior_precision,
        "tuned": tuned,
        "sigma_noise": la.sigma_noise if la.regression else None,
        "log_marginal_likelihood": la.log_marginal_likelihood(),
        "log_likelihood": la.log_likelihood(),
        "curvature_used": _fit_used(la),
    }


def _description(laplace_id: str, fit: HeldFit) -> dict[str, Any]:
    """A kept fit as GET /v1/tapes/{id}/laplace[/{laplace_id}] answers it: its summary,
    the bytes it holds, when it was made."""
    return {
        **_summary(laplace_id, fit.laplace, fit.tuned),
        "bytes": fit.bytes,
        "created": fit.created,
    }


def _fit_used(la: Laplace) -> Any:
    """The fit's curvature_used, as its request's options state it (service/core/
    operations.py): its evidence, predictive and samples answer it too."""
    options = LaplaceOptions(
        curvature=CurvatureKind(la.curvature),
        structure=LaplaceStructure(la.structure),
        sharing=Sharing(la.sharing),
    )
    return msgspec.to_builtins(options.curvature_used())


@tapes.operation("tape_laplace")
def laplace_row(flat: Any, keys: list[str], asked: tapes.Asked) -> dict[str, Any]:
    assert asked.session is not None, "a sharded tape refuses a Laplace fit"
    return laplace_fit(asked.session, _as_dict(asked.options), asked.context)


def laplace_fit(
    session: tapes.TapeSession, payload: Mapping[str, Any], context: WorkerContext | None = None
) -> dict[str, Any]:
    curvature, engine = _examples(session, "laplace")
    structure = payload.get("structure") or "kron"
    if structure in ("diag", "kron"):
        _check_seed_bytes(
            curvature,
            payload.get("curvature") or "ggn",
            None,
            context,
            "laplace",
            engine if structure == "kron" else None,
        )
    prior = payload.get("prior_precision")
    tune = bool(payload.get("tune")) or prior == "tune"
    try:
        la = Laplace(
            curvature,
            subset=payload.get("subset") or "all",
            structure=structure,
            curvature=payload.get("curvature") or "ggn",
            prior_precision=1.0 if tune or prior is None else float(prior),
            sigma_noise=float(payload.get("sigma_noise") or 1.0),
            sharing=payload.get("sharing") or "expand",
            names=list(_names(session)),
            max_full=int(payload.get("max_full") or 4096),
        )
        if tune:
            la.tune_prior_precision()
    except (MixedExamplesError, CurvatureError, ValueError) as exc:
        raise _laplace_error(exc, "curvature") from None
    held = _laplaces(session)
    while len(held) >= MAX_LAPLACES:
        held.pop(next(iter(held)))
    laplace_id = secrets.token_hex(8)
    # Its own arrays: the walk stops at the tape's curvature recording, which it shares.
    own = held_bytes(la, shared=(*tapes.SHARED, type(la.curv)))
    held[laplace_id] = HeldFit(la, time.time(), own, tune)
    session.remeasure = True  # the fit is held with the tape: count its bytes
    return _summary(laplace_id, la, tune)


def tape_laplace_evidence(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session, rebuilt = tapes.session_for(payload, context)
    fit = _held(session, payload)
    la = fit.laplace
    prior = payload.get("prior_precision")
    try:
        if prior == "tune":
            la.tune_prior_precision()
        elif prior is not None:
            la.log_marginal_likelihood(float(prior))  # checks it before keeping it
            la.prior_precision = float(prior)
    except (CurvatureError, ValueError) as exc:
        raise _curvature_error(exc, "prior_precision") from None
    if prior is not None:
        fit.tuned = prior == "tune"
    return tapes.finish_answer(
        session, rebuilt, _summary(payload["laplace_id"], la, prior == "tune"), hvp_only=True
    )


def _kept_session(payload: Mapping[str, Any], context: WorkerContext) -> tapes.TapeSession | None:
    """The tape's recording in this worker, never recorded for the asking: listing,
    reading or deleting fits finds none in a worker that lost the tape (None)."""
    session = tapes.sessions(context).get(payload["tape_id"])
    if session is None and "rebuild" not in payload:
        # (Lost since the HTTP side last saw it: it asks again with `rebuild`.)
        raise RequestError(
            "tape-missing", f"worker {context.index} does not hold tape {payload['tape_id']}"
        )
    # `rerecord`: this recording is of older values, its fits with it.
    return None if payload.get("rerecord") else session


def _kept_answer(session: tapes.TapeSession | None, result: dict[str, Any]) -> dict[str, Any]:
    if session is None:
        result["tape"] = {"bytes": 0, "rebuilt": False}
        return result
    return tapes.finish_answer(session, False, result, hvp_only=True)


def tape_laplace_list(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session = _kept_session(payload, context)
    held = {} if session is None else _laplaces(session)
    fits = [_description(laplace_id, fit) for laplace_id, fit in held.items()]
    return _kept_answer(session, {"fits": fits})


def tape_laplace_read(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session = _kept_session(payload, context)
    if session is None:
        raise _unknown_fit(payload["laplace_id"], NOT_HELD)
    return _kept_answer(session, _description(payload["laplace_id"], _held(session, payload)))


def tape_laplace_delete(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session = _kept_session(payload, context)
    if session is None:
        raise _unknown_fit(payload["laplace_id"], NOT_HELD)
    _held(session, payload)
    del _laplaces(session)[payload["laplace_id"]]
    session.remeasure = True  # its memory is free: the tape holds less
    return _kept_answer(session, {"laplace_id": payload["laplace_id"]})


def tape_laplace_predictive(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session, rebuilt = tapes.session_for(payload, context)
    la = _fitted(session, payload)
    curvature = la.curv
    data, _ = _model_test_points(session, curvature, payload["test_inputs"], context)
    # What the predictive holds: the jacobian (M, C, n) and, for Monte-Carlo, the draws.
    rows = next(iter(data.values())).shape[0]
    width = curvature.output.size // curvature.output.shape[0]
    samples = int(payload.get("samples") or 100) if payload.get("link") == "mc" else 0
    held = 8 * rows * width * (la.n + samples + width)
    budget = context.memory_budget or DEFAULT_BUDGET
    if held > budget:
        raise RequestError(
            "too-large",
            f"test_inputs: {rows} test points hold {held:,} bytes of jacobians "
            f"{'and draws ' if samples else ''}(M x C x (n{' + samples' if samples else ''})), "
            f"above this server's {budget:,}; ask for fewer points per request",
            field="test_inputs",
            limit=budget,
        )
    assert session.split is not None
    model, _ = session.split.functions(session.leaves)
    try:
        found = la.predictive(
            model,
            data,
            link=payload.get("link") or "probit",
            samples=int(payload.get("samples") or 100),
            seed=payload.get("seed", 0),
        )
    except (MixedExamplesError, CurvatureError, ValueError) as exc:
        raise _curvature_error(exc, "test_inputs") from None
    result = {
        "mean": found.mean,
        "variance": found.variance,
        "noise": found.noise,
        "probabilities": found.probabilities,
        "link": found.link if not la.regression else None,
        "samples": found.samples,
        "curvature_used": _fit_used(la),
    }
    return tapes.finish_answer(session, rebuilt, result, hvp_only=True)


def _model_test_points(
    session: tapes.TapeSession,
    curvature: Curvature,
    given: Mapping[str, Any],
    context: WorkerContext,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The test inputs the model reads (its data): the loss's targets are not needed."""
    wanted = set(curvature.data)
    if not wanted or not given:
        raise RequestError(
            "request",
            "test_inputs: give new rows for the inputs the model reads along the examples "
            f"axis ({', '.join(map(repr, sorted(wanted))) or 'none: the model reads no data'})",
            field="test_inputs",
        )
    extra = {n: given[n] for n in given if n not in wanted}
    if extra:
        raise RequestError(
            "request",
            f"test_inputs: {', '.join(map(repr, extra))} not read by the model along the "
            f"examples axis; give {', '.join(map(repr, sorted(wanted)))}",
            field="test_inputs",
        )
    # test_points_of checks every input the model and the loss read: fill the loss's
    # targets with one dummy row per test point so that only the model's are required.
    fake = dict(given)
    missing = [n for n in curvature.data if n not in given]
    if missing:
        raise RequestError(
            "request",
            f"test_inputs: missing {', '.join(map(repr, missing))} (the inputs the model reads "
            "along the examples axis)",
            field="test_inputs",
        )
    # A scalar has no rows: test_points_of names its shape (len() would be a TypeError).
    first = np.asarray(next(iter(given.values())))
    rows = first.shape[0] if first.ndim else 0
    for name in curvature.targets:
        if name not in fake:
            leaf = session.program.inputs[name].type
            fake[name] = np.zeros((rows, *leaf.shape[1:]), leaf.dtype)
    return tapes.test_points_of(session, curvature, fake, context)


def tape_laplace_samples(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session, rebuilt = tapes.session_for(payload, context)
    la = _fitted(session, payload)
    count = int(payload["count"])
    budget = context.memory_budget or DEFAULT_BUDGET
    if count * la.n * 8 > budget:
        raise RequestError(
            "too-large",
            f"count: {count} samples of {la.n} parameters hold {count * la.n * 8:,} bytes, "
            f"above this server's {budget:,}",
            field="count",
            limit=budget,
        )
    draws = la.sample(count, seed=payload.get("seed", 0))
    names = list(_names(session))
    params = la.curv._flat
    out, lo = {}, 0
    for i in la.indices:
        size = params[i].size
        out[_names(session)[names[i]]] = draws[:, lo : lo + size].reshape((count, *params[i].shape))
        lo += size
    result = {"samples": out, "count": count, "subset": la.subset, "curvature_used": _fit_used(la)}
    return tapes.finish_answer(session, rebuilt, result, hvp_only=True)


tapes.OPERATORS.update(kfac=kfac_operator, ekfac=kfac_operator)
tapes.DIAGONALS.update(backprop=backprop_diagonal)
tapes.PRECONDITIONERS.update(
    kfac=lambda session: kfac_of(session, {"curvature": "ggn", "others": "exact"}),
    ekfac=lambda session: kfac_of(session, {"curvature": "ggn", "others": "exact", "ekfac": True}),
)

# The table's rows (tape_per_example, tape_kfac, tape_laplace) are handled through
# service/worker/tapes.py's run_operation; these are the fits' questions and the
# stateless per-example gradients.
HANDLERS = {
    "per_example": definition_per_example,
    "tape_laplace_evidence": tape_laplace_evidence,
    "tape_laplace_predictive": tape_laplace_predictive,
    "tape_laplace_samples": tape_laplace_samples,
    "tape_laplace_list": tape_laplace_list,
    "tape_laplace_read": tape_laplace_read,
    "tape_laplace_delete": tape_laplace_delete,
}
