"""Accepting a job is bookkeeping (issue 25): `"async": true` or `Prefer: respond-async`
answers 202 at once, queued, without waiting for one of its key's concurrency slots (the
queue holds the job until one is free); past the key's job quota, an immediate 429 with
Retry-After. One worker and one slot per key here, so a running job holds the only slot:
before issue 25 the next async request waited for that job to end."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.test_cancel import chain
from tests.service.test_jobs import wait

KEY = "admission-key"
LONG = {  # a trace that runs until cancelled (its budgets are far away)
    "method": "hutchinson",
    "max_hvps": 100000,
    "batch_size": 1,
    "max_seconds": 300,
    "time_limit": 300,
}


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("admission")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_MAX_TIME_LIMIT": "300",
            "GRADTAPE_ALGORITHM_MAX_HVPS": "100000",
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": KEY,
            "GRADTAPE_MAX_JOBS_PER_KEY": "3",
            "GRADTAPE_MAX_CONCURRENT_PER_KEY": "1",
        },
        tmp / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_jobs_answer_202_at_once_and_the_quota_429_never_waits(one_slot) -> None:
    # The timeout is the test's only clock: a 202 that waited for the running job
    # (300 s of budget) would not come within it.
    with httpx.Client(
        base_url=one_slot.base_url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    ) as client:
        made = client.post("/v1/tapes", json={"definition": chain(40), "target": "loss"})
        assert made.status_code == 201, made.text
        trace = f"/v1/tapes/{made.json()['tape_id']}/trace"
        first = client.post(trace, json={**LONG, "async": True})
        assert first.status_code == 202, first.text
        running = wait(client, first.headers["location"], ("running",))
        assert running["state"] == "running"  # it holds the key's only slot now
        second = client.post(trace, json={**LONG, "async": True})
        third = client.post(trace, json=LONG, headers={"Prefer": "respond-async"})
        for answer in (second, third):
            assert answer.status_code == 202, answer.text
            assert answer.json()["state"] == "queued"
        locations = [r.headers["location"] for r in (first, second, third)]
        # Ordered by events: both were accepted while the first still ran.
        assert client.get(locations[0]).json()["state"] == "running"
        over = client.post(trace, json={**LONG, "async": True})
        assert over.status_code == 429, over.text
        assert over.json()["quota"] == "jobs" and int(over.headers["retry-after"]) >= 1
        assert "max_jobs_per_key" in over.json()["detail"]
        # The queue holds them: cancelling the running one lets the next one run.
        assert client.delete(locations[0]).status_code == 204
        assert wait(client, locations[1], ("running",))["state"] == "running"
        for location in locations[1:]:
            assert client.delete(location).status_code == 204
        for location in locations:
            assert wait(client, location, ("cancelled",))["state"] == "cancelled"
        # A plain request takes the slot again, as before.
        plain = client.post(trace, json={**LONG, "max_hvps": 4})
        assert plain.status_code == 200, plain.text
