"""API keys: optional (off by default, for local use). With `api_keys_enabled`, every
/v1 request needs one of the configured keys, as `Authorization: Bearer <key>` or
`X-API-Key: <key>`; a request without a valid key gets a 401 problem.

A key's owner id is the SHA-256 of the key: that is what the store keeps beside each
tape and model (never the key itself), and what makes another key's tapes invisible.
Without keys every request has the owner id "" (one anonymous owner).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from service.api.problems import ProblemError
from service.core.config import Settings

ANONYMOUS = ""

bearer_scheme = HTTPBearer(
    auto_error=False, scheme_name="bearerAuth",
    description="An API key as a bearer token (when the server requires keys).",
)
api_key_scheme = APIKeyHeader(
    name="X-API-Key", auto_error=False, scheme_name="apiKeyAuth",
    description="An API key in the X-API-Key header (when the server requires keys).",
)


def owner_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The accepted keys, held as their digests."""

    def __init__(self, settings: Settings):
        self.enabled = settings.api_keys_enabled
        self._owners: dict[str, str] = {}
        if self.enabled:
            keys = settings.load_api_keys()
            if not keys:
                raise ValueError(
                    "api_keys_enabled is set but no key is configured: set GRADTAPE_API_KEYS "
                    "or GRADTAPE_API_KEYS_FILE"
                )
            for key in keys:
                digest = owner_id(key)
                self._owners[digest] = digest

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, key: str) -> str | None:
        digest = owner_id(key)
        for known in self._owners:  # compare every digest, in constant time each
            if hmac.compare_digest(known, digest):
                return known
        return None


_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="gradtape"'}


async def authenticate(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
    api_key: Annotated[str | None, Depends(api_key_scheme)],
) -> str:
    """The caller's owner id; 401 when keys are required and none valid was sent."""
    keyring: KeyRing = request.app.state.keyring
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
            "unauthorized", "the API key is not valid for this server",
            headers=_UNAUTHORIZED_HEADERS,
        )
    return owner


OwnerDep = Annotated[str, Depends(authenticate)]
