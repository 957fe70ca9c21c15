"""The worker pool: a request past its time limit, and a worker killed mid-request, each
get a clear problem response while the other requests carry on; the worker is replaced
and the next request is fine. Then the pool on its own: routing to a worker, the queue
bound."""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from service.api.schemas import GRADIENT_EXAMPLE
from service.core.config import Settings
from service.pool import ComputeFailed, PoolBusy
from service.pool.local import WorkerPool
from tests.service.conftest import Server, own_server
from tests.service.wire import num, post, problem, t64

# About two seconds of matrix products per pass on one core (2000 x 2000 float32).
SLOW = {
    "definition": {
        "inputs": {"v": t64(np.linspace(0, 1, 2000))},
        "program": [
            "a = broadcast_to(v, (2000, 2000)) * 0.001",
            *[f"m{i} = tanh({'a' if i == 0 else f'm{i - 1}'} @ a)" for i in range(8)],
            "s = sum(m7)",
        ],
    },
    "target": "s",
    "sources": ["v"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of this module's own with the compute-cost guard off: these tests need a
    request that runs past its time limit (SLOW), which the guard would refuse before it
    runs; the guard has tests of its own (test_cost.py)."""
    with own_server(tmp_path_factory.mktemp("workers"), cost_flops_per_second="0") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


def _workers(client: httpx.Client) -> list[dict]:
    response = client.get("/readyz")
    body = response.json()
    return body["workers"]


def _busy_worker(client: httpx.Client, running: threading.Thread) -> dict | None:
    """The worker seen busy while `running` (the request's thread) is alive; None when
    the request ended first: a worker killed by a 1 s time limit can be busy, killed and
    replaced between two polls on a loaded machine. No deadline of its own: the request's
    client timeout bounds the wait."""
    while running.is_alive():
        busy = [w for w in _workers(client) if w["state"] == "busy"]
        if busy:
            return busy[0]
        time.sleep(0.02)
    return None


def _in_background(base_url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []

    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=60.0) as c:
            result.append(c.post("/v1/gradient", json=body))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_time_limit(server, client) -> None:
    before = {w["index"]: w for w in server.wait_ready()["workers"]}
    thread, result = _in_background(server.base_url, {**SLOW, "time_limit": 1.0})
    _busy_worker(client, thread)
    for _ in range(5):  # the other worker keeps answering meanwhile
        assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    thread.join(60)
    found = problem(result[0], 504, "time-limit")
    assert "1 s" in found["detail"] and found["time_limit"] == 1.0
    after = {w["index"]: w for w in server.wait_ready()["workers"]}
    # the one worker that ran it was replaced (whether or not a poll saw it busy)
    (index,) = [i for i in after if after[i]["generation"] != before[i]["generation"]]
    assert after[index]["pid"] != before[index]["pid"]
    assert after[index]["generation"] == before[index]["generation"] + 1
    assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    assert 'reason="timeout"' in client.get("/metrics").text


def test_killed_worker(server, client) -> None:
    server.wait_ready()
    thread, result = _in_background(server.base_url, SLOW)
    victim = _busy_worker(client, thread)
    assert victim is not None, result  # SLOW runs until its time limit: busy is seen
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(30)
    found = problem(result[0], 502, "worker-crashed")
    assert "SIGKILL" in found["detail"] and "replaced" in found["detail"]
    assert result[0].headers["retry-after"] == "1"
    after = {w["index"]: w for w in server.wait_ready()["workers"]}
    assert after[victim["index"]]["pid"] != victim["pid"]
    assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    assert 'reason="crash"' in client.get("/metrics").text


def _wait_dead(pid: int) -> None:
    """Until the server can reap the process: its main thread a zombie and no other thread
    left in /proc/<pid>/task, or the process gone. Not every listed thread a zombie: after
    SIGKILL the main thread and the others turn zombie at once, but the others stay listed
    until each is released, and until the last one is, the process holds its sockets and
    its parent's waitpid does not report it (a request sent then still reaches it)."""
    for _ in range(6000):  # a bound that only stops a hang: minutes, however loaded
        try:
            threads = os.listdir(f"/proc/{pid}/task")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(") ")[2][:1]
        except (FileNotFoundError, ProcessLookupError):  # reaped already
            return
        if threads == [str(pid)] and state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not exit")


def test_idle_worker_death_spares_the_next_request(server, client) -> None:
    victim = server.wait_ready()["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    _wait_dead(victim["pid"])
    for _ in range(4):  # served by whichever worker is up; none is sent to the dead one
        assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    after = server.wait_ready()["workers"][0]
    assert after["pid"] != victim["pid"]


# ---- the pool on its own ----------------------------------------------------------------


def _payload(size: int, products: int) -> dict:
    from service.api.payloads import gradient
    from service.api.schemas import GradientRequest

    body = {
        **SLOW,
        "definition": {
            "inputs": {"v": t64(np.linspace(0, 1, size))},
            "program": [
                f"a = broadcast_to(v, ({size}, {size})) * 0.001",
                *[f"m{i} = tanh({'a' if i == 0 else f'm{i - 1}'} @ a)" for i in range(products)],
                f"s = sum(m{products - 1})",
            ],
        },
    }
    return gradient(GradientRequest.model_validate(body), Settings()).payload


def test_routing_to_a_worker_and_the_queue_bound() -> None:
    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=2, queue_size=0, time_limit=20))
        await pool.start()
        try:
            pids = [w.pid for w in pool.workers()]
            for index in (1, 0, 1):
                reply = await pool.submit("ping", None, worker=index)
                assert (reply.worker, reply.result["pid"]) == (index, pids[index])
            payload = _payload(1000, 3)  # a few tenths of a second
            running = [
                asyncio.create_task(pool.submit("gradient", payload, worker=i)) for i in (0, 1)
            ]
            # Both computing (an event: the pool's own states, no sleep), then at once,
            # with no await between, a third request: no room for it.
            while [w.state for w in pool.workers()] != ["busy", "busy"]:
                assert not any(task.done() for task in running), running
                await asyncio.sleep(0.001)
            with pytest.raises(PoolBusy, match="requests are already waiting"):
                await pool.submit("ping", None)  # both busy, no room to wait
            replies = await asyncio.gather(*running)
            assert [r.worker for r in replies] == [0, 1]
            assert replies[0].result["value"] == replies[1].result["value"]
            with pytest.raises(ComputeFailed) as failed:
                await pool.submit("nope", None)
            assert failed.value.error["type"] == "internal"
        finally:
            await pool.close()
        assert all(w.state == "down" for w in pool.workers())

    asyncio.run(scenario())


def test_requests_wait_in_the_queue_in_order() -> None:
    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=1, queue_size=4, time_limit=20))
        await pool.start()
        try:
            first = asyncio.create_task(pool.submit("gradient", _payload(1000, 2)))
            while pool.workers()[0].state != "busy":  # an event, not a sleep
                assert not first.done(), f"the first request ended unseen: {first}"
                await asyncio.sleep(0.001)
            waiting = [asyncio.create_task(pool.submit("ping", None)) for _ in range(3)]
            while pool.queue_depth < 3:  # each queued once its task has run
                assert not first.done(), "the first request ended before the others queued"
                await asyncio.sleep(0)
            assert pool.queue_depth == 3
            await first
            assert [(await w).worker for w in waiting] == [0, 0, 0]
            assert pool.queue_depth == 0
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_full_queue_answers_503_with_retry_after() -> None:
    """The app in this process (its own pool of one worker, no queue), over ASGI."""
    from service.api.app import create_app

    async def scenario() -> None:
        app = create_app(Settings(workers=1, queue_size=0, retry_after=3))
        slow = {
            **SLOW,
            "definition": {
                **SLOW["definition"],
                "program": [
                    "a = broadcast_to(v, (1000, 2000)) * 0.001",
                    "m = tanh(a @ transpose(a))",
                    "s = sum(m)",
                ],
            },
        }
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                running = asyncio.create_task(c.post("/v1/gradient", json=slow))
                while app.state.pool.workers()[0].state != "busy":
                    assert not running.done(), f"the slow request ended unseen: {running}"
                    await asyncio.sleep(0.005)
                refused = await c.post("/v1/gradient", json=GRADIENT_EXAMPLE)
                found = problem(refused, 503, "busy")
                assert refused.headers["retry-after"] == "3" and "busy" in found["detail"]
                assert (await running).status_code == 200
                assert (await c.post("/v1/gradient", json=GRADIENT_EXAMPLE)).status_code == 200
        unavailable = httpx.ASGITransport(app=app)  # after shutdown: 503, not a crash
        async with httpx.AsyncClient(transport=unavailable, base_url="http://app") as c:
            problem(await c.post("/v1/gradient", json=GRADIENT_EXAMPLE), 503, "unavailable")

    asyncio.run(scenario())


def test_a_request_cancelled_as_a_worker_takes_it_never_reaches_the_worker() -> None:
    """The flake of tests/service/test_jobs.py: a job queued behind another, cancelled in
    the very moment the freed worker took it (dispatched, its frame not yet written), was
    sent anyway, and the worker computed it for nobody up to its time limit (the cancel
    flag named no request yet). Here the cancel comes from the job's own `started`
    callback, which the pool calls as it hands the request to the worker: its frame is
    never sent (the pool's observer counts each request handed to a worker), and the
    worker answers the next request, the same worker (not one replaced after
    cancel_grace). Counted, not timed (issue 27, item 13)."""
    from service.pool import PoolObserver, calls

    class Handed(PoolObserver):
        def __init__(self) -> None:
            self.requests = 0

        def request_started(self, worker: int) -> None:
            self.requests += 1

    async def scenario() -> None:
        handed = Handed()
        pool = WorkerPool(Settings(workers=1, time_limit=60), handed)
        await pool.start()
        try:
            first = asyncio.create_task(pool.submit("gradient", _payload(1000, 2)))
            while pool.workers()[0].state != "busy":
                assert not first.done(), f"the first request ended unseen: {first}"
                await asyncio.sleep(0.001)
            worker = pool.workers()[0]
            taken: list[asyncio.Task] = []
            context = contextvars.Context()
            context.run(calls.current.set, calls.Watch(started=lambda: taken[0].cancel()))
            long = _payload(1000, 24)  # seconds of matrix products, if it ever ran
            taken.append(asyncio.create_task(pool.submit("gradient", long), context=context))
            await first
            with pytest.raises(asyncio.CancelledError):
                await taken[0]
            # (a guard against a hang only: the answer to wait for is the ping's)
            reply = await asyncio.wait_for(pool.submit("ping", None), 120)
            assert reply.worker == 0 and reply.generation == worker.generation
            assert handed.requests == 1  # the first; the cancelled one never was
            assert (pool.workers()[0].pid, pool.workers()[0].restarts) == (
                worker.pid,
                worker.restarts,
            )
        finally:
            await pool.close()

    asyncio.run(scenario())


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
@pytest.mark.parametrize("setting, expected", [("true", "1"), ("false", "0")])
def test_the_allocator_setting_reaches_the_workers_before_the_engine(
    setting: str, expected: str, tmp_path, client: httpx.Client
) -> None:
    """The engine tunes the allocator at import unless GRADTAPE_TUNE_ALLOCATOR says no; a
    worker imports it before it hears its options, so worker_tune_allocator must be in its
    environment from the start; its answers are the same either way."""
    from engine.allocator import OPT_OUT
    from service.pool.local import ALLOCATOR_VARIABLE
    from tests.service.conftest import start_server, stop_server

    assert ALLOCATOR_VARIABLE == OPT_OUT  # the service names it without importing the engine
    srv = start_server(
        {"GRADTAPE_WORKER_TUNE_ALLOCATOR": setting, "GRADTAPE_WORKERS": "1"},
        tmp_path / "server.log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as own:
            pid = own.get("/readyz").json()["workers"][0]["pid"]
            assert _environment(pid)[OPT_OUT] == expected
            body = post(own, "/v1/gradient", GRADIENT_EXAMPLE)
        # (all but execution: how each server's worker ran it depends on what it saw)
        other = post(client, "/v1/gradient", GRADIENT_EXAMPLE)
        assert body.pop("execution") is not None and other.pop("execution") is not None
        assert body == other
    finally:
        stop_server(srv)
