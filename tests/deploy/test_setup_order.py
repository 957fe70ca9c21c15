"""Issue 27, item 11: the README's two set-up commands, in the README's order, in one
virtualenv. The serve command installs and serves; while it serves, the test command's
install runs in the same virtualenv; the live server then still answers an ONNX model
(engine/onnx, imported lazily in a worker) and starts a worker anew (a killed one is
replaced), the answers unchanged. With `pip install '.[service]'` first, the dev install
swapped the installed sources for the checkout under the live server, and the ONNX
example failed with a 500 "No module named 'engine.onnx'"."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.conftest import INSTALL_TIMEOUT, Install, Server, free_port, run, setup_commands
from tests.engine.onnx.graphs import fixture
from tests.service.test_onnx import b64, definition

pytestmark = pytest.mark.deploy


def _onnx_gradient(server: Server) -> float:
    data, _ = fixture("lenet")
    body = {"definition": definition("lenet", {"onnx": b64(data)}), "target": "loss"}
    r = httpx.post(f"{server.base_url}/v1/gradient", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return float(r.json()["value"]["data"][0])


def _worker(server: Server) -> dict:
    try:
        r = httpx.get(f"{server.base_url}/readyz", timeout=10)
    except httpx.HTTPError:
        return {}
    return r.json().get("workers", [{}])[0] if r.status_code == 200 else {}


def test_the_readme_commands_in_their_order_in_one_virtualenv(
    install: Install, tmp_path: Path
) -> None:
    """The first command has run in `install`'s fresh virtualenv (the deploy conftest;
    test_clean_install checks what it serves); its server is started again there, and
    the second command's install runs beside it."""
    serve_line, test_line = setup_commands()
    first, serve = (part.strip() for part in serve_line.split("&&"))
    dev_install = test_line.split("&&")[0].strip()
    assert serve == "gradtape serve" and dev_install.startswith("pip install")
    assert first.startswith("pip install -e")
    checkout = install.context
    port = free_port()
    env = install.env(
        GRADTAPE_PORT=str(port),
        GRADTAPE_DATA_DIR=str(tmp_path / "data"),
        GRADTAPE_WORKERS="1",  # so that the replaced worker is the one that answers
    )
    server = Server.start(
        ["bash", "-c", serve], cwd=checkout, env=env, log=tmp_path / "serve.log", port=port
    )
    try:
        before = _onnx_gradient(server)
        # The second terminal: the test command's install, in the same virtualenv.
        run(["bash", "-c", dev_install], cwd=checkout, env=env, timeout=2 * INSTALL_TIMEOUT)
        assert _onnx_gradient(server) == before
        # A worker started after the install imports what the first one did: the one
        # worker killed, its replacement computes the same answer.
        (worker,) = httpx.get(f"{server.base_url}/readyz", timeout=10).json()["workers"]
        os.kill(worker["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
        while True:
            # (one answer read for both checks: a second /readyz is another moment, and
            # one that failed reads {}, which has no state)
            now = _worker(server)
            if now.get("pid") not in (None, worker["pid"]) and now.get("state") == "idle":
                break
            assert time.monotonic() < deadline, "the worker was not replaced"
            time.sleep(0.2)
        assert _onnx_gradient(server) == before
    finally:
        server.stop()
    assert "No module named" not in (tmp_path / "serve.log").read_text()
