"""Clients generated from openapi/openapi.json with the users' own toolchains drive the
live server (the real `gradtape serve` on loopback):

- Python: openapi-python-client generates a package into a temp dir, pip installs it
  (with its dependencies) into a temp --target, and clients/python/example.py runs a
  gradient, a jacobian, a tape with HVPs and an error through it.
- TypeScript: openapi-typescript (TypeScript 5) types and openapi-fetch calls, compiled
  with tsc (strict) and run by Node: clients/ts. Skipped where node or npm is absent.

The generated Python code is also held to reading well: one module per operation named
by its stable operation id, and no generated model names for anonymous inline schemas
beyond a known list that may only shrink.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, Server, copy_files, repo_files, run

pytestmark = pytest.mark.deploy

OPENAPI = ROOT / "openapi" / "openapi.json"
GENERATOR_CONFIG = ROOT / "clients" / "python" / "openapi-python-client.yaml"

# Model classes openapi-python-client invents for inline schemas (`<Schema><Field>`,
# `...Type0`, `...Item`, `...AdditionalProperty`): each is a schema that would read
# better named in the contract. The list may only shrink (a test fails when an entry
# is gone, so that it is removed here, and when a new one appears).
ANONYMOUS_MODELS = {
    # the `ctx` of FastAPI's default 422 schema (ValidationError), which four operations
    # with path parameters still declare although the service answers a Problem
    "ValidationErrorContext",
}  # fmt: skip


def operations() -> list[tuple[str, str]]:
    """(tag, operationId) of every operation in the contract."""
    spec = json.loads(OPENAPI.read_text())
    return [
        (op["tags"][0], op["operationId"])
        for path in spec["paths"].values()
        for op in path.values()
    ]


def check_summary(summary: dict) -> None:
    """What both examples print: the answers of SCENARIOS.md 15, a jacobian, a tape's
    HVPs and two problem answers."""
    assert summary["gradient"]["value"] == [31] and summary["gradient"]["w1"] == [5]
    assert summary["jacobian"] == [2, 0, 0, 4]
    assert summary["tape"] == {
        "gradient": [3, 12],
        "hvp": [6, 0],
        "hvps": [[0, 12], [6, 12]],
        "after_delete": "/problems/tape-not-found",
    }
    assert summary["error"]["status"] == 422
    assert "undefined name 'q'" in summary["error"]["detail"]


# --------------------------------------------------------------------------- Python


@pytest.fixture(scope="module")
def python_client(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The generated package's directory, and the generator's output."""
    tmp = tmp_path_factory.mktemp("python-client")
    out = tmp / "gradtape-openapi-client"
    done = run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(OPENAPI),
            "--meta",
            "setup",
            "--config",
            str(GENERATOR_CONFIG),
            "--output-path",
            str(out),
        ],
        cwd=tmp,
        timeout=180,
    )
    return out, done.stdout + done.stderr


def test_the_generated_client_is_a_distribution_of_its_own(
    python_client: tuple[Path, str],
) -> None:
    """Issue 27, item 10: the generated client was the distribution `gradtape-client`,
    the SDK's name, so installing it uninstalled the SDK. It has its own name now."""
    import tomllib

    sdk = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())
    # --meta setup: the name is in setup.py
    found = re.search(r'name="([^"]+)"', (python_client[0] / "setup.py").read_text())
    assert found is not None
    assert found.group(1) == "gradtape-openapi-client" != sdk["project"]["name"]
    assert (python_client[0] / "gradtape_client").is_dir()  # the import name is unchanged


def test_generator_warns_only_about_msgpack(python_client: tuple[Path, str]) -> None:
    """What openapi-python-client cannot use: the msgpack alternative of the request
    bodies (it sends JSON), and the raw ONNX file body of PUT /v1/models/{name} (that one
    operation is left out of the generated client); anything else it warns about is a
    contract problem."""
    _, output = python_client
    warnings = re.findall(
        r"WARNING parsing (\S+ \S+) within \w+\.(?: Endpoint will not be generated\.)?"
        r"\s+(.+)",
        output,
    )
    assert warnings, "expected the msgpack warnings: has the generator changed?"
    assert {reason for _, reason in warnings} == {
        "Unsupported content type application/msgpack",
        "Unsupported content type application/onnx",
    }, output
    assert [op for op, reason in warnings if reason.endswith("application/onnx")] == [
        "PUT /v1/models/{name}"
    ], output
    assert "Unable to" not in output and "ERROR" not in output, output


# Operations the generator leaves out: their only request body is not JSON (see
# test_generator_warns_only_about_msgpack).
NOT_GENERATED = {"put_onnx_model"}


def test_operations_are_named_by_their_ids(python_client: tuple[Path, str]) -> None:
    package = python_client[0] / "gradtape_client"
    for tag, operation_id in operations():
        generated = (package / "api" / tag / f"{operation_id}.py").is_file()
        assert generated == (operation_id not in NOT_GENERATED), operation_id


def test_no_new_anonymous_models(python_client: tuple[Path, str]) -> None:
    init = (python_client[0] / "gradtape_client" / "models" / "__init__.py").read_text()
    models = set(re.findall(r'"(\w+)"', init[init.index("__all__") :]))
    schemas = set(json.loads(OPENAPI.read_text())["components"]["schemas"])
    invented = {
        m for m in models if m not in schemas and m.lower() not in {s.lower() for s in schemas}
    }
    assert invented - ANONYMOUS_MODELS == set(), "new inline schemas: name them"
    assert ANONYMOUS_MODELS - invented == set(), "named now: drop them from ANONYMOUS_MODELS"


def test_python_client_drives_the_server(
    python_client: tuple[Path, str], live_server: Server, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--target",
            str(site),
            str(python_client[0]),
        ],
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    done = run(
        [sys.executable, str(ROOT / "clients" / "python" / "example.py"), live_server.base_url],
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    check_summary(json.loads(done.stdout))


# ----------------------------------------------------------------------- TypeScript


@pytest.mark.skipif(
    not (shutil.which("node") and shutil.which("npm")),
    reason="node and npm are not installed (apt-get install nodejs npm)",
)
def test_typescript_client_drives_the_server(live_server: Server, tmp_path: Path) -> None:
    """`npm ci` (the committed lockfile), types generated from the contract, tsc strict,
    then the example against the server; in a copy, so the checkout stays clean."""
    files = [p for p in repo_files() if p.startswith(("clients/ts/", "openapi/"))]
    copy = copy_files(files, tmp_path / "checkout")
    project = copy / "clients" / "ts"
    run(["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=project, timeout=300)
    run(["npm", "run", "build"], cwd=project, timeout=180)
    version = run(["npx", "tsc", "--version"], cwd=project, timeout=60).stdout
    assert version.startswith("Version 5."), version
    done = run(["node", "dist/example.js", live_server.base_url], cwd=project, timeout=120)
    check_summary(json.loads(done.stdout))
