"""The engine workers as Ray actors: the same pool as service/pool/local.py (its queue,
routing, time limits, cancellation, replacement and generations), with each worker a
Ray actor on any node of a Ray cluster instead of a process of this host.

    GRADTAPE_EXECUTOR=ray                      # a local Ray, started with the server
    GRADTAPE_EXECUTOR=ray GRADTAPE_RAY_ADDRESS=auto              # the cluster of this node
    GRADTAPE_EXECUTOR=ray GRADTAPE_RAY_ADDRESS=ray://head:10001  # through Ray Client

What differs from local processes, and why:

- Transport. A request crosses as the msgpack bytes of service/core/ipc.py, and the
  reply comes back as such bytes: Ray pickles only a `bytes` object, never a client's
  data, so the no-pickle rule holds on every wire. Arrays stay inline in those bytes
  (the local pool's shared memory is one host's; Ray's object store moves them). The
  actor runs the worker's own code (compute.start, dispatch.answer) on one engine
  thread of its own.
- Kept answers (a shard's product, for the sum in its coordinator: base.Pool.submit).
  A kept request runs as `run_keep`, which returns two objects: the small reply (ok or
  the error, the tape's bookkeeping), which this process reads, and the answer's bytes,
  which stay in the object store of the actor's node; this process holds only their
  ObjectRef. The request that gathers them passes the refs as arguments of its `run`,
  so Ray moves the bytes from node to node, to the coordinator's, before it runs; they
  never come here (unless smaller than Ray's inline limit, 100 KiB, which Ray returns to
  the caller's memory store by itself). One that cannot be fetched (its node gone) fails
  the gathering request with KEPT_LOST, and the caller asks the parts again.
- Shared fields (the vector asked of every shard: base.Pool.share) are packed and put
  into the object store once, and each request that names them passes their ref as
  its last argument: one copy from this process, whatever the number of parts (Ray's
  object manager serves the nodes' pulls, from any node that holds a copy already).
- Cancellation. Each actor keeps its cancel flag (the id of the request to stop) in its
  own memory; `cancel(id)` sets it from another of the actor's threads, and the running
  request reads it before every engine op. A flag in shared memory would reach only
  actors on this host, and a flag in a separate actor or queue would cost a remote call
  per op; an actor method call reaches the actor wherever Ray placed it, and the check
  stays a plain attribute read.
- Progress. The actor keeps the running request's reports; the pool collects them every
  PROGRESS_POLL seconds while a caller that wants them (a job) waits: plain actor calls,
  the core of Ray's API, rather than a streaming generator.
- Death. Each actor has one call that blocks until the actor stops (`wait_stopped`); it
  raises as soon as Ray sees the actor die, however (SIGKILL, OOM, its node gone), so a
  dead idle actor is replaced at once and a dead busy one gives its request
  WorkerCrashed with Ray's account of why. A request past its time limit gets
  ComputeTimeout and its actor is killed with `ray.kill` and replaced. A replaced actor
  starts a new generation: the tapes it held are recorded again from the store on
  their next use (service/domain/sessions.py), with the same numbers.
- Devices. A GPU worker is an actor with `num_gpus=1` (Ray gives it one GPU, visible
  to it as cuda:0); a CPU worker takes `num_cpus=1` and runs
  `worker_threads` BLAS threads.

The actors import the engine when they start (in their own processes, on their node);
this module, in the HTTP process, imports only Ray and the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from service.core import ipc
from service.core.config import Settings
from service.core.wire import array_bytes
from service.pool.base import (
    KEPT_FIELDS,
    KEPT_LOST,
    ComputeFailed,
    ComputeTimeout,
    PoolError,
    PoolObserver,
    PoolUnavailable,
    WorkerCrashed,
    WorkerStartError,
    kept_reply,
)
from service.pool.local import (
    BLAS_THREAD_VARIABLES,
    QueuedJob,
    WorkerHandle,
    WorkerPool,
    worker_environment,
)

log = logging.getLogger("gradtape.workers")

NAMESPACE = "gradtape"
LOOPBACK = "127.0.0.2"  # the node address of a Ray this server starts (see _connect)
PROGRESS_POLL = 0.1  # seconds between two collections of a running job's progress
MAX_HELD_REPORTS = 256  # progress reports an actor keeps for the next collection
# cancel, progress, wait_stopped and hello beside the one running request
ACTOR_THREADS = 6
# Fields shared by many requests go into the object store from this many bytes: Ray
# inlines smaller objects in its messages (max_direct_call_object_size).
SHARE_MIN_BYTES = 100 * 1024


# ----------------------------------------------------------------------------------------
# The actor (runs in a Ray worker process, on any node)
# ----------------------------------------------------------------------------------------


class EngineActor:
    """One engine worker. Methods run on the actor's threads; the engine runs on one
    thread of its own (`_engine`), so a request always finds the device it started on,
    while cancel and progress calls are served beside it."""

    def __init__(self, index: int, device: str, options: dict[str, Any]):
        self._setup = (index, device, options)
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="gradtape-engine")
        self._context: Any = None
        self._cancel_id = 0  # the id of the request the pool wants stopped
        self._request_id = 0  # the request running, or the last one (its final reports)
        self._reports: deque[dict[str, Any]] = deque(maxlen=MAX_HELD_REPORTS)
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def hello(self) -> bytes:
        """Load the engine for the device and describe the worker (ipc's hello or fatal)."""
        try:
            self._context = self._engine.submit(self._start).result()
        except Exception as exc:  # noqa: BLE001 - any failure to start is reported
            return ipc.pack({"fatal": f"{type(exc).__name__}: {exc}"})
        return ipc.pack(
            {"hello": {**self._context.describe(), "node": ray.get_runtime_context().get_node_id()}}
        )

    def _start(self) -> Any:
        from service.worker import compute  # the engine loads here, in the actor

        return compute.start(*self._setup)

    def run(self, body: bytes, *kept: bytes) -> bytes:
        """Answer one request (ipc bytes in, ipc bytes out). `kept`: the answers the
        request gathers (its "gather" keys, in order), which Ray has fetched to this
        node as the bytes of `run_keep`'s second object."""
        message = self._received(body, kept)
        return self._engine.submit(self._answer, message).result()

    @ray.method(num_returns=2)
    def run_keep(self, body: bytes, *kept: bytes) -> tuple[bytes, bytes]:
        """Answer one request whose answer is kept: (the reply without it, the answer's
        ipc bytes; b"" for an error reply). `kept`: as `run`'s (a merge of kept answers
        is kept in turn)."""
        message = self._received(body, kept)
        return self._engine.submit(self._answer_kept, message).result()

    def _received(self, body: bytes, kept: tuple[bytes, ...]) -> dict[str, Any]:
        """The request, with the objects Ray fetched for it: the answers it gathers (in
        its "gather" order) and, last, the fields it shares with others ("shared")."""
        message: dict[str, Any] = ipc.unpack(body)
        answers = list(kept)
        if message.get("shared"):
            fields = answers.pop()
            message["payload"] = {**message["payload"], **ipc.unpack(fields)}
        if answers:
            keys = message.get("gather") or []
            message["kept"] = {k: ipc.unpack(b) for k, b in zip(keys, answers, strict=True)}
        request_id: int = message.get("id") or 0
        with self._lock:
            self._request_id = request_id
            self._reports.clear()
        return message

    def _reply(self, message: dict[str, Any]) -> dict[str, Any]:
        from service.worker import dispatch

        request_id = message.get("id")
        report = self._report if message.get("progress") else None
        return dispatch.answer(
            self._context, message, cancelled=lambda: self._cancel_id == request_id, report=report
        )

    def _answer(self, message: dict[str, Any]) -> bytes:
        reply = self._reply(message)
        try:
            return ipc.pack(reply)
        except (TypeError, ValueError, OverflowError) as exc:  # a result msgpack cannot carry
            return self._unpackable(reply, exc)

    def _answer_kept(self, message: dict[str, Any]) -> tuple[bytes, bytes]:
        reply = self._reply(message)
        result = reply.get("result")
        if not reply.get("ok") or not isinstance(result, dict) or "stashed" in result:
            return self._answer_of(reply), b""  # an error, or stashed here: nothing kept
        small = {k: result.pop(k) for k in KEPT_FIELDS if k in result}
        try:
            kept = ipc.pack(result)
        except (TypeError, ValueError, OverflowError) as exc:
            return self._unpackable(reply, exc), b""
        # Its arrays' bytes, as the pool counts every hop's (array_bytes).
        return self._answer_of({**reply, "result": small, "kept_bytes": array_bytes(result)}), kept

    def _answer_of(self, reply: dict[str, Any]) -> bytes:
        try:
            return ipc.pack(reply)
        except (TypeError, ValueError, OverflowError) as exc:
            return self._unpackable(reply, exc)

    @staticmethod
    def _unpackable(reply: dict[str, Any], exc: Exception) -> bytes:
        """The error reply for an answer msgpack cannot carry."""
        from service.worker import compute

        error = compute.internal_error(exc)
        return ipc.pack({"id": reply.get("id"), "ok": False, "error": error})

    def _report(self, progress: dict[str, Any]) -> None:
        with self._lock:
            self._reports.append(progress)

    def cancel(self, request_id: int) -> None:
        """Stop request `request_id` at its next op (ignored once another one runs)."""
        self._cancel_id = request_id

    def progress(self, request_id: int) -> bytes:
        """The reports of request `request_id` since the last call, oldest first."""
        with self._lock:
            if request_id != self._request_id:
                return ipc.pack([])
            reports = list(self._reports)
            self._reports.clear()
        return ipc.pack(reports)

    def wait_stopped(self) -> None:
        """Returns when the actor is told to stop; raises in the caller if it dies."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


RemoteEngineActor: Any = ray.remote(EngineActor)


# ----------------------------------------------------------------------------------------
# The pool (the HTTP process)
# ----------------------------------------------------------------------------------------


class _ActorWorker(WorkerHandle):
    """The HTTP side's handle on one actor (replaced actors reuse it)."""

    def __init__(self, index: int, device: str):
        super().__init__(index, device)
        self.actor: Any = None
        self.watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.hello.get("pid") if self.actor is not None else None


@contextmanager
def _without_metrics_directory() -> Iterator[None]:
    """The environment without PROMETHEUS_MULTIPROC_DIR while Ray starts its processes:
    they use prometheus_client too, and would write their series into the directory where
    the HTTP processes sum theirs (service/domain/metrics.py). Ray starts during the
    server's start-up, before this process makes a metric file it has not made yet."""
    saved = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved


def _check_reachable(address: str) -> None:
    """Fail at once when nothing listens at a host:port address: Ray itself would retry
    for minutes before it gives up ('auto' and an empty address need no network)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address in ("", "auto") or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5.0).close()
    except OSError as exc:
        raise WorkerStartError(
            f"cannot start the Ray cluster at {address!r}: nothing answers at {host}:{port} "
            f"({exc.strerror or exc}); is its head node up (`ray start --head`)?"
        ) from None


def _process_gone(pid: Any) -> bool:
    """Whether process `pid` of this host has exited (a zombie until Ray reaps it)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, ValueError, TypeError, IndexError):
        return True


def how_it_died(exc: BaseException) -> str:
    """Ray's account of an actor's death, in one clause."""
    text = " ".join(str(exc).split())
    found = re.search(r"The actor is dead because (.*?)(?:\. |$)", text)
    reason = found.group(1) if found else "it died"
    detail = re.search(r"Worker exit detail: (.*?)(?:\. |$)", text)
    if detail:
        reason += f": {detail.group(1)}"
    return f"its Ray actor died: {reason}"


class RayPool(WorkerPool):
    def __init__(self, settings: Settings, observer: PoolObserver | None = None):
        super().__init__(settings, observer)
        # Requests and replies stay msgpack bytes, arrays inline: an actor may run on any
        # node, where this host's /dev/shm is not (Ray's own object store carries them).
        self._channel = None
        # The device of each actor is settled at start, once the cluster's GPUs are known.
        self._workers = [_ActorWorker(i, d) for i, d in enumerate(settings.worker_devices())]
        self._started_ray = False
        self._node: str | None = None  # the Ray node of this process
        self._shared: dict[str, Any] = {}  # shared fields' ObjectRefs by key (share)

    # Lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Join (or start) Ray, start one actor per worker and wait for each hello."""
        await asyncio.to_thread(self._connect)
        gpus = await asyncio.to_thread(lambda: ray.cluster_resources().get("GPU", 0))
        try:
            self._node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - through Ray Client this process is on no node
            self._node = None
        for w in self._workers:
            w.device = self._device(gpus)
        results = await asyncio.gather(
            *(self._spawn(w) for w in self._workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._started()

    def _connect(self) -> None:
        if ray.is_initialized():  # embedded in a Ray driver that has joined already
            return
        address = self.settings.ray_address
        _check_reachable(address)
        try:
            with _without_metrics_directory():
                self._start_or_join(address)
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; each stops startup
            where = f"the Ray cluster at {address!r}" if address else "a local Ray"
            raise WorkerStartError(f"cannot start {where}: {type(exc).__name__}: {exc}") from None
        self._started_ray = True
        log.info("joined Ray %s (%s)", ray.__version__, address or "started locally")

    def _start_or_join(self, address: str) -> None:
        if address:
            self._join(address)
        else:
            # A new Ray of this host for this server alone ("local": never one that
            # runs here already): one CPU per worker, no dashboard, an object store
            # sized for the requests in flight, and on loopback: Ray swaps 127.0.0.1
            # for the host's reachable address, but keeps any other 127.x address.
            ray.init(
                address="local",
                num_cpus=len(self._workers),
                namespace=NAMESPACE,
                object_store_memory=self.settings.ray_object_store_memory,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                log_to_driver=False,
            )

    @staticmethod
    def _join(address: str) -> None:
        """ray.init of a running cluster. Through Ray Client (ray://), the cluster's proxy
        forks a server for each client, and that fork can die at once (a gRPC fork
        race seen on a loaded machine: "Initialization failure from server", the
        server a zombie): a server of the proxy's failing is tried again, twice, before
        the service refuses to start."""
        for attempt in range(3):
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
                return
            except ConnectionAbortedError as exc:
                if attempt == 2 or "Initialization failure from server" not in str(exc):
                    raise
                log.warning("Ray Client at %s: its server failed to start; again", address)
                ray.shutdown()  # (whatever the failed connection left set up)
                time.sleep(1.0 + attempt)

    def _device(self, cluster_gpus: float) -> str:
        """An actor's device: one of the GPUs Ray gives it, or the CPU."""
        device = self.settings.device
        if device.startswith("cuda") or (device == "auto" and cluster_gpus):
            return "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU
        return "cpu"

    async def close(self) -> None:
        await super().close()
        self._shared.clear()
        if self._started_ray:
            self._started_ray = False
            await asyncio.to_thread(ray.shutdown)

    # The transport ------------------------------------------------------------------------
    def _begin(self, w: WorkerHandle, job: QueuedJob) -> None:
        # An actor's call is awaited (the local pool's socket sends in the caller's turn).
        self._spawn_task(self._execute(w, job))

    async def _execute(self, w: WorkerHandle, job: QueuedJob) -> None:
        if self._dropped_unsent(w, job):
            return
        generation = w.generation
        w.request_id = job.id
        if job.kind != "ping":
            self.observer.request_started(w.index)
        started = w.sent_at = time.perf_counter()
        try:
            # (asyncio.timeout, not wait_for: no task of its own around the round trip)
            async with asyncio.timeout(job.time_limit):
                message = await self._roundtrip(w, job)
        except TimeoutError:
            job.fail(ComputeTimeout(job.time_limit, w.index))
            self._spawn_task(self._replace(w, generation, self._overrun_reason(w, job)))
            return
        except (PoolError, ConnectionError, OSError) as exc:
            # The actor is gone (_roundtrip replaces it), or the call could not be made.
            if not isinstance(exc, PoolError):
                exc = WorkerCrashed(w.index, None)
                self._spawn_task(self._replace(w, generation, "crash"))
            job.fail(exc)
            return
        finally:
            self.observer.worker_busy(w.index, time.perf_counter() - started)
            w.job = None
        w.answered_at = time.perf_counter()
        w.state = "idle"
        self._settle(job, w.index, generation, message, w.reply_array_bytes)
        self._dispatch()

    async def _roundtrip(self, w: WorkerHandle, job: QueuedJob) -> dict[str, Any]:
        assert isinstance(w, _ActorWorker)
        actor, generation = w.actor, w.generation
        kept_ref = None
        try:
            # The ipc bytes packed at submit (and the refs of the answers it gathers).
            if job.keep is not None:
                ref, kept_ref = actor.run_keep.remote(job.outgoing.body, *job.gathered)
            else:
                ref = actor.run.remote(job.outgoing.body, *job.gathered)
            watch = job.watch
            if watch is None or watch.progress is None:
                body = await ref
            else:
                body = await self._with_progress(actor, ref, job)
        except RayActorError as exc:
            if self._closing:
                raise PoolUnavailable("the service is shutting down") from None
            self._spawn_task(self._replace(w, generation, "crash"))
            raise WorkerCrashed(w.index, None, how_it_died(exc)) from None
        except RayError as exc:
            if job.gathered:
                # A kept answer it gathers could not be fetched (lost with its node, or
                # its owner): the caller asks its part again.
                log.warning("worker %d: a kept answer was lost: %s", w.index, exc)
                return {
                    "id": job.id,
                    "ok": False,
                    "error": {
                        "type": KEPT_LOST,
                        "message": "a shard's kept answer was lost before "
                        f"its sum ({type(exc).__name__}); ask again",
                    },
                }
            # The actor's own code raised (dispatch.answer never does): a bug, answered
            # as one (500), and the actor, alive, takes the next request.
            log.error("worker %d: the Ray actor's call failed: %s", w.index, exc)
            return {
                "id": job.id,
                "ok": False,
                "error": {
                    "type": "internal",
                    "message": f"the worker's Ray actor failed: {type(exc).__name__}",
                },
            }
        counted = [0]  # (its arrays' bytes, for the pool's "from_workers" metric)
        reply: dict[str, Any] = ipc.unpack(body, None, counted)
        w.reply_array_bytes = counted[0]
        if kept_ref is not None and "kept_bytes" in reply:
            reply["kept_ref"] = kept_ref  # for _kept_answer, which keeps it (or lets it go)
        return reply

    # Kept answers -------------------------------------------------------------------------
    def _gather(self, message: dict[str, Any], keys: Sequence[str]) -> list[Any]:
        """The kept answers' refs, handed to the actor's `run` with the request (their
        keys in the message, in the same order): Ray moves the bytes, not this process."""
        if not keys:
            return []
        kept = self._take(keys)
        message["gather"] = list(keys)
        self.observer.arrays_moved("between_workers", sum(k.nbytes for k in kept))
        return [k.value for k in kept]

    @property
    def kept_between_workers(self) -> bool:
        return True  # node to node, as object references

    async def share(self, fields: dict[str, Any]) -> str | None:
        """Put the fields into the object store once; None below Ray's inline limit
        (such objects travel inside each request's message anyway)."""
        nbytes = array_bytes(fields)
        if nbytes < SHARE_MIN_BYTES:
            return None
        body = ipc.pack(fields)
        ref = await asyncio.to_thread(ray.put, body)  # a copy into the store: off the loop
        key = secrets.token_urlsafe(12)
        self._shared[key] = ref
        self.observer.arrays_moved("to_workers", nbytes)  # once, whatever the requests
        return key

    def _shared_fields(self, message: dict[str, Any], key: str) -> list[Any]:
        """The shared fields' ref, handed to the actor after the gathered answers."""
        ref = self._shared.get(key)
        if ref is None:
            raise ComputeFailed(
                {"type": KEPT_LOST, "message": f"the shared fields {key} are gone; ask again"}
            )
        message["shared"] = True
        return [ref]

    def release(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        super().release(keys)
        for key in keys:
            self._shared.pop(key, None)

    def _kept_answer(self, job: QueuedJob, message: dict[str, Any]) -> Any:
        """The kept answer's ref, kept; its handle and bookkeeping returned."""
        assert job.keep is not None
        if "kept_ref" not in message:
            return message.get("result")  # its actor stashed it itself: nothing kept
        ref = message.pop("kept_ref")
        self._keep(job.keep, ref, int(message.get("kept_bytes", 0)))
        return kept_reply(job.keep, message.get("result"))

    async def _with_progress(self, actor: Any, ref: Any, job: QueuedJob) -> bytes:
        """The reply of `ref`, handing the request's progress reports to its watch as
        they come (collected every PROGRESS_POLL seconds, and once more at the end)."""
        assert job.watch is not None and job.watch.progress is not None
        answer = asyncio.ensure_future(ref)
        try:
            while True:
                await asyncio.wait([answer], timeout=PROGRESS_POLL)
                reports = ipc.unpack(await actor.progress.remote(job.id))
                for report in reports:
                    if not job.future.done():
                        job.watch.progress(report)
                if answer.done():
                    body: bytes = answer.result()
                    return body
        finally:
            answer.cancel()

    def _signal_cancel(self, w: WorkerHandle, job: QueuedJob) -> None:
        assert isinstance(w, _ActorWorker)
        if w.actor is not None:
            w.actor.cancel.remote(job.id)  # no wait: _enforce_cancel kills it if need be

    def _died_idle(self, w: WorkerHandle) -> bool:
        """Whether an idle actor is known dead: its watch has seen it, or, on this host,
        its process is gone (a moment before Ray tells the watch)."""
        assert isinstance(w, _ActorWorker)
        if w.watch is not None and w.watch.done():
            return True
        return w.hello.get("node") == self._node and _process_gone(w.hello.get("pid"))

    # Actors -------------------------------------------------------------------------------
    def _actor_options(self, device: str) -> dict[str, Any]:
        threads = self.settings.worker_threads or (
            self.settings.blas_threads() if not self.settings.ray_address else 1
        )
        options: dict[str, Any] = {
            "num_cpus": 1,
            "max_concurrency": ACTOR_THREADS,
            "max_restarts": 0,  # the pool replaces a dead actor itself (a new generation)
            "runtime_env": {
                "env_vars": {
                    **{name: str(threads) for name in BLAS_THREAD_VARIABLES},
                    **worker_environment(self.settings),
                }
            },
        }
        if device.startswith("cuda"):
            options["num_gpus"] = 1
        return options

    async def _spawn(self, w: WorkerHandle) -> None:
        """Start an actor for `w` and wait for its hello."""
        assert isinstance(w, _ActorWorker)
        w.state = "starting"
        options = self._actor_options(w.device)
        actor = RemoteEngineActor.options(**options).remote(
            w.index, w.device, self.settings.worker_options()
        )
        w.actor = actor
        try:
            hello = ipc.unpack(
                await asyncio.wait_for(actor.hello.remote(), self.settings.startup_timeout)
            )
        except TimeoutError:
            ray.kill(actor, no_restart=True)
            wanted = {k: options[k] for k in ("num_cpus", "num_gpus") if k in options}
            raise WorkerStartError(
                f"worker {w.index} ({w.device}) did not start within "
                f"{self.settings.startup_timeout:g} s: no node of the Ray cluster had "
                f"{wanted} free"
            ) from None
        except RayActorError as exc:
            raise WorkerStartError(
                f"worker {w.index} ({w.device}) did not start: {how_it_died(exc)}"
            ) from None
        if "fatal" in hello:
            ray.kill(actor, no_restart=True)
            raise WorkerStartError(
                f"worker {w.index} ({w.device}) failed to start: {hello['fatal']}"
            )
        w.hello = hello.get("hello", {})
        w.kernels = w.hello.get("kernels")
        w.generation += 1
        w.answered_at = time.perf_counter()
        w.state = "idle"
        w.watch = asyncio.get_running_loop().create_task(self._watch(w, actor, w.generation))
        log.info(
            "worker %d up: Ray actor pid %s on node %s (%s)",
            w.index,
            w.hello.get("pid"),
            str(w.hello.get("node"))[:12],
            w.device,
        )

    async def _watch(self, w: _ActorWorker, actor: Any, generation: int) -> None:
        """Notice when the actor dies (busy or idle) and replace it."""
        try:
            await actor.wait_stopped.remote()
            return  # stopped on purpose
        except RayActorError as exc:
            how = how_it_died(exc)
        if self._closing or w.generation != generation or w.retired == generation:
            return
        w.state = "down"  # at once: nothing more is dispatched to it
        log.warning("worker %d: %s", w.index, how)
        # A request it was computing learns it from its own call (WorkerCrashed).
        await self._replace(w, generation, "crash")

    async def _stop(self, w: WorkerHandle, graceful: bool) -> None:
        assert isinstance(w, _ActorWorker)
        w.state = "down"
        w.retired = w.generation
        actor, w.actor = w.actor, None
        if actor is not None:
            # Actors keep nothing that needs saving: killed at once, either way.
            ray.kill(actor, no_restart=True)
        if w.watch is not None and w.watch is not asyncio.current_task():
            w.watch.cancel()
        w.watch = None
