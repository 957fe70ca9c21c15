"""Server-side jobs: long requests (eigenvalues, trace, solve, jacobians, Hessians) run in
the background on the server, followed by polling, shown as a tqdm bar, cancelled on
Ctrl-C.

    with client.tape(definition, "loss") as tape:
        top = tape.eigenvalues(k=5, max_hvps=2000, progress=True)   # a tqdm bar
    job = client.job(job_id)          # a job started elsewhere: .status(), .wait(), .cancel()

A method given `progress=` (True: a tqdm bar; a callable: called with each `JobStatus`)
starts its request as a job (`"async": true`), polls GET /v1/jobs/{id} until it ends and
answers as the synchronous call would. A KeyboardInterrupt (or the cancellation of an
awaiting task) while it waits cancels the job (DELETE /v1/jobs/{id}: the server's worker
stops at its next op) before it propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import GradtapeError, JobCancelled, error_class
from .results import check_approximate, check_converged, check_estimated

if TYPE_CHECKING:
    from ._client import ApiMethods
    from ._core import Core, Op

ACTIVE = ("queued", "running")
POLL_FIRST, POLL_MAX = 0.05, 0.5  # seconds between polls: doubling from the first


@dataclass(frozen=True)
class JobStatus:
    """A job as GET /v1/jobs/{id} describes it. `progress`: {done, total, unit,
    estimate, error, seconds, eta} (or None before the first report)."""

    id: str
    state: str  # queued, running, succeeded, failed, cancelled
    operation: str
    progress: dict[str, Any] | None
    elapsed: float
    document: dict[str, Any]  # the whole answer (with `result` once succeeded)

    @property
    def done(self) -> bool:
        return self.state not in ACTIVE

    @classmethod
    def of(cls, doc: dict[str, Any]) -> JobStatus:
        return cls(
            doc["job_id"],
            doc["state"],
            doc.get("operation", ""),
            doc.get("progress"),
            float(doc.get("elapsed") or 0.0),
            doc,
        )


Reporter = Callable[[JobStatus], None]


class TqdmReporter:
    """A tqdm bar over a job's progress: HVPs (or rows) done of the budget, with the
    current estimate and its error beside it. Closed by `close()`."""

    def __init__(self, description: str):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - depends on the installation
            raise ImportError(
                "progress=True shows a tqdm bar: pip install 'gradtape-client[progress]' "
                "(or pass progress=<a callable taking a JobStatus>)"
            ) from None
        self.bar = tqdm(total=None, desc=description, unit="hvp", dynamic_ncols=True)

    def __call__(self, status: JobStatus) -> None:
        p = status.progress
        if p is None:
            self.bar.set_postfix_str(status.state, refresh=True)
            return
        if p.get("total") is not None and self.bar.total != p["total"]:
            self.bar.total = p["total"]
        if status.state == "succeeded":
            self.bar.total = p["done"]  # an estimator may stop short of its budget
        self.bar.unit = {"hvps": "hvp", "rows": "row"}.get(p.get("unit", ""), "it")
        self.bar.update(max(0, int(p["done"]) - self.bar.n))
        postfix = {}
        if p.get("estimate") is not None:
            postfix["estimate"] = _short(p["estimate"])
        if p.get("error") is not None:
            postfix["error"] = _short(p["error"])
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _short(value: Any) -> str:
    if isinstance(value, list):
        return (
            "["
            + ", ".join(_short(v) for v in value[:4])
            + (", ..." if len(value) > 4 else "")
            + "]"
        )
    return "nan" if value is None else f"{value:.4g}"


def reporter(progress: Any, description: str) -> tuple[Reporter | None, Callable[[], None]]:
    """(the callback, what to call at the end) for a method's `progress=` argument."""
    if progress is None or progress is False:
        return None, lambda: None
    if progress is True:
        bar = TqdmReporter(description)
        return bar, bar.close
    if callable(progress):
        return progress, lambda: None
    raise TypeError(f"progress= takes True, False or a callable, not {type(progress).__name__}")


def follow(core: Core, doc: dict[str, Any], report: Reporter | None) -> Op[dict[str, Any]]:
    """Poll the job `doc` describes until it ends; its answer (tensors as arrays), or
    its problem raised (JobCancelled when cancelled). Interrupted while waiting (Ctrl-C,
    a cancelled task): cancel the job on the server, then let the interruption go on."""
    from ._core import Sleep

    status = JobStatus.of(doc)
    path = f"/v1/jobs/{status.id}"
    wait = POLL_FIRST
    try:
        while True:
            if report is not None:
                report(status)
            if status.done:
                break
            yield Sleep(wait)
            wait = min(POLL_MAX, wait * 2)
            status = JobStatus.of((yield from core.call("GET", path)))
    except GeneratorExit:
        raise
    except BaseException:
        if not status.done:
            try:
                yield from core.call("DELETE", path)
            except GradtapeError:
                pass  # ended or gone meanwhile
        raise
    return outcome(status)


def outcome(status: JobStatus) -> dict[str, Any]:
    """A finished job's answer, or its problem as the exception the synchronous call
    would have raised."""
    if status.state == "succeeded":
        result: dict[str, Any] = status.document["result"]
        return result
    if status.state == "cancelled":
        why = status.document.get("error") or {}  # (its tape deleted: says so)
        raise JobCancelled(
            {
                "status": 409,
                "type": "/problems/cancelled",
                "title": "Cancelled",
                "detail": why.get("detail") or f"job {status.id} was cancelled",
                "job_id": status.id,
            }
        )
    problem = dict(status.document.get("error") or {"status": 500, "detail": "the job failed"})
    raise error_class(int(problem.get("status") or 500), problem.get("type"))(problem)


class Job:
    """A job on the server, by id (`client.job(id)`; ids come from a 202's Location or
    `client.jobs()`). With a `Client` its methods answer values, with an `AsyncClient`
    awaitables."""

    def __init__(
        self, client: ApiMethods, job_id: str, decode: Callable[[dict[str, Any]], Any] | None = None
    ):
        self._client = client
        self.id = job_id
        self._decode = decode

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _status_op(self) -> Op[JobStatus]:
        return JobStatus.of((yield from self._client._core.call("GET", f"/v1/jobs/{self.id}")))

    def status(self) -> Any:
        """The job's state and progress now (`JobStatus`)."""
        return self._client._run(self._status_op())

    def _wait_op(self, progress: Any) -> Op[Any]:
        report, close = reporter(progress, self.id[:8])
        try:
            doc = yield from self._client._core.call("GET", f"/v1/jobs/{self.id}")
            answer = yield from follow(self._client._core, doc, report)
        finally:
            close()
        if self._decode is not None:
            return self._decode(answer)  # a typed result, which warns itself
        check_converged(f"job {self.id}", answer)
        check_approximate(f"job {self.id}", answer)  # as the method that started it warns
        check_estimated(f"job {self.id}", answer)
        return answer

    def wait(self, progress: Any = False) -> Any:
        """Wait for the end; the answer (decoded as the method that started it decodes
        it; else a dict of arrays), or the job's problem raised. Ctrl-C cancels it."""
        return self._client._run(self._wait_op(progress))

    result = wait

    def _cancel_op(self) -> Op[None]:
        yield from self._client._core.call("DELETE", f"/v1/jobs/{self.id}")

    def cancel(self) -> Any:
        """Cancel the job (its worker stops at its next op; cancelling it again changes
        nothing); a job that succeeded or failed is forgotten."""
        return self._client._run(self._cancel_op())


__all__ = ["Job", "JobStatus", "TqdmReporter"]
