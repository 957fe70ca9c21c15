"""Prometheus metrics, one registry per app (so several apps in one process, as in
tests, do not collide). Served at GET /metrics.

With several HTTP processes (`gradtape serve --http-workers N`), a scrape reaches one of
them, so each process writes its values where the others read them: prometheus_client's
multiprocess mode (the serve command sets PROMETHEUS_MULTIPROC_DIR before it starts the
processes), and a scrape answers the sum over the processes. Gauges there cannot be read
by a function at scrape time (the other processes' functions are out of reach): each
process copies its readings into them every REFRESH_SECONDS and before answering a
scrape, and the gauges of a process that died are dropped."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from service.core.metric_files import METRIC_FILE, metric_files
from service.pool import PoolObserver

if TYPE_CHECKING:
    from service.domain.sessions import TapeRegistry
    from service.pool import Pool

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


# How often a process of several copies its gauge readings for the others' scrapes.
REFRESH_SECONDS = 1.0
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> Path | None:
    """The directory the processes share, when prometheus_client was imported in
    multiprocess mode (it decides at import, from the environment)."""
    if values.ValueClass is values.MutexValue:
        return None
    return Path(os.environ[MULTIPROCESS_DIR])


def _summed_gauge(name: str, documentation: str, registry: CollectorRegistry) -> Gauge:
    """A gauge whose value over several processes is the sum over the live ones (the
    mode is ignored with one process)."""
    return Gauge(name, documentation, registry=registry, multiprocess_mode="livesum")


class Metrics(PoolObserver):
    def __init__(self) -> None:
        self.shared_dir = multiprocess_dir()
        # (gauge, reading): set_function with one process; copied by refresh() with several
        self._readings: list[tuple[Gauge, Callable[[], float]]] = []
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
            "Requests handed to each worker, the pool's pings aside (a request cancelled "
            "while it waited in the queue never is)",
            ["worker"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "gradtape_worker_restarts",
            "Workers replaced, by reason: timeout (past a time limit), cancel (its client left or "
            "its job was cancelled), crash, unresponsive (an idle worker that did not answer the pool's "
            "ping within worker_liveness_timeout)",
            ["worker", "reason"],
            registry=r,
        )
        self.queue_depth = _summed_gauge("gradtape_queue_depth", "Requests waiting for a worker", r)
        self.workers_busy = _summed_gauge("gradtape_workers_busy", "Workers computing now", r)
        self.workers_up = _summed_gauge(
            "gradtape_workers_up", "Workers started and answering (idle or busy)", r
        )
        self.workers_kernels_failed = _summed_gauge(
            "gradtape_workers_kernels_failed",
            "Workers whose compiled kernels' warm-up failed, as of their start or the pool's last "
            "ping: they answer by the NumPy paths (the same answers, slower; their log says why)",
            r,
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
        self.key_slots_held = _summed_gauge(
            "gradtape_key_slots_held",
            "API keys' slots taken (max_concurrent_per_key): requests computing or reading "
            "their body, jobs computing",
            r,
        )
        self.key_requests_waiting = _summed_gauge(
            "gradtape_key_requests_waiting",
            "Requests waiting in their API key's line for a slot (max_waiting_per_key)",
            r,
        )
        self.tapes = Gauge(
            "gradtape_tapes",
            "Live tapes (with several HTTP processes, which share them: the most any one "
            "process knows of)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.tape_bytes = _summed_gauge(
            "gradtape_tape_bytes", "Bytes of the tapes held in workers now", r
        )

    def _read(self, gauge: Gauge, reading: Callable[[], float]) -> None:
        self._readings = [(g, f) for g, f in self._readings if g is not gauge]
        self._readings.append((gauge, reading))
        if self.shared_dir is None:
            gauge.set_function(reading)

    def bind(self, pool: Pool) -> None:
        """Read the pool's gauges when scraped."""
        self._read(self.queue_depth, lambda: pool.queue_depth)
        self._read(self.workers_busy, lambda: sum(w.state == "busy" for w in pool.workers()))
        self._read(
            self.workers_up, lambda: sum(w.state in ("idle", "busy") for w in pool.workers())
        )
        self._read(
            self.workers_kernels_failed,
            lambda: sum(w.kernels == "failed" for w in pool.workers()),
        )

    def bind_fairness(self, slots_held: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the keys' slots and lines (service/api/fairness.py) when scraped."""
        self._read(self.key_slots_held, slots_held)
        self._read(self.key_requests_waiting, waiting)

    def bind_tapes(self, tapes: TapeRegistry) -> None:
        self._read(self.tapes, tapes.count)
        self._read(self.tape_bytes, tapes.total_bytes)

    # Several processes ----------------------------------------------------------------
    def refresh(self) -> None:
        """Copy this process's readings into the shared gauges (several processes only)."""
        if self.shared_dir is not None:
            for gauge, reading in self._readings:
                gauge.set(reading())

    def exposition(self) -> bytes:
        """The text GET /metrics answers: this registry's, or with several processes
        the sum over the processes (the gauges of those no longer running left out)."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        self.refresh()
        _forget_dead_processes(self.shared_dir)
        merged = CollectorRegistry()
        merged.register(_MetricFiles(self.shared_dir))
        return generate_latest(merged)

    def close(self) -> None:
        """This process stops: its gauges leave the sums (its counters stay)."""
        if self.shared_dir is not None:
            multiprocess.mark_process_dead(os.getpid(), path=str(self.shared_dir))

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


def _forget_dead_processes(directory: Path) -> None:
    """Drop the live gauges of processes that ended without close() (killed, crashed):
    uvicorn starts another in their place, whose gauges would otherwise add to theirs.
    (A dead process's pid taken by a new process keeps its gauges until that one ends.)"""
    for file in metric_files(directory):
        kind, pid = METRIC_FILE.fullmatch(file.name).groups()  # type: ignore[union-attr]
        if not kind.startswith("gauge_live"):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(int(pid), path=str(directory))
        except PermissionError:
            pass  # a process of another user holds the pid: alive, not ours to judge


class _MetricFiles:
    """A collector of the processes' metric files, summed (MultiProcessCollector reads
    every *.db file of the directory, an operator's own and a store included)."""

    def __init__(self, directory: Path):
        self.directory = directory

    def collect(self) -> Any:
        files = [str(f) for f in metric_files(self.directory)]
        return multiprocess.MultiProcessCollector.merge(files, accumulate=True)
