"""Fair sharing between API keys: a token-bucket rate limit and a bound on the requests
one key has computing or queued at once, both per key, in the HTTP process.

Without them one key's flood fills the workers' queue and every other key waits behind
it. With them a key has at most `max_concurrent_per_key` requests past this gate (by
default as many as there are workers: it may fill the workers, never the queue), so
another key's request waits for at most one of the flood's requests to finish. Requests
beyond the slots wait here, in their own key's line (bounded by `max_waiting_per_key`);
beyond the rate or the line, a 429 `rate-limited` with `Retry-After` (a request refused
for a full line spends no token). The /v1 routes pass this gate before their body is
read (GatedRoute, service/api/bodies.py), and hold their slot until they are answered.

Off on a server without API keys (every caller is the same owner there).

Several HTTP processes (`http_workers` > 1): the rate is shared, a key's bucket kept in
the store (one small write per request), so a key's rate is the same however its
connections spread over the processes; the slots and the waiting line stay per
process, since they bound a key's share of that process's own workers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NoReturn

from service.api.problems import ProblemError
from service.core.config import Settings
from service.core.store import Store

# The longest a refused request of a key that ignored its Retry-After is held before its
# 429 (a connection held costs memory, not time).
MAX_HOLD_REFUSED = 1.0


@dataclass
class _KeyState:
    tokens: float
    stamp: float
    slots: asyncio.Semaphore
    waiting: int = 0  # requests in this key's line (admitted, no slot yet)
    held: int = 0  # this key's slots taken (requests and jobs computing or reading a body)
    users: int = 0  # requests holding this state (to forget idle keys)
    refused_until: float = 0.0  # the Retry-After of the key's last 429 (monotonic)


class Admission:
    """A request past its key's rate, in its key's line: `take_slot` waits for one of the
    key's slots (held until the request is answered); `leave` ends the stay in line."""

    def __init__(self, state: _KeyState | None, waiting: bool = True):
        self._state = state
        self._waiting = state is not None and waiting
        self._holding = False

    async def take_slot(self) -> None:
        state = self._state
        if state is None or self._holding:
            return
        try:
            await state.slots.acquire()
            self._holding = True
            state.held += 1
        finally:
            self._stop_waiting()

    def _stop_waiting(self) -> None:
        if self._waiting:
            assert self._state is not None
            self._state.waiting -= 1
            self._waiting = False

    def without_slot(self) -> None:
        """This request needs no slot (it starts a job): out of the line now."""
        self._stop_waiting()

    def leave(self) -> None:
        self._stop_waiting()
        if self._holding:
            assert self._state is not None
            self._state.slots.release()
            self._state.held -= 1
            self._holding = False


class Fairness:
    def __init__(self, settings: Settings, workers: int, store: Store | None = None):
        self.enabled = settings.api_keys_enabled
        self.store = store if settings.shared else None  # the shared buckets
        self.rate = settings.rate_limit_per_second
        self.burst = settings.rate_limit_burst
        self.concurrent = settings.max_concurrent_per_key or max(1, workers)
        self.max_waiting = settings.max_waiting_per_key
        self._keys: dict[str, _KeyState] = {}

    def slots_held(self) -> int:
        """Keys' slots taken now, over every key (GET /metrics)."""
        return sum(state.held for state in self._keys.values())

    def waiting(self) -> int:
        """Requests in their keys' lines now, over every key (GET /metrics)."""
        return sum(state.waiting for state in self._keys.values())

    def _state(self, owner: str, now: float) -> _KeyState:
        state = self._keys.get(owner)
        if state is None:
            state = _KeyState(float(self.burst), now, asyncio.Semaphore(self.concurrent))
            self._keys[owner] = state
        return state

    def _refill(self, state: _KeyState, now: float) -> None:
        state.tokens = min(float(self.burst), state.tokens + (now - state.stamp) * self.rate)
        state.stamp = now

    def _check_rate(self, state: _KeyState, now: float) -> tuple[str, float] | None:
        """Why and how long to wait (a 429), unless the key has a token to spend (the
        bucket refilled first)."""
        if self.rate <= 0:
            return None
        self._refill(state, now)
        if state.tokens < 1.0:
            wait = (1.0 - state.tokens) / self.rate
            why = f"this API key is over its rate of {self.rate:g} requests per second"
            return f"{why} (burst {self.burst})", wait
        return None

    async def _refuse(self, state: _KeyState, detail: str, wait: float) -> NoReturn:
        """A 429 with Retry-After. A key that comes back before its last Retry-After
        (ignoring it) is answered only when it was told to come back (at most
        MAX_HOLD_REFUSED later): costing nothing while it waits, a client that ignores
        Retry-After cannot keep this process busy refusing it, and other keys' requests
        find the event loop free (issue 25: a quiet key's p99 under such a flood)."""
        now = time.monotonic()
        if now < state.refused_until:
            await asyncio.sleep(min(state.refused_until - now, MAX_HOLD_REFUSED))
        else:
            state.refused_until = now + _retry_after(wait)  # what the client is told
        raise _limited(detail, wait)

    @asynccontextmanager
    async def admit(self, owner: str, computes: bool = True) -> AsyncIterator[Admission]:
        """Pass the key's rate and line (off on a server without keys): 429 over the
        rate or past a full waiting line. The request then waits in its key's line until
        it takes a slot (Admission.take_slot), or leaves the line without one: a request
        started as a job is bookkeeping, answered 202 at once (its job takes a slot when
        it computes, Fairness.slot). A request that `computes` nothing (a read, a
        delete: no worker's queue) pays its token and neither stands in the line nor
        takes a slot: the key's own jobs, holding every slot, never hold up a listing."""
        if not self.enabled:
            yield Admission(None)
            return
        now = time.monotonic()
        state = self._state(owner, now)
        if self.store is None and (over := self._check_rate(state, now)) is not None:
            await self._refuse(state, *over)
        if computes and state.slots.locked() and state.waiting >= self.max_waiting:
            # Refused before it costs a token: a client told to come back later keeps
            # its rate for when it does.
            await self._refuse(
                state,
                f"this API key has {self.concurrent} requests computing and "
                f"{state.waiting} waiting (max_waiting_per_key)",
                1.0,
            )
        if self.store is not None and self.rate > 0:
            wait = await asyncio.to_thread(
                self.store.take_token, owner, self.rate, self.burst, time.time()
            )
            if wait > 0:
                await self._refuse(
                    state,
                    f"this API key is over its rate of {self.rate:g} requests per "
                    f"second (burst {self.burst}), counted over every HTTP "
                    "process",
                    wait,
                )
        elif self.rate > 0:
            state.tokens -= 1.0
        state.users += 1
        if computes:
            state.waiting += 1
        admission = Admission(state, waiting=computes)
        try:
            yield admission
        finally:
            admission.leave()
            state.users -= 1
            if self.rate > 0:
                self._refill(state, time.monotonic())
            if state.users == 0 and (self.rate <= 0 or state.tokens >= self.burst):
                # Idle with a full bucket: nothing to remember, so the table holds only
                # the keys that are active or still paying back a burst.
                self._keys.pop(owner, None)

    @asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        """One of the key's slots, for a job while it computes (its request paid its
        token already; it waits in its key's line however long the line is)."""
        if not self.enabled:
            yield
            return
        state = self._state(owner, time.monotonic())
        state.users += 1
        try:
            async with state.slots:
                state.held += 1
                try:
                    yield
                finally:
                    state.held -= 1
        finally:
            state.users -= 1
            if state.users == 0 and (self.rate <= 0 or state.tokens >= self.burst):
                self._keys.pop(owner, None)


def _retry_after(wait: float) -> int:
    """Retry-After's whole seconds, at least 1."""
    return max(1, math.ceil(wait))


def _limited(detail: str, wait: float) -> ProblemError:
    return ProblemError("rate-limited", detail, headers={"Retry-After": str(_retry_after(wait))})
