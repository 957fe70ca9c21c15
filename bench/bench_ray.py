"""The Ray executor against local processes (issue 16, item 5): the same requests to two
real `gradtape serve` servers on loopback ports, one with GRADTAPE_EXECUTOR=local and one
with GRADTAPE_EXECUTOR=ray (a Ray it starts itself), one engine worker each, so every
request is one worker's and the difference is the path to it.

- the small request: the design's /v1/gradient example (JSON), where the path is all
  there is: median latency, and the latency beyond the worker's compute (Server-Timing);
- the medium MLP of bench_sessions.py (662,026 float32 parameters, B=256): /v1/gradient
  and a recorded tape's HVP (K=1 and K=16 vectors), msgpack with raw tensor bytes.

The two servers take turns request by request (after warm-up rounds), so that both see
the same state of a shared machine. Then a capacity calculation for a 100-node cluster
from the measured per-request costs (a calculation, not a measurement: stated as such).

Run by hand (not in CI), with the `ray` extra installed and OpenBLAS's core type left to
autodetect:

    env -u OPENBLAS_CORETYPE python bench/bench_ray.py [--repeat 20] [--small 200]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack

from bench.bench_sessions import MSGPACK, compute_seconds, free_port, model, vectors

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "definition": {
        "variables": {"w1": {"value": 2.0}, "w2": {"value": 3.0}},
        "inputs": {"x1": 5.0, "x2": 7.0},
        "program": ["s = w1 * x1 + w2 * x2"],
    },
    "target": "s",
}


class Server:
    """A real `gradtape serve` on loopback with the given executor (bench_shards.py uses it
    too, with two workers and its own limits in `settings`, and `root`: the checkout whose
    code it runs, to compare a change with the code before it)."""

    def __init__(
        self,
        executor: str,
        data_dir: str,
        workers: int = 1,
        settings: dict[str, str] | None = None,
        timeout: float = 600.0,
        root: Path = ROOT,
    ):
        self.executor = executor
        self.port = free_port()
        env = {
            **os.environ,
            "GRADTAPE_WORKERS": str(workers),
            "GRADTAPE_ACCESS_LOG": "false",
            "GRADTAPE_LOG_LEVEL": "warning",
            "GRADTAPE_DATA_DIR": data_dir,
            "GRADTAPE_EXECUTOR": executor,
            "GRADTAPE_MAX_BODY_BYTES": str(512 * 2**20),
            "GRADTAPE_TIME_LIMIT": "120",
            "GRADTAPE_MAX_TIME_LIMIT": "300",
            "GRADTAPE_HVP_MAX_VECTORS": "64",
            **(settings or {}),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port)],
            cwd=root,  # `-m` runs the service (and engine) of this checkout
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the {executor} server did not come up")

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()  # the server stops its workers (and its Ray) itself
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def json(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = self.client.post(path, json=body)
        response.raise_for_status()
        return response

    def packed(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = self.client.post(
            path,
            content=msgpack.packb(body, use_bin_type=True),
            headers={"content-type": MSGPACK, "accept": MSGPACK},
        )
        if response.status_code >= 300:
            raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
        return response


def turns(
    servers: list[Server], send: Any, repeat: int, warmup: int = 2
) -> dict[str, tuple[float, float]]:
    """Per server: medians of (latency, latency beyond compute), the servers taking
    turns request by request."""
    for _ in range(warmup):
        for s in servers:
            send(s)
    samples: dict[str, list[tuple[float, float]]] = {s.executor: [] for s in servers}
    for _ in range(repeat):
        for s in servers:
            started = time.perf_counter()
            response = send(s)
            latency = time.perf_counter() - started
            samples[s.executor].append((latency, latency - compute_seconds(response)))
    return {
        k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
        for k, v in samples.items()
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}" if seconds < 0.01 else f"{seconds * 1e3:,.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="medium requests per case")
    parser.add_argument("--small", type=int, default=200, help="small requests")
    args = parser.parse_args()
    definition, shapes = model()
    one, sixteen = vectors(shapes, 1, 1)[0], vectors(shapes, 16, 2)
    started = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        servers = [Server("local", f"{tmp}/local"), Server("ray", f"{tmp}/ray")]
        try:
            tapes = {
                s.executor: msgpack.unpackb(
                    s.packed("/v1/tapes", {"definition": definition, "target": "loss"}).content
                )["tape_id"]
                for s in servers
            }
            cases = [
                ("small /v1/gradient (JSON)", args.small, lambda s: s.json("/v1/gradient", SMALL)),
                (
                    "medium /v1/gradient",
                    args.repeat,
                    lambda s: s.packed(
                        "/v1/gradient", {"definition": definition, "target": "loss"}
                    ),
                ),
                (
                    "medium tape HVP, K=1",
                    args.repeat,
                    lambda s: s.packed(f"/v1/tapes/{tapes[s.executor]}/hvp", {"vector": one}),
                ),
                (
                    "medium tape HVP, K=16",
                    max(3, args.repeat // 4),
                    lambda s: s.packed(f"/v1/tapes/{tapes[s.executor]}/hvp", {"vectors": sixteen}),
                ),
            ]
            results = [(name, n, turns(servers, send, n)) for name, n, send in cases]
        finally:
            for s in servers:
                s.stop()
    print(f"- command: `{' '.join(['python', *sys.argv])}`")
    print(
        f"- date: {started.isoformat(timespec='seconds')}; load average at start: "
        f"{', '.join(f'{x:.2f}' for x in load)}"
    )
    print(
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}"
    )
    print()
    print(
        "| request | n | local p50 ms | ray p50 ms | ray - local ms | beyond compute: "
        "local / ray ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, n, r in results:
        (local, local_over), (ray, ray_over) = r["local"], r["ray"]
        print(
            f"| {name} | {n} | {ms(local)} | {ms(ray)} | {ms(ray - local)} | "
            f"{ms(local_over)} / {ms(ray_over)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
