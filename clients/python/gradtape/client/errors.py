"""Problems (RFC 9457 `application/problem+json` answers) as exceptions.

Every error answer becomes a `GradtapeError` (or a subclass picked by the problem's
`type`, falling back on its HTTP status), carrying `status`, `type`, `title`, `detail`,
`errors` (one dict per problem, as the server lists them) and the whole `problem`.

    GradtapeError
    ├── InvalidRequest          400, 406, 415, 422 validation / invalid-request
    │   └── DefinitionError     422 definition: every problem, each shown at its line
    ├── ComputeError            422 execution / unsupported / batch-dependence
    │   └── NonFiniteResult     422 non-finite
    ├── TooLarge                413 body-too-large, 422 too-large
    ├── Unauthorized            401
    ├── NotFound                404
    │   ├── TapeGone            404 tape-expired / tape-evicted / tape-not-found
    │   ├── ModelNotFound       404 model-not-found
    │   └── JobNotFound         404 job-not-found
    ├── Conflict                409 model-exists, job-not-finished
    │   └── JobCancelled        409 cancelled
    ├── QuotaExceeded           429
    ├── ServerError             500, 507, and other 5xx
    │   ├── WorkerCrashed       502
    │   ├── ServiceBusy         503 (retried by the client first, see `Retry`)
    │   └── ComputeTimeout      504
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping, Sequence
from typing import Any


class GradtapeError(Exception):
    """An error answer of the service."""

    def __init__(self, problem: Mapping[str, Any], *, headers: Mapping[str, str] | None = None):
        self.problem: dict[str, Any] = dict(problem)
        self.status: int = int(problem.get("status") or 0)
        self.type: str = str(problem.get("type") or "about:blank")
        self.title: str = str(problem.get("title") or "")
        self.detail: str = str(problem.get("detail") or "")
        self.errors: list[dict[str, Any]] = list(problem.get("errors") or [])
        self.headers: dict[str, str] = dict(headers or {})
        super().__init__(self._message())

    @property
    def slug(self) -> str:
        """The last part of `type`: "definition", "tape-expired", ..."""
        return self.type.rstrip("/").rsplit("/", 1)[-1]

    def _message(self) -> str:
        head = f"{self.status} {self.title}".strip()
        return f"{head}: {self.detail}" if self.detail else head


class InvalidRequest(GradtapeError):
    """The request is malformed or does not fit its definition (`errors` name the fields)."""


class DefinitionError(InvalidRequest):
    """The definition cannot run. `errors` lists every problem; `str()` shows each at its
    program line with a caret under the column."""

    def __init__(
        self,
        problem: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        program: Sequence[str] | None = None,
        functions: Mapping[str, Any] | None = None,
    ):
        self.program = list(program or [])
        self.functions = dict(functions or {})
        super().__init__(problem, headers=headers)

    def _source_line(self, item: Mapping[str, Any]) -> str | None:
        """The text of the line an item points at, where the client knows it."""
        line, section = item.get("line"), item.get("section") or "program"
        if not isinstance(line, int) or line < 1:
            return None
        lines: Any = self.program
        if section != "program":  # e.g. "functions.clip.backward"
            parts = section.split(".")
            if len(parts) == 3 and parts[0] == "functions":
                lines = (self.functions.get(parts[1]) or {}).get(parts[2])
            else:
                return None
        if isinstance(lines, str):
            lines = lines.splitlines()
        if not isinstance(lines, list) or line > len(lines):
            return None
        return str(lines[line - 1])

    def _message(self) -> str:
        out = [f"{self.status} {self.title}: {len(self.errors) or 1} problem(s)"]
        for item in self.errors or [{"message": self.detail}]:
            where = item.get("section") or "program"
            if item.get("line") is not None:
                where += f" line {item['line']}"
                if item.get("column") is not None:
                    where += f", column {item['column']}"
            op = f"{item['op']}: " if item.get("op") else ""
            out.append(f"  {where}: {op}{item.get('message', '')}")
            text = self._source_line(item)
            if text is not None:
                out.append(f"    {text}")
                column = item.get("column")
                if isinstance(column, int) and column >= 1:
                    out.append("    " + " " * (column - 1) + "^")
        return "\n".join(out)


class ComputeError(GradtapeError):
    """A checked definition failed while computing (a singular matrix, no rule, ...)."""


class NonFiniteResult(ComputeError):
    """The answer would hold NaN or infinite values; `errors` names the op where the first
    appeared. Pass `allow_nonfinite=True` to receive such answers."""


class TooLarge(GradtapeError):
    """The body, or what it asks for, exceeds a limit of the server."""


class Unauthorized(GradtapeError):
    """The server needs an API key and got none, or one it does not accept."""


class NotFound(GradtapeError):
    """No such thing (for this API key)."""


class TapeGone(NotFound):
    """The tape cannot be used: `reason` is "expired", "evicted" or "deleted" (with
    `ended_at`), or None for an id the server never gave this key."""

    def __init__(self, problem: Mapping[str, Any], *, headers: Mapping[str, str] | None = None):
        self.reason: str | None = problem.get("reason")
        self.ended_at: str | None = problem.get("ended_at")
        super().__init__(problem, headers=headers)


class ModelNotFound(NotFound):
    """No stored model of this name for this API key."""


class Conflict(GradtapeError):
    """The name is taken (send replace=True to replace it)."""


class QuotaExceeded(GradtapeError):
    """This key holds as many tapes, tape bytes or models as it may; `problem["quota"]`
    names which."""


class ServerError(GradtapeError):
    """The server failed (a bug, out of memory, ...)."""


class WorkerCrashed(ServerError):
    """The worker computing the request died and is being replaced."""


class JobNotFound(NotFound):
    """No such job for this API key (never started, or forgotten job_ttl after it ended)."""


class JobCancelled(Conflict):
    """The job was cancelled (DELETE /v1/jobs/{id}, or Ctrl-C while the client waited)."""


class ServiceBusy(ServerError):
    """503: every worker busy and the queue full (or the service starting). Raised only
    after the client's retries (`Retry`) are used up; `attempts` says how many it made."""

    attempts: int = 1

    @property
    def retry_after(self) -> float | None:
        return parse_retry_after(self.headers.get("retry-after"))


class ComputeTimeout(ServerError):
    """504: the computation ran past its time limit (`problem["time_limit"]`); its worker
    was replaced. Ask for less, or pass a larger `time_limit`."""


_BY_SLUG: dict[str, type[GradtapeError]] = {
    "definition": DefinitionError,
    "validation": InvalidRequest,
    "invalid-request": InvalidRequest,
    "malformed-body": InvalidRequest,
    "unsupported-media-type": InvalidRequest,
    "not-acceptable": InvalidRequest,
    "method-not-allowed": InvalidRequest,
    "execution": ComputeError,
    "unsupported": ComputeError,
    "batch-dependence": ComputeError,
    "non-finite": NonFiniteResult,
    "too-large": TooLarge,
    "body-too-large": TooLarge,
    "unauthorized": Unauthorized,
    "not-found": NotFound,
    "tape-not-found": TapeGone,
    "tape-expired": TapeGone,
    "tape-evicted": TapeGone,
    "model-not-found": ModelNotFound,
    "model-exists": Conflict,
    "job-not-found": JobNotFound,
    "job-not-finished": Conflict,
    "cancelled": JobCancelled,
    "quota-exceeded": QuotaExceeded,
    "worker-crashed": WorkerCrashed,
    "busy": ServiceBusy,
    "unavailable": ServiceBusy,
    "not-ready": ServiceBusy,
    "device": ServiceBusy,
    "time-limit": ComputeTimeout,
}
_BY_STATUS: dict[int, type[GradtapeError]] = {
    401: Unauthorized, 404: NotFound, 409: Conflict, 413: TooLarge, 429: QuotaExceeded,
    502: WorkerCrashed, 503: ServiceBusy, 504: ComputeTimeout,
}  # fmt: skip


def error_class(status: int, type_: str | None) -> type[GradtapeError]:
    slug = (type_ or "").rstrip("/").rsplit("/", 1)[-1]
    if slug in _BY_SLUG:
        return _BY_SLUG[slug]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ServerError
    if 400 <= status < 500:
        return InvalidRequest
    return GradtapeError


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds, or an HTTP date
    (RFC 9110 10.2.3); None when absent or unreadable."""
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)
