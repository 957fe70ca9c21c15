"""The operations endpoints (/healthz, /readyz, /metrics) and the documentation pages,
which render with no internet: every asset is served by the app itself."""

from __future__ import annotations

import re

import httpx

from service.api.schemas import GRADIENT_EXAMPLE
from tests.service.conftest import start_server, stop_server
from tests.service.test_tapes import DEFN
from tests.service.wire import post


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
