"""Where a GPU pass spends its time: cProfile over one ONNX model's gradient and reused
HVP on CuPy (the rows of bench/bench_gpu.py), with the device synchronized after each.

    python bench/gpu_profile.py [--model resnet] [--calls 10] [--top 30]

Prints the wall time per call beside the host (CPU) time per call (a pass whose host time
is close to its wall time is bound by Python and kernel launches, not by the GPU), the
number of CUDA kernels CuPy compiled, and the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu import Peer, onnx_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    peer = Peer("gradtape", "gpu")
    if peer.why_not:
        sys.exit(f"gradtape on the GPU: {peer.why_not}")
    cases = onnx_cases(peer, args.model, args.batch)
    for name in ("gradient", "reused HVP"):
        case = cases[name]
        for _ in range(3):
            case()
        peer.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.calls):
            case()
        peer.sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"## {args.model} {name}: {1e3 * wall / args.calls:.2f} ms wall, "
            f"{1e3 * cpu / args.calls:.2f} ms host CPU per call"
        )
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            case()
        peer.sync()
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
        stats.print_stats(args.top)
        print(text.getvalue())


if __name__ == "__main__":
    main()
