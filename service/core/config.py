"""Service settings: environment variables with the prefix GRADTAPE_ (or flags of
`gradtape serve`), read once by `get_settings()`.

Tests override `get_settings` (FastAPI's settings pattern) or pass a `Settings` to
`create_app`; nothing else reads the environment.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core import defaults

DEFAULT_CPU_WORKERS = 2


def cuda_device_count() -> int:
    """GPUs this host offers to CuPy, found without importing CuPy (or touching CUDA) in
    the HTTP process: 0 when CuPy is not installed."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return len(ids) if ids and ids[0] != "-1" else 0
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _absolute_store(path: str) -> str:
    return path if path == ":memory:" else os.path.abspath(path)


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/gradtape, else ~/.local/share/gradtape."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "gradtape"


class Settings(BaseSettings):
    """Everything an operator can set. Sizes are in bytes or elements, times in seconds."""

    model_config = SettingsConfigDict(env_prefix="GRADTAPE_", extra="ignore", frozen=True)

    # Serving ------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = True
    http_workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="HTTP processes (uvicorn workers) sharing the port; each runs its own "
        "engine workers (or Ray actors on the shared cluster), and all share the store file: "
        "tapes, jobs and rate limits are then read from it (docs/guides/sharding.md: Several HTTP processes)",
    )

    # Workers ------------------------------------------------------------------------------
    device: str = Field(
        default="auto",
        description="'auto' (every GPU when CuPy and a GPU are present, else the CPU), "
        "'cpu', 'cuda' (all GPUs) or 'cuda:N' (one GPU)",
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="engine workers (processes, or Ray actors); default: one per GPU of this "
        "host, else 2",
    )
    worker_threads: int | None = Field(
        default=None, ge=1, description="BLAS threads per CPU worker; default: cores / workers"
    )
    startup_timeout: float = Field(default=120.0, gt=0, description="for a worker to come up")
    executor: Literal["local", "ray"] = Field(
        default="local",
        description="what runs the workers: 'local' (processes of this host) or 'ray' (Ray "
        "actors, on this host or across a Ray cluster; needs the `ray` extra)",
    )
    ray_address: str = Field(
        default="",
        description="with executor 'ray': the cluster to join ('auto': the one this node "
        "belongs to, 'ray://host:10001': through Ray Client); empty: start a Ray of this "
        "host for this server alone",
    )
    ray_object_store_memory: int = Field(
        default=256 * 2**20,
        ge=80 * 2**20,
        description="bytes of the object store of a Ray this server starts itself (the "
        "requests and replies in flight pass through it); a cluster's own is set with "
        "`ray start`",
    )
    shm_threshold: int = Field(
        default=64 * 2**10,
        ge=0,
        description="arrays of at least this many bytes cross between the HTTP process and "
        "a local worker through shared memory (/dev/shm, read in place) instead of the "
        "socket; 0: always the socket (Ray actors always use their own transport)",
    )
    worker_tune_allocator: bool = Field(
        default=defaults.WORKER_TUNE_ALLOCATOR,
        description="raise glibc's mmap/trim thresholds in the workers (the engine's default "
        "at import, engine/allocator.py): freed array memory is reused instead of "
        "page-faulted in again, so repeated requests run faster and a worker's RSS settles "
        "at its working set instead of swinging with each request; off: the workers start "
        "with GRADTAPE_TUNE_ALLOCATOR=0 and memory goes back to the system sooner",
    )

    # Compiled kernels' warm-up (engine/kernels/warmup.py) -----------------------------------
    worker_warm_kernels: bool = Field(
        default=True,
        description="each worker compiles, or loads from numba's disk cache, every compiled "
        "kernel in the background from its start (compilations in a process of their own), "
        "and its requests run the NumPy paths until a kernel is ready: no request waits "
        "for a compilation; off: a kernel compiles at its first use, inside that request",
    )

    # Requests -----------------------------------------------------------------------------
    time_limit: float = Field(default=30.0, gt=0, description="compute seconds per request")
    max_time_limit: float = Field(default=300.0, gt=0, description="most a request may ask for")
    queue_size: int = Field(
        default=64, ge=0, description="requests that may wait for a worker; beyond it 503"
    )
    queue_timeout: float = Field(
        default=60.0, gt=0, description="most seconds a request waits for a worker; then 503"
    )
    retry_after: int = Field(default=1, ge=0, description="Retry-After seconds on a 503")
    max_body_bytes: int = Field(default=64 * 2**20, ge=1, description="request body limit (413)")
    max_onnx_bytes: int = Field(
        default=32 * 2**20,
        ge=1,
        description="largest ONNX file a definition may carry or PUT /v1/models may store (413)",
    )
    max_body_depth: int = Field(
        default=64, ge=8, description="deepest nesting of lists/objects a body may have (400)"
    )
    max_body_containers: int = Field(
        default=200_000,
        ge=100,
        description="most lists and objects in one body, counted off the event loop (422)",
    )
    max_reported_problems: int = Field(
        default=50, ge=1, description="problems listed in one 422; the rest are counted"
    )
    allow_nonfinite: bool = Field(
        default=False, description="default for requests that do not say: accept NaN/Inf inputs"
    )
    cancel_grace: float = Field(
        default=10.0,
        gt=0,
        description="seconds a cancelled request's worker has to stop (at its next op) before "
        "it is killed and replaced",
    )
    disconnect_poll: float = Field(
        default=0.05,
        gt=0,
        description="seconds between checks that a waiting request's client is still connected",
    )

    # Worker health (the pool's pings: readiness reports, liveness replaces) ---------------
    worker_ping_interval: float = Field(
        default=10.0,
        ge=0,
        description="seconds an idle worker may go without answering anything before the "
        "pool pings it (a worker that answers requests is never pinged); 0: no pings, and "
        "an idle worker that hangs is found only by the next request's time limit",
    )
    worker_ready_timeout: float = Field(
        default=5.0,
        gt=0,
        description="a ping unanswered this long shows its worker `unresponsive` in /readyz "
        "(503 not-ready); nothing is done to the worker",
    )
    # (20 s: well under queue_timeout's 60, so a request routed to a hung worker's tapes
    # is served by its replacement instead of a 503 from the queue)
    worker_liveness_timeout: float = Field(
        default=20.0,
        gt=0,
        description="a ping unanswered this long: its worker is deemed hung, killed and "
        "replaced (restart reason `unresponsive`); a busy worker is governed by its "
        "request's time limit instead. Keep it below queue_timeout: requests for a hung "
        "worker's tapes wait for its replacement",
    )

    # Sizes of what a request may ask for -------------------------------------------------
    hessian_max_size: int = Field(
        default=defaults.HESSIAN_MAX_SIZE,
        ge=1,
        description="most parameters (n of the n x n Hessian) of /v1/hessian",
    )
    jacobian_max_elements: int = Field(
        default=defaults.JACOBIAN_MAX_ELEMENTS,
        ge=1,
        description="most elements of all the jacobians of one request",
    )
    chunk_size: int = Field(
        default=defaults.CHUNK_SIZE,
        ge=1,
        description="jacobian rows per backward pass (bounds worker memory)",
    )
    hvp_max_vectors: int = Field(
        default=defaults.HVP_MAX_VECTORS, ge=1, description="most vectors in one /v1/hvp"
    )
    max_shards: int = Field(
        default=64,
        ge=1,
        description="most shards one sharded tape or request may split its batch into",
    )
    request_memory_budget: int = Field(
        default=0,
        ge=0,
        description="bytes one request's recording and derivative passes may use, as the "
        "memory model estimates them from the inferred shapes: batched passes (HVP vectors, "
        "jacobian rows, Hessian rows, trace probes) are split to fit, and what cannot fit "
        "one at a time is a 422; 0: half the tape_memory_budget",
    )
    cost_flops_per_second: float | None = Field(
        default=None,
        ge=0,
        description="the compute-cost guard: a request whose estimated run (contraction "
        "FLOPs, transcendental elements and bytes moved by its passes, over these three "
        "throughputs of a worker) exceeds its time_limit is refused (422) before it runs. "
        "Matmul FLOP/s of one worker (default: this project's CPU measurement, 4e10, on a "
        "CPU worker; none on a GPU one, where the guard is then off); 0 turns the guard off",
    )
    cost_transcendentals_per_second: float | None = Field(
        default=None,
        ge=0,
        description="the compute-cost guard: elements of sin, exp, tanh, ... per second "
        "(default 2.5e8 on a CPU worker); 0 turns the guard off",
    )
    cost_bytes_per_second: float | None = Field(
        default=None,
        ge=0,
        description="the compute-cost guard: bytes elementwise ops read and write per second "
        "(default 1.2e10 on a CPU worker); 0 turns the guard off",
    )
    definition_limits: dict[str, int] = Field(
        default_factory=dict,
        description="overrides of the definition language's limits (max_lines, "
        "max_elements, ...), as JSON; unknown names stop the workers at startup",
    )

    # Tapes (sessions) ---------------------------------------------------------------------
    tape_ttl: float = Field(
        default=3600.0, gt=0, description="seconds a tape lives after its last use (default)"
    )
    tape_max_ttl: float = Field(
        default=86400.0, gt=0, description="most a client may ask for with `ttl`"
    )
    tape_memory_budget: int = Field(
        default=2 * 2**30,
        ge=1,
        description="bytes of tapes one worker holds (device memory on a GPU); beyond it the "
        "least recently used tapes are evicted",
    )
    max_tapes_per_key: int = Field(
        default=100, ge=0, description="live tapes per API key (or in all, without keys)"
    )
    max_tape_bytes_per_key: int = Field(
        default=8 * 2**30, ge=0, description="bytes of live tapes per API key"
    )
    max_models_per_key: int = Field(default=100, ge=0, description="stored models per API key")
    max_datasets_per_key: int = Field(default=100, ge=0, description="stored datasets per API key")
    max_dataset_bytes: int = Field(
        default=1 << 30, ge=1, description="bytes of one dataset's arrays (413 past it)"
    )
    max_dataset_bytes_per_key: int = Field(
        default=4 << 30, ge=1, description="bytes of all of one API key's datasets (413 past it)"
    )
    worker_dataset_memory: int = Field(
        default=defaults.WORKER_DATASET_MEMORY,
        ge=0,
        description="bytes of dataset arrays one worker keeps in memory "
        "(least recently used out first)",
    )
    algorithm_max_hvps: int = Field(
        default=10000,
        ge=1,
        description="most HVPs one eigenvalues/trace/diagonal/spectral-density/solve request "
        "may use",
    )
    lanczos_max_basis_bytes: int = Field(
        default=defaults.LANCZOS_MAX_BASIS_BYTES,
        ge=1,
        description="host memory of an algorithm's stored vectors (x n float64): the Lanczos "
        "basis, the spectral density's bases, the Hutch++ sketch, the power-iteration block",
    )
    tape_sweep_interval: float = Field(
        default=10.0,
        gt=0,
        description="seconds between sweeps that expire tapes and save their usage",
    )
    tombstone_ttl: float = Field(
        default=7 * 86400.0,
        ge=0,
        description="seconds an ended tape's id keeps answering why it is gone",
    )

    # Jobs ---------------------------------------------------------------------------------
    job_ttl: float = Field(
        default=3600.0,
        gt=0,
        description="seconds a finished job (and its answer) is kept for GET /v1/jobs/{id}",
    )
    max_jobs_per_key: int = Field(
        default=8, ge=0, description="queued or running jobs per API key (or in all, without keys)"
    )
    job_time_limit: float = Field(
        default=3600.0,
        gt=0,
        description='compute seconds of a request run as a job ("async": true or Prefer: '
        "respond-async): its own budget, far above time_limit, since nobody holds a "
        "connection open for it; a job's time_limit may ask for less, never more",
    )

    # Storage ------------------------------------------------------------------------------
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="where the store lives (default $XDG_DATA_HOME/gradtape or "
        "~/.local/share/gradtape)",
    )
    store_path: str | None = Field(
        default=None,
        description="the SQLite file of tapes, models and datasets (default "
        "<data_dir>/gradtape.sqlite3; ':memory:' keeps nothing across restarts, and bound "
        "dataset arrays then travel to the workers with each request)",
    )

    # Fair sharing between API keys (off without keys) -------------------------------------
    rate_limit_per_second: float = Field(
        default=100.0,
        ge=0,
        description="requests per second per API key (a token bucket; with several HTTP "
        "processes one bucket in the store, shared by them); 0: no rate limit",
    )
    rate_limit_burst: int = Field(
        default=200, ge=1, description="requests a key may send at once beyond its rate"
    )
    max_concurrent_per_key: int = Field(
        default=0,
        ge=0,
        description="requests of one key computing or queued for a worker at once, per HTTP "
        "process (each has its own workers); 0: the number of workers (a key may fill the "
        "workers, never the queue)",
    )
    max_waiting_per_key: int = Field(
        default=64,
        ge=0,
        description="requests of one key waiting for one of its concurrent slots (per HTTP "
        "process); beyond, 429",
    )

    # API keys -----------------------------------------------------------------------------
    api_keys_enabled: bool = Field(
        default=False, description="require an API key on every /v1 request"
    )
    api_keys: SecretStr = Field(
        default=SecretStr(""), description="the accepted keys, separated by commas or spaces"
    )
    api_keys_file: Path | None = Field(
        default=None, description="a file of accepted keys, one per line (# comments)"
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        value = value.strip().lower()
        kind, _, index = value.partition(":")
        if kind not in ("auto", "cpu", "cuda", "gpu") or (index and not index.isdigit()):
            raise ValueError("device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if kind in ("auto", "cpu") and index:
            raise ValueError(f"device {value!r} takes no index")
        return value.replace("gpu", "cuda")

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.time_limit > self.max_time_limit:
            raise ValueError(
                f"time_limit ({self.time_limit}) is above max_time_limit ({self.max_time_limit})"
            )
        if self.job_time_limit < self.time_limit:
            raise ValueError(
                f"job_time_limit ({self.job_time_limit}) is below time_limit ({self.time_limit})"
            )
        if self.worker_ready_timeout >= self.worker_liveness_timeout:
            raise ValueError(
                f"worker_ready_timeout ({self.worker_ready_timeout}) must be below "
                f"worker_liveness_timeout ({self.worker_liveness_timeout}): a silent worker "
                "is shown unresponsive before it is replaced"
            )
        if self.tape_ttl > self.tape_max_ttl:
            raise ValueError(
                f"tape_ttl ({self.tape_ttl}) is above tape_max_ttl ({self.tape_max_ttl})"
            )
        if self.http_workers > 1 and self.resolved_store_path() == ":memory:":
            raise ValueError(
                f"http_workers = {self.http_workers} needs a store file that the HTTP "
                "processes share, but store_path is ':memory:' (each process would have a "
                "store of its own): set GRADTAPE_STORE_PATH to a file, or GRADTAPE_HTTP_WORKERS=1"
            )
        if self.http_workers > 1 and self.executor == "ray" and not self.ray_address:
            raise ValueError(
                f"http_workers = {self.http_workers} with executor 'ray' needs ray_address: "
                "the HTTP processes join one cluster (start it with `ray start --head` and set "
                "GRADTAPE_RAY_ADDRESS=auto or its address); an empty ray_address would start "
                "one Ray per process"
            )
        return self

    @property
    def shared(self) -> bool:
        """Several HTTP processes share the store: tapes, jobs and rate limits are read
        from it at each use (one process keeps them in its memory)."""
        return self.http_workers > 1

    def resolved_request_memory_budget(self) -> int:
        return self.request_memory_budget or max(1, self.tape_memory_budget // 2)

    def worker_options(self) -> dict[str, Any]:
        """What each worker process is started with (service/worker/compute.start)."""
        return {
            "chunk_size": self.chunk_size,
            "hessian_max_size": self.hessian_max_size,
            "jacobian_max_elements": self.jacobian_max_elements,
            "hvp_max_vectors": self.hvp_max_vectors,
            "memory_budget": self.resolved_request_memory_budget(),
            "lanczos_max_basis_bytes": self.lanczos_max_basis_bytes,
            "tune_allocator": self.worker_tune_allocator,
            "warm_kernels": self.worker_warm_kernels,
            "empty_working_directory": True,  # nothing a relative path could reach
            # the compute-cost guard (None: the device's default); the job form's limit
            "cost_throughput": [
                self.cost_flops_per_second,
                self.cost_transcendentals_per_second,
                self.cost_bytes_per_second,
            ],
            # a job's own budget (issue 27): what the job form of a refused request gets
            "job_time_limit": self.job_time_limit,
            "definition_limits": dict(self.definition_limits),
            # a worker reads the arrays of datasets from the store's file (read-only);
            # absolute, as the worker works in an empty directory of its own
            "store_path": _absolute_store(self.resolved_store_path()),
            "dataset_memory_budget": self.worker_dataset_memory,
        }

    def resolved_store_path(self) -> str:
        if self.store_path:
            return self.store_path
        return str(self.data_dir / "gradtape.sqlite3")

    def load_api_keys(self) -> list[str]:
        """The accepted keys, from api_keys and api_keys_file (read at each call)."""
        keys = self.api_keys.get_secret_value().replace(",", " ").split()
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        return keys

    def worker_devices(self) -> list[str]:
        """One device string per worker process."""
        gpus = cuda_device_count()
        device = self.device
        if device == "auto":
            device = "cuda" if gpus else "cpu"
        if device == "cpu":
            return ["cpu"] * (self.workers or DEFAULT_CPU_WORKERS)
        if device == "cuda":
            if gpus == 0:
                # The workers will say precisely why (no CuPy, no driver) when they start.
                return ["cuda:0"] * (self.workers or 1)
            count = self.workers or gpus
            return [f"cuda:{i % gpus}" for i in range(count)]
        return [device] * (self.workers or 1)

    def blas_threads(self) -> int:
        if self.worker_threads is not None:
            return self.worker_threads
        return max(1, (os.cpu_count() or 1) // len(self.worker_devices()))

    def describe(self) -> dict[str, Any]:
        """The settings as printed at startup (API keys masked: only their count shows)."""
        shown = self.model_dump(mode="json")
        shown["api_keys"] = (
            f"<{len(self.api_keys.get_secret_value().replace(',', ' ').split())} key(s)>"
        )
        shown["worker_devices"] = self.worker_devices()
        shown["store_path"] = self.resolved_store_path()
        return shown


@lru_cache
def get_settings() -> Settings:
    return Settings()
