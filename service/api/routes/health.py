from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from service.api.auth import api_key_scheme, authenticate, bearer_scheme
from service.api.bodies import BoundedRoute
from service.api.deps import PoolDep
from service.api.openapi import problem_responses
from service.api.problems import ProblemError, problem_response
from service.api.schemas import HealthResponse, ReadinessResponse, WorkerStatus

router = APIRouter(tags=["operations"], route_class=BoundedRoute)


@router.get("/healthz", response_model=HealthResponse, summary="Liveness")
async def check_health() -> HealthResponse:
    """The HTTP process is up (it does not look at the workers: see /readyz)."""
    return HealthResponse(status="ok")


@router.get(
    "/readyz",
    response_model=ReadinessResponse,
    responses=problem_responses(503),
    summary="Readiness",
)
async def check_readiness(request: Request, pool: PoolDep) -> ReadinessResponse | Response:
    """Every worker is up and answering: idle, or busy within its request's time limit.
    503 (with the workers' states) while one is starting, being replaced, or
    `unresponsive` (a ping of the pool's own unanswered past worker_ready_timeout).
    A readiness probe: it sends nothing to the workers and changes nothing, so polling it
    can never get a worker replaced; the pool replaces a hung worker itself
    (worker_liveness_timeout). For liveness, probe /healthz. On a server that requires
    API keys, the workers' process ids are shown only to a caller with a valid key (`pid`
    is null otherwise)."""
    show_pids = await _may_see_processes(request)
    workers = [
        WorkerStatus(**{**asdict(w), "pid": w.pid if show_pids else None})
        for w in await pool.check()
    ]
    if pool.running and all(w.state in ("idle", "busy") for w in workers):
        return ReadinessResponse(status="ready", workers=workers)
    down = [f"{w.index} ({w.state})" for w in workers if w.state not in ("idle", "busy")]
    return problem_response(
        request.scope,
        "not-ready",
        f"worker(s) {', '.join(down) or 'all'} not ready"
        + ("" if pool.running else "; the pool is not running"),
        workers=[w.model_dump() for w in workers],
    )


async def _may_see_processes(request: Request) -> bool:
    keyring = request.app.state.keyring
    if not keyring.enabled:
        return True  # a server without keys trusts every caller alike
    try:
        await authenticate(request, await bearer_scheme(request), await api_key_scheme(request))
    except ProblemError:
        return False
    return True


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        }
    },
)
async def read_metrics(request: Request) -> Response:
    """Requests and latency histograms per route, problem responses by type, worker busy
    seconds and restarts, queue depth, workers up and busy."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
