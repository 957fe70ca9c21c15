"""Tapes on the HTTP side: which worker holds each, who owns it, when it expires, what
it costs; and the stored models. No math here: the recordings live in the workers
(service/worker/tapes.py), their definitions in the store (service/core/store.py).

- A tape lives in one worker; every request for it is routed there
  (`pool.submit(..., worker=i)`). The registry remembers the worker's `generation` when
  it last answered: a different generation now (the worker was replaced) or none (the
  service restarted) means the worker lost the recording, and the request carries the
  stored definition so that the worker records it again before answering. A worker
  that says "tape-missing" anyway gets the same request again with the definition.
- A tape expires `ttl` seconds after its last use. A worker holds at most
  `tape_memory_budget` bytes of tapes: past it, its least recently used tapes are
  evicted. An expired, evicted or deleted tape keeps a tombstone in the store, so its
  id answers 404 with the reason (for `tombstone_ttl` seconds).
- Quotas per owner (API key; one anonymous owner without keys): `max_tapes_per_key`
  live tapes holding at most `max_tape_bytes_per_key` bytes; past them, 429.
- Usage (last use, hits, bytes) is kept in memory and written to the store by the
  sweeper every `tape_sweep_interval` seconds and at shutdown; tapes, tombstones and
  definitions are written at once.

Several HTTP processes (`http_workers` > 1, settings.shared): the store is the
authority, each process's `_tapes` only its copies. Every use reads the tape's row
(and its parts'), one indexed read: a tape another process made is adopted (recorded on
one of this process's workers on first use, as after a restart), a copy whose stored
`version` moved (new values, PATCHed elsewhere) is recorded again, an ended one answers
its 404 (deleted, expired). Uses are written at once (last use: the latest of every
process's; hits add up); the sweeper ends only tapes whose stored last use is older than their ttl,
and forgets the copies of tapes ended elsewhere; quotas count the store's rows.
Eviction unloads this process's copy only (the tape stays live in the store, and its
next use here records it again): one process's memory pressure ends no tape that the
others serve.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from service.core.config import Settings
from service.core.errors import ServiceError
from service.core.store import ModelRow, QuotaFull, Store, TapeRow, is_ref
from service.domain.metrics import Metrics
from service.domain.shards import Sharding, ShardSet
from service.pool import Cancelled, ComputeFailed, Pool, PoolError, Reply, WorkerInfo

log = logging.getLogger("gradtape.sessions")


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


@dataclass(eq=False)
class Tape:
    row: TapeRow
    generation: int | None = None  # the worker generation holding the recording
    busy: int = 0  # requests in flight (never evicted meanwhile)
    dirty: bool = False  # usage not yet written to the store
    shards: ShardSet | None = None  # a sharded tape: its parts (service/domain/shards.py)
    parent: Tape | None = None  # a part of a sharded tape: never seen by clients
    # A stateless request's sharded tape or part: not stored, registered or counted; a
    # part keeps its recording's spec here (for a rebuild if its worker is replaced).
    transient: bool = False
    kept_spec: dict[str, Any] | None = None
    # Several HTTP processes: the worker's recording is of an older stored version; the
    # next use records the stored definition again in its place.
    stale: bool = False

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def expires(self) -> float:
        return self.row.last_used + self.row.ttl

    @property
    def ended(self) -> bool:
        return self.row.state != "live"

    def info(self, loaded: bool) -> dict[str, Any]:
        r = self.row
        return {
            "tape_id": r.id,
            "target": r.target,
            "output": r.output,
            "sources": r.sources,
            "model": r.model,
            "created_at": iso(r.created),
            "last_used_at": iso(r.last_used),
            "expires_at": iso(self.expires),
            "ttl": r.ttl,
            "hits": r.hits,
            "bytes": r.bytes,
            "device": r.device,
            "worker": r.worker,
            "loaded": loaded,
            "rebuilds": r.rebuilds,
            **(self.shards.info() if self.shards is not None else {}),
        }


def with_applied(definition: dict[str, Any], applied: Mapping[str, Any] | None) -> dict[str, Any]:
    """The definition with the values a flat point gave its sources (the worker split
    the point and says which names it set), as the tape's stored definition: a rebuild
    then records the same point."""
    if not applied:
        return definition
    variables = dict(definition["variables"])
    for name, value in applied["variables"].items():
        variables[name] = {**variables.get(name, {"trainable": True}), "value": value}
    return {
        **definition,
        "variables": variables,
        "inputs": {**definition["inputs"], **applied["inputs"]},
    }


# The whole numbers a double holds exactly are those below 2**53 in magnitude.
BARE_EXACT = 2.0**53


def _as_recorded(value: np.ndarray, recorded: np.dtype, bare: bool, what: str) -> np.ndarray | str:
    """`value` in the recorded dtype, or why it cannot be. A tensor that names its dtype
    is cast within its kind (float64 into a float32 tape); a bare number or list (read
    as float64) takes the recorded dtype of any kind, when it holds that kind's values:
    whole numbers within range for integers (labels), 0 and 1 for booleans."""
    if value.dtype.kind == recorded.kind:
        return value.astype(recorded)
    refused = f"dtype {value.dtype} cannot replace {what} {recorded}"
    if not bare or recorded.kind not in "iub" or value.dtype.kind != "f":
        return refused
    if recorded.kind == "b":
        fits = bool(np.isin(value, (0.0, 1.0)).all())
    else:
        bounds = np.iinfo(recorded)
        fits = bool(
            np.isfinite(value).all()
            and (value == np.round(value)).all()
            and (value >= bounds.min).all()
            and (value < float(bounds.max) + 1).all()  # 2**63 as a float is past int64
            # Read as float64, a bare whole number past 2**53 may be another one (2**53 + 1
            # arrives as 2**53): refused, not cast to a value the client never sent.
            and (np.abs(value) < BARE_EXACT).all()
        )
    if not fits:
        if recorded.kind == "b":
            return f"{what} dtype is {recorded}: the values given must be 0 or 1"
        return (
            f"{what} dtype is {recorded}: the values given must be whole numbers within "
            f"{recorded}'s range and below 2**53 in magnitude (a bare number is read as a "
            f"double, exact only there; send larger ones as a tensor with dtype {recorded})"
        )
    return value.astype(recorded)


class TapeRegistry:
    def __init__(self, settings: Settings, pool: Pool, store: Store, metrics: Metrics):
        self.settings = settings
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self._tapes: dict[str, Tape] = {}
        self._creating: defaultdict[str, int] = defaultdict(int)
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.sharding = Sharding(self)
        self.shared = settings.shared

    @property
    def _expiry_grace(self) -> float:
        """How long past its ttl another process waits before it ends a tape (several
        processes): a tape with a request in flight here has its stored last use
        refreshed only by this process's sweeps (keep_alive, every tape_sweep_interval), so
        a request that began just before the ttl ran out must not see its tape ended
        under it by a process that has not heard of it."""
        return 2 * self.settings.tape_sweep_interval

    # Lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Load the live tapes of the store (none is in a worker yet: each is recorded
        again on its first use) and start the sweeper."""
        if self.shared:  # nothing to load: each tape is adopted on its first use here
            ended = await asyncio.to_thread(
                self.store.expire_tapes, time.time(), self._expiry_grace
            )
            if ended:
                log.info("%d tape(s) expired while no process used them", len(ended))
            self.metrics.bind_tapes(self)
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
            return
        rows = await asyncio.to_thread(self.store.live_tapes)
        now = time.time()
        expired = [r for r in rows if r.last_used + r.ttl <= now]
        await asyncio.to_thread(self.store.end_tapes, expired, "expired", now)
        for row in rows:
            if row.last_used + row.ttl > now:
                self._tapes[row.id] = Tape(row)
        # A sharded tape and its parts come back together, or not at all.
        broken = [
            t
            for t in self._tapes.values()
            if t.row.shards and "ids" in t.row.shards and not self.sharding.restore(t, self._tapes)
        ]
        orphans = [
            t
            for t in self._tapes.values()
            if t.row.shards and "parent" in t.row.shards and t.parent is None
        ]
        await self._end(broken + orphans, "expired")
        if rows:
            log.info(
                "%d tape(s) restored from the store (%d had expired)",
                len(self._tapes),
                len(expired),
            )
        self.metrics.bind_tapes(self)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for task in list(self._tasks):
            task.cancel()
        await self.flush()

    # Reading ------------------------------------------------------------------------------
    async def live(self, owner: str) -> list[Tape]:
        now = time.time()
        if self.shared:  # every process's tapes, from the store
            rows = await asyncio.to_thread(self.store.live_tapes, owner)
            by_id = {r.id: r for r in rows}
            families = [
                [r, *(by_id[i] for i in r.shards["ids"] if i in by_id)]
                if r.shards and "ids" in r.shards
                else [r]
                for r in rows
                if not r.is_part and r.last_used + r.ttl > now
            ]
            # (a sharded tape ending elsewhere as this was read: left out, not half-listed)
            whole = [f for f in families if len(f) == 1 + len((f[0].shards or {}).get("ids", []))]
            return sorted((self._sync(f) for f in whole), key=lambda t: t.row.created)
        return sorted(
            (
                t
                for t in self._tapes.values()
                if t.row.owner == owner and t.expires > now and t.parent is None
            ),
            key=lambda t: t.row.created,
        )

    def loaded(self, tape: Tape, workers: list[WorkerInfo] | None = None) -> bool:
        """Whether the tape's worker still holds it (a sharded tape: every part's).
        `workers`: pool.workers(), when the caller asks for many tapes (it costs a few us
        a worker each time)."""
        workers = self.pool.workers() if workers is None else workers
        if tape.shards is not None:
            return all(self.loaded(p, workers) for p in tape.shards.parts)
        return (
            tape.row.worker < len(workers)
            and tape.generation == workers[tape.row.worker].generation
        )

    def count(self) -> int:
        return sum(1 for t in self._tapes.values() if t.parent is None)

    def total_bytes(self) -> int:
        workers = self.pool.workers()
        return sum(
            t.row.bytes
            for t in self._tapes.values()
            if t.shards is None and self.loaded(t, workers)
        )

    async def get(self, tape_id: str, owner: str) -> Tape:
        """The caller's live tape, or a 404 problem that says why there is none."""
        if self.shared:
            return await self._get_shared(tape_id, owner)
        tape = self._tapes.get(tape_id)
        if tape is not None and tape.parent is not None:
            tape = None  # a shard is the sharded tape's business, never a client's
        if tape is not None and tape.row.owner == owner:
            if tape.expires > time.time() or tape.busy:
                return tape
            await self._end([tape], "expired")
            raise self._gone(tape.row)
        if tape is None and len(tape_id) <= 128:
            row = await asyncio.to_thread(self.store.get_tape, tape_id)
            if row is not None and row.owner == owner and row.state != "live":
                raise self._gone(row)
        raise self._not_found(tape_id)

    def _not_found(self, tape_id: str) -> ServiceError:
        return ServiceError(
            "tape-not-found",
            f"no tape {tape_id!r} (tape ids come from POST /v1/tapes; GET /v1/tapes lists yours)",
        )

    # Several HTTP processes: the store's rows are the tapes -----------------------------
    async def _get_shared(self, tape_id: str, owner: str) -> Tape:
        """The caller's live tape as the store has it now (this process's copy brought
        up to date, or adopted); its 404 when it ended, wherever that happened."""
        if len(tape_id) > 128:
            raise self._not_found(tape_id)
        rows = await asyncio.to_thread(self.store.get_tape_family, tape_id)
        if not rows or rows[0].owner != owner or rows[0].is_part:
            raise self._not_found(tape_id)
        row = rows[0]
        local = self._tapes.get(tape_id)
        if row.state != "live":
            if local is not None:
                self._forget(local, row.state)
            raise self._gone(row)
        now = time.time()
        if row.last_used + row.ttl + self._expiry_grace <= now and not (
            local is not None and local.busy
        ):
            # Unused by every process for its ttl: ended in one transaction that looks at
            # the stored last use again (a use elsewhere meanwhile keeps it).
            ended = await asyncio.to_thread(self.store.expire_tapes, now, self._expiry_grace)
            self._forget_rows(ended)
            fresh = await asyncio.to_thread(self.store.get_tape, tape_id)
            if fresh is not None and fresh.state != "live":
                raise self._gone(fresh)
            rows = await asyncio.to_thread(self.store.get_tape_family, tape_id)
        if (
            rows[0].shards
            and "ids" in rows[0].shards
            and len(rows) != 1 + len(rows[0].shards["ids"])
        ):
            raise ServiceError(
                "internal", f"the stored parts of sharded tape {tape_id} are missing"
            )
        return self._sync(rows)

    def _sync(self, rows: list[TapeRow]) -> Tape:
        """This process's copy of the tape (and parts) in `rows`, the store's rows read
        now: made when there is none, its recording marked stale where a version moved."""
        head = rows[0]
        tape = self._tapes.get(head.id)
        if tape is None:
            return self._adopt(rows)
        copies = [tape] if tape.shards is None else [tape, *tape.shards.parts]
        for copy, row in zip(copies, rows, strict=True):
            if row.version != copy.row.version:
                copy.row.definition = row.definition
                copy.row.version = row.version
                # (still stale if it moved twice before a use here recorded it again)
                copy.stale = copy.stale or copy.generation is not None
                copy.generation = None
            copy.row.last_used = max(copy.row.last_used, row.last_used)
            copy.row.hits = row.hits
            copy.row.rebuilds = row.rebuilds
            copy.row.ttl = row.ttl
        return tape

    def _adopt(self, rows: list[TapeRow]) -> Tape:
        """A tape made (or last recorded) by another process: a copy here, on this
        process's least loaded worker(s), recorded there on its first use."""
        head = self.new_tape(rows[0])
        placed: defaultdict[int, int] = defaultdict(int)
        parts = []
        for row in rows[1:]:
            part = Tape(row, parent=head)
            row.worker = self._choose_worker(placed)
            placed[row.worker] += 1
            parts.append(part)
        if parts:
            self.sharding.restore(head, {p.id: p for p in parts})
            for part in parts:
                self._tapes[part.id] = part
        else:
            head.row.worker = self._choose_worker()
        self._tapes[head.id] = head
        return head

    def _forget(self, tape: Tape, state: str) -> None:
        """Let this process's copy of a tape ended elsewhere go (`state`: the store's)."""
        copies = [tape] if tape.shards is None else [tape, *tape.shards.parts]
        for copy in copies:
            if self._tapes.pop(copy.id, None) is None:
                continue
            copy.row.state = state  # a request in flight here drops its recording after
            if copy.shards is None and self.loaded(copy):
                self._drop_later(copy.row.worker, [copy.id])

    def _forget_rows(self, rows: list[TapeRow]) -> None:
        for row in rows:
            local = self._tapes.get(row.id)
            if local is not None:
                self._forget(local, "expired")
                self.metrics.tape_event("expired")

    async def _used(self, tape: Tape, rebuilt: bool = False) -> None:
        """Several HTTP processes: write a use at once (others' sweepers read it)."""
        if self.shared and not tape.transient:
            await asyncio.to_thread(
                self.store.touch_tape, tape.id, tape.row.last_used, tape.row.bytes, rebuilt
            )

    def _gone(self, row: TapeRow) -> ServiceError:
        when = iso(row.ended or time.time())
        again = "; record it again with POST /v1/tapes"
        if row.state == "expired":
            return ServiceError(
                "tape-expired",
                f"tape {row.id} expired at {when}: it was not used for {row.ttl:g} s (its "
                f"ttl){again}",
                reason="expired",
                ended_at=when,
            )
        if row.state == "evicted":
            return ServiceError(
                "tape-evicted",
                f"tape {row.id} was evicted at {when}: worker {row.worker} needed room for "
                f"more recently used tapes within its memory budget "
                f"(tape_memory_budget = {self.settings.tape_memory_budget:,} bytes){again}",
                reason="evicted",
                ended_at=when,
            )
        return ServiceError(
            "tape-not-found",
            f"tape {row.id} was deleted at {when}",
            reason="deleted",
            ended_at=when,
        )

    # Creating -----------------------------------------------------------------------------
    async def create(
        self,
        owner: str,
        spec: dict[str, Any],
        ttl: float,
        model: str | None,
        time_limit: float,
        worker: int | None = None,
        part_of: tuple[Tape, int] | None = None,
        transient: bool = False,
    ) -> tuple[Tape, dict[str, Any]]:
        """Record a tape in a worker (`worker`, else the least loaded), store it, and
        register it; answer the worker's result (value, gradients, device, resolved
        sources). `part_of`: the tape is part `index` of the sharded tape `parent`,
        counted in the quotas through it. `transient` (a part of a stateless request):
        kept in memory only, out of the quotas, the store and the eviction accounts."""
        if part_of is None:
            await self._check_count(owner)
        self._creating[owner] += 0 if transient else 1
        try:
            tape_id = secrets.token_urlsafe(24)
            worker = self._choose_worker() if worker is None else worker
            try:
                reply = await self.pool.submit(
                    "tape_create",
                    {"tape_id": tape_id, **spec},
                    worker=worker,
                    time_limit=time_limit,
                )
            except Cancelled:
                # The worker may have finished recording as the cancel arrived.
                self._drop_later(worker, [tape_id])
                raise
            result: dict[str, Any] = reply.result
            size = int(result.pop("tape")["bytes"])
            definition = with_applied(spec["definition"], result.pop("applied", None))
            try:
                await self._check_size(owner, size, quota=not transient)
                now = time.time()
                row = TapeRow(
                    id=tape_id,
                    owner=owner,
                    definition=None,
                    model=model,
                    target=spec["target"],
                    sources=dict(result.pop("sources")),
                    ttl=ttl,
                    created=now,
                    last_used=now,
                    hits=0,
                    bytes=size,
                    worker=reply.worker,
                    device=str(result.pop("device")),
                    rebuilds=0,
                    state="live",
                    ended=None,
                    output=spec.get("output"),
                    shards=None
                    if part_of is None
                    else {"parent": part_of[0].id, "index": part_of[1]},
                )
                if not transient:
                    # Several processes: the quota counted again as the row goes in.
                    limit = (
                        self.settings.max_tapes_per_key if self.shared and part_of is None else None
                    )
                    try:
                        await asyncio.to_thread(self.store.insert_tape, row, definition, limit)
                    except QuotaFull as full:
                        raise self._quota_error(full.held, 0) from None
            except BaseException:
                self._drop_later(reply.worker, [tape_id])
                raise
        finally:
            self._creating[owner] -= 0 if transient else 1
        tape = Tape(
            row, generation=reply.generation, parent=None if part_of is None else part_of[0]
        )
        if transient:
            tape.transient = True
            tape.kept_spec = {**spec, "definition": definition}
            return tape, result
        self._tapes[tape_id] = tape
        if part_of is None:
            self.metrics.tape_event("created")
        await self._enforce_budget(reply.worker, keep=tape)
        return tape, result

    async def create_sharded(
        self,
        owner: str,
        spec: dict[str, Any],
        ttl: float,
        model: str | None,
        time_limit: float,
        sharding: dict[str, Any],
    ) -> tuple[Tape, dict[str, Any]]:
        """A tape whose batch is split over `sharding["shards"]` tapes in distinct
        workers (service/domain/shards.py): answers as `create` does."""
        await self._check_count(owner)
        self._creating[owner] += 1
        try:
            return await self.sharding.create(owner, spec, ttl, model, time_limit, sharding)
        finally:
            self._creating[owner] -= 1

    def new_tape(self, row: TapeRow) -> Tape:
        return Tape(row)

    def register(self, tape: Tape) -> None:
        """A tape recorded and stored elsewhere (a sharded tape, by shards.py)."""
        self._tapes[tape.id] = tape
        self.metrics.tape_event("created")

    async def _check_count(self, owner: str) -> None:
        limit = self.settings.max_tapes_per_key
        if self.shared:  # every process's tapes (those being recorded: this one's)
            held = (await asyncio.to_thread(self.store.tape_usage, owner))[0]
        else:
            held = sum(1 for t in self._tapes.values() if t.row.owner == owner and t.parent is None)
        if held + self._creating[owner] >= limit:
            raise self._quota_error(held, self._creating[owner])

    def _quota_error(self, held: int, creating: int) -> ServiceError:
        limit = self.settings.max_tapes_per_key
        return ServiceError(
            "quota-exceeded",
            f"this API key holds {held} live tape(s) (with {creating} being recorded); the "
            f"quota is {limit} (max_tapes_per_key). DELETE tapes you no longer need (GET "
            "/v1/tapes lists them), or let them expire",
            quota="tapes",
            limit=limit,
        )

    async def _check_size(self, owner: str, size: int, quota: bool = True) -> None:
        budget = self.settings.tape_memory_budget
        if size > budget:
            raise ServiceError(
                "too-large",
                f"the tape holds {size:,} bytes, more than a worker may hold in tapes "
                f"(tape_memory_budget = {budget:,} bytes); use a smaller batch or model, or "
                "the stateless /v1/hvp",
                limit=budget,
            )
        if not quota:
            return
        limit = self.settings.max_tape_bytes_per_key
        if self.shared:
            used = (await asyncio.to_thread(self.store.tape_usage, owner))[1]
        else:
            used = sum(
                t.row.bytes
                for t in self._tapes.values()
                if t.row.owner == owner and t.shards is None
            )
        if used + size > limit:
            raise ServiceError(
                "quota-exceeded",
                f"this tape holds {size:,} bytes and this API key's live tapes already hold "
                f"{used:,}; the quota is {limit:,} bytes (max_tape_bytes_per_key). DELETE "
                "tapes you no longer need, or let them expire",
                quota="bytes",
                limit=limit,
            )

    def _choose_worker(self, avoid: Mapping[int, int] | None = None) -> int:
        """An idle worker holding the fewest tape bytes (else any, by bytes); with
        `avoid` (worker -> parts of one sharded tape placed there already), the worker
        holding the fewest of those first, so that its parts run side by side."""
        workers = self.pool.workers()
        held = [0] * len(workers)
        for t in self._tapes.values():
            if t.shards is None and self.loaded(t, workers):
                held[t.row.worker] += t.row.bytes
        avoid = avoid or {}
        return min(
            range(len(workers)),
            key=lambda i: (avoid.get(i, 0), workers[i].state != "idle", held[i], i),
        )

    # Using --------------------------------------------------------------------------------
    async def call(
        self, tape: Tape, kind: str, payload: dict[str, Any], time_limit: float
    ) -> Reply:
        """Run `kind` on the tape in its worker, recording it again there first when the
        worker lost it; update its usage. The reply's result is the answer. A sharded
        tape asks its parts (service/domain/shards.py)."""
        if tape.shards is not None:
            return await self.sharding.call(tape, kind, payload, time_limit)
        tape.busy += 1
        try:
            worker = self._worker_of(tape)
            message = {"tape_id": tape.id, **payload}
            if not self.loaded(tape):
                message["rebuild"] = await self._spec(tape)
                if tape.stale:
                    message["rerecord"] = True
            try:
                reply = await self.pool.submit(kind, message, worker=worker, time_limit=time_limit)
            except ComputeFailed as exc:
                if exc.error.get("type") != "tape-missing" or "rebuild" in message:
                    raise
                if tape.ended:
                    raise self._gone(tape.row) from None
                message["rebuild"] = await self._spec(tape)
                reply = await self.pool.submit(kind, message, worker=worker, time_limit=time_limit)
        finally:
            tape.busy -= 1
        result: dict[str, Any] = reply.result
        meta = result.pop("tape")
        tape.generation = reply.generation
        if meta["rebuilt"]:
            tape.row.rebuilds += 1
            self.metrics.tape_event("rebuilt")
            log.info("tape %s... recorded again in worker %d", tape.id[:8], worker)
        tape.stale = False
        tape.row.bytes = int(meta["bytes"])
        tape.row.hits += 1
        tape.row.last_used = time.time()
        tape.dirty = not self.shared
        if self.shared:
            await self._used(tape, bool(meta["rebuilt"]))
        if tape.ended:  # deleted or evicted while this request ran: let it go again
            self._drop_later(worker, [tape.id])
        elif not tape.transient:  # a transient part is out of the eviction accounts
            await self._enforce_budget(worker, keep=tape)
        return reply

    def touch(self, tape: Tape) -> None:
        """A sharded tape was used (its parts count their own use)."""
        assert tape.shards is not None
        tape.row.bytes = sum(p.row.bytes for p in tape.shards.parts)
        tape.row.rebuilds = sum(p.row.rebuilds for p in tape.shards.parts)
        tape.row.hits += 1
        tape.row.last_used = time.time()
        tape.dirty = True
        if self.shared:  # written at once (its parts wrote theirs)
            tape.dirty = False
            self._later(self._used(tape))

    def _later(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _worker_of(self, tape: Tape) -> int:
        if tape.row.worker >= self.pool.size:  # restarted with fewer workers
            tape.row.worker = self._choose_worker()
            tape.generation = None
        return tape.row.worker

    async def _spec(self, tape: Tape) -> dict[str, Any]:
        """What the worker needs to record the tape again: its stored definition."""
        if tape.kept_spec is not None and not tape.ended:
            kept = tape.kept_spec
            return {
                "definition": kept["definition"],
                "target": kept["target"],
                "sources": tape.row.sources,
                "output": kept.get("output"),
                "shards": kept.get("shards"),
            }
        if tape.ended or tape.row.definition is None:
            raise self._gone(tape.row)
        definition = await asyncio.to_thread(self.store.get_definition, tape.row.definition)
        if definition is None:
            raise ServiceError("internal", f"the stored definition of tape {tape.id} is missing")
        return {
            "definition": definition,
            "target": tape.row.target,
            "sources": tape.row.sources,
            "output": tape.row.output,
        }

    async def update(
        self,
        tape: Tape,
        variables: Mapping[str, np.ndarray],
        inputs: Mapping[str, Any],
        time_limit: float,
        point: np.ndarray | None = None,
        flat: bool = False,
        bare: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        """New values for some variables and inputs (or for every source, as one flat
        `point`): record the tape again (in place, same id); the stored definition changes
        only once the new recording succeeded. A sharded tape updates its parts. An input may be an array or a reference to
        a dataset's array (store.is_ref): a bound input may be rebound or replaced by an
        array of any number of rows. `flat`: answer flat vectors. `bare`: the fields sent
        as bare numbers or lists (read as float64), which take the recorded dtype of any
        kind; a tensor with a dtype keeps to the recorded kind."""
        if tape.shards is not None:
            return await self.sharding.update(
                tape, variables, inputs, time_limit, point, flat, bare
            )
        spec = await self._spec(tape)
        definition = spec["definition"]
        errors = []
        initializers = []  # names only the worker can check: ONNX initializers
        if point is not None:  # split over the sources in the worker, which knows them
            spec["point"] = point
        for section, values in (("variables", variables), ("inputs", inputs)):
            held = definition[section]
            for name, value in values.items():
                field = f"{section}.{name}"
                if name not in held and section == "variables" and definition.get("models"):
                    # Maybe an initializer of an imported model (the worker loads the file,
                    # checks the name, shape and dtype; its frozen flag stays).
                    held[name] = {"value": value, "trainable": True}
                    initializers.append(name)
                    continue
                if name not in held:
                    known = ", ".join(map(repr, held)) or "none"
                    errors.append(
                        {
                            "field": field,
                            "message": f"the tape's definition has no "
                            f"{section[:-1]} {name!r} (it has: {known})",
                        }
                    )
                    continue
                if section == "inputs" and is_ref(value):
                    # Bound to (other rows of) a dataset's array: its shape is the rows
                    # taken, which the worker checks against the program.
                    held[name] = value
                    continue
                if section == "inputs" and is_ref(held[name]):
                    # Sent data replaces a binding: any number of rows, the bound dtype.
                    bound = np.dtype(held[name]["dtype"])
                    cast = _as_recorded(value, bound, field in bare, "the bound array's")
                    if isinstance(cast, str):
                        errors.append({"field": field, "message": cast})
                        continue
                    held[name] = cast
                    continue
                old = held[name]["value"] if section == "variables" else held[name]
                if value.shape != old.shape:
                    errors.append(
                        {
                            "field": field,
                            "message": f"shape {list(value.shape)} "
                            f"differs from the recorded {list(old.shape)}; record a "
                            "new tape to change shapes",
                        }
                    )
                    continue
                if value.dtype != old.dtype:
                    cast = _as_recorded(value, old.dtype, field in bare, "the recorded")
                    if isinstance(cast, str):
                        errors.append({"field": field, "message": cast})
                        continue
                    value = cast
                if section == "variables":
                    held[name] = {**held[name], "value": value}
                else:
                    held[name] = value
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ServiceError(
                "validation", f"{errors[0]['field']}: {errors[0]['message']}{more}", errors=errors
            )
        tape.busy += 1
        try:
            worker = self._worker_of(tape)
            try:
                reply = await self.pool.submit(
                    "tape_create",
                    {"tape_id": tape.id, **spec, "initializers": initializers, "flat": flat},
                    worker=worker,
                    time_limit=time_limit,
                )
            except Cancelled:
                # The worker may hold the new recording while the store keeps the old
                # definition: let it go, so that the next use records the stored one.
                self._drop_later(worker, [tape.id])
                raise
            result: dict[str, Any] = reply.result
            definition = with_applied(definition, result.pop("applied", None))
            digest, version = await asyncio.to_thread(
                self.store.replace_tape_definition, tape.id, definition
            )
        finally:
            tape.busy -= 1
        tape.row.definition = digest
        tape.row.version = version
        tape.stale = False
        tape.row.bytes = int(result.pop("tape")["bytes"])
        result.pop("sources")
        tape.row.device = str(result.pop("device"))
        tape.generation = reply.generation
        tape.row.hits += 1
        tape.row.last_used = time.time()
        tape.dirty = not self.shared
        if self.shared:
            await self._used(tape)
        if tape.ended:
            self._drop_later(worker, [tape.id])
        else:
            await self._enforce_budget(worker, keep=tape)
        return result

    async def delete(self, tape: Tape) -> None:
        await self._end([tape], "deleted")

    # Ending -------------------------------------------------------------------------------
    async def _end(self, tapes: list[Tape], state: str) -> None:
        now = time.time()
        drops: defaultdict[int, list[str]] = defaultdict(list)
        ended = []
        # A sharded tape ends whole: with its parts, and when one of them must go.
        whole = [t.parent if t.parent is not None else t for t in tapes]
        tapes = list(
            {
                id(t): t
                for t in [
                    *whole,
                    *(p for t in whole if t.shards is not None for p in t.shards.parts),
                ]
            }.values()
        )
        for tape in tapes:
            if tape.ended:
                continue
            if tape.shards is None and self.loaded(tape):
                drops[tape.row.worker].append(tape.id)
            tape.row.state = state
            tape.row.ended = now
            self._tapes.pop(tape.id, None)
            ended.append(tape.row)
            if tape.parent is None:
                self.metrics.tape_event(state)
        await asyncio.to_thread(self.store.end_tapes, ended, state, now)
        for worker, ids in drops.items():
            self._drop_later(worker, ids)

    async def _enforce_budget(self, worker: int, keep: Tape) -> None:
        """Evict the worker's least recently used tapes while it holds more than its
        budget (never `keep`, nor a tape with a request in flight)."""
        budget = self.settings.tape_memory_budget
        workers = self.pool.workers()
        held = [
            t
            for t in self._tapes.values()
            if t.row.worker == worker and t.shards is None and self.loaded(t, workers)
        ]
        total = sum(t.row.bytes for t in held)
        if total <= budget:  # the common case, after every request on a tape: no sort
            return
        held.sort(key=lambda t: t.row.last_used)
        victims = []
        for t in held:
            if total <= budget:
                break
            if (
                t is keep
                or t.busy
                or (t.parent is not None and (t.parent is keep.parent or t.parent.busy))
            ):
                continue
            victims.append(t)
            total -= t.row.bytes
        if victims and self.shared:
            # Only this process's copies: the tapes stay live in the store (another
            # process may serve them), and a next use here records them again.
            log.info("worker %d over its tape budget: unloading %d tape(s)", worker, len(victims))
            for victim in victims:
                victim.generation = None
                self.metrics.tape_event("unloaded")
            self._drop_later(worker, [v.id for v in victims])
        elif victims:
            log.info("worker %d over its tape budget: evicting %d tape(s)", worker, len(victims))
            await self._end(victims, "evicted")

    def _drop_later(self, worker: int, tape_ids: list[str]) -> None:
        """Tell the worker to let the recordings go (after what it is doing now)."""
        self.send_later(worker, "tape_drop", {"tape_ids": tape_ids})

    def send_later(self, worker: int, kind: str, payload: dict[str, Any]) -> None:
        """Ask the worker to let something go (a `tape_drop`, a `shard_drop`), after what it
        is doing now, answering no one."""

        async def drop() -> None:
            try:
                await self.pool.submit(
                    kind, payload, worker=worker, time_limit=30.0, queue_bound=False
                )
            except PoolError as exc:  # a worker that is gone has let it go already
                log.debug("%s on worker %d: %s", kind, worker, exc)

        # A context of its own: the drop is not cancelled with the request that caused it.
        task = asyncio.get_running_loop().create_task(drop(), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # Sweeping -----------------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tape_sweep_interval)
            try:
                await self.sweep()
            except Exception:  # the sweeper must survive a bad round
                log.exception("the tape sweep failed")

    async def sweep(self) -> None:
        """Expire tapes past their ttl, save usage, prune old tombstones and collect
        unused definitions."""
        now = time.time()
        if self.shared:
            await self._sweep_shared(now)
        else:
            # The parts of a sharded tape end with it (never on their own clock).
            expired = [
                t
                for t in self._tapes.values()
                if t.expires <= now and not t.busy and t.parent is None
            ]
            if expired:
                await self._end(expired, "expired")
        await self.flush()
        if self.settings.tombstone_ttl:
            await asyncio.to_thread(self.store.prune_tombstones, now - self.settings.tombstone_ttl)
        await asyncio.to_thread(self.store.collect_garbage)

    async def _sweep_shared(self, now: float) -> None:
        """Keep the tapes in use here alive in the store, end those no process used for
        their ttl, and forget this process's copies of tapes ended anywhere."""
        busy = [t.id for t in self._tapes.values() if t.busy]
        await asyncio.to_thread(self.store.keep_alive, busy, now)
        self._forget_rows(await asyncio.to_thread(self.store.expire_tapes, now, self._expiry_grace))
        held = [t for t in self._tapes.values() if t.parent is None]
        states = await asyncio.to_thread(self.store.tape_states, [t.id for t in held])
        for tape in held:
            state = states.get(tape.id, ("deleted", 0))[0]
            if state != "live":
                self._forget(tape, state)

    async def flush(self) -> None:
        dirty = [t for t in self._tapes.values() if t.dirty]
        for t in dirty:
            t.dirty = False
        await asyncio.to_thread(self.store.save_usage, [t.row for t in dirty])


# ----------------------------------------------------------------------------------------
# Stored models
# ----------------------------------------------------------------------------------------


def model_info(row: ModelRow) -> dict[str, Any]:
    return {
        "name": row.name,
        "description": row.description,
        "digest": row.definition,
        "created_at": iso(row.created),
        "updated_at": iso(row.updated),
        **row.info,
    }


class ModelCatalog:
    """Named definitions, per owner, in the store."""

    def __init__(self, settings: Settings, pool: Pool, store: Store):
        self.settings = settings
        self.pool = pool
        self.store = store

    async def put(
        self,
        owner: str,
        name: str,
        definition: dict[str, Any],
        description: str | None,
        replace: bool,
        time_limit: float,
    ) -> tuple[ModelRow, bool]:
        """Check the definition in a worker and store it; (row, created)."""
        existing = await asyncio.to_thread(self.store.get_model, owner, name)
        if existing is not None and not replace:
            raise ServiceError(
                "model-exists",
                f'a model named {name!r} exists already; send "replace": true to replace '
                f"it, or DELETE /v1/models/{name} first",
            )
        if existing is None:
            count = await asyncio.to_thread(self.store.count_models, owner)
            limit = self.settings.max_models_per_key
            if count >= limit:
                raise ServiceError(
                    "quota-exceeded",
                    f"this API key stores {count} model(s); the quota is {limit} "
                    "(max_models_per_key). DELETE models you no longer need",
                    quota="models",
                    limit=limit,
                )
        reply = await self.pool.submit(
            "check_definition", {"definition": definition}, time_limit=time_limit
        )
        row = await asyncio.to_thread(
            self.store.put_model, owner, name, definition, description, reply.result
        )
        if existing is not None:
            await asyncio.to_thread(self.store.collect_garbage)
        return row, existing is None

    async def get(self, owner: str, name: str) -> ModelRow:
        row = await asyncio.to_thread(self.store.get_model, owner, name)
        if row is None:
            raise ServiceError(
                "model-not-found",
                f"no stored model {name!r} (POST /v1/models stores one; GET /v1/models lists "
                "yours)",
            )
        return row

    async def list(self, owner: str) -> list[ModelRow]:
        return await asyncio.to_thread(self.store.list_models, owner)

    async def delete(self, owner: str, name: str) -> None:
        await self.get(owner, name)
        await asyncio.to_thread(self.store.delete_model, owner, name)
        await asyncio.to_thread(self.store.collect_garbage)

    async def put_onnx(
        self, owner: str, name: str, data: bytes, description: str | None, time_limit: float
    ) -> tuple[ModelRow, bool]:
        """Store an ONNX file as a model: a definition with no program whose one imported
        model is the file (checked in a worker: loads, and every node is supported).
        Definitions then call it with {"models": {"net": {"stored": name}}}."""
        definition = {"program": [], "models": {"onnx": {"onnx": data, "frozen": []}}}
        try:
            return await self.put(owner, name, definition, description, True, time_limit)
        except ComputeFailed as exc:
            if exc.error.get("type") != "definition":
                raise
            # The problems name the upload, not the definition's internal `models.onnx`.
            label = f"the uploaded model {name!r}"
            error = dict(exc.error)
            error["message"] = str(error.get("message", "")).replace("models.onnx", label, 1)
            error["problems"] = [
                {**p, "section": label} if p.get("section") == "models.onnx" else p
                for p in error.get("problems") or []
            ]
            raise ComputeFailed(error) from None

    async def onnx_file(self, owner: str, name: str, field: str) -> bytes:
        """The ONNX file of the stored model `name` (422 when it is not an ONNX model)."""
        definition = await self.definition(owner, name)
        files = list((definition.get("models") or {}).values())
        if definition.get("program") or len(files) != 1:
            raise ServiceError(
                "validation",
                f"{field}: the stored model {name!r} is a definition, not an ONNX file (store "
                "one with PUT /v1/models/{name} and Content-Type: application/onnx)",
                errors=[{"field": field, "message": "not an ONNX model"}],
            )
        return files[0]["onnx"]

    async def definition(self, owner: str, name: str) -> dict[str, Any]:
        """The model's definition in the worker form, for a request that names it."""
        row = await self.get(owner, name)
        definition = await asyncio.to_thread(self.store.get_definition, row.definition)
        if definition is None:
            raise ServiceError("internal", f"the stored definition of model {name!r} is missing")
        return definition
