"""Where the transformer's compiled gradient goes, part by part, against PyTorch's kernels
on the same shapes (issue 28; bench/RESULTS.md "The transformer's gradient, op by op").

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 PYTHONPATH=. python bench/profile_transformer.py

gradtape: bench_onnx.py's transformer (batch 64) through the service's compiled
`value_and_gradients`; every step of its replayed schedule timed alone (perf_counter,
the minimum over 20 passes), grouped by what it computes (by primitive and shape: a
grouping for this model only). PyTorch: its kernels (MKL GEMMs, GELU, softmax, LayerNorm,
embedding backward) timed alone on the gradient's shapes, one thread, process time, the
minimum over 5 rounds; what is left of its gradient's time is its autograd engine,
copies, the loss and small ops.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import onnx_models
from engine import replay
from engine.language import as_definition, compile_definition

PASSES = 20


def _category(name: str, shape: tuple, params: dict) -> str:
    if name == "matmul":
        return "GEMMs"
    if name == "erf":
        return "erf"
    index = params.get("index", ())
    gathers = name in ("getitem", "scatter_add") and any(isinstance(i, np.ndarray) for i in index)
    if gathers or shape == (100, 64):
        return "embedding (gather, scatter)"
    if name in ("transpose", "reshape", "broadcast_to", "getitem", "scatter_add"):
        return "transposes, reshapes, slices"
    if shape in ((64, 16, 256), (256,)):
        return "GELU's other ops (+ the ff1 bias)"
    if len(shape) == 4:
        return "softmax (+ the scores' scaling)"
    if shape in ((64, 16, 64), (64, 16, 1), (64,), (64, 192), (192,), (64, 16, 192)):
        return "LayerNorm, residuals, biases"
    return "head, pooling, loss"


def gradtape() -> None:
    data, _, frozen = onnx_models.model("transformer")
    x, y = onnx_models.batch("transformer", 64, np.random.default_rng(0))
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
    for _ in range(4):  # dynamic, captured, then replayed
        prog.value_and_gradients(request, leaves)
    (schedule,) = [s for s in prog.gradient_passes().values() if isinstance(s, replay.Schedule)]
    plan = [entry for entry in schedule.plan if entry[0] is not None]
    steps = schedule.steps
    assert steps is not None and len(steps) == len(plan)
    last: dict[int, float] = {}
    best: dict[int, float] = {}

    def timed(i: int, step):
        def run(env):
            t = time.perf_counter()
            step(env)
            last[i] = time.perf_counter() - t

        return run

    schedule.steps = [timed(i, s) for i, s in enumerate(steps)]
    for _ in range(PASSES):
        prog.value_and_gradients(request, leaves)
        for i, v in last.items():
            best[i] = min(best.get(i, v), v)
    schedule.steps = steps
    whole = min(_process_time(lambda: prog.value_and_gradients(request, leaves)) for _ in range(20))
    parts: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    for i, (prim, params, *_rest) in enumerate(plan):
        part = _category(prim.name, plan[i][7].shape, params)
        parts[part] += best[i] * 1e3
        counts[part] += 1
    print(f"gradtape: {len(plan)} steps; the pass {whole * 1e3:.2f} ms (process time, min of 20)")
    print("| part | steps | ms |\n|---|---|---|")
    for part, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {counts[part]} | {ms:.2f} |")


def _process_time(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def torch_kernels() -> None:
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)

    def ms(fn, n: int = 30) -> float:
        for _ in range(3):
            fn()
        return 1e3 * min(_process_time(lambda: [fn() for _ in range(n)]) / n for _ in range(5))

    r = torch.randn

    def linear(d_in: int, d_out: int) -> float:  # forward, dX and dW of one linear
        x, w, b, g = r(1024, d_in), r(d_out, d_in), r(d_out), r(1024, d_out)
        return ms(lambda: torch.addmm(b, x, w.t())) + ms(lambda: g @ w) + ms(lambda: g.t() @ x)

    gemms = 2 * sum(linear(*shape) for shape in [(64, 192), (64, 64), (64, 256), (256, 64)])
    a = r(256, 16, 16)
    gemms += 2 * 6 * ms(lambda: torch.bmm(a, a))  # per layer: 2 forward, 4 backward
    h, gh = r(64, 16, 256), r(64, 16, 256)
    gelu = 2 * (ms(lambda: F.gelu(h)) + ms(lambda: torch.ops.aten.gelu_backward(gh, h)))
    s, gs = r(64, 4, 16, 16), r(64, 4, 16, 16)
    p = torch.softmax(s, -1)
    softmax = 2 * (
        ms(lambda: torch.softmax(s, -1))
        + ms(lambda: torch.ops.aten._softmax_backward_data(gs, p, -1, torch.float32))
    )
    z, w64, b64 = r(64, 16, 64), r(64), r(64)
    _, mu, rstd = torch.ops.aten.native_layer_norm(z, [64], w64, b64, 1e-5)
    mask = [True, True, True]
    norm = 5 * (
        ms(lambda: torch.ops.aten.native_layer_norm(z, [64], w64, b64, 1e-5))
        + ms(
            lambda: torch.ops.aten.native_layer_norm_backward(z, z, [64], mu, rstd, w64, b64, mask)
        )
    )
    tokens, ge = torch.randint(0, 100, (64, 16)), r(64, 16, 64)
    embed = ms(lambda: torch.ops.aten.embedding_dense_backward(ge, tokens, 100, -1, False))
    print("\nPyTorch's kernels on the gradient's shapes (ms):")
    print(f"| GEMMs (linears and attention, head left out) | {gemms:.2f} |")
    print(f"| GELU forward + backward, 2 layers | {gelu:.2f} |")
    print(f"| softmax forward + backward, 2 layers | {softmax:.2f} |")
    print(f"| LayerNorm forward + backward, 5 | {norm:.2f} |")
    print(f"| embedding backward | {embed:.2f} |")


if __name__ == "__main__":
    gradtape()
    torch_kernels()
