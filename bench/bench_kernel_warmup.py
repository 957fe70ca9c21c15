"""The compiled kernels' warm-up (engine/kernels/warmup.py): a worker's start and its first
requests with the warm-up off (a kernel compiles inside the first request that uses it)
and on (the worker warms in the background: loads a filled cache in its thread, has a
cold one compiled by a process of its own), with numba's cache empty and filled; and
what a request pays while a compilation runs in its own process's thread (the GIL)
against one in another process.

Run from the repository root (one BLAS thread; OPENBLAS_CORETYPE unset):

    env -u OPENBLAS_CORETYPE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python bench/bench_kernel_warmup.py [--model transformer|resnet]

Each scenario is a fresh pool of one worker (service/pool/local.py) with a cache
directory of its own (NUMBA_CACHE_DIR: empty, or filled by `python -m
engine.kernels.warmup` beforehand); the model is bench/onnx_models.py's (the
transformer: 2 layers, d=64, batch 32; the ResNet: batch 8), its gradient a request.
Wall times in seconds; "worker s" is the compute time the worker reports.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import onnx_models
from service.core.config import Settings
from service.pool.local import WorkerPool

BATCH = {"transformer": 32, "resnet": 8}


def payload(name: str) -> dict:
    from service.api.payloads import gradient
    from service.api.schemas import GradientRequest

    data, _, frozen = onnx_models.model(name)
    x, y = onnx_models.batch(name, BATCH[name], np.random.default_rng(0))

    def tensor(a: np.ndarray) -> dict:
        return {
            "dtype": str(a.dtype),
            "shape": list(a.shape),
            "base64": base64.b64encode(a.tobytes()).decode(),
        }

    body = {
        "definition": {
            "models": {"net": {"onnx": base64.b64encode(data).decode(), "frozen": frozen}},
            "inputs": {"x": tensor(x), "y": tensor(y)},
            "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
        },
        "target": "loss",
    }
    return gradient(GradientRequest.model_validate(body), Settings()).payload


def fill(cache: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "engine.kernels.warmup"], env=env, check=True, capture_output=True
    )


async def scenario(warm: bool, cache: Path, body: dict) -> dict:
    os.environ["NUMBA_CACHE_DIR"] = str(cache)  # the worker's, at its spawn
    pool = WorkerPool(Settings(workers=1, worker_warm_kernels=warm, time_limit=300))
    t0 = time.perf_counter()
    await pool.start()
    out: dict = {"hello": time.perf_counter() - t0}
    try:
        t = time.perf_counter()
        first = await pool.submit("gradient", body, time_limit=300)
        out["first"], out["first_worker"] = time.perf_counter() - t, first.seconds
        if warm:
            status = (await pool.submit("kernel_warmup", {"wait": 290}, time_limit=300)).result
            out["ready"] = time.perf_counter() - t0
            out["status"] = {k: status.get(k) for k in ("loaded", "compiled", "process")}
        later = []
        for _ in range(3):
            t = time.perf_counter()
            await pool.submit("gradient", body, time_limit=300)
            later.append(time.perf_counter() - t)
        out["after"] = min(later)
    finally:
        await pool.close()
    return out


GIL_PROBE = """
import json, sys, threading, time
import numpy as np
sys.path.insert(0, {root!r})
from engine import kernels
from engine.kernels import warmup
from service.worker import compute, dispatch
from bench.bench_kernel_warmup import payload
body = payload(sys.argv[2])
kernels.hold_until_warm()  # as a worker: the requests run the NumPy paths until warm
context = compute.start(0, "cpu", {{}})
def request():
    t = time.perf_counter()
    reply = dispatch.answer(context, {{"id": 1, "kind": "gradient", "payload": body}})
    assert reply["ok"], reply
    return time.perf_counter() - t
request()
alone = min(request() for _ in range(3))
mode = sys.argv[1]
if mode == "thread":
    worker = threading.Thread(target=warmup.warm)
else:
    import subprocess
    worker = subprocess.Popen([sys.executable, "-m", "engine.kernels.warmup"],
                              stdout=subprocess.DEVNULL)
worker.start() if mode == "thread" else None
beside = []
while (worker.is_alive() if mode == "thread" else worker.poll() is None):
    beside.append(request())
(worker.join() if mode == "thread" else worker.wait())
print(json.dumps({{"alone": alone, "beside": beside}}))
"""


def gil_probe(mode: str, name: str) -> dict:
    """Requests (NumPy paths) timed alone, then while every kernel compiles from an empty
    cache in a thread of the same process or in a process of its own."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", GIL_PROBE.format(root=str(ROOT)), mode, name],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    result: dict = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="transformer", choices=sorted(BATCH))
    parser.add_argument("--gil", action="store_true", help="also the GIL probe")
    parser.add_argument("--gil-only", action="store_true", help="only the GIL probe")
    parser.add_argument("--starts", type=int, default=0, help="only N rounds of worker starts")
    args = parser.parse_args()
    if args.starts:
        starts(args.starts)
        return
    print(f"model: {args.model}, batch {BATCH[args.model]}; cpu count {os.cpu_count()}")
    if not args.gil_only:
        pools(args.model)
    if args.gil or args.gil_only:
        for mode in ("thread", "process"):
            r = gil_probe(mode, args.model)
            beside = np.array(r["beside"])
            print(
                f"compilation in a {mode:7}: request alone {r['alone']:.3f} s; beside it "
                f"median {np.median(beside):.3f} s, max {beside.max():.3f} s "
                f"({len(beside)} requests)"
            )


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_once(warm: bool) -> tuple[float, float]:
    """A pool of one worker started: its hello's wall time, and the worker's CPU time once
    it is idle with its warm-up ended (a filled cache: the steady state)."""
    pool = WorkerPool(Settings(workers=1, worker_warm_kernels=warm))
    t0 = time.perf_counter()
    await pool.start()
    hello = time.perf_counter() - t0
    try:
        await pool.submit("kernel_warmup", {"wait": 290}, time_limit=300)
        pid = pool.workers()[0].pid
        assert pid is not None
        return hello, cpu_seconds(pid)
    finally:
        await pool.close()


def starts(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fill(Path(tmp))
        os.environ["NUMBA_CACHE_DIR"] = tmp
        seen: dict[bool, list] = {False: [], True: []}
        for _ in range(rounds):
            for warm in (False, True):  # interleaved
                seen[warm].append(asyncio.run(start_once(warm)))
    for warm, runs in seen.items():
        hello, cpu = np.array(runs).T
        print(
            f"worker start, warm-up {'on ' if warm else 'off'} (filled cache): hello median "
            f"{np.median(hello):.2f} s (min {hello.min():.2f}); worker CPU until warm "
            f"median {np.median(cpu):.2f} s (min {cpu.min():.2f}); {rounds} rounds"
        )


def pools(name: str) -> None:
    body = payload(name)
    print(
        f"{'warm-up':8} {'cache':7} {'hello':>7} {'1st req':>8} {'(worker)':>9} "
        f"{'ready':>7} {'later req':>9}  warm-up status"
    )
    for warm in (False, True):
        for cold in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                cache = Path(tmp)
                if not cold:
                    fill(cache)
                r = asyncio.run(scenario(warm, cache, body))
            ready = f"{r['ready']:7.2f}" if "ready" in r else f"{'-':>7}"
            print(
                f"{'on' if warm else 'off':8} {'empty' if cold else 'filled':7} "
                f"{r['hello']:7.2f} {r['first']:8.2f} {r['first_worker']:9.2f} {ready} "
                f"{r['after']:9.3f}  {r.get('status', '')}"
            )


if __name__ == "__main__":
    main()
