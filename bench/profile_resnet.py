"""Where the ResNet's compiled passes go, primitive by primitive (issue 28; bench/RESULTS.md
"Compiled kernels for the convolutions' memory passes").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/profile_resnet.py

bench_onnx.py's ResNet (batch 64, float32) through the service's compiled gradient, fresh
HVP and a HessianOperator's reused HVP: every replayed step is timed (process time) by a
wrapper around `replay._compile_step`, summed per primitive (conv_input split by stride),
the minimum over PASSES passes of each step's time. GRADTAPE_KERNELS=numpy gives the NumPy
paths' figures.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine as gt
from bench import onnx_models
from engine import replay
from engine.language import as_definition, compile_definition

PASSES = 7
_steps: dict[str, list] = collections.defaultdict(list)  # per pass kind: [name, best]
_current = ["gradient"]
_original = replay._compile_step


def _name(prim, params) -> str:
    if prim.name == "conv_input":
        return f"conv_input stride {params['strides'][0]}"
    if prim.name == "conv_gather":
        return f"conv_gather stride {params['strides'][0]}"
    return prim.name


def _timed_compile_step(prim, params, *rest):
    step = _original(prim, params, *rest)
    entry = [_name(prim, params), float("inf")]
    _steps[_current[0]].append(entry)
    clock = time.process_time

    def run(env):
        t = clock()
        step(env)
        entry[1] = min(entry[1], clock() - t)

    return run


def main() -> None:
    replay._compile_step = _timed_compile_step
    data, _, frozen = onnx_models.model("resnet")
    x, y = onnx_models.batch("resnet", 64, np.random.default_rng(0))
    defn = as_definition(
        {
            "models": {"net": {"onnx": data, "frozen": frozen}},
            "inputs": {"x": x, "y": y},
            "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
        }
    )
    prog = compile_definition(defn)
    leaves = prog.leaves(defn)
    request = prog.check_request("loss")
    sources = [leaves[s] for s in request.sources.values()]
    rng = np.random.default_rng(1)
    vectors = [gt.constant(rng.standard_normal(s.shape).astype(np.float32)) for s in sources]
    batched = [gt.constant(v.numpy()[None]) for v in vectors]
    op = prog.hessian_operator(request, leaves)
    passes = {
        "gradient": lambda: prog.value_and_gradients(request, leaves),
        "fresh HVP": lambda: prog.hessian_vector_products(request, leaves, batched),
        "reused HVP": lambda: op.hvp(*vectors),
    }
    for kind, fn in passes.items():
        _current[0] = kind
        for _ in range(3):  # dynamic, captured, then replayed (compiles the steps)
            fn()
        whole = float("inf")
        for _ in range(PASSES):
            t = time.process_time()
            fn()
            whole = min(whole, time.process_time() - t)
        parts: dict[str, float] = collections.defaultdict(float)
        counts: collections.Counter = collections.Counter()
        for name, best in _steps[kind]:
            parts[name] += best * 1e3
            counts[name] += 1
        print(
            f"\n{kind}: {len(_steps[kind])} steps, the pass {whole * 1e3:.1f} ms (min of {PASSES})"
        )
        print("| primitive | steps | ms |\n|---|---|---|")
        for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            if ms >= 0.5:
                print(f"| {name} | {counts[name]} | {ms:.1f} |")


if __name__ == "__main__":
    main()
