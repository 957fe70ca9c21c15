"""The page at /ui (issue 31) in a real browser: Debian's headless Chromium, driven over
the DevTools protocol (tests/ui/browser.py), against `gradtape serve` with API keys on.

- The key is typed into the page and sent as the API expects; it never appears in a URL
  (the server's access log, which logs every request line, is searched for it).
- A job started through the API is watched from the page: its progress moves (the page
  received several reports, with growing HVP counts, before the job ended), then its
  result is drawn; the chart's data is the answer's, from GET /v1/jobs/{id}/result.
- Beside a curvature answer the page states the matrix it is of (the answer's
  `curvature_used`): the Hessian's density exact; a Monte-Carlo Fisher's trace with its
  samples, seed, reason and an approximate flag, drawn apart from the exact Fisher's.
- A cancel from the page stops a long job (the API then says cancelled, the worker
  is idle again).
- Screenshots are kept as test artifacts: tests/ui/artifacts/ (git-ignored).

Without Chromium (`apt-get install chromium`; .ci/run installs it) the browser tests skip,
saying so; the files and headers checks run anyway.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.ui.browser import CHROMIUM, Browser, browser

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "service" / "api" / "ui" / "static"
ARTIFACTS = Path(__file__).parent / "artifacts"
KEY = "ui-test-key-7f3a9c"

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (apt-get install chromium; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-server")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp / "data"),
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": KEY,
            "GRADTAPE_ACCESS_LOG": "true",  # every request line, to look for the key in
            "GRADTAPE_LOG_LEVEL": "info",
            "GRADTAPE_ALGORITHM_MAX_HVPS": "1000000",
            "GRADTAPE_TIME_LIMIT": "300",
            "GRADTAPE_MAX_TIME_LIMIT": "600",
        },
        tmp / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)
        assert KEY not in srv.log.read_text(), "the API key reached the server's log"


@pytest.fixture(scope="module")
def api(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60.0
    ) as c:
        yield c


@pytest.fixture(scope="module")
def page(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    with browser(tmp_path_factory.mktemp("chromium-profile")) as b:
        b.goto(f"{server.base_url}/ui")
        # Without a key the lists are refused, and the page says why.
        b.wait_for("document.getElementById('status').textContent.includes('requires an API key')")
        b.evaluate(
            f"document.getElementById('api-key').value = {json.dumps(KEY)};"
            "document.querySelector('#key-form button[type=submit]').click(); true"
        )
        b.wait_for("document.getElementById('status').textContent === 'key in use'")
        keyless = b.problems()  # the lists' 401s before the key was given, nothing else
        assert keyless and all("401" in p for p in keyless), keyless
        since = len(b.events)
        yield b
        problems = b.problems(since)
        assert problems == [], f"the page logged errors (CSP violations among them): {problems}"


def mlp(rng: np.random.Generator, batch: int, width: int) -> dict:
    """A one-hidden-layer tanh network's mean squared error: 2 * width**2 parameters,
    each HVP a few (batch x width x width) products."""

    def tensor(a: np.ndarray) -> dict:
        return {"dtype": "float64", "shape": list(a.shape), "data": a.ravel().tolist()}

    return {
        "variables": {
            "W1": tensor(rng.standard_normal((width, width)) / np.sqrt(width)),
            "W2": tensor(rng.standard_normal((width, width)) / np.sqrt(width)),
        },
        "inputs": {
            "X": tensor(rng.standard_normal((batch, width))),
            "Y": tensor(rng.standard_normal((batch, width))),
        },
        "program": ["h = tanh(X @ W1)", "out = h @ W2", "loss = mean((out - Y) ** 2)"],
    }


def start_job(api: httpx.Client, tape_id: str, kind: str, body: dict) -> str:
    r = api.post(f"/v1/tapes/{tape_id}/{kind}", json={**body, "async": True})
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


def watch_from_the_page(page: Browser, job_id: str) -> None:
    """Click the job's Watch button in the page's job list."""
    page.evaluate("gradtapeUI.refresh()")
    button = f"#jobs tr[data-job={json.dumps(job_id)}] button[data-action=watch]"
    page.wait_for(f"!!document.querySelector({json.dumps(button)})")
    page.evaluate(f"document.querySelector({json.dumps(button)}).click(); true")
    page.wait_for(f"gradtapeUI.watching && gradtapeUI.watching.id === {json.dumps(job_id)}")


EXACT = {"samples": None, "seed": None, "structure": None, "approximate": False, "reason": None}


def curvature_shown(page: Browser) -> dict:
    """What the result's curvature box shows (its facts by name, the exact/approximate
    flag, the reason), and whether it is drawn apart (the class and colour that mark an
    approximate answer)."""
    shown: dict = page.evaluate(
        """(() => {
          const box = document.getElementById('result-curvature');
          const facts = {};
          for (const dd of box.querySelectorAll('dd')) facts[dd.dataset.fact] = dd.textContent;
          const reason = box.querySelector('.reason');
          return {
            hidden: box.hidden,
            visible: box.getBoundingClientRect().height > 0,
            facts,
            flag: box.querySelector('.flag').textContent,
            approximate: box.classList.contains('approximate'),
            background: getComputedStyle(box).backgroundColor,
            reason: reason ? reason.textContent : null,
          };
        })()"""
    )
    assert not shown["hidden"] and shown["visible"], shown
    return shown


def job_state_shown(page: Browser) -> str:
    return str(page.evaluate("document.getElementById('job-state').textContent"))


# ------------------------------------------------------------------ files and headers


def test_vendored_chart_library_is_the_recorded_release() -> None:
    recorded = (STATIC / "vendor" / "VENDOR.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in recorded, name
    assert "v1.6.32" in (STATIC / "vendor" / "uPlot.iife.min.js").read_text()[:100]
    assert "MIT" in (STATIC / "vendor" / "LICENSE-uPlot").read_text()


def test_the_page_loads_nothing_from_elsewhere() -> None:
    html = (STATIC / "index.html").read_text()
    for url in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert url.startswith("/") or url == "data:,", url
    assert (
        "<script>" not in html
        and " on" not in re.sub(r"<!--.*?-->", "", html).lower().split("<body")[1].split(">")[0]
    )


def test_page_and_assets_are_served_with_a_strict_policy(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/ui")  # no key needed for the page itself
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = r.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert "default-src 'none'" in policy and r.headers["cache-control"] == "no-store"
    for asset in ("ui.js", "ui.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"):
        got = httpx.get(f"{server.base_url}/ui/assets/{asset}")
        assert got.status_code == 200 and got.content == (STATIC / asset).read_bytes()
    assert httpx.get(f"{server.base_url}/ui/assets/../__init__.py").status_code == 404
    assert httpx.get(f"{server.base_url}/ui/", follow_redirects=False).headers["location"] == "/ui"


# ----------------------------------------------------------------------------- browser


@needs_chromium
def test_lists_show_the_callers_things(page: Browser, api: httpx.Client) -> None:
    rng = np.random.default_rng(3)
    tape = api.post("/v1/tapes", json={**_target(), "definition": mlp(rng, 8, 4)}).json()
    assert api.put(
        "/v1/datasets/ui-points", json={"X": {"dtype": "float32", "shape": [2], "data": [1, 2]}}
    ).status_code in (200, 201)
    page.evaluate("gradtapeUI.refresh()")
    page.wait_for(
        f"document.querySelector('#tapes tbody').textContent.includes({json.dumps(tape['tape_id'][:10])})"
    )
    page.wait_for("document.querySelector('#datasets tbody').textContent.includes('ui-points')")
    workers = page.evaluate("document.querySelector('#workers tbody').textContent")
    assert "idle" in workers and "hidden" not in workers  # the key may see the pids


def _target() -> dict:
    return {"target": "loss", "sources": ["W1", "W2"]}


@needs_chromium
def test_a_job_moves_then_its_density_is_drawn(page: Browser, api: httpx.Client) -> None:
    rng = np.random.default_rng(31)
    tape = api.post("/v1/tapes", json={**_target(), "definition": mlp(rng, 400, 24)}).json()
    job_id = start_job(api, tape["tape_id"], "spectral-density", {"probes": 32, "steps": 240})
    # Watched at once (as a click on its row does, without waiting for the list): the
    # 7,680 HVPs take seconds, reported every 50 ms.
    page.evaluate(f"gradtapeUI.watch({json.dumps(job_id)}); true")
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'density'")
    assert job_state_shown(page) == "succeeded"
    # Progress moved: the page was handed several reports of the running job, each with
    # more HVPs done than the last, before the answer (32 x 240 HVPs) was in.
    history = page.evaluate("gradtapeUI.watching.history")
    done = [point[0] for point in history]
    assert len(done) >= 3 and done == sorted(set(done)), done
    assert done[0] < 32 * 240, done
    # The drawn density is the answer's.
    result = api.get(f"/v1/jobs/{job_id}/result").json()
    drawn = page.evaluate("gradtapeUI.charts.result.data")
    np.testing.assert_array_equal(drawn[0], result["grid"])
    np.testing.assert_array_equal(drawn[1], result["density"])
    stderr = np.array(result["stderr"])
    np.testing.assert_allclose(drawn[2], np.array(result["density"]) + 2 * stderr)
    assert "32 probes" in page.evaluate("document.getElementById('result-note').textContent")
    # The curvature it is of, as the answer states it: the Hessian itself, exact.
    assert result["curvature_used"] == {**EXACT, "kind": "hessian"}
    shown = curvature_shown(page)
    assert shown["facts"] == {"kind": "hessian", "structure": "the matrix itself"}, shown
    assert (shown["flag"], shown["approximate"], shown["reason"]) == ("exact", False, None)
    # The job list caught up: the row says succeeded.
    page.wait_for(
        f"document.querySelector('#jobs tr[data-job={json.dumps(job_id)}]')"
        ".textContent.includes('succeeded')"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(ARTIFACTS / "ui-density.png")


@needs_chromium
def test_eigenvalues_are_drawn(page: Browser, api: httpx.Client) -> None:
    rng = np.random.default_rng(5)
    tape = api.post("/v1/tapes", json={**_target(), "definition": mlp(rng, 50, 6)}).json()
    job_id = start_job(api, tape["tape_id"], "eigenvalues", {"k": 4, "max_hvps": 300})
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'eigenvalues'")
    result = api.get(f"/v1/jobs/{job_id}/result").json()
    drawn = page.evaluate("gradtapeUI.charts.result.data")
    assert drawn == [[1, 2, 3, 4], result["eigenvalues"]]


@needs_chromium
def test_a_diagonal_and_influence_scores_are_drawn(page: Browser, api: httpx.Client) -> None:
    rng = np.random.default_rng(6)
    definition = mlp(rng, 12, 3)
    body = {**_target(), "definition": definition, "output": "out"}
    tape = api.post("/v1/tapes", json=body).json()
    job_id = start_job(api, tape["tape_id"], "diagonal", {"method": "exact"})
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'diagonal'")
    result = api.get(f"/v1/jobs/{job_id}/result").json()
    drawn = page.evaluate("gradtapeUI.charts.result.data")
    flat = [v for name in ("W1", "W2") for v in np.ravel(result["diagonal"][name]["data"])]
    np.testing.assert_allclose(drawn[1], flat)  # W1's entries, then W2's, as the sources
    test_points = {"X": definition["inputs"]["X"], "Y": definition["inputs"]["Y"]}
    job_id = start_job(
        api, tape["tape_id"], "influence", {"test_inputs": test_points, "damping": 0.1}
    )
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'influence'")
    result = api.get(f"/v1/jobs/{job_id}/result").json()
    assert page.evaluate("gradtapeUI.charts.result.data") == [list(range(12)), result["scores"]]


@needs_chromium
def test_a_monte_carlo_answer_is_marked_approximate(page: Browser, api: httpx.Client) -> None:
    """An exact trace of a Monte-Carlo Fisher is the sampled matrix's: the page says so
    beside the answer (kind, samples, seed, the approximate flag and the server's
    reason), drawn apart from an exact answer's statement."""
    rng = np.random.default_rng(12)
    body = {**_target(), "definition": mlp(rng, 10, 3), "output": "out"}
    tape = api.post("/v1/tapes", json=body).json()
    asked = {"method": "exact", "curvature": "fisher", "samples": 4, "fisher_seed": 7}
    job_id = start_job(api, tape["tape_id"], "trace", asked)
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'trace'")
    page.wait_for("!document.getElementById('result-curvature').hidden")
    used = api.get(f"/v1/jobs/{job_id}/result").json()["curvature_used"]
    assert (used["kind"], used["samples"], used["seed"], used["approximate"]) == (
        "fisher",
        4,
        7,
        True,
    )
    shown = curvature_shown(page)
    assert shown["facts"] == {
        "kind": "fisher",
        "structure": "the matrix itself",
        "Monte-Carlo samples": "4 per example",
        "seed": "7",
    }, shown
    assert shown["flag"] == "approximate" and shown["approximate"]
    assert shown["reason"] == "Why approximate: " + used["reason"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(ARTIFACTS / "ui-monte-carlo.png")
    # The same tape's exact Fisher: stated exact, and drawn unlike the approximate one.
    job_id = start_job(api, tape["tape_id"], "trace", {"method": "exact", "curvature": "fisher"})
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'trace'")
    page.wait_for("document.getElementById('result-curvature').dataset.approximate === 'false'")
    exact = curvature_shown(page)
    assert exact["facts"] == {"kind": "fisher", "structure": "the matrix itself"}, exact
    assert (exact["flag"], exact["approximate"], exact["reason"]) == ("exact", False, None)
    assert exact["background"] != shown["background"]


@needs_chromium
def test_cancel_from_the_page_stops_the_job(page: Browser, api: httpx.Client) -> None:
    rng = np.random.default_rng(8)
    tape = api.post("/v1/tapes", json={**_target(), "definition": mlp(rng, 400, 24)}).json()
    # Hutchinson to a tolerance it cannot reach within a budget of a million HVPs.
    job_id = start_job(
        api,
        tape["tape_id"],
        "trace",
        {"method": "hutchinson", "batch_size": 1, "rtol": 1e-9, "max_hvps": 1_000_000},
    )
    watch_from_the_page(page, job_id)
    page.wait_for("gradtapeUI.watching.history.length >= 2")  # running, reporting
    assert job_state_shown(page) == "running"
    page.evaluate("document.getElementById('job-cancel').click(); true")
    page.wait_for("document.getElementById('job-state').textContent === 'cancelled'")
    assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"
    # The worker is free again: a request on the same tape answers.
    assert api.post(f"/v1/tapes/{tape['tape_id']}/gradient", json={}).status_code == 200
    assert page.evaluate("document.getElementById('job-cancel').hidden") is True
    # The live chart drew the trace's estimates, with a band of +-2 standard errors once
    # there is one (from 30 samples on).
    history = page.evaluate("gradtapeUI.watching.history")
    drawn = page.evaluate("gradtapeUI.charts.progress.data")
    assert drawn[0] == [p[0] for p in history] and drawn[1] == [p[1] for p in history]
    known = [i for i, p in enumerate(history) if p[2] is not None]
    if known:
        np.testing.assert_allclose(
            [drawn[2][i] for i in known], [history[i][1] + 2 * history[i][2] for i in known]
        )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(ARTIFACTS / "ui-cancelled.png")


@needs_chromium
def test_a_job_watched_next_shows_nothing_of_the_one_before(
    page: Browser, api: httpx.Client
) -> None:
    """The job view is the watched job's alone: a solve watched after a trace showed the
    trace's running "estimate: ..." beside the solve's state. And the solve's residual
    axis (log scale) labels each tick with its value: 1e-5 read "0"."""
    rng = np.random.default_rng(14)
    body = {**_target(), "definition": mlp(rng, 20, 4), "output": "out"}
    tape = api.post("/v1/tapes", json=body).json()
    job_id = start_job(api, tape["tape_id"], "trace", {"method": "hutchinson", "max_hvps": 64})
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'trace'")
    estimate = page.evaluate("document.getElementById('job-estimate').textContent")
    assert estimate.startswith("estimate: "), estimate  # the trace's own running estimate
    asked = {"curvature": "ggn", "damping": 0.01, "tol": 1e-12}
    job_id = start_job(api, tape["tape_id"], "solve", asked)
    watch_from_the_page(page, job_id)
    page.wait_for("document.getElementById('result-chart').dataset.kind === 'solve'")
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["progress"]["estimate"] is None  # a solve reports no estimate...
    assert (
        page.evaluate("document.getElementById('job-estimate').textContent") == ""
    )  # ...none shown
    shown = page.evaluate("document.getElementById('job-progress-text').textContent")
    assert shown.startswith(f"{job['progress']['done']} / {job['progress']['total']} hvps"), shown
    result = api.get(f"/v1/jobs/{job_id}/result").json()
    assert min(result["residuals"]) < 1e-5, result["residuals"]  # the axis reaches past 1e-5
    # What uPlot drew on the y axis (its last rendered ticks; the release is pinned).
    splits, labels = page.evaluate(
        "[gradtapeUI.charts.result.axes[1]._splits, gradtapeUI.charts.result.axes[1]._values]"
    )
    ticks = [(s, label) for s, label in zip(splits, labels, strict=True) if label]
    assert any(s < 1e-4 for s, _ in ticks), ticks
    for split, label in ticks:
        assert float(label) == pytest.approx(split, rel=1e-9), (split, label)


@needs_chromium
def test_a_cancel_pressed_after_the_job_ended_keeps_its_answer(
    page: Browser, api: httpx.Client
) -> None:
    """The job list draws Cancel for a job that was running when it was read (every two
    seconds); pressed once the job has succeeded, it sent DELETE, which forgets a job
    that ended, and the answer the user was waiting for was gone (the page said
    "cancelled"). Now the page cancels only what still runs."""
    rng = np.random.default_rng(15)
    tape = api.post("/v1/tapes", json={**_target(), "definition": mlp(rng, 20, 4)}).json()
    job_id = start_job(api, tape["tape_id"], "trace", {"method": "exact"})
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as events:  # ends with the job
        assert "event: succeeded" in "\n".join(events.iter_lines())
    answer = api.get(f"/v1/jobs/{job_id}/result").json()
    page.evaluate(f"gradtapeUI.cancel({json.dumps(job_id)})")  # the stale button's press
    kept = api.get(f"/v1/jobs/{job_id}")
    assert kept.status_code == 200 and kept.json()["state"] == "succeeded", kept.text
    assert api.get(f"/v1/jobs/{job_id}/result").json() == answer
