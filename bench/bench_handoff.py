"""What a shard's answer costs the local pool on its way to the coordinator (issue 16,
item 2): through the HTTP process, as the pool routes it, against a handoff from worker
to worker in which the coordinator would map the part's own shared-memory segment and
the HTTP process pass only its name.

One process plays the three sides with the pool's own code (service/core/ipc.py and
shm.py: each side its own Outbox/Inbox, so every mapping, page allocation and fault is
the real one): the part's worker writes its reply (a parameter-sized float32 vector,
the medium and large MLPs' of bench_shards.py); then either

- routed: the HTTP process reads it (maps the part's segment) and packs it into the
  message for the coordinator (a copy into its own segment for that worker), which
  reads it and sums it with its own part; or
- handoff: the coordinator reads the part's segment itself and sums.

Each step is timed (wall and this process's CPU), medians of --repeat. The difference
is what a worker-to-worker handoff would save per part's answer and product.

    env -u OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS=1 .venv/bin/python -m bench.bench_handoff
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.core import ipc, shm

SIZES = {"medium": 662_026, "large": 10_512_394}  # float32 parameters (bench_shards.py)


def timed(step: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = step()
    return out, time.perf_counter() - wall, time.process_time() - cpu


class Sides:
    """The arenas of the three processes, kept across rounds as the pool keeps them (an
    arena is mapped once and reused; past shm.MAX_ARENA each message has its own)."""

    def __init__(self, channel: shm.Channel):
        self.channel = channel
        self.part_routed = shm.Outbox(channel, "w1")  # the part's replies, read here
        self.part_handoff = shm.Outbox(channel, "w2")  # ... read by the coordinator
        self.http_in, self.http_out = shm.Inbox(channel), shm.Outbox(channel, "a0")
        self.coordinator_in = shm.Inbox(channel)  # from the HTTP process
        self.coordinator_from_part = shm.Inbox(channel)  # from the part (handoff)

    def close(self) -> None:
        for outbox in (self.part_routed, self.part_handoff, self.http_out):
            outbox.close()
        shm.sweep(self.channel.prefix + "-")


def one_round(n: int, sides: Sides) -> dict[str, tuple[float, float]]:
    channel = sides.channel
    own = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    answer = {"hvp": {"w": np.random.default_rng(1).standard_normal(n).astype(np.float32)}}
    out: dict[str, tuple[float, float]] = {}

    def summed(result: dict[str, Any]) -> np.ndarray:
        return 0.5 * own.astype(np.float64) + 0.5 * np.asarray(result["hvp"]["w"], np.float64)

    # The part writes its reply (both ways alike).
    (_, body), *t = timed(lambda: ipc.prepare({"result": answer}, channel).frame(sides.part_routed))
    out["part writes its answer"] = (t[0], t[1])
    # Routed: the HTTP process reads it and packs it for the coordinator.
    result, *t1 = timed(lambda: ipc.unpack(body, sides.http_in)["result"])
    (_, body2), *t2 = timed(
        lambda: ipc.prepare({"kept": {"k": result}}, channel).frame(sides.http_out)
    )
    out["HTTP process: read + forward"] = (t1[0] + t2[0], t1[1] + t2[1])
    _, *t = timed(lambda: summed(ipc.unpack(body2, sides.coordinator_in)["kept"]["k"]))
    out["coordinator reads + sums (routed)"] = (t[0], t[1])
    result = None  # its arena free again, as the pool lets it go once forwarded
    # Handoff: the coordinator maps the part's segment itself.
    (_, body), *_ = timed(
        lambda: ipc.prepare({"result": answer}, channel).frame(sides.part_handoff)
    )
    _, *t = timed(lambda: summed(ipc.unpack(body, sides.coordinator_from_part)["result"]))
    out["coordinator reads + sums (handoff)"] = (t[0], t[1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    print(
        f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{os.cpu_count()} CPUs"
    )
    print()
    print("| vector | step | wall ms (p50) | CPU ms (p50) |")
    print("|---|---|---|---|")
    for size, n in SIZES.items():
        sides = Sides(shm.Channel.for_new_pool(64 * 1024))
        try:
            rounds = [one_round(n, sides) for _ in range(args.repeat + 1)][1:]  # warm-up
        finally:
            sides.close()
        for step in rounds[0]:
            wall = statistics.median(r[step][0] for r in rounds) * 1e3
            cpu = statistics.median(r[step][1] for r in rounds) * 1e3
            print(f"| {size} ({n * 4 / 1e6:.1f} MB) | {step} | {wall:,.1f} | {cpu:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
