"""The pool's interface: what the HTTP process may ask of its engine workers, whatever
runs them. `Pool` is the protocol; service/pool/local.py (worker processes of this host)
and service/pool/ray.py (Ray actors, on one host or a cluster) are its backends.
The failures, the reply and the worker description below are the protocol's too: the
HTTP layer maps each failure to a problem once (service/api/errors.py).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# ----------------------------------------------------------------------------------------
# What can go wrong (the HTTP layer maps each to a problem response)
# ----------------------------------------------------------------------------------------


class PoolError(Exception):
    """Base of the pool's failures."""


class PoolBusy(PoolError):
    """The queue is full, or no worker became free in time."""


class PoolUnavailable(PoolError):
    """The pool is not running (starting up or shutting down)."""


class ComputeTimeout(PoolError):
    def __init__(self, limit: float, worker: int):
        super().__init__(f"worker {worker} ran past the time limit of {limit:g} s")
        self.limit = limit
        self.worker = worker


class WorkerCrashed(PoolError):
    """`how`: what the backend knows of the death (by default the process's exit status;
    a Ray actor on another node has none to read, Ray's own account stands in)."""

    def __init__(self, worker: int, exitcode: int | None, how: str | None = None):
        self.worker = worker
        self.exitcode = exitcode
        self.how = how or describe_exit(exitcode)
        super().__init__(f"worker {worker} stopped unexpectedly ({self.how})")


class ComputeFailed(PoolError):
    """The worker answered with an error: `error` is compute.describe_error's dict
    (type, message, and for definition errors the list of problems)."""

    def __init__(self, error: dict[str, Any]):
        super().__init__(error.get("message", "the computation failed"))
        self.error = error


class WorkerStartError(PoolError):
    pass


class Cancelled(PoolError):
    """The caller stopped waiting (its client disconnected, its job was cancelled)."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass(frozen=True)
class Reply:
    result: Any
    worker: int
    generation: int
    seconds: float  # compute time in the worker


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    pid: int | None
    device: str
    # starting, idle, busy, unresponsive (a ping unanswered past worker_ready_timeout;
    # internally busy with it), down. A worker answering a ping is shown idle: a ping is
    # no work, and it answers in microseconds.
    state: str
    generation: int
    restarts: int
    # Seconds since the worker last sent anything (its hello, an answer, a progress
    # report); None while it is starting or down. A busy worker is silent while it
    # computes, within its request's time limit.
    silent_seconds: float | None = None
    # Its compiled kernels' warm-up (engine/kernels/warmup.py) as of its hello or the
    # pool's last ping: warming, ready, failed (it runs the NumPy paths), off (kernels do
    # not run there), idle (no warm-up asked); None while starting or down, or from a
    # worker that does not say.
    kernels: str | None = None


# ----------------------------------------------------------------------------------------
# Kept answers: one worker's answer handed to a request on another (sharded tapes' sums)
# ----------------------------------------------------------------------------------------

KEEP = "keep"  # the payload key that asks the pool to keep the answer (see Pool.submit)
SHARED = "shared"  # the payload key naming fields the pool holds for many requests (share)
# What of a kept answer still comes back to the caller: the tape's bookkeeping (its size,
# whether it was recorded again), which service/domain/sessions.py reads from every answer.
KEPT_FIELDS = ("tape",)
# The error type of a request that names a kept answer the pool no longer has (released,
# or lost with the node that held it): the caller asks for it again. The same string as a
# coordinator's lost state (service/worker/shards.py), which callers treat alike.
KEPT_LOST = "shard-state-lost"


def kept_reply(key: str, result: Any) -> dict[str, Any]:
    """The small answer a kept request returns: its handle and the KEPT_FIELDS."""
    small: dict[str, Any] = {"stashed": key, "kept": True}
    if isinstance(result, dict):
        small.update({k: result[k] for k in KEPT_FIELDS if k in result})
    return small


class PoolObserver:
    """Hooks for metrics; the default does nothing."""

    def worker_busy(self, worker: int, seconds: float) -> None:
        pass

    def request_started(self, worker: int) -> None:
        """A request was handed to `worker` (its frame sent): one that waited in the
        queue and was cancelled there never counts."""

    def worker_restarted(self, worker: int, reason: str) -> None:
        pass

    def arrays_moved(self, route: str, nbytes: int) -> None:
        """`nbytes` of arrays moved: "to_workers" and "from_workers" (through this
        process), or "between_workers" (a kept answer handed from one worker to another
        without passing through it)."""


class Pool(Protocol):
    """Engine workers that compute requests. A request may be routed to one worker
    (`worker=i`: where a tape lives); `generation` in each Reply and WorkerInfo counts
    that worker's restarts, so a caller can tell that state it left there is gone."""

    async def start(self) -> None:
        """Start every worker; raises WorkerStartError if one cannot start."""

    async def close(self) -> None:
        """Stop the workers; requests still waiting get PoolUnavailable."""

    @property
    def running(self) -> bool: ...

    @property
    def size(self) -> int:
        """How many workers (the valid `worker=` indices are 0..size-1)."""

    @property
    def queue_depth(self) -> int: ...

    def workers(self) -> list[WorkerInfo]: ...

    def hello(self, index: int = 0) -> dict[str, Any]:
        """What worker `index` reported when it started (device, limits, engine)."""

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
        """Run `kind` (a worker handler: service/worker/compute.py or tapes.py) on
        `payload`; raises a PoolError (PoolBusy, PoolUnavailable, ComputeTimeout,
        WorkerCrashed, Cancelled, ComputeFailed with the worker's description of the error).

        Kept answers, for a sum in another worker (service/domain/shards.py): a payload
        (a dict) with `"keep": key` asks that the answer be kept by the pool, not
        returned: the Reply's result is then `{"stashed": key, "kept": True, **its
        KEPT_FIELDS}` (an error is answered as ever; an answer its worker stashed itself,
        `"stash"` in the payload too, comes back as the worker's `{"stashed": key}`,
        not kept again). A later request that names the key in `gather` finds the kept
        answer in its worker's stash under that key (service/worker/shards.py reads
        `{"stashed": key}` there); each is gathered once. Where it waits meanwhile is the
        backend's: Ray's object store on the node that computed it, moved node to node
        (it never comes here); the local pool, this process (its worker's shared memory
        arena). A key the pool no longer has fails the request with KEPT_LOST.

        A backend must honour the caller's watch (service.pool.calls.current()): cancel
        the request when `gone()` says so (out of the queue, or stopped at its worker's
        next op, raising Cancelled), call `started()` when a worker takes it, and pass the
        worker's progress reports to `progress` when the payload asked for them."""

    @property
    def kept_between_workers(self) -> bool:
        """Whether kept answers go from worker to worker without this process (a sum
        is then worth splitting into a tree of merges where the answers are)."""

    async def share(self, fields: dict[str, Any]) -> str | None:
        """Hold payload fields that many requests carry alike (the vector of a product
        asked of every shard): a payload with `"shared": key` is run as if it held them.
        Ray puts them into the object store once (each node fetches them, not one copy per
        request from this process); None where that does not pay (the local pool, whose
        workers read this process's memory anyway; objects Ray would inline): the
        caller then sends the fields with each request. `release(key)` when done."""

    def release(self, keys: Iterable[str]) -> None:
        """Let kept answers (or shared fields) go that no request will need (their
        request failed or was cancelled, or answered); unknown keys are ignored."""

    async def check(self) -> list[WorkerInfo]:
        """Readiness: the workers as the pool last saw them. It sends nothing and changes
        nothing, so a probe polled on a loaded host cannot get a worker replaced: the
        pool's own pings (every worker_ping_interval, idle workers only) keep the states
        current; a ping unanswered past worker_ready_timeout shows its worker
        `unresponsive`, and past worker_liveness_timeout the pool replaces it (reason
        "unresponsive": liveness is the pool's decision, never a probe's)."""
