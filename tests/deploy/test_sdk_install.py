"""The Python SDK (clients/python, distribution `gradtape-client`) installs on its own: into
a fresh virtualenv, from a copy of its directory, with only its declared dependencies; it
then drives the live server from there. The server's editable install (`pip install -e .`,
as the README's test command does) goes into the same virtualenv beside it without a clash:
the two distributions share no file, and both import.

(tests/client imports the SDK from this checkout; this is what proves the directory is a
package a user can install.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.deploy.conftest import Server, copy_files, make_venv, repo_files, run

pytestmark = pytest.mark.deploy

INSTALL_TIMEOUT = 300.0

# What `pip install ./clients/python` may bring: its three dependencies and theirs.
ALLOWED = {
    "gradtape-client", "httpx", "numpy", "msgpack",
    "httpcore", "h11", "anyio", "idna", "certifi", "sniffio", "typing-extensions",
    "exceptiongroup", "pip", "setuptools", "wheel",
}  # fmt: skip

DRIVE = """
import json, sys
import numpy as np
import gradtape.client
from gradtape.client import Client, TapeGone

with Client(sys.argv[1]) as client:
    value, grads = client.gradient(
        {"variables": {"w": np.array([1.0, 2.0])}, "program": ["loss = sum(w * w * w)"]},
        "loss")
    with client.tape({"variables": {"w": np.array([1.0, 2.0])},
                      "program": ["loss = sum(w * w * w)"]}, "loss") as tape:
        hvp = tape.hvp({"w": np.array([1.0, 1.0])})["w"]
print(json.dumps({"file": gradtape.client.__file__, "value": float(value),
                  "dtype": str(value.dtype), "gradient": grads["w"].tolist(),
                  "hvp": hvp.tolist()}))
"""


def env_for(bin_dir: Path) -> dict[str, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADTAPE_", "PYTHON", "VIRTUAL_ENV"))
    }
    return {
        **base,
        "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}",
        "VIRTUAL_ENV": str(bin_dir.parent),
    }


def dist_files(python: Path, name: str, env: dict[str, str]) -> set[str]:
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps([str(f) for f in m.files(sys.argv[1]) or []]))"
    )
    done = run([str(python), "-c", code, name], env=env, timeout=60)
    return set(json.loads(done.stdout))


def test_sdk_installs_alone_and_beside_the_server(live_server: Server, tmp_path: Path) -> None:
    checkout = copy_files(repo_files(), tmp_path / "checkout")
    bin_dir = make_venv(tmp_path / "venv")
    env = env_for(bin_dir)
    python = bin_dir / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]

    run(
        [*pip, str(checkout / "clients" / "python")], env=env, cwd=tmp_path, timeout=INSTALL_TIMEOUT
    )
    listed = run([str(python), "-m", "pip", "list", "--format=json"], env=env, timeout=60)
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert installed <= ALLOWED, installed - ALLOWED
    # From tmp_path: `python -c` puts the working directory on sys.path, and the
    # checkout's own engine/ must not count as installed.
    absent = run(
        [str(python), "-c", "import engine"], env=env, cwd=tmp_path, timeout=60, check=False
    )
    assert absent.returncode != 0  # the SDK brings no server code

    done = run([str(python), "-c", DRIVE, live_server.base_url], env=env, cwd=tmp_path, timeout=120)
    answer = json.loads(done.stdout)
    assert Path(answer["file"]).is_relative_to(tmp_path / "venv")  # the installed copy
    assert answer | {"file": None} == {
        "file": None,
        "value": 9.0,
        "dtype": "float64",
        "gradient": [3.0, 12.0],
        "hvp": [6.0, 12.0],
    }

    # The server, editable, into the same virtualenv: both import, no file is shared.
    run([*pip, "-e", str(checkout)], env=env, cwd=checkout, timeout=INSTALL_TIMEOUT)
    both = run(
        [str(python), "-c", "import engine, service, gradtape.client; print('ok')"],
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert both.stdout.strip() == "ok"
    run([str(python), "-m", "pip", "check"], env=env, timeout=60)
    shared = dist_files(python, "gradtape", env) & dist_files(python, "gradtape-client", env)
    assert not shared, shared
