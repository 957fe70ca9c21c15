"""The engine worker pool: the only service module that starts worker processes.

Each worker is a process of the "spawn" context that owns one device and computes one
request at a time with the engine (service/worker/compute.py). The HTTP process talks to it
over a socket pair in msgpack frames (service/core/ipc.py): client data is never pickled and
the event loop never runs engine code, it only waits on sockets.

    pool = WorkerPool(settings)
    await pool.start()
    reply = await pool.submit("gradient", payload, time_limit=5.0)   # any free worker
    reply = await pool.submit("hvp", payload, worker=reply.worker)   # that worker
    await pool.close()

- Requests wait in one FIFO queue of at most `settings.queue_size` entries (beyond it:
  PoolBusy, a 503). A request routed to a worker (`worker=i`) waits for that worker; the
  others take any request. A free worker takes the oldest request it may serve.
- A request running past its time limit gets ComputeTimeout; its worker is killed and
  replaced. A worker that dies gives its request WorkerCrashed and is replaced.
- A request whose caller stops waiting (calls.Watch: the HTTP client disconnected, the
  job was cancelled) is cancelled: taken out of the queue, or, when it runs, stopped at
  its worker's next op through the worker's cancel flag (a shared integer the worker
  compares with the id of the request it runs), and the caller gets Cancelled at once.
  A worker that does not stop within `cancel_grace` seconds is killed and replaced.
- Liveness, the pool's own (readiness probes only read it: check()): an idle worker that
  has sent nothing for `worker_ping_interval` seconds is pinged; a ping unanswered past
  `worker_ready_timeout` shows the worker `unresponsive` (not ready, nothing done), and
  past `worker_liveness_timeout` (the ping's time limit) the worker is killed and replaced
  (reason "unresponsive"). A busy worker is never pinged: its request's time limit
  governs it. Pings run in no caller's context, so nothing cancels one half-way (a
  cancelled ping would get its worker replaced after cancel_grace).
- A worker may send progress reports of the request it runs (`{"id", "progress"}`,
  when the request asked with `"progress": true`); they go to the caller's Watch.
- Arrays of at least settings.shm_threshold bytes cross through shared memory, not the
  socket (service/core/shm.py): an arena per worker and direction, written at dispatch
  (a queued request holds its arrays, not shared memory); the pool drops a worker's
  arenas when it stops it, sweeps a dead worker's leftovers once it is reaped, its own
  prefix when it closes, and those of dead servers when it starts.
- Each worker keeps a dict of state between requests (compute.WorkerContext.state) for
  requests routed back to it (issue 6's tapes); `generation` counts its restarts, so a
  caller can tell that the state it left there is gone.
- Kept answers (a shard's product for the sum in another worker; base.Pool.submit): this
  pool keeps them here, as they came (views of the worker's reply arena), and sends them
  with the request that gathers them (the message's "kept"). A handoff from worker to
  worker through a segment the gathering worker maps, with only its name passing here,
  was measured and did not pay enough for its lifecycle (bench/RESULTS.md, "Sharded
  tapes"); the Ray pool, whose workers may be nodes apart, keeps them where they were
  computed (service/pool/ray.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import itertools
import logging
import multiprocessing
import os
import socket
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from service.core import ipc, shm
from service.core.config import Settings
from service.core.wire import array_bytes
from service.pool import calls
from service.pool.base import (
    KEEP,
    KEPT_FIELDS,
    KEPT_LOST,
    SHARED,
    Cancelled,
    ComputeFailed,
    ComputeTimeout,
    PoolBusy,
    PoolError,
    PoolObserver,
    PoolUnavailable,
    Reply,
    WorkerCrashed,
    WorkerInfo,
    WorkerStartError,
    describe_exit,
    kept_reply,
)

log = logging.getLogger("gradtape.workers")

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Read by the engine once, at its import (engine/allocator.py's OPT_OUT): a worker imports
# the engine before it hears its options, so worker_tune_allocator travels this way.
ALLOCATOR_VARIABLE = "GRADTAPE_TUNE_ALLOCATOR"


def worker_environment(settings: Settings) -> dict[str, str]:
    """What a worker's environment must say before it imports the engine."""
    return {ALLOCATOR_VARIABLE: "1" if settings.worker_tune_allocator else "0"}


# A kept answer no request gathered (its caller went away without releasing it) is let go
# after this long (the sharded runs' own idle limit, service/worker/shards.py).
KEPT_SECONDS = 600.0


# ----------------------------------------------------------------------------------------
# Pool
# ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Kept:
    """A kept answer: the answer itself (this pool) or where it is (Ray: an ObjectRef)."""

    value: Any
    nbytes: int
    at: float  # time.monotonic() when kept


@dataclass(eq=False)
class QueuedJob:
    id: int
    outgoing: ipc.Outgoing  # the request message, packed once at submit time
    worker: int | None
    time_limit: float
    future: asyncio.Future[Reply]
    started: asyncio.Event = field(default_factory=asyncio.Event)
    watch: calls.Watch | None = None
    running_on: WorkerHandle | None = None  # the worker computing it, once dispatched
    keep: str | None = None  # its answer is kept under this key (Pool.submit)
    gathered: list[Any] = field(default_factory=list)  # kept answers it carries (Ray: refs)
    kind: str = ""  # the worker handler: "ping" (liveness) is not counted as a request
    # What its caller awaits (Pool._wait): woken directly when the job starts or ends, so
    # that the caller resumes in the next loop turn (a done-callback would add one).
    waiter: asyncio.Future[None] | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
        self.started.set()
        self.wake()

    def succeed(self, reply: Reply) -> None:
        if not self.future.done():
            self.future.set_result(reply)
        self.wake()

    def wake(self) -> None:
        _wake(self.waiter)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class WorkerHandle:
    """The HTTP side's handle on one worker process (replaced processes reuse it)."""

    def __init__(self, index: int, device: str):
        self.index = index
        self.device = device
        self.generation = 0  # +1 at each successful start
        self.retired = 0  # the last generation stopped on purpose
        self.restarts = 0
        self.state = "starting"
        self.process: BaseProcess | None = None
        # Its socket (the local pool): frames are read by the protocol as they arrive
        # (ipc.FrameReader) and written on the transport.
        self.writer: asyncio.WriteTransport | None = None
        self.request_id = 0
        self.job: QueuedJob | None = None  # the request it computes now
        self.sent_at = 0.0  # time.perf_counter() when that request was sent
        self.answered_at = 0.0  # time.perf_counter() when it last sent anything
        self.timer: asyncio.TimerHandle | None = None  # its time limit (the local pool)
        self.reply_array_bytes = 0  # the bytes of the arrays of its last reply (as read)
        # The id of a request to stop; the worker compares it with the one it runs, so a
        # late cancel can never stop the next request. Shared memory: the worker reads it
        # before every op while its socket is busy with nothing.
        self.cancel: Any = None
        self.hello: dict[str, Any] = {}
        self.kernels: str | None = None  # its kernels' warm-up (WorkerInfo.kernels)
        # Its process's shared memory (service/core/shm.py): the arena this side writes
        # requests into, and its view of the arena the worker writes replies into.
        self.outbox: shm.Outbox | None = None
        self.inbox: shm.Inbox | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def info(self, ready_timeout: float) -> WorkerInfo:
        """As a caller sees it: a worker answering a ping is idle (it answers in
        microseconds), unless the ping has waited past `ready_timeout`."""
        now = time.perf_counter()
        state = self.state
        if state == "busy" and self.job is not None and self.job.kind == "ping":
            state = "unresponsive" if now - self.sent_at > ready_timeout else "idle"
        up = state not in ("starting", "down")
        silent = round(now - self.answered_at, 3) if up else None
        return WorkerInfo(
            self.index,
            self.pid,
            self.device,
            state,
            self.generation,
            self.restarts,
            silent,
            self.kernels if up else None,
        )


class WorkerPool:
    def __init__(self, settings: Settings, observer: PoolObserver | None = None):
        self.settings = settings
        self.observer = observer or PoolObserver()
        self._ctx = multiprocessing.get_context("spawn")
        self._workers = [WorkerHandle(i, d) for i, d in enumerate(settings.worker_devices())]
        self._queue: deque[QueuedJob] = deque()
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running = False
        self._closing = False
        self._kept: dict[str, _Kept] = {}  # kept answers by key (Pool.submit's keep)
        # The pool's shared memory for large arrays (None: every array goes through the
        # socket); a backend whose workers may be on other hosts sets it to None.
        self._channel: shm.Channel | None = None
        if settings.shm_threshold and shm.available():
            self._channel = shm.Channel.for_new_pool(settings.shm_threshold)

    # Lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker and wait until each has said hello; raise when one cannot
        start (a bad device, a bad definition limit), after stopping the others."""
        threads = str(self.settings.blas_threads())
        for name in BLAS_THREAD_VARIABLES:
            # Inherited by the spawned workers (the HTTP process's NumPy is loaded already).
            if self.settings.worker_threads is not None:
                os.environ[name] = threads
            else:
                os.environ.setdefault(name, threads)
        os.environ.update(worker_environment(self.settings))  # inherited, as the above
        if self._channel is not None:
            # What a server killed outright (SIGKILL, OOM) left in /dev/shm.
            await asyncio.to_thread(shm.sweep_orphans)
        results = await asyncio.gather(
            *(self._spawn(w) for w in self._workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._started()

    def _started(self) -> None:
        """Every worker is up: take requests, and start the liveness pings."""
        self._running = True
        if self.settings.worker_ping_interval > 0:
            # In a context of its own (no caller's Watch), as are the pings it starts.
            task = asyncio.get_running_loop().create_task(
                self._keep_pinging(), context=contextvars.Context()
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop accepting work, fail what waits, and stop every worker."""
        self._closing = True
        self._running = False
        while self._queue:
            self._queue.popleft().fail(PoolUnavailable("the service is shutting down"))
        await asyncio.gather(*(self._stop(w, graceful=True) for w in self._workers))
        for task in list(self._tasks):
            task.cancel()
        self._kept.clear()
        if self._channel is not None:
            # Every worker is gone: whatever arena of this pool is left, nobody reads.
            await asyncio.to_thread(shm.sweep, self._channel.prefix + "-")

    @property
    def running(self) -> bool:
        return self._running

    @property
    def size(self) -> int:
        return len(self._workers)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def workers(self) -> list[WorkerInfo]:
        return [w.info(self.settings.worker_ready_timeout) for w in self._workers]

    def hello(self, index: int = 0) -> dict[str, Any]:
        """What worker `index` reported when it started (device, limits, engine)."""
        return dict(self._workers[index].hello)

    # Submitting ---------------------------------------------------------------------------
    async def submit(
        self,
        kind: str,
        payload: Any,
        *,
        worker: int | None = None,
        time_limit: float | None = None,
        queue_bound: bool = True,
        gather: Sequence[str] = (),
    ) -> Reply:
        """Run `kind` (a handler of service.worker.compute) on `payload` in a worker.

        worker: run on that worker only (None: any). time_limit: compute seconds
        (default: settings.time_limit). Raises PoolBusy, PoolUnavailable, ComputeTimeout,
        WorkerCrashed, or ComputeFailed with the worker's description of the error.
        `keep` in the payload and `gather`: kept answers (base.Pool.submit).
        """
        if not self._running:
            raise PoolUnavailable("the worker pool is not running")
        if worker is not None and not 0 <= worker < len(self._workers):
            raise ValueError(f"no worker {worker}: the pool has {len(self._workers)}")
        loop = asyncio.get_running_loop()
        limit = self.settings.time_limit if time_limit is None else time_limit
        request_id = next(self._ids)
        watch = calls.current.get()
        keep = payload.get(KEEP) if isinstance(payload, dict) else None
        shared = payload.get(SHARED) if isinstance(payload, dict) else None
        if keep is not None or shared is not None:  # the pool's words, not the worker's
            payload = {k: v for k, v in payload.items() if k not in (KEEP, SHARED)}
        # The time limit travels too: the worker refuses what cannot finish within it.
        message: dict[str, Any] = {
            "id": request_id,
            "kind": kind,
            "payload": payload,
            "time_limit": limit,
        }
        if watch is not None and watch.progress is not None:
            message["progress"] = True
        gathered = self._gather(message, gather)
        if shared is not None:
            gathered += self._shared_fields(message, shared)
        # Packed here, so that a payload msgpack cannot carry fails its caller at once.
        outgoing = ipc.prepare(message, self._channel)
        self.observer.arrays_moved("to_workers", outgoing.array_bytes)
        job = QueuedJob(
            request_id,
            outgoing,
            worker,
            limit,
            loop.create_future(),
            watch=watch,
            keep=keep,
            gathered=gathered,
            kind=kind,
        )
        self._queue.append(job)
        self._dispatch()
        if (
            not job.started.is_set()
            and queue_bound
            and len(self._queue) > self.settings.queue_size + self._answering_pings(job)
        ):
            self._queue.remove(job)
            raise PoolBusy(
                f"all {len(self._workers)} workers are busy and {self.settings.queue_size} "
                "requests are already waiting"
            )
        try:
            return await self._wait(job)
        except asyncio.CancelledError:
            self._cancel(job, "the request was abandoned", abandoned=True)
            raise

    async def _wait(self, job: QueuedJob) -> Reply:
        """The job's reply; PoolBusy when it waits in the queue past queue_timeout;
        Cancelled (and the job cancelled) as soon as its caller's watch says gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.queue_timeout
        watch = job.watch
        poll = self.settings.disconnect_poll if watch and watch.gone else None
        while not job.future.done():
            timeout = poll
            if not job.started.is_set():
                left = deadline - loop.time()
                if left <= 0:
                    if job in self._queue:
                        self._queue.remove(job)
                    raise PoolBusy(
                        f"no worker became free within {self.settings.queue_timeout:g} s"
                    )
                timeout = left if poll is None else min(left, poll)
            # Woken by the job's start or end (QueuedJob.wake) or by the timer. The job's
            # own future is not awaited: a cancelled caller must leave it to _cancel.
            job.waiter = waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                job.waiter = None
                if timer is not None:
                    timer.cancel()
            if job.future.done():
                break
            if watch is not None and watch.gone is not None and await watch.gone():
                self._cancel(job, watch.reason)
        return job.future.result()

    # Kept answers ---------------------------------------------------------------------------
    def _gather(self, message: dict[str, Any], keys: Sequence[str]) -> list[Any]:
        """Take the kept answers `keys` for `message` (each is gathered once): here, they
        ride in the message itself, under "kept" (the worker stashes them before it
        answers). What the job must carry besides (Ray: the answers' refs)."""
        if not keys:
            return []
        message["kept"] = {
            key: kept.value for key, kept in zip(keys, self._take(keys), strict=True)
        }
        return []

    def _take(self, keys: Sequence[str]) -> list[_Kept]:
        """The kept answers `keys`, out of the pool; ComputeFailed(KEPT_LOST) when one is
        gone (released, expired, lost with its node), and then none is taken."""
        missing = [key for key in keys if key not in self._kept]
        if missing:
            raise ComputeFailed(
                {
                    "type": KEPT_LOST,
                    "message": f"the kept answer {missing[0]} "
                    "is gone (its worker was replaced, or it waited too long); "
                    "ask again",
                }
            )
        return [self._kept.pop(key) for key in keys]

    def _keep(self, key: str, value: Any, nbytes: int) -> None:
        now = time.monotonic()
        for old in [k for k, kept in self._kept.items() if now - kept.at > KEPT_SECONDS]:
            del self._kept[old]  # its caller went away without releasing it
        self._kept[key] = _Kept(value, nbytes, now)

    def _kept_answer(self, job: QueuedJob, message: dict[str, Any]) -> Any:
        """A kept request's reply: its answer kept here, its handle returned."""
        assert job.keep is not None
        result = message.get("result")
        if isinstance(result, dict) and "stashed" in result:
            return result  # its worker stashed it itself: nothing to keep here
        kept = (
            {k: v for k, v in result.items() if k not in KEPT_FIELDS}
            if isinstance(result, dict)
            else result
        )
        self._keep(job.keep, kept, array_bytes(kept))
        return kept_reply(job.keep, result)

    @property
    def kept_between_workers(self) -> bool:
        return False  # kept here: each hop passes through this process

    async def share(self, fields: dict[str, Any]) -> str | None:
        return None  # each request carries them: its worker reads them from an arena

    def _shared_fields(self, message: dict[str, Any], key: str) -> list[Any]:
        """Where a request's shared fields go (the payload, here); what the job carries
        besides (Ray: their ref)."""
        raise ComputeFailed({"type": KEPT_LOST, "message": f"no shared fields {key}"})

    def release(self, keys: Iterable[str]) -> None:
        """Let kept answers go that no request will gather; unknown keys are ignored."""
        for key in keys:
            self._kept.pop(key, None)

    def _cancel(self, job: QueuedJob, reason: str, abandoned: bool = False) -> None:
        """Stop the job: out of the queue, or at its worker's next op (killed when it
        does not stop within cancel_grace); its caller gets Cancelled (an abandoned
        caller, whose task was cancelled, reads no answer: its future is cancelled)."""
        if job.future.done():
            return
        if job in self._queue:
            self._queue.remove(job)
        w = job.running_on
        if w is not None and w.job is job:
            # Dispatched: its frame is sent (_begin sends none for a job already
            # cancelled), so the worker is told to stop it.
            self._signal_cancel(w, job)
            self._spawn_task(self._enforce_cancel(w, job, w.generation))
            log.info("request %d cancelled on worker %d (%s)", job.id, w.index, reason)
        if abandoned:
            job.future.cancel()
            job.started.set()
        else:
            job.fail(Cancelled(reason))

    def _signal_cancel(self, w: WorkerHandle, job: QueuedJob) -> None:
        """Tell worker `w` to stop `job` at its next op: its shared cancel flag."""
        w.cancel.value = job.id

    async def _enforce_cancel(self, w: WorkerHandle, job: QueuedJob, generation: int) -> None:
        await asyncio.sleep(self.settings.cancel_grace)
        if w.job is job and w.generation == generation:
            log.warning(
                "worker %d did not stop its cancelled request within %g s",
                w.index,
                self.settings.cancel_grace,
            )
            await self._replace(w, generation, "cancel")

    async def check(self) -> list[WorkerInfo]:
        """Readiness (base.Pool.check): the workers' states, sending nothing."""
        return self.workers()

    # Liveness -----------------------------------------------------------------------------
    async def _keep_pinging(self) -> None:
        """Ping each idle worker that has sent nothing for worker_ping_interval: one wake
        per interval at most, a few microseconds of a worker's time per ping, and none at
        all for a worker that answers requests."""
        interval = self.settings.worker_ping_interval
        while self._running:
            now = time.perf_counter()
            wake = now + interval
            for w in self._workers:
                if w.state != "idle":
                    continue  # busy: its request's time limit governs it (or a ping's)
                due = w.answered_at + interval
                if due <= now:
                    self._spawn_task(self._ping(w))
                else:
                    wake = min(wake, due)
            await asyncio.sleep(wake - now)

    async def _ping(self, w: WorkerHandle) -> None:
        """One ping of worker `w`, with worker_liveness_timeout for its time limit: past
        it, _timed_out replaces the worker (reason "unresponsive"). Its answer refreshes
        w.answered_at as any answer does."""
        if w.state != "idle" or not self._running:
            return  # it took a request meanwhile: that answer will do
        try:
            reply = await self.submit(
                "ping",
                None,
                worker=w.index,
                time_limit=self.settings.worker_liveness_timeout,
                queue_bound=False,
            )
        except PoolError:
            return  # unanswered, or the worker died: the pool replaces it either way
        kernels = reply.result.get("kernels") if isinstance(reply.result, dict) else None
        if isinstance(kernels, dict) and reply.generation == w.generation:
            w.kernels = kernels.get("state")

    def _answering_pings(self, job: QueuedJob) -> int:
        """Workers `job` may run on that are busy only with a ping: each is free in
        microseconds, so a request may wait for it beyond the queue's bound (the pool's
        own pings must not turn a request away). A ping unanswered past
        worker_ready_timeout does not count: its worker is unresponsive, not about to be
        free, and requests must not pile up past the queue's bound behind it."""
        fresh_since = time.perf_counter() - self.settings.worker_ready_timeout
        return sum(
            1
            for w in self._workers
            if w.state == "busy"
            and w.job is not None
            and w.job.kind == "ping"
            and w.sent_at >= fresh_since
            and job.worker in (None, w.index)
        )

    # Scheduling ---------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.state != "idle":
                continue
            if self._died_idle(w):
                # Died while idle, and its reader has not noticed yet: no job goes there.
                w.state = "down"
                self._spawn_task(self._replace(w, w.generation, "crash"))
                continue
            job = next((j for j in self._queue if j.worker in (None, w.index)), None)
            if job is None:
                continue
            self._queue.remove(job)
            # Bound to the worker before it is sent: a cancel in between (the `started`
            # callback below) must find the job on its worker, or the worker would
            # compute it for nobody.
            w.state = "busy"
            w.job = job
            job.running_on = w
            job.started.set()
            job.wake()
            if job.watch is not None and job.watch.started is not None:
                job.watch.started()
                # What it does may cancel the job's caller (a job cancelled as it starts),
                # which learns it at its next step: sent after that step, or never.
                asyncio.get_running_loop().call_soon(self._begin, w, job)
            else:
                self._begin(w, job)

    def _died_idle(self, w: WorkerHandle) -> bool:
        return w.process is not None and not w.process.is_alive()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dropped_unsent(self, w: WorkerHandle, job: QueuedJob) -> bool:
        """Whether `job` was cancelled since its dispatch (its `started` callback, or its
        caller before an actor's call began): then it is never sent, and the worker, which
        never saw it, is free at once."""
        if not job.future.done():
            return False
        if w.job is job:
            w.job = None
            if w.state == "busy":
                w.state = "idle"
        self._dispatch()
        return True

    def _begin(self, w: WorkerHandle, job: QueuedJob) -> None:
        """Send `job` to worker `w`, now, in the caller's turn; its reply is handled as it
        arrives (_on_frame -> _finish), its time limit by a timer (_timed_out)."""
        if self._dropped_unsent(w, job):
            return
        assert w.writer is not None
        generation = w.generation
        w.request_id = job.id
        if job.kind != "ping":
            self.observer.request_started(w.index)
        w.sent_at = time.perf_counter()
        held = w.inbox.held() if w.inbox is not None else None
        if held:
            # Arrays of the worker's reply arenas still in use here (the answer to its
            # last request being written, a job's stored answer): not for the next reply.
            ipc.write_message(w.writer, {"id": 0, "kind": ipc.HELD, "payload": held})
        # The worker has answered its previous request (or is new), so nothing reads the
        # request arena now: the large arrays are copied into it here.
        try:
            frames = job.outgoing.frame(w.outbox)
        except ValueError as exc:  # too large for one frame once shared memory refused it
            # Nothing of it was written: answered as the worker's refusal, the worker free
            # at once, not a wait for a reply that never comes.
            error = {"type": "too-large", "message": str(exc)}
            self._finish(w, job, generation, {"ok": False, "error": error}, 0)
            return
        # A worker that went away meanwhile: the transport drops the frame, and the
        # protocol's connection_lost fails the job (_lost).
        w.writer.writelines(frames)
        if job.time_limit is not None:
            w.timer = asyncio.get_running_loop().call_later(
                job.time_limit, self._timed_out, w, job, generation
            )

    def _timed_out(self, w: WorkerHandle, job: QueuedJob, generation: int) -> None:
        if w.job is not job or w.generation != generation:
            return
        w.timer = None
        self.observer.worker_busy(w.index, time.perf_counter() - w.sent_at)
        w.job = None  # the worker stays busy until it is replaced
        job.fail(ComputeTimeout(job.time_limit, w.index))
        self._spawn_task(self._replace(w, generation, self._overrun_reason(w, job)))

    def _overrun_reason(self, w: WorkerHandle, job: QueuedJob) -> str:
        """Why a worker past its job's time limit is replaced: a request that ran too
        long ("timeout"), or a ping it never answered: a hung worker ("unresponsive")."""
        if job.kind != "ping":
            return "timeout"
        log.warning(
            "worker %d did not answer a ping within %g s (worker_liveness_timeout)",
            w.index,
            job.time_limit,
        )
        return "unresponsive"

    def _finish(
        self,
        w: WorkerHandle,
        job: QueuedJob,
        generation: int,
        message: dict[str, Any],
        array_bytes: int,
    ) -> None:
        """The worker answered `job`: it is free, and the job has its outcome."""
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        self.observer.worker_busy(w.index, time.perf_counter() - w.sent_at)
        w.job = None
        w.state = "idle"
        self._settle(job, w.index, generation, message, array_bytes)
        self._dispatch()

    def _settle(
        self,
        job: QueuedJob,
        index: int,
        generation: int,
        message: dict[str, Any],
        array_bytes: int,
    ) -> None:
        """The job's outcome from its worker's reply `message` (any backend); a job
        cancelled or abandoned meanwhile keeps the outcome it has."""
        if message.get("ok"):
            result = message.get("result")
            self.observer.arrays_moved("from_workers", array_bytes)
            if job.keep is not None and not job.future.done():
                result = self._kept_answer(job, message)
            job.succeed(Reply(result, index, generation, message.get("seconds", 0.0)))
        else:
            job.fail(ComputeFailed(message.get("error") or {}))

    # Worker processes ---------------------------------------------------------------------
    async def _spawn(self, w: WorkerHandle) -> None:
        """Start a process for `w` and wait for its hello."""
        w.state = "starting"
        parent_sock, child_sock = socket.socketpair()
        if w.cancel is None:
            w.cancel = self._ctx.RawValue(ctypes.c_int64, 0)
        w.cancel.value = 0
        process = self._ctx.Process(
            target=_run_worker,
            args=(
                child_sock,
                w.index,
                w.device,
                self.settings.worker_options(),
                w.cancel,
                self._channel,
            ),
            name=f"gradtape-worker-{w.index}",
            daemon=True,
        )
        try:
            await asyncio.to_thread(process.start)
        finally:
            child_sock.close()
        w.process = process
        loop = asyncio.get_running_loop()
        hello_future: asyncio.Future[Any] = loop.create_future()

        def hello(body: bytes | memoryview) -> None:
            if not hello_future.done():
                hello_future.set_result(ipc.unpack(body))

        def lost_before_hello(exc: BaseException | None) -> None:
            if not hello_future.done():
                hello_future.set_exception(ipc.FrameError("the worker closed its connection"))

        reader = ipc.FrameReader(hello, lost_before_hello)
        transport, _ = await loop.create_unix_connection(lambda: reader, sock=parent_sock)
        try:
            hello_message = await asyncio.wait_for(hello_future, self.settings.startup_timeout)
        except (TimeoutError, ipc.FrameError) as exc:
            transport.close()
            process.kill()
            exitcode = await self._exitcode(w)
            what = (
                "did not start in time"
                if isinstance(exc, TimeoutError)
                else describe_exit(exitcode)
            )
            raise WorkerStartError(f"worker {w.index} ({w.device}) {what}") from None
        if "fatal" in hello_message:
            transport.close()
            await self._exitcode(w)
            raise WorkerStartError(
                f"worker {w.index} ({w.device}) failed to start: {hello_message['fatal']}"
            )
        w.writer, w.hello = transport, hello_message.get("hello", {})
        w.kernels = w.hello.get("kernels")
        if self._channel is not None:
            w.outbox = shm.Outbox(self._channel, f"a{w.index}")
            w.inbox = shm.Inbox(self._channel)
        w.generation += 1
        w.answered_at = time.perf_counter()
        generation = w.generation
        reader.on_frame = lambda body: self._on_frame(w, generation, body)
        reader.on_lost = lambda exc: self._spawn_task(self._lost(w, generation))
        if transport.is_closing():  # gone between its hello and now
            self._spawn_task(self._lost(w, generation))
        w.state = "idle"
        log.info("worker %d up: pid %s on %s", w.index, process.pid, w.device)

    def _on_frame(self, w: WorkerHandle, generation: int, body: bytes | memoryview) -> None:
        """A message from worker `w`: a progress report to its request's watch, or its
        reply, which finishes the request (in this loop turn)."""
        counted = [0]
        message = ipc.unpack(body, w.inbox, counted)
        if type(message) is not dict:  # a frame, but no message of ours: a broken worker
            raise ipc.FrameError(f"worker {w.index} sent a {type(message).__name__}, not a message")
        if w.generation != generation:
            return  # a replaced worker's last words
        w.answered_at = time.perf_counter()
        if "progress" in message:
            job = w.job
            if (
                job is not None
                and message.get("id") == job.id
                and job.watch is not None
                and job.watch.progress is not None
                and not job.future.done()
            ):
                job.watch.progress(message["progress"])
            return
        if ipc.UNREADABLE in message:  # its arrays could not be mapped here
            message = {
                "id": message["id"],
                "ok": False,
                "error": {
                    "type": "unavailable",
                    "message": f"the worker's answer could not be read: "
                    f"{message[ipc.UNREADABLE]}; retry shortly",
                },
            }
        held = message.pop("held", None)
        if w.outbox is not None:  # request arenas the worker keeps arrays of
            w.outbox.held = set(held or ())
        job = w.job
        if job is not None and message.get("id") == w.request_id:
            self._finish(w, job, generation, message, counted[0])

    async def _lost(self, w: WorkerHandle, generation: int) -> None:
        """Worker `w`'s connection is gone: unless it was stopped on purpose, it died; its
        request gets WorkerCrashed, and it is replaced."""
        if self._closing or w.generation != generation or w.retired == generation:
            return  # stopped on purpose
        w.state = "down"  # at once: nothing more is dispatched to it
        exitcode = await self._exitcode(w)
        log.warning("worker %d %s", w.index, describe_exit(exitcode))
        job = w.job
        if job is not None and w.generation == generation:
            if w.timer is not None:
                w.timer.cancel()
                w.timer = None
            self.observer.worker_busy(w.index, time.perf_counter() - w.sent_at)
            w.job = None
            job.fail(WorkerCrashed(w.index, exitcode))
        await self._replace(w, generation, "crash")

    async def _exitcode(self, w: WorkerHandle) -> int | None:
        process = w.process
        if process is None:
            return None
        await asyncio.to_thread(process.join, 5.0)
        return process.exitcode

    async def _replace(self, w: WorkerHandle, generation: int, reason: str) -> None:
        """Kill worker `w` (if that generation is still running) and start a new one."""
        if w.generation != generation or w.retired == generation or self._closing:
            return
        w.retired = generation
        await self._stop(w, graceful=False)
        w.restarts += 1
        self.observer.worker_restarted(w.index, reason)
        log.warning("replacing worker %d (%s)", w.index, reason)
        delay = 0.5
        while not self._closing:
            try:
                await self._spawn(w)
                break
            except WorkerStartError as exc:
                log.error("%s; retrying in %.1f s", exc, delay)
                w.state = "down"
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        self._dispatch()

    async def _stop(self, w: WorkerHandle, graceful: bool) -> None:
        w.state = "down"
        w.retired = w.generation
        process, writer = w.process, w.writer
        if writer is not None:
            if graceful and process is not None and process.is_alive():
                try:
                    ipc.write_message(writer, {"id": 0, "kind": "shutdown", "payload": None})
                except (ConnectionError, OSError):
                    pass
            writer.close()  # (after sending what it holds); its reader stops at once
        if process is not None:
            if graceful:
                await asyncio.to_thread(process.join, 3.0)
            if process.is_alive():
                process.kill()
            await asyncio.to_thread(process.join, 5.0)
            if self._channel is not None and not process.is_alive():
                # Reaped: it writes nothing more. An arena it had made and not yet
                # sent (killed mid-transfer) is left to no one else.
                await asyncio.to_thread(shm.sweep, f"{self._channel.prefix}-w{process.pid}-")
        job = w.job
        if job is not None:  # the request it was computing is not answered now
            if w.timer is not None:
                w.timer.cancel()
                w.timer = None
            self.observer.worker_busy(w.index, time.perf_counter() - w.sent_at)
            w.job = None
            job.fail(PoolUnavailable("the service is shutting down"))
        w.writer = None
        if w.outbox is not None:
            w.outbox.close()  # unlinked, if the worker died before it mapped it
        w.outbox = w.inbox = None  # arrays from its arena keep their own mapping


def _run_worker(*args: Any) -> None:
    """The worker process's entry point. The worker package (and with it the engine) is
    imported here, in the child: the HTTP process never loads it."""
    from service.worker.main import worker_main

    worker_main(*args)
