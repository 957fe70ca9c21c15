"""Every resource's router, registered in one place. The /v1 routes take the caller's
API key (when the server requires keys); those that compute or store also pass its
fair-sharing gate, before their body is read (their route class, GatedRoute, does both:
service/api/bodies.py); the operational ones do neither."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from service.api.auth import authenticate
from service.api.routes import (
    datasets,
    derivatives,
    health,
    jobs,
    models,
    ops,
    tapes,
)

api_router = APIRouter()
for module in (derivatives, tapes, models, datasets, ops):
    api_router.include_router(module.router, dependencies=[Depends(authenticate)])
# Following a job uses no worker (and its event stream lasts as long as the job): no slot.
# A job takes its key's slot while it computes (service/domain/jobs.py).
api_router.include_router(jobs.router, dependencies=[Depends(authenticate)])
api_router.include_router(health.router)
