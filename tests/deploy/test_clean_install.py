"""A clean install serves: a fresh virtualenv, the project installed from exactly the
files the Docker build context holds (.dockerignore applied), by the README's first
set-up command; then the image's entry command, with the image's environment, started
outside Docker, answers /readyz, and the image's and compose's health checks pass
against it. pip's cache is reused; nothing else is."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.conftest import (
    INSTALL_TIMEOUT,
    ROOT,
    Install,
    Server,
    copy_files,
    free_port,
    make_venv,
    repo_files,
    run,
    setup_commands,
)
from tests.deploy.files import (
    Dockerfile,
    dockerignore_filter,
    env_pairs,
    exec_form,
    healthcheck,
    interpolate_tree,
)

pytestmark = pytest.mark.deploy


def test_the_context_is_the_package_sources(install: Install) -> None:
    top = {p.name for p in install.context.iterdir()}
    assert top >= {"pyproject.toml", "README.md", "engine", "service"}
    assert not top & {".git", "tests", "bench", "clients", "openapi"}


def test_readme_command_serves_from_a_fresh_virtualenv(install: Install) -> None:
    assert (install.bin / "gradtape").is_file()
    assert install.readiness["status"] == "ready"
    assert [w["device"] for w in install.readiness["workers"]] == ["cpu", "cpu"]


@pytest.fixture(scope="module")
def image_server(install: Install) -> Iterator[tuple[Server, dict[str, str]]]:
    """The image's ENTRYPOINT + CMD with the image's ENV, on this machine: PATH's
    /opt/gradtape/bin is the fresh virtualenv, and the host (0.0.0.0 in the image, for
    the published port), port, data directory and kernel cache are moved to loopback and
    temp dirs."""
    final = Dockerfile.read(ROOT / "Dockerfile").stages[-1]
    image_env: dict[str, str] = {}
    for ins in final.all("ENV"):
        image_env |= env_pairs(ins.args)
    argv = exec_form(final.last("ENTRYPOINT").args) + exec_form(final.last("CMD").args)  # type: ignore[union-attr]
    workdir = install.tmp / "workdir"
    workdir.mkdir()
    port = free_port()
    env = install.env(**{k: v for k, v in image_env.items() if k != "PATH"})
    env |= {
        "GRADTAPE_HOST": "127.0.0.1",
        "GRADTAPE_PORT": str(port),
        "GRADTAPE_DATA_DIR": str(install.tmp / "image-data"),
        # the image's kernel cache (filled at its build) moved as the data directory is
        "NUMBA_CACHE_DIR": str(install.tmp / "image-numba-cache"),
    }
    server = Server.start(argv, cwd=workdir, env=env, log=install.tmp / "image.log", port=port)
    try:
        yield server, env
    finally:
        server.stop()


def test_image_entry_command_serves(image_server: tuple[Server, dict[str, str]]) -> None:
    server, _ = image_server
    r = httpx.get(f"{server.base_url}/readyz", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    r = httpx.post(
        f"{server.base_url}/v1/gradient",
        timeout=30,
        json={
            "definition": {
                "variables": {"w1": 2.0, "w2": 3.0},
                "inputs": {"x1": 5.0, "x2": 7.0},
                "program": ["s = w1 * x1 + w2 * x2"],
            },
            "target": "s",
            "sources": ["w1", "w2"],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["value"]["data"] == [31.0]


def test_the_installed_package_serves_the_page(
    image_server: tuple[Server, dict[str, str]],
) -> None:
    """/ui's static files are package data: a non-editable install must ship them."""
    server, _ = image_server
    page = httpx.get(f"{server.base_url}/ui", timeout=10)
    assert page.status_code == 200 and "<title>gradtape</title>" in page.text
    assets = re.findall(r'(?:src|href)="(/ui/assets/[^"]+)"', page.text)
    assert len(assets) == 4, assets  # uPlot's script and style, the page's own
    for asset in assets:
        assert httpx.get(f"{server.base_url}{asset}", timeout=10).status_code == 200, asset


def test_image_healthcheck_passes(
    image_server: tuple[Server, dict[str, str]], install: Install
) -> None:
    """The HEALTHCHECK command, as the container runs it (the image's python, its env)."""
    _, env = image_server
    _, command = healthcheck(
        Dockerfile.read(ROOT / "Dockerfile").stages[-1].last("HEALTHCHECK").args
    )  # type: ignore[union-attr]
    run(command, env=env, timeout=30)
    # and it fails where nothing answers
    dead = run(command, env={**env, "GRADTAPE_PORT": str(free_port())}, timeout=30, check=False)
    assert dead.returncode != 0


def test_compose_healthcheck_passes(image_server: tuple[Server, dict[str, str]]) -> None:
    """compose's readiness check, its container port (8000) moved to the server's."""
    server, env = image_server
    doc = interpolate_tree(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})
    checked = 0
    for service in doc["services"].values():  # type: ignore[index]
        if service["healthcheck"].get("disable"):  # a Ray worker node serves no HTTP
            continue
        command = service["healthcheck"]["test"]
        assert command[0] == "CMD"
        argv = [part.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}") for part in command[1:]]
        run(argv, env=env, timeout=30)
        checked += 1
    assert checked >= 2  # the CPU and the GPU service at least


def test_gradtape_openapi_matches_the_contract(install: Install) -> None:
    """The installed `gradtape openapi` writes the committed contract, from which the
    clients are generated."""
    done = run(
        [str(install.bin / "gradtape"), "openapi"], env=install.env(), timeout=120, cwd=install.tmp
    )
    assert done.stdout == (ROOT / "openapi" / "openapi.json").read_text()


def test_setup_commands_are_valid_shell() -> None:
    """The first command installs the checkout with the service's extra; both parse as
    shell. (That .ci/run runs
    the second one, verbatim, in a fresh virtualenv is test_readme.py's to check.)"""
    readme = setup_commands()
    assert len(readme) == 2, readme
    assert shlex.split(readme[0].split("&&")[0]) == ["pip", "install", "-e", ".[service]"]
    for command in readme:
        assert subprocess.run(["bash", "-n", "-c", command], check=False).returncode == 0


def test_the_engine_installs_alone_with_numpy(tmp_path: Path) -> None:
    """`pip install .` is the engine alone: NumPy is the one dependency it brings, the
    engine computes a gradient with it, and `gradtape serve` says which extra it needs
    (exit 2) instead of failing on an import."""
    included = dockerignore_filter((ROOT / ".dockerignore").read_text())
    context = copy_files([p for p in repo_files() if included(p)], tmp_path / "context")
    bin_dir = make_venv(tmp_path / "venv")
    run([str(bin_dir / "pip"), "install", "--quiet", str(context)], timeout=INSTALL_TIMEOUT)
    listed = run([str(bin_dir / "pip"), "list", "--format=freeze"], timeout=60).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert names - {"pip", "setuptools", "wheel"} == {"gradtape", "numpy"}, names
    code = (
        "import engine as gt, numpy as np; w = gt.Variable(np.array([1.0, 2.0]));\n"
        "with gt.GradientTape() as t: y = gt.sum(w ** 3)\n"
        "print(t.gradient(y, w).numpy().tolist())"
    )
    out = run([str(bin_dir / "python"), "-c", code], timeout=60, cwd=tmp_path).stdout
    assert out.strip() == "[3.0, 12.0]"
    serve = run([str(bin_dir / "gradtape"), "serve"], timeout=60, check=False, cwd=tmp_path)
    assert serve.returncode == 2, serve
    assert "pip install 'gradtape[service]'" in serve.stderr and "fastapi" in serve.stderr
