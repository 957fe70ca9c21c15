"""Peak memory of repeated large gradients (issue 17, item 2): the resident set size after
each of N gradient calls of the large MLP (B=1024, d=1024, 3 x 2048 tanh, out 10), as
growth over the process's RSS before the first call. A reference cycle that keeps a
call's gradients alive until the garbage collector runs shows as growth call after call;
without one, every call ends where the first did.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 \\
        python bench/bench_rss.py --calls 11

`--case hvp_fresh` runs gt.hvp of the same loss instead (forward, gradient and the
tangent pass, all fresh) and prints each call's CPU time and minor page faults beside
the RSS: what glibc's allocator costs when its thresholds are not raised. `import
engine` raises them by default (engine/allocator.py); GRADTAPE_TUNE_ALLOCATOR=0 in the
environment measures glibc's defaults.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import time

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
    parser.add_argument("--case", choices=["gradient", "hvp_fresh"], default="gradient")
    args = parser.parse_args()
    print(f"allocator tuned at import: {gt.allocator.tuned_at_import}")
    rng = np.random.default_rng(0)
    sizes = [1024, 2048, 2048, 2048, 10]
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    y = rng.standard_normal((1024, 10)).astype(np.float32)
    weights = [
        gt.Variable((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
        for a, b in itertools.pairwise(sizes)
    ]

    def loss() -> gt.Tensor:
        h = gt.constant(x)
        for w in weights[:-1]:
            h = gt.tanh(h @ w)
        return gt.mean((h @ weights[-1] - y) ** 2)

    base = rss_mib()
    growth = []
    if args.case == "hvp_fresh":
        params = [gt.constant(w.value) for w in weights]
        vectors = [gt.constant(rng.standard_normal(w.shape).astype(np.float32)) for w in weights]

        def of_params(*ws: gt.Tensor) -> gt.Tensor:
            h = gt.constant(x)
            for w in ws[:-1]:
                h = gt.tanh(h @ w)
            return gt.mean((h @ ws[-1] - y) ** 2)

        for _ in range(args.calls):
            cpu, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            out = gt.hvp(of_params, params, vectors)
            del out
            used = resource.getrusage(resource.RUSAGE_SELF)
            print(
                f"call: {1e3 * (time.process_time() - cpu):.0f} ms CPU, "
                f"{used.ru_minflt - faults.ru_minflt} minor faults"
            )
            growth.append(rss_mib() - base)
    for _ in range(args.calls if args.case == "gradient" else 0):
        with gt.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, {"w": weights})
        del tape, value, grads
        growth.append(rss_mib() - base)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    print(f"RSS growth after each call (MiB): {' '.join(f'{g:.0f}' for g in growth)}")
    print(
        f"first {growth[0]:.0f} MiB, last {growth[-1]:.0f} MiB, "
        f"last/first {growth[-1] / growth[0]:.2f}; peak over base {peak:.0f} MiB"
    )


if __name__ == "__main__":
    main()
