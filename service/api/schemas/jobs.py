"""Jobs (GET /v1/jobs): a long request run in the background."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Union

from pydantic import (
    BaseModel,
    Field,
)
from typing_extensions import TypeAliasType

from service.api.schemas.algorithms import (
    DiagonalResponse,
    EigenvaluesResponse,
    SolveResponse,
    SpectralDensityResponse,
    TraceResponse,
)
from service.api.schemas.compute import HessianResponse, JacobianResponse
from service.api.schemas.meta import Problem
from service.api.schemas.operations import RESPONSE_MODELS

# Jobs ------------------------------------------------------------------------------------


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


# The answer of a request that may run as a job: what the synchronous request answers
# (and the answers the operation table declares: service/core/operations.py).
_ANSWERS = (
    EigenvaluesResponse,
    TraceResponse,
    DiagonalResponse,
    SpectralDensityResponse,
    SolveResponse,
    JacobianResponse,
    HessianResponse,
    *RESPONSE_MODELS.values(),
)
if TYPE_CHECKING:
    JobResult = BaseModel
else:
    JobResult = TypeAliasType("JobResult", Union[_ANSWERS])  # noqa: UP007 (a tuple of them)


class JobProgress(BaseModel):
    """Where a running job stands (the last report of its worker). Once it succeeded,
    the figures of its answer instead, as its operation's table row declares them
    (service/core/operations.py `progress`): `done` its HVPs, `estimate` and `error` the
    answer's (eta 0), so the last event never disagrees with the result."""

    done: int = Field(
        description="Units of work done: HVPs (vectors) for eigenvalues, trace, "
        "diagonal, spectral density and solve; rows for a Hessian."
    )
    total: int | None = Field(
        None,
        description="The budget of units (max_hvps, rows), when "
        "known; an algorithm may stop sooner, on convergence.",
    )
    unit: str = Field(description="hvps or rows.", examples=["hvps"])
    estimate: float | list[float | None] | None = Field(
        None,
        description="What the algorithm would answer now: the Ritz values (eigenvalues), "
        "the trace estimate; exact diagonal: the fraction of entries done; spectral density: "
        "the probes finished; null when there is none yet (solve, hutchinson diagonal: see "
        "error).",
    )
    error: float | list[float | None] | None = Field(
        None,
        description="The estimate's error: Ritz residuals, the trace's standard error, "
        "the diagonal's relative error rms(stderr) / rms(diagonal), the solve's relative "
        "residual ||b - A x|| / ||b||.",
    )
    seconds: float = Field(description="Seconds the computation has run in its worker.")
    eta: float | None = Field(
        None,
        description="Seconds left at the current pace if the whole budget is used "
        "(within max_seconds); null when unknown.",
    )
    max_seconds: float | None = Field(
        None,
        description="The seconds the algorithm may run: within the job's own time budget "
        "(the server's job_time_limit, or the request's time_limit), not the "
        "synchronous one; null when unknown.",
    )


class JobInfo(BaseModel):
    """A job: a long computation run in the background (`"async": true` or `Prefer:
    respond-async`)."""

    job_id: str
    state: JobState = Field(description="queued, running, succeeded, failed or cancelled.")
    operation: str = Field(
        description="The request that started it.", examples=["POST /v1/tapes/{tape_id}/trace"]
    )
    tape_id: str | None = Field(None, description="The tape it runs on, if any.")
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    expires_at: str | None = Field(
        None, description="When a finished job is forgotten (job_ttl after it ended)."
    )
    elapsed: float = Field(description="Seconds since it started running (until it ended).")
    progress: JobProgress | None = None
    result: JobResult | None = Field(
        None,
        description="When succeeded: the answer the synchronous request gives (also at "
        "GET /v1/jobs/{job_id}/result).",
    )
    error: Problem | None = Field(
        None,
        description="When failed: the problem the synchronous request would have answered. "
        "When cancelled because its tape was deleted: a `cancelled` problem saying so.",
    )


class JobList(BaseModel):
    jobs: list[JobInfo] = Field(description="The caller's jobs, oldest first (without results).")
