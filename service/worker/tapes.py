"""Tapes inside a worker (issue 6): record once, then answer many requests from the
recording. Runs in the worker processes, next to service/worker/compute.py.

A tape is the definition's forward pass and its target's gradient, recorded once:

- a HessianOperator over the tape's sources (the forward pass and inner gradient on a
  persistent tape): every HVP afterwards is one second-order pass that records nothing,
  so the worker's memory stays flat however many HVPs are asked;
- a second persistent GradientTape, recorded in the same forward pass, that watches
  every floating-point variable and input: gradients and jacobians of *other* names of
  the program (an accuracy, a regularizer, the logits) come from it without running the
  program again.

Tapes live in `WorkerContext.state["tapes"]` by id. A request for a tape this worker
does not hold (it was restarted, or the service was) carries the tape's stored
definition in `rebuild`; without it the answer is the error type "tape-missing" and the
HTTP side asks again with it. Every reply carries `tape: {bytes, rebuilt}`: the bytes of
the arrays the tape holds (forward values, gradient, cached rule stages), which the HTTP
side uses for the memory budget, the quotas and GET /v1/tapes/{id}.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import engine as gt
from engine import replay
from engine.curvature import Curvature, CurvatureError
from engine.footprint import held_bytes
from engine.hessian_algorithms import (
    FlatOperator,
    Progress,
    choose_diagonal_method,
    choose_trace_method,
    conjugate_gradient,
    estimate_diagonal,
    estimate_trace,
    exact_pass_size,
    lanczos,
    power_iteration,
    spectral_density,
)
from engine.hessian_algorithms import budget as algorithm_budget
from engine.hessian_algorithms.hutchinson import FROBENIUS, hutchinson
from engine.language import (
    CompiledProgram,
    Definition,
    DefinitionError,
    ModelSplit,
    Problem,
    Request,
    as_definition,
    compile_definition,
)
from engine.tensor import Tensor
from service.core import defaults, shm
from service.core.operations import (
    BY_KIND,
    OPERATIONS,
    CurvatureChoice,
    curvature_choice,
    decode_options,
)
from service.worker.compute import (
    RequestError,
    WorkerContext,
    check_cost,
    check_jacobian_size,
    check_vector,
    execution,
    given_vectors,
    jacobians_on,
    on_device,
)


@dataclass(eq=False)
class TapeSession:
    tape_id: str
    program: CompiledProgram
    request: Request
    leaves: dict[str, Tensor]
    keys: list[str]  # the answer keys of the sources (aliases), in order
    primals: list[Tensor]
    operator: gt.HessianOperator
    flat: FlatOperator
    recording: gt.GradientTape  # persistent; watches every floating-point leaf
    env: dict[str, Tensor]  # every name of the program, as recorded
    split: ModelSplit | None = None  # the program cut at its output, when one is named
    curvature: Curvature | None = None  # recorded on the first non-Hessian request
    flats: dict[tuple, FlatOperator] | None = None  # per curvature, on first use
    bytes: int = 0
    remeasure: bool = True  # count the bytes at the next HVP too (see finish_answer)
    replay_seen: int = -1  # the operator's replay_changes when its bytes were counted
    # The definition with its leaves as shapes only (no data): a shard's program shapes
    # inferred again at other batch sizes (service/worker/shards.py, jacobians). A
    # rebuilt part is told nothing of its sharding: every tape keeps one.
    skeleton: Definition | None = None
    # Fitted on request and kept with this recording (service/worker/curvature_ops.py):
    # KFACs by their options, Laplace approximations by id.
    kfacs: dict[tuple, Any] = field(default_factory=dict)
    laplaces: dict[str, Any] = field(default_factory=dict)


# What a tape's bytes leave out: the compiled program (shared by every tape of its
# definition) and the skeleton (shapes only; its models are the program's).
SHARED = (CompiledProgram, Definition)


def sessions(context: WorkerContext) -> dict[str, TapeSession]:
    tapes: dict[str, TapeSession] = context.state.setdefault("tapes", {})
    return tapes


def record(tape_id: str, spec: Mapping[str, Any], context: WorkerContext) -> TapeSession:
    """Run the definition once under the tapes; raise on any problem (nothing is kept)."""
    # Its arrays live as long as the tape: out of the request's shared memory first.
    spec = shm.detached(spec)
    definition = as_definition(spec["definition"])
    owned = definition.model_params
    unknown = [n for n in spec.get("initializers", ()) if n not in owned]
    if unknown:  # a PATCH named variables that are neither given nor initializers
        raise DefinitionError(
            [
                Problem(
                    f"the tape's definition has no variable {n!r} (neither a variable nor "
                    "an initializer of its models)",
                    f"variables.{n}",
                    kind="request",
                )
                for n in unknown
            ]
        )
    program = compile_definition(definition, context.limits)
    # A tape serves other targets too: lines the target does not use are expected.
    request = program.check_request(spec["target"], spec.get("sources"), "zero", allow_unused=True)
    target_type = program.types[request.target]
    if math.prod(target_type.shape) != 1 and spec.get("shards"):
        # A part of a sharded tape or request: its shape is the part's, not the batch's.
        raise RequestError(
            "request",
            f"the target of a sharded tape or request must be a scalar (the shards' losses "
            f"are combined into one); {request.target!r} is not: on one of the "
            f"{spec['shards']} shards of the batch it has shape {list(target_type.shape)}. "
            "Reduce it over the batch (mean() or sum(), and shard_reduction to match)",
        )
    if math.prod(target_type.shape) != 1:
        raise RequestError(
            "request",
            f"a tape's target must be a scalar (it answers Hessian-vector products); "
            f"{request.target!r} has shape {list(target_type.shape)}. Reduce it (sum(), "
            "mean()); other targets, of any shape, can be asked of the tape afterwards",
        )
    if not request.sources:
        raise RequestError(
            "request",
            "the tape has no sources: the definition has no trainable floating-point "
            "variable; name the sources",
        )
    # With an output named, the program is cut there now, so a bad cut is a 422 at once.
    split = (
        None
        if spec.get("output") is None
        else program.split(spec["output"], request.target, request.sources)
    )
    leaves = program.leaves(definition, context.device)
    names = list(request.sources.values())
    recording = gt.GradientTape(persistent=True, watch_accessed_variables=False)
    recorded: dict[str, dict[str, Tensor]] = {}

    def f(*values: Tensor) -> Tensor:
        env = dict(leaves)
        env.update(zip(names, values, strict=True))
        with recording:
            recording.watch([v for v in env.values() if v.dtype.kind == "f"])
            recorded["env"] = program.run(env)
        return recorded["env"][request.target]

    # Batched passes over the tape (HVP vectors, probes) are split to fit the memory budget.
    most = program.batch_within(context.memory_budget, "recording the tape and one HVP pass")
    # Recording is a forward pass and its gradient: guarded as /v1/gradient is.
    check_cost(program, 1, True, context, "recording the tape")
    operator = gt.hessian_operator(f, *[leaves[n] for n in names], max_batch=most)
    session = TapeSession(
        tape_id=tape_id,
        program=program,
        request=request,
        leaves=leaves,
        keys=list(request.sources),
        primals=[leaves[n] for n in names],
        operator=operator,
        flat=FlatOperator(operator),
        recording=recording,
        env=recorded["env"],
        split=split,
        skeleton=skeleton(definition),
    )
    session.bytes = held_bytes(session, shared=SHARED)
    return session


def _shape_only(array: Any) -> np.ndarray:
    return np.broadcast_to(np.zeros((), array.dtype), array.shape)


def skeleton(definition: Definition) -> Definition:
    """The definition with every variable and input a read-only zero of its shape and
    dtype (a broadcast: no memory): enough to compile it, nothing to run."""
    return dataclasses.replace(
        definition,
        variables={
            n: dataclasses.replace(v, value=_shape_only(v.value))
            for n, v in definition.variables.items()
        },
        inputs={n: _shape_only(a) for n, a in definition.inputs.items()},
    )


# ----------------------------------------------------------------------------------------
# Curvatures beyond the Hessian (engine/curvature.py on the program cut at its output)
# ----------------------------------------------------------------------------------------

PER_EXAMPLE = ("fisher", "empirical_fisher", "empirical_fisher_terms")
# Curvatures, diagonal methods and CG preconditioners served by
# service/worker/curvature_ops.py, which fills these when it is imported (it imports this
# module; dispatch imports both).
OPERATORS: dict[str, Callable[..., tuple[gt.HessianOperator, FlatOperator]]] = {}
DIAGONALS: dict[str, Callable[..., dict[str, Any]]] = {}
PRECONDITIONERS: dict[str, Callable[..., Any]] = {}
MONTE_CARLO_MAX_BYTES = 1 << 30  # without a worker memory budget


def session_curvature(session: TapeSession) -> Curvature:
    """The model and loss recorded once more, cut at the output (on the first request
    that needs it; kept with the tape). The model's inputs along the examples axis (the
    output's first) are its data, the loss's inputs its targets."""
    if session.split is None:
        raise RequestError(
            "request",
            "curvature: curvatures other than the Hessian, and influence, need a tape "
            'that names its model output: record it with "output": the line of the '
            "model's output (the loss's lines follow it)",
            field="curvature",
        )
    if session.curvature is None:
        split, leaves = session.split, session.leaves
        model, loss = split.functions(leaves)
        params = {name: leaves[name] for name in session.request.sources.values()}
        data = {n: leaves[n] for n in split.data if n in _batched(session)}
        targets = {n: leaves[n] for n in split.targets}
        # The tape's own operator answers the Hessian: this recording keeps no gradient
        # for it (influence on the Hessian records one when first asked).
        session.curvature = Curvature(
            model, loss, params, data, targets, max_batch=session.operator.max_batch, hessian=False
        )
        session.flats = {}
        session.remeasure = True  # the tape holds more now: count again
    return session.curvature


def _batched(session: TapeSession) -> set[str]:
    """The inputs along the examples axis: first axis the output's."""
    assert session.split is not None
    shape = session.program.types[session.split.output].shape
    if not shape:
        return set()
    return {n for n, leaf in session.program.inputs.items() if leaf.type.shape[:1] == shape[:1]}


def check_batched_targets(session: TapeSession, what: str) -> None:
    """Per-example curvatures slice the loss's inputs by example: all must be batched."""
    assert session.split is not None
    shape = session.program.types[session.split.output].shape
    batched = _batched(session)
    for name in session.split.targets:
        if name not in batched:
            raise RequestError(
                "request",
                f"{what} splits the loss by example along the first axis of the "
                f"output {session.split.output!r} ({list(shape)}); the loss reads input "
                f"{name!r} of shape {list(session.program.inputs[name].type.shape)}, which "
                "is not along it",
                field="curvature",
            )


def curvature_operator(
    session: TapeSession, choice: CurvatureChoice, context: WorkerContext
) -> tuple[gt.HessianOperator, FlatOperator]:
    """The operator and flat view of the curvature the request asks for (its options,
    or any CurvatureChoice)."""
    kind = str(choice.curvature)
    if kind == "hessian":
        return session.operator, session.flat
    if kind in OPERATORS:  # the Kronecker-factored GGN (curvature_ops.py)
        return OPERATORS[kind](session, choice)
    curvature = session_curvature(session)
    if kind in PER_EXAMPLE:
        check_batched_targets(session, f"curvature {kind!r}")
    samples, seed = choice.samples, choice.draws_seed
    if samples is not None:
        # The Monte-Carlo Fisher keeps one output-sized gradient per sample.
        held = samples * curvature.output.size * curvature.output.dtype.itemsize
        limit = context.memory_budget or MONTE_CARLO_MAX_BYTES
        if held > limit:
            raise RequestError(
                "too-large",
                f"samples: {samples} Monte-Carlo targets of the output "
                f"{list(curvature.output.shape)} hold {held:,} bytes, above this server's "
                f"{limit:,}; ask for at most {max(1, limit // (held // samples))}",
                field="samples",
                limit=limit,
            )
    try:
        operator = curvature.operator(kind, samples=samples, seed=seed)
    except CurvatureError as exc:
        raise RequestError("request", str(exc), field="curvature") from None
    assert session.flats is not None
    key = (kind, samples, seed)
    if key not in session.flats:
        session.flats[key] = FlatOperator(operator)
        session.remeasure = True
    return operator, session.flats[key]


def _products(
    session: TapeSession, operator: gt.HessianOperator, stacked: list[Tensor]
) -> list[Tensor]:
    """hvp_many in the sources' order: the tape's Hessian takes one primal per source, a
    curvature operator one mapping name -> tensor."""
    if operator is session.operator:
        return list(operator.hvp_many(*stacked))
    names = list(session.request.sources.values())
    (products,) = operator.hvp_many(dict(zip(names, stacked, strict=True)))
    return [products[n] for n in names]


def session_for(payload: Mapping[str, Any], context: WorkerContext) -> tuple[TapeSession, bool]:
    """The tape the request names, rebuilt from `rebuild` when this worker lacks it."""
    tapes = sessions(context)
    tape_id = payload["tape_id"]
    session = tapes.get(tape_id)
    # `rerecord`: the recording here is of older values (another HTTP process changed
    # the tape): the one in `rebuild` replaces it.
    if session is not None and not payload.get("rerecord"):
        return session, False
    spec = payload.get("rebuild")
    if spec is None:
        raise RequestError("tape-missing", f"worker {context.index} does not hold tape {tape_id}")
    session = record(tape_id, spec, context)
    tapes[tape_id] = session
    return session, True


def finish_answer(
    session: TapeSession, rebuilt: bool, result: dict[str, Any], hvp_only: bool
) -> dict[str, Any]:
    # An HVP records nothing. What it may add: the rule stages' caches (filled by the
    # first HVP after a recording), and what the compiled replay keeps for a vector
    # layout (engine/replay.py: seen, captured, its buffers allocated on the first
    # replay), whose changes the operator counts. So the bytes are counted after anything
    # else, after the first HVP that follows, and when replay_changes moves.
    changes = session.operator.replay_changes
    if not hvp_only or session.remeasure or changes != session.replay_seen:
        session.bytes = held_bytes(session, shared=SHARED)
        session.remeasure, session.replay_seen = not hvp_only, changes
    result["tape"] = {"bytes": session.bytes, "rebuilt": rebuilt}
    return result


def _recorded_answer(session: TapeSession) -> dict[str, Any]:
    return {
        "value": session.operator.value.numpy(),
        "gradients": dict(
            zip(session.keys, [g.numpy() for g in session.operator.grad], strict=True)
        ),
        "device": gt.backend.device_of(session.operator.value.value),
        "sources": dict(session.request.sources),
    }


# ----------------------------------------------------------------------------------------
# Handlers
# ----------------------------------------------------------------------------------------


def tape_create(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """Record a tape (replacing one of the same id only once the new one is recorded:
    a failed update keeps the old tape)."""
    session = record(payload["tape_id"], payload, context)
    sessions(context)[session.tape_id] = session
    result = _recorded_answer(session)
    result["tape"] = {"bytes": session.bytes, "rebuilt": False}
    if payload.get("shards"):  # a part: how its target adds up over the batch, if it says
        result["reduction"] = session.program.batch_reduction(
            session.request.target, payload.get("shard_by")
        )
    return result


def tape_drop(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    tapes = sessions(context)
    dropped = [i for i in payload["tape_ids"] if tapes.pop(i, None) is not None]
    if dropped:
        gc.collect()  # hand the arrays back now, cycles included
    return {"dropped": dropped, "held": len(tapes)}


def _stack(arrays: list[Any]) -> np.ndarray:
    """np.stack's new array (never a view of a request's read-only bytes); one array, the
    usual request, as a copy with a leading axis (np.stack's checks cost ~8 us a source)."""
    if len(arrays) == 1:
        return np.asarray(arrays[0])[np.newaxis].copy()
    return np.stack([np.asarray(a) for a in arrays])


def tape_hvp(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session, rebuilt = session_for(payload, context)
    single, vectors = given_vectors(payload, session.keys, session.primals)
    for i, vector in enumerate(vectors):
        check_vector(vector, session.keys, session.primals, "vector" if single else f"vectors.{i}")
    # (the estimate counts a recording the tape has already: small beside many vectors)
    count = len(vectors)
    check_cost(session.program, count, False, context, f"the HVP of {count:,} vector(s)")
    stacked = [
        on_device(_stack([v[k] for v in vectors]), p, context)
        for k, p in zip(session.keys, session.primals, strict=True)
    ]
    # (a message without `curvature` asks for the Hessian)
    operator, _ = curvature_operator(session, curvature_choice(payload.get("curvature")), context)
    with replay.observe() as observed:  # (the tape's HVP passes compile per vector layout)
        products = _products(session, operator, stacked)  # batched passes, nothing recorded
    host = [p.numpy() for p in products]
    # [i, ...]: a 0-d parameter's product stays a 0-d array, never a bare number.
    answers = [
        {k: host[j][i, ...] for j, k in enumerate(session.keys)} for i in range(len(vectors))
    ]
    result = {
        "hvp": answers[0] if single else None,
        "hvps": None if single else answers,
        "execution": execution(observed),
    }
    return finish_answer(session, rebuilt, result, hvp_only=True)


def other_request(session: TapeSession, payload: Mapping[str, Any]) -> Request:
    target = payload.get("target") or session.request.target
    sources = payload.get("sources")
    if sources is None:
        sources = dict(session.request.sources)
    return session.program.check_request(
        target, sources, payload.get("unconnected", "none"), allow_unused=True
    )


def tape_gradient(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The gradient of any name of the program over any floating-point leaves, from the
    recording (one backward pass; the program does not run again)."""
    session, rebuilt = session_for(payload, context)
    request = other_request(session, payload)
    y = session.env[request.target]
    watched = {key: session.leaves[name] for key, name in request.sources.items()}
    grads = session.recording.gradient(y, watched, unconnected_gradients=request.unconnected)
    result = {
        "value": y.numpy(),
        "gradients": {k: None if g is None else g.numpy() for k, g in grads.items()},
    }
    return finish_answer(session, rebuilt, result, hvp_only=False)


def tape_jacobian(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    session, rebuilt = session_for(payload, context)
    request = other_request(session, payload)
    y = session.env[request.target]
    watched = {key: session.leaves[name] for key, name in request.sources.items()}
    batch = bool(payload.get("batch"))
    check_jacobian_size(
        request.target,
        tuple(y.shape),
        {k: tuple(t.shape) for k, t in watched.items()},
        batch,
        context,
    )
    count = math.prod(tuple(y.shape)[1:] if batch else tuple(y.shape))
    check_cost(session.program, count, True, context, f"the jacobian of {count:,} rows")
    rows = session.operator.max_batch  # the budget's HVP batch bounds a jacobian pass too
    jacobians = jacobians_on(
        session.recording, y, watched, batch, request.unconnected, context, rows
    )
    return finish_answer(
        session, rebuilt, {"value": y.numpy(), "jacobians": jacobians}, hvp_only=False
    )


# Operations --------------------------------------------------------------------------------
# Every row of service/core/operations.py has its function here, registered under the
# row's kind: `fn(flat, keys, asked)`, on a flat operator (a tape's, or a sharded tape's
# whose matvec asks its parts: service/worker/shards.py), `keys` the sources in the flat
# order, `asked` the request (its typed options, tensors, time and tape).


@dataclass
class Asked:
    """One operation's request inside the worker."""

    options: Any  # the row's options Struct (service/core/operations.py), typed
    tensors: Mapping[str, Any]  # the row's tensor fields, decoded by the HTTP side
    context: WorkerContext
    started: float  # now() when the request arrived (a rebuild counts against it)
    session: TapeSession | None = None  # None on a sharded run's coordinator

    def seconds_left(self) -> float:
        """The algorithm's own time budget, less what a rebuild took (at least
        ALGORITHM_MIN_SECONDS, the smallest max_seconds a request may give)."""
        budget = float(self.options.max_seconds)
        elapsed = now() - self.started
        return max(defaults.ALGORITHM_MIN_SECONDS, budget - elapsed)

    def relay(self) -> Callable[[Progress], None] | None:
        return _relay(self.context)


def now() -> float:
    """The seconds the algorithms' budgets count (engine.hessian_algorithms.budget.clock).
    A request's time before its algorithm starts is counted on the same clock, so a test
    that injects one there sees the whole of a run's max_seconds on it."""
    return algorithm_budget.clock()


OperationFunction = Callable[[Any, list[str], Asked], dict[str, Any]]
OPERATION_FUNCTIONS: dict[str, OperationFunction] = {}


def operation(kind: str) -> Callable[[OperationFunction], OperationFunction]:
    """Register the function of the table row `kind`."""

    def register(fn: OperationFunction) -> OperationFunction:
        OPERATION_FUNCTIONS[kind] = fn
        return fn

    return register


def run_operation(kind: str) -> Callable[[Any, WorkerContext], dict[str, Any]]:
    """The worker handler of a table row: the options decoded (typed), the tape found or
    rebuilt, the curvature asked applied, the row's function run on it."""
    op = BY_KIND[kind]

    def handler(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
        started = now()
        options = decode_options(op, payload["options"])
        session, rebuilt = session_for(payload, context)
        _, flat = curvature_operator(session, options, context)
        asked = Asked(options, payload, context, started, session)
        result = OPERATION_FUNCTIONS[kind](flat, session.keys, asked)
        return finish_answer(session, rebuilt, result, hvp_only=True)

    handler.__name__ = kind
    return handler


def _relay(context: WorkerContext) -> Callable[[Progress], None] | None:
    """An algorithm's progress callback that forwards to the request's caller (a job),
    or None when nobody asked."""
    if context.report is None:
        return None

    def relay(p: Progress) -> None:
        context.progress(
            hvps=p.hvps,
            max_hvps=p.max_hvps,
            estimate=p.estimate,
            error=p.error,
            seconds=p.seconds,
            max_seconds=p.max_seconds,
            unit="hvps",
        )

    return relay


def _check_max_hvps(value: int, at_least: int, what: str, instead: str = "") -> None:
    if value < at_least:
        raise RequestError(
            "request",
            f"max_hvps: {what} needs at least {at_least}, got {value} (the request's "
            f"max_hvps, or its default){instead}",
            field="max_hvps",
        )


def _check_basis(context: WorkerContext, rows: int, n: int, what: str, fewer: str) -> None:
    """Refuse (too-large) an algorithm whose host vectors (rows x n float64) would pass the
    server's lanczos_max_basis_bytes."""
    if 8 * rows * n > context.lanczos_max_basis_bytes:
        raise RequestError(
            "too-large",
            f"{what} of {rows} vectors of {n:,} parameters ({8 * rows * n:,} bytes) exceeds "
            f"this server's lanczos_max_basis_bytes ({context.lanczos_max_basis_bytes:,}); "
            f"{fewer}",
            limit=context.lanczos_max_basis_bytes,
        )


@operation("tape_eigenvalues")
def eigenvalues_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    o, context = asked.options, asked.context
    k = o.k
    if k > flat.n:
        raise RequestError(
            "request",
            f"k: the tape has {flat.n} parameters, so at most {flat.n} eigenvalues",
            field="k",
        )
    _check_max_hvps(o.max_hvps, k, f"k = {k} eigenvalues")
    method = str(o.method)
    # Lanczos holds at least k basis vectors; power iteration its block of k and A times it.
    rows = k if method == "lanczos" else 2 * k
    what = "a Lanczos basis" if method == "lanczos" else "a power-iteration block"
    _check_basis(context, rows, flat.n, what, "ask for fewer eigenvalues")
    tol, max_hvps = o.tol, o.max_hvps
    max_seconds = asked.seconds_left()
    eigenvectors, seed = o.eigenvectors, o.seed
    if method == "power":
        out = power_iteration(
            flat.matvec,
            flat.n,
            k=k,
            tol=tol,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            eigenvectors=eigenvectors,
            seed=seed,
            callback=asked.relay(),
        )
    else:
        out = lanczos(
            flat.matvec,
            flat.n,
            k=k,
            which=str(o.which),
            tol=tol,
            max_hvps=max_hvps,
            max_seconds=max_seconds,
            eigenvectors=eigenvectors,
            seed=seed,
            max_basis_bytes=context.lanczos_max_basis_bytes,
            callback=asked.relay(),
        )
    vectors = None
    if out.eigenvectors is not None:
        vectors = [dict(zip(keys, flat.unflatten(y), strict=True)) for y in out.eigenvectors]
    return {
        "eigenvalues": [float(v) for v in out.eigenvalues],
        "residuals": [float(r) for r in out.residuals],
        "eigenvectors": vectors,
        "method": method,
        "converged": out.converged,
        "stopped": out.stopped,
        "iterations": out.iterations,
        "hvps": out.hvps,
        "seconds": out.seconds,
    }


def _exact_pass(flat: FlatOperator, context: WorkerContext) -> int:
    """Unit vectors per exact pass: as many as the host memory bound, the server's
    hvp_max_vectors and the tape's memory budget (its max_batch) allow."""
    return min(exact_pass_size(flat.n, flat.max_batch), context.hvp_max_vectors)


def _check_method_budget(method: str, max_hvps: int, n: int, what: str) -> None:
    if method == "exact":
        # Past the server's algorithm_max_hvps no max_hvps reaches n: the way on is an
        # estimate, which the default method picks by itself.
        _check_max_hvps(
            max_hvps,
            n,
            f"the exact {what} of a tape with {n} parameters",
            "; for an estimate within the budget, method 'auto' (the default) or 'hutchinson'",
        )
    elif method == "hutchpp":
        _check_max_hvps(max_hvps, 3, "hutchpp (a sketch, its product and a probe)")
    else:
        _check_max_hvps(max_hvps, 2, "a standard error")


@operation("tape_trace")
def trace_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    o, context = asked.options, asked.context
    max_hvps = o.max_hvps
    method = choose_trace_method(str(o.method), flat.n, max_hvps)
    _check_method_budget(method, max_hvps, flat.n, "trace")
    if method == "exact":  # n HVPs, never more (exact named without a budget: the most)
        max_hvps = min(max_hvps, flat.n)
    batch = min(o.batch_size, context.hvp_max_vectors)
    exact_batch = _exact_pass(flat, context)
    out = estimate_trace(
        flat.matvec,
        flat.n,
        method=method,
        batch_size=batch,
        max_hvps=max_hvps,
        rtol=o.rtol,
        atol=o.atol,
        max_seconds=asked.seconds_left(),
        seed=o.seed,
        exact_batch_size=exact_batch,
        max_basis_bytes=context.lanczos_max_basis_bytes,
        callback=asked.relay(),
    )
    return {
        "trace": out.trace,
        "stderr": out.stderr if math.isfinite(out.stderr) else None,
        "method": out.method,
        "samples": out.samples,
        "sketch": out.sketch,
        "batches": out.batches,
        "batch_size": exact_batch if out.method == "exact" else batch,  # hutchpp may hand over
        "converged": out.converged,
        "stopped": out.stopped,
        # The exact method cut short (time_limit) is an estimate from the directions seen.
        "partial": out.method == "exact" and out.stopped != "exhausted",
        "auto_estimated": str(o.method) == "auto" and out.method != "exact",
        "hvps": out.hvps,
        "seconds": out.seconds,
    }


@operation("tape_diagonal")
def diagonal_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    o, context = asked.options, asked.context
    if str(o.method) in DIAGONALS:  # square-root columns, not products (curvature_ops.py)
        assert asked.session is not None, "a sharded tape refuses method backprop"
        return DIAGONALS[str(o.method)](asked.session, o, context)
    max_hvps = o.max_hvps
    method = choose_diagonal_method(str(o.method), flat.n, max_hvps)
    _check_method_budget(method, max_hvps, flat.n, "diagonal")
    if method == "exact":  # n HVPs, never more (exact named without a budget: the most)
        max_hvps = min(max_hvps, flat.n)
    batch = min(o.batch_size, context.hvp_max_vectors)
    exact_batch = _exact_pass(flat, context)
    out = estimate_diagonal(
        flat.matvec,
        flat.n,
        method=method,
        batch_size=batch,
        max_hvps=max_hvps,
        rtol=o.rtol,
        atol=o.atol,
        max_seconds=asked.seconds_left(),
        seed=o.seed,
        exact_batch_size=exact_batch,
        callback=asked.relay(),
    )
    # An exact run stopped by its time limit reached the first entries only (NaN past
    # them, which JSON cannot carry): then no per-source diagonal, the reached entries
    # flat in `partial`, never a made-up value for the others.
    reached = int(np.count_nonzero(~np.isnan(out.diagonal)))

    def per_source(x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(keys, flat.unflatten(x), strict=True))

    result = {
        "diagonal": per_source(out.diagonal) if reached == flat.n else None,
        "partial": out.diagonal[:reached] if reached < flat.n else None,
        "stderr": per_source(out.stderr) if method == "hutchinson" else None,
        "error": out.error if math.isfinite(out.error) else None,
        "method": out.method,
        "reached": reached,
        "samples": out.samples,
        "batches": out.batches,
        "batch_size": exact_batch if method == "exact" else batch,
        "converged": out.converged,
        "stopped": out.stopped,
        "auto_estimated": str(o.method) == "auto" and method != "exact",
        "hvps": out.hvps,
        "seconds": out.seconds,
    }
    if method == "hutchinson" and not np.isfinite(out.stderr).all():
        result["stderr"] = None  # a single probe has no standard error
    return result


@operation("tape_spectral_density")
def spectral_density_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    o, context = asked.options, asked.context
    steps = min(o.steps, flat.n)
    _check_basis(context, steps, flat.n, "a Lanczos basis", "ask for fewer steps")
    probes = o.probes
    grid = o.grid
    out = spectral_density(
        flat.matvec,
        flat.n,
        probes=probes,
        steps=steps,
        sigma=o.sigma,
        points=o.points,
        grid=None if grid is None else np.asarray(grid),
        batch_size=min(probes, context.hvp_max_vectors),
        max_hvps=o.max_hvps,
        max_seconds=asked.seconds_left(),
        max_basis_bytes=context.lanczos_max_basis_bytes,
        seed=o.seed,
        callback=asked.relay(),
    )
    return {
        "grid": [float(x) for x in out.grid],
        "density": [float(x) for x in out.density],
        "stderr": None if out.stderr is None else [float(x) for x in out.stderr],
        "nodes": [[float(x) for x in t] for t in out.nodes],
        "weights": [[float(x) for x in w] for w in out.weights],
        "sigma": out.sigma,
        "probes": out.probes,
        "steps": out.steps,
        "parameters": flat.n,
        "converged": out.converged,
        "stopped": out.stopped,
        "hvps": out.hvps,
        "seconds": out.seconds,
    }


@operation("tape_solve")
def solve_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    """b: the vector asked, or the recorded gradient (a sharded run is handed the parts'
    gradients summed, with `rhs` "gradient")."""
    o, session = asked.options, asked.session
    vector = asked.tensors.get("vector")
    if vector is None:
        assert session is not None, "a sharded solve is handed its b"
        b = flat.flatten(session.operator.grad)
        rhs = "gradient"
    else:
        primals = (
            session.primals
            if session is not None
            else [
                np.broadcast_to(np.zeros((), d), s)
                for s, d in zip(flat.shapes, flat.dtypes, strict=True)
            ]
        )
        check_vector(vector, keys, primals, "vector")  # type: ignore[arg-type]
        b = flat.flatten([np.asarray(vector[k]) for k in keys])
        rhs = asked.tensors.get("rhs", "vector")
    out = conjugate_gradient(
        flat.matvec,
        b,
        damping=o.damping,
        tol=o.tol,
        max_iterations=o.max_iterations,
        max_hvps=o.max_hvps,
        max_seconds=asked.seconds_left(),
        callback=asked.relay(),
    )
    return {
        "solution": dict(zip(keys, flat.unflatten(out.x), strict=True)),
        "rhs": rhs,
        "converged": out.converged,
        "stopped": out.stopped,
        "iterations": out.iterations,
        "hvps": out.hvps,
        "residuals": out.residuals,
        "seconds": out.seconds,
    }


@operation("tape_frobenius_norm")
def frobenius_norm_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    o = asked.options
    batch = min(o.batch_size, asked.context.hvp_max_vectors)
    out = hutchinson(
        flat.matvec,
        flat.n,
        FROBENIUS,
        batch_size=batch,
        max_hvps=o.max_hvps,
        rtol=o.rtol,
        atol=o.atol,
        max_seconds=asked.seconds_left(),
        seed=o.seed,
        callback=asked.relay(),
    )
    stderr = float(out.stderr[0])
    return {
        "frobenius_norm_squared": float(out.mean[0]),
        "stderr": stderr if math.isfinite(stderr) else None,
        "curvature": str(o.curvature),
        "samples": out.samples,
        "batches": out.batches,
        "batch_size": batch,
        "converged": out.converged,
        "stopped": out.stopped,
        "hvps": out.hvps,
        "seconds": out.seconds,
    }


def test_points_of(
    session: TapeSession, curvature: Curvature, given: Mapping[str, Any], context: WorkerContext
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The test inputs as the model's data and the loss's targets: every batched input
    the two read, each with its input's trailing shape and the same number of rows."""
    wanted = list(curvature.data) + [n for n in curvature.targets if n not in curvature.data]
    missing = [n for n in wanted if n not in given]
    extra = [n for n in given if n not in wanted]
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"not read along the examples axis: {', '.join(map(repr, extra))}"] if extra else []
        )
        raise RequestError(
            "request",
            f"test_inputs must give the inputs the model and the loss read along "
            f"the examples axis ({', '.join(map(repr, wanted))}): " + "; ".join(parts),
            field="test_inputs",
        )
    values: dict[str, Tensor] = {}
    rows = None
    for name in wanted:
        leaf = session.program.inputs[name].type
        array = np.asarray(given[name])
        field = f"test_inputs.{name}"
        if array.ndim != len(leaf.shape) or array.shape[1:] != tuple(leaf.shape[1:]):
            raise RequestError(
                "request",
                f"{field} has shape {list(array.shape)}; input {name!r} is "
                f"{list(leaf.shape)}: the test points need its shape after the first axis "
                f"([M, {', '.join(map(str, leaf.shape[1:]))}])",
                field=field,
            )
        if rows is not None and array.shape[0] != rows[1]:
            raise RequestError(
                "request",
                f"{field} has {array.shape[0]} rows but test_inputs.{rows[0]} has "
                f"{rows[1]}: every test input needs one row per test point",
                field=field,
            )
        rows = rows or (name, array.shape[0])
        if array.shape[0] == 0:
            raise RequestError("request", f"{field} has no rows", field=field)
        if (
            leaf.dtype.kind in "iub"
            and array.dtype.kind == "f"
            and (not np.all(np.isfinite(array)) or np.any(array != np.round(array)))
        ):
            raise RequestError(
                "request",
                f"{field}: input {name!r} is {leaf.dtype}; the values given are not whole numbers",
                field=field,
            )
        values[name] = gt.constant(array.astype(leaf.dtype), device=context.device)
    return ({n: values[n] for n in curvature.data}, {n: values[n] for n in curvature.targets})


def _preconditioner(session: TapeSession, options: Any) -> Any:
    """The damped KFAC (EKFAC) inverse the request asks CG to be preconditioned with."""
    kind = str(options.preconditioner)
    if kind == "none":
        return None
    fitted = PRECONDITIONERS[kind](session)
    try:
        return fitted.preconditioner(max(float(options.damping), 0.0))
    except CurvatureError as exc:
        raise RequestError("request", str(exc), field="damping") from None


@operation("tape_influence")
def influence_of(flat: Any, keys: list[str], asked: Asked) -> dict[str, Any]:
    """Koh and Liang's influence of every example on the test loss (engine.curvature); a
    sharded tape runs it in pieces (service/domain/shards.py)."""
    o, context, session = asked.options, asked.context, asked.session
    assert session is not None, "influence on a sharded tape has a path of its own"
    curvature = session_curvature(session)
    check_batched_targets(session, "influence")
    kind = str(o.curvature)
    test_data = test_targets = rows = None
    if asked.tensors.get("rows") is not None:
        n = curvature.examples
        rows = [int(r) for r in asked.tensors["rows"]]
        bad = [r for r in rows if not 0 <= r < n]
        if bad:
            raise RequestError(
                "request",
                f"rows: {bad[:5]} out of range; the tape has {n} examples (rows 0 to N - 1)",
                field="rows",
            )
    else:
        test_data, test_targets = test_points_of(
            session, curvature, asked.tensors["test_inputs"], context
        )
    try:
        out = curvature.influence(
            test_data,
            test_targets,
            rows=rows,
            curvature="ggn" if kind in ("kfac", "ekfac") else kind,
            samples=o.samples,
            seed=o.draws_seed,
            damping=o.damping,
            top_k=o.top_k,
            tol=o.tol,
            max_iterations=o.max_iterations,
            max_hvps=o.max_hvps,
            max_seconds=asked.seconds_left(),
            callback=asked.relay(),
            # The tape's own recording answers the Hessian (the same sources, in order).
            operator=flat.operator if kind in ("hessian", "kfac", "ekfac") else None,
            preconditioner=_preconditioner(session, o),
        )
    except CurvatureError as exc:
        raise RequestError("request", str(exc), field="curvature") from None
    names = session.request.sources
    return {
        "scores": out.scores.tolist(),
        "removal": out.removal.tolist(),
        "helpful": [int(i) for i in out.helpful],
        "harmful": [int(i) for i in out.harmful],
        "test_loss": out.test_loss,
        "s_test": {key: out.s_test[name] for key, name in names.items()},
        "curvature": kind,
        "converged": out.solve.converged,
        "stopped": out.solve.stopped,
        "iterations": out.solve.iterations,
        "hvps": out.solve.hvps,
        "residuals": out.solve.residuals,
        "seconds": out.solve.seconds,
    }


# Stored models --------------------------------------------------------------------------


def check_definition(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """Compile a definition (every problem at once) and describe what it defines."""
    definition = as_definition(payload["definition"])
    program = compile_definition(definition, context.limits)

    def describe(name: str) -> dict[str, Any]:
        t = program.types[name]
        return {"dtype": str(t.dtype), "shape": list(t.shape)}

    return {
        "variables": {
            n: {**describe(n), "trainable": leaf.trainable} for n, leaf in program.variables.items()
        },
        "inputs": {n: describe(n) for n in program.inputs},
        "names": {n: describe(n) for n in program.line_names},
        "functions": sorted(definition.functions),
        "trainable": program.trainable,
    }


HANDLERS: dict[str, Callable[[Any, WorkerContext], Any]] = {
    "tape_create": tape_create,
    "tape_drop": tape_drop,
    "tape_hvp": tape_hvp,
    "tape_gradient": tape_gradient,
    "tape_jacobian": tape_jacobian,
    "check_definition": check_definition,
    # one handler per row of the operation table (service/core/operations.py)
    **{op.kind: run_operation(op.kind) for op in OPERATIONS},
}
