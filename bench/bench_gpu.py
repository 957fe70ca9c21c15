"""The GPU rows of issue 28 (item 7): gradtape on CuPy against PyTorch CUDA eager and
JAX (jit), on the MLPs of bench_engine (medium, large) and the issue-sized ONNX models
of bench/onnx_models.py (LeNet, ResNet, transformer): gradient, fresh HVP, reused HVP.

Run by bench/gpu_check.sh on an NVIDIA machine; each peer that is missing (CuPy, torch
with CUDA, JAX with a GPU, the onnx package for the ONNX rows) gives "n/a" cells with the
reason, never a failure. `--device cpu` runs the same rows on the CPU (NumPy, torch CPU,
JAX CPU) with small sizes: how the script's own paths are checked on a machine without a
GPU; its figures are not GPU figures.

Timing: every case once as a warm-up (the ONNX gradient passes compile on their third
call on NumPy; CuPy passes always run dynamically), then --rounds interleaved rounds
that time each case once (the device synchronized before the clock stops); medians of
wall time, ms per call. The products are checked against each other (max relative
difference printed) before they are timed.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MLP_SIZES = {  # name: (batch, d_in, hidden, d_out), bench_engine's medium and large
    "medium": (256, 256, (512, 512, 512), 10),
    "large": (1024, 1024, (2048, 2048, 2048), 10),
    "small": (32, 16, (32, 32), 4),  # the CPU check
}


class Peer:
    """One framework on one device: what it can run here, or why not."""

    def __init__(self, name: str, device: str):
        self.name, self.device, self.why_not = name, device, None
        self.sync: Callable[[], None] = lambda: None
        try:
            getattr(self, f"_setup_{name}")()
        except Exception as exc:  # noqa: BLE001 - an absent or broken peer: its cells say why
            self.why_not = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]

    # set-up ---------------------------------------------------------------------------
    def _setup_gradtape(self) -> None:
        import engine as gt

        self.gt = gt
        if self.device == "gpu":
            if not gt.cuda_available():
                raise RuntimeError("CuPy or a CUDA device is not available")
            import cupy

            self.sync = lambda: cupy.cuda.Device().synchronize()
            self.where = "cuda"
        else:
            self.sync = lambda: None
            self.where = "cpu"

    def _setup_torch(self) -> None:
        import torch

        torch.set_num_threads(1 if self.device == "cpu" else torch.get_num_threads())
        if self.device == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
            self.sync = torch.cuda.synchronize
            self.where = "cuda"
        else:
            self.sync = lambda: None
            self.where = "cpu"
        self.torch = torch

    def _setup_jax(self) -> None:
        import jax

        if self.device == "gpu" and not any(d.platform == "gpu" for d in jax.devices()):
            raise RuntimeError(f"jax {jax.__version__} sees no GPU ({jax.devices()})")
        self.jax = jax
        self.sync = lambda: None  # results are blocked on in the cases

    def version(self) -> str:
        if self.why_not:
            return f"{self.name}: not run ({self.why_not})"
        module = {"gradtape": "numpy", "torch": "torch", "jax": "jax"}[self.name]
        extra = ""
        if self.name == "gradtape" and self.device == "gpu":
            import cupy

            extra = f", cupy {cupy.__version__}"
        return f"{self.name}: {module} {sys.modules[module].__version__}{extra}"


# ---- the MLP cases ----------------------------------------------------------------------
def mlp_problem(size: str, seed: int = 0) -> dict:
    batch, d_in, hidden, d_out = MLP_SIZES[size]
    rng = np.random.default_rng(seed)
    dims = (d_in, *hidden, d_out)
    params = []
    for a, b in itertools.pairwise(dims):
        params.append((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
        params.append((0.1 * rng.standard_normal(b)).astype(np.float32))
    return {
        "x": rng.standard_normal((batch, d_in)).astype(np.float32),
        "y": rng.standard_normal((batch, d_out)).astype(np.float32),
        "params": params,
        "v": [rng.standard_normal(p.shape).astype(np.float32) for p in params],
    }


def _mlp(x, params, act):
    h = x
    for i in range(len(params) // 2):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < len(params) // 2 - 1:
            h = act(h)
    return h


def mlp_cases(peer: Peer, prob: dict) -> dict[str, Callable[[], object]]:
    """name -> a call returning host arrays (the answer, to check)."""
    if peer.name == "gradtape":
        gt = peer.gt
        c = lambda a: gt.constant(a, device=peer.where)
        x, y = c(prob["x"]), c(prob["y"])
        params, v = [c(a) for a in prob["params"]], [c(a) for a in prob["v"]]

        def loss(*ps):
            return gt.mean((_mlp(x, ps, gt.tanh) - y) ** 2)

        nums = tuple(range(len(params)))
        grad = gt.grad(loss, nums)
        op = gt.hessian_operator(loss, *params)
        host = lambda ts: [t.numpy() for t in ts]
        return {
            "gradient": lambda: host(grad(*params)),
            "fresh HVP": lambda: host(gt.hvp(loss, params, v)),
            "reused HVP": lambda: host(op.hvp(*v)),
        }
    if peer.name == "torch":
        torch = peer.torch
        t = lambda a: torch.from_numpy(a).to(peer.where)
        x, y = t(prob["x"]), t(prob["y"])
        params = [t(a).requires_grad_() for a in prob["params"]]
        v = [t(a) for a in prob["v"]]

        def loss():
            return ((_mlp(x, params, torch.tanh) - y) ** 2).mean()

        kept = torch.autograd.grad(loss(), params, create_graph=True)
        host = lambda ts: [a.detach().cpu().numpy() for a in ts]

        def fresh():
            g = torch.autograd.grad(loss(), params, create_graph=True)
            return host(torch.autograd.grad(g, params, v))

        return {
            "gradient": lambda: host(torch.autograd.grad(loss(), params)),
            "fresh HVP": fresh,
            "reused HVP": lambda: host(torch.autograd.grad(kept, params, v, retain_graph=True)),
        }
    jax = peer.jax
    jnp = jax.numpy
    x, y = jnp.asarray(prob["x"]), jnp.asarray(prob["y"])
    params, v = [jnp.asarray(a) for a in prob["params"]], [jnp.asarray(a) for a in prob["v"]]

    def jloss(ps):
        return jnp.mean((_mlp(x, ps, jnp.tanh) - y) ** 2)

    grad = jax.jit(jax.grad(jloss))
    hvp = jax.jit(lambda ps, vs: jax.jvp(jax.grad(jloss), (ps,), (vs,))[1])
    _, linear = jax.linearize(jax.grad(jloss), params)
    reused = jax.jit(linear)
    host = lambda ts: [np.asarray(jax.block_until_ready(a)) for a in ts]
    return {
        "gradient": lambda: host(grad(params)),
        "fresh HVP": lambda: host(hvp(params, v)),
        "reused HVP": lambda: host(reused(v)),
    }


# ---- the ONNX cases ---------------------------------------------------------------------
PROGRAM = ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"]


def onnx_cases(peer: Peer, name: str, batch: int) -> dict[str, Callable[[], object]]:
    from bench import onnx_models

    data, module, frozen = onnx_models.model(name)
    x, y = onnx_models.batch(name, batch, np.random.default_rng(0))
    if peer.name == "gradtape":
        gt = peer.gt
        from engine.language import as_definition, compile_definition

        defn = as_definition(
            {
                "models": {"net": {"onnx": data, "frozen": frozen}},
                "inputs": {"x": x, "y": y},
                "program": PROGRAM,
            }
        )
        prog = compile_definition(defn)
        leaves = prog.leaves(defn, device=peer.where)
        request = prog.check_request("loss")
        names = list(request.sources.values())
        rng = np.random.default_rng(1)
        vectors = [
            gt.constant(rng.standard_normal(leaves[n].shape).astype(np.float32), device=peer.where)
            for n in names
        ]
        batched = [gt.constant(v.numpy()[None], device=peer.where) for v in vectors]
        op = prog.hessian_operator(request, leaves)
        host = lambda ts: [t.numpy() for t in ts]
        return {
            "gradient": lambda: host(prog.value_and_gradients(request, leaves)[1].values()),
            "fresh HVP": lambda: [
                a[0] for a in host(prog.hessian_vector_products(request, leaves, batched)[2])
            ],
            "reused HVP": lambda: host(op.hvp(*vectors)),
        }
    if peer.name == "torch":
        torch = peer.torch
        from torch.nn import functional as F

        module = module.to(peer.where)
        tx, ty = torch.from_numpy(x).to(peer.where), torch.from_numpy(y).to(peer.where)
        params = [p for _, p in module.named_parameters()]
        rng = np.random.default_rng(1)
        v = [
            torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)).to(peer.where)
            for p in params
        ]

        def loss():
            return F.cross_entropy(module(tx), ty)

        kept = torch.autograd.grad(loss(), params, create_graph=True)
        host = lambda ts: [a.detach().cpu().numpy() for a in ts]

        def fresh():
            g = torch.autograd.grad(loss(), params, create_graph=True)
            return host(torch.autograd.grad(g, params, v))

        return {
            "gradient": lambda: host(torch.autograd.grad(loss(), params)),
            "fresh HVP": fresh,
            "reused HVP": lambda: host(torch.autograd.grad(kept, params, v, retain_graph=True)),
        }
    raise NotImplementedError("no JAX version of the ONNX models is written (MLP rows only)")


# ---- timing and the report --------------------------------------------------------------
def _rel(a: list, b: list) -> float:
    worst = 0.0
    for p, q in zip(a, b):
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        worst = max(worst, float(np.max(np.abs(p - q)) / (np.max(np.abs(q)) + 1e-30)))
    return worst


_written = {"path": None, "lines": 0}


def flush(out: list[str]) -> None:
    """Print and append (to --out) the lines not written yet: a run stopped at its time
    limit keeps every table it finished."""
    fresh = out[_written["lines"] :]
    _written["lines"] = len(out)
    print("\n".join(fresh), flush=True)
    if _written["path"]:
        with open(_written["path"], "a") as f:
            f.write("\n".join(fresh) + "\n")


def run_table(
    title: str, peers: list[Peer], make: Callable[[Peer], dict], rounds: int, out: list[str]
) -> None:
    out.append(f"\n### {title}\n")
    cases: dict[tuple[str, str], Callable[[], object]] = {}
    notes = []
    answers: dict[tuple[str, str], object] = {}
    for peer in peers:
        if peer.why_not:
            continue
        try:
            made = make(peer)
            for key, fn in made.items():
                for _ in range(3):  # warm-up; the third call of a NumPy pass is a replay
                    answers[(peer.name, key)] = fn()
                peer.sync()
                cases[(peer.name, key)] = fn
        except Exception as exc:  # noqa: BLE001 - a row that fails is reported, not fatal
            notes.append(f"- {peer.name}: not run ({type(exc).__name__}: {exc})".splitlines()[0])
            if not isinstance(exc, NotImplementedError):
                traceback.print_exc()
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cases}
    syncs = {p.name: p.sync for p in peers}
    for _ in range(rounds):
        for (peer, key), fn in cases.items():
            start = time.perf_counter()
            fn()
            syncs[peer]()
            times[(peer, key)].append(time.perf_counter() - start)
    keys = ["gradient", "fresh HVP", "reused HVP"]
    names = [p.name for p in peers]
    out.append("| case | " + " | ".join(f"{n} ms" for n in names) + " | gt/torch | gt/jax |")
    out.append("|---|" + "---|" * (len(names) + 2))
    for key in keys:
        med = {n: statistics.median(times[(n, key)]) * 1e3 for n in names if (n, key) in times}
        cells = [f"{med[n]:.3f}" if n in med else "n/a" for n in names]
        ratios = [
            f"{med['gradtape'] / med[p]:.2f}x" if "gradtape" in med and p in med else "n/a"
            for p in ("torch", "jax")
        ]
        out.append(f"| {key} | " + " | ".join(cells + ratios) + " |")
    for key in keys:
        ref = answers.get(("gradtape", key))
        for p in ("torch", "jax"):
            if ref is not None and (p, key) in answers:
                notes.append(
                    f"- {key}: gradtape vs {p}, max relative difference "
                    f"{_rel(ref, answers[(p, key)]):.1e}"
                )
    out.extend(notes)
    flush(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64, help="the ONNX models' batch")
    parser.add_argument("--sizes", default=None, help="MLP sizes (default medium,large)")
    parser.add_argument("--models", default="lenet,resnet,transformer")
    parser.add_argument("--out", default=None, help="append the tables to this file")
    args = parser.parse_args()
    sizes = (args.sizes or ("medium,large" if args.device == "gpu" else "small")).split(",")
    peers = [Peer(n, args.device) for n in ("gradtape", "torch", "jax")]
    out = [
        f"## bench_gpu.py --device {args.device} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        (
            f"- machine: {platform.node()}, {platform.processor() or platform.machine()}, "
            f"python {platform.python_version()}"
        ),
        *(f"- {p.version()}" for p in peers),
        f"- {args.rounds} interleaved rounds, medians of wall time (device synchronized)",
    ]
    if args.device == "cpu":
        out.append("- CPU run: checks the script's paths; these are not GPU figures")
    _written["path"] = args.out
    flush(out)
    for size in sizes:
        prob = mlp_problem(size)
        batch, d_in, hidden, d_out = MLP_SIZES[size]
        run_table(
            f"MLP {size} (B={batch}, d={d_in}, hidden {hidden}, out {d_out}, tanh, MSE)",
            peers,
            lambda p, prob=prob: mlp_cases(p, prob),
            args.rounds,
            out,
        )
    for name in [m for m in args.models.split(",") if m]:
        try:
            import onnx  # noqa: F401  (the importer and the models need it)
        except ImportError:
            out.append(f"\n### ONNX {name}: not run (the onnx package is not installed)")
            flush(out)
            continue
        run_table(
            f"ONNX {name} (batch {args.batch}, float32, softmax cross-entropy)",
            peers,
            lambda p, name=name: onnx_cases(p, name, args.batch),
            args.rounds,
            out,
        )


if __name__ == "__main__":
    main()
