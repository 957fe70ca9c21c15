"""The service under test: the real `gradtape serve` (uvicorn and its worker processes)
on a free loopback port, started once per session and stopped at the end.

Settings come from GRADTAPE_* variables, small where a test needs to reach a limit.
Every server and app the tests start keeps its store (tapes, models) under a temporary
directory, never the user's data directory. Other modules start servers of their own
with `start_server` (API keys on, a restart over the same store).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Read by Settings() in this process too (apps the tests build in-process).
DATA_DIR = Path(tempfile.mkdtemp(prefix="gradtape-tests-"))
os.environ["GRADTAPE_DATA_DIR"] = str(DATA_DIR)

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
    "GRADTAPE_MAX_TAPES_PER_KEY": "100000",  # schemathesis records tapes too
    "GRADTAPE_ALGORITHM_MAX_HVPS": "5000",
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

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Wait until /readyz answers 200 with every worker idle; return its body. The
        timeout only guards against a hang (a server that never comes up): on a loaded
        machine (load 15 on 2 cores) four HTTP processes and their workers took over a
        minute to start, so it is far above any quiet start."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()}")
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5.0)
                last = r.text
                if r.status_code == 200 and all(w["state"] == "idle" for w in r.json()["workers"]):
                    return r.json()
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"the server did not become ready: {last}\n{self.log.read_text()}")


def start_server(settings: dict[str, str], log: Path, cwd: Path | None = None) -> Server:
    """`gradtape serve` with these GRADTAPE_* settings (over SERVER_SETTINGS), ready;
    started in `cwd` (the Docker image starts in its data directory), else the checkout.

    The port is free when free_port() lets it go, not necessarily when the server binds it
    a second or more later: another process (another xdist worker's server, Ray's many
    ports) may take it meanwhile. A server that exits for that is started again on
    another port; any other failure is raised."""
    for attempt in range(3):
        written = log.stat().st_size if log.exists() else 0
        srv = _start(settings, log, cwd)
        try:
            srv.wait_ready()
            return srv
        except RuntimeError:
            stop_server(srv)
            this_start = log.read_bytes()[written:].decode(errors="replace")
            if "address already in use" not in this_start.lower() or attempt == 2:
                raise
        except BaseException:
            stop_server(srv)
            raise
    raise AssertionError("unreachable")


def _start(settings: dict[str, str], log: Path, cwd: Path | None) -> Server:
    port = free_port()
    env = {**os.environ, **SERVER_SETTINGS, **settings}
    if cwd is not None:  # the checkout stays importable from elsewhere
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=cwd or ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Server(f"http://127.0.0.1:{port}", process, log)


def stop_server(srv: Server) -> None:
    """Ctrl-C (a graceful shutdown), then kill if it hangs. The wait only guards against
    a hang: a graceful shutdown may take up to ~18 s by its own bounds (uvicorn's 10 s
    for requests in flight, 3 + 5 s to join a worker), more on a loaded machine, and a
    kill in its place loses what it saves on the way out (tapes' usage: test_restart)."""
    srv.process.send_signal(signal.SIGINT)
    try:
        srv.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        srv.process.kill()
        srv.process.wait()


@contextmanager
def own_server(folder: Path, **settings: str) -> Iterator[Server]:
    """A server of a test's own (data and log in `folder`), GRADTAPE_<NAME> from the
    keyword settings (workers="1" ...), stopped at the end."""
    env = {f"GRADTAPE_{k.upper()}": v for k, v in settings.items()}
    srv = start_server({"GRADTAPE_DATA_DIR": str(folder / "data"), **env}, folder / "server.log")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session", autouse=True)
def _temporary_data_dir() -> Iterator[Path]:
    yield DATA_DIR
    shutil.rmtree(DATA_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server({"GRADTAPE_DATA_DIR": str(tmp_path_factory.mktemp("store"))}, log)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c
