"""The SDK's side of jobs (issue 14, item 2) against the live server: `progress=` runs
an estimator, a jacobian or a Hessian as a server-side job and answers exactly what the
synchronous call answers; `progress=True` draws a tqdm bar; Ctrl-C (a real
KeyboardInterrupt in the main thread) and a cancelled asyncio task cancel the job on
the server and free its worker; `client.job(id)` and `client.jobs()` follow jobs."""

from __future__ import annotations

import _thread
import asyncio
import threading
import time

import gradtape.client as gc
import numpy as np
import pytest

from tests.service.conftest import Server
from tests.service.test_cancel import N, chain

LONG = {
    "method": "hutchinson",
    "max_hvps": 5000,
    "batch_size": 1,
    "max_seconds": 55.0,
    "time_limit": 60.0,
}


def definition() -> dict:
    """chain(40) with NumPy arrays (the SDK sends them in their dtype)."""
    d = chain(40)
    return {
        "variables": {"w": np.asarray(d["variables"]["w"]["data"], dtype=np.float64)},
        "inputs": {"a": np.asarray(d["inputs"]["a"]["data"], dtype=np.float64).reshape(N, N)},
        "program": d["program"],
    }


def workers(ready: dict) -> dict[int, tuple[int, int]]:
    """Each worker's (pid, restarts): a worker killed and replaced changes both."""
    return {w["index"]: (w["pid"], w["restarts"]) for w in ready["workers"]}


def all_idle(ready: dict) -> bool:
    return all(w["state"] == "idle" for w in ready["workers"])


GUARD = 120.0  # seconds: only turns a hang into a failure; nothing asserts how soon


def test_estimators_as_jobs_answer_as_the_synchronous_calls(client: gc.Client) -> None:
    with client.tape(definition(), "loss") as tape:
        seen: list[gc.JobStatus] = []
        eig = tape.eigenvalues(3, max_hvps=N, tol=1e-300, progress=seen.append)
        sync = tape.eigenvalues(3, max_hvps=N, tol=1e-300)
        np.testing.assert_array_equal(eig.eigenvalues, sync.eigenvalues)
        assert (eig.hvps, eig.stopped) == (sync.hvps, sync.stopped)
        assert seen[-1].state == "succeeded" and seen[-1].done
        running = [s for s in seen if s.state == "running" and s.progress]
        assert running, [s.state for s in seen]
        assert all(s.progress["total"] == N and s.progress["unit"] == "hvps" for s in running)
        assert seen[-1].progress["done"] == N

        seen.clear()
        trace = tape.trace(method="hutchinson", max_hvps=400, batch_size=4, progress=seen.append)
        assert trace.trace == tape.trace(method="hutchinson", max_hvps=400, batch_size=4).trace
        estimates = [s.progress["estimate"] for s in seen if s.progress]
        assert estimates and np.isfinite(estimates).all()

        x = tape.solve(damping=10.0, progress=lambda s: None)
        np.testing.assert_array_equal(x.solution["w"], tape.solve(damping=10.0).solution["w"])

        # A failure is the synchronous call's exception.
        with pytest.raises(gc.InvalidRequest) as job_error:
            tape.eigenvalues(N + 1, progress=lambda s: None)
        with pytest.raises(gc.InvalidRequest) as sync_error:
            tape.eigenvalues(N + 1)
        assert job_error.value.detail == sync_error.value.detail


def test_stateless_hessian_and_jacobian_as_jobs(client: gc.Client) -> None:
    rng = np.random.default_rng(5)
    m = rng.standard_normal((40, 40))
    d = {
        "variables": {"w": rng.standard_normal(40)},
        "inputs": {"m": m},
        "program": ["z = tanh(m @ w)", "loss = sum(z * z)"],
    }
    rows: list[dict] = []
    h = client.hessian(d, "loss", "w", progress=lambda s: s.progress and rows.append(s.progress))
    np.testing.assert_array_equal(h.hessian, client.hessian(d, "loss", "w").hessian)
    assert rows and rows[-1]["unit"] == "rows" and rows[-1]["total"] == 40
    j = client.jacobian(d, "z", "w", allow_unused=True, progress=lambda s: None)
    z = np.tanh(m @ d["variables"]["w"])
    np.testing.assert_allclose(j.jacobians, (1 - z**2)[:, None] * m, rtol=1e-12, atol=1e-12)


def test_progress_true_draws_a_tqdm_bar(client: gc.Client, capsys: pytest.CaptureFixture) -> None:
    with client.tape(definition(), "loss") as tape:
        tape.trace(method="hutchinson", max_hvps=200, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "trace" in err and "200/200" in err and "estimate=" in err, err[-500:]


def test_ctrl_c_cancels_the_job_and_frees_the_worker(server: Server) -> None:
    """Events, not a clock (issue 27, item 13): Ctrl-C comes once the job has counted
    progress, and the worker that ran it is seen idle again, the same process (one that
    went on computing would stay busy for a minute, or be killed and replaced after the
    server's cancel_grace)."""
    with gc.Client(server.base_url) as client, client.tape(definition(), "loss") as tape:
        before = workers(client.ready())
        statuses: list[gc.JobStatus] = []
        under_way = threading.Event()

        def seen(status: gc.JobStatus) -> None:
            statuses.append(status)
            if status.state == "running" and (status.progress or {}).get("done"):
                under_way.set()

        # A real Ctrl-C: KeyboardInterrupt raised in this (the main) thread while the
        # client sleeps between polls or waits for an answer, once the job is under way.
        def interrupt() -> None:
            if under_way.wait(GUARD):
                _thread.interrupt_main()

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            tape.trace(**LONG, progress=seen)
        assert under_way.is_set(), [s.state for s in statuses]
        job = client.job(statuses[-1].id)
        status = job.status()
        assert status.state == "cancelled"
        assert statuses[-1].state == "running" and statuses[-1].progress["done"] > 0
        assert status.progress is None or status.progress["done"] < LONG["max_hvps"]
        deadline = time.monotonic() + GUARD
        while not all_idle(ready := client.ready()):
            assert time.monotonic() < deadline, ready
            time.sleep(0.01)
        assert workers(ready) == before
        with pytest.raises(gc.JobCancelled):
            job.wait()
        assert job.id in [s.id for s in client.jobs()]
        job.cancel()  # cancelled again: it stays as it was
        assert job.status().state == "cancelled"
        assert job.id in [s.id for s in client.jobs()]


def test_a_cancelled_task_cancels_its_job(server: Server) -> None:
    """As Ctrl-C: the task is cancelled once the job has counted progress, and its
    worker is seen idle again, the same process."""

    async def main() -> None:
        async with gc.AsyncClient(server.base_url) as client:
            tape = await client.tape(definition(), "loss")
            async with tape:
                before = workers(await client.ready())
                statuses: list[gc.JobStatus] = []
                task = asyncio.ensure_future(tape.trace(**LONG, progress=statuses.append))
                while not (statuses and (statuses[-1].progress or {}).get("done")):
                    assert not task.done(), task
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                status = await client.job(statuses[-1].id).status()
                assert status.state == "cancelled"
                deadline = time.monotonic() + GUARD
                while not all_idle(ready := await client.ready()):
                    assert time.monotonic() < deadline, ready
                    await asyncio.sleep(0.01)
                assert workers(ready) == before

    asyncio.run(main())


def test_a_job_by_id(client: gc.Client) -> None:
    with client.tape(definition(), "loss") as tape:
        # Started by some other program: the raw API's "async": true.
        doc = client._run(
            client._core.call("POST", f"/v1/tapes/{tape.id}/trace", {"max_hvps": 64, "async": True})
        )
        job = client.job(doc["job_id"])
        assert repr(job) == f"Job({doc['job_id']!r})"
        answer = job.wait(progress=lambda s: None)
        assert answer["trace"] == tape.trace(max_hvps=64).trace
        assert job.status().state == "succeeded"
        assert job.result() == answer
