"""The worker pool's round trip alone, as the HTTP process pays it: `pool.submit` of a
ping and of SCENARIOS 15's gradient on a real one-worker pool, with a calls.Watch as the
HTTP middleware gives every request (so the disconnect poll is armed). Prints the median
wall time and the median CPU time of this process's thread per round trip (the event
loop's own work: framing, the loop's turns, the socket calls), and the 10th percentile of
the CPU (less sensitive to other processes). Run it in two checkouts one after the other
to compare them.

    env -u OPENBLAS_CORETYPE .venv/bin/python -m bench.pool_roundtrip [--requests 3000]
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
from service.pool import calls
from service.pool.local import WorkerPool


async def run(requests: int) -> None:
    pool = WorkerPool(Settings(workers=1, data_dir=Path(tempfile.mkdtemp())))
    await pool.start()

    async def gone() -> bool:
        return False

    calls.current.set(calls.Watch(gone))
    try:
        for kind, payload in (("ping", None), ("gradient", SCENARIO_15)):
            for _ in range(200):  # warm-up (the gradient's pass is compiled here)
                await pool.submit(kind, payload)
            wall, cpu = [], []
            for _ in range(requests):
                c, t = time.thread_time(), time.perf_counter()
                await pool.submit(kind, payload)
                wall.append(time.perf_counter() - t)
                cpu.append(time.thread_time() - c)
            print(
                f"{kind}: wall p50 {statistics.median(wall) * 1e3:.3f} ms, this process's "
                f"CPU p50 {statistics.median(cpu) * 1e3:.3f} ms "
                f"(p10 {sorted(cpu)[len(cpu) // 10] * 1e3:.3f} ms)"
            )
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    asyncio.run(run(parser.parse_args().requests))


if __name__ == "__main__":
    main()
