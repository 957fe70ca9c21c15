"""The engine workers, as the HTTP process sees them: the `Pool` protocol and its errors
(base.py), the backends that run them as processes of this host (local.py) or as Ray
actors (ray.py), and `make_pool`, which picks the backend the settings name."""

from __future__ import annotations

from service.core.config import Settings
from service.pool.base import (
    KEEP,
    KEPT_LOST,
    SHARED,
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
    "KEEP", "KEPT_LOST", "SHARED", "Cancelled", "ComputeFailed", "ComputeTimeout", "Pool", "PoolBusy", "PoolError",
    "PoolObserver", "PoolUnavailable", "Reply", "WorkerCrashed", "WorkerInfo",
    "WorkerStartError", "describe_exit", "make_pool",
]  # fmt: skip


def make_pool(settings: Settings, observer: PoolObserver | None = None) -> Pool:
    """The pool the settings ask for (`executor`): worker processes of this host, or Ray
    actors. Ray is imported only when asked for: it is an optional extra."""
    if settings.executor == "ray":
        try:
            from service.pool.ray import RayPool
        except ImportError as exc:  # a bad setting for this installation (cli: exit 2)
            raise ValueError(
                f"GRADTAPE_EXECUTOR=ray needs Ray ({exc}): pip install 'gradtape[ray]'"
            ) from None
        return RayPool(settings, observer=observer)
    from service.pool.local import WorkerPool

    return WorkerPool(settings, observer=observer)
