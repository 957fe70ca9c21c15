"""What the pool's liveness pings cost (service/pool/local.py, worker_ping_interval).

Two figures on real one-worker pools, in one run:

1. One ping's round trip on an idle worker (wall and this process's CPU, medians): what
   each ping costs, paid once per `worker_ping_interval` (10 s by default) by an idle
   worker only (a worker that answers requests is never pinged).
2. Small requests (SCENARIOS 15's gradient) with an idle gap after each (`--gap`, so that
   pings do land between them), on a pool without pings and on one pinging at
   `--interval` (default 0.005 s: 2000 times the default rate), in interleaved rounds,
   each on a fresh pool (so that no other pool's pings run in this process meanwhile):
   the requests' median wall and the HTTP process's CPU per request, and their ratio.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python -m bench.bench_pings [--rounds 5 --requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.bench_request import SCENARIO_15
from service.core.config import Settings
from service.pool import PoolObserver
from service.pool.local import WorkerPool


class Counted(PoolObserver):
    """Pings sent: every job a worker finished (worker_busy) less the requests."""

    def __init__(self) -> None:
        self.finished = 0
        self.requests = 0

    def worker_busy(self, worker: int, seconds: float) -> None:
        self.finished += 1

    def request_started(self, worker: int) -> None:
        self.requests += 1


async def _pool(interval: float, observer: PoolObserver | None = None) -> WorkerPool:
    settings = Settings(workers=1, worker_ping_interval=interval, data_dir=Path(tempfile.mkdtemp()))
    pool = WorkerPool(settings, observer)
    await pool.start()
    for _ in range(100):  # warm-up (the gradient's pass is compiled here)
        await pool.submit("gradient", SCENARIO_15)
    return pool


async def ping_round_trip(pings: int) -> None:
    pool = await _pool(0.0)
    try:
        wall, cpu = [], []
        for _ in range(pings):
            c, t = time.process_time(), time.perf_counter()
            await pool.submit("ping", None, worker=0, queue_bound=False)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        rt, rc = statistics.median(wall), statistics.median(cpu)
        print(
            f"one ping: wall p50 {rt * 1e6:.0f} us, this process's CPU p50 {rc * 1e6:.0f} us; "
            f"at the default interval (10 s) {rt / 10:.1e} of an idle worker's time"
        )
    finally:
        await pool.close()


async def one_round(
    interval: float, requests: int, gap: float, walls: list[float], cpus: list[float]
) -> int:
    """`requests` gradients on a fresh pool of its own (no other pool's pings running in
    this process meanwhile); the pings it sent."""
    counted = Counted()
    pool = await _pool(interval, counted)
    try:
        pings_before = counted.finished - counted.requests
        c = time.process_time()
        for _ in range(requests):
            t = time.perf_counter()
            await pool.submit("gradient", SCENARIO_15)
            walls.append(time.perf_counter() - t)
            await asyncio.sleep(gap)  # idle: room for a ping
        cpus.append((time.process_time() - c) / requests)
        return counted.finished - counted.requests - pings_before
    finally:
        await pool.close()


def requests_beside_pings(rounds: int, requests: int, gap: float, interval: float) -> None:
    names = {"no pings": 0.0, f"pings every {interval:g} s": interval}
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    pings = 0
    for _ in range(rounds):
        for name, every in names.items():  # interleaved: the same load for both
            pings += asyncio.run(one_round(every, requests, gap, walls[name], cpus[name]))
    base, pinged = list(names)
    for name in names:
        print(
            f"{name}: request wall p50 {statistics.median(walls[name]) * 1e3:.3f} ms, "
            f"HTTP process CPU per request (with its idle gap's loop turns) "
            f"min {min(cpus[name]) * 1e3:.3f} ms, median {statistics.median(cpus[name]) * 1e3:.3f} ms"
        )
    print(
        f"ratio (pinged / none): wall p50 "
        f"{statistics.median(walls[pinged]) / statistics.median(walls[base]):.3f}x, CPU min "
        f"{min(cpus[pinged]) / min(cpus[base]):.3f}x; {pings} pings during "
        f"{rounds * requests} requests"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.01)
    parser.add_argument("--interval", type=float, default=0.005)
    args = parser.parse_args()
    asyncio.run(ping_round_trip(args.pings))
    requests_beside_pings(args.rounds, args.requests, args.gap, args.interval)


if __name__ == "__main__":
    main()
