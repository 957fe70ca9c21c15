"""Issue 28, item 6: the peak memory of one large fresh HVP, gradtape against the NumPy
floor (bench_engine's hand-written forward, backward and R-op) and PyTorch (double
backward), each in its own process: the peak resident set (VmHWM, reset just before the
call) over the RSS just before it, with the inputs already made. Then the memory handed back: gradtape's
RSS after the call, before and after engine.allocator.release().

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        MKL_NUM_THREADS=1 PYTHONPATH=. /work/venv/bin/python bench/bench_hvp_peak.py

The large MLP of bench_engine (B=1024, d=1024, hidden 3 x 2048 tanh, out 10, float32).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def reset_peak() -> None:
    """Start VmHWM (the peak RSS) over from the current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(who: str, size: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench.bench_engine import SIZES, NumpyFloor, make_problem

    prob = make_problem(SIZES[size], "tanh")
    out: dict = {}
    if who == "floor":
        run = NumpyFloor(prob).hvp_fresh()
    elif who == "torch":
        import torch

        torch.set_num_threads(1)
        from bench.bench_engine import TorchPeer

        run = TorchPeer(prob).hvp_fresh()
    else:
        import engine as gt

        params = [gt.constant(a) for a in prob.params]
        vectors = [gt.constant(a) for a in prob.v]
        x, y = gt.constant(prob.x), gt.constant(prob.y)

        def loss(*ps):
            h = x
            for i in range(len(ps) // 2):
                h = h @ ps[2 * i] + ps[2 * i + 1]
                if i < len(ps) // 2 - 1:
                    h = gt.tanh(h)
            return gt.mean((h - y) ** 2)

        def run():
            return gt.hvp(loss, params, vectors)

    base = rss_mib()
    reset_peak()
    result = run()
    del result
    out["peak"] = rss_mib("VmHWM") - base
    out["after"] = rss_mib() - base
    if who == "gradtape":
        import engine as gt

        gt.allocator.release()
        out["released"] = rss_mib() - base
        out["tuned"] = gt.allocator.tuned_at_import
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="large")
    parser.add_argument("--child", default=None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.size)))
        return
    results: dict[str, list[dict]] = {}
    for _ in range(args.runs):  # interleaved, each in a fresh process
        for who in ("floor", "gradtape", "torch"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", who, "--size", args.size],
                capture_output=True,
                text=True,
                check=True,
            )
            results.setdefault(who, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    floor = min(r["peak"] for r in results["floor"])
    print(f"- {args.size} MLP, fresh HVP, {args.runs} processes each; MiB over the RSS before")
    print("\n| who | peak (min..max) | peak / floor | RSS after | after release() |")
    print("|---|---|---|---|---|")
    for who, rs in results.items():
        peaks = [r["peak"] for r in rs]
        after = min(r["after"] for r in rs)
        released = min(r.get("released", float("nan")) for r in rs)
        print(
            f"| {who} | {min(peaks):.0f}..{max(peaks):.0f} | {min(peaks) / floor:.2f}x | "
            f"{after:.0f} | {released:.0f} |"
        )


if __name__ == "__main__":
    main()
