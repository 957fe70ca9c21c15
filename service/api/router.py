"""Every resource's router, registered in one place. The /v1 routes take the caller's
API key (when the server requires keys); those that compute or store also pass its
fair-sharing gate, before their body is read (their route class, GatedRoute, does both:
service/api/bodies.py); the operational ones do neither.

GatedRoute authenticates every request of the gated routers before FastAPI sees it, so
their routes declare the two key schemes to the OpenAPI document only (GatedRoute's
`security`), and their owner dependency reads what the gate found: `authenticate` as a
dependency would only repeat the gate's work, at three FastAPI solves per request. The
job routes are not gated: their dependency authenticates."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from service.api.auth import authenticate
from service.api.routes import (
    curvature,
    datasets,
    derivatives,
    health,
    jobs,
    models,
    ops,
    tapes,
)


def include_routers(app: FastAPI) -> None:
    """Include every resource's router in the app itself, not through an aggregating
    router: FastAPI matches a request's path again at each level of included routers
    (twice and more per route before it: ~50 us of a small request at two levels)."""
    for module in (derivatives, tapes, models, datasets, ops, curvature):
        app.include_router(module.router)  # (GatedRoute declares the key schemes)
    # Following a job uses no worker (and its event stream lasts as long as the job): no
    # slot. A job takes its key's slot while it computes (service/domain/jobs.py).
    app.include_router(jobs.router, dependencies=[Depends(authenticate)])
    app.include_router(health.router)
