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

Run by hand (not in CI):

    env -u OPENBLAS_CORETYPE .venv/bin/python -m bench.bench_shards \
        [--sizes medium,large] [--executors local,ray] [--repeat 5]
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
from typing import Any

import httpx
import msgpack
import numpy as np

from bench.bench_ray import Server
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
    definition = {"variables": variables,
                  "inputs": {"x": tensor(rng.standard_normal((batch, dims[0]))),
                             "y": tensor(rng.standard_normal((batch, dims[-1])))},
                  "program": lines}
    return definition, shapes


def vectors(shapes: dict[str, tuple[int, ...]], k: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{n: tensor(rng.standard_normal(s)) for n, s in shapes.items()} for _ in range(k)]


def shard_server(executor: str, data_dir: str) -> Server:
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
    )


def answer(response: httpx.Response) -> dict[str, Any]:
    return msgpack.unpackb(response.content)


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for key, want in b.items():
        x, y = decode(a[key]).astype(np.float64), decode(want).astype(np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


def run(size: str, executor: str, repeat: int, tmp: str) -> list[tuple[str, ...]]:
    definition, shapes = model(size)
    one, eight = vectors(shapes, 1, 1), vectors(shapes, 8, 2)
    server = shard_server(executor, f"{tmp}/{executor}-{size}")
    rows = []
    try:
        body = {"definition": definition, "target": "loss"}
        tapes = {n: answer(server.packed("/v1/tapes", {**body, "shards": n}))["tape_id"]
                 for n in (1, 2)}
        # The sharded answers against the unsharded ones (float32: rounding only).
        checks = {}
        grads = {n: answer(server.packed(f"/v1/tapes/{tapes[n]}/gradient", {}))["gradients"]
                 for n in (1, 2)}
        checks["gradient"] = largest_difference(grads[2], grads[1])
        hvps = {n: answer(server.packed(f"/v1/tapes/{tapes[n]}/hvp", {"vector": one[0]}))["hvp"]
                for n in (1, 2)}
        checks["hvp"] = largest_difference(hvps[2], hvps[1])
        cases = [
            ("tape gradient", lambda n: (f"/v1/tapes/{tapes[n]}/gradient", {})),
            ("tape HVP, K=1", lambda n: (f"/v1/tapes/{tapes[n]}/hvp", {"vector": one[0]})),
            ("tape HVP, K=8", lambda n: (f"/v1/tapes/{tapes[n]}/hvp", {"vectors": eight})),
            ("/v1/gradient", lambda n: ("/v1/gradient", {**body, "shards": n})),
        ]
        for name, request in cases:
            samples: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
            for i in range(repeat + 1):  # the first round warms up
                for n in (1, 2):
                    path, payload = request(n)
                    started = time.perf_counter()
                    response = server.packed(path, payload)
                    latency = time.perf_counter() - started
                    if i:
                        samples[n].append((latency, compute_seconds(response)))
            med = {n: (statistics.median(a for a, _ in s), statistics.median(c for _, c in s))
                   for n, s in samples.items()}
            check = checks.get("gradient" if "gradient" in name else "hvp")
            rows.append((size, executor, name, f"{med[1][0] * 1e3:,.0f}",
                         f"{med[1][1] * 1e3:,.0f}", f"{med[2][0] * 1e3:,.0f}",
                         f"{med[1][0] / med[2][0]:.2f}",
                         "" if name == "/v1/gradient" else f"{check:.1e}"))
            print(" | ".join(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="medium,large")
    parser.add_argument("--executors", default="local,ray")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for executor in args.executors.split(","):
                rows += run(size, executor, args.repeat, tmp)
    print()
    print(f"- command: `{' '.join(['python', *sys.argv])}`")
    print(f"- date: {started.isoformat(timespec='seconds')}; load average at start: "
          f"{', '.join(f'{x:.2f}' for x in load)}")
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}")
    print()
    print("| size | executor | request | 1 shard p50 ms | 1 shard compute ms | "
          "2 shards p50 ms | speedup | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
