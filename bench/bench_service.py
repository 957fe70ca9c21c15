"""Service benchmark: latency and throughput of the HTTP layer, and tensor transport.

Starts the real `gradtape serve` (uvicorn and its worker processes) and a trivial FastAPI
app (the floor: bench/_floor_app.py) on loopback ports, then measures

- a small gradient request (SCENARIOS.md 15) against a trivial JSON endpoint:
  p50/p99 latency and requests per second, sequential and with 8 concurrent clients;
- the round trip of a 10^6-element float32 tensor (sent as a variable, its gradient
  2w of the same size coming back) in each encoding (JSON lists, base64, msgpack)
  against a raw application/octet-stream echo of the same 4 MB.

Run by hand (not in CI), with OpenBLAS's core type left to autodetect:

    env -u OPENBLAS_CORETYPE python bench/bench_service.py [--requests 300] [--write PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import os
import platform
import socket
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

SMALL_GRADIENT = {
    "definition": {
        "variables": {"w1": {"value": 2.0}, "w2": {"value": 3.0}},
        "inputs": {"x1": 5.0, "x2": 7.0},
        "program": ["s = w1 * x1 + w2 * x2"],
    },
    "target": "s",
    "sources": ["w1", "w2"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    args: list[str], env: dict[str, str], url: str, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """`args` started in `cwd` (another checkout: bench_request.py's --baseline), once
    `url` answers 200."""
    process = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{args} did not come up at {url}")


def start_floor(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """bench/_floor_app.py (the trivial endpoints every request is compared with) under
    uvicorn, as the service runs: its process and base URL."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "uvicorn",
        "bench._floor_app:app",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    url = f"http://127.0.0.1:{port}"
    return start(args, env, f"{url}/ping"), url


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1e3, ordered[int(len(ordered) * 0.99) - 1] * 1e3


def sequential(call: Callable[[], httpx.Response], n: int) -> dict[str, float]:
    for _ in range(min(20, n)):
        call().raise_for_status()
    times = []
    start_all = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        call().raise_for_status()
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start_all
    p50, p99 = percentiles(times)
    return {"p50_ms": p50, "p99_ms": p99, "rps": n / total}


def concurrent(
    url: str, body: dict | None, n_per_client: int, clients: int = 8
) -> dict[str, float]:
    async def client(session: httpx.AsyncClient, times: list[float]) -> None:
        for _ in range(n_per_client):
            t = time.perf_counter()
            r = await (session.post(url, json=body) if body is not None else session.get(url))
            r.raise_for_status()
            times.append(time.perf_counter() - t)

    async def run() -> dict[str, float]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=60, limits=limits) as session:
            await asyncio.gather(*(client(session, []) for _ in range(clients)))  # warm-up
            times: list[float] = []
            t0 = time.perf_counter()
            await asyncio.gather(*(client(session, times) for _ in range(clients)))
            total = time.perf_counter() - t0
        p50, p99 = percentiles(times)
        return {"p50_ms": p50, "p99_ms": p99, "rps": len(times) / total}

    return asyncio.run(run())


def tensor_body(w: np.ndarray, encoding: str) -> dict:
    if encoding == "json":
        value: dict = {"dtype": "float32", "shape": list(w.shape), "data": w.tolist()}
    elif encoding == "base64":
        value = {
            "dtype": "float32",
            "shape": list(w.shape),
            "base64": base64.b64encode(w.tobytes()).decode(),
        }
    else:
        value = {"dtype": "float32", "shape": list(w.shape), "data": w.tobytes()}
    return {
        "definition": {"variables": {"w": {"value": value}}, "program": ["s = sum(w * w)"]},
        "target": "s",
        "sources": ["w"],
    }


def round_trip(
    client: httpx.Client, base: str, encoding: str, w: np.ndarray
) -> Callable[[], httpx.Response]:
    body = tensor_body(w, encoding)
    if encoding == "msgpack":
        payload = msgpack.packb(body, use_bin_type=True)
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        return lambda: client.post(f"{base}/v1/gradient", content=payload, headers=headers)
    return lambda: client.post(f"{base}/v1/gradient", json=body)


def check_round_trip(response: httpx.Response, encoding: str, w: np.ndarray) -> None:
    if encoding == "msgpack":
        grad = msgpack.unpackb(response.content, raw=False)["gradients"]["w"]
        got = np.frombuffer(grad["data"], dtype="<f4")
    else:
        grad = response.json()["gradients"]["w"]
        got = (
            np.frombuffer(base64.b64decode(grad["base64"]), "<f4")
            if "base64" in grad
            else np.asarray(grad["data"], np.float32)
        )
    np.testing.assert_allclose(got, 2 * w, rtol=1e-6)


def median_ms(call: Callable[[], httpx.Response], repeat: int) -> float:
    call().raise_for_status()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        call().raise_for_status()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per row")
    parser.add_argument("--repeat", type=int, default=7, help="round trips per encoding")
    parser.add_argument("--write", type=Path, help="append the markdown section to this file")
    args = parser.parse_args()
    if os.environ.get("OPENBLAS_CORETYPE"):
        print(
            "warning: OPENBLAS_CORETYPE is set; run with `env -u OPENBLAS_CORETYPE`",
            file=sys.stderr,
        )

    env = {
        **os.environ,
        "GRADTAPE_ACCESS_LOG": "false",
        "GRADTAPE_LOG_LEVEL": "warning",
        "GRADTAPE_MAX_BODY_BYTES": str(256 * 2**20),
        "GRADTAPE_WORKERS": "1",
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env, f"{base}/readyz"
    )
    floor_server, floor = start_floor(env)
    rows: list[tuple[str, str]] = []
    try:
        with httpx.Client(timeout=120) as client:
            trivial = sequential(
                lambda: client.post(f"{floor}/trivial", json=SMALL_GRADIENT), args.requests
            )
            gradient = sequential(
                lambda: client.post(f"{base}/v1/gradient", json=SMALL_GRADIENT), args.requests
            )
            rows.append(
                (
                    "trivial FastAPI endpoint, sequential",
                    f"p50 {trivial['p50_ms']:.2f} ms, p99 {trivial['p99_ms']:.2f} ms, {trivial['rps']:.0f} req/s",
                )
            )
            rows.append(
                (
                    "small gradient, sequential",
                    f"p50 {gradient['p50_ms']:.2f} ms, p99 {gradient['p99_ms']:.2f} ms, {gradient['rps']:.0f} req/s",
                )
            )
            rows.append(
                (
                    "  gradient p50 minus floor p50",
                    f"{gradient['p50_ms'] - trivial['p50_ms']:.2f} ms (target: within 2 ms)",
                )
            )
            per_client = max(10, args.requests // 8)
            trivial8 = concurrent(f"{floor}/trivial", SMALL_GRADIENT, per_client)
            gradient8 = concurrent(f"{base}/v1/gradient", SMALL_GRADIENT, per_client)
            rows.append(
                (
                    "trivial endpoint, 8 concurrent clients",
                    f"p50 {trivial8['p50_ms']:.2f} ms, p99 {trivial8['p99_ms']:.2f} ms, {trivial8['rps']:.0f} req/s",
                )
            )
            rows.append(
                (
                    "small gradient, 8 concurrent clients",
                    f"p50 {gradient8['p50_ms']:.2f} ms, p99 {gradient8['p99_ms']:.2f} ms, {gradient8['rps']:.0f} req/s",
                )
            )

            w = np.random.default_rng(0).standard_normal(10**6).astype(np.float32)
            megabytes = 2 * w.nbytes / 1e6  # there and back
            echo = median_ms(
                lambda: client.post(
                    f"{floor}/echo",
                    content=w.tobytes(),
                    headers={"Content-Type": "application/octet-stream"},
                ),
                args.repeat,
            )
            rows.append(
                (
                    "raw octet-stream echo, 10^6 float32",
                    f"{echo:.1f} ms ({megabytes / echo * 1e3:.0f} MB/s)",
                )
            )
            for encoding in ("msgpack", "base64", "json"):
                call = round_trip(client, base, encoding, w)
                check_round_trip(call(), encoding, w)
                ms = median_ms(call, args.repeat if encoding != "json" else 3)
                rows.append(
                    (
                        f"gradient round trip, 10^6 float32, {encoding}",
                        f"{ms:.1f} ms ({megabytes / ms * 1e3:.0f} MB/s, {ms / echo:.1f}x the echo)",
                    )
                )
    finally:
        for p in (server, floor_server):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    command = "env -u OPENBLAS_CORETYPE python bench/bench_service.py " + " ".join(sys.argv[1:])
    lines = [
        f"### Service ({datetime.date.today()}, {platform.node() or 'this machine'}, {os.cpu_count()} CPUs)",
        "",
        f"Command: `{command.strip()}`",
        "",
        "| measurement | result |",
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
