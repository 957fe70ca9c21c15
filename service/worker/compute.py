"""The stateless computations, inside a worker process, and what every handler shares
(the worker's context, preparing a definition, describing errors); the tapes' handlers
build on it in service/worker/tapes.py, and service/worker/dispatch.py routes each
request message to its handler.

A handler takes the payload the HTTP side built (the request with its tensors decoded
to NumPy arrays) and returns plain data with NumPy arrays, or raises. Every exception
becomes an error description `{"type", "message", ...}` (describe_error) that the HTTP
side maps to a problem response; the error classes of the engine never cross the
process boundary.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import engine as gt
from engine import backend, replay
from engine.curvature import CurvatureError
from engine.kernels import warmup
from engine.language import (
    CompiledProgram,
    Definition,
    DefinitionError,
    ExecutionError,
    Limits,
    OverBudget,
    Problem,
    Request,
    as_definition,
    catalogue,
    compile_definition,
    evaluate,
    evaluate_compiled,
)
from engine.language.cost import Throughput
from engine.tape import per_example_jacobian
from engine.tensor import Tensor
from engine.transforms import SingularHessianError
from service.core import defaults, flat
from service.core.execution import Execution
from service.worker.datasets import DatasetCache, DatasetUnavailable, resolve

log = logging.getLogger("gradtape.compute")

# What engine ops raise for data the checks cannot see; anything else is a bug (500).
RUNTIME_ERRORS = (ValueError, TypeError, IndexError, ArithmeticError)

PROGRESS_INTERVAL = 0.05  # seconds between two progress reports of one request


def _plain(value: Any) -> Any:
    """A progress field as msgpack carries it: floats (None for non-finite), lists."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


@dataclass
class WorkerContext:
    """A worker's device, limits, and the state it keeps between requests (issue 6's
    recorded tapes live in `state`, keyed by the caller)."""

    index: int
    device: str
    limits: Limits
    chunk_size: int
    hessian_max_size: int
    jacobian_max_elements: int
    hvp_max_vectors: int = 1024
    lanczos_max_basis_bytes: int = 1 << 30
    memory_budget: int | None = None  # bytes of one request's passes (None: unbounded)
    # The compute-cost guard: this worker's throughputs (None: off), the running request's
    # time limit (dispatch sets it per message) and the most a request may ask for.
    throughput: Throughput | None = None
    time_limit: float | None = None
    job_time_limit: float | None = None  # the job form's most (a refusal names it)
    state: dict[str, Any] = field(default_factory=dict)
    # Where the running request's progress goes (a job's caller asked for it), or None.
    report: Callable[[dict[str, Any]], None] | None = None
    _last_report: float = 0.0

    def progress(self, final: bool = False, **report: Any) -> None:
        """Send a progress report of the running request (at most one per 50 ms, except
        `final` ones), when its caller asked for them; a no-op otherwise."""
        if self.report is None:
            return
        now = time.perf_counter()
        if not final and now - self._last_report < PROGRESS_INTERVAL:
            return
        self._last_report = now
        self.report({k: _plain(v) for k, v in report.items()})

    datasets: DatasetCache = field(default_factory=lambda: DatasetCache(None, 0))

    def describe(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "index": self.index,
            "device": self.device,
            "definition_limits": self.limits.as_dict(),
            "kernels": warmup.status()["state"],
        }


class RequestError(Exception):
    """A request this worker refuses, with the problem type the HTTP side answers."""

    def __init__(self, type_: str, message: str, **extra: Any):
        super().__init__(message)
        self.type = type_
        self.extra = extra


def leave_the_working_directory() -> str:
    """Move the worker into an empty directory of its own, unwritable, removed at exit.

    Whatever path a request manages to open relative to the working directory then finds
    nothing (the HTTP process's may be the data directory, with the store in it: the
    Docker image starts there). The ONNX loader refuses external data outright
    (engine/onnx/external.py); this is the second wall. Every path a worker is given
    (the store's) is absolute (Settings.worker_options)."""
    empty = tempfile.mkdtemp(prefix="gradtape-worker-")
    os.chmod(empty, 0o500)
    os.chdir(empty)
    atexit.register(_remove_quietly, empty)
    return empty


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _throughput(given: Any, device_kind: str) -> Throughput | None:
    """The cost guard's throughputs: each setting given, else the CPU measurement on a
    CPU worker; None (no guard) when one is 0, or on a GPU with one left unset."""
    cpu = (
        defaults.COST_FLOPS_PER_SECOND,
        defaults.COST_TRANSCENDENTALS_PER_SECOND,
        defaults.COST_BYTES_PER_SECOND,
    )
    values = list(given) if given is not None else [None, None, None]
    if device_kind != "cpu" and None in values:
        return None
    rate = Throughput(*(float(cpu[i] if v is None else v) for i, v in enumerate(values)))
    return rate if rate.enabled else None


def check_cost(
    program: CompiledProgram, items: int, first_order: bool, context: WorkerContext, what: str
) -> None:
    """Refuse, before anything runs, a run whose estimated time exceeds the request's
    time limit: a 422 naming the estimate, the limit and the job form that can take it."""
    rate, limit = context.throughput, context.time_limit
    if rate is None or limit is None:
        return
    estimate = program.cost.estimate(items, first_order, rate)
    if estimate.seconds <= limit:
        return
    most = context.job_time_limit
    if most is not None and estimate.seconds <= most:
        way = (
            f'run it as a job ("async": true, or the header Prefer: respond-async), which '
            f"may compute for up to {most:g} s (this server's job_time_limit)"
        )
    else:
        way = (
            f"it would not finish within this server's job_time_limit ({most:g} s) either"
            if most is not None
            else "raise time_limit"
        )
    raise RequestError(
        "too-large",
        f"{what} is estimated at {estimate.describe()}; the request's time_limit is "
        f"{limit:g} s. Ask for fewer items, or {way}. (The estimate uses this worker's "
        "measured throughputs: settings cost_flops_per_second, "
        "cost_transcendentals_per_second, cost_bytes_per_second.)",
        estimate=estimate.as_dict(),
        time_limit=limit,
    )


def start(index: int, device: str, options: Mapping[str, Any]) -> WorkerContext:
    """Set up a worker: check its device, build its limits, tune the allocator (unless
    told not to), warm the engine up."""
    # The pool always passes the setting (default on); a worker started bare (a test, in its
    # own process) leaves that process's allocator as it found it.
    if options.get("tune_allocator", False):
        gt.tune_allocator()
    if options.get("empty_working_directory", False):  # the pool's workers: always
        leave_the_working_directory()
    xp = backend.xp_for_device(device)  # DeviceError when the device is missing
    kind, number = backend.parse_device(device)
    if kind == "cuda":
        xp.cuda.Device(number).use()
    try:
        limits = Limits(**options.get("definition_limits", {}))
    except TypeError as exc:
        known = ", ".join(Limits().as_dict())
        raise ValueError(f"bad definition_limits ({exc}); known limits: {known}") from None
    context = WorkerContext(
        index=index,
        device=device,
        limits=limits,
        chunk_size=int(options.get("chunk_size", defaults.CHUNK_SIZE)),
        hessian_max_size=int(options.get("hessian_max_size", defaults.HESSIAN_MAX_SIZE)),
        jacobian_max_elements=int(
            options.get("jacobian_max_elements", defaults.JACOBIAN_MAX_ELEMENTS)
        ),
        hvp_max_vectors=int(options.get("hvp_max_vectors", defaults.HVP_MAX_VECTORS)),
        lanczos_max_basis_bytes=int(
            options.get("lanczos_max_basis_bytes", defaults.LANCZOS_MAX_BASIS_BYTES)
        ),
        memory_budget=options.get("memory_budget"),
        throughput=_throughput(options.get("cost_throughput"), kind),
        job_time_limit=options.get("job_time_limit"),
        datasets=DatasetCache(
            options.get("store_path"),
            int(options.get("dataset_memory_budget", defaults.WORKER_DATASET_MEMORY)),
        ),
    )
    warm = {"program": ["y = x * x"], "variables": {"x": {"value": np.float32(1.0)}}}
    evaluate(warm, "y", limits=limits, device=device)  # first-call imports and caches
    if options.get("warm_kernels", False):  # the pool's workers: the setting (default on)
        # In the background: the hello (readiness) waits for none of it, and requests run
        # the NumPy paths of the kernels not yet ready (engine/kernels/warmup.py).
        warmup.start_in_background()
    return context


class NonFiniteAnswer(RequestError):
    """An answer holding NaN or infinity, refused (the request did not allow them)."""


def refuse_nonfinite(detail: str, problem: Problem) -> NonFiniteAnswer:
    return NonFiniteAnswer("non-finite", detail, problems=[problem.to_dict()])


def bind_datasets(payload: Any, context: WorkerContext) -> Any:
    """The payload with the inputs bound to datasets (of its definition, of the
    definition a tape is rebuilt from, and of an influence request's test points)
    replaced by their arrays, rows taken."""
    if not isinstance(payload, Mapping):
        return payload
    out = dict(payload)
    try:
        if isinstance(out.get("definition"), Mapping):
            out["definition"] = resolve(out["definition"], context.datasets)
        rebuild = out.get("rebuild")
        if isinstance(rebuild, Mapping) and isinstance(rebuild.get("definition"), Mapping):
            out["rebuild"] = {
                **rebuild,
                "definition": resolve(rebuild["definition"], context.datasets),
            }
        if isinstance(out.get("test_inputs"), Mapping):
            out["test_inputs"] = resolve(
                {"inputs": out["test_inputs"]}, context.datasets, "test_inputs"
            )["inputs"]
    except (ValueError, DatasetUnavailable) as exc:
        raise RequestError("request", str(exc)) from None
    return out


def apply_point(payload: Any, context: WorkerContext) -> Any:
    """The payload with its flat `point` split over the request's sources (in their
    resolved order, as flat answers list them) into their values in the definition, cast
    to each source's dtype. The values set are listed under `applied` ({variables,
    inputs}: a recorded tape's stored definition takes them, so a rebuild records the
    same point). A variable the definition does not list is an initializer of one of
    its imported models, which the value replaces."""
    if (
        not isinstance(payload, Mapping)
        or payload.get("point") is None
        or "definition" not in payload
    ):
        return payload
    program = compile_definition(as_definition(payload["definition"]), context.limits)
    request = program.check_request(
        payload["target"], payload.get("sources"), "zero", allow_unused=True
    )
    keys = list(request.sources)
    leaves = [program.leaf_info[request.sources[k]] for k in keys]
    try:
        values = flat.split(payload["point"], keys, [leaf.type.shape for leaf in leaves], "point")
    except flat.FlatError as exc:
        raise RequestError("request", str(exc), field="point") from None
    applied: dict[str, dict[str, Any]] = {"variables": {}, "inputs": {}}
    for key, leaf in zip(keys, leaves, strict=True):
        applied[f"{leaf.role}s"][leaf.name] = values[key].astype(leaf.type.dtype)
    definition = dict(payload["definition"])
    variables = dict(definition["variables"])
    for name, value in applied["variables"].items():
        variables[name] = {**variables.get(name, {"trainable": True}), "value": value}
    definition.update(variables=variables, inputs={**definition["inputs"], **applied["inputs"]})
    return {**payload, "definition": definition, "applied": applied}


def describe_error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, RequestError):
        return {"type": exc.type, "message": str(exc), **exc.extra}
    if isinstance(exc, OverBudget):
        return {"type": "too-large", "message": str(exc.problems[0]), "problems": exc.to_list()}
    if isinstance(exc, gt.Interrupted):
        return {"type": "cancelled", "message": str(exc)}
    if isinstance(exc, DefinitionError):
        kind = "execution" if isinstance(exc, ExecutionError) else "definition"
        problems = exc.to_list()
        first = str(exc.problems[0])
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return {"type": kind, "message": first + more, "problems": problems}
    if isinstance(exc, CurvatureError):
        return {"type": "request", "message": str(exc), "field": "curvature"}
    if isinstance(exc, gt.BatchDependenceError):
        return {"type": "batch-dependence", "message": str(exc)}
    if isinstance(exc, gt.MissingRuleError):
        return {"type": "unsupported", "message": str(exc)}
    if isinstance(exc, MemoryError):
        return {"type": "out-of-memory", "message": "the worker ran out of memory"}
    if isinstance(exc, gt.DeviceError):
        return {"type": "device", "message": str(exc)}
    if isinstance(exc, RUNTIME_ERRORS):
        return {"type": "execution", "message": f"{type(exc).__name__}: {exc}"}
    return internal_error(exc)


def internal_error(exc: BaseException) -> dict[str, Any]:
    log.error("internal error in a worker:\n%s", "".join(traceback.format_exception(exc)))
    return {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}


# ----------------------------------------------------------------------------------------
# Shared steps
# ----------------------------------------------------------------------------------------


@dataclass
class Prepared:
    definition: Definition
    program: CompiledProgram
    request: Request
    leaves: dict[str, Tensor]

    def source_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.leaves[self.request.sources[key]].shape)


def prepare(
    payload: Mapping[str, Any], context: WorkerContext, unconnected: str = "none"
) -> Prepared:
    definition = as_definition(payload["definition"])
    program = compile_definition(definition, context.limits)
    request = program.check_request(
        payload["target"],
        payload.get("sources"),
        unconnected,
        allow_unused=bool(payload.get("allow_unused")),
    )
    return Prepared(definition, program, request, program.leaves(definition, context.device))


def execution(observed: replay.Observed) -> dict[str, Any]:
    """The answer's `execution`: how the passes run inside `observed` ran, as the engine
    reported them while running them (compiled, or dynamic and why)."""
    how = observed.summary()
    return Execution(compiled=how.compiled, reason=how.reason).message()


def _host(tensor: Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.numpy()


def _target_shape(prepared: Prepared) -> tuple[int, ...]:
    return tuple(prepared.program.types[prepared.request.target].shape)


def _scalar_target(prepared: Prepared, endpoint: str) -> None:
    shape = _target_shape(prepared)
    if math.prod(shape) != 1:
        raise RequestError(
            "request",
            f"{endpoint} needs a scalar target; {prepared.request.target!r} has shape "
            f"{list(shape)} (reduce it, e.g. with sum() or mean(), or use /v1/jacobian)",
        )


def on_device(array: Any, like: Tensor, context: WorkerContext) -> Tensor:
    return gt.constant(np.asarray(array), dtype=like.dtype, device=context.device)


# ----------------------------------------------------------------------------------------
# Handlers
# ----------------------------------------------------------------------------------------


def ping(payload: Any, context: WorkerContext) -> dict[str, Any]:
    """The worker's pid and where its compiled kernels' warm-up stands."""
    return {"pid": os.getpid(), "kernels": warmup.status()}


def kernel_warmup(payload: Any, context: WorkerContext) -> dict[str, Any]:
    """The kernels' warm-up status, once it has ended when the payload asks
    {"wait": seconds}: the tests and bench/bench_kernel_warmup.py wait on warm-up's end
    through it instead of polling ping (no HTTP route sends it)."""
    seconds = payload.get("wait") if isinstance(payload, Mapping) else None
    return warmup.wait(float(seconds)) if seconds is not None else warmup.status()


def ops(payload: Any, context: WorkerContext) -> list[dict[str, Any]]:
    return catalogue()


def gradient(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    # Coerced and compiled once: the checks below and the run share them.
    definition = as_definition(payload["definition"])
    program = compile_definition(definition, context.limits)
    program.batch_within(context.memory_budget, "its forward and backward pass", first_order=True)
    check_cost(program, 1, True, context, "the gradient")
    with replay.observe() as observed:  # compiled: see evaluate
        result = evaluate_compiled(
            program,
            definition,
            payload["target"],
            payload.get("sources"),
            unconnected=payload.get("unconnected", "none"),
            device=context.device,
            allow_unused=bool(payload.get("allow_unused")),
        )
    return {
        "value": result.value,
        "gradients": result.gradients,
        "execution": execution(observed),
    }


def jacobian(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    unconnected = payload.get("unconnected", "none")
    prepared = prepare(payload, context, unconnected)
    watched = {key: prepared.leaves[name] for key, name in prepared.request.sources.items()}
    batch = bool(payload.get("batch"))
    check_jacobian_size(
        prepared.request.target,
        _target_shape(prepared),
        {key: tuple(t.shape) for key, t in watched.items()},
        batch,
        context,
    )
    rows = prepared.program.batch_within(
        context.memory_budget, "a jacobian pass of one row", first_order=True
    )
    target_shape = _target_shape(prepared)
    row_count = math.prod(target_shape[1:] if batch else target_shape)
    check_cost(prepared.program, row_count, True, context, f"the jacobian of {row_count:,} rows")
    # compiled: a definition's later requests of the same layout replay the captured pass
    chunk_size = min(context.chunk_size, rows or context.chunk_size)
    with replay.observe() as observed:
        y, jacobians = prepared.program.jacobians(
            prepared.request, prepared.leaves, batch, chunk_size
        )
    return {
        "value": y.numpy(),
        "jacobians": {k: _host(j) for k, j in jacobians.items()},
        "execution": execution(observed),
    }


def check_jacobian_size(
    target: str,
    target_shape: tuple[int, ...],
    source_shapes: Mapping[str, tuple[int, ...]],
    batch: bool,
    context: WorkerContext,
) -> None:
    """Refuse a jacobian request whose answer would exceed jacobian_max_elements, or a
    batch jacobian whose target and sources do not share their first axis."""
    if batch:
        for key, shape in source_shapes.items():
            if not target_shape or not shape or target_shape[0] != shape[0]:
                raise RequestError(
                    "request",
                    f"batch: true needs the target and each source to share their first "
                    f"(batch) axis; target {target!r} has shape {list(target_shape)} and "
                    f"source {key!r} has shape {list(shape)}",
                    field="batch",
                )
    sizes = {
        key: math.prod(target_shape) * math.prod(shape[1:] if batch else shape)
        for key, shape in source_shapes.items()
    }
    total = sum(sizes.values())
    if total > context.jacobian_max_elements:
        raise RequestError(
            "too-large",
            f"the jacobian(s) would hold {total:,} elements "
            f"({', '.join(f'{k}: {n:,}' for k, n in sizes.items())}); this server answers "
            f"up to {context.jacobian_max_elements:,}. Ask for fewer sources, a smaller "
            "target, batch: true when examples are independent, or use /v1/hvp or "
            "vector-Jacobian products via /v1/gradient",
            limit=context.jacobian_max_elements,
        )


def jacobians_on(
    tape: gt.GradientTape,
    y: Tensor,
    watched: Mapping[str, Tensor],
    batch: bool,
    unconnected: str,
    context: WorkerContext,
    most_rows: int | None = None,
) -> dict[str, np.ndarray | None]:
    """The jacobians of y over the watched sources, from a persistent tape, on the host,
    at most `most_rows` rows (the memory budget's) per backward pass."""
    chunk_size = min(context.chunk_size, most_rows or context.chunk_size)
    if batch:
        jacobians = {key: per_example_jacobian(tape, y, source) for key, source in watched.items()}
    else:
        jacobians = tape.jacobian(
            y, dict(watched), unconnected_gradients=unconnected, chunk_size=chunk_size
        )
    return {k: _host(j) for k, j in jacobians.items()}


def hessian(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    prepared = prepare(payload, context, "zero")
    _scalar_target(prepared, "/v1/hessian")
    keys = list(prepared.request.sources)
    shapes = [prepared.source_shape(k) for k in keys]
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    if n > context.hessian_max_size:
        raise RequestError(
            "too-large",
            f"the Hessian over {', '.join(keys)} is {n:,} x {n:,} ({n * n:,} entries); this "
            f"server builds Hessians over at most {context.hessian_max_size:,} parameters. "
            "Use POST /v1/hvp for Hessian-vector products (one or many vectors in one "
            "pass), or choose fewer sources",
            limit=context.hessian_max_size,
            size=n,
        )
    check_cost(prepared.program, n, False, context, f"the {n:,} x {n:,} Hessian")
    operator = prepared.program.hessian_operator(
        prepared.request, prepared.leaves, context.memory_budget
    )
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        context.progress(
            final=done == total,
            done=done,
            total=total,
            unit="rows",
            seconds=time.perf_counter() - t0,
        )

    h = operator.dense(context.chunk_size, progress)
    grads = operator.grad  # the sources' shapes and dtypes, in the order of `keys`
    offsets = np.cumsum([0, *sizes])
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for i, (ka, sa, pa) in enumerate(zip(keys, shapes, grads, strict=True)):
        blocks[ka] = {}
        for j, (kb, sb) in enumerate(zip(keys, shapes, strict=True)):
            block = h[offsets[i] : offsets[i + 1], offsets[j] : offsets[j + 1]]
            blocks[ka][kb] = block.reshape(sa + sb).astype(pa.dtype)
    result: dict[str, Any] = {
        "value": operator.value.numpy(),
        "gradients": dict(zip(keys, [g.numpy() for g in grads], strict=True)),
        "hessian": blocks,
        "newton_step": None,
    }
    newton = payload.get("newton")
    if newton is not None:
        try:
            step = operator.newton_step(float(newton.get("damping", 1e-3)), dense=h)
        except SingularHessianError as exc:
            raise RequestError("request", f"{exc}; raise newton.damping") from None
        result["newton_step"] = dict(zip(keys, step, strict=True))
    return result


def hvp(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    prepared = prepare(payload, context, "zero")
    _scalar_target(prepared, "/v1/hvp")
    keys = list(prepared.request.sources)
    primals = [prepared.leaves[prepared.request.sources[k]] for k in keys]
    single, vectors = given_vectors(payload, keys, primals)
    for i, vector in enumerate(vectors):
        where = "vector" if single else f"vectors.{i}"
        check_vector(vector, keys, primals, where)
    count = len(vectors)
    check_cost(prepared.program, count, False, context, f"the HVP of {count:,} vector(s)")
    stacked = [
        # (one vector: a view with the batch axis, not np.stack's copy)
        on_device(
            np.asarray(vectors[0][k])[None]
            if single
            else np.stack([np.asarray(v[k]) for v in vectors]),
            p,
            context,
        )
        for k, p in zip(keys, primals, strict=True)
    ]
    # Forward, gradient and batched second-order passes (as many vectors as fit each);
    # compiled: a definition's later requests of the same layout replay the captured pass.
    with replay.observe() as observed:
        value, grads, products = prepared.program.hessian_vector_products(
            prepared.request, prepared.leaves, stacked, context.memory_budget
        )
    # [i, ...] keeps a 0-d parameter's product a 0-d array ([i] would give a NumPy scalar,
    # which crosses to the HTTP process as a bare number instead of a tensor).
    answers = [
        {k: products[j].numpy()[i, ...] for j, k in enumerate(keys)} for i in range(len(vectors))
    ]
    return {
        "value": value.numpy(),
        "gradients": dict(zip(keys, [g.numpy() for g in grads], strict=True)),
        "hvp": answers[0] if single else None,
        "hvps": None if single else answers,
        "execution": execution(observed),
    }


def given_vectors(
    payload: Mapping[str, Any], keys: list[str], primals: list[Tensor]
) -> tuple[bool, list[Mapping[str, Any]]]:
    """(one vector?, the vectors keyed by source), a flat_vector split by the sources."""
    if payload.get("flat_vector") is not None:
        try:
            vector = flat.split(
                payload["flat_vector"], keys, [tuple(p.shape) for p in primals], "flat_vector"
            )
        except flat.FlatError as exc:
            raise RequestError("request", str(exc)) from None
        return True, [vector]
    if payload.get("vector") is not None:
        return True, [payload["vector"]]
    return False, payload["vectors"]


def check_vector(
    vector: Mapping[str, Any], keys: list[str], primals: list[Tensor], where: str
) -> None:
    missing = [k for k in keys if k not in vector]
    extra = [k for k in vector if k not in keys]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unknown {', '.join(map(repr, extra))}")
        raise RequestError(
            "request",
            f"{where} must give one tensor per source ({', '.join(map(repr, keys))}): "
            + "; ".join(parts),
            field=where,
        )
    for key, primal in zip(keys, primals, strict=True):
        shape = tuple(np.shape(vector[key]))
        if shape != tuple(primal.shape):
            raise RequestError(
                "request",
                f"{where}.{key} has shape {list(shape)}; source {key!r} has shape "
                f"{list(primal.shape)}",
                field=f"{where}.{key}",
            )


HANDLERS: dict[str, Callable[[Any, WorkerContext], Any]] = {
    "ping": ping,
    "kernel_warmup": kernel_warmup,
    "ops": ops,
    "gradient": gradient,
    "jacobian": jacobian,
    "hessian": hessian,
    "hvp": hvp,
}
