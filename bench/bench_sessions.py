"""Tape sessions benchmark: HVP requests on a recorded tape against the same HVPs through
the stateless /v1/hvp, and the memory of the server's worker over 10,000 HVPs.

Starts the real `gradtape serve` (one worker, so every request and every byte is that
worker's) on a loopback port, with a medium MLP regression loss in float32:

    B=256, d=256, hidden 3 x 512 (tanh), out 10;  loss = mean((out - y) ** 2)
    sources: every weight and bias (662,026 parameters)

Every request travels as msgpack with raw tensor bytes (the service's fast transport),
so both sides pay the same transport and the difference is the computation. Measured:

- /v1/gradient: one forward pass + gradient (the work a tape saves per HVP request);
- POST /v1/tapes/{id}/hvp against POST /v1/hvp, with K=1 and K=16 vectors per request
  (K vectors in one batched pass), taking turns: median request latency over --repeat
  requests, and the worker's seconds per request (from /metrics);
- the worker's RSS (and the HTTP process's) over --rss-hvps HVPs on one tape, in
  requests of --rss-k vectors (default 1: 10,000 requests, each a chance to leak):
  after the first hundred HVPs, every thousand, and at the end (the target: flat within
  5%), with the tape's own bytes as the server reports them.

Run by hand (not in CI), with OpenBLAS's core type left to autodetect:

    env -u OPENBLAS_CORETYPE python bench/bench_sessions.py [--repeat 10] \
        [--rss-hvps 10000] [--rss-k 1] [--write PATH]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MSGPACK = "application/msgpack"
DIMS = (256, 512, 512, 512, 10)  # d, hidden x 3, out
BATCH = 256


def tensor(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    return {"dtype": "float32", "shape": list(array.shape), "data": array.tobytes()}


def model() -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    rng = np.random.default_rng(0)
    variables, shapes, lines, h = {}, {}, [], "x"
    for i, (a, b) in enumerate(itertools.pairwise(DIMS), start=1):
        variables[f"w{i}"] = tensor(rng.standard_normal((a, b)) / np.sqrt(a))
        variables[f"b{i}"] = tensor(np.zeros(b))
        shapes[f"w{i}"], shapes[f"b{i}"] = (a, b), (b,)
        z = f"{h} @ w{i} + b{i}"
        out = f"h{i}" if i < len(DIMS) - 1 else "out"
        lines.append(f"{out} = tanh({z})" if i < len(DIMS) - 1 else f"{out} = {z}")
        h = out
    lines.append("loss = mean((out - y) ** 2)")
    definition = {
        "variables": variables,
        "inputs": {
            "x": tensor(rng.standard_normal((BATCH, DIMS[0]))),
            "y": tensor(rng.standard_normal((BATCH, DIMS[-1]))),
        },
        "program": lines,
    }
    return definition, shapes


def vectors(shapes: dict[str, tuple[int, ...]], k: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {name: tensor(rng.standard_normal(shape)) for name, shape in shapes.items()}
        for _ in range(k)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, data_dir: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_ACCESS_LOG": "false",
            "GRADTAPE_LOG_LEVEL": "warning",
            "GRADTAPE_DATA_DIR": data_dir,
            "GRADTAPE_MAX_BODY_BYTES": str(512 * 2**20),
            "GRADTAPE_TIME_LIMIT": "120",
            "GRADTAPE_MAX_TIME_LIMIT": "300",
            "GRADTAPE_HVP_MAX_VECTORS": "64",
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = httpx.Client(base_url=self.url, timeout=600.0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not come up")

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return msgpack.unpackb(self.request(path, body).content)

    def request(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = self.client.post(
            path,
            content=msgpack.packb(body, use_bin_type=True),
            headers={"content-type": MSGPACK, "accept": MSGPACK},
        )
        if response.status_code >= 300:
            raise RuntimeError(f"{path}: {response.status_code} {response.text[:500]}")
        return response

    def worker_pid(self) -> int:
        return int(self.client.get("/readyz").json()["workers"][0]["pid"])

    def busy_seconds(self) -> float:
        text = self.client.get("/metrics").text
        match = re.search(r'gradtape_worker_busy_seconds_total\{worker="0"\} (\S+)', text)
        return float(match.group(1)) if match else 0.0


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def compute_seconds(response: httpx.Response) -> float:
    match = re.search(r"compute;dur=([0-9.]+)", response.headers.get("server-timing", ""))
    return float(match.group(1)) / 1e3 if match else float("nan")


def timed(
    server: Server, requests: list[tuple[str, dict[str, Any]]], repeat: int
) -> list[tuple[float, float, float]]:
    """Per request: medians of (latency, worker seconds, compute seconds). The requests
    take turns, after two warm-up rounds, so that each sees the same state of the
    machine (the worker's heap grows during the first large requests)."""
    for _ in range(2):
        for path, body in requests:
            server.post(path, body)
    samples: list[list[tuple[float, float, float]]] = [[] for _ in requests]
    for _ in range(repeat):
        for i, (path, body) in enumerate(requests):
            before = server.busy_seconds()
            started = time.perf_counter()
            response = server.request(path, body)
            latency = time.perf_counter() - started
            samples[i].append((latency, server.busy_seconds() - before, compute_seconds(response)))
    return [
        tuple(statistics.median(column) for column in zip(*rows, strict=True)) for rows in samples
    ]  # type: ignore[misc]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:,.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="requests per latency row")
    parser.add_argument("--rss-hvps", type=int, default=10000, help="HVPs of the RSS phase")
    parser.add_argument("--rss-k", type=int, default=1, help="vectors per request there")
    parser.add_argument("--write", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    command = "env -u OPENBLAS_CORETYPE python bench/bench_sessions.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )

    definition, shapes = model()
    n = sum(int(np.prod(s)) for s in shapes.values())
    with tempfile.TemporaryDirectory(prefix="gradtape-bench-") as data_dir:
        server = Server(data_dir)
        try:
            started = time.perf_counter()
            created = server.post("/v1/tapes", {"definition": definition, "target": "loss"})
            record_seconds = time.perf_counter() - started
            tape_id = created["tape_id"]
            print(
                f"tape {tape_id[:8]}...: {n:,} parameters, {mib(created['bytes'])} MiB "
                f"recorded in {record_seconds:.2f} s",
                file=sys.stderr,
            )
            rows = []
            (grad,) = timed(
                server,
                [("/v1/gradient", {"definition": definition, "target": "loss"})],
                args.repeat,
            )
            rows.append(("/v1/gradient (forward + gradient)", 1, grad, None))
            for k in (1, 16):
                body = (
                    {"vector": vectors(shapes, 1, k)[0]}
                    if k == 1
                    else {"vectors": vectors(shapes, k, k)}
                )
                tape, fresh = timed(
                    server,
                    [
                        (f"/v1/tapes/{tape_id}/hvp", body),
                        ("/v1/hvp", {"definition": definition, "target": "loss", **body}),
                    ],
                    args.repeat,
                )
                rows.append((f"tape HVP, K={k}", k, tape, fresh))
                rows.append((f"stateless /v1/hvp, K={k}", k, fresh, None))
                print(f"K={k}: tape {ms(tape[0])} ms, stateless {ms(fresh[0])} ms", file=sys.stderr)

            # Memory over many HVPs on one tape (--rss-hvps 0: none).
            pid, http_pid = server.worker_pid(), server.process.pid
            body = {"vectors": vectors(shapes, args.rss_k, 99)}
            path = f"/v1/tapes/{tape_id}/hvp"
            done, samples = 0, []
            bytes_before = server.client.get(f"/v1/tapes/{tape_id}").json()["bytes"]
            rss_start = rss(pid)
            phase = time.perf_counter()
            while done < args.rss_hvps:
                server.post(path, body)
                done += args.rss_k
                first_hundred = not samples and done >= 100
                if first_hundred or done >= args.rss_hvps or done % 1000 < args.rss_k:
                    samples.append((done, rss(pid), rss(http_pid)))
            phase = time.perf_counter() - phase
            info = server.client.get(f"/v1/tapes/{tape_id}").json()
        finally:
            server.stop()

    lines = [
        (
            f"Tape sessions ({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} "
            f"cores, Python {platform.python_version()}, NumPy {np.__version__}); one worker, "
            "msgpack with raw tensor bytes."
        ),
        "",
        (
            f"Medium MLP: B={BATCH}, d={DIMS[0]}, hidden 3 x {DIMS[1]} tanh, out {DIMS[-1]}, "
            f"float32, HVPs over all {n:,} parameters. Tape: {mib(created['bytes'])} MiB, "
            f"recorded in {record_seconds:.2f} s. Medians of {args.repeat} requests after two "
            "warm-up rounds, tape and stateless requests taking turns. worker: seconds the "
            "worker spent on the request, transfers to and from it included (/metrics); "
            "compute: the worker's computation alone (the Server-Timing header)."
        ),
        "",
        (
            "| request | K | latency ms | worker ms | compute ms | latency per vector ms "
            "| saved vs stateless ms |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, k, (latency, worker, compute), fresh in rows:
        saved = "" if fresh is None else f"{ms(fresh[0] - latency)} ({fresh[0] / latency:.2f}x)"
        lines.append(
            f"| {name} | {k} | {ms(latency)} | {ms(worker)} | {ms(compute)} "
            f"| {ms(latency / k)} | {saved} |"
        )
    if samples:
        first, last = samples[0], samples[-1]
        peak = max(s[1] for s in samples)
        growth = (last[1] - first[1]) / first[1] * 100
        settled = next((s for s in samples if s[0] >= 1000), first)
        late = (last[1] - settled[1]) / settled[1] * 100
        lines += [
            "",
            (
                f"Memory over {last[0]:,} HVPs on one tape ({last[0] // args.rss_k} requests of "
                f"K={args.rss_k}, {phase:.0f} s):"
            ),
            "",
            "| after HVPs | worker RSS MiB | HTTP process RSS MiB |",
            "|---:|---:|---:|",
            f"| 0 | {mib(rss_start)} | |",
        ]
        lines += [f"| {d:,} | {mib(w)} | {mib(h)} |" for d, w, h in samples]
        lines += [
            "",
            (
                f"Worker RSS from {first[0]:,} to {last[0]:,} HVPs: {growth:+.2f}%; from "
                f"{settled[0]:,} to {last[0]:,}: {late:+.2f}% (peak {mib(peak)} MiB). The tape's "
                f"bytes: {bytes_before:,} before, {info['bytes']:,} after; hits "
                f"{info['hits']:,}."
            ),
        ]
    lines += ["", f"Command: `{command.strip()}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
