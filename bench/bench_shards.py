"""Sharded tapes (issue 16, item 2): the same MLP regression loss recorded as one tape
and as a tape sharded over two workers (`"shards": 2`), on a real `gradtape serve` with
two engine workers, for each executor asked (local processes; Ray actors of a Ray the
server starts itself). Per size and executor, the requests take turns after warm-up:

- the tape's gradient (POST /v1/tapes/{id}/gradient: a backward pass over the recording;
  sharded: each part's, summed by the coordinator worker);
- a tape HVP with K=1 and K=8 vectors (sharded: each part's products, summed);
- a stateless /v1/gradient (sharded: temporary parts recorded, asked and let go).

Each sharded answer is checked against the unsharded one first (largest relative
difference printed). Sizes: bench_engine.py's medium (B=256, d=256, 3 x 512 tanh, out
10) and large (B=1024, d=1024, 3 x 2048, out 10), float32, msgpack with raw bytes.

Beside each latency: the HTTP process's CPU time for the request (/proc, all its
threads), and the array bytes it moved to and from the workers (its /metrics, where the
code counts them). `--base DIR` runs a second server from another checkout (the code
before a change) beside this one's, the requests taking turns between all four tapes.

Run by hand (not in CI):

    env -u OPENBLAS_CORETYPE GRADTAPE_WORKER_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        .venv/bin/python -m bench.bench_shards \
        [--sizes medium,large] [--executors local,ray] [--repeat 5] [--base ../main]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

from bench.bench_ray import ROOT, Server
from bench.bench_sessions import compute_seconds

SIZES = {  # batch, dims (d, hidden..., out)
    "medium": (256, (256, 512, 512, 512, 10)),
    "large": (1024, (1024, 2048, 2048, 2048, 10)),
}


def tensor(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    return {"dtype": "float32", "shape": list(array.shape), "data": array.tobytes()}


def decode(t: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(t["data"], np.dtype(t["dtype"]).newbyteorder("<")).reshape(t["shape"])


def model(size: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    batch, dims = SIZES[size]
    rng = np.random.default_rng(0)
    variables, shapes, lines, h = {}, {}, [], "x"
    for i, (a, b) in enumerate(itertools.pairwise(dims), start=1):
        variables[f"w{i}"] = tensor(rng.standard_normal((a, b)) / np.sqrt(a))
        variables[f"b{i}"] = tensor(np.zeros(b))
        shapes[f"w{i}"], shapes[f"b{i}"] = (a, b), (b,)
        out = f"h{i}" if i < len(dims) - 1 else "out"
        z = f"{h} @ w{i} + b{i}"
        lines.append(f"{out} = tanh({z})" if i < len(dims) - 1 else f"{out} = {z}")
        h = out
    lines.append("loss = mean((out - y) ** 2)")
    definition = {
        "variables": variables,
        "inputs": {
            "x": tensor(rng.standard_normal((batch, dims[0]))),
            "y": tensor(rng.standard_normal((batch, dims[-1]))),
        },
        "program": lines,
    }
    return definition, shapes


def vectors(shapes: dict[str, tuple[int, ...]], k: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{n: tensor(rng.standard_normal(s)) for n, s in shapes.items()} for _ in range(k)]


def shard_server(executor: str, data_dir: str, root: Path = ROOT) -> Server:
    """Two workers (the shards' room) and limits for the large K=8 rows."""
    return Server(
        executor,
        data_dir,
        workers=2,
        settings={
            "GRADTAPE_TIME_LIMIT": "300",
            "GRADTAPE_MAX_TIME_LIMIT": "600",
            "GRADTAPE_RAY_OBJECT_STORE_MEMORY": str(1 << 30),
        },
        timeout=900.0,
        root=root,
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads (the HTTP process:
    uvicorn, the pool, and on Ray its core worker's threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def moved_bytes(server: Server) -> float | None:
    """The array bytes the pool has moved through the HTTP process so far (to and from the
    workers), from /metrics; None for code that does not count them."""
    text = server.client.get("/metrics").text
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gradtape_pool_array_bytes_total{")
        and ('"to_workers"' in line or '"from_workers"' in line)
    ]
    return sum(found) if found else None


def answer(response: httpx.Response) -> dict[str, Any]:
    return msgpack.unpackb(response.content)


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for key, want in b.items():
        x, y = decode(a[key]).astype(np.float64), decode(want).astype(np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


def run(
    size: str, executor: str, repeat: int, tmp: str, roots: dict[str, Path]
) -> list[tuple[str, ...]]:
    """The rows of one size and executor, for each checkout in `roots` (label -> root):
    one server each, all up at once, the requests taking turns between them."""
    definition, shapes = model(size)
    one, eight = vectors(shapes, 1, 1), vectors(shapes, 8, 2)
    servers: dict[str, Server] = {}
    rows = []
    try:
        for label, root in roots.items():
            servers[label] = shard_server(executor, f"{tmp}/{label}-{executor}-{size}", root)
        body = {"definition": definition, "target": "loss"}
        tapes, checks = {}, {}
        for label, server in servers.items():
            tapes[label] = {
                n: answer(server.packed("/v1/tapes", {**body, "shards": n}))["tape_id"]
                for n in (1, 2)
            }
            # The sharded answers against the unsharded ones (float32: rounding only).
            grads = {
                n: answer(server.packed(f"/v1/tapes/{tapes[label][n]}/gradient", {}))["gradients"]
                for n in (1, 2)
            }
            hvps = {
                n: answer(server.packed(f"/v1/tapes/{tapes[label][n]}/hvp", {"vector": one[0]}))[
                    "hvp"
                ]
                for n in (1, 2)
            }
            checks[label] = {
                "gradient": largest_difference(grads[2], grads[1]),
                "hvp": largest_difference(hvps[2], hvps[1]),
            }
        cases = [
            ("tape gradient", lambda t, n: (f"/v1/tapes/{t[n]}/gradient", {})),
            ("tape HVP, K=1", lambda t, n: (f"/v1/tapes/{t[n]}/hvp", {"vector": one[0]})),
            ("tape HVP, K=8", lambda t, n: (f"/v1/tapes/{t[n]}/hvp", {"vectors": eight})),
            ("/v1/gradient", lambda t, n: ("/v1/gradient", {**body, "shards": n})),
        ]
        for name, request in cases:
            # (latency, compute, HTTP process CPU, bytes through it) per checkout and n
            samples: dict[tuple[str, int], list[tuple[float, ...]]] = {
                (label, n): [] for label in servers for n in (1, 2)
            }
            for i in range(repeat + 1):  # the first round warms up
                for label, server in servers.items():
                    for n in (1, 2):
                        path, payload = request(tapes[label], n)
                        moved = moved_bytes(server)
                        cpu = cpu_seconds(server.process.pid)
                        started = time.perf_counter()
                        response = server.packed(path, payload)
                        latency = time.perf_counter() - started
                        cpu = cpu_seconds(server.process.pid) - cpu
                        after = moved_bytes(server)
                        if i:
                            samples[label, n].append(
                                (
                                    latency,
                                    compute_seconds(response),
                                    cpu,
                                    float("nan")
                                    if moved is None or after is None
                                    else after - moved,
                                )
                            )
            for label in servers:
                # Medians; the CPU time's mean (the kernel counts it in 10 ms ticks).
                med = {
                    n: [statistics.median(x[j] for x in samples[label, n]) for j in range(4)]
                    for n in (1, 2)
                }
                for n in (1, 2):
                    med[n][2] = statistics.fmean(x[2] for x in samples[label, n])
                check = checks[label]["gradient" if "gradient" in name else "hvp"]
                mb = [f"{med[n][3] / 1e6:,.1f}" if med[n][3] == med[n][3] else "" for n in (1, 2)]
                rows.append(
                    (
                        size,
                        executor,
                        name,
                        label,
                        f"{med[1][0] * 1e3:,.0f}",
                        f"{med[1][2] * 1e3:,.0f}",
                        f"{med[1][1] * 1e3:,.0f}",
                        f"{med[2][0] * 1e3:,.0f}",
                        f"{med[2][2] * 1e3:,.0f}",
                        f"{med[1][0] / med[2][0]:.2f}",
                        f"{mb[0]} / {mb[1]}" if mb[0] else "",
                        "" if name == "/v1/gradient" else f"{check:.1e}",
                    )
                )
                print(" | ".join(rows[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="medium,large")
    parser.add_argument("--executors", default="local,ray")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="a checkout of the code before a change: its server runs beside "
        "this checkout's, the requests taking turns between them",
    )
    args = parser.parse_args()
    roots = {"this": ROOT} if args.base is None else {"before": args.base, "after": ROOT}
    started = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for executor in args.executors.split(","):
                rows += run(size, executor, args.repeat, tmp, roots)
    print()
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
    print(f"- BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    print()
    print(
        "| size | executor | request | code | 1 shard p50 ms | 1 shard HTTP CPU ms (mean) | "
        "1 shard compute ms | 2 shards p50 ms | 2 shards HTTP CPU ms (mean) | speedup | "
        "MB through HTTP, 1 / 2 shards | max rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
