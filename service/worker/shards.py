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

from service.core import shm
from service.worker import tapes
from service.worker.compute import RequestError, WorkerContext, check_vector

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
        return [weighted_sum([p[i] for p in parts], weights, f"{where}.{i}")
                for i in range(len(first))]
    arrays = [np.asarray(p) for p in parts]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise RequestError(
            "request", f"{where}: the shards answered shapes "
            f"{sorted(list(s) for s in shapes)}, which do not add up: on a sharded tape ask "
            "for derivatives of the loss over the variables (not the sharded inputs)")
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
    return out


@dataclasses.dataclass
class Kept:
    result: dict[str, Any]
    bytes: int
    at: float  # time.monotonic() when kept


def _nbytes(tree: Any) -> int:
    if isinstance(tree, Mapping):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_nbytes(v) for v in tree)
    return int(tree.nbytes) if isinstance(tree, np.ndarray) else 0


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
    size = _nbytes(result)
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
        raise RequestError(LOST, f"worker {context.index} no longer keeps the shard's answer "
                           "to sum (it was restarted meanwhile); ask again")
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
        return [x[lo:lo + size].reshape(shape).astype(dtype)
                for shape, dtype, lo, size in zip(self.shapes, self.dtypes, self.offsets[:-1],
                                                  self.sizes, strict=True)]

    def keyed(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(self.keys, self.unflatten(x), strict=True))


class Run:
    """One algorithm in its thread, and the two queues between it and the handlers."""

    def __init__(self, run_id: str, layout: Sequence[Sequence[Any]],
                 runs: dict[str, Run] | None = None):
        self.id = run_id
        self.runs = runs  # the worker's runs (this one leaves them when it is let go)
        self.flat = ShardedFlat(layout, self)
        self.products: queue.Queue[Any] = queue.Queue()  # to the algorithm
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()  # from it
        self.asked: np.ndarray | None = None
        self.progress: dict[str, Any] | None = None  # the algorithm's latest report

    def start(self, work: Callable[[ShardedFlat], dict[str, Any]]) -> None:
        threading.Thread(target=self._main, args=(work,), daemon=True,
                         name=f"shard-run-{self.id[:8]}").start()

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


def _work(kind: str, payload: Mapping[str, Any], context: WorkerContext, run: Run
          ) -> Callable[[ShardedFlat], dict[str, Any]]:
    """The algorithm `kind` (a tape handler's name) on a ShardedFlat."""
    started = time.perf_counter()
    # A run outlives the request in flight: its progress goes out with its next need.
    quiet = dataclasses.replace(context, report=run.note)

    def eigenvalues(flat: ShardedFlat) -> dict[str, Any]:
        return tapes.eigenvalues_of(flat, flat.keys, payload, quiet, started)

    def trace(flat: ShardedFlat) -> dict[str, Any]:
        return tapes.trace_of(flat, flat.keys, payload, quiet, started)

    def diagonal(flat: ShardedFlat) -> dict[str, Any]:
        return tapes.diagonal_of(flat, flat.keys, payload, quiet, started)

    def density(flat: ShardedFlat) -> dict[str, Any]:
        return tapes.spectral_density_of(flat, flat.keys, payload, quiet, started)

    def solve(flat: ShardedFlat) -> dict[str, Any]:
        # b: the vector asked, or the sharded tape's gradient (summed by the caller).
        vector = payload["vector"]
        primals = [np.broadcast_to(np.zeros((), d), s) for s, d in
                   zip(flat.shapes, flat.dtypes, strict=True)]
        check_vector(vector, flat.keys, primals, "vector")  # type: ignore[arg-type]
        b = flat.flatten([np.asarray(vector[k]) for k in flat.keys])
        return tapes.solve_of(flat, flat.keys, b, payload.get("rhs", "vector"), payload, quiet,
                              started)

    table = {"tape_eigenvalues": eigenvalues, "tape_trace": trace, "tape_diagonal": diagonal,
             "tape_spectral_density": density, "tape_solve": solve}
    if kind not in table:
        raise RequestError("internal", f"no sharded algorithm {kind!r}")
    return table[kind]


def _advance(run: Run, context: WorkerContext) -> dict[str, Any]:
    """Wait for the run's next event: a need (answered to the caller) or its end."""
    event, value = run.next_event()
    if event == "need":  # as the shards' tape_hvp takes it: one tensor per source
        progress, run.progress = run.progress, None
        return {"run": run.id, "need": [run.flat.keyed(v) for v in value],
                "progress": progress}
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
        raise RequestError(LOST, f"worker {context.index} holds no sharded run "
                           f"{payload['run']} (it was restarted meanwhile); ask again")
    parts = [_part(context, p, ("flat", "hvps")) for p in payload["parts"]]
    product = weighted_sum(parts, payload["weights"], "products")
    assert run.asked is not None
    if np.shape(product) != run.asked.shape:
        raise RequestError("internal", f"the shards' products have shape "
                           f"{list(np.shape(product))}, not {list(run.asked.shape)}")
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


HANDLERS: dict[str, Callable[[Any, WorkerContext], Any]] = {
    "shard_combine": shard_combine,
    "shard_run": shard_run,
    "shard_step": shard_step,
    "shard_drop": shard_drop,
}
