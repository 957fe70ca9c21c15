"""Jobs (issue 14, item 2): a long request (eigenvalues, trace, solve, a big jacobian or
Hessian) run in the background of the HTTP process, followed by polling or server-sent
events, cancelled by DELETE. No math here: a job runs the very coroutine the
synchronous route awaits (a pool submit, a tape call), with a calls.Watch of its own
that relays the worker's progress reports and marks it running when a worker takes it.

- A job belongs to the API key that started it (another key's job is a 404), counts
  against `max_jobs_per_key` while queued or running (429 past it), and is forgotten
  `job_ttl` seconds after it ended (then 404, like a job that never was).
- Cancelling (DELETE, or shutdown) cancels the job's task; the pool then cancels its
  request, and the worker stops at its next op (service/pool/local.py). Deleting a tape
  cancels its queued and running jobs so (`cancel_tape`), their `error` saying why: a
  job on a deleted tape would hold a worker and a job slot for an answer nobody can use.
- A failure keeps the problem body the synchronous request would have answered (a
  worker crash: worker-crashed; the time limit: time-limit): a job never hangs, since
  the pool's time limit bounds every request it runs.
- Jobs live in memory: a restart of the service forgets them (their tapes survive).
- A job has its own time budget (`job_time_limit`, an hour by default, where a plain
  request has `time_limit`, 30 s): a request's `time_limit` may ask a job for less
  (`time_limit_of`). When it ends, its progress is its answer's own figures
  (`final_progress`): the last event never disagrees with the result.

Several HTTP processes (`http_workers` > 1, settings.shared): a job runs in the process
that started it, which also writes it to the store (state, progress, the answer as
msgpack: service/core/ipc.py) at every change; any other process reads it from there
(GET, /result, the events stream, which polls the row), and cancels it by writing the
row cancelled with a flag, which the running process polls (every CANCEL_POLL s) and
obeys. A job whose process is gone (its pid dead, or silent for PROCESS_SILENT_AFTER
sweeps) reads as failed (job-lost). The quota counts the store's jobs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from service.core import ipc, shm
from service.core.config import Settings
from service.core.errors import ServiceError
from service.core.operations import FinalProgress
from service.core.store import JobRow, Store
from service.core.wire import Encoding
from service.domain.sessions import iso
from service.pool import calls

log = logging.getLogger("gradtape.jobs")

ACTIVE = ("queued", "running")
# What a job runs: the worker's result (a dict with NumPy arrays) and its compute seconds.
Run = Callable[[], Awaitable[tuple[dict[str, Any], float]]]
# Turns an exception into (status, problem body) as the synchronous route answers it.
Explain = Callable[[BaseException], tuple[int, dict[str, Any]]]
# A problem body from (type slug, detail, instance), for a job whose process is gone.
Problem = Callable[[str, str, str], dict[str, Any]]

CANCEL_POLL = 0.2  # seconds between a running job's looks at the store for a cancel
FOLLOW_POLL = 0.1  # seconds between an events stream's looks at another process's job
# Without /proc: sweeps without a heartbeat after which that HTTP process is taken for gone
PROCESS_SILENT_AFTER = 6


def time_limit_of(requested: float | None, as_job: bool, settings: Settings) -> float:
    """A request's compute seconds: what it asked for, else `time_limit`, or for a job
    `job_time_limit`; at most `max_time_limit` (a job: at most `job_time_limit`)."""
    default, most, name = (
        (settings.job_time_limit, settings.job_time_limit, "job_time_limit")
        if as_job
        else (settings.time_limit, settings.max_time_limit, "max_time_limit")
    )
    limit = default if requested is None else requested
    if limit > most:
        raise ServiceError(
            "too-large",
            f"time_limit: {limit:g} s is above this server's {name} of {most:g} s"
            + ("" if as_job else ' (a job, "async": true, may run longer)'),
            errors=[{"field": "time_limit", "message": f"at most {most:g}"}],
        )
    return limit


def _listed(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _exact_share(value: Any, result: dict[str, Any]) -> Any:
    """1.0 once an exact run answered every entry; null for a stochastic method (its
    running figure is no answer); an exact run cut short keeps the share it reported."""
    if result.get("method") != "exact":
        return None
    return 1.0 if value is not None else KEEP


KEEP = object()  # a take's answer: leave the last report's figure
TAKES: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "value": lambda value, _: _listed(value),
    "last": lambda value, _: _listed(value)[-1] if value is not None and len(value) else None,
    "count": lambda value, _: len(value),
    "exact_share": _exact_share,
}


def final_progress(
    progress: dict[str, Any],
    result: dict[str, Any],
    seconds: float,
    declared: FinalProgress | None = None,
) -> None:
    """A finished job's progress, in place: the figures of its answer its operation
    declares (service/core/operations.py, the row's `progress`: the HVPs it took, the
    estimate and its error), never the last report's (sent at most every 50 ms, so it
    may lag the end). Without a declaration (a job outside the table): its time."""
    progress["seconds"] = seconds
    progress["eta"] = 0.0
    if declared is None:
        return
    if declared.done is not None and isinstance(result.get(declared.done), int):
        progress["done"] = result[declared.done]
    for name, figure in (("estimate", declared.estimate), ("error", declared.error)):
        if figure is None:
            continue
        value = TAKES[figure.take](result.get(figure.key), result)
        if value is not KEEP:
            progress[name] = value


@dataclass(eq=False)
class Job:
    id: str
    owner: str
    operation: str
    tape_id: str | None
    encoding: Encoding
    created: float = field(default_factory=time.time)
    state: str = "queued"
    started: float | None = None
    finished: float | None = None
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    seconds: float | None = None  # compute seconds of the answer
    error: dict[str, Any] | None = None
    task: asyncio.Task[None] | None = None
    version: int = 0  # +1 at every change; the events stream sends each
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Several HTTP processes: the job is another process's, read from the store.
    remote: bool = False
    _dirty: bool = False  # a change not yet written to the store
    _writer: asyncio.Task[None] | None = None
    _on_change: Callable[[Job], None] | None = None

    @classmethod
    def from_row(cls, row: JobRow) -> Job:
        job = cls(
            row.id,
            row.owner,
            row.operation,
            row.tape_id,
            Encoding(row.encoding),
            row.created,
            row.state,
            row.started,
            row.finished,
            row.progress,
            None if row.result is None else ipc.unpack(row.result),
            row.seconds,
            row.error,
            version=row.version,
            remote=True,
        )
        return job

    def to_row(self, process: str) -> JobRow:
        result = None if self.result is None else ipc.pack(self.result)
        return JobRow(
            self.id,
            self.owner,
            self.operation,
            self.tape_id,
            str(self.encoding),
            self.created,
            self.state,
            self.started,
            self.finished,
            self.progress,
            result,
            self.seconds,
            self.error,
            process,
            False,
            self.version,
        )

    @property
    def ended(self) -> bool:
        return self.state not in ACTIVE

    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it before reading the state)."""
        return self._changed

    def touch(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        if self._on_change is not None:
            self._on_change(self)

    def elapsed(self) -> float:
        if self.started is None:
            return 0.0
        return (self.finished or time.time()) - self.started

    def info(self, ttl: float, with_result: bool = True) -> dict[str, Any]:
        """The job document (GET /v1/jobs/{id}); tensors of the result stay NumPy
        arrays, written by the route in the request's encoding."""
        return {
            "job_id": self.id,
            "state": self.state,
            "operation": self.operation,
            "tape_id": self.tape_id,
            "created_at": iso(self.created),
            "started_at": iso(self.started) if self.started else None,
            "finished_at": iso(self.finished) if self.finished else None,
            "expires_at": iso(self.finished + ttl) if self.finished else None,
            "elapsed": round(self.elapsed(), 6),
            "progress": self.progress,
            "result": self.result if with_result else None,
            "error": self.error,
        }

    def on_progress(self, report: dict[str, Any]) -> None:
        """A worker's report (compute.WorkerContext.progress) -> the job's progress."""
        done = report.get("hvps", report.get("done", 0))
        total = report.get("max_hvps", report.get("total"))
        seconds = float(report.get("seconds") or 0.0)
        eta = None
        if total is not None and done:
            eta = max(0.0, seconds / done * (total - done))
        limit = report.get("max_seconds")
        if limit is not None:
            left = max(0.0, float(limit) - seconds)
            eta = left if eta is None else min(eta, left)
        self.progress = {
            "done": int(done),
            "total": None if total is None else int(total),
            "unit": str(report.get("unit", "hvps")),
            "estimate": report.get("estimate"),
            "error": report.get("error"),
            "seconds": seconds,
            "eta": eta,
            "max_seconds": None if limit is None else float(limit),
        }
        self.touch()


class JobRegistry:
    def __init__(
        self, settings: Settings, store: Store | None = None, problem: Problem | None = None
    ):
        self.settings = settings
        self._jobs: dict[str, Job] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.shared = settings.shared and store is not None
        self.store = store
        self.problem = problem
        # This HTTP process, as the store's jobs name it (a pid may be reused).
        self.process = secrets.token_urlsafe(12)
        self.pid = os.getpid()
        self.booted = time.time()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def open(self) -> None:
        if self.shared:
            await self._heartbeat()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.ended]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.shared:  # the last writes of the jobs cancelled above, then goodbye
            writers = [j._writer for j in self._jobs.values() if j._writer is not None]
            await asyncio.gather(*writers, return_exceptions=True)
            for task in list(self._tasks):
                task.cancel()
            assert self.store is not None
            await asyncio.to_thread(self.store.forget_process, self.process)

    # Several HTTP processes: the store's copy ---------------------------------------------
    async def _heartbeat(self) -> None:
        assert self.store is not None
        now = time.time()
        self.pid = os.getpid()  # (uvicorn may build the app before it forks)
        ticks = _start_ticks(self.pid)
        started = self.booted if ticks is None else float(ticks)
        await asyncio.to_thread(self.store.heartbeat, self.process, self.pid, started, now)

    def _write(self, job: Job) -> None:
        """The job changed: write it to the store (one writer per job at a time, which
        writes the latest state when it gets its turn: bursts of progress coalesce)."""
        job._dirty = True
        if job._writer is None or job._writer.done():
            job._writer = self._spawn(self._writer_loop(job))

    async def _writer_loop(self, job: Job) -> None:
        assert self.store is not None
        failures = 0
        while job._dirty:
            job._dirty = False
            row = job.to_row(self.process)
            try:
                kept = await asyncio.to_thread(self.store.save_job, row, True)
            except Exception:
                # (A locked or full store.) The state must still land, the last one above
                # all: other processes would read the job as running for ever. Try again,
                # backing off.
                if failures % 10 == 0:
                    log.exception(
                        "could not write job %s... to the store (attempt %d)",
                        job.id[:8],
                        failures + 1,
                    )
                failures += 1
                job._dirty = True
                await asyncio.sleep(min(0.05 * 2**failures, 2.0))
                continue
            failures = 0
            if not kept and not job.ended:
                await self._cancelled_here(job)  # cancelled through another process meanwhile

    async def _watch_cancel(self, job: Job) -> None:
        """Poll the store for a cancel asked through another process."""
        assert self.store is not None
        while not job.ended:
            await asyncio.sleep(CANCEL_POLL)
            found = await asyncio.to_thread(self.store.job_version, job.id)
            if (found is None or found[1]) and not job.ended:
                await self._cancelled_here(job)
                return

    def cancel_here(self, job: Job, why: dict[str, Any] | None = None) -> None:
        """A job of this process cancelled through another one: stop it now (`why`: the
        problem the store's row holds, its tape deleted there)."""
        log.info("job %s... cancelled through another process", job.id[:8])
        self._stop(job, why)

    def _stop(self, job: Job, why: dict[str, Any] | None = None) -> None:
        """Cancel a job of this process: its task is cancelled (the pool cancels its
        request; the worker stops at its next op) and its state changes at once. `why`:
        the problem its `error` holds when it was not its client's cancel."""
        if job.task is not None:
            job.task.cancel()
        if why is not None and not job.ended:
            job.error = why
        self._end(job, "cancelled")

    async def _cancelled_here(self, job: Job) -> None:
        """cancel_here, with the reason the store's row holds."""
        assert self.store is not None
        row = await asyncio.to_thread(self.store.get_job, job.id)
        if not job.ended:
            self.cancel_here(job, None if row is None else row.error)

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle(self, row: JobRow) -> JobRow:
        """Another process's queued or running job, failed if that process is gone."""
        if row.state not in ACTIVE or row.process == self.process:
            return row
        assert self.store is not None
        found = await asyncio.to_thread(self.store.process, row.process)
        if found is not None:
            pid, started, seen = found
            if PROC_STAT:
                # The very process (a reused pid has another start): alive, however long
                # its heartbeats have not reached the store (a store locked for a while
                # must not make a live process's jobs lost).
                if _start_ticks(pid) == started:
                    return row
            else:
                silent = PROCESS_SILENT_AFTER * min(
                    self.settings.tape_sweep_interval, self.settings.job_ttl
                )
                if _alive(pid) and time.time() - seen < silent:
                    return row
        where = f" (pid {found[0]})" if found is not None else ""
        detail = (
            f"the HTTP process{where} that ran job {row.id} exited before the job "
            "ended (killed, or crashed); its work is lost: start the request again"
        )
        error = (
            self.problem("job-lost", detail, f"/v1/jobs/{row.id}")
            if self.problem is not None
            else {"status": 502, "detail": detail}
        )
        await asyncio.to_thread(self.store.fail_orphan_job, row.id, time.time(), error)
        log.info("job %s... failed: its HTTP process%s is gone", row.id[:8], where)
        fresh = await asyncio.to_thread(self.store.get_job, row.id)
        return fresh if fresh is not None else row

    # Starting -----------------------------------------------------------------------------
    async def start(
        self,
        owner: str,
        operation: str,
        run: Run,
        explain: Explain,
        encoding: Encoding,
        tape_id: str | None = None,
        figures: FinalProgress | None = None,
    ) -> Job:
        """Start `run` as a job; `figures`: what its progress takes from its answer when
        it ends (its operation's declaration; None: a job outside the table)."""
        if self.shared:  # every process's jobs
            assert self.store is not None
            active = await asyncio.to_thread(self.store.count_active_jobs, owner)
        else:
            active = sum(1 for j in self._jobs.values() if j.owner == owner and not j.ended)
        limit = self.settings.max_jobs_per_key
        if active >= limit:
            raise ServiceError(
                "quota-exceeded",
                f"this API key has {active} job(s) queued or running; the quota is {limit} "
                "(max_jobs_per_key). Wait for one to end, or cancel one (DELETE "
                "/v1/jobs/{job_id}; GET /v1/jobs lists them)",
                quota="jobs",
                limit=limit,
            )
        job = Job(secrets.token_urlsafe(18), owner, operation, tape_id, encoding)
        self._jobs[job.id] = job
        if self.shared:
            assert self.store is not None
            await asyncio.to_thread(self.store.insert_job, job.to_row(self.process))
            job._on_change = self._write
            if tape_id is not None and await self._tape_deleted(tape_id):
                # Its tape was deleted through another process after this request found
                # it, and that process's cancel_tape looked for the tape's jobs before
                # this one's row was written: it never runs (the row is written first
                # and the tape's state read after, as cancel_tape ends the tape first
                # and reads the jobs after, so one of the two always sees the other).
                job.error = self._tape_deleted_problem(tape_id)
                self._end(job, "cancelled")
                return job
            self._spawn(self._watch_cancel(job))
        # A context of its own: the job outlives the request that started it, and its
        # watch (progress, running) is not the request's (whose client may go at once).
        context = contextvars.Context()
        context.run(
            calls.current.set,
            calls.Watch(
                progress=job.on_progress,
                started=lambda: self._running(job),
                reason="the job was cancelled",
            ),
        )
        job.task = asyncio.get_running_loop().create_task(
            self._run(job, run, explain, figures), context=context
        )
        return job

    def _running(self, job: Job) -> None:
        if job.state == "queued":
            job.state = "running"
            job.started = time.time()
            job.touch()

    async def _run(
        self, job: Job, run: Run, explain: Explain, figures: FinalProgress | None
    ) -> None:
        try:
            result, seconds = await run()
        except asyncio.CancelledError:
            self._end(job, "cancelled")
            return  # the task ends here; nobody awaits it
        except Exception as exc:  # noqa: BLE001 - every failure is the job's state
            status, body = explain(exc)
            job.error = body
            self._end(job, "failed")
            log.info("job %s... failed (%d): %s", job.id[:8], status, body.get("detail"))
            return
        # Kept for job_ttl: out of the worker's shared-memory arena, which it would pin.
        job.result, job.seconds = shm.detached(result), seconds
        if job.progress is not None:
            final_progress(job.progress, result, seconds, figures)
        self._end(job, "succeeded")

    def _end(self, job: Job, state: str) -> None:
        if job.ended:
            return
        if job.started is None:
            job.started = time.time()
        job.finished = time.time()
        job.state = state
        job.touch()

    # Reading ------------------------------------------------------------------------------
    async def get(self, job_id: str, owner: str) -> Job:
        job = self._jobs.get(job_id)
        if job is not None and not job.ended and self.shared:
            # Cancelled through another process a moment ago (before the poll saw it)?
            assert self.store is not None
            found = await asyncio.to_thread(self.store.job_version, job.id)
            if found is not None and found[1] and not job.ended:
                await self._cancelled_here(job)
        if (
            job is not None
            and job.ended
            and self.shared
            and job._writer is not None
            and (job._writer.done())
        ):
            # Ended here, maybe forgotten through another process since (DELETE).
            assert self.store is not None
            if await asyncio.to_thread(self.store.job_version, job.id) is None:
                self._jobs.pop(job.id, None)
                job = None
        if job is None and self.shared and len(job_id) <= 64:
            assert self.store is not None
            row = await asyncio.to_thread(self.store.get_job, job_id)
            if row is not None and row.owner == owner:
                job = Job.from_row(await self._settle(row))
        if job is None or job.owner != owner or self._expired(job, time.time()):
            raise ServiceError(
                "job-not-found",
                f"no job {job_id[:64]!r} (job ids come from a 202 answer's Location; GET "
                f"/v1/jobs lists yours; a job is kept {self.settings.job_ttl:g} s after it "
                "ends)",
            )
        return job

    async def list(self, owner: str) -> list[Job]:
        now = time.time()
        jobs = {j.id: j for j in self._jobs.values() if j.owner == owner}
        if self.shared:  # every process's (this one's from memory: the freshest)
            assert self.store is not None
            rows = await asyncio.to_thread(self.store.list_jobs, owner)
            stored = {row.id for row in rows}
            for job in [
                j
                for j in jobs.values()
                if j.ended and j.id not in stored and j._writer is not None and j._writer.done()
            ]:
                del jobs[job.id]  # forgotten through another process
                self._jobs.pop(job.id, None)
            for row in rows:
                if row.id not in jobs:
                    jobs[row.id] = Job.from_row(await self._settle(row))
        return sorted(
            (j for j in jobs.values() if not self._expired(j, now)), key=lambda j: j.created
        )

    async def updates(self, job: Job, keep_alive: float) -> AsyncIterator[Job | None]:
        """The job now and at each change until it ends (None after `keep_alive` quiet
        seconds). Another process's job: its stored row, polled."""
        sent = -1
        if job.remote:
            assert self.store is not None
            quiet = 0.0
            while True:
                if job.version != sent:
                    sent, quiet = job.version, 0.0
                    yield job
                    if job.ended:
                        return
                await asyncio.sleep(FOLLOW_POLL)
                quiet += FOLLOW_POLL
                if quiet >= keep_alive:
                    quiet = 0.0
                    yield None
                found = await asyncio.to_thread(self.store.job_version, job.id)
                if found is None:
                    return  # forgotten meanwhile
                if found[0] != job.version:
                    row = await asyncio.to_thread(self.store.get_job, job.id)
                    if row is None:
                        return
                    job = Job.from_row(await self._settle(row))
                elif job.state in ACTIVE and quiet == 0.0:
                    # Quiet for a while: its process may be gone.
                    row = await asyncio.to_thread(self.store.get_job, job.id)
                    if row is not None:
                        job = Job.from_row(await self._settle(row))
        while True:
            changed = job.changed()
            if job.version != sent:
                sent = job.version
                yield job
                if job.ended:
                    return
            try:
                await asyncio.wait_for(changed.wait(), keep_alive)
            except TimeoutError:
                yield None

    async def cancel(self, job: Job) -> None:
        """Cancel a queued or running job (its worker stops at its next op); forget one
        that ended by itself (succeeded or failed). A cancelled job is left as it is:
        a cancel sent again (a retry, a second click) keeps it listed as cancelled until
        it expires, as the first left it, instead of making it vanish."""
        if job.state == "cancelled":
            return
        if job.remote:  # another process's: through the store, which that one polls
            assert self.store is not None
            if job.ended:
                await asyncio.to_thread(self.store.delete_job, job.id)
            else:
                await asyncio.to_thread(self.store.cancel_job, job.id, time.time())
            return
        if job.ended:
            self._jobs.pop(job.id, None)
            if self.shared:
                assert self.store is not None
                await asyncio.to_thread(self.store.delete_job, job.id)
            return
        self._stop(job)

    def _tape_deleted_problem(self, tape_id: str) -> dict[str, Any]:
        """A cancelled job's `error` when its tape was deleted."""
        detail = (
            f"tape {tape_id} was deleted while this job was queued or running (DELETE "
            f"/v1/tapes/{tape_id}); it was cancelled and has no answer"
        )
        instance = f"/v1/tapes/{tape_id}"
        if self.problem is None:
            return {"status": 409, "detail": detail, "instance": instance}
        return self.problem("cancelled", detail, instance)

    async def _tape_deleted(self, tape_id: str) -> bool:
        assert self.store is not None
        found = await asyncio.to_thread(self.store.tape_states, [tape_id])
        return tape_id in found and found[tape_id][0] == "deleted"

    async def cancel_tape(self, tape_id: str) -> int:
        """Cancel every queued or running job on a tape that was deleted (call it after
        the tape ended: a job started meanwhile through another process then sees the
        tape gone itself, in `start`), each with an `error` saying so: its worker is freed
        as a cancel frees it. Several HTTP processes: other processes' jobs through the
        store, as `cancel` does. Answers how many were cancelled."""
        why = self._tape_deleted_problem(tape_id)
        cancelled = 0
        # (self._jobs holds this process's jobs only: another's are read, never kept)
        for job in [j for j in self._jobs.values() if j.tape_id == tape_id and not j.ended]:
            self._stop(job, why)
            cancelled += 1
        if self.shared:
            assert self.store is not None
            now = time.time()
            for job_id in await asyncio.to_thread(self.store.active_tape_jobs, tape_id):
                if job_id not in self._jobs:
                    cancelled += await asyncio.to_thread(self.store.cancel_job, job_id, now, why)
        return cancelled

    def count(self) -> int:
        return len(self._jobs)

    # Expiry -------------------------------------------------------------------------------
    def _expired(self, job: Job, now: float) -> bool:
        return job.finished is not None and job.finished + self.settings.job_ttl <= now

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.settings.tape_sweep_interval, self.settings.job_ttl))
            try:
                await self.sweep()
            except Exception:  # the sweeper must survive a bad round
                log.exception("the job sweep failed")

    async def sweep(self) -> None:
        now = time.time()
        for job in [j for j in self._jobs.values() if self._expired(j, now)]:
            del self._jobs[job.id]
        if self.shared:
            assert self.store is not None
            await self._heartbeat()
            await asyncio.to_thread(self.store.prune_jobs, now - self.settings.job_ttl)


PROC_STAT = os.path.exists("/proc/self/stat")


def _start_ticks(pid: int) -> int | None:
    """When the process `pid` started, in clock ticks since boot (/proc/<pid>/stat's 22nd
    field): with the pid, it names one process for good. None: no such live process, or
    no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # (fields after the command, which is in parentheses and may hold spaces)
    fields = stat.rpartition(b")")[2].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped: gone all the same
        return None
    return int(fields[19])


def _alive(pid: int) -> bool:
    """Whether a process of this host has this pid (the HTTP processes share a host:
    they share a SQLite file)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def event(job: Job, ttl: float) -> bytes:
    """One server-sent event: the job document without its result (GET the job or its
    /result for that); the event's name is the state (progress while running)."""
    name = "progress" if job.state == "running" else job.state
    data = orjson.dumps(job.info(ttl, with_result=False), option=orjson.OPT_SERIALIZE_NUMPY)
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (job.version, name.encode(), data)
