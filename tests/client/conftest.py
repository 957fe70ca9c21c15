"""The SDK (clients/python, `gradtape.client`) against the real service: `gradtape serve`
(uvicorn and its worker processes) on loopback, as tests/service starts it.

The suite's environment is the server's (`pip install -e '.[dev]'`), which cannot name
the SDK's directory as a dependency; so the SDK is imported from this checkout's
clients/python (put first on sys.path by pyproject.toml's pytest `pythonpath`), and
tests/deploy/test_sdk_install.py proves that the directory also installs on its own into
a fresh virtualenv with only its declared dependencies.

Two servers: `server` (two workers, the limits of tests/service) and `strict` (API keys
required, one worker, no queue, two slots per key: a second concurrent request is a 503).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import gradtape.client
import numpy as np
import pytest

from tests.service import conftest as service_conftest
from tests.service.conftest import Server, own_server, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "clients" / "python"
assert Path(gradtape.client.__file__).is_relative_to(SDK), gradtape.client.__file__

KEY = "sdk-test-key"

# Both transports; answers must not depend on the transport.
TRANSPORTS = ["msgpack", "json"]


@pytest.fixture(scope="session", autouse=True)
def _service_data_dir() -> Iterator[None]:
    """The temporary directory tests/service/conftest.py makes on import (removed there
    by its own fixture, which is not active when only tests/client runs)."""
    yield
    shutil.rmtree(service_conftest.DATA_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The compute-cost guard off: the SDK's timeout tests send requests that must run to
    # their time limit, which the guard would refuse first (it has tests: test_cost.py).
    with own_server(tmp_path_factory.mktemp("sdk-server"), cost_flops_per_second="0") as srv:
        yield srv


@pytest.fixture(scope="session")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("sdk-strict")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(tmp / "data"),
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": KEY,
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_QUEUE_SIZE": "0",
            "GRADTAPE_RETRY_AFTER": "1",
            # Two requests of the key reach the pool at once (fair sharing would otherwise
            # hold the second in the key's line, where no 503 is answered).
            "GRADTAPE_MAX_CONCURRENT_PER_KEY": "2",
            # heavy(1000, 80) holds the worker for seconds; the memory model puts it
            # over the default request budget (1 GiB), so the budget here is larger.
            "GRADTAPE_REQUEST_MEMORY_BUDGET": str(4 * 2**30),
            # ... and the compute-cost guard would refuse it before it runs (it must run
            # to its time limit here); the guard has tests of its own (test_cost.py).
            "GRADTAPE_COST_FLOPS_PER_SECOND": "0",
        },
        tmp / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(params=TRANSPORTS)
def client(request: pytest.FixtureRequest, server: Server) -> Iterator[gradtape.client.Client]:
    with gradtape.client.Client(server.base_url, transport=request.param) as c:
        yield c


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(14)


def heavy(n: int, lines: int) -> dict:
    """A definition whose gradient takes a while: `lines` n x n matmuls of a projection
    (outer(x, x) with |x| = 1, so every product stays the projection: no overflow)."""
    x = np.full(n, 1 / np.sqrt(n))
    program = ["a0 = outer(x, x)"]
    program += [f"a{i} = a{i - 1} @ a0" for i in range(1, lines)]
    program += [f"loss = sum(a{lines - 1} * w)"]
    return {"variables": {"w": np.float64(1.0)}, "inputs": {"x": x}, "program": program}
