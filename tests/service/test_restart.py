"""No loss across restarts: a server of its own, stopped and started again over the same
store (gracefully, then killed outright), keeps its models (SCENARIOS.md 4: the custom
gradient gives the same 2.0) and its tapes, which answer as before, recorded again
transparently on their first use."""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest

from tests.service.conftest import start_server, stop_server
from tests.service.wire import arr, num, nums, ok, post, problem, t

CLIPPED = {
    "variables": {"v": 2.0},
    "functions": {
        "clipped": {
            "params": ["x"],
            "forward": ["y = x"],
            "backward": ["grad_x = clip_by_norm(upstream, 0.5)"],
        }
    },
    "program": ["output = clipped(v * v)"],
}
rng = np.random.default_rng(10)
DEFN = {
    "variables": {"w": t(rng.standard_normal((4, 3)), "float64")},
    "inputs": {"x": t(rng.standard_normal((8, 4)), "float64")},
    "program": ["h = tanh(x @ w)", "loss = sum(h ** 2)"],
}
VECTOR = {"w": t(rng.standard_normal((4, 3)), "float64")}


def test_models_and_tapes_survive_restarts(tmp_path) -> None:
    settings = {"GRADTAPE_DATA_DIR": str(tmp_path / "data"), "GRADTAPE_WORKERS": "1"}
    log = tmp_path / "server.log"
    srv = start_server(settings, log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            assert (
                c.post("/v1/models", json={"name": "clip", "definition": CLIPPED}).status_code
                == 201
            )
            before = post(c, "/v1/gradient", {"model": "clip", "target": "output"})
            assert nums(before["gradients"]) == {"v": 2.0}
            created = c.post("/v1/tapes", json={"definition": DEFN, "target": "loss"}).json()
            tape_id = created["tape_id"]
            hvp = post(c, f"/v1/tapes/{tape_id}/hvp", {"vector": VECTOR})["hvp"]
            from_model = c.post("/v1/tapes", json={"model": "clip", "target": "output"}).json()
            doomed = c.post("/v1/tapes", json={"definition": DEFN, "target": "loss"}).json()
            assert c.delete(f"/v1/tapes/{doomed['tape_id']}").status_code == 204
    finally:
        stop_server(srv)  # graceful: usage is saved on the way out

    srv = start_server(settings, log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            assert [m["name"] for m in ok(c.get("/v1/models"))["models"]] == ["clip"]
            after = post(c, "/v1/gradient", {"model": "clip", "target": "output"})
            assert num(after["value"]) == 4.0 and nums(after["gradients"]) == {"v": 2.0}
            about = ok(c.get(f"/v1/tapes/{tape_id}"))
            assert not about["loaded"] and about["hits"] == 1 and about["rebuilds"] == 0
            again = post(c, f"/v1/tapes/{tape_id}/hvp", {"vector": VECTOR})["hvp"]
            np.testing.assert_array_equal(arr(again["w"]), arr(hvp["w"]))
            about = ok(c.get(f"/v1/tapes/{tape_id}"))
            assert about["loaded"] and about["rebuilds"] == 1 and about["hits"] == 2
            custom = post(c, f"/v1/tapes/{from_model['tape_id']}/gradient", {})
            assert nums(custom["gradients"]) == {"v": 2.0}
            gone = problem(c.get(f"/v1/tapes/{doomed['tape_id']}"), 404, "tape-not-found")
            assert "deleted" in gone["detail"]
            listed = {x["tape_id"] for x in ok(c.get("/v1/tapes"))["tapes"]}
            assert listed == {tape_id, from_model["tape_id"]}
            assert "gradtape_tapes 2.0" in c.get("/metrics").text
    finally:
        srv.process.send_signal(signal.SIGKILL)  # a crash: nothing is saved on the way out
        srv.process.wait()

    srv = start_server(settings, log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60.0) as c:
            third = post(c, f"/v1/tapes/{tape_id}/hvp", {"vector": VECTOR})["hvp"]
            np.testing.assert_array_equal(arr(third["w"]), arr(hvp["w"]))
            assert nums(
                post(c, "/v1/gradient", {"model": "clip", "target": "output"})["gradients"]
            ) == {"v": 2.0}
    finally:
        stop_server(srv)


def test_a_store_from_a_newer_version_stops_the_server(tmp_path) -> None:
    import sqlite3

    path = tmp_path / "store.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema version 99"):
        start_server(
            {"GRADTAPE_STORE_PATH": str(path), "GRADTAPE_WORKERS": "1"}, tmp_path / "server.log"
        )
