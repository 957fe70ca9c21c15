"""Dependencies shared by the routes, as Annotated aliases (the FastAPI template's
`SessionDep` pattern): the settings, the worker pool, the negotiated body formats.

They are `async def` on purpose: FastAPI runs a plain `def` dependency in a thread,
which costs more than the whole lookup. The settings are the app's (`create_app`
takes them, by default from the lru_cached `get_settings`); a test overrides
`app_settings` to change them for one app.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.negotiation import Negotiated, negotiate
from service.core.config import Settings
from service.workers import WorkerPool


async def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_pool(request: Request) -> WorkerPool:
    pool: WorkerPool = request.app.state.pool
    return pool


SettingsDep = Annotated[Settings, Depends(app_settings)]
PoolDep = Annotated[WorkerPool, Depends(get_pool)]
NegotiatedDep = Annotated[Negotiated, Depends(negotiate)]
