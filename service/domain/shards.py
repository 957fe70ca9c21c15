"""Sharded tapes on the HTTP side (issue 16): a tape whose batch is split over several
workers. No math here: the parts are ordinary tapes (service/domain/sessions.py records,
stores, rebuilds and evicts them as any other), and what they answer is summed in a
worker, the coordinator (service/worker/shards.py). This module splits the batch,
places the parts, routes each request to them and back.

- Splitting: the inputs named by `shard_by` (default: every input with an axis) are cut
  along their first axis into `shards` contiguous parts of sizes differing by one at
  most; all must have the same first-axis length N. An input bound to a stored dataset
  is split by its rows (the part's reference takes its slice of them), so the data goes
  from the store to the part's worker and no process holds all of it.
- Reduction: the request says how the parts add up. "mean" (the default): the loss is
  a mean over the batch, so the parts are weighted n_i / N (exact too for terms that do
  not depend on the batch, such as a weight penalty); "sum": the loss is a sum over the
  batch, the parts are added (a batch-independent term would then count once per part).
- A product that is a sum (the value, the gradient, HVPs, curvature products): the
  request goes to every part at once, and their answers to the coordinator, which sums
  them. An algorithm (eigenvalues, trace, diagonal, spectral density, solve) runs in the
  coordinator, which answers each product it needs as a request for it; the product is
  asked of every part and the answers handed to it (see service/worker/shards.py).
- The parts' answers do not pass through here: the coordinator's own part keeps its
  answer in its worker (`stash`), the others' are kept by the pool (`keep`, then
  `gather` with the sum: service/pool/base.py), which on Ray hands them from node to
  node as object references; this process routes their keys.
- Jacobians, gradients of other targets (or over a split input) and influence
  functions: pieces asked of the parts (the first part's plan of how the parts'
  derivatives combine; the parts' own; the influence's test gradient and
  each part's scores of its own examples, around a CG run as above), put together in
  the coordinator.
- A part whose worker was replaced is recorded again on its next use, alone (sessions.py
  does that for every tape); a coordinator lost mid-run restarts the run (the algorithms
  are seeded: the same numbers). A sharded tape ends whole: with its parts, and when one
  of its parts is evicted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from service.core.errors import ServiceError
from service.core.operations import (
    BY_KIND,
    CURVATURE_FIELDS,
    OPERATIONS,
    InfluenceOptions,
    Sharded,
    SolveOptions,
    curvature_choice,
    decode_options,
    encode_options,
)
from service.core.store import TapeRow, is_ref
from service.pool import (
    KEEP,
    KEPT_LOST,
    SHARED,
    ComputeFailed,
    ComputeTimeout,
    Reply,
    WorkerCrashed,
    calls,
)

# sessions.Tape and sessions.TapeRegistry: sessions.py imports this module, so they are
# named here only (the registry hands over what it makes: new_tape).
Tape = Any
TapeRegistry = Any

log = logging.getLogger("gradtape.shards")

LOST = KEPT_LOST  # the coordinator no longer holds a run or a kept part, nor the pool one
SHARED_FIELDS = ("vector", "vectors", "flat_vector")  # a product's, alike for every part
SUMS = ("tape_hvp", "tape_gradient")  # answers that are sums of the parts' answers
# The table operations run as one algorithm over the parts (their products summed); the
# others have a path of their own here (`own`) or are refused with the row's reason.
ALGORITHMS = frozenset(op.kind for op in OPERATIONS if op.sharded is Sharded.algorithm)


# A Laplace fit's questions (service/worker/curvature_ops.py; the fit itself is a table
# row, refused there): a sharded tape holds no fit.
UNSHARDED = ("tape_laplace_evidence", "tape_laplace_predictive", "tape_laplace_samples")


def _refuse_whole_batch_only(kind: str, payload: Mapping[str, Any]) -> None:
    """KFAC (as a curvature or a CG preconditioner), the backprop diagonal and a Laplace
    fit's questions need every example in one recording: a sharded tape refuses them."""
    options = payload.get("options") or {}
    if kind in UNSHARDED:
        raise _invalid("shards", "a sharded tape holds no Laplace fit: record it without shards")
    if options.get("curvature") in ("kfac", "ekfac"):
        raise _invalid("curvature", "KFAC needs every example in one recording: an unsharded tape")
    if options.get("preconditioner") not in (None, "none"):
        raise _invalid("preconditioner", "a KFAC preconditioner needs an unsharded tape")
    if options.get("method") == "backprop":
        raise _invalid("method", "method 'backprop' needs an unsharded tape")


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(
        "validation", f"{field}: {message}", errors=[{"field": field, "message": message}]
    )


def _reduction(given: str | None, program: str | None) -> str:
    """How the parts add up: what the client gave, else what the program says (a part's
    worker reads it: engine/language/reduction.py); never a default that could be a
    silent third (a summed loss averaged over three parts)."""
    if given is None and program is None:
        raise _invalid(
            "shard_reduction",
            "the target's line does not say plainly how it adds up over the batch (as "
            "sum(...), mean(...) or a loss op's reduction do): give 'mean' (the parts are "
            "weighted by their share of the rows) or 'sum' (the parts are added)",
        )
    if given is not None and program is not None and given != program:
        raise _invalid(
            "shard_reduction",
            f"{given!r}, but the target is a {program} over the batch in the program: the "
            f"total would be wrong; give {program!r} or leave shard_reduction out",
        )
    return given or program  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------
# Splitting a batch
# ----------------------------------------------------------------------------------------


def _ref_rows(ref: Mapping[str, Any]) -> range | list[int]:
    """The rows of its array a dataset reference takes (as indices)."""
    n = int(ref["shape"][0]) if ref.get("shape") else 0
    rows = ref.get("rows")
    if rows is None:
        return range(n)
    if isinstance(rows, Mapping):
        start = rows.get("start") or 0
        stop = n if rows.get("stop") is None else min(int(rows["stop"]), n)
        return range(start, stop, rows.get("step") or 1)
    return list(rows)


def batch_length(value: Any) -> int | None:
    """The first-axis length of an input (an array or a dataset reference); None for a
    scalar."""
    if is_ref(value):
        return len(_ref_rows(value)) if value.get("shape") else None
    shape = np.shape(value)
    return int(shape[0]) if shape else None


def take(value: Any, lo: int, hi: int) -> Any:
    """Rows lo:hi of an input: a view of an array, or a reference to fewer rows."""
    if not is_ref(value):
        return value[lo:hi]
    rows = _ref_rows(value)
    part = rows[lo:hi]
    taken: Any
    if isinstance(part, range):
        taken = {
            "start": part.start,
            "stop": part.start + (len(part) - 1) * part.step + 1,
            "step": part.step,
        }
    else:
        taken = part
    return {**value, "rows": taken}


def bounds(total: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous parts of sizes differing by one at most (the first ones larger)."""
    size, extra = divmod(total, shards)
    out, lo = [], 0
    for i in range(shards):
        hi = lo + size + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def split(
    definition: Mapping[str, Any], shard_by: Sequence[str] | None, shards: int
) -> tuple[list[dict[str, Any]], list[int], list[str]]:
    """(the parts' definitions, their batch sizes, the inputs split). 422s name the field."""
    inputs = definition.get("inputs") or {}
    if shard_by is None:
        names = [n for n, v in inputs.items() if batch_length(v) is not None]
        if not names:
            raise _invalid(
                "shards",
                "the definition has no input with a batch axis to split "
                "(shard_by names the inputs to split along their first axis)",
            )
    else:
        names = list(shard_by)
        unknown = [n for n in names if n not in inputs]
        if unknown:
            known = ", ".join(map(repr, inputs)) or "none"
            raise _invalid(
                "shard_by", f"no input {unknown[0]!r} in the definition (its inputs: {known})"
            )
        if len(set(names)) != len(names):
            raise _invalid("shard_by", "an input is named twice")
    lengths = {n: batch_length(inputs[n]) for n in names}
    scalar = [n for n, length in lengths.items() if length is None]
    if scalar:
        raise _invalid(
            "shard_by", f"input {scalar[0]!r} is a scalar: it has no batch axis to split"
        )
    if len(set(lengths.values())) != 1:
        listed = ", ".join(f"{n!r}: {length}" for n, length in lengths.items())
        how = (
            "name the batch inputs in shard_by" if shard_by is None else "name inputs of one batch"
        )
        raise _invalid(
            "shard_by",
            f"the inputs split must have the same first-axis length "
            f"(the batch); they have {listed}: {how}",
        )
    total = next(iter(lengths.values()))
    assert total is not None  # scalars were refused above
    if shards > total:
        raise _invalid(
            "shards",
            f"{shards} shards of a batch of {total}: at most {total} (one example per shard)",
        )
    parts = []
    for lo, hi in bounds(total, shards):
        part_inputs = {n: take(v, lo, hi) if n in lengths else v for n, v in inputs.items()}
        parts.append({**definition, "inputs": part_inputs})
    return parts, [hi - lo for lo, hi in bounds(total, shards)], names


def _source_names(sources: Any) -> list[str]:
    """The names a request's `sources` take derivatives over (a list, a dict, a name)."""
    if isinstance(sources, Mapping):
        return [str(v) for v in sources.values()]
    if isinstance(sources, str):
        return [sources]
    return [str(n) for n in sources or ()]


# ----------------------------------------------------------------------------------------
# A sharded tape
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deadline:
    """A request's time limit, which covers every step it takes across the workers."""

    at: float  # the event loop's clock
    limit: float

    @classmethod
    def after(cls, limit: float) -> Deadline:
        return cls(asyncio.get_running_loop().time() + limit, limit)

    def left(self, worker: int) -> float:
        """The time left for the next step (on `worker`); past it, the request's timeout."""
        left = self.at - asyncio.get_running_loop().time()
        if left <= 0:
            raise ComputeTimeout(self.limit, worker)
        return left


@dataclass(eq=False)
class ShardSet:
    parts: list[Tape]
    rows: list[int]  # each part's batch size
    reduction: str  # "mean" or "sum"
    shard_by: list[str]
    layout: list[list[Any]]  # [key, shape, dtype] per source, in the flat order

    @property
    def weights(self) -> list[float]:
        if self.reduction == "sum":
            return [1.0] * len(self.rows)
        total = sum(self.rows)
        return [r / total for r in self.rows]

    @property
    def coordinator(self) -> int:
        """The worker that sums the parts' answers (the first part's)."""
        return self.parts[0].row.worker

    def record(self) -> dict[str, Any]:
        """What the store keeps with the sharded tape (TapeRow.shards)."""
        return {
            "ids": [p.id for p in self.parts],
            "rows": self.rows,
            "reduction": self.reduction,
            "shard_by": self.shard_by,
            "layout": self.layout,
        }

    def info(self) -> dict[str, Any]:
        return {
            "shard_reduction": self.reduction,
            "shard_by": self.shard_by,
            "shards": [
                {
                    "rows": r,
                    "worker": p.row.worker,
                    "bytes": p.row.bytes,
                    "rebuilds": p.row.rebuilds,
                    "hits": p.row.hits,
                }
                for p, r in zip(self.parts, self.rows, strict=True)
            ],
        }


def kept_keys(parts: Sequence[Any]) -> list[str]:
    """The keys of the parts' answers the pool kept (those the coordinator's worker
    stashed itself are found there): what the sum gathers."""
    return [p["stashed"] for p in parts if isinstance(p, Mapping) and p.get("kept")]


class Sharding:
    """The sharded tapes of one TapeRegistry (which routes their requests here)."""

    def __init__(self, registry: TapeRegistry):
        self.registry = registry

    @property
    def pool(self) -> Any:
        return self.registry.pool

    # Creating -----------------------------------------------------------------------------
    def check(self, shards: int) -> None:
        limit = self.registry.settings.max_shards
        if shards > limit:
            raise _invalid("shards", f"at most {limit} on this server (max_shards)")

    async def create(
        self,
        owner: str,
        spec: dict[str, Any],
        ttl: float,
        model: str | None,
        time_limit: float,
        sharding: Mapping[str, Any],
        transient: bool = False,
    ) -> tuple[Tape, dict[str, Any]]:
        """Record the parts and combine their answers. `transient` (a stateless request's
        sharded tape): nothing stored, registered or counted; the caller releases it."""
        shards = int(sharding["shards"])
        self.check(shards)
        definitions, rows, names = split(spec["definition"], sharding.get("shard_by"), shards)
        self._check_sources(_source_names(spec.get("sources")), names)
        deadline = Deadline.after(time_limit)
        now = time.time()
        parent = self.registry.new_tape(
            TapeRow(
                id=secrets.token_urlsafe(24),
                owner=owner,
                definition=None,
                model=model,
                target=spec["target"],
                sources={},
                ttl=ttl,
                created=now,
                last_used=now,
                hits=0,
                bytes=0,
                worker=0,
                device="",
                rebuilds=0,
                state="live",
                ended=None,
                output=spec.get("output"),
            )
        )
        parent.transient = transient
        parent.busy += 1  # its parts are not evicted while their siblings are recorded
        placed: Counter[int] = Counter()
        workers = []
        for _ in range(shards):  # distinct workers while there are enough
            worker = self.registry._choose_worker(placed)
            placed[worker] += 1
            workers.append(worker)
        # The coordinator flattens the sum; `shards` words a part's errors for the whole.
        # `shard_by`: the inputs split, along which the part reads the target's reduction.
        part_spec = {**spec, "flat": False, "shards": shards, "shard_by": names}
        made: list[Tape] = []

        async def record(i: int) -> tuple[Tape, dict[str, Any]]:
            tape, answer = await self.registry.create(
                owner,
                {**part_spec, "definition": definitions[i]},
                ttl,
                model,
                deadline.left(workers[i]),
                worker=workers[i],
                part_of=(parent, i),
                transient=transient,
            )
            made.append(tape)  # recorded: dropped with the others if the rest fails
            return tape, answer

        try:
            outcomes = await asyncio.gather(
                *(record(i) for i in range(shards)), return_exceptions=True
            )
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            parts = [o[0] for o in outcomes]  # type: ignore[index]
            answers = [o[1] for o in outcomes]  # type: ignore[index]
            first = parts[0].row
            # Default sources are resolved by the workers: checked once they answered.
            self._check_sources(list(first.sources.values()), names)
            layout = [
                [k, list(np.shape(g)), str(np.asarray(g).dtype)]
                for k, g in answers[0]["gradients"].items()
            ]
            reduction = _reduction(sharding.get("reduction"), answers[0].get("reduction"))
            parent.shards = ShardSet(parts, rows, reduction, names, layout)
            combined = await self._combine(parent, answers, spec, deadline)
            parent.row.sources = dict(first.sources)
            parent.row.device = first.device
            parent.row.worker = first.worker
            parent.row.bytes = sum(p.row.bytes for p in parts)
            parent.row.shards = parent.shards.record()
            if not transient:
                await asyncio.to_thread(self.registry.store.insert_tape, parent.row, None)
        except BaseException:
            parent.shards = None
            for part in made:
                part.parent = None  # ends alone
            if transient:
                self.release_parts(made)
            else:
                await self.registry._end(made, "deleted")
            raise
        finally:
            parent.busy -= 1
        if not transient:
            self.registry.register(parent)
        return parent, combined

    def _check_sources(self, sources: Sequence[str], split_inputs: Sequence[str]) -> None:
        """A split input's gradient has each part's rows: never a sum of the parts'."""
        split_ones = [n for n in sources if n in split_inputs]
        if split_ones:
            raise _invalid(
                "sources",
                f"input {split_ones[0]!r} is split over the shards "
                "(shard_by): its gradient is not a sum of the parts'; take "
                "derivatives over the variables, or leave it out of shard_by",
            )

    def release_parts(self, parts: Sequence[Tape]) -> None:
        """Let a transient sharded tape's parts go from their workers (nothing stored)."""
        for part in parts:
            part.row.state = "deleted"
            self.registry._drop_later(part.row.worker, [part.id])

    def restore(self, parent: Tape, tapes: Mapping[str, Tape]) -> bool:
        """Link a sharded tape loaded from the store to its parts; False when one is gone."""
        record = parent.row.shards
        assert record is not None
        parts = [tapes.get(i) for i in record["ids"]]
        if any(p is None for p in parts):
            return False
        linked = [p for p in parts if p is not None]
        for part in linked:
            part.parent = parent
        parent.shards = ShardSet(
            linked,
            list(record["rows"]),
            record["reduction"],
            list(record["shard_by"]),
            record["layout"],
        )
        return True

    # Asking -------------------------------------------------------------------------------
    async def call(
        self, tape: Tape, kind: str, payload: dict[str, Any], time_limit: float
    ) -> Reply:
        """Run `kind` on the sharded tape: its parts' answers summed, or an algorithm
        across them; the time limit covers the whole run."""
        assert tape.shards is not None
        _refuse_whole_batch_only(kind, payload)
        started = time.perf_counter()
        deadline = Deadline.after(time_limit)
        tape.busy += 1
        try:
            if kind == "tape_gradient" and not self._gradient_is_a_sum(tape, payload):
                result = await self._pieced(tape, "gradient", payload, deadline)
            elif kind in SUMS:
                result = await self._sum(tape, kind, payload, deadline)
            elif kind in ALGORITHMS:
                result = await self._run(tape, kind, payload, deadline)
            elif kind in BY_KIND and BY_KIND[kind].sharded is Sharded.refused:
                raise _invalid("shards", f"{BY_KIND[kind].path}: {BY_KIND[kind].refusal}")
            elif kind == "tape_jacobian":
                result = await self._pieced(tape, "jacobian", payload, deadline)
            elif kind == "tape_influence":
                result = await self._influence(tape, payload, deadline)
            else:
                raise ServiceError("internal", f"no sharded form of {kind!r}")
        finally:
            tape.busy -= 1
        self.registry.touch(tape)
        return Reply(result, tape.shards.coordinator, 0, time.perf_counter() - started)

    def _gradient_is_a_sum(self, tape: Tape, payload: Mapping[str, Any]) -> bool:
        """The loss's gradient over unsplit sources is the parts' weighted sum; another
        target's, or one over a split input (each part's rows), is put together by
        _pieced."""
        assert tape.shards is not None
        target = payload.get("target")
        split = set(tape.shards.shard_by)
        return (target is None or target == tape.row.target) and not any(
            name in split for name in _source_names(payload.get("sources"))
        )

    async def _sum(
        self, tape: Tape, kind: str, payload: Mapping[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        assert tape.shards is not None
        part = {**payload, "flat": False}
        for attempt in (1, 2):
            replies = await self._fan(tape, kind, [part] * len(tape.shards.parts), deadline)
            try:
                parts, weights = await self._merge_kept(
                    [r.result for r in replies],
                    tape.shards.weights,
                    [r.worker for r in replies],
                    deadline,
                )
                return await self._combine(tape, parts, payload, deadline, weights)
            except ComputeFailed as exc:
                # The coordinator was replaced between the two steps (its kept parts went
                # with it): ask the parts again, once.
                if exc.error.get("type") != LOST or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _combine(
        self,
        tape: Tape,
        answers: list[dict[str, Any]],
        payload: Mapping[str, Any],
        deadline: Deadline,
        weights: Sequence[float] | None = None,
    ) -> dict[str, Any]:
        """The parts' answers summed by the coordinator (flattened there when asked);
        those the pool kept ({"stashed": key, "kept": true}) go to it from where they
        are. `weights`: the answers' own (default: the shards')."""
        assert tape.shards is not None
        worker = tape.shards.coordinator
        gather = kept_keys(answers)
        try:
            reply = await self.pool.submit(
                "shard_combine",
                {
                    "parts": answers,
                    "weights": list(weights or tape.shards.weights),
                    "flat": payload.get("flat"),
                    "allow_nonfinite": payload.get("allow_nonfinite", False),
                },
                worker=worker,
                time_limit=deadline.left(worker),
                gather=gather,
            )
        except BaseException:
            self.pool.release(gather)  # not taken if the request never left (its deadline)
            raise
        result: dict[str, Any] = reply.result
        return result

    async def _merge_kept(
        self, parts: list[Any], weights: Sequence[float], workers: Sequence[int], deadline: Deadline
    ) -> tuple[list[Any], list[float]]:
        """Sum the kept answers pairwise where they are, level by level, until two are
        left for the coordinator to gather beside its own parts' (not n - 1 into one
        worker: about log2(n) steps of one answer each). Only where the pool moves kept
        answers between workers (Ray); through this process (the local pool) each merge
        would add hops. A merge's failure fails the sum as the sum's own would (every
        kept answer let go)."""
        kept = [i for i, p in enumerate(parts) if isinstance(p, Mapping) and p.get("kept")]
        if len(kept) <= 2 or not self.pool.kept_between_workers:
            return parts, list(weights)
        parts, weights, where = list(parts), list(weights), list(workers)
        prefix = secrets.token_urlsafe(9)

        async def merge(a: int, b: int, key: str) -> None:
            worker = where[a]  # a's answer is there already: only b's moves
            reply = await self.pool.submit(
                "shard_combine",
                {
                    "parts": [parts[a], parts[b]],
                    "weights": [weights[a], weights[b]],
                    KEEP: key,
                    "allow_nonfinite": True,
                },
                worker=worker,
                time_limit=deadline.left(worker),
                gather=[parts[a]["stashed"], parts[b]["stashed"]],
            )
            parts[a], weights[a] = reply.result, 1.0

        merged: set[int] = set()  # answers summed into another's: out of the sum
        level = 0
        try:
            while len(kept) > 2:
                pairs = list(zip(kept[0::2], kept[1::2], strict=False))
                outcomes = await asyncio.gather(
                    *(merge(a, b, f"{prefix}:{level}:{a}") for a, b in pairs),
                    return_exceptions=True,
                )
                merged.update(b for _, b in pairs)  # gathered: consumed either way
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                kept = [i for i in kept if i not in merged]
                level += 1
        except BaseException:
            self.pool.release(kept_keys(parts))
            raise
        left = [i for i in range(len(parts)) if i not in merged]
        return [parts[i] for i in left], [weights[i] for i in left]

    async def _fan(
        self, tape: Tape, kind: str, payloads: Sequence[dict[str, Any]], deadline: Deadline
    ) -> list[Reply]:
        """`kind` on every part at once (a part's worker lost meanwhile: asked again once,
        which records that part again alone); the first failure, once all answered. Each
        part's answer waits for the sum where it is best kept, answering {"stashed":
        key}: in the coordinator's worker for the parts there (`stash`), and by the pool
        for the others (`keep`: on Ray, in the object store of the part's node, from
        where the sum gathers it; kept_keys names them). The vectors every part is asked
        with alike go to the pool once (`share`: on Ray, one object that each node
        fetches), not once per part."""
        shards = tape.shards
        assert shards is not None
        prefix = secrets.token_urlsafe(9)
        shared = await self._share(payloads)
        if shared is not None:
            payloads = [
                {k: v for k, v in q.items() if k not in SHARED_FIELDS} | {SHARED: shared}
                for q in payloads
            ]
        # A coordinator's part past its stash's room (STASH_MOST_BYTES) is kept by the pool.
        payloads = [
            {
                **q,
                KEEP: f"{prefix}:{i}",
                **({"stash": f"{prefix}:{i}"} if p.row.worker == shards.coordinator else {}),
            }
            for i, (p, q) in enumerate(zip(shards.parts, payloads, strict=True))
        ]
        kept = [q["stash"] for q in payloads if "stash" in q]
        try:
            outcomes = await asyncio.gather(
                *(
                    self._ask(p, kind, q, deadline)
                    for p, q in zip(shards.parts, payloads, strict=True)
                ),
                return_exceptions=True,
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:  # a part failed, or the request was cancelled
            if kept:
                self._drop_later(shards.coordinator, {"stash": kept})
            self.pool.release(q[KEEP] for q in payloads if KEEP in q)
            raise
        finally:
            if shared is not None:
                self.pool.release([shared])  # every part has answered (or will not)
        return list(outcomes)  # type: ignore[arg-type]

    async def _share(self, payloads: Sequence[dict[str, Any]]) -> str | None:
        """The pool's key for the vectors every part is asked with (the same request to
        each), or None: sent with each part's request."""
        if len(payloads) < 2 or any(q is not payloads[0] for q in payloads):
            return None
        fields = {k: payloads[0][k] for k in SHARED_FIELDS if payloads[0].get(k) is not None}
        return await self.pool.share(fields) if fields else None

    async def _run(
        self, tape: Tape, kind: str, payload: Mapping[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        """An algorithm in the coordinator, its products asked of the parts."""
        shards = tape.shards
        assert shards is not None
        body = dict(payload)
        curvature = curvature_choice(decode_options(BY_KIND[kind], payload["options"]))
        if kind == "tape_solve" and payload.get("vector") is None:
            # b is the sharded tape's gradient: the parts' gradients, summed.
            gradient = await self._sum(
                tape,
                "tape_gradient",
                {
                    "target": None,
                    "sources": None,
                    "unconnected": "zero",
                    "flat": False,
                    "allow_nonfinite": payload.get("allow_nonfinite", False),
                },
                deadline,
            )
            body["vector"], body["rhs"] = gradient["gradients"], "gradient"
        product = {
            "curvature": encode_options(curvature),
            "flat": True,
            "vector": None,
            "flat_vector": None,
            "allow_nonfinite": payload.get("allow_nonfinite", False),
        }
        start = {"kind": kind, "payload": body, "layout": shards.layout}
        for attempt in (1, 2):
            run_id = secrets.token_urlsafe(12)
            worker = shards.coordinator
            try:
                reply = await self.pool.submit(
                    "shard_run",
                    {"run": run_id, **start},
                    worker=worker,
                    time_limit=deadline.left(worker),
                )
                while reply.result["run"] is not None:
                    self._report(reply.result.get("progress"))
                    asked = [{**product, "vectors": reply.result["need"]}] * len(shards.parts)
                    replies = await self._fan(tape, "tape_hvp", asked, deadline)
                    parts, weights = await self._merge_kept(
                        [
                            r.result if "stashed" in r.result else r.result["flat"]["hvps"]
                            for r in replies
                        ],
                        shards.weights,
                        [r.worker for r in replies],
                        deadline,
                    )
                    gather = kept_keys(parts)
                    try:
                        reply = await self.pool.submit(
                            "shard_step",
                            {
                                "run": run_id,
                                "parts": parts,
                                "weights": weights,
                                "allow_nonfinite": True,
                            },
                            worker=worker,
                            time_limit=deadline.left(worker),
                            gather=gather,
                        )
                    except BaseException:
                        self.pool.release(gather)
                        raise
                answer: dict[str, Any] = reply.result["answer"]
                return answer
            except (WorkerCrashed, ComputeFailed) as exc:
                # The coordinator died with the run (computing, or between two steps):
                # start it again (seeded: the same numbers).
                lost = (
                    exc.worker == worker
                    if isinstance(exc, WorkerCrashed)
                    else exc.error.get("type") == LOST
                )
                if not lost or attempt == 2:
                    self._drop_later(worker, {"run": run_id})
                    raise
                log.info("sharded run's coordinator, worker %d, was lost: running again", worker)
            except BaseException:
                self._drop_later(worker, {"run": run_id})
                raise
        raise AssertionError("unreachable")

    # Jacobians and influence: pieces from the parts, put together in the coordinator ----
    async def _ask(
        self, part: Tape, kind: str, payload: dict[str, Any], deadline: Deadline
    ) -> Reply:
        """`kind` on one part (its worker lost meanwhile: asked again once, which records
        the part again)."""
        try:
            return await self.registry.call(part, kind, payload, deadline.left(part.row.worker))
        except WorkerCrashed:
            log.info("shard %s... lost with worker %d: asking again", part.id[:8], part.row.worker)
            return await self.registry.call(part, kind, payload, deadline.left(part.row.worker))

    async def _assemble(
        self,
        tape: Tape,
        kind: str,
        payloads: Sequence[dict[str, Any]],
        assemble: dict[str, Any],
        deadline: Deadline,
    ) -> dict[str, Any]:
        """`kind` on every part, their answers put together by the coordinator's
        `assemble` handler (its payload, with the parts' answers as "parts"). The
        coordinator replaced between the two steps (the answers it kept went with it):
        the parts are asked again, once."""
        shards = tape.shards
        assert shards is not None
        worker = shards.coordinator
        for attempt in (1, 2):
            replies = await self._fan(tape, kind, payloads, deadline)
            parts = [r.result for r in replies]
            gather = kept_keys(parts)  # the parts' answers the pool kept: to the coordinator
            try:
                reply = await self.pool.submit(
                    assemble["kind"],
                    {**assemble["payload"], "parts": parts},
                    worker=worker,
                    time_limit=deadline.left(worker),
                    gather=gather,
                )
                result: dict[str, Any] = reply.result
                return result
            except ComputeFailed as exc:
                self.pool.release(gather)
                if exc.error.get("type") != LOST or attempt == 2:
                    raise
            except BaseException:
                self.pool.release(gather)
                raise
        raise AssertionError("unreachable")

    async def _pieced(
        self, tape: Tape, of: str, payload: Mapping[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        """The jacobian, or gradient (`of`), of any name over any sources, as the
        unsharded tape answers it: the first part says from the program how the parts'
        make it (combined as the loss, rows in part order, block diagonal over a split
        input, ...; or refused, for a name that mixes the examples), then every part
        answers its own and the coordinator assembles them (service/worker/shards.py)."""
        shards = tape.shards
        assert shards is not None
        question = {k: payload.get(k) for k in ("target", "sources", "unconnected", "batch")}
        plan = (
            await self._ask(
                shards.parts[0],
                "tape_shard_plan",
                {**question, "of": of, "split": shards.shard_by, "rows": shards.rows},
                deadline,
            )
        ).result
        part = {**payload, "flat": False}
        return await self._assemble(
            tape,
            f"tape_{of}",
            [part] * len(shards.parts),
            {
                "kind": f"shard_{of}",
                "payload": {
                    "mode": plan["mode"],
                    "split_keys": plan["split_keys"],
                    "weights": shards.weights,
                    "batch": payload.get("batch"),
                    "flat": payload.get("flat"),
                    "allow_nonfinite": payload.get("allow_nonfinite", False),
                },
            },
            deadline,
        )

    async def _influence(
        self, tape: Tape, payload: Mapping[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        """Influence as the unsharded tape answers it: grad L_test from the parts, s_test
        by the CG run across the shards (the curvature's products summed), then every
        part scores its own examples, in part order (the unsharded example indices)."""
        shards = tape.shards
        assert shards is not None
        asked = msgspec.convert(payload["options"], InfluenceOptions)
        options = {"curvature": encode_options(curvature_choice(asked))}
        starts = [sum(shards.rows[:k]) for k in range(len(shards.rows))]
        test_rows = payload.get("rows")
        if test_rows is None:  # the tape's loss on new points: one part computes it
            test = (
                await self._ask(
                    shards.parts[0],
                    "tape_influence_test",
                    {**options, "test_inputs": payload["test_inputs"], "examples": shards.rows[0]},
                    deadline,
                )
            ).result
        else:
            total = sum(shards.rows)
            bad = [r for r in test_rows if not 0 <= r < total]
            if bad:
                raise _invalid(
                    "rows",
                    f"{bad[:5]} out of range; the tape has {total} examples (rows 0 to N - 1)",
                )
            # Each part's loss on its own rows, weighted as the reduction adds the batch
            # (a mean over |R| rows: the part's mean over its |R_k| times |R_k| / |R|).
            local = [
                [r - lo for r in test_rows if lo <= r < lo + n]
                for lo, n in zip(starts, shards.rows, strict=True)
            ]
            weights = (
                [len(rows) / len(test_rows) for rows in local]
                if shards.reduction == "mean"
                else [1.0] * len(local)
            )
            test = await self._assemble(
                tape,
                "tape_influence_test",
                [
                    {**options, "rows": rows, "examples": n}
                    for rows, n in zip(local, shards.rows, strict=True)
                ],
                {
                    "kind": "shard_combine",
                    "payload": {
                        "weights": weights,
                        "flat": False,
                        "allow_nonfinite": payload.get("allow_nonfinite", False),
                    },
                },
                deadline,
            )
        # s_test by the sharded CG run: a solve with the influence request's own options.
        solve = msgspec.convert(
            {
                k: getattr(asked, k)
                for k in (
                    *CURVATURE_FIELDS,
                    "damping",
                    "tol",
                    "max_iterations",
                    "max_hvps",
                    "max_seconds",
                )
            },
            SolveOptions,
        )
        solved = await self._run(
            tape,
            "tape_solve",
            {
                "options": encode_options(solve),
                "vector": test["gradients"],
                "allow_nonfinite": payload.get("allow_nonfinite", False),
            },
            deadline,
        )
        return await self._assemble(
            tape,
            "tape_influence_scores",
            [{**options, "s_test": solved["solution"], "examples": n} for n in shards.rows],
            {
                "kind": "shard_influence",
                "payload": {
                    "weights": shards.weights,
                    "top_k": asked.top_k,
                    "test_loss": test["value"],
                    "solve": solved,
                    "curvature": str(asked.curvature),
                },
            },
            deadline,
        )

    def _report(self, progress: dict[str, Any] | None) -> None:
        """The algorithm's progress to the caller, when it is a job that wants it."""
        watch = calls.current.get()
        if progress and watch is not None and watch.progress is not None:
            watch.progress(progress)

    def _drop_later(self, worker: int, what: dict[str, Any]) -> None:
        """Let the coordinator's run or kept answers go (after what it is doing now)."""
        self.registry.send_later(worker, "shard_drop", what)

    # Stateless requests -------------------------------------------------------------------
    async def stateless(
        self,
        owner: str,
        kind: str,
        payload: Mapping[str, Any],
        time_limit: float,
        sharding: Mapping[str, Any],
    ) -> Reply:
        """POST /v1/gradient or /v1/hvp with `shards`: a transient sharded tape recorded
        for the request, asked, and let go (on an error or a cancel too)."""
        started = time.perf_counter()
        deadline = Deadline.after(time_limit)
        flat = bool(payload.get("flat"))
        spec = {
            "definition": payload["definition"],
            "target": payload["target"],
            "sources": payload.get("sources"),
            "flat": flat,
            "output": None,
            "allow_nonfinite": payload.get("allow_nonfinite", False),
            **({"point": payload["point"]} if payload.get("point") is not None else {}),
        }
        # Transient: nothing stored, no quota, no eviction of other tapes on its account.
        tape, result = await self.create(
            owner, spec, self.registry.settings.tape_ttl, None, time_limit, sharding, transient=True
        )
        try:
            if kind == "hvp":
                products = await self.call(
                    tape,
                    "tape_hvp",
                    {
                        "vector": payload.get("vector"),
                        "vectors": payload.get("vectors"),
                        "flat_vector": payload.get("flat_vector"),
                        "flat": flat,
                        "curvature": None,
                        "allow_nonfinite": spec["allow_nonfinite"],
                    },
                    deadline.left(tape.shards.coordinator),
                )
                answer = products.result
                result = {**result, "hvp": answer.get("hvp"), "hvps": answer.get("hvps")}
                if flat:  # one flat answer: the gradient's and the products'
                    result["flat"] = {**result.get("flat", {}), **answer["flat"]}
        finally:
            assert tape.shards is not None
            self.release_parts(tape.shards.parts)
        return Reply(result, tape.shards.coordinator, 0, time.perf_counter() - started)

    # Updating -----------------------------------------------------------------------------
    async def update(
        self,
        tape: Tape,
        variables: Mapping[str, np.ndarray],
        inputs: Mapping[str, Any],
        time_limit: float,
        point: Any,
        flat: bool,
        bare: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        """New variable values (or a flat point) for every part, recorded again in
        place; the value and gradients summed. `bare`: as TapeRegistry.update's."""
        shards = tape.shards
        assert shards is not None
        if inputs:
            raise _invalid(
                "inputs",
                "a sharded tape's inputs are split over its shards: "
                "record a new sharded tape for new data",
            )
        deadline = Deadline.after(time_limit)
        store = self.registry.store
        tape.busy += 1
        try:
            # Every part takes the new values or none does: the old definitions are put
            # back on the parts that took them when another part (or the sum) fails.
            old = [
                await asyncio.to_thread(store.get_definition, p.row.definition)
                for p in shards.parts
            ]
            answers = await asyncio.gather(
                *(
                    self.registry.update(
                        p,
                        variables,
                        {},
                        deadline.left(p.row.worker),
                        point=point,
                        flat=False,
                        bare=bare,
                    )
                    for p in shards.parts
                ),
                return_exceptions=True,
            )
            try:
                for answer in answers:
                    if isinstance(answer, BaseException):
                        raise answer
                combined = await self._combine(tape, list(answers), {"flat": flat}, deadline)  # type: ignore[arg-type]
            except BaseException:
                updated = [
                    (p, d)
                    for p, d, a in zip(shards.parts, old, answers, strict=True)
                    if not isinstance(a, BaseException)
                ]
                await self._restore(updated)
                raise
        finally:
            tape.busy -= 1
        self.registry.touch(tape)
        return combined

    async def _restore(self, parts: Sequence[tuple[Tape, dict[str, Any] | None]]) -> None:
        """Give parts their old definitions back (a PATCH failed on a sibling): stored
        at once, their workers' new recordings dropped, so that the next use records the
        old values again."""
        for part, definition in parts:
            if definition is None:  # cannot happen for a live part; end it rather than mix
                raise ServiceError(
                    "internal", f"the stored definition of shard {part.id} is missing"
                )
            part.row.definition = await asyncio.to_thread(
                self.registry.store.set_tape_definition, part.id, definition
            )
            part.generation = None  # recorded again, with the old values, on next use
            self.registry._drop_later(part.row.worker, [part.id])
