"""Cancellation (issue 11, item 4): a client that disconnects does not leave its worker
busy until the time limit. The HTTP process notices the disconnect while it waits for
the worker, sets the worker's cancel flag, and the worker stops at its next op: on a
one-worker server, the same worker (not one killed and replaced after cancel_grace) is
idle again and answers the next request, and the tape the cancelled request ran on
still answers exactly as before.

Real server, real sockets: the disconnect is a client closing its TCP connection in the
middle of a long Hutchinson trace or a long gradient. Every wait is on an event seen in
/metrics (issue 27, item 13), never a sleep or a bound on seconds.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker and a long time limit: a request nobody cancels holds it for minutes."""
    tmp = tmp_path_factory.mktemp("cancel")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_TIME_LIMIT": "120",
            "GRADTAPE_MAX_TIME_LIMIT": "300",
            "GRADTAPE_ALGORITHM_MAX_HVPS": "100000",
        },
        tmp / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


N = 64  # parameters


def chain(lines: int, depth: int = 1) -> dict:
    """sum(tanh(A ... tanh(A w)...)^2): `lines` lines of `depth` matrix products each, so
    one HVP applies hundreds of ops (and 700 x 15 take seconds to compile and record)."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((N, N)) / np.sqrt(N)
    program = ["h0 = w"]
    for i in range(1, lines + 1):
        expr = f"h{i - 1}"
        for _ in range(depth):
            expr = f"tanh(a @ {expr})"
        program.append(f"h{i} = {expr}")
    program += [f"loss = sum(h{lines} * h{lines})"]
    return {
        "variables": {"w": {"dtype": "float64", "shape": [N], "data": list(np.linspace(-1, 1, N))}},
        "inputs": {"a": {"dtype": "float64", "shape": [N, N], "data": a.ravel().tolist()}},
        "program": program,
    }


def hang_up_while_computing(srv: Server, path: str, body: dict) -> None:
    """POST `body` on a raw socket, wait until the one worker computes it (an event:
    gradtape_workers_busy, not a sleep), then hang up before any answer came."""
    with _sent(srv, path, body) as sock:
        _until(srv, lambda m: _counter(m, "gradtape_workers_busy") == 1)
        # The answer has not come: the request is still computing.
        sock.setblocking(False)
        try:
            early = sock.recv(4096)
        except BlockingIOError:
            return
        raise AssertionError(f"answered before the hang-up: {early[:500]!r}")


def busy(srv: Server) -> bool:
    workers = httpx.get(f"{srv.base_url}/readyz", timeout=5).json()["workers"]
    return any(w["state"] == "busy" for w in workers)


def quick_gradient(srv: Server) -> None:
    """A small gradient, end to end (it needs the one worker), answered right."""
    r = httpx.post(
        f"{srv.base_url}/v1/gradient",
        timeout=60,
        json={"definition": {"variables": {"x": 3.0}, "program": ["y = x * x"]}, "target": "y"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["gradients"]["x"]["data"] == [6.0]


def stopped_by_its_cancel_flag(srv: Server, before: str) -> None:
    """After a hang-up: the one worker goes idle, and it is the same worker, stopped at
    its next op by its cancel flag. Events, not a clock (issue 27, item 13): a worker
    that went on computing would stay busy for minutes (the guard of _until turns that
    into a failure) or, past cancel_grace, be killed and replaced, which
    gradtape_worker_restarts_total counts; the request ended as cancelled
    (gradtape_errors_total{type="cancelled"}), not answered."""
    _until(srv, lambda m: _counter(m, "gradtape_workers_busy") == 0)
    after = _metrics(srv)
    assert _counter(after, "gradtape_worker_restarts_total") == _counter(
        before, "gradtape_worker_restarts_total"
    )
    assert _counter(after, "gradtape_errors_total", 'type="cancelled"') == (
        _counter(before, "gradtape_errors_total", 'type="cancelled"') + 1
    )
    # It was handed to the worker (it computed, then stopped), not cancelled in the queue.
    assert _counter(after, "gradtape_worker_requests_total") > _counter(
        before, "gradtape_worker_requests_total"
    )


def test_a_disconnected_trace_frees_the_worker_and_keeps_the_tape(solo: Server) -> None:
    base = solo.base_url
    r = httpx.post(f"{base}/v1/tapes", json={"definition": chain(40), "target": "loss"}, timeout=60)
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    v = {"w": {"dtype": "float64", "shape": [N], "data": list(np.cos(np.arange(N)))}}
    before = httpx.post(f"{base}/v1/tapes/{tape}/hvp", json={"vector": v}, timeout=60)
    assert before.status_code == 200, before.text

    # Alone, this trace runs for minutes (100,000 HVPs one at a time, 300 s allowed).
    metrics = _metrics(solo)
    hang_up_while_computing(
        solo,
        f"/v1/tapes/{tape}/trace",
        {
            "method": "hutchinson",
            "max_hvps": 100000,
            "batch_size": 1,
            "max_seconds": 300,
            "time_limit": 300,
        },
    )
    # The worker stops at its next op and is free again: the next request (which needs
    # that one worker) is answered.
    stopped_by_its_cancel_flag(solo, metrics)
    quick_gradient(solo)
    assert not busy(solo)
    # The tape is whole: the same HVP, bit for bit.
    after = httpx.post(f"{base}/v1/tapes/{tape}/hvp", json={"vector": v}, timeout=60)
    assert after.status_code == 200, after.text
    # (all but execution: the trace's passes of this vector layout compiled it since)
    same, was = after.json(), before.json()
    assert same.pop("execution") is not None and was.pop("execution") is not None
    assert same == was
    assert "Traceback" not in Path(solo.log).read_text()


def test_a_disconnected_tape_recording_leaves_no_tape(solo: Server) -> None:
    base = solo.base_url
    held = len(httpx.get(f"{base}/v1/tapes", timeout=10).json()["tapes"])
    # Compiling and recording 10,500 products takes seconds: hang up in the middle.
    metrics = _metrics(solo)
    hang_up_while_computing(
        solo, "/v1/tapes", {"definition": chain(700, 15), "target": "loss", "time_limit": 300}
    )
    stopped_by_its_cancel_flag(solo, metrics)
    quick_gradient(solo)
    assert len(httpx.get(f"{base}/v1/tapes", timeout=10).json()["tapes"]) == held


def test_a_queued_request_whose_client_left_never_runs(solo: Server) -> None:
    """Two long requests: the first computes, the second waits; both clients hang up.
    Neither holds the worker afterwards, and the queued one is never handed to it.

    Events, not a clock (issue 27, item 13): the second is sent once the worker is busy
    with the first, its client leaves once it is queued, and the first's once the queue
    is empty again; then, the worker idle, what it was handed is counted
    (gradtape_worker_requests_total): the first request, then the small gradient that
    follows, never the one that left the queue."""
    long = {"definition": chain(700, 14), "target": "loss", "time_limit": 300}
    before = _handed(solo)
    with _sent(solo, "/v1/gradient", long) as computing:
        _until(solo, lambda m: _counter(m, "gradtape_workers_busy") == 1)
        with _sent(solo, "/v1/gradient", long):
            _until(solo, lambda m: _counter(m, "gradtape_queue_depth") == 1)
        # Its client gone, the queued request leaves the queue; the first still computes.
        _until(solo, lambda m: _counter(m, "gradtape_queue_depth") == 0)
        computing.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            early = computing.recv(4096)
            raise AssertionError(f"answered before the hang-up: {early[:500]!r}")
    _until(solo, lambda m: _counter(m, "gradtape_workers_busy") == 0)
    quick_gradient(solo)  # the worker serves the next request
    assert _handed(solo) - before == 2  # the first long request and the quick gradient


@contextlib.contextmanager
def _sent(srv: Server, path: str, body: dict) -> Iterator[socket.socket]:
    """POST `body` on a raw socket, held open (the request computes or waits) until the
    block ends, when the client hangs up."""
    url = urlsplit(srv.base_url)
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        yield sock


def _metrics(srv: Server) -> str:
    return httpx.get(f"{srv.base_url}/metrics", timeout=10).text


def _counter(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (over its labels; those with `label`, such as
    'type="cancelled"', when given)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{")) and label in line
    )


def _handed(srv: Server) -> float:
    return _counter(_metrics(srv), "gradtape_worker_requests_total")


def _until(srv: Server, ready: Callable[[str], bool], guard: float = 120.0) -> None:
    """Poll /metrics until `ready` holds. `guard` only stops a hang: no assertion
    depends on how soon it holds."""
    deadline = time.monotonic() + guard
    while not ready(_metrics(srv)):
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.05)
