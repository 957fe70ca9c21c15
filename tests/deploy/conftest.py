"""Deployment checks: the Dockerfile and compose file (hadolint, the compose-spec schema),
a clean install serving, clients generated from the OpenAPI contract, and the README's
commands, all against the real `gradtape serve` on loopback.

Every module here is marked `deploy` (slow: fresh virtualenvs, npm, code generation);
`python -m pytest -m "not deploy"` leaves them out.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.deploy.files import dockerignore_filter, readme_blocks

ROOT = Path(__file__).resolve().parents[2]

# pip byte-compiles every file it installs: about 70% of an install's time here (Ray's
# wheel alone: 11 s, 3 s without), in every fresh virtualenv these tests make. Nothing
# here reads a .pyc, and Python compiles what it imports on its first import. Said as
# PIP_COMPILE=0: pip reads PIP_NO_COMPILE inverted ("1" compiles, "0" does not).
os.environ.setdefault("PIP_COMPILE", "0")

# Settings of the server the deploy tests talk to; the rest keep their defaults.
SERVER_SETTINGS = {
    "GRADTAPE_WORKERS": "2",
    "GRADTAPE_ACCESS_LOG": "false",
    "GRADTAPE_LOG_LEVEL": "warning",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deploy: slow deployment checks (Docker files, clean install, clients, README)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_setup_order runs the README's second command (the dev extra) in the
    session's `install` virtualenv: it runs after every other test, so that
    test_clean_install checks what the first command installed alone whatever order the
    files are named in (`pytest test_setup_order.py test_clean_install.py` ran it first,
    and the clean install's checks then ran in a virtualenv holding the dev extra)."""
    changes_install = [
        i
        for i in items
        if i.path.name == "test_setup_order.py" and "install" in getattr(i, "fixturenames", ())
    ]
    if changes_install:
        later = set(map(id, changes_install))
        items[:] = [i for i in items if id(i) not in later] + changes_install


# ---------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    args: list[str] | str, *, timeout: float, check: bool = True, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """Run a command, its output captured; on failure the assertion shows the output."""
    done = subprocess.run(
        args, check=False, capture_output=True, text=True, timeout=timeout, **kwargs
    )  # type: ignore[call-overload]
    if check and done.returncode != 0:
        pytest.fail(
            f"{args!r} exited {done.returncode}\n--- stdout\n{done.stdout}"
            f"\n--- stderr\n{done.stderr}"
        )
    return done


def repo_files() -> list[str]:
    """The files of a checkout: tracked, plus untracked ones git does not ignore (what a
    user who cloned and edited has), as paths relative to the repository root."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sorted(p for p in listed if p and (ROOT / p).is_file())


def copy_files(paths: Iterable[str], dest: Path) -> Path:
    for rel in paths:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return dest


def make_venv(path: Path) -> Path:
    """A fresh virtualenv; returns its bin directory."""
    run([sys.executable, "-m", "venv", str(path)], timeout=120)
    return path / "bin"


def layered_venv(path: Path) -> Path:
    """A fresh virtualenv that also sees the suite's environment (after its own
    packages): a .pth line adds the suite's site-packages as a site directory, so that
    the editable install's own .pth files work too. What its pip installs goes into it
    alone. (A venv made with --system-site-packages from inside a venv would see the
    *base* interpreter's packages instead.) Returns its bin directory."""
    import site

    bin_dir = make_venv(path)
    done = run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        timeout=60,
    )
    own = Path(done.stdout.strip())
    suite = [p for p in site.getsitepackages() if Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in suite]
    (own / "zz_suite_environment.pth").write_text("\n".join(lines) + "\n")
    return bin_dir


def installed_distributions() -> dict[str, str]:
    """The distributions of the environment running the suite: name -> version."""
    import importlib.metadata

    return {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}


class Server:
    """A `gradtape serve` process on a loopback port."""

    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.process = process
        self.log = log

    @classmethod
    def start(
        cls,
        args: list[str],
        *,
        env: dict[str, str],
        log: Path,
        port: int,
        cwd: Path = ROOT,
        timeout: float = 300.0,  # a guard against a hang (tests/service/conftest.py's)
    ) -> Server:
        with log.open("wb") as out:
            process = subprocess.Popen(
                args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        server = cls(port, process, log)
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()}")
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5.0)
                last = r.text
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout}s: {last}\n{self.log.read_text()}")

    def stop(self) -> None:
        """SIGINT to the whole process group (a shell, uvicorn, its workers)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The service from this checkout (`python -m service.cli serve`), as the
    README's first set-up command starts it, on a free loopback port."""
    tmp = tmp_path_factory.mktemp("live-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADTAPE_")}
    env |= {**SERVER_SETTINGS, "GRADTAPE_DATA_DIR": str(tmp / "data")}
    server = Server.start(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        log=tmp / "server.log",
        port=port,
    )
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------- the README's first command

INSTALL_TIMEOUT = 300.0  # pip resolving and installing every dependency from its cache


def setup_commands() -> list[str]:
    """The README's set-up commands: the first bash block of its "Set up" section."""
    blocks = [
        b
        for b in readme_blocks((ROOT / "README.md").read_text())
        if b.section == "Set up" and b.lang == "bash"
    ]
    assert blocks, 'README.md has no bash block under "## Set up"'
    return blocks[0].commands()


@dataclass
class Install:
    context: Path  # the Docker build context, copied
    bin: Path  # the fresh virtualenv's bin directory
    tmp: Path
    readiness: dict  # what /readyz answered to the README's command

    def env(self, **settings: str) -> dict[str, str]:
        """A clean environment: the virtualenv first on PATH, no GRADTAPE_* inherited."""
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GRADTAPE_", "PYTHON", "VIRTUAL_ENV"))
        }
        return {
            **base,
            "PATH": f"{self.bin}{os.pathsep}{base['PATH']}",
            "VIRTUAL_ENV": str(self.bin.parent),
            **settings,
        }


@pytest.fixture(scope="session")
def install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    """Runs the README's first set-up command (`pip install -e '.[service]' && gradtape
    serve`) in the build context with a fresh virtualenv active, waits for /readyz, stops
    it. One for the session: test_clean_install checks it, then test_setup_order runs the
    README's second command in the same virtualenv (a superset of the first's packages),
    always last (pytest_collection_modifyitems above)."""
    tmp = tmp_path_factory.mktemp("clean-install")
    included = dockerignore_filter((ROOT / ".dockerignore").read_text())
    context = copy_files([p for p in repo_files() if included(p)], tmp / "context")
    bin_dir = make_venv(tmp / "venv")
    install = Install(context, bin_dir, tmp, {})
    command = setup_commands()[0]
    port = free_port()
    server = Server.start(
        ["bash", "-c", command],
        cwd=context,
        log=tmp / "readme-serve.log",
        port=port,
        env=install.env(GRADTAPE_PORT=str(port), GRADTAPE_DATA_DIR=str(tmp / "data")),
        timeout=INSTALL_TIMEOUT,
    )
    try:
        install.readiness = server.wait_ready(10)
    finally:
        server.stop()
    yield install
