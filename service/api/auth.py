"""API keys: optional (off by default, for local use). With `api_keys_enabled`, every
/v1 request needs one of the configured keys, as `Authorization: Bearer <key>` or
`X-API-Key: <key>`; a request without a valid key gets a 401 problem.

A key's owner id is the SHA-256 of the key: that is what the store keeps beside each
tape and model (never the key itself), and what makes another key's tapes invisible.
Without keys every request has the owner id "" (one anonymous owner).

Keys from `api_keys_file` are read again when the file changes (its mtime and size are
looked at on each authenticated request, a stat call) or on SIGHUP, without a restart:
a key added works on the next request, a key removed is refused on the next request. A
file that cannot be read, or holds no key, keeps the keys in force (a half-written file
must not lock every client out) and logs an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from service.api.problems import ProblemError
from service.core.config import Settings

ANONYMOUS = ""

log = logging.getLogger("gradtape.auth")

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearerAuth",
    description="An API key as a bearer token (when the server requires keys).",
)
api_key_scheme = APIKeyHeader(
    name="X-API-Key",
    auto_error=False,
    scheme_name="apiKeyAuth",
    description="An API key in the X-API-Key header (when the server requires keys).",
)


def owner_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The accepted keys, held as their digests; reloaded when the keys file changes."""

    def __init__(self, settings: Settings):
        self.enabled = settings.api_keys_enabled
        self._settings = settings
        self._owners: frozenset[str] = frozenset()
        self._file_stamp: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        if self.enabled:
            keys = settings.load_api_keys()
            if not keys:
                raise ValueError(
                    "api_keys_enabled is set but no key is configured: set GRADTAPE_API_KEYS "
                    "or GRADTAPE_API_KEYS_FILE"
                )
            self._file_stamp = self._stamp()
            self._owners = frozenset(map(owner_id, keys))

    def __len__(self) -> int:
        return len(self._owners)

    def _stamp(self) -> tuple[int, ...] | None:
        path = self._settings.api_keys_file
        if path is None:
            return None
        try:
            status = os.stat(path)
        except OSError:
            return None
        return status.st_mtime_ns, status.st_ctime_ns, status.st_ino, status.st_size

    def reload(self, *, force: bool = False) -> None:
        """Read the keys again if the keys file changed (or always, with force)."""
        if not self.enabled or self._settings.api_keys_file is None:
            return
        stamp = self._stamp()
        if not force and stamp == self._file_stamp:
            return
        with self._lock:
            try:
                keys = self._settings.load_api_keys()
            except (OSError, UnicodeDecodeError) as exc:
                self._file_stamp = stamp  # logged once per change, not once per request
                log.error("API keys file not reloaded, the keys in force stay: %s", exc)
                return
            self._file_stamp = stamp
            if not keys:
                log.error(
                    "API keys file holds no key; the %d key(s) in force stay", len(self._owners)
                )
                return
            owners = frozenset(map(owner_id, keys))
            if owners != self._owners:
                log.info("API keys reloaded: %d key(s)", len(owners))
            self._owners = owners

    def owner(self, key: str) -> str | None:
        self.reload()
        digest = owner_id(key)
        found = None
        for known in self._owners:  # compare every digest, in constant time each
            if hmac.compare_digest(known, digest):
                found = known
        return found


_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="gradtape"'}


async def authenticate(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
    api_key: Annotated[str | None, Depends(api_key_scheme)],
) -> str:
    """The caller's owner id; 401 when keys are required and none valid was sent.

    Called first by the /v1 routes' gate, before the body is read (service/api/bodies.py),
    then as the routes' dependency, which finds the owner in the request's state."""
    known: str | None = getattr(request.state, "owner", None)
    if known is not None:
        return known
    owner = _owner_of(request.app.state.keyring, bearer, api_key)
    request.state.owner = owner
    return owner


def _owner_of(
    keyring: KeyRing, bearer: HTTPAuthorizationCredentials | None, api_key: str | None
) -> str:
    if not keyring.enabled:
        return ANONYMOUS
    key = bearer.credentials if bearer is not None else api_key
    if not key:
        raise ProblemError(
            "unauthorized",
            "this server requires an API key: send it as 'Authorization: Bearer <key>' or "
            "'X-API-Key: <key>'",
            headers=_UNAUTHORIZED_HEADERS,
        )
    owner = keyring.owner(key)
    if owner is None:
        raise ProblemError(
            "unauthorized",
            "the API key is not valid for this server",
            headers=_UNAUTHORIZED_HEADERS,
        )
    return owner


async def current_owner(request: Request) -> str:
    """The caller's owner id, as the /v1 routers' `authenticate` dependency (or the gate
    before it) found it: one cheap dependency for the routes and their dependencies,
    rather than `authenticate` and its two header schemes solved again for each."""
    known: str | None = getattr(request.state, "owner", None)
    if known is not None:
        return known
    return await authenticate(request, await bearer_scheme(request), await api_key_scheme(request))


OwnerDep = Annotated[str, Depends(current_owner)]
