"""The FastAPI application: `create_app(settings)` builds it; uvicorn serves it
(`gradtape serve`, or `uvicorn --factory service.api.app:create_app`).

The app validates requests, hands them to the worker pool and writes the answers; the
engine runs only in the pool's worker processes (service/worker/compute.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI

from service.api import docs, errors, openapi, ui
from service.api.auth import KeyRing
from service.api.deps import Services
from service.api.fairness import Fairness
from service.api.middleware import BodyLimitMiddleware, DisconnectMiddleware, MetricsMiddleware
from service.api.problems import job_problem
from service.api.router import include_routers
from service.core.config import Settings, get_settings
from service.core.store import Store
from service.domain.datasets import DatasetCatalog
from service.domain.jobs import JobRegistry
from service.domain.metrics import REFRESH_SECONDS, Metrics
from service.domain.sessions import ModelCatalog, TapeRegistry
from service.pool import Pool, make_pool

log = logging.getLogger("gradtape.service")

DESCRIPTION = """\
Derivatives over HTTP. Send a model/loss **definition** (variables, inputs, program
lines), a **target** and **sources**; get values, gradients, jacobians, Hessians and
Hessian-vector products, computed by a reverse-mode gradient-tape engine in worker
processes.

**Tensors** travel as `{"dtype", "shape", "data"}` (a flat or nested JSON list),
`{"dtype", "shape", "base64"}` (little-endian row-major bytes), or, in a msgpack body
(`Content-Type: application/msgpack`), `{"dtype", "shape", "data": <raw bytes>}`. A bare
number or nested list is float32. Answers use the request's format and tensor encoding
unless `Accept` or `response_encoding` ask otherwise.

**Tapes** keep a recording in a worker: `POST /v1/tapes` records the forward pass and
gradient once; `/v1/tapes/{id}/hvp`, `/gradient`, `/jacobian`, `/eigenvalues`, `/trace`
and `/solve` reuse it. **Jobs**: eigenvalues, trace, solve, jacobians and Hessians run in
the background with `"async": true` or `Prefer: respond-async` (202, `Location:
/v1/jobs/{id}`): progress, server-sent events, cancel. **Models** stored with `POST /v1/models` can be named
(`"model": name`) instead of sending a definition.

**API keys** (when the server requires them): `Authorization: Bearer <key>` or
`X-API-Key: <key>`; tapes and models are visible only to the key that made them.

**Errors** are `application/problem+json` (RFC 9457); `detail` names the field, or the
program line, column, op and shapes, and `errors` lists every problem found.
"""


def _version() -> str:
    try:
        return version("gradtape")
    except PackageNotFoundError:
        return "0.0.0"


def _ensure_logging(level: str) -> None:
    logger = logging.getLogger("gradtape")
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)


def _reload_keys_on_sighup(keyring: KeyRing) -> None:
    """`kill -HUP` reads the API keys file again (it is also read when it changes)."""
    try:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, lambda: keyring.reload(force=True)
        )
    except (NotImplementedError, RuntimeError, AttributeError):  # no SIGHUP (Windows), or
        pass  # not the main thread (a test's in-process app): the file check still works


def _freeze_startup_objects() -> None:
    """What the app made at startup (the routes, the schemas, the modules: ~100,000
    objects) out of the garbage collector's sight until shutdown: a full collection
    walked them all again every few thousand requests, 0.1 s each time on a small
    machine (a pause for the requests in flight, ~40 us a request on average). The
    garbage of before is collected first; gc.unfreeze() at shutdown hands them back
    (another app in the same process, as in tests, keeps collecting normally)."""
    gc.collect()
    gc.freeze()


async def _refresh_metrics(metrics: Metrics) -> None:
    """With several HTTP processes: this one's gauge readings, copied where the process
    answering a scrape reads them (service/domain/metrics.py)."""
    while True:
        metrics.refresh()
        await asyncio.sleep(REFRESH_SECONDS)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _ensure_logging(settings.log_level)
        log.info("settings: %s", json.dumps(settings.describe()))
        pool: Pool = app.state.pool
        store: Store = app.state.store
        tapes: TapeRegistry = app.state.tapes
        jobs: JobRegistry = app.state.jobs
        await asyncio.to_thread(store.open)
        _reload_keys_on_sighup(app.state.keyring)
        try:
            await pool.start()
            metrics.bind(pool)
            log.info(
                "%d worker(s) ready; limits: %s; store: %s",
                pool.size,
                json.dumps(pool.hello(0).get("definition_limits")),
                store.path,
            )
            await tapes.open()
            await jobs.open()
            _freeze_startup_objects()
            refresher = (
                asyncio.create_task(_refresh_metrics(metrics), name="metrics refresh")
                if metrics.shared_dir is not None
                else None
            )
            try:
                yield
            finally:
                gc.unfreeze()
                if refresher is not None:
                    refresher.cancel()
                await jobs.close()
                await tapes.close()
                await pool.close()
        finally:
            metrics.close()
            store.close()

    app = FastAPI(
        title="gradtape",
        version=_version(),
        summary="Gradients, jacobians, Hessians and HVPs of a model definition, over HTTP",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=openapi.operation_id,
        separate_input_output_schemas=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.pool = pool = make_pool(settings, observer=metrics)
    app.state.keyring = KeyRing(settings)  # ValueError when keys are on but none is set
    app.state.store = store = Store(settings.resolved_store_path())
    app.state.fairness = fairness = Fairness(settings, pool.size, store)
    metrics.bind_fairness(fairness.slots_held, fairness.waiting)
    app.state.tapes = TapeRegistry(settings, pool, store, metrics)
    app.state.models = ModelCatalog(settings, pool, store)
    app.state.jobs = JobRegistry(settings, store, job_problem)
    app.state.datasets = DatasetCatalog(settings, store)
    app.state.services = Services(
        settings, pool, app.state.tapes, app.state.models, app.state.datasets
    )
    errors.install(app)
    docs.install(app)
    ui.install(app)  # the page at /ui
    openapi.install(app)
    include_routers(app)
    app.add_middleware(DisconnectMiddleware)  # innermost: the routes see its watch
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees every answer
    return app
