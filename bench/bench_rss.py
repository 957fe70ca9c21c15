"""Peak memory of repeated large gradients (issue 17, item 2): the resident set size after
each of N gradient calls of the large MLP (B=1024, d=1024, 3 x 2048 tanh, out 10), as
growth over the process's RSS before the first call. A reference cycle that keeps a
call's gradients alive until the garbage collector runs shows as growth call after call;
without one, every call ends where the first did.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 \\
        python bench/bench_rss.py --calls 11
"""

from __future__ import annotations

import argparse
import itertools
import resource

import numpy as np

import engine as gt


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=11)
    parser.add_argument("--tune-allocator", action="store_true",
                        help="engine.tune_allocator() first (the service's workers do)")
    args = parser.parse_args()
    if args.tune_allocator:
        gt.tune_allocator()
    rng = np.random.default_rng(0)
    sizes = [1024, 2048, 2048, 2048, 10]
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    y = rng.standard_normal((1024, 10)).astype(np.float32)
    weights = [gt.Variable((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
               for a, b in itertools.pairwise(sizes)]

    def loss() -> gt.Tensor:
        h = gt.constant(x)
        for w in weights[:-1]:
            h = gt.tanh(h @ w)
        return gt.mean((h @ weights[-1] - y) ** 2)

    base = rss_mib()
    growth = []
    for _ in range(args.calls):
        with gt.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, {"w": weights})
        del tape, value, grads
        growth.append(rss_mib() - base)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    print(f"RSS growth after each call (MiB): {' '.join(f'{g:.0f}' for g in growth)}")
    print(f"first {growth[0]:.0f} MiB, last {growth[-1]:.0f} MiB, "
          f"last/first {growth[-1] / growth[0]:.2f}; peak over base {peak:.0f} MiB")


if __name__ == "__main__":
    main()
