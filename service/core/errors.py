"""The service's domain error, raised below the HTTP layer (tapes, models, datasets,
jobs, payload checks) and turned into an application/problem+json answer in one place
above it (service/api/errors.py). It names a problem type by its slug (the keys of
service/api/problems.py's PROBLEM_TYPES, which fix each type's status and title); the
domain never sees a status line or a header."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A request cannot be answered: `slug` names the problem type, `detail` says why
    (naming the field, the line or the shape), `errors` lists located problems and
    `extensions` are extra members of the problem (`quota`, `reason`, ...)."""

    def __init__(
        self,
        slug: str,
        detail: str,
        *,
        errors: list[dict[str, Any]] | None = None,
        **extensions: Any,
    ):
        super().__init__(detail)
        self.slug = slug
        self.detail = detail
        self.errors = errors
        self.extensions = extensions
