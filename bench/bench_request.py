"""Request-path benchmark: what the HTTP process adds to a small request (issue 17, item 3).

Starts the real `gradtape serve` (uvicorn and one worker process, as the tests start it)
and the floor, a trivial FastAPI app served by the same uvicorn (bench/_floor_app.py), on
loopback ports, then sends interleaved requests over keep-alive httpx connections:

- the floor: `GET /ping` (no body) and `POST /trivial` with each row's own body (parsed,
  a small JSON answer): the least a FastAPI endpoint costs for that body;
- `POST /v1/gradient`: SCENARIOS.md 15 (two scalars), and a small MLP (B32 d16, 2x32 tanh,
  out 4, mean squared error), JSON and msgpack;
- `POST /v1/tapes/{id}/hvp` on the small MLP's tape, one vector, JSON and msgpack.

With `--baseline TREE`, the server of another checkout (a worktree of the commit before a
change) runs beside this one and its rows are interleaved with the others: a before and
after from one run. Each round sends every row once, in a shuffled order; the table gives
the p50 and p90 wall latency, the client's CPU time per request (the client shares the
machine's cores with the servers), the worker's own compute time (its Server-Timing
header), the mean CPU time of the processes that answered it (its server's HTTP process,
its worker; Linux /proc, clock ticks: a mean over many requests), and each row's p50
minus its floor's p50.

Run by hand (not in CI), with OpenBLAS's core type left to autodetect:

    env -u OPENBLAS_CORETYPE .venv/bin/python bench/bench_request.py [--rounds 600]
        [--baseline ../main-worktree] [--write PATH]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (imported after the path is set: run as `python bench/bench_request.py`)
from bench.bench_service import SMALL_GRADIENT, free_port, start, start_floor

MSGPACK = "application/msgpack"

SCENARIO_15 = SMALL_GRADIENT  # (SCENARIOS.md 15, as bench_service.py sends it)
DIMS = (16, 32, 32, 4)  # d, hidden x 2, out
BATCH = 32


def _tensor(array: np.ndarray, binary: bool) -> dict[str, Any]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    data: Any = array.tobytes() if binary else array.reshape(-1).tolist()
    return {"dtype": "float32", "shape": list(array.shape), "data": data}


def small_mlp(binary: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the gradient body, one HVP vector) of the small MLP, as JSON lists or bytes."""
    rng = np.random.default_rng(0)
    variables: dict[str, Any] = {}
    vector: dict[str, Any] = {}
    lines, h = [], "x"
    for i, (a, b) in enumerate(itertools.pairwise(DIMS), start=1):
        w = rng.standard_normal((a, b)) / np.sqrt(a)
        variables[f"w{i}"], variables[f"b{i}"] = _tensor(w, binary), _tensor(np.zeros(b), binary)
        vector[f"w{i}"] = _tensor(rng.standard_normal((a, b)), binary)
        vector[f"b{i}"] = _tensor(rng.standard_normal(b), binary)
        last = i == len(DIMS) - 1
        out = "out" if last else f"h{i}"
        lines.append(f"{out} = {h} @ w{i} + b{i}" if last else f"{out} = tanh({h} @ w{i} + b{i})")
        h = out
    lines.append("loss = mean((out - y) ** 2)")
    body = {
        "definition": {
            "variables": variables,
            "inputs": {
                "x": _tensor(rng.standard_normal((BATCH, DIMS[0])), binary),
                "y": _tensor(rng.standard_normal((BATCH, DIMS[-1])), binary),
            },
            "program": lines,
        },
        "target": "loss",
    }
    return body, vector


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Row:
    name: str
    url: str
    content: bytes | None  # None: a GET
    content_type: str = "application/json"
    floor: str | None = None  # the row this one is compared with
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    # The processes answering it (its server's HTTP process, then its workers) and their
    # CPU seconds during each of its requests (/proc: clock ticks, so a mean over many
    # requests, not a percentile).
    processes: list[int] = field(default_factory=list)
    spent: list[list[float]] = field(default_factory=list)

    def send(self, client: httpx.Client) -> httpx.Response:
        if self.content is None:
            return client.get(self.url)
        headers = {"content-type": self.content_type, "accept": self.content_type}
        return client.post(self.url, content=self.content, headers=headers)

    def timed(self, client: httpx.Client) -> None:
        before = [_cpu(pid) for pid in self.processes]
        cpu, wall = time.thread_time(), time.perf_counter()
        response = self.send(client)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        self.spent.append([_cpu(pid) - b for pid, b in zip(self.processes, before, strict=True)])
        if response.status_code >= 300:
            raise RuntimeError(f"{self.name}: {response.status_code} {response.text[:300]}")
        self.wall.append(wall)
        self.cpu.append(cpu)
        match = re.search(r"compute;dur=([0-9.]+)", response.headers.get("server-timing", ""))
        if match:
            self.compute.append(float(match.group(1)) / 1e3)


def _cpu(pid: int) -> float:
    """User + system seconds of process `pid` (Linux /proc; 0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def rows_for(
    servers: list[tuple[str, str, str]], floor: str, bodies: dict[str, Any], probes: bool = False
) -> list[Row]:
    """The floor's rows, and for each server (label, base URL, tape id) its compute rows,
    each beside the floor's row for the same body; with `probes`, the service's GET
    /healthz (its middleware and routing alone) and GET /v1/tapes (gated, no worker)
    beside the floor's GET /ping."""
    rows = [Row("floor GET /ping", f"{floor}/ping", None)]
    cases = [
        ("gradient, SCENARIOS 15, JSON", "gradient", SCENARIO_15, False),
        ("gradient, small MLP, JSON", "gradient", bodies["mlp_json"], False),
        ("gradient, small MLP, msgpack", "gradient", bodies["mlp_msgpack"], True),
        ("tape HVP, small MLP, JSON", "hvp", {"vector": bodies["vector_json"]}, False),
        ("tape HVP, small MLP, msgpack", "hvp", {"vector": bodies["vector_msgpack"]}, True),
    ]
    if probes:  # the service's own stack without a worker, against the floor's GET
        for label, base, _ in servers:
            rows.append(
                Row(f"probe GET /healthz{label}", f"{base}/healthz", None, floor=rows[0].name)
            )
            rows.append(
                Row(f"probe GET /v1/tapes{label}", f"{base}/v1/tapes", None, floor=rows[0].name)
            )
    for name, route, body, binary in cases:
        content = msgpack.packb(body, use_bin_type=True) if binary else orjson.dumps(body)
        kind = MSGPACK if binary else "application/json"
        twin = f"floor POST /trivial, body of: {name}"
        rows.append(Row(twin, f"{floor}/trivial", content, kind))
        for label, base, tape_id in servers:
            url = f"{base}/v1/gradient" if route == "gradient" else f"{base}/v1/tapes/{tape_id}/hvp"
            rows.append(Row(f"{name}{label}", url, content, kind, floor=twin))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=600, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=50, help="untimed rounds first")
    parser.add_argument("--write", type=Path, help="append the markdown table to this file")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. a worktree of main) whose server is measured beside "
        "this one's, interleaved: its rows are marked [baseline]",
    )
    parser.add_argument(
        "--probes",
        action="store_true",
        help="also GET /healthz and GET /v1/tapes of each server (no worker: the HTTP "
        "process's own stack), beside the floor's GET /ping",
    )
    args = parser.parse_args()
    if os.environ.get("OPENBLAS_CORETYPE"):
        print(
            "warning: OPENBLAS_CORETYPE is set; run with `env -u OPENBLAS_CORETYPE`",
            file=sys.stderr,
        )

    trees = [("", ROOT)] + ([(" [baseline]", args.baseline.resolve())] if args.baseline else [])
    env = {
        **os.environ,
        "GRADTAPE_ACCESS_LOG": "false",
        "GRADTAPE_LOG_LEVEL": "warning",
        "GRADTAPE_WORKERS": "1",
    }
    processes: list[subprocess.Popen[bytes]] = []
    servers: list[tuple[str, str, str]] = []
    try:
        floor_process, floor = start_floor(env)
        processes.append(floor_process)
        mlp_json, vector_json = small_mlp(binary=False)
        mlp_msgpack, vector_msgpack = small_mlp(binary=True)
        for label, tree in trees:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            data_dir = tempfile.mkdtemp(prefix="gradtape-bench-request-")
            processes.append(
                start(
                    [sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                    {**env, "GRADTAPE_DATA_DIR": data_dir},
                    f"{base}/readyz",
                    cwd=tree,
                )
            )
            created = httpx.post(f"{base}/v1/tapes", json=mlp_json, timeout=60)
            created.raise_for_status()
            servers.append((label, base, created.json()["tape_id"]))
        rows = rows_for(
            servers,
            floor,
            {
                "mlp_json": mlp_json,
                "mlp_msgpack": mlp_msgpack,
                "vector_json": vector_json,
                "vector_msgpack": vector_msgpack,
            },
            args.probes,
        )
        with httpx.Client(timeout=60) as client:
            order = list(rows)
            rng = random.Random(0)
            for _ in range(args.warmup):
                for row in order:
                    row.send(client).raise_for_status()
            # The processes each row's requests go through: the HTTP process, its workers.
            bases = {base: process.pid for (_, base, _), process in zip(servers, processes[1:])}
            for row in rows:
                pid = next((p for b, p in bases.items() if row.url.startswith(b)), None)
                row.processes = [floor_process.pid] if pid is None else [pid, *_children(pid)]
            for _ in range(args.rounds):
                rng.shuffle(order)
                for row in order:
                    row.timed(client)
    finally:
        for process in processes:
            stop(process)

    by_name = {row.name: row for row in rows}
    lines = [
        (
            "| request | p50 ms | p90 ms | client CPU p50 ms | worker compute p50 ms "
            "| server CPU mean ms | worker CPU mean ms | p50 minus its floor's ms |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        p50 = statistics.median(row.wall)
        over = ""
        if row.floor is not None:
            over = ms(p50 - statistics.median(by_name[row.floor].wall))
        compute = ms(statistics.median(row.compute)) if row.compute else ""
        # (the HTTP process's: the floor's own for its rows; the workers', summed)
        server = ms(statistics.fmean(s[0] for s in row.spent)) if row.spent else ""
        workers = [sum(s[1:]) for s in row.spent]
        worker = ms(statistics.fmean(workers)) if len(row.processes) > 1 else ""
        lines.append(
            f"| {row.name} | {ms(p50)} | {ms(quantile(row.wall, 0.9))} | "
            f"{ms(statistics.median(row.cpu))} | {compute} | {server} | {worker} | {over} |"
        )
    load = os.getloadavg()
    command = "env -u OPENBLAS_CORETYPE .venv/bin/python bench/bench_request.py " + " ".join(
        sys.argv[1:]
    )
    text = "\n".join(
        [
            (
                f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
                f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end; {args.rounds} "
                f"interleaved rounds of {len(rows)} requests."
            ),
            "",
            f"Command: `{command.strip()}`",
            "",
            *lines,
            "",
        ]
    )
    print(text)
    if args.write:
        with args.write.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
