"""The service under test: the real `gradtape serve` (uvicorn and its worker processes)
on a free loopback port, started once per session and stopped at the end.

Settings come from GRADTAPE_* variables, small where a test needs to reach a limit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

# The limits the tests reach; every other setting keeps its default.
SERVER_SETTINGS = {
    "GRADTAPE_WORKERS": "2",
    "GRADTAPE_TIME_LIMIT": "30",
    "GRADTAPE_MAX_TIME_LIMIT": "60",
    "GRADTAPE_HESSIAN_MAX_SIZE": "100",
    "GRADTAPE_JACOBIAN_MAX_ELEMENTS": "200000",
    "GRADTAPE_CHUNK_SIZE": "16",  # several backward passes per jacobian and Hessian
    "GRADTAPE_HVP_MAX_VECTORS": "32",
    "GRADTAPE_MAX_BODY_BYTES": str(4 * 2**20),
    "GRADTAPE_ACCESS_LOG": "false",
    "GRADTAPE_LOG_LEVEL": "warning",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, base_url: str, process: subprocess.Popen[bytes], log: Path):
        self.base_url = base_url
        self.process = process
        self.log = log

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """Wait until /readyz answers 200 with every worker idle; return its body."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()}")
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5.0)
                last = r.text
                if r.status_code == 200 and all(
                    w["state"] == "idle" for w in r.json()["workers"]
                ):
                    return r.json()
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"the server did not become ready: {last}\n{self.log.read_text()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, **SERVER_SETTINGS}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    srv = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
