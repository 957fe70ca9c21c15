"""Prometheus metrics, one registry per app (so several apps in one process, as in
tests, do not collide). Served at GET /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.pool import PoolObserver

if TYPE_CHECKING:
    from service.domain.sessions import TapeRegistry
    from service.pool import Pool

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


class Metrics(PoolObserver):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._children: dict[tuple[Any, ...], Any] = {}  # (see _child)
        self.requests = Counter(
            "gradtape_http_requests",
            "HTTP requests answered",
            ["method", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "gradtape_http_request_duration_seconds",
            "Time to answer an HTTP request",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "gradtape_errors", "Problem responses by problem type", ["type"], registry=r
        )
        self.busy_seconds = Counter(
            "gradtape_worker_busy_seconds",
            "Seconds each worker spent on requests",
            ["worker"],
            registry=r,
        )
        self.started = Counter(
            "gradtape_worker_requests",
            "Requests handed to each worker, readiness pings aside (a request cancelled "
            "while it waited in the queue never is)",
            ["worker"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "gradtape_worker_restarts",
            "Workers replaced, by reason: timeout (past a time limit), cancel (its client left or "
            "its job was cancelled), crash",
            ["worker", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "gradtape_queue_depth", "Requests waiting for a worker", registry=r
        )
        self.workers_busy = Gauge("gradtape_workers_busy", "Workers computing now", registry=r)
        self.workers_up = Gauge(
            "gradtape_workers_up", "Workers started and answering (idle or busy)", registry=r
        )
        self.tape_events = Counter(
            "gradtape_tape_events",
            "Tapes created, rebuilt (after a worker or service restart), expired, evicted, "
            "deleted, unloaded (a shared store's tape dropped from this process's worker)",
            ["event"],
            registry=r,
        )
        self.array_bytes = Counter(
            "gradtape_pool_array_bytes",
            "Bytes of arrays moved to and from the workers through this process, and "
            "between workers without it (a shard's answer handed to its sum)",
            ["route"],
            registry=r,
        )
        self.key_slots_held = Gauge(
            "gradtape_key_slots_held",
            "API keys' slots taken (max_concurrent_per_key): requests computing or reading "
            "their body, jobs computing",
            registry=r,
        )
        self.key_requests_waiting = Gauge(
            "gradtape_key_requests_waiting",
            "Requests waiting in their API key's line for a slot (max_waiting_per_key)",
            registry=r,
        )
        self.tapes = Gauge("gradtape_tapes", "Live tapes", registry=r)
        self.tape_bytes = Gauge(
            "gradtape_tape_bytes", "Bytes of the tapes held in workers now", registry=r
        )

    def bind(self, pool: Pool) -> None:
        """Read the pool's gauges when scraped."""
        self.queue_depth.set_function(lambda: pool.queue_depth)
        self.workers_busy.set_function(lambda: sum(w.state == "busy" for w in pool.workers()))
        self.workers_up.set_function(
            lambda: sum(w.state in ("idle", "busy") for w in pool.workers())
        )

    def bind_fairness(self, slots_held: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the keys' slots and lines (service/api/fairness.py) when scraped."""
        self.key_slots_held.set_function(slots_held)
        self.key_requests_waiting.set_function(waiting)

    def bind_tapes(self, tapes: TapeRegistry) -> None:
        self.tapes.set_function(tapes.count)
        self.tape_bytes.set_function(tapes.total_bytes)

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), remembered: prometheus_client checks the labels and
        takes a lock at every labels() call, six times in every compute request."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # Hooks ------------------------------------------------------------------------------
    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self._child(self.requests, method, route, str(status)).inc()
        self._child(self.latency, method, route).observe(seconds)

    def tape_event(self, event: str) -> None:
        self._child(self.tape_events, event).inc()

    def problem(self, type_: str) -> None:
        self._child(self.errors, type_).inc()

    def worker_busy(self, worker: int, seconds: float) -> None:
        self._child(self.busy_seconds, str(worker)).inc(seconds)

    def request_started(self, worker: int) -> None:
        self._child(self.started, str(worker)).inc()

    def worker_restarted(self, worker: int, reason: str) -> None:
        self._child(self.worker_restarts, str(worker), reason).inc()

    def arrays_moved(self, route: str, nbytes: int) -> None:
        self._child(self.array_bytes, route).inc(nbytes)
