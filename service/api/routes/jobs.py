"""Jobs: long requests run in the background (`"async": true` or `Prefer:
respond-async` on eigenvalues, trace, solve, jacobians and Hessians), followed here:
state and progress, the answer, server-sent events, cancel (service/domain/jobs.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from starlette.responses import Response, StreamingResponse

from service.api.deps import JobsDep, OwnerDep, SettingsDep
from service.api.negotiation import MSGPACK, Format, Negotiated, answer, answer_format
from service.api.openapi import COMPUTE_ERRORS, problem_responses
from service.api.problems import ProblemError, problem_response
from service.api.schemas import JobInfo, JobList
from service.domain.jobs import Job, event

router = APIRouter(tags=["jobs"])

KEEP_ALIVE = 15.0  # seconds between comments on a quiet event stream (proxies close idle ones)


async def get_job(
    job_id: Annotated[str, Path(description="The id in the 202 answer's Location.")],
    owner: OwnerDep,
    jobs: JobsDep,
) -> Job:
    return await jobs.get(job_id, owner)


JobDep = Annotated[Job, Depends(get_job)]


async def negotiate_answer(request: Request) -> Negotiated:
    """A GET's answer format: what Accept prefers, else JSON (406 if it takes neither)."""
    return Negotiated(Format.JSON, answer_format(request.headers.get("accept"), Format.JSON))


AnswerDep = Annotated[Negotiated, Depends(negotiate_answer)]


@router.get(
    "/v1/jobs",
    response_model=JobList,
    responses=problem_responses(401, 406),
    summary="List your jobs",
)
async def list_jobs(owner: OwnerDep, jobs: JobsDep, settings: SettingsDep) -> JobList:
    """The caller's jobs (those of its API key), oldest first: running ones and those
    that ended less than `job_ttl` seconds ago. Results are left out: GET a job for its
    answer."""
    return JobList.model_validate(
        {"jobs": [j.info(settings.job_ttl, with_result=False) for j in await jobs.list(owner)]}
    )


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobInfo,
    responses={
        200: {"content": {MSGPACK: {"schema": {"$ref": "#/components/schemas/JobInfo"}}}},
        **problem_responses(401, 404, 406),
    },
    summary="A job's state, progress and answer",
)
async def read_job(job: JobDep, negotiated: AnswerDep, settings: SettingsDep) -> Response:
    """State (queued, running, succeeded, failed, cancelled), progress (HVPs or rows done
    of the budget, the current estimate and its error, seconds, an ETA), and once it
    has succeeded the `result`: the answer the synchronous request gives, tensors in the
    request's encoding (or msgpack, as Accept asks). A failed job has the `error` the
    synchronous request would have answered (a problem). Another API key's job is a 404."""
    return answer(job.info(settings.job_ttl), negotiated, job.encoding)


@router.get(
    "/v1/jobs/{job_id}/result",
    responses={
        200: {
            "description": "The synchronous request's answer.",
            "content": {
                media: {"schema": {"$ref": "#/components/schemas/JobResult"}}
                for media in ("application/json", MSGPACK)
            },
        },
        # 409 while it runs; a failed job answers its own problem, with the status the
        # synchronous request would have answered (any of a compute route's).
        **problem_responses(409, *COMPUTE_ERRORS),
    },
    summary="A finished job's answer",
)
async def read_job_result(request: Request, job: JobDep, negotiated: AnswerDep) -> Response:
    """Exactly the body the synchronous request answers (200); the job's problem when it
    failed (with that problem's status); 409 while it is queued or running (job-not-
    finished) or when it was cancelled."""
    if job.state == "succeeded":
        assert job.result is not None
        return answer(job.result, negotiated, job.encoding, job.seconds)
    if job.state == "failed":
        assert job.error is not None
        error = dict(job.error)
        status = int(error.pop("status", 500))
        slug = str(error.pop("type", "")).removeprefix("/problems/") or None
        detail = str(error.pop("detail", ""))
        error.pop("title", None)
        error.pop("instance", None)
        return problem_response(request.scope, slug, detail, status=status, **error)
    if job.state == "cancelled":
        # (Its error, when it has one, says why: its tape was deleted.)
        why = (job.error or {}).get("detail")
        raise ProblemError("cancelled", why or f"job {job.id} was cancelled; it has no answer")
    raise ProblemError(
        "job-not-finished",
        f"job {job.id} is {job.state}; GET /v1/jobs/{job.id} follows its progress, "
        f"/v1/jobs/{job.id}/events streams it",
        headers={"Retry-After": "1"},
    )


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "text/event-stream: one event per change, named by the "
            "job's state (progress while running), its data the job document "
            "without the result; the stream ends with the job",
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "string",
                        "description": "A stream of server-sent events, each `id: <version>`, "
                        "`event: <name>` and `data: <JobInfo as JSON, result null>`, ended by "
                        "a blank line; a line `: keep-alive` every 15 s on a quiet stream. "
                        "The names: queued, progress (running), succeeded, failed, cancelled "
                        "(the last event; the stream ends with it).",
                        "example": 'id: 3\nevent: progress\ndata: {"job_id": "Qm9...", '
                        '"state": "running", "progress": {"done": 40, "total": 200, ...}, '
                        '"result": null, ...}\n\n',
                    },
                    # OpenAPI 3.2's itemSchema, ahead of it: one event's fields.
                    "x-item-schema": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "event": {
                                "enum": ["queued", "progress", "succeeded", "failed", "cancelled"]
                            },
                            "data": {"$ref": "#/components/schemas/JobInfo"},
                        },
                        "required": ["id", "event", "data"],
                    },
                }
            },
        },
        **problem_responses(401, 404),
    },
    summary="A job's progress as server-sent events",
)
async def stream_job_events(job: JobDep, jobs: JobsDep, settings: SettingsDep) -> StreamingResponse:
    """Server-sent events (text/event-stream): the job's document at once, then at every
    change (progress reports come at most every 50 ms), with a comment every 15 s on a
    quiet stream; the last event is named succeeded, failed or cancelled, and the stream
    ends there. Its data never holds the result: GET the job or its /result for that."""

    async def events() -> AsyncIterator[bytes]:
        async for current in jobs.updates(job, KEEP_ALIVE):
            yield b": keep-alive\n\n" if current is None else event(current, settings.job_ttl)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.delete(
    "/v1/jobs/{job_id}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(401, 404),
    summary="Cancel a job (or forget one that ended by itself)",
)
async def cancel_job(job: JobDep, jobs: JobsDep) -> Response:
    """A queued or running job is cancelled: its worker stops at its next op (between
    two HVPs at the latest) and is free again; the job stays listed as cancelled until
    it expires, however often the cancel is sent. A job that succeeded or failed is
    forgotten (its id then answers 404)."""
    await jobs.cancel(job)
    return Response(status_code=204)
