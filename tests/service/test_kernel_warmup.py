"""The compiled kernels' warm-up in the service (engine/kernels/warmup.py): `gradtape
kernels warm` fills numba's cache, and a worker (setting worker_warm_kernels, off in
the rest of the suite) says hello at once, answers its requests on the NumPy paths
while it warms, loads a filled cache, and has a cold one compiled by a process of its
own that a kill of the worker (the pool's answer to a request past its time limit)
does not stop. Each with a cache directory of its own (NUMBA_CACHE_DIR), real workers
and real numba; every wait is on a state the worker reports, with no time bound but a
hang guard."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.special import erf

from engine import kernels
from engine.kernels import warmup
from service.core.config import Settings
from service.pool.local import WorkerPool
from tests.service.wire import t64

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD = 900.0  # seconds: only a hang (a loaded machine compiles for a minute)

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

KERNELS = sorted(k.__name__ for k in warmup.declared())
SIGNATURES = sum(len(k.signatures) for k in warmup.declared())


def cli_warm(cache: Path) -> dict:
    """`gradtape kernels warm --json` with `cache` as numba's cache directory."""
    env = {k: v for k, v in os.environ.items() if k != "GRADTAPE_KERNELS"}
    env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "kernels", "warm", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert done.returncode == 0, done.stderr
    report: dict = json.loads(done.stdout)
    return report


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A cache directory `gradtape kernels warm` filled from empty, and its report."""
    cache = tmp_path_factory.mktemp("numba-cache")
    return cache, cli_warm(cache)


def test_the_cli_fills_an_empty_cache_and_a_second_run_loads_it(filled) -> None:
    cache, first = filled
    assert first["cache"] and first["cache_dir"].startswith(str(cache))
    assert first["signatures"] == first["compiled"] == SIGNATURES
    second = cli_warm(cache)
    assert second["loaded"] == SIGNATURES and second["compiled"] == 0
    assert {s["source"] for s in second["each"]} == {"loaded"}


# ---- a worker's warm-up --------------------------------------------------------------

X = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
W = np.cos(np.arange(64, dtype=np.float32)).reshape(4, 16)


def gelu_payload(dtype: str = "float32") -> dict:
    """The gradient of sum(gelu(x) w) (float32: the GELU and contracting slope kernels'
    dtype; float64: GELU's erf from SciPy, the slope's kernel bound to NumPy's bits)."""
    from service.api.payloads import gradient
    from service.api.schemas import GradientRequest

    body = {
        "definition": {
            "inputs": {"x": t64(X, dtype), "w": t64(W, dtype)},
            "program": ["y = sum(gelu(x) * w)"],
        },
        "target": "y",
        "sources": ["x"],
    }
    return gradient(GradientRequest.model_validate(body), Settings()).payload


def check_gelu_gradient(result: dict) -> None:
    x = X.astype(np.float64)
    slope = 0.5 * (1 + erf(x / np.sqrt(2))) + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi)
    got = np.asarray(result["gradients"]["x"], np.float64)
    np.testing.assert_allclose(got, slope * W, rtol=2e-6, atol=1e-6)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_worker_loads_a_filled_cache_after_its_hello(filled, monkeypatch) -> None:
    cache, _ = filled
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))  # the workers' environment

    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=1, worker_warm_kernels=True))
        await pool.start()
        try:
            done = await pool.submit("kernel_warmup", {"wait": HANG_GUARD}, time_limit=HANG_GUARD)
            status = done.result
            assert status["state"] == "ready" and status["process"] is None
            assert status["loaded"] == SIGNATURES and status["compiled"] == 0
            assert sorted(status["warmed"]) == KERNELS
            assert status["cache_dir"].startswith(str(cache))
            reply = await pool.submit("gradient", gelu_payload())
            check_gelu_gradient(reply.result)
            assert (await pool.submit("ping", None)).result["kernels"] == status
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_cold_cache_compiles_in_a_process_that_outlives_its_worker(
    tmp_path: Path, monkeypatch
) -> None:
    """The test holds the compiling processes' lock: the worker's warm-up stays at its
    compiling process, which the test then sees through a kill of its worker; released,
    the process fills the cache with no worker left."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    lock = open(warmup._lock_path(), "a")  # released in the finally below
    fcntl.flock(lock, fcntl.LOCK_EX)

    async def scenario() -> int:
        pool = WorkerPool(Settings(workers=1, worker_warm_kernels=True))
        await pool.start()  # the hello: readiness waits for no compilation
        try:
            # Served while warming, on the NumPy paths (no kernel is warmed). In float64:
            # float32's slope kernel is one of those whose bits differ from its NumPy
            # path's, which a request readies itself rather than answer other bits
            # (tests/engine/test_kernels_warmup.py): the kernels stay unwarmed here.
            reply = await pool.submit("gradient", gelu_payload("float64"))
            check_gelu_gradient(reply.result)
            deadline = time.monotonic() + HANG_GUARD
            while (
                "compiler_pid"
                not in (status := (await pool.submit("ping", None)).result)["kernels"]
            ):
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            kernels_status = status["kernels"]
            assert kernels_status["state"] == "warming" and kernels_status["warmed"] == []
            compiler = kernels_status["compiler_pid"]
            os.kill(status["pid"], signal.SIGKILL)  # as the pool kills one past its limit
            while pool.workers()[0].pid == status["pid"] or pool.workers()[0].state != "idle":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert alive(compiler), "the compiling process died with its worker"
            return int(compiler)
        finally:
            await pool.close()

    try:
        compiler = asyncio.run(scenario())
    finally:
        lock.close()  # releases the lock: the compiling process goes on
    deadline = time.monotonic() + HANG_GUARD
    while alive(compiler):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # Everything is in the cache: a load-only warm-up finds every signature there.
    env = {k: v for k, v in os.environ.items() if k != "GRADTAPE_KERNELS"}
    env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(cache))
    code = "import json; from engine.kernels import warmup; "
    code += "print(json.dumps(warmup.warm(compile=False).summary()))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_GUARD
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["loaded"] == SIGNATURES and summary["missing"] == 0


def test_warm_up_off_leaves_the_kernels_to_their_first_use() -> None:
    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=1, worker_warm_kernels=False))
        await pool.start()
        try:
            # (no warm-up to wait for: answered at once, however long it may wait)
            status = (await pool.submit("kernel_warmup", {"wait": HANG_GUARD})).result
            assert status["state"] == "idle" and status["warmed"] == []
        finally:
            await pool.close()

    asyncio.run(scenario())
