"""Every resource's router, registered in one place."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.routes import gradient, health, hessian, hvp, jacobian, ops

api_router = APIRouter()
for module in (gradient, jacobian, hessian, hvp, ops, health):
    api_router.include_router(module.router)
