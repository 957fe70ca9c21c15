"""The engine workers, as the HTTP process sees them: the `Pool` protocol and its errors
(base.py), the backend that runs them as processes of this host (local.py), and
`make_pool`, which picks the backend the settings name."""

from __future__ import annotations

from service.core.config import Settings
from service.pool.base import (
    Cancelled,
    ComputeFailed,
    ComputeTimeout,
    Pool,
    PoolBusy,
    PoolError,
    PoolObserver,
    PoolUnavailable,
    Reply,
    WorkerCrashed,
    WorkerInfo,
    WorkerStartError,
    describe_exit,
)

__all__ = [
    "Cancelled", "ComputeFailed", "ComputeTimeout", "Pool", "PoolBusy", "PoolError",
    "PoolObserver", "PoolUnavailable", "Reply", "WorkerCrashed", "WorkerInfo",
    "WorkerStartError", "describe_exit", "make_pool",
]  # fmt: skip


def make_pool(settings: Settings, observer: PoolObserver | None = None) -> Pool:
    """The pool the settings ask for: today worker processes of this host."""
    from service.pool.local import WorkerPool

    return WorkerPool(settings, observer=observer)
