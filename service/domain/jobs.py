"""Jobs (issue 14, item 2): a long request (eigenvalues, trace, solve, a big jacobian or
Hessian) run in the background of the HTTP process, followed by polling or server-sent
events, cancelled by DELETE. No math here: a job runs the very coroutine the
synchronous route awaits (a pool submit, a tape call), with a calls.Watch of its own
that relays the worker's progress reports and marks it running when a worker takes it.

- A job belongs to the API key that started it (another key's job is a 404), counts
  against `max_jobs_per_key` while queued or running (429 past it), and is forgotten
  `job_ttl` seconds after it ended (then 404, like a job that never was).
- Cancelling (DELETE, or shutdown) cancels the job's task; the pool then cancels its
  request, and the worker stops at its next op (service/pool/local.py).
- A failure keeps the problem body the synchronous request would have answered (a
  worker crash: worker-crashed; the time limit: time-limit): a job never hangs, since
  the pool's time limit bounds every request it runs.
- Jobs live in memory: a restart of the service forgets them (their tapes survive).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from service.core import shm
from service.core.config import Settings
from service.core.errors import ServiceError
from service.core.wire import Encoding
from service.domain.sessions import iso
from service.pool import calls

log = logging.getLogger("gradtape.jobs")

ACTIVE = ("queued", "running")
# What a job runs: the worker's result (a dict with NumPy arrays) and its compute seconds.
Run = Callable[[], Awaitable[tuple[dict[str, Any], float]]]
# Turns an exception into (status, problem body) as the synchronous route answers it.
Explain = Callable[[BaseException], tuple[int, dict[str, Any]]]


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
        }
        self.touch()


class JobRegistry:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._jobs: dict[str, Job] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.ended]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Starting -----------------------------------------------------------------------------
    def start(self, owner: str, operation: str, run: Run, explain: Explain,
              encoding: Encoding, tape_id: str | None = None) -> Job:
        active = sum(1 for j in self._jobs.values() if j.owner == owner and not j.ended)
        limit = self.settings.max_jobs_per_key
        if active >= limit:
            raise ServiceError(
                "quota-exceeded",
                f"this API key has {active} job(s) queued or running; the quota is {limit} "
                "(max_jobs_per_key). Wait for one to end, or cancel one (DELETE "
                "/v1/jobs/{job_id}; GET /v1/jobs lists them)",
                quota="jobs", limit=limit,
            )
        job = Job(secrets.token_urlsafe(18), owner, operation, tape_id, encoding)
        self._jobs[job.id] = job
        # A context of its own: the job outlives the request that started it, and its
        # watch (progress, running) is not the request's (whose client may go at once).
        context = contextvars.Context()
        context.run(calls.current.set, calls.Watch(
            progress=job.on_progress, started=lambda: self._running(job),
            reason="the job was cancelled"))
        job.task = asyncio.get_running_loop().create_task(
            self._run(job, run, explain), context=context)
        return job

    def _running(self, job: Job) -> None:
        if job.state == "queued":
            job.state = "running"
            job.started = time.time()
            job.touch()

    async def _run(self, job: Job, run: Run, explain: Explain) -> None:
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
            # Reports are sent at most every 50 ms: the answer says where it ended.
            if isinstance(result.get("hvps"), int):
                job.progress["done"] = result["hvps"]
            job.progress["seconds"] = seconds
            job.progress["eta"] = 0.0
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
    def get(self, job_id: str, owner: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None or job.owner != owner or self._expired(job, time.time()):
            raise ServiceError(
                "job-not-found",
                f"no job {job_id[:64]!r} (job ids come from a 202 answer's Location; GET "
                f"/v1/jobs lists yours; a job is kept {self.settings.job_ttl:g} s after it "
                "ends)",
            )
        return job

    def list(self, owner: str) -> list[Job]:
        now = time.time()
        return sorted((j for j in self._jobs.values()
                       if j.owner == owner and not self._expired(j, now)),
                      key=lambda j: j.created)

    def cancel(self, job: Job) -> None:
        """Cancel a queued or running job (its worker stops at its next op); forget an
        ended one."""
        if job.ended:
            self._jobs.pop(job.id, None)
            return
        assert job.task is not None
        job.task.cancel()
        # The state changes at once (the task ends at its next step).
        self._end(job, "cancelled")

    def count(self) -> int:
        return len(self._jobs)

    # Expiry -------------------------------------------------------------------------------
    def _expired(self, job: Job, now: float) -> bool:
        return job.finished is not None and job.finished + self.settings.job_ttl <= now

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.settings.tape_sweep_interval, self.settings.job_ttl))
            self.sweep()

    def sweep(self) -> None:
        now = time.time()
        for job in [j for j in self._jobs.values() if self._expired(j, now)]:
            del self._jobs[job.id]


def event(job: Job, ttl: float) -> bytes:
    """One server-sent event: the job document without its result (GET the job or its
    /result for that); the event's name is the state (progress while running)."""
    name = "progress" if job.state == "running" else job.state
    data = orjson.dumps(job.info(ttl, with_result=False), option=orjson.OPT_SERIALIZE_NUMPY)
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (job.version, name.encode(), data)
