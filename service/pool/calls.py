"""Who is waiting for a computation, as the pool sees it (HTTP process only).

A request to the pool runs on behalf of a caller: an HTTP client waiting for its answer,
or a job (service/domain/jobs.py). The caller's `Watch` rides in a context variable, set by
the ASGI middleware for every HTTP request and by the job runner for every job, so that
`WorkerPool.submit` finds it without every route and registry passing it along:

- `gone()`: has the caller stopped waiting (the client disconnected, the job was
  cancelled)? The pool polls it while the request waits or computes, and cancels the
  request when it says so: a queued request leaves the queue, a running one is stopped
  at the worker's next op (its cancel flag), and the worker is free again.
- `progress(report)`: where a running computation's progress reports go (jobs only).
- `started()`: called when a worker takes the request (jobs: queued -> running).

A job needs no `gone`: cancelling it cancels its task, and the pool cancels a request
whose waiting task is cancelled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Watch:
    gone: Callable[[], Awaitable[bool]] | None = None
    progress: Callable[[dict[str, Any]], None] | None = None
    started: Callable[[], None] | None = None
    reason: str = "the client disconnected"


current: ContextVar[Watch | None] = ContextVar("gradtape_call_watch", default=None)
