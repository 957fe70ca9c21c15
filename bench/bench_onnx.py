"""Issue 13: gradient and reused HVP of the three reference ONNX models, gradtape against
PyTorch eager (the same weights), with the ONNX Runtime forward as a floor.

Run from the repository root with the peers venv (torch CPU, onnx, onnxruntime), one
BLAS thread:

    env -u OPENBLAS_CORETYPE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        PYTHONPATH=. /work/peers-venv/bin/python bench/bench_onnx.py --batch 64

Contenders are interleaved (each round times every one once); the table gives the
minimum over rounds of process time (ms per call). gradtape: the program
`logits = net(x)`, `loss = softmax_cross_entropy(logits, y)` compiled once; "grad
(dynamic)" is a recorded forward plus a backward, "grad (compiled)" the service's
`value_and_gradients` (replayed from its third call: issue 28), "fresh HVP" the service's
`hessian_vector_products` of one vector (forward, gradient and HVP, replayed), "reused
HVP" one product on a HessianOperator (forward and gradient recorded once). PyTorch:
`autograd.grad` of the loss; its fresh HVP a create_graph gradient and a backward of it;
its reused HVP a backward through the retained double-backward graph of the gradient.
ONNX Runtime's forward is a column when it is installed.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine as gt
from bench import onnx_models
from engine.language import as_definition, compile_definition
from tests.engine.onnx.graphs import fixture


def fixture_batch(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, 10, n).astype(np.int64)
    if name == "lenet":
        return rng.standard_normal((n, 1, 16, 16)).astype(np.float32), y
    if name == "resnet":
        return rng.standard_normal((n, 3, 8, 8)).astype(np.float32), y
    return rng.integers(0, 20, (n, 6)).astype(np.int64), y


PROGRAM = ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"]


def timed(fn: Callable[[], object], inner: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(inner):
        fn()
    return ((time.perf_counter() - wall) / inner, (time.process_time() - cpu) / inner)


def contenders(name: str, n: int, sizes: str) -> dict[str, Callable[[], object]]:
    try:  # the forward floor, when installed (not in /work/venv)
        import onnxruntime as ort
    except ImportError:
        ort = None
    import torch
    from torch.nn import functional as F

    if sizes == "issue":
        data, model, frozen = onnx_models.model(name)
        x, y = onnx_models.batch(name, n, np.random.default_rng(0))
    else:
        sys.path.insert(0, str(ROOT / "tests" / "engine" / "onnx" / "fixtures"))
        import export

        data, record = fixture(name)
        x, y = fixture_batch(name, n, np.random.default_rng(0))
        frozen = [str(f) for f in record["frozen"]]
        model = {"lenet": export.LeNet, "resnet": export.ResNet, "transformer": export.Transformer}[
            name
        ]()
        from onnx import load_model_from_string, numpy_helper

        weights = {
            i.name: torch.from_numpy(numpy_helper.to_array(i).copy())
            for i in load_model_from_string(data).graph.initializer
        }
        state = model.state_dict()
        model.load_state_dict({k: weights.get(k, v) for k, v in state.items()})
        model.eval()

    # gradtape
    defn = as_definition(
        {
            "models": {"net": {"onnx": data, "frozen": frozen}},
            "inputs": {"x": x, "y": y},
            "program": PROGRAM,
        }
    )
    prog = compile_definition(defn)
    leaves = prog.leaves(defn)
    request = prog.check_request("loss")
    sources = [leaves[s] for s in request.sources.values()]
    rng = np.random.default_rng(1)
    vectors = [gt.constant(rng.standard_normal(s.shape).astype(np.float32)) for s in sources]
    op = prog.hessian_operator(request, leaves)

    def gt_forward():
        return prog.run(leaves)["loss"]

    def gt_gradient():
        with gt.GradientTape() as tape:
            env = prog.run(leaves)
        return tape.gradient(env["loss"], sources)

    def gt_hvp():
        return op.hvp(*vectors)

    def gt_gradient_compiled():  # the service's path: replayed from the third call on
        return prog.value_and_gradients(request, leaves)

    batched = [gt.constant(v.numpy()[None]) for v in vectors]

    def gt_fresh_hvp():  # forward, gradient and one HVP, compiled (the stateless request)
        return prog.hessian_vector_products(request, leaves, batched)

    # PyTorch eager, the same weights
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    params = [p for _, p in model.named_parameters()]
    # the same parameters differentiated on both sides
    assert len(params) == len(sources), (len(params), sorted(request.sources))
    tv = [torch.randn(p.shape) for p in params]
    loss = F.cross_entropy(model(tx), ty)
    grads = torch.autograd.grad(loss, params, create_graph=True)

    def torch_forward():
        with torch.no_grad():
            return F.cross_entropy(model(tx), ty)

    def torch_gradient():
        return torch.autograd.grad(F.cross_entropy(model(tx), ty), params)

    def torch_hvp():
        return torch.autograd.grad(grads, params, grad_outputs=tv, retain_graph=True)

    def torch_fresh_hvp():
        fresh = torch.autograd.grad(F.cross_entropy(model(tx), ty), params, create_graph=True)
        return torch.autograd.grad(fresh, params, grad_outputs=tv)

    runs = {
        "gt forward": gt_forward,
        "gt gradient": gt_gradient,
        "gt gradient compiled": gt_gradient_compiled,
        "gt fresh HVP": gt_fresh_hvp,
        "gt reused HVP": gt_hvp,
        "torch forward": torch_forward,
        "torch gradient": torch_gradient,
        "torch fresh HVP": torch_fresh_hvp,
        "torch reused HVP": torch_hvp,
    }
    if ort is not None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        runs["ort forward"] = lambda: session.run(None, {"x": x})

    check = float(np.asarray(gt_forward().numpy())), float(torch_forward())
    assert abs(check[0] - check[1]) < 1e-4 * max(1.0, abs(check[1])), check
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=["lenet", "resnet", "transformer"])
    parser.add_argument(
        "--sizes",
        choices=["issue", "fixture"],
        default="issue",
        help="issue: the issue-28 widths (bench/onnx_models.py); fixture: the test fixtures",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(
        f"- machine: {platform.processor() or platform.machine()}, python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}"
    )
    print(
        f"- batch {args.batch}, {args.rounds} interleaved rounds of {args.inner} calls; "
        "ms of process time per call, minimum over rounds; one thread each (torch: MKL, "
        "NumPy: its OpenBLAS)\n"
    )
    print(
        "| model | gt grad (dynamic) | gt grad (compiled) | gt fresh HVP | gt reused HVP | "
        "torch grad | torch fresh HVP | torch reused HVP | grad gt/torch | fresh HVP gt/torch "
        "| reused HVP gt/torch | gt fwd / ORT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        runs = contenders(name, args.batch, args.sizes)
        for fn in runs.values():  # warm up (and capture: compiled passes replay from call 3)
            fn()
            fn()
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for key, fn in runs.items():
                samples[key].append(timed(fn, args.inner))
        # minimum over rounds, process time: the least disturbed by other load
        cpu = {k: min(s[1] for s in v) * 1e3 for k, v in samples.items()}

        def cell(k: str, cpu=cpu) -> str:
            return f"{cpu[k]:.2f}"

        def ratio(a: str, b: str, cpu=cpu) -> str:
            return f"{cpu[a] / cpu[b]:.2f}x" if b in cpu else "n/a"

        print(
            f"| {name} | {cell('gt gradient')} | {cell('gt gradient compiled')} | "
            f"{cell('gt fresh HVP')} | {cell('gt reused HVP')} | {cell('torch gradient')} | "
            f"{cell('torch fresh HVP')} | {cell('torch reused HVP')} | "
            f"{ratio('gt gradient compiled', 'torch gradient')} | "
            f"{ratio('gt fresh HVP', 'torch fresh HVP')} | "
            f"{ratio('gt reused HVP', 'torch reused HVP')} | "
            f"{ratio('gt forward', 'ort forward')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
