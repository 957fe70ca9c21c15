"""Every resource's router, registered in one place. The /v1 routes take the caller's
API key (when the server requires keys); the operational ones do not."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from service.api.routes import (
    gradient,
    health,
    hessian,
    hvp,
    jacobian,
    jobs,
    models,
    ops,
    tapes,
)
from service.auth import authenticate

api_router = APIRouter()
for module in (gradient, jacobian, hessian, hvp, tapes, jobs, models, ops):
    api_router.include_router(module.router, dependencies=[Depends(authenticate)])
api_router.include_router(health.router)
