"""IPC benchmark (issue 17, item 4): a 10^6-element float32 array between the HTTP process
and a worker, through the socket pair (GRADTAPE_SHM_THRESHOLD=0) and through shared
memory (the default threshold), against a raw octet-stream echo of the same 4 MB.

Two measurements, each interleaved round by round (so a noisy spell of this shared
machine hits every variant alike), medians, with CPU time beside wall time:

1. The pool alone (this process plays the HTTP process): `pool.submit("gradient")` of
   `s = sum(w)` with w of 10^6 float32; the reply carries ds/dw (10^6 float32) back.
   `transport` is the round trip less the seconds the worker computed. CPU is this
   process's plus the worker's (/proc).
2. End to end over loopback HTTP: the same request as a msgpack body (`s = sum(w * w)`,
   as bench/bench_service.py sends it) to a server with each transport, against
   bench/_floor_app.py's raw octet-stream echo. CPU is the server's (its HTTP process
   and workers, /proc), not the client's. The ratios to the echo are medians of each
   round's ratio (steadier than a ratio of medians while other sessions' load varies).

Run by hand (not in CI):

    env -u OPENBLAS_CORETYPE python bench/bench_ipc.py [--rounds 30] [--write bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_service import free_port, start, start_floor

N = 10**6


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of these processes, all their threads (the scheduler's nanosecond count,
    /proc/<pid>/task/<tid>/schedstat: /proc/<pid>/stat counts 10 ms ticks, too coarse
    for one request)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                pass
    return total / 1e9


def with_children(pid: int) -> list[int]:
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return pids


def median(values: list[float]) -> float:
    return statistics.median(values) * 1e3


# ----------------------------------------------------------------------------------------
# 1. The pool alone
# ----------------------------------------------------------------------------------------


def pool_rows(rounds: int) -> list[tuple[str, str]]:
    from service.api.payloads import gradient
    from service.api.schemas import GradientRequest
    from service.core.config import Settings
    from service.pool.local import WorkerPool

    w = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    body = {
        "definition": {
            "variables": {"w": {"value": {"dtype": "float32", "shape": [N], "data": w.tobytes()}}},
            "program": ["s = sum(w)"],
        },
        "target": "s",
        "sources": ["w"],
    }
    payload = gradient(GradientRequest.model_validate(body), Settings()).payload

    async def run() -> dict[str, dict[str, list[float]]]:
        pools = {
            "socket": WorkerPool(Settings(workers=1, shm_threshold=0)),
            "shared memory": WorkerPool(Settings(workers=1)),
        }
        for pool in pools.values():
            await pool.start()
        samples: dict[str, dict[str, list[float]]] = {
            name: {"wall": [], "transport": [], "cpu": []} for name in pools
        }
        try:
            for round_ in range(rounds + 3):
                for name, pool in pools.items():
                    pids = [os.getpid(), *(wk.pid for wk in pool.workers() if wk.pid)]
                    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
                    reply = await pool.submit("gradient", payload)
                    wall = time.perf_counter() - t0
                    cpu = cpu_seconds(pids) - cpu0
                    got = reply.result["gradients"]["w"]
                    assert got.shape == (N,) and got.dtype == np.float32 and np.all(got == 1)
                    if round_ >= 3:  # warm-up rounds
                        samples[name]["wall"].append(wall)
                        samples[name]["transport"].append(wall - reply.seconds)
                        samples[name]["cpu"].append(cpu)
                    del got, reply
        finally:
            for pool in pools.values():
                await pool.close()
        return samples

    samples = asyncio.run(run())
    return [
        (
            f"pool round trip, {name}",
            (
                f"wall {median(s['wall']):.2f} ms (transport {median(s['transport']):.2f} ms), "
                f"CPU {median(s['cpu']):.2f} ms"
            ),
        )
        for name, s in samples.items()
    ]


# ----------------------------------------------------------------------------------------
# 2. End to end, against the raw echo
# ----------------------------------------------------------------------------------------


def http_rows(rounds: int) -> list[tuple[str, str]]:
    env = {
        **os.environ,
        "GRADTAPE_ACCESS_LOG": "false",
        "GRADTAPE_LOG_LEVEL": "warning",
        "GRADTAPE_MAX_BODY_BYTES": str(256 * 2**20),
        "GRADTAPE_WORKERS": "1",
        "GRADTAPE_STORE_PATH": ":memory:",
    }
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, threshold in (("socket", "0"), ("shared memory", None)):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            server_env = dict(env)
            if threshold is not None:
                server_env["GRADTAPE_SHM_THRESHOLD"] = threshold
            process = start(
                [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                server_env,
                f"{base}/readyz",
            )
            servers[name] = (process, base)
        floor_process, floor = start_floor(env)
        servers["echo"] = (floor_process, floor)

        w = np.random.default_rng(0).standard_normal(N).astype(np.float32)
        body = msgpack.packb(
            {
                "definition": {
                    "variables": {
                        "w": {"value": {"dtype": "float32", "shape": [N], "data": w.tobytes()}}
                    },
                    "program": ["s = sum(w * w)"],
                },
                "target": "s",
                "sources": ["w"],
            },
            use_bin_type=True,
        )
        raw = w.tobytes()
        with httpx.Client(timeout=120) as client:
            calls: dict[str, Callable[[], httpx.Response]] = {
                "echo": lambda: client.post(
                    f"{floor}/echo",
                    content=raw,
                    headers={"Content-Type": "application/octet-stream"},
                ),
            }
            for name in ("socket", "shared memory"):
                url = f"{servers[name][1]}/v1/gradient"
                calls[name] = lambda url=url: client.post(  # type: ignore[misc]
                    url,
                    content=body,
                    headers={
                        "Content-Type": "application/msgpack",
                        "Accept": "application/msgpack",
                    },
                )
                answer = msgpack.unpackb(calls[name]().content)
                got = np.frombuffer(answer["gradients"]["w"]["data"], "<f4")
                np.testing.assert_allclose(got, 2 * w, rtol=1e-6)
            samples: dict[str, dict[str, list[float]]] = {
                name: {"wall": [], "cpu": []} for name in calls
            }
            for round_ in range(rounds + 3):
                for name, call in calls.items():
                    pids = with_children(servers[name][0].pid)
                    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
                    call().raise_for_status()
                    wall = time.perf_counter() - t0
                    cpu = cpu_seconds(pids) - cpu0
                    if round_ >= 3:
                        samples[name]["wall"].append(wall)
                        samples[name]["cpu"].append(cpu)
    finally:
        for process, _ in servers.values():
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
    echo = median(samples["echo"]["wall"])
    echo_cpu = median(samples["echo"]["cpu"])
    rows = [
        (
            "raw octet-stream echo (bench/_floor_app.py)",
            f"wall {echo:.2f} ms, server CPU {echo_cpu:.2f} ms",
        )
    ]
    for name in ("socket", "shared memory"):
        wall, cpu = median(samples[name]["wall"]), median(samples[name]["cpu"])
        # Each round's ratio to the echo of the same round, then their median: steadier
        # than a ratio of medians while other sessions' load comes and goes.
        ratio = statistics.median(
            a / b for a, b in zip(samples[name]["wall"], samples["echo"]["wall"], strict=True)
        )
        cpu_ratio = statistics.median(
            a / b for a, b in zip(samples[name]["cpu"], samples["echo"]["cpu"], strict=True)
        )
        rows.append(
            (
                f"msgpack gradient round trip, {name}",
                (
                    f"wall {wall:.2f} ms ({ratio:.2f}x the echo), server CPU {cpu:.2f} ms "
                    f"({cpu_ratio:.2f}x)"
                ),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="measured rounds per variant")
    parser.add_argument("--write", type=Path, help="append the markdown section to this file")
    args = parser.parse_args()
    if os.environ.get("OPENBLAS_CORETYPE"):
        print(
            "warning: OPENBLAS_CORETYPE is set; run with `env -u OPENBLAS_CORETYPE`",
            file=sys.stderr,
        )
    started = datetime.datetime.now(datetime.UTC)
    rows = pool_rows(args.rounds) + http_rows(args.rounds)
    command = "env -u OPENBLAS_CORETYPE python bench/bench_ipc.py " + " ".join(sys.argv[1:])
    lines = [
        (
            f"### Run {started:%Y-%m-%d %H:%M} UTC ({platform.node() or 'this machine'}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})"
        ),
        "",
        f"Command: `{command.strip()}`",
        "",
        "| measurement (10^6 float32 there and back, medians) | result |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with args.write.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
