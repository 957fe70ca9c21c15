"""API keys, quotas and the memory budget, on a server of their own: keys on (from the
environment and from a file), one worker, small quotas and a small tape budget.

- Every /v1 request needs a key (401 otherwise); the operational routes do not.
- A tape or model is visible only to the key that made it: another key gets 404.
- Quotas per key on tapes, their bytes and models: 429 quota-exceeded.
- A worker over its tape budget evicts its least recently used tapes: 404 tape-evicted.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import ok, post, problem, t, t64

MIB = 2**20
KEYS_FROM_ENV = ["alice-key", "bob-key", "carol-key"]
KEYS_FROM_FILE = ["dave-key", "erin-key", "frank-key"]
BUDGET = 3 * MIB  # per worker
BYTES_QUOTA = int(2.5 * MIB)  # per key


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("keyed")
    keys = folder / "keys.txt"
    keys.write_text("# one key per line\n" + "\n".join(KEYS_FROM_FILE) + "\n\n")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(folder / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": ", ".join(KEYS_FROM_ENV),
            "GRADTAPE_API_KEYS_FILE": str(keys),
            "GRADTAPE_MAX_TAPES_PER_KEY": "4",
            "GRADTAPE_MAX_TAPE_BYTES_PER_KEY": str(BYTES_QUOTA),
            "GRADTAPE_MAX_MODELS_PER_KEY": "2",
            "GRADTAPE_TAPE_MEMORY_BUDGET": str(BUDGET),
            # The tape budget is what these tests are about; a request's own budget (by
            # default half of it) must not refuse their tapes first.
            "GRADTAPE_REQUEST_MEMORY_BUDGET": str(64 * MIB),
        },
        folder / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def client(server: Server, key: str | None, header: str = "bearer") -> httpx.Client:
    headers = {}
    if key is not None:
        headers = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"X-API-Key": key}
    return httpx.Client(base_url=server.base_url, timeout=60.0, headers=headers)


def defn(rows: int) -> dict:
    """A tape of 32,824 + 2,048 * rows bytes as recorded; each of its first three HVPs
    adds 512 * rows (rule caches, then the compiled replay's buffers), then it settles.
    The eviction test below is sized by these figures."""
    g = np.random.default_rng(rows)
    return {
        "variables": {"w": t64(g.standard_normal((64, 32)), "float64")},
        "inputs": {"x": t64(g.standard_normal((rows, 64)), "float64")},
        "program": ["h = tanh(x @ w)", "loss = mean(h ** 2)"],
    }


def record(c: httpx.Client, rows: int = 4) -> dict:
    response = c.post("/v1/tapes", json={"definition": defn(rows), "target": "loss"})
    assert response.status_code == 201, response.text
    return response.json()


def hvp(c: httpx.Client, tape_id: str) -> httpx.Response:
    return c.post(
        f"/v1/tapes/{tape_id}/hvp", json={"vector": {"w": t(np.ones((64, 32)), "float64")}}
    )


def test_every_v1_request_needs_a_key(keyed) -> None:
    with client(keyed, None) as anonymous:
        for method, path in (
            ("GET", "/v1/tapes"),
            ("GET", "/v1/models"),
            ("GET", "/v1/ops"),
            ("POST", "/v1/gradient"),
            ("POST", "/v1/tapes"),
            ("GET", "/v1/tapes/whatever"),
        ):
            response = anonymous.request(method, path, json={} if method == "POST" else None)
            found = problem(response, 401, "unauthorized")
            assert "API key" in found["detail"] and "X-API-Key" in found["detail"]
            assert response.headers["www-authenticate"].startswith("Bearer")
        assert anonymous.get("/healthz").status_code == 200  # operations need none
        assert anonymous.get("/readyz").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
    with client(keyed, "mallory-key") as wrong:
        assert "not valid" in problem(wrong.get("/v1/tapes"), 401, "unauthorized")["detail"]
    for key, header in (("alice-key", "bearer"), ("dave-key", "x-api-key")):
        with client(keyed, key, header) as c:
            assert ok(c.get("/v1/tapes")) == {"tapes": []}


def test_a_tape_is_visible_only_to_its_key(keyed) -> None:
    with client(keyed, "alice-key") as alice, client(keyed, "bob-key", "x-api-key") as bob:
        tape_id = record(alice)["tape_id"]
        for response in (
            bob.get(f"/v1/tapes/{tape_id}"),
            hvp(bob, tape_id),
            bob.post(f"/v1/tapes/{tape_id}/gradient", json={}),
            bob.delete(f"/v1/tapes/{tape_id}"),
        ):
            found = problem(response, 404, "tape-not-found")  # not 403: it does not exist
            assert "reason" not in found
        assert ok(bob.get("/v1/tapes")) == {"tapes": []}
        assert [x["tape_id"] for x in ok(alice.get("/v1/tapes"))["tapes"]] == [tape_id]
        assert hvp(alice, tape_id).status_code == 200
        assert alice.delete(f"/v1/tapes/{tape_id}").status_code == 204
        # Even the tombstone is alice's: bob learns nothing from the id.
        assert "reason" not in problem(bob.get(f"/v1/tapes/{tape_id}"), 404)
        assert problem(alice.get(f"/v1/tapes/{tape_id}"), 404)["reason"] == "deleted"


def test_models_are_per_key(keyed) -> None:
    mine = {"variables": {"v": 2.0}, "program": ["y = v * v"]}
    with client(keyed, "alice-key") as alice, client(keyed, "bob-key") as bob:
        assert alice.post("/v1/models", json={"name": "sq", "definition": mine}).status_code == 201
        problem(bob.get("/v1/models/sq"), 404, "model-not-found")
        problem(
            bob.post("/v1/gradient", json={"model": "sq", "target": "y"}), 404, "model-not-found"
        )
        assert post(alice, "/v1/gradient", {"model": "sq", "target": "y"})["gradients"]
        # bob may have his own "sq"; alice's stays hers.
        assert bob.post("/v1/models", json={"name": "sq", "definition": mine}).status_code == 201
        assert bob.post("/v1/models", json={"name": "sq2", "definition": mine}).status_code == 201
        full = problem(
            bob.post("/v1/models", json={"name": "sq3", "definition": mine}), 429, "quota-exceeded"
        )
        assert full["quota"] == "models" and "max_models_per_key" in full["detail"]


def test_quota_on_the_number_of_tapes(keyed) -> None:
    with client(keyed, "carol-key") as carol:
        ids = [record(carol)["tape_id"] for _ in range(4)]
        full = problem(
            carol.post("/v1/tapes", json={"definition": defn(4), "target": "loss"}),
            429,
            "quota-exceeded",
        )
        assert full["quota"] == "tapes" and full["limit"] == 4
        assert "4 live tape(s)" in full["detail"] and "DELETE" in full["detail"]
        with client(keyed, "alice-key") as alice:  # a quota per key
            alice_tape = record(alice)["tape_id"]
            assert alice.delete(f"/v1/tapes/{alice_tape}").status_code == 204
        assert carol.delete(f"/v1/tapes/{ids[0]}").status_code == 204
        ids[0] = record(carol)["tape_id"]  # room again
        for tape_id in ids:
            assert carol.delete(f"/v1/tapes/{tape_id}").status_code == 204


def test_quota_on_bytes_and_the_budget(keyed) -> None:
    with client(keyed, "dave-key") as dave:
        too_big = problem(
            # 3.16 MiB: over the 3 MiB budget of a worker's tapes
            dave.post("/v1/tapes", json={"definition": defn(1600), "target": "loss"}),
            422,
            "too-large",
        )
        assert "tape_memory_budget" in too_big["detail"]
        over = problem(
            # 2.77 MiB: within the budget, over the key's 2.5 MiB
            dave.post("/v1/tapes", json={"definition": defn(1400), "target": "loss"}),
            429,
            "quota-exceeded",
        )
        assert over["quota"] == "bytes" and "max_tape_bytes_per_key" in over["detail"]
        assert ok(dave.get("/v1/tapes")) == {"tapes": []}  # nothing kept from either


def test_least_recently_used_tapes_are_evicted(keyed) -> None:
    with client(keyed, "erin-key") as erin, client(keyed, "frank-key") as frank:
        first = record(erin, 500)
        assert 0.95 * MIB < first["bytes"] < 1.05 * MIB  # the sizes this test assumes
        second = record(frank, 500)
        assert hvp(erin, first["tape_id"]).status_code == 200  # first is now more recent
        third = record(frank, 500)  # three do not fit in 3 MiB: the least recent goes
        gone = problem(frank.get(f"/v1/tapes/{second['tape_id']}"), 404, "tape-evicted")
        assert "evicted" in gone["detail"] and f"{BUDGET:,}" in gone["detail"]
        assert gone["reason"] == "evicted"
        problem(hvp(frank, second["tape_id"]), 404, "tape-evicted")
        assert hvp(erin, first["tape_id"]).status_code == 200
        assert hvp(frank, third["tape_id"]).status_code == 200
        loaded = [
            ok(c.get(f"/v1/tapes/{tape['tape_id']}")) for c, tape in ((erin, first), (frank, third))
        ]
        assert all(x["loaded"] for x in loaded) and sum(x["bytes"] for x in loaded) <= BUDGET
        again = record(frank, 500)  # a client can record it again (evicting in turn)
        assert again["tape_id"] != second["tape_id"]
        metrics = httpx.get(f"{keyed.base_url}/metrics").text
        assert 'gradtape_tape_events_total{event="evicted"}' in metrics


# -- operational defaults (issue 11) -----------------------------------------------------------


def test_readyz_shows_process_ids_only_to_a_key(keyed) -> None:
    with client(keyed, None) as anonymous, client(keyed, "alice-key") as alice:
        hidden = ok(anonymous.get("/readyz"))["workers"]
        shown = ok(alice.get("/readyz"))["workers"]
    assert hidden and all(w["pid"] is None for w in hidden)
    assert all(isinstance(w["pid"], int) and w["pid"] > 0 for w in shown)
    # The same workers apart from the pid (their states and silences are not compared:
    # two calls are two moments, and a worker may be busy in one of them).
    moment = ("pid", "state", "silent_seconds")
    stable = [{k: v for k, v in w.items() if k not in moment} for w in shown]
    assert [{k: v for k, v in w.items() if k not in moment} for w in hidden] == stable
    assert all(w.keys() == shown[0].keys() for w in hidden)


@pytest.fixture
def reloading(tmp_path) -> Iterator[tuple[Server, Path]]:
    keys = tmp_path / "keys.txt"
    keys.write_text("first-key\n")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp_path / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS_FILE": str(keys),
            "GRADTAPE_LOG_LEVEL": "info",  # the SIGHUP test reads the reload's log line
        },
        tmp_path / "server.log",
    )
    try:
        yield srv, keys
    finally:
        stop_server(srv)


def status_for(server: Server, key: str) -> int:
    with client(server, key) as c:
        return c.get("/v1/tapes").status_code


def test_api_keys_reload_when_their_file_changes(reloading) -> None:
    server, keys = reloading
    assert status_for(server, "first-key") == 200
    assert status_for(server, "second-key") == 401
    keys.write_text("second-key\nthird-key\n")  # first revoked, two added: no restart
    assert status_for(server, "second-key") == 200
    assert status_for(server, "third-key") == 200
    assert status_for(server, "first-key") == 401
    keys.write_text("")  # an empty (e.g. half-written) file locks nobody out
    assert status_for(server, "second-key") == 200
    assert "holds no key" in server.log.read_text()


def test_api_keys_reload_on_sighup(reloading) -> None:
    """SIGHUP reads the file at once, before any request looks at it (the log says so;
    the file check per request would also catch the change, but only on a request)."""
    server, keys = reloading
    assert status_for(server, "first-key") == 200
    keys.write_text("other-key\nmore-key\n")
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60  # a guard against a hang, not a measurement
    while "API keys reloaded: 2 key(s)" not in server.log.read_text():
        assert time.monotonic() < deadline, "SIGHUP did not reload the keys"
        time.sleep(0.05)
    assert status_for(server, "other-key") == 200
    assert status_for(server, "first-key") == 401
