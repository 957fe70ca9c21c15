"""The op catalogue, health and readiness, and the problem+json body."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)


class OpParam(BaseModel):
    name: str
    kind: str = Field(description="tensor, tensors (a list of them) or constant")
    type: str
    required: bool
    variadic: bool
    default: Any = None


class OpInfo(BaseModel):
    """One op a program can call."""

    name: str
    family: str
    signature: str
    doc: str
    operator: str | None = Field(None, description="The operator spelling, e.g. 'a + b'.")
    params: list[OpParam]


class OpCatalogue(BaseModel):
    """Every op and built-in a program can call."""

    ops: list[OpInfo]


class HealthResponse(BaseModel):
    status: str = Field(examples=["ok"])


class WorkerStatus(BaseModel):
    """One engine worker process."""

    index: int
    pid: int | None
    device: str
    state: str = Field(
        description="starting, idle, busy (computing a request, within its time limit), "
        "unresponsive (a ping unanswered past worker_ready_timeout: not ready; replaced "
        "past worker_liveness_timeout) or down"
    )
    generation: int = Field(description="How many times this worker has been (re)started.")
    restarts: int
    silent_seconds: float | None = Field(
        None,
        description="Seconds since the worker last sent anything (its start, an answer, a "
        "progress report, an answer to the pool's ping); null while starting or down. A busy "
        "worker is silent while it computes.",
    )
    kernels: str | None = Field(
        None,
        description="Its compiled kernels' warm-up, as of its start or the pool's last ping of "
        "it: warming (requests run the NumPy paths of the kernels not yet ready), ready, "
        "failed (it runs the NumPy paths: same answers, slower; the worker's log says why), "
        "off (kernels switched off or numba missing), idle (no warm-up asked: "
        "worker_warm_kernels off); null while starting or down.",
    )


class ReadinessResponse(BaseModel):
    status: str = Field(examples=["ready"])
    workers: list[WorkerStatus]


class ProblemItem(BaseModel):
    """One located error: a request field, or a line/column of the program."""

    message: str
    field: str | None = Field(None, description="Dotted path of the request field.")
    kind: str | None = Field(None, description="syntax, name, op, shape, dtype, limit, ...")
    section: str | None = Field(None, description="program, functions.<name>.forward, ...")
    line: int | None = None
    column: int | None = None
    op: str | None = None
    shapes: list[list[int]] | None = None


class Problem(BaseModel):
    """An error, as application/problem+json (RFC 9457)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field("about:blank", description="URI reference naming the kind of problem.")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[ProblemItem] | None = None
    omitted: int | None = Field(
        None,
        description="Problems found beyond those listed in `errors` (the server lists "
        "at most max_reported_problems).",
    )
