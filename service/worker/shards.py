"""A sharded tape's coordinator, inside a worker (issue 16): the batch is split over
ordinary tapes in several workers (service/domain/shards.py records them and routes
every request); what the parts answer is combined here, because the HTTP process does
no math.

- `shard_combine`: the parts' answers to one request (the loss value, gradients, HVPs)
  summed with the shards' weights (n_i / N for a mean loss, 1 for a sum).
- `shard_run`, `shard_step`, `shard_drop`: an algorithm of service/worker/tapes.py
  (Lanczos, trace, diagonal, spectral density, CG) on a flat operator whose matvec is
  "ask the shards and sum". The algorithm runs in a thread of this worker; when it needs
  a product, `shard_run` (or `shard_step`) answers `{"run": id, "need": vectors}`
  instead of an answer, and the HTTP side asks the shards for their products and sends
  them back with `shard_step`, which sums them and hands the sum to the waiting thread.
  Between steps this worker is free (it may hold a shard and serve its part), so no
  worker ever waits for another. A run is dropped on its answer, on an error, on
  `shard_drop`, and when no step came for RUN_IDLE_SECONDS.
- Jacobians and gradients of other targets (`tape_shard_plan` on the first part,
  `shard_jacobian`, `shard_gradient`) and influence
  (`tape_influence_test`, `tape_influence_scores` on the parts, `shard_influence`): the
  parts' pieces put together as the unsharded tape answers (see their sections).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from engine.curvature import Curvature, CurvatureError, top_by_sign
from engine.language import DefinitionError, compile_definition
from service.core import shm
from service.core.operations import BY_KIND, Sharded, curvature_choice, decode_options
from service.core.wire import array_bytes
from service.worker import tapes
from service.worker.compute import (
    RequestError,
    WorkerContext,
    check_jacobian_size,
    on_device,
)

RUN_IDLE_SECONDS = 600.0  # a run whose caller went away is let go after this
# The error type of a run or kept part this worker no longer holds (it was replaced
# between two steps): the HTTP side starts the request's steps again.
LOST = "shard-state-lost"
# Answers kept for a sum that is coming (see stash), shared by every request on this
# worker: an entry is never evicted while its request may still sum it (that was a
# shard-state-lost under load); past this many bytes a part's answer is sent back
# instead (it travels, nothing is lost), and an entry whose sum never came (its caller
# went away) is let go after RUN_IDLE_SECONDS.
STASH_MOST_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------------
# Sums
# ----------------------------------------------------------------------------------------

SUMMED = ("value", "gradients", "hvp", "hvps", "flat")
FLAT_SUMMED = ("gradient", "hvp", "hvps")


def weighted_sum(parts: Sequence[Any], weights: Sequence[float], where: str) -> Any:
    """sum_i weights[i] * parts[i] over matching trees of arrays (dicts, lists, None),
    in float64, cast back to the parts' dtype."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, Mapping):
        return {k: weighted_sum([p[k] for p in parts], weights, f"{where}.{k}") for k in first}
    if isinstance(first, list | tuple):
        return [
            weighted_sum([p[i] for p in parts], weights, f"{where}.{i}") for i in range(len(first))
        ]
    arrays = [np.asarray(p) for p in parts]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise RequestError(
            "request",
            f"{where}: the shards answered shapes "
            f"{sorted(list(s) for s in shapes)}, which do not add up: on a sharded tape ask "
            "for derivatives of the loss over the variables (not the sharded inputs)",
        )
    total = np.zeros(arrays[0].shape, np.float64)
    for a, w in zip(arrays, weights, strict=True):
        total += w * a.astype(np.float64)
    return total.astype(arrays[0].dtype) if arrays[0].dtype.kind == "f" else total


def combine(parts: Sequence[Mapping[str, Any]], weights: Sequence[float]) -> dict[str, Any]:
    """The parts' answers to one request as the unsharded tape would answer it."""
    out = dict(parts[0])
    for key in SUMMED:
        if key not in out:
            continue
        if key == "flat" and out["flat"] is not None:
            flat = dict(out["flat"])
            for k in FLAT_SUMMED:
                if flat.get(k) is not None:
                    flat[k] = weighted_sum([p["flat"][k] for p in parts], weights, f"flat.{k}")
            out["flat"] = flat
        else:
            out[key] = weighted_sum([p[key] for p in parts], weights, key)
    out.pop("nonfinite", None)  # flagged again, on the sum, by the worker's front door
    out.pop("execution", None)  # one part's: the parts ran on several workers
    return out


@dataclasses.dataclass
class Kept:
    result: dict[str, Any]
    bytes: int
    at: float  # time.monotonic() when kept


def _stash(context: WorkerContext) -> dict[str, Kept]:
    kept: dict[str, Kept] = context.state.setdefault("shard_stash", {})
    return kept


def stash(context: WorkerContext, key: str, result: dict[str, Any]) -> dict[str, Any]:
    """Keep a part's answer in this worker, the coordinator, for the sum that comes next
    (shard_combine or shard_step name it by `key`, unique to the request), so that its
    bytes do not travel to the HTTP process and back; answer the bookkeeping only. Past
    STASH_MOST_BYTES the answer itself goes back (the sum takes either)."""
    kept = _stash(context)
    now = time.monotonic()
    for old in [k for k, entry in kept.items() if now - entry.at > RUN_IDLE_SECONDS]:
        del kept[old]  # its request went away without dropping it
    size = array_bytes(result)
    if sum(entry.bytes for entry in kept.values()) + size > STASH_MOST_BYTES:
        return result
    meta = result.pop("tape", None)
    kept[key] = Kept(result, size, now)
    return {"stashed": key, "tape": meta}


def receive(context: WorkerContext, kept: Mapping[str, Any]) -> list[str]:
    """Stash the kept answers the pool hands with a request (other shards' answers,
    computed in other workers: service/pool/base.py's `gather`), for its sum to find
    under their keys as it finds this worker's own; their keys, for `forget` once the
    request has answered. Never refused for size: they are summed now."""
    stash_ = _stash(context)
    now = time.monotonic()
    for key, result in kept.items():
        stash_[key] = Kept(result, 0, now)  # 0: out of STASH_MOST_BYTES' account
    return list(kept)


def forget(context: WorkerContext, keys: Sequence[str]) -> None:
    """Let go of what `receive` stashed for a request that has answered (unused on an
    error: it would otherwise hold the request's memory, or its arena, until it expires)."""
    stash_ = _stash(context)
    for key in keys:
        stash_.pop(key, None)


def _part(context: WorkerContext, part: Any, path: Sequence[str] = ()) -> Any:
    """A part's answer as sent, or the one kept here under {"stashed": key}."""
    if not (isinstance(part, Mapping) and "stashed" in part):
        return part
    entry = _stash(context).pop(part["stashed"], None)
    if entry is None:
        raise RequestError(
            LOST,
            f"worker {context.index} no longer keeps the shard's answer "
            "to sum (it was restarted meanwhile); ask again",
        )
    found: Any = entry.result
    for key in path:
        found = found[key]
    return found


def shard_combine(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    return combine([_part(context, p) for p in payload["parts"]], payload["weights"])


# ----------------------------------------------------------------------------------------
# Algorithms across shards
# ----------------------------------------------------------------------------------------


class RunDropped(Exception):
    """The run's caller dropped it (or went away): the algorithm thread stops."""


class ShardedFlat:
    """The sharded tape's operator as an n x n matrix on flat float64 vectors, as the
    algorithms take it (engine FlatOperator's interface): matvec hands V to the caller
    and waits for the shards' summed product."""

    def __init__(self, layout: Sequence[Sequence[Any]], run: Run):
        self.keys = [str(k) for k, _, _ in layout]
        self.shapes = [tuple(int(d) for d in shape) for _, shape, _ in layout]
        self.dtypes = [np.dtype(dtype) for _, _, dtype in layout]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes])
        self.n = int(self.offsets[-1])
        self.max_batch: int | None = None  # each shard splits its own passes
        self.run = run

    def matvec(self, vectors: np.ndarray) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.n:
            raise ValueError(f"matvec: expected shape (K, {self.n}), got {vectors.shape}")
        return self.run.ask(vectors)

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        arrays = [np.asarray(t, np.float64).reshape(-1) for t in tensors]
        return np.concatenate(arrays) if arrays else np.zeros(0)

    def unflatten(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.asarray(x)
        return [
            x[lo : lo + size].reshape(shape).astype(dtype)
            for shape, dtype, lo, size in zip(
                self.shapes, self.dtypes, self.offsets[:-1], self.sizes, strict=True
            )
        ]

    def keyed(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(self.keys, self.unflatten(x), strict=True))


class Run:
    """One algorithm in its thread, and the two queues between it and the handlers."""

    def __init__(
        self, run_id: str, layout: Sequence[Sequence[Any]], runs: dict[str, Run] | None = None
    ):
        self.id = run_id
        self.runs = runs  # the worker's runs (this one leaves them when it is let go)
        self.flat = ShardedFlat(layout, self)
        self.products: queue.Queue[Any] = queue.Queue()  # to the algorithm
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()  # from it
        self.asked: np.ndarray | None = None
        self.progress: dict[str, Any] | None = None  # the algorithm's latest report

    def start(self, work: Callable[[ShardedFlat], dict[str, Any]]) -> None:
        threading.Thread(
            target=self._main, args=(work,), daemon=True, name=f"shard-run-{self.id[:8]}"
        ).start()

    def note(self, report: dict[str, Any]) -> None:
        """The algorithm's progress (handed to the caller with the next need)."""
        self.progress = report

    def _main(self, work: Callable[[ShardedFlat], dict[str, Any]]) -> None:
        try:
            self.events.put(("answer", work(self.flat)))
        except RunDropped as exc:
            # Nobody reads its events any more (dropped, or no step came for
            # RUN_IDLE_SECONDS): it leaves the worker's runs (unless started again).
            if self.runs is not None and self.runs.get(self.id) is self:
                self.runs.pop(self.id, None)
            self.events.put(("error", exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the handler, which raises it
            self.events.put(("error", exc))

    def ask(self, vectors: np.ndarray) -> np.ndarray:
        """In the algorithm's thread: the product of the shards' operator with V."""
        self.asked = vectors
        self.events.put(("need", vectors))
        try:
            product = self.products.get(timeout=RUN_IDLE_SECONDS)
        except queue.Empty:
            raise RunDropped("no shard products came") from None
        if product is None:
            raise RunDropped("the run was dropped")
        return np.asarray(product)

    def next_event(self) -> tuple[str, Any]:
        return self.events.get()


def _runs(context: WorkerContext) -> dict[str, Run]:
    runs: dict[str, Run] = context.state.setdefault("shard_runs", {})
    return runs


def _work(
    kind: str, payload: Mapping[str, Any], context: WorkerContext, run: Run
) -> Callable[[ShardedFlat], dict[str, Any]]:
    """The table operation `kind` (one run as an algorithm over the parts) on a
    ShardedFlat: the same function the unsharded tape runs (tapes.OPERATION_FUNCTIONS)."""
    op = BY_KIND.get(kind)
    if op is None or op.sharded is not Sharded.algorithm:
        raise RequestError("internal", f"no sharded algorithm {kind!r}")
    # A run outlives the request in flight: its progress goes out with its next need.
    quiet = dataclasses.replace(context, report=run.note)
    asked = tapes.Asked(decode_options(op, payload["options"]), payload, quiet, tapes.now())
    function = tapes.OPERATION_FUNCTIONS[kind]
    return lambda flat: function(flat, flat.keys, asked)


def _advance(run: Run, context: WorkerContext) -> dict[str, Any]:
    """Wait for the run's next event: a need (answered to the caller) or its end."""
    event, value = run.next_event()
    if event == "need":  # as the shards' tape_hvp takes it: one tensor per source
        progress, run.progress = run.progress, None
        return {"run": run.id, "need": [run.flat.keyed(v) for v in value], "progress": progress}
    _runs(context).pop(run.id, None)
    if event == "error":
        raise value
    return {"run": None, "answer": value}


def shard_run(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """Start an algorithm over the shards: answers its first need (or its answer)."""
    runs = _runs(context)
    old = runs.pop(payload["run"], None)
    if old is not None:  # the same run started again (its first try's caller went away)
        old.products.put(None)
    run = Run(payload["run"], payload["layout"], runs)
    # The run outlives this request: its arrays out of the request's shared memory.
    work = _work(payload["kind"], shm.detached(payload["payload"]), context, run)
    runs[run.id] = run
    run.start(work)
    return _advance(run, context)


def shard_step(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The shards' products for the run's last need: summed, handed to the algorithm;
    answers its next need or its answer."""
    run = _runs(context).get(payload["run"])
    if run is None:
        raise RequestError(
            LOST,
            f"worker {context.index} holds no sharded run "
            f"{payload['run']} (it was restarted meanwhile); ask again",
        )
    parts = [_part(context, p, ("flat", "hvps")) for p in payload["parts"]]
    product = weighted_sum(parts, payload["weights"], "products")
    assert run.asked is not None
    if np.shape(product) != run.asked.shape:
        raise RequestError(
            "internal",
            f"the shards' products have shape "
            f"{list(np.shape(product))}, not {list(run.asked.shape)}",
        )
    run.products.put(np.asarray(product, np.float64))
    return _advance(run, context)


def shard_drop(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """Let a run (`run`) or kept answers (`stash`: keys) go."""
    run = _runs(context).pop(payload.get("run") or "", None)
    if run is not None:
        run.products.put(None)
    kept = _stash(context)
    for key in payload.get("stash") or ():
        kept.pop(key, None)
    return {"dropped": run is not None}


# ----------------------------------------------------------------------------------------
# Jacobians, and gradients of other targets, across shards
# ----------------------------------------------------------------------------------------
# The parts answer tape_jacobian (tape_gradient) as any tape does; the unsharded answer is
# assembled from theirs according to what the target is (tape_shard_plan decides, on the
# first part, from the program; shard_jacobian and shard_gradient assemble, in the
# coordinator):
#   "sum":  the tape's target (its loss): weighted as its gradient is; over a split
#           input, each part's rows, weighted, in part order;
#   "same": a name that reads no split input (a weight penalty, a variable): every part
#           answers the unsharded one (over a split input: zeros, N rows of them);
#   "rows": a name whose first axis is the split batch axis (per-example outputs): the
#           parts' rows in part order; its gradient (of the sum of its elements) is the
#           parts' added. Over a split input the full jacobian is block diagonal (an
#           example depends on its own rows only, as the sharded loss already takes),
#           per example (batch) the parts' blocks follow each other, and the gradient is
#           each part's rows in order.
# Any other name mixes the examples (a sum or mean over the batch that is not the tape's
# loss): its parts' derivatives do not make its own, and it is refused with what to ask
# instead.


def _along_batch(
    session: tapes.TapeSession, target: str, split: set[str], rows: int, context: WorkerContext
) -> bool:
    """Whether the target's first axis is the batch the shards split: it has the part's
    rows there, and one more when the split inputs have one more (the program's shapes
    inferred again from the part's skeleton: no data, nothing run)."""
    shape = tuple(session.env[target].shape)
    if session.skeleton is None or not shape or shape[0] != rows:
        return False
    skeleton = session.skeleton
    grown = {
        name: np.broadcast_to(np.zeros((), a.dtype), (a.shape[0] + 1, *a.shape[1:]))
        if name in split
        else a
        for name, a in skeleton.inputs.items()
    }
    try:
        program = compile_definition(dataclasses.replace(skeleton, inputs=grown), context.limits)
    except DefinitionError:  # the program fixes the batch size somewhere: cannot tell
        return False
    return tuple(program.types[target].shape) == (rows + 1, *shape[1:])


def _mode(
    session: tapes.TapeSession, target: str, split: set[str], rows: int, context: WorkerContext
) -> str:
    """How the parts' derivatives of `target` make the unsharded ones (see above)."""
    if target == session.request.target:
        return "sum"
    if not session.program.leaves_read(target) & split:
        return "same"
    if _along_batch(session, target, split, rows, context):
        return "rows"
    shape = list(session.env[target].shape)
    raise RequestError(
        "request",
        f"target: {target!r} reads the split inputs "
        f"({', '.join(map(repr, sorted(split)))}) but is neither the tape's target "
        f"{session.request.target!r} nor along the batch axis (on the first shard it has "
        f"shape {shape}, for {rows} rows of the batch): it mixes the examples (a sum or "
        "mean over the batch), so its derivatives are not made of the shards'. Ask for "
        "the tape's target, or for a per-example name (the batch along its first axis) "
        "and reduce its derivatives, or record an unsharded tape",
        field="target",
    )


def tape_shard_plan(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """On the first part: how the parts' jacobians (`of`: "jacobian") or gradients
    ("gradient") of the request's target make the unsharded ones ("mode", see above;
    "split_keys": the sources that are split inputs); a jacobian checked against the
    jacobian size limit at the unsharded shapes."""
    session, rebuilt = tapes.session_for(payload, context)
    request = tapes.other_request(session, payload)
    target, split = request.target, set(payload["split"])
    rows, total = int(payload["rows"][0]), sum(int(r) for r in payload["rows"])
    split_keys = [k for k, name in request.sources.items() if name in split]
    mode = _mode(session, target, split, rows, context)
    if payload["of"] == "jacobian":
        batch = bool(payload.get("batch"))
        unsplit = [k for k in request.sources if k not in split_keys]
        if batch and (mode != "rows" or unsplit):
            what = (
                f"source {unsplit[0]!r} is not a split input"
                if mode == "rows"
                else f"target {target!r} is not along the batch axis"
            )
            raise RequestError(
                "request",
                f"batch: per-example jacobians of a sharded tape are taken of a "
                "target along the batch axis over the split inputs "
                f"({', '.join(map(repr, sorted(split)))}); {what}",
                field="batch",
            )
        shape = tuple(session.env[target].shape)
        full_sources = {
            key: (total, *session.leaves[name].shape[1:])
            if name in split
            else tuple(session.leaves[name].shape)
            for key, name in request.sources.items()
        }
        check_jacobian_size(
            target, (total, *shape[1:]) if mode == "rows" else shape, full_sources, batch, context
        )
    return tapes.finish_answer(
        session, rebuilt, {"mode": mode, "split_keys": split_keys}, hvp_only=True
    )


def _scaled(array: np.ndarray, weight: float) -> np.ndarray:
    if weight == 1.0:
        return array
    scaled = weight * array.astype(np.float64)
    return scaled.astype(array.dtype) if array.dtype.kind == "f" else scaled


def _stacked(blocks: Sequence[np.ndarray], weights: Sequence[float], axis: int) -> np.ndarray:
    """The parts' blocks, each times its weight, one after the other along `axis`."""
    return np.concatenate([_scaled(b, w) for b, w in zip(blocks, weights, strict=True)], axis=axis)


def _block_diagonal(blocks: Sequence[np.ndarray], target_ndim: int) -> np.ndarray:
    """Per-part jacobians (n_k, *y[1:], n_k, *x[1:]) of a per-example target over a
    split input as the full (N, *y[1:], N, *x[1:]): each part's on the diagonal, zeros
    elsewhere (an example does not read the others' rows)."""
    first = blocks[0]
    total = sum(b.shape[0] for b in blocks)
    shape = (total, *first.shape[1:target_ndim], total, *first.shape[target_ndim + 1 :])
    full = np.zeros(shape, first.dtype)
    lo = 0
    for block in blocks:
        hi = lo + block.shape[0]
        full[(slice(lo, hi),) + (slice(None),) * (target_ndim - 1) + (slice(lo, hi),)] = block
        lo = hi
    return full


def _value(parts: Sequence[Mapping[str, Any]], mode: str, weights: Sequence[float]) -> np.ndarray:
    values = [np.asarray(p["value"]) for p in parts]
    if mode == "sum":
        return np.asarray(weighted_sum(values, weights, "value"))
    if mode == "same":
        return values[0]
    return np.concatenate(values, axis=0)


def _per_source(
    parts: Sequence[Mapping[str, Any]],
    field: str,
    assemble: Callable[[str, list[np.ndarray]], np.ndarray],
) -> dict[str, np.ndarray | None]:
    """`assemble(key, the parts' arrays)` for every source; None where the parts answer
    None (unconnected: in every part alike, as they run one program)."""
    out: dict[str, np.ndarray | None] = {}
    for key in parts[0][field]:
        found = [p[field][key] for p in parts]
        out[key] = (
            None if any(f is None for f in found) else assemble(key, [np.asarray(f) for f in found])
        )
    return out


def shard_jacobian(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The parts' jacobians assembled as the unsharded tape's (see above)."""
    parts = [_part(context, p) for p in payload["parts"]]
    mode, weights = payload["mode"], payload["weights"]
    split, batch = set(payload["split_keys"]), bool(payload.get("batch"))
    value = _value(parts, mode, weights)
    ones = [1.0] * len(parts)

    def assemble(key: str, blocks: list[np.ndarray]) -> np.ndarray:
        if key in split:
            if mode == "rows" and not batch:
                return _block_diagonal(blocks, value.ndim)
            # The split input's axis follows the target's (is the first per example).
            return _stacked(blocks, weights if mode == "sum" else ones, 0 if batch else value.ndim)
        if mode == "sum":
            return np.asarray(weighted_sum(blocks, weights, f"jacobians.{key}"))
        return blocks[0] if mode == "same" else np.concatenate(blocks, axis=0)

    return {"value": value, "jacobians": _per_source(parts, "jacobians", assemble)}


def shard_gradient(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The parts' gradients of another target than the loss, or over a split input,
    assembled as the unsharded tape's (see above)."""
    parts = [_part(context, p) for p in payload["parts"]]
    mode, weights = payload["mode"], payload["weights"]
    split = set(payload["split_keys"])
    ones = [1.0] * len(parts)
    scale = weights if mode == "sum" else ones

    def assemble(key: str, blocks: list[np.ndarray]) -> np.ndarray:
        if key in split:  # each part's rows of the input
            return _stacked(blocks, scale, 0)
        if mode == "same":
            return blocks[0]
        return np.asarray(weighted_sum(blocks, scale, f"gradients.{key}"))

    return {
        "value": _value(parts, mode, weights),
        "gradients": _per_source(parts, "gradients", assemble),
    }


# ----------------------------------------------------------------------------------------
# Influence across shards
# ----------------------------------------------------------------------------------------
# grad L_test from the parts (test inputs: the first part's loss on them; training rows:
# each part's loss on its own rows, summed as the reduction sums the batch), s_test by the
# sharded CG run above (tape_solve on "ask the parts and sum"), then each part scores its
# own examples against s_test and the coordinator puts the scores in part order.


def _influence_curvature(
    session: tapes.TapeSession, payload: Mapping[str, Any], context: WorkerContext
) -> Curvature:
    """The part's curvature recording, checked as tape_influence checks it, and its
    examples checked to be the part's rows of the split batch."""
    curvature = tapes.session_curvature(session)
    tapes.check_batched_targets(session, "influence")
    # refuses an impossible curvature, with its reason
    tapes.curvature_operator(session, curvature_choice(payload.get("curvature")), context)
    if curvature.examples != int(payload["examples"]):
        assert session.split is not None
        raise RequestError(
            "request",
            f"influence on a sharded tape scores the examples along the first "
            f"axis of the output {session.split.output!r}, which has {curvature.examples} on "
            f"a shard that holds {payload['examples']} rows of the split inputs: the "
            "examples must be the batch the shards split (shard_by)",
            field="shard_by",
        )
    return curvature


def tape_influence_test(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """A part's test loss and its gradient ("value", "gradients" by source key): on the
    test inputs, or on the part's own training `rows` (zeros when it holds none)."""
    session, rebuilt = tapes.session_for(payload, context)
    curvature = _influence_curvature(session, payload, context)
    names = session.request.sources
    try:
        rows = payload.get("rows")
        if rows is not None and not rows:
            result = {
                "value": np.zeros((), session.operator.value.dtype),
                "gradients": {
                    k: np.zeros(p.shape, p.dtype)
                    for k, p in zip(session.keys, session.primals, strict=True)
                },
            }
            return tapes.finish_answer(session, rebuilt, result, hvp_only=True)
        if rows is not None:
            value, grad = curvature.test_gradient(rows=[int(r) for r in rows])
        else:
            data, targets = tapes.test_points_of(
                session, curvature, payload["test_inputs"], context
            )
            value, grad = curvature.test_gradient(data, targets)
    except CurvatureError as exc:
        raise RequestError("request", str(exc), field="curvature") from None
    result = {
        "value": value.numpy(),
        "gradients": {key: grad[name].numpy() for key, name in names.items()},
    }
    return tapes.finish_answer(session, rebuilt, result, hvp_only=True)


def tape_influence_scores(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """A part's examples scored against s_test (-g_i . s_test, one batched JVP), and its
    per-example scale c (its loss = c sum_i l_i over its own rows)."""
    session, rebuilt = tapes.session_for(payload, context)
    curvature = _influence_curvature(session, payload, context)
    s_test = payload["s_test"]
    batched = {
        name: on_device(np.asarray(s_test[key])[None], session.leaves[name], context)
        for key, name in session.request.sources.items()
    }
    try:
        dots = curvature.example_dots(batched)
        scale = curvature.scale()
    except CurvatureError as exc:
        raise RequestError("request", str(exc), field="curvature") from None
    return tapes.finish_answer(
        session, rebuilt, {"scores": -dots[0], "scale": scale}, hvp_only=True
    )


def shard_influence(payload: Mapping[str, Any], context: WorkerContext) -> dict[str, Any]:
    """The parts' scores in part order (the unsharded tape's example indices), and the
    answer tape_influence gives. A part's removal is its weight times its own scale
    (n_k / N times 1 / n_k for a mean: the unsharded 1 / N)."""
    parts = [_part(context, p) for p in payload["parts"]]
    scores = np.concatenate([np.asarray(p["scores"], np.float64) for p in parts])
    removal = np.concatenate(
        [
            -(w * float(p["scale"])) * np.asarray(p["scores"], np.float64)
            for p, w in zip(parts, payload["weights"], strict=True)
        ]
    )
    helpful, harmful = top_by_sign(scores, int(payload["top_k"]))
    solve = payload["solve"]
    return {
        "scores": scores.tolist(),
        "removal": removal.tolist(),
        "helpful": [int(i) for i in helpful],
        "harmful": [int(i) for i in harmful],
        "test_loss": float(payload["test_loss"]),
        "s_test": solve["solution"],
        "curvature": payload["curvature"],
        **{
            k: solve[k]
            for k in ("converged", "stopped", "iterations", "hvps", "residuals", "seconds")
        },
    }


HANDLERS: dict[str, Callable[[Any, WorkerContext], Any]] = {
    "shard_combine": shard_combine,
    "shard_run": shard_run,
    "shard_step": shard_step,
    "shard_drop": shard_drop,
    "tape_shard_plan": tape_shard_plan,
    "shard_jacobian": shard_jacobian,
    "shard_gradient": shard_gradient,
    "tape_influence_test": tape_influence_test,
    "tape_influence_scores": tape_influence_scores,
    "shard_influence": shard_influence,
}
