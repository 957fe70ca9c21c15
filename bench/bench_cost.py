"""Calibrate the compute-cost guard (engine/language/cost.py, issue 25).

Three throughputs of this machine, measured with NumPy on one BLAS thread:
- FLOP/s: a float32 and a float64 512x512 matmul (the faster is kept);
- transcendental elements/s: sin, exp, tanh of 16 Mi float32 elements (the fastest);
- bytes/s: elementwise add and multiply of 16 Mi float32 elements, allocating their
  result (bytes read + written; the faster).
Then, for programs of several kinds (elementwise, matmul, attention-free MLP, the issue's
broadcast program), the engine's real gradient, jacobian and HVP runs, timed, beside the
cost model's estimate with those throughputs: the ratio estimate/measured. The guard
refuses when the estimate exceeds the time limit: a ratio r above 1 refuses a request
that would have finished in more than limit/r; below 1, lets one through that then runs
into its limit (504, as before the guard). The last two columns use the service's default throughputs
(service/core/defaults.py: COST_*), the figures this bench gave on a quieter run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \\
        OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=$PWD python bench/bench_cost.py
"""

from __future__ import annotations

import os
import time

import numpy as np

import engine as gt
from engine.language import as_definition, compile_definition
from engine.language.cost import Throughput
from service.core import defaults


def best(run, repeat: int = 5) -> tuple[float, float]:
    """(wall, cpu) seconds: the fastest of `repeat` runs after one warm-up."""
    run()
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    i = int(np.argmin(walls))
    return walls[i], cpus[i]


def machine_throughput() -> Throughput:
    rates = []
    for dtype in (np.float32, np.float64):
        a = np.random.default_rng(0).normal(size=(512, 512)).astype(dtype)
        wall, _ = best(lambda a=a: a @ a)
        rates.append(2 * 512**3 / wall)
    # 64 MiB arrays: out of cache, as the arrays of the requests the guard is for
    x = np.random.default_rng(0).uniform(size=2**24).astype(np.float32)
    moved = []
    for op in (np.add, np.multiply):  # allocating the result, as the engine's ops do
        wall, _ = best(lambda op=op: op(x, x))
        moved.append(3 * x.nbytes / wall)
    transcendental = []
    for op in (np.sin, np.exp, np.tanh):
        wall, _ = best(lambda op=op: op(x))
        transcendental.append(x.size / wall)
    return Throughput(max(rates), max(transcendental), max(moved))


def programs() -> dict[str, dict]:
    rng = np.random.default_rng(1)
    f32 = lambda *s: rng.normal(size=s).astype(np.float32)
    return {
        "issue broadcast (512x512)": {
            "program": ["z = broadcast_to(sum(w), (512, 512))", "loss = sum(sin(z) * z)"],
            "variables": {"w": np.array([1, 2, 3, 4], np.float32)},
        },
        "issue broadcast (2048x2048)": {
            "program": ["z = broadcast_to(sum(w), (2048, 2048))", "loss = sum(sin(z) * z)"],
            "variables": {"w": np.array([1, 2, 3, 4], np.float32)},
        },
        "elementwise 2^20": {
            "program": ["h = tanh(w * x) + exp(-x * x)", "loss = sum(h * h)"],
            "variables": {"w": f32(1024, 1024)},
            "inputs": {"x": f32(1024, 1024)},
        },
        "matmul 256": {
            "program": ["y = tanh(x @ w)", "loss = sum(y * y)"],
            "variables": {"w": f32(256, 256)},
            "inputs": {"x": f32(256, 256)},
        },
        "mlp 128x512x512x10": {
            "program": [
                "h = relu(x @ w1)",
                "g = tanh(h @ w2)",
                "loss = sum(softplus(g @ w3))",
            ],
            "variables": {"w1": f32(512, 512), "w2": f32(512, 512), "w3": f32(512, 10)},
            "inputs": {"x": f32(128, 512)},
        },
    }


SERVICE = Throughput(
    defaults.COST_FLOPS_PER_SECOND,
    defaults.COST_TRANSCENDENTALS_PER_SECOND,
    defaults.COST_BYTES_PER_SECOND,
)


def measure(name: str, definition: dict, rate: Throughput, hvps: int = 8) -> list[str]:
    program = compile_definition(as_definition(definition))
    leaves = program.leaves(as_definition(definition))
    request = program.check_request("loss")
    sources = list(request.sources)
    rows = []

    def grad() -> None:
        program.value_and_gradients(request, leaves)

    def hvp() -> None:
        vectors = [
            gt.constant(np.ones((hvps, *leaves[request.sources[k]].shape), np.float32))
            for k in sources
        ]
        program.hessian_vector_products(request, leaves, vectors)

    for what, run, items, first_order in (
        ("gradient", grad, 1, True),
        (f"hvp x{hvps}", hvp, hvps, False),
    ):
        wall, cpu = best(run, 3)
        estimate = program.cost.estimate(items, first_order, rate).seconds
        service = program.cost.estimate(items, first_order, SERVICE).seconds
        rows.append(
            f"| {name} | {what} | {wall * 1e3:,.1f} | {cpu * 1e3:,.1f} | "
            f"{estimate * 1e3:,.1f} | {estimate / wall:.2f} | {estimate / cpu:.2f} | "
            f"{service / wall:.2f} | {service / cpu:.2f} |"
        )
    return rows


def main() -> None:
    gt.tune_allocator()  # as the service's workers do
    print(f"BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    rate = machine_throughput()
    print(
        f"machine: {rate.flops_per_second / 1e9:.1f} GFLOP/s (matmul), "
        f"{rate.transcendentals_per_second / 1e9:.2f} G transcendental elements/s, "
        f"{rate.bytes_per_second / 1e9:.1f} GB/s (elementwise add/multiply)"
    )
    print(
        "| program | run | wall ms | cpu ms | estimate ms | est / wall | est / cpu "
        "| service est / wall | service est / cpu |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, definition in programs().items():
        for row in measure(name, definition, rate):
            print(row)
    issue = compile_definition(as_definition(programs()["issue broadcast (2048x2048)"]))
    for items in (1024,):
        for label, r in (("measured rates", rate), ("service defaults", SERVICE)):
            estimate = issue.cost.estimate(items, False, r)
            print(f"the issue's HVP of {items} vectors ({label}): {estimate.describe()}")


if __name__ == "__main__":
    main()
