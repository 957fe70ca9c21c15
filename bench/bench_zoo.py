"""Issue 26: the zoo (tests/bridge/zoo.py, the files make_zoo.py exported through the
PyTorch bridge), gradtape against PyTorch eager with the same weights, float64.

Run from the repository root, one BLAS thread (OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
unset for benchmarks only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=.:clients/python python bench/bench_zoo.py --batch 32

Per model: the gradient of the loss (a recorded forward and a backward) and the reused HVP
(one product on a recorded HessianOperator; in PyTorch one backward through the retained
double-backward graph of the gradient). Contenders are interleaved (each round times
every one once); medians of CPU time (process_time) and wall time. PyTorch runs its own
kernels (MKL/oneDNN); gradtape runs NumPy on OpenBLAS.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

import engine as gt
from engine.language import DefinitionError, as_definition, compile_definition

FIXTURES = ROOT / "tests" / "bridge" / "fixtures"
LOSS_LINE = {
    "cross_entropy": "loss = softmax_cross_entropy(logits, y)",
    "mse": "loss = mean_squared_error(logits, y)",
}


def timed(fn: Callable[[], object], inner: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(inner):
        fn()
    return ((time.perf_counter() - wall) / inner, (time.process_time() - cpu) / inner)


def contenders(name: str, n: int) -> dict[str, Callable[[], object]]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.bridge import zoo

    with np.load(FIXTURES / f"{name}.npz") as r:
        record = dict(r)
    reps = -(-n // record["x"].shape[0])
    x = np.concatenate([record["x"]] * reps)[:n]
    y = np.concatenate([record["y"]] * reps)[:n]
    kind = str(record["kind"])

    defn = as_definition(
        {
            "models": {"net": {"onnx": (FIXTURES / f"{name}.onnx").read_bytes()}},
            "inputs": {"x": x, "y": y},
            "program": ["logits = net(x)", LOSS_LINE[kind]],
        }
    )
    prog = compile_definition(defn)
    leaves = prog.leaves(defn)
    request = prog.check_request("loss")
    sources = [leaves[s] for s in request.sources.values()]
    vectors = [gt.constant(record[f"v/{s}"]) for s in request.sources.values()]
    op = prog.hessian_operator(request, leaves)

    def gt_gradient():
        with gt.GradientTape() as tape:
            env = prog.run(leaves)
        return tape.gradient(env["loss"], sources)

    def gt_hvp():
        return op.hvp(*vectors)

    model, _, _, _ = zoo.build(name)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    params = list(model.parameters())
    tv = [torch.from_numpy(record[f"v/{n}"]) for n, _ in model.named_parameters()]
    with sdpa_kernel([SDPBackend.MATH]):  # the fused CPU kernels have no double backward
        grads = torch.autograd.grad(zoo.torch_loss(model, tx, ty, kind), params, create_graph=True)

    def torch_gradient():
        return torch.autograd.grad(zoo.torch_loss(model, tx, ty, kind), params)

    def torch_hvp():
        return torch.autograd.grad(grads, params, grad_outputs=tv, retain_graph=True)

    mine = float(np.asarray(prog.run(leaves)["loss"].numpy()))
    theirs = float(zoo.torch_loss(model, tx, ty, kind))
    assert abs(mine - theirs) <= 1e-9 * max(1.0, abs(theirs)), (name, mine, theirs)
    return {
        "gt gradient": gt_gradient,
        "torch gradient": torch_gradient,
        "gt reused HVP": gt_hvp,
        "torch reused HVP": torch_hvp,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=None)
    args = parser.parse_args()
    import os

    import torch

    from tests.bridge import zoo

    torch.set_num_threads(1)
    print(
        f"- machine: {platform.processor() or platform.machine()}, python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}; "
        f"load average at start {', '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    print(
        f"- float64, batch {args.batch}, {args.rounds} interleaved rounds of {args.inner} "
        "calls; medians, ms per call: CPU time (wall in parentheses)\n"
    )
    print(
        "| model | gt grad | torch grad | gt reused HVP | torch reused HVP | "
        "grad gt/torch (CPU) | HVP gt/torch (CPU) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.models or list(zoo.MODELS):
        try:
            runs = contenders(name, args.batch)
        except DefinitionError as exc:  # an op the importer does not run yet
            print(f"| {name} | not run: {exc.problems[0]} | | | | | |", flush=True)
            continue
        for fn in runs.values():  # warm up
            fn()
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for key, fn in runs.items():
                samples[key].append(timed(fn, args.inner))
        wall = {k: statistics.median(s[0] for s in v) * 1e3 for k, v in samples.items()}
        cpu = {k: statistics.median(s[1] for s in v) * 1e3 for k, v in samples.items()}

        def cell(k: str, wall=wall, cpu=cpu) -> str:
            return f"{cpu[k]:.2f} ({wall[k]:.2f})"

        print(
            f"| {name} | {cell('gt gradient')} | {cell('torch gradient')} | "
            f"{cell('gt reused HVP')} | {cell('torch reused HVP')} | "
            f"{cpu['gt gradient'] / cpu['torch gradient']:.2f}x | "
            f"{cpu['gt reused HVP'] / cpu['torch reused HVP']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
