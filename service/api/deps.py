"""Dependencies shared by the routes, as Annotated aliases (the FastAPI template's
`SessionDep` pattern): the settings, the worker pool, the negotiated body formats, the
caller (its API key's owner id), the tape registry, the stored models, and the tape a
path names. The compute routes take what they need as one `ComputeDep` (the caller,
the formats, the app's parts): FastAPI solves each dependency anew for every request
(~10 us each, cached or not), which a small request notices.

They are `async def` on purpose: FastAPI runs a plain `def` dependency in a thread,
which costs more than the whole lookup. The settings are the app's (`create_app`
takes them, by default from the lru_cached `get_settings`, and builds `Services` with
them): a test passes its own Settings to `create_app` to change them for one app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request

from service.api.auth import OwnerDep, current_owner
from service.api.negotiation import Negotiated, negotiate
from service.core.config import Settings
from service.domain.datasets import DatasetCatalog
from service.domain.jobs import JobRegistry
from service.domain.sessions import ModelCatalog, Tape, TapeRegistry
from service.pool import Pool


async def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_pool(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


async def get_tapes(request: Request) -> TapeRegistry:
    tapes: TapeRegistry = request.app.state.tapes
    return tapes


async def get_models(request: Request) -> ModelCatalog:
    models: ModelCatalog = request.app.state.models
    return models


async def get_datasets(request: Request) -> DatasetCatalog:
    datasets: DatasetCatalog = request.app.state.datasets
    return datasets


async def get_jobs(request: Request) -> JobRegistry:
    jobs: JobRegistry = request.app.state.jobs
    return jobs


@dataclass(frozen=True)
class Services:
    """The parts of the app a compute route uses (create_app builds it once)."""

    settings: Settings
    pool: Pool
    tapes: TapeRegistry
    models: ModelCatalog
    datasets: DatasetCatalog


@dataclass(frozen=True)
class Compute:
    """What a compute route needs of its request and of the app."""

    owner: str
    negotiated: Negotiated
    services: Services


async def get_compute(request: Request) -> Compute:
    """The caller's owner id, the negotiated formats (415 or 406 first), the app's parts."""
    owner = await current_owner(request)
    return Compute(owner, await negotiate(request), request.app.state.services)


SettingsDep = Annotated[Settings, Depends(app_settings)]
ComputeDep = Annotated[Compute, Depends(get_compute)]
DatasetsDep = Annotated[DatasetCatalog, Depends(get_datasets)]
PoolDep = Annotated[Pool, Depends(get_pool)]
NegotiatedDep = Annotated[Negotiated, Depends(negotiate)]
TapesDep = Annotated[TapeRegistry, Depends(get_tapes)]
ModelsDep = Annotated[ModelCatalog, Depends(get_models)]
JobsDep = Annotated[JobRegistry, Depends(get_jobs)]


async def get_tape(
    tape_id: Annotated[str, Path(description="The id POST /v1/tapes answered.")],
    request: Request,
) -> Tape:
    """The caller's live tape named by the path; 404 (saying why) otherwise."""
    tapes: TapeRegistry = request.app.state.tapes
    return await tapes.get(tape_id, await current_owner(request))


TapeDep = Annotated[Tape, Depends(get_tape)]


@dataclass(frozen=True)
class TapeCompute(Compute):
    """What a compute route on a tape needs: its Compute, and the tape the path names."""

    tape: Tape


async def get_tape_compute(
    tape_id: Annotated[str, Path(description="The id POST /v1/tapes answered.")],
    request: Request,
) -> TapeCompute:
    """get_tape then get_compute (the 404 first, then 415 or 406), as one dependency:
    FastAPI solves each dependency anew for every request."""
    owner = await current_owner(request)
    tapes: TapeRegistry = request.app.state.tapes
    tape = await tapes.get(tape_id, owner)
    return TapeCompute(owner, await negotiate(request), request.app.state.services, tape)


TapeComputeDep = Annotated[TapeCompute, Depends(get_tape_compute)]

__all__ = [
    "Compute",
    "ComputeDep",
    "DatasetsDep",
    "ModelsDep",
    "NegotiatedDep",
    "OwnerDep",
    "PoolDep",
    "Services",
    "SettingsDep",
    "TapeCompute",
    "TapeComputeDep",
    "TapeDep",
    "TapesDep",
]
