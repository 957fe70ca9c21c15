"""Every resource's router, registered in one place. The /v1 routes take the caller's
API key (when the server requires keys) and pass its fair-sharing gate; the operational
ones do neither."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from service.api.fairness import admit
from service.api.routes import (
    datasets,
    gradient,
    health,
    hessian,
    hvp,
    jacobian,
    models,
    ops,
    tapes,
)
from service.auth import authenticate

api_router = APIRouter()
for module in (gradient, jacobian, hessian, hvp, tapes, models, datasets, ops):
    api_router.include_router(module.router, dependencies=[Depends(authenticate), Depends(admit)])
api_router.include_router(health.router)
