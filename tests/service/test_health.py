"""The operations endpoints (/healthz, /readyz, /metrics) and the documentation pages,
which render with no internet: every asset is served by the app itself. Readiness and
liveness of the workers: /readyz reports a worker that does not answer and never gets it
replaced; the pool replaces it itself past worker_liveness_timeout."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from service.api.schemas import GRADIENT_EXAMPLE
from service.core.config import Settings
from service.pool.base import PoolBusy
from service.pool.local import WorkerPool
from tests.service.conftest import own_server, start_server, stop_server
from tests.service.test_tapes import DEFN
from tests.service.wire import num, post, problem


def test_healthz(client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_lists_the_workers(client) -> None:
    body = client.get("/readyz").json()
    assert body["status"] == "ready"
    assert [w["index"] for w in body["workers"]] == [0, 1]
    for worker in body["workers"]:
        assert worker["state"] in ("idle", "busy") and worker["device"] == "cpu"
        assert worker["pid"] > 0 and worker["generation"] >= 1
        assert worker["silent_seconds"] >= 0  # since its last answer (or its start)


def test_metrics(client) -> None:
    post(client, "/v1/gradient", GRADIENT_EXAMPLE)
    client.get("/nowhere")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert re.search(
        r'gradtape_http_requests_total\{method="POST",route="/v1/gradient",status="200"\} \d', text
    )
    assert (
        'gradtape_http_request_duration_seconds_bucket{le="0.005",method="POST",'
        'route="/v1/gradient"}' in text
    )
    assert 'gradtape_errors_total{type="not-found"}' in text
    assert re.search(r'gradtape_worker_busy_seconds_total\{worker="0"\} [0-9.e-]+', text)
    assert "gradtape_queue_depth 0.0" in text
    assert "gradtape_workers_up 2.0" in text
    # (no API keys on this server: no key's slot or line; tests/service/test_fairness.py
    # waits on them where keys hold slots)
    assert "gradtape_key_slots_held 0.0" in text and "gradtape_key_requests_waiting 0.0" in text


def test_swagger_ui_is_served_locally(client) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "http" not in re.sub(r"window\.location\.origin", "", page.text.split("<body>")[1])
    assets = re.findall(r'(?:src|href)="(/static/docs/[^"]+)"', page.text)
    assert len(assets) == 3
    for asset in assets:
        assert client.get(asset).status_code == 200
    bundle = client.get("/static/docs/swagger-ui-bundle.js").text
    version = re.search(r'PACKAGE_VERSION:"(\d+)\.\d+\.\d+"', bundle)
    assert version and int(version.group(1)) >= 5  # OpenAPI 3.1 needs Swagger UI 5


def test_the_root_leads_a_browser_to_the_docs(client) -> None:
    """Issue 27, item 9: GET / was a 404; a browser (Accept: text/html) is redirected to
    /docs, a program gets the links as JSON."""
    browser = {"accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    r = client.get("/", headers=browser)
    assert r.status_code == 307 and r.headers["location"] == "/docs"
    assert client.get("/", headers=browser, follow_redirects=True).status_code == 200
    links = client.get("/", headers={"accept": "application/json"})
    assert links.status_code == 200 and links.json()["docs"] == "/docs"
    assert client.get(links.json()["openapi"]).status_code == 200


def test_redoc_is_served_locally(client) -> None:
    page = client.get("/redoc")
    assert page.status_code == 200 and "fonts.googleapis" not in page.text
    assert client.get("/static/docs/redoc.standalone.js").status_code == 200


def test_openapi_document(client) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    operations = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert operations == {
        "compute_gradient",
        "compute_jacobian",
        "compute_hessian",
        "compute_hvp",
        "list_ops",
        "check_health",
        "check_readiness",
        "read_metrics",
        "create_tape",
        "list_tapes",
        "read_tape",
        "update_tape",
        "delete_tape",
        "compute_tape_hvp",
        "compute_tape_gradient",
        "compute_tape_jacobian",
        "compute_tape_eigenvalues",
        "estimate_tape_trace",
        "estimate_tape_diagonal",
        "estimate_tape_spectral_density",
        "solve_tape",
        "compute_tape_influence",
        "estimate_tape_frobenius_norm",
        "compute_tape_per_example",
        "compute_per_example",
        "compute_tape_kfac",
        "fit_tape_laplace",
        "list_laplace_fits",
        "read_laplace_fit",
        "delete_laplace_fit",
        "compute_laplace_evidence",
        "compute_laplace_predictive",
        "sample_laplace_posterior",
        "create_model",
        "list_models",
        "read_model",
        "delete_model",
        "list_jobs",
        "read_job",
        "read_job_result",
        "stream_job_events",
        "cancel_job",
        "put_onnx_model",
        "put_dataset",
        "list_datasets",
        "read_dataset",
        "delete_dataset",
    }


def test_an_operators_metrics_directory_starts_each_run_afresh(tmp_path) -> None:
    """PROMETHEUS_MULTIPROC_DIR set by the operator, not there yet: made. Each run counts
    from zero (an earlier run's metric files removed at start), and the other files there
    (here the store itself, and one of the operator's) are left as they are."""
    folder = tmp_path / "metrics" / "not-yet"
    settings = {
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
        "GRADTAPE_STORE_PATH": str(folder / "store.db"),
        "GRADTAPE_WORKERS": "1",
    }
    healthz = re.compile(
        r'^gradtape_http_requests_total\{method="GET",route="/healthz",[^}]*\} (\S+)$', re.M
    )
    tape_id = None
    for run, calls in enumerate((3, 2)):
        server = start_server(settings, tmp_path / f"server-{run}.log")
        try:
            if tape_id is None:
                (folder / "operators.db").write_bytes(b"not a metric file")
                stored = httpx.post(
                    f"{server.base_url}/v1/tapes", json={"definition": DEFN, "target": "loss"}
                )
                assert stored.status_code == 201, stored.text
                tape_id = stored.json()["tape_id"]
            else:  # the store survived the restart, with the tape in it
                assert httpx.get(f"{server.base_url}/v1/tapes/{tape_id}").status_code == 200
            for _ in range(calls):
                assert httpx.get(f"{server.base_url}/healthz").status_code == 200
            counted = healthz.findall(httpx.get(f"{server.base_url}/metrics").text)
            assert sum(float(c) for c in counted) == calls  # this run's, not the last one's
        finally:
            stop_server(server)
    assert (folder / "operators.db").read_bytes() == b"not a metric file"


# ----------------------------------------------------------------------------------------
# Readiness reports, liveness replaces
# ----------------------------------------------------------------------------------------


def _readiness(client: httpx.Client) -> tuple[int, dict]:
    """/readyz's status and its one worker (from the 200 or the 503 problem alike)."""
    r = client.get("/readyz")
    assert r.status_code in (200, 503), r.text
    (worker,) = r.json()["workers"]
    return r.status_code, worker


def _poll(client: httpx.Client, until: Callable[[dict], bool]) -> dict:
    """/readyz's worker once `until` holds. The deadline is a guard against a hang only
    (what is waited for is the pool's own state), far above any loaded machine's wait."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        _, worker = _readiness(client)
        if until(worker):
            return worker
        time.sleep(0.05)
    raise AssertionError(f"/readyz never showed the state awaited: {worker}")


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _stop_a_ready_worker(srv) -> dict:
    """SIGSTOP the worker /readyz shows ready, and return what it showed. With a short
    liveness timeout a loaded machine can get even a healthy worker replaced between the
    answer and the signal (its pid then gone): the new one is taken instead."""
    for _ in range(5):
        (worker,) = srv.wait_ready()["workers"]
        try:
            _stopped(worker["pid"])
        except ProcessLookupError:
            continue
        return worker
    raise AssertionError("the worker was replaced five times before it could be stopped")


def _resumed(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # replaced (and reaped) already


def test_readyz_reports_a_silent_worker_and_never_replaces_it(tmp_path) -> None:
    """A worker that stops answering (SIGSTOP: a hung or starved process) is shown
    `unresponsive` and the server not ready (503), however often /readyz is asked, and is
    never replaced for it: the same process answers again once it resumes (SIGCONT).
    The liveness timeout is out of reach here (an hour)."""
    settings = {
        "workers": "1",
        "worker_ping_interval": "0.1",
        "worker_ready_timeout": "0.5",
        "worker_liveness_timeout": "3600",
    }
    with (
        own_server(tmp_path, **settings) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as client,
    ):
        (before,) = srv.wait_ready()["workers"]
        _stopped(before["pid"])
        try:
            # Pinged by the pool (idle past the interval), unanswered past 0.5 s.
            _poll(client, lambda w: w["state"] == "unresponsive")
            for _ in range(20):  # (the old /readyz replaced it after one 5 s ping)
                found = problem(client.get("/readyz"), 503, "not-ready")
                (worker,) = found["workers"]
                assert "0 (unresponsive)" in found["detail"], found
                assert worker["state"] == "unresponsive"
                assert worker["silent_seconds"] > 0.5  # its ping has waited that long
                same = ("pid", "generation", "restarts")
                assert [worker[k] for k in same] == [before[k] for k in same]
            # (the gauge, read as /metrics is scraped, or copied each second by each of
            # several HTTP processes: polled until it says so)
            _poll(client, lambda w: "gradtape_workers_up 0.0" in client.get("/metrics").text)
        finally:
            _resumed(before["pid"])
        # Its ping answered: ready again, the very same process.
        (after,) = srv.wait_ready()["workers"]
        same = ("pid", "generation", "restarts")
        assert [after[k] for k in same] == [before[k] for k in same]
        assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
        assert "gradtape_worker_restarts_total{" not in client.get("/metrics").text


def test_a_worker_silent_past_the_liveness_timeout_is_replaced(tmp_path) -> None:
    """Liveness is the pool's: a worker that does not answer its ping within
    worker_liveness_timeout is killed and replaced, with the reason in the metrics and
    the log, and the new worker computes. (5 s: a healthy worker on a loaded machine
    answers a ping well within it; the test waits on the pool's state, not on a clock.)"""
    settings = {
        "workers": "1",
        "worker_ping_interval": "0.1",
        "worker_ready_timeout": "2",
        "worker_liveness_timeout": "5",
    }
    with (
        own_server(tmp_path, **settings) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as client,
    ):
        before = _stop_a_ready_worker(srv)
        try:
            _poll(client, lambda w: w["generation"] > before["generation"])
        finally:
            _resumed(before["pid"])
        (after,) = srv.wait_ready()["workers"]
        assert after["pid"] != before["pid"] and after["restarts"] >= 1
        metrics = client.get("/metrics").text
        assert re.search(
            r'^gradtape_worker_restarts_total\{reason="unresponsive",worker="0"\} [1-9]',
            metrics,
            re.M,
        ), metrics
        assert "did not answer a ping within 5 s" in srv.log.read_text()
        assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0


def _one_pinged_worker_and_no_queue(ready_timeout: float) -> WorkerPool:
    """A pool of one worker pinged every 50 ms, no queue places (queue_size 0), and a
    liveness timeout an hour off: the pool never replaces the worker during a test."""
    return WorkerPool(
        Settings(
            workers=1,
            queue_size=0,
            worker_ping_interval=0.05,
            worker_ready_timeout=ready_timeout,
            worker_liveness_timeout=3600,
        )
    )


def test_the_pools_own_ping_turns_no_request_away() -> None:
    """With no room in the queue (queue_size 0), a request that finds its worker
    answering the pool's ping waits for it instead of a 503 (the ping is the pool's, not
    a client's); here the ping waits on a stopped worker, which the pool leaves alone
    (readiness and liveness timeouts an hour off, so the ping stays fresh): the request
    runs once the worker resumes, on the same process."""

    async def scenario() -> None:
        pool = _one_pinged_worker_and_no_queue(ready_timeout=3500)
        await pool.start()
        try:
            (before,) = pool.workers()
            assert before.pid is not None
            _stopped(before.pid)
            try:
                # The pool's own state; the deadline only guards against a hang.
                async def pinging() -> None:
                    while (job := pool._workers[0].job) is None or job.kind != "ping":
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(pinging(), 300)
                assert [w.state for w in await pool.check()] == ["idle"]  # (a fresh ping)
                request = asyncio.create_task(pool.submit("ops", None))
                while pool.queue_depth == 0 and not request.done():
                    await asyncio.sleep(0.001)
                assert not request.done(), request  # waiting, not turned away
            finally:
                _resumed(before.pid)
            # (a guard against a hang only: what is awaited is the request's answer)
            reply = await asyncio.wait_for(request, 300)
            assert any(op["name"] == "matmul" for op in reply.result)
            (after,) = pool.workers()
            assert (reply.generation, after.pid, after.restarts) == (
                before.generation,
                before.pid,
                0,
            )
        finally:
            await pool.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("setting", ["-1", "nope"])
def test_a_bad_ping_interval_is_refused(setting: str, monkeypatch) -> None:
    monkeypatch.setenv("GRADTAPE_WORKER_PING_INTERVAL", setting)
    with pytest.raises(ValueError, match="worker_ping_interval"):
        Settings()


@pytest.mark.parametrize(("ready", "liveness"), [("5", "5"), ("30", "20")])
def test_a_readiness_timeout_not_below_the_liveness_timeout_is_refused(
    ready: str, liveness: str, monkeypatch
) -> None:
    """A silent worker must show unresponsive before it is replaced."""
    monkeypatch.setenv("GRADTAPE_WORKER_READY_TIMEOUT", ready)
    monkeypatch.setenv("GRADTAPE_WORKER_LIVENESS_TIMEOUT", liveness)
    with pytest.raises(ValueError, match=r"worker_ready_timeout .* must be below"):
        Settings()


def test_a_ping_unanswered_past_the_ready_timeout_does_not_hold_a_queue_place() -> None:
    """The pool's own ping lets a request wait beyond the queue's bound only while the
    ping is fresh: behind a worker already unresponsive, a request is turned away (503
    at once, PoolBusy) instead of piling up behind a hung process."""

    async def scenario() -> None:
        pool = _one_pinged_worker_and_no_queue(ready_timeout=0.2)
        await pool.start()
        try:
            (before,) = pool.workers()
            _stopped(before.pid)
            try:
                while pool.workers()[0].state != "unresponsive":
                    await asyncio.sleep(0.02)  # the pool's ping, unanswered past 0.2 s
                with pytest.raises(PoolBusy):
                    await pool.submit("gradient", GRADIENT_EXAMPLE)
            finally:
                _resumed(before.pid)
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))


@pytest.mark.parametrize(
    ("environment", "state", "failed"),
    [
        # numba's compiler switched off: the kernels are plain Python functions, which
        # warm-up cannot compile (a real failure: an operator debugging numba)
        ({"NUMBA_DISABLE_JIT": "1"}, "failed", 1),
        ({"GRADTAPE_KERNELS": "numpy"}, "off", 0),  # kernels switched off on purpose
    ],
)
def test_the_kernels_warm_up_shows_in_readyz_and_the_metrics(
    tmp_path, environment: dict[str, str], state: str, failed: int
) -> None:
    """A worker says where its compiled kernels' warm-up stands (its hello, then each of
    the pool's pings): /readyz shows it per worker, a failed one is counted by
    gradtape_workers_kernels_failed and its log says why, and the server is ready and
    right all the same (the NumPy paths answer)."""
    settings = {
        "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
        "GRADTAPE_WORKERS": "1",
        "GRADTAPE_WORKER_WARM_KERNELS": "true",  # (off in the other tests: tests/conftest.py)
        "GRADTAPE_WORKER_PING_INTERVAL": "0.1",
        **environment,
    }
    srv = start_server(settings, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            _poll(client, lambda w: w["kernels"] == state)  # (warming first, when failing)
            status, worker = _readiness(client)
            assert status == 200 and worker["state"] in ("idle", "busy"), worker
            gauge = f"gradtape_workers_kernels_failed {failed}.0"
            _poll(client, lambda w: gauge in client.get("/metrics").text)
            said = "kernel warm-up failed, the NumPy paths run" in srv.log.read_text()
            assert said == (state == "failed")
            assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
    finally:
        stop_server(srv)


def test_a_worker_that_is_never_pinged_still_shows_its_kernels_warm_up_end(tmp_path) -> None:
    """A worker answering requests is never pinged (nor is any with pings off): its
    answers themselves carry where its warm-up stands, so /readyz and the gauge do not
    keep the hello's `warming` for as long as traffic lasts (review r14)."""
    settings = {
        "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
        "GRADTAPE_WORKERS": "1",
        "GRADTAPE_WORKER_WARM_KERNELS": "true",
        "GRADTAPE_WORKER_PING_INTERVAL": "0",  # no pings: requests are all the pool hears
        "NUMBA_DISABLE_JIT": "1",  # warm-up fails (a real failure, as above)
    }
    srv = start_server(settings, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as client:
            # (the deadline guards against a hang only: each request's answer says the
            # state as of its end, and the warm-up fails within a second or so)
            deadline = time.monotonic() + 300
            while True:
                assert num(post(client, "/v1/gradient", GRADIENT_EXAMPLE)["value"]) == 31.0
                _, worker = _readiness(client)
                if worker["kernels"] == "failed" or time.monotonic() > deadline:
                    break
                assert worker["kernels"] == "warming", worker
                time.sleep(0.05)
            assert worker["kernels"] == "failed", worker
            assert "gradtape_workers_kernels_failed 1.0" in client.get("/metrics").text
    finally:
        stop_server(srv)
