"""A key that ignores Retry-After cannot keep the HTTP process busy refusing it (issue
25): a request that comes back before its key's last Retry-After is answered (429) only
when it was told to come back, so 4 connections flooding for a few seconds get a handful
of answers, not thousands, while another key is served. Counted, not timed: a slower
machine only answers the flood fewer times."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.service.conftest import Server, stop_server
from tests.service.test_fairness import as_key, keyed_server

FLOOD = """
import sys, threading, httpx
url, key, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
answers = {}
lock = threading.Lock()
go = threading.Event()
def flood():
    with httpx.Client(base_url=url, timeout=60.0,
                      headers={"Authorization": "Bearer " + key}) as c:
        go.wait()
        while True:
            status = c.get("/v1/tapes").status_code  # 429: sent again at once
            with lock:
                answers[status] = answers.get(status, 0) + 1
for _ in range(count):
    threading.Thread(target=flood, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
go.set()
sys.stdin.readline()
with lock:
    print(answers.get(200, 0), answers.get(429, 0), sum(answers.values()), flush=True)
"""


@pytest.fixture
def rated(tmp_path) -> Iterator[Server]:
    srv = keyed_server(tmp_path, rate_limit_per_second="1", rate_limit_burst="2")
    try:
        yield srv
    finally:
        stop_server(srv)


def test_a_flood_that_ignores_retry_after_is_answered_when_told(rated) -> None:
    connections = 4
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, rated.base_url, "flood-key", str(connections)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert flood.stdin is not None and flood.stdout is not None
    try:
        assert flood.stdout.readline() == b"ready\n"
        with as_key(rated, "quiet-key") as quiet:
            # The window measured holds the whole flood (started before it is told to
            # go, read after it stopped counting): a loaded machine only widens it, and
            # the bounds below, which grow with it, only loosen.
            started = time.monotonic()
            flood.stdin.write(b"\n")
            flood.stdin.flush()
            served = [quiet.get("/v1/tapes").status_code for _ in range(2)]
            time.sleep(3.0)
            served.append(quiet.get("/v1/tapes").status_code)
            flood.stdin.write(b"\n")
            flood.stdin.flush()
            ok, refused, total = map(int, flood.stdout.readline().split())
            elapsed = time.monotonic() - started
    finally:
        flood.kill()
        flood.wait()
    assert served == [200, 200, 200]  # the quiet key's own bucket, its requests answered
    assert refused >= 1 and ok <= 2 + elapsed + 1  # the burst, then the rate of 1/s
    # Each connection gets at most one answer per Retry-After (1 s at 1 request/s) after
    # its first refusal, plus what was in flight: before issue 25, about a thousand 429s.
    assert total <= connections * (elapsed + 3) + 3, (ok, refused, total, elapsed)
