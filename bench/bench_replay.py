"""Reused and fresh HVPs, interleaved: gradtape compiled (replayed) and dynamic against
the NumPy floor, PyTorch eager and JAX jit (issue 17's targets).

The problems and the peers' implementations are bench_engine.py's (same seeded MLP,
same calls); only the harness differs: every (case, framework) cell is timed once per
round, rounds interleave all cells, and the table gives medians over rounds of the wall
time and of the process CPU time per call (per vector for xK), with the ratios that
were measured in the same run. `grad_program` is a definition's gradient
(CompiledProgram.value_and_gradients, what POST /v1/gradient runs) against the peers'
gradients. `gradtape-dynamic` is the same engine with
`compiled=False` (every pass the dynamic sweep) and no deferred products (a fresh HVP
computes its gradients' GEMMs): the before/after of issue 17's items 1 and 2.
`hvp_program` and `bjac_program` are a definition's fresh HVP (one vector) and batch
jacobian (d out / d x per example) through CompiledProgram, cycling over NEW_VALUES
sets of values, as a stateless client sends them; `hvp_request` and `bjac_request` are
the worker's whole handler for those requests (checks, leaves, the compiled pass).
`grad_jit`, `hvp_jit` and `bjac_jit` are the Python API compiled by gt.jit (its
value_and_grad, hvp and batch_jacobian), cycling over NEW_VALUES sets of parameters
and vectors (inputs for the batch jacobian); their `gradtape-dynamic` cells are
gt.value_and_grad, gt.hvp and GradientTape.batch_jacobian on the same values.

Run from the repository root, in the peers' virtualenv, on one thread:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        MKL_NUM_THREADS=1 XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \\
        /work/wt/peers-venv/bin/python bench/bench_replay.py --sizes small,medium
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench import bench_engine as be


def _definition(prob) -> dict:
    """The benchmark MLP as a definition (what a /v1/gradient request sends)."""
    n_layers = len(prob.params) // 2
    variables = {}
    for i in range(n_layers):
        variables[f"w{i}"] = prob.params[2 * i]
        variables[f"b{i}"] = prob.params[2 * i + 1]
    lines, h = [], "x"
    for i in range(n_layers):
        z = f"{h} @ w{i} + b{i}"
        if i < n_layers - 1:
            lines.append(f"h{i} = {prob.activation}({z})")
            h = f"h{i}"
        else:
            lines.append(f"out = {z}")
    lines.append("loss = mean((out - y) ** 2)")
    return {"variables": variables, "inputs": {"x": prob.x, "y": prob.y}, "program": lines}


def _program_gradient(prob, compiled: bool):
    from engine.language import compile_definition

    definition = _definition(prob)
    program = compile_definition(definition)
    request = program.check_request("loss", None, "none")
    leaves = program.leaves(definition)
    return lambda: program.value_and_gradients(request, leaves, compiled)


NEW_VALUES = 4  # the stateless rows cycle over this many sets of values


def _value_sets(prob, definition: dict) -> list[tuple[dict, list]]:
    """NEW_VALUES (definition, HVP vectors) pairs of one structure with other values: a
    stateless client's requests (the compiled pass must not depend on them)."""
    rng = np.random.default_rng(7)
    sets = []
    for _ in range(NEW_VALUES):

        def other(a):
            return (a * rng.uniform(0.9, 1.1, a.shape)).astype(a.dtype)

        sets.append(
            (
                {
                    **definition,
                    "variables": {n: other(v) for n, v in definition["variables"].items()},
                    "inputs": {n: other(v) for n, v in definition["inputs"].items()},
                },
                [other(v)[None] for v in prob.v],  # one vector, stacked: what /v1/hvp sends
            )
        )
    return sets


def _program_hvp(prob, compiled: bool):
    """A fresh HVP of a definition (CompiledProgram.hessian_vector_products, what POST
    /v1/hvp runs), with new values and a new vector on every call."""
    import engine as gt
    from engine.language import compile_definition

    definition = _definition(prob)
    program = compile_definition(definition)
    request = program.check_request("loss", None, "zero")
    calls = itertools.cycle(
        [
            (program.leaves(d), [gt.constant(v) for v in vectors])
            for d, vectors in _value_sets(prob, definition)
        ]
    )

    def run():
        leaves, vectors = next(calls)
        return program.hessian_vector_products(request, leaves, vectors, compiled=compiled)

    return run


def _batch_definition(prob) -> dict:
    """The benchmark MLP's output as a definition (a batch jacobian's target)."""
    definition = _definition(prob)
    return {
        "variables": definition["variables"],
        "inputs": {"x": prob.x},
        "program": definition["program"][:-1],
    }


def _program_batch_jacobian(prob, compiled: bool):
    """d out_b / d x_b per example of a definition (CompiledProgram.jacobians with batch,
    what POST /v1/jacobian with batch: true runs), new values on every call."""
    from engine.language import compile_definition

    definition = _batch_definition(prob)
    program = compile_definition(definition)
    request = program.check_request("out", ["x"], "none")
    calls = itertools.cycle([program.leaves(d) for d, _ in _value_sets(prob, definition)])
    return lambda: program.jacobians(request, next(calls), batch=True, compiled=compiled)


def _worker_request(prob, handler: str):
    """The worker's whole stateless handler (service/worker/compute.py: the definition
    checked and its leaves made, then the compiled pass), new values on every call: all
    of a request's cost but the HTTP process's and the IPC."""
    from service.worker import compute

    context = compute.start(0, "cpu", {})
    if handler == "hvp":
        definition = _definition(prob)
        names = list(definition["variables"])
        payloads = [
            {
                "definition": d,
                "target": "loss",
                "vector": {n: v[0] for n, v in zip(names, vectors, strict=True)},
            }
            for d, vectors in _value_sets(prob, definition)
        ]
    else:
        payloads = [
            {"definition": d, "target": "out", "sources": ["x"], "batch": True}
            for d, _ in _value_sets(prob, _batch_definition(prob))
        ]
    calls = itertools.cycle(payloads)
    fn = getattr(compute, handler)
    return lambda: fn(next(calls), context)


def _jit_cases(gradtape, compiled: bool, case: str):
    """The Python API (gt.jit's transforms, or with compiled=False the dynamic ones) on
    the benchmark MLP, cycling over NEW_VALUES sets of parameters and vectors (the data
    closed over, as bench_engine's gradtape rows have it), or of inputs x for the batch
    jacobian."""
    gt, prob = gradtape.gt, gradtape.prob
    rng = np.random.default_rng(11)

    def other(t):
        return gt.constant((t.numpy() * rng.uniform(0.9, 1.1, t.shape)).astype(t.dtype))

    if case == "bjac":
        model = gt.jit(lambda x: be.mlp(x, gradtape.consts, gradtape.act))
        xs = itertools.cycle([other(gradtape.x) for _ in range(NEW_VALUES)])
        if compiled:
            bjac = model.batch_jacobian()
            return lambda: bjac(next(xs))

        def dynamic():
            x = next(xs)
            with gt.GradientTape() as tape:
                tape.watch(x)
                out = be.mlp(x, gradtape.consts, gradtape.act)
            return tape.batch_jacobian(out, x)

        return dynamic
    sets = itertools.cycle(
        [
            ([other(p) for p in gradtape.consts], [other(v) for v in gradtape.v])
            for _ in range(NEW_VALUES)
        ]
    )
    loss = gradtape.loss
    nums = tuple(range(len(prob.params)))
    if case == "grad":
        vg = gt.jit(loss).value_and_grad(nums) if compiled else gt.value_and_grad(loss, nums)
        return lambda: vg(*next(sets)[0])
    if compiled:
        jitted = gt.jit(loss)
        return lambda: jitted.hvp(*next(sets))
    return lambda: gt.hvp(loss, *next(sets))


be.Gradtape.grad_jit = lambda self: _jit_cases(self, True, "grad")
be.Gradtape.hvp_jit = lambda self: _jit_cases(self, True, "hvp")
be.Gradtape.bjac_jit = lambda self: _jit_cases(self, True, "bjac")
be.Gradtape.grad_program = lambda self: _program_gradient(self.prob, True)
be.Gradtape.hvp_program = lambda self: _program_hvp(self.prob, True)
be.Gradtape.bjac_program = lambda self: _program_batch_jacobian(self.prob, True)
be.Gradtape.hvp_request = lambda self: _worker_request(self.prob, "hvp")
be.Gradtape.bjac_request = lambda self: _worker_request(self.prob, "jacobian")
for _peer in (be.NumpyFloor, be.TorchPeer, be.JaxPeer):
    _peer.grad_program = _peer.grad_jit = _peer.grad
    _peer.hvp_jit = _peer.hvp_fresh
    _peer.bjac_jit = _peer.batch_jac
    _peer.hvp_program = _peer.hvp_request = _peer.hvp_fresh
    _peer.bjac_program = _peer.bjac_request = _peer.batch_jac

CASES = {
    "grad_program": "gradient of a definition",
    "hvp_reused": "HVP reused (1 vector)",
    "hvp_batched": f"HVP reused x{be.K_VECTORS}, per vector",
    "hvp_fresh": "HVP fresh",
    "hvp_program": "HVP fresh of a definition, new values",
    "hvp_request": "HVP fresh, worker's /v1/hvp handler",
    "bjac_program": "batch jacobian of a definition, new values",
    "bjac_request": "batch jacobian, worker's /v1/jacobian handler",
    "grad_jit": "gradient, gt.jit(f).value_and_grad, new params",
    "hvp_jit": "HVP fresh, gt.jit(f).hvp, new params and vector",
    "bjac_jit": "batch jacobian, gt.jit(f).batch_jacobian, new x",
}


class GradtapeDynamic(be.Gradtape):
    """The engine as it was before issue 17's items 1-2: every HVP pass dynamic (no
    capture, no replay), and a fresh HVP computing its gradients' own GEMMs."""

    name = "gradtape-dynamic"

    def hvp_fresh(self):
        from engine.registry import DEFERRED_SHAPES

        fresh = super().hvp_fresh()

        def run():
            saved = dict(DEFERRED_SHAPES)
            DEFERRED_SHAPES.clear()
            try:
                return fresh()
            finally:
                DEFERRED_SHAPES.update(saved)

        return run

    def grad_program(self):
        return _program_gradient(self.prob, False)

    def grad_jit(self):
        return _jit_cases(self, False, "grad")

    def hvp_jit(self):
        return _jit_cases(self, False, "hvp")

    def bjac_jit(self):
        return _jit_cases(self, False, "bjac")

    def hvp_program(self):
        return _program_hvp(self.prob, False)

    def bjac_program(self):
        return _program_batch_jacobian(self.prob, False)

    def hvp_request(self):
        return None  # (the handler has no switch: the dynamic pass is hvp_program's)

    def bjac_request(self):
        return None

    def hvp_reused(self):
        op = self.gt.hessian_operator(self.loss, *self.consts, compiled=False)
        return lambda: op.hvp(self.v)

    def hvp_batched(self):
        op = self.gt.hessian_operator(self.loss, *self.consts, compiled=False)
        return lambda: op.hvp_many(self.vs)


PEERS = {**be.PEERS, GradtapeDynamic.name: GradtapeDynamic}


def timed(fn, inner: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call over `inner` calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(inner):
        out = fn()
    be_block(out)
    return (time.perf_counter() - w0) / inner, (time.process_time() - c0) / inner


def be_block(out) -> None:
    for leaf in out if isinstance(out, (list, tuple)) else [out]:
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--activation", default="tanh")
    parser.add_argument("--frameworks", default="gradtape,gradtape-dynamic,floor,torch,jax")
    parser.add_argument("--cases", default="hvp_reused,hvp_batched,hvp_fresh")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.2, help="per cell per round, about")
    args = parser.parse_args()
    frameworks = args.frameworks.split(",")
    cases = args.cases.split(",")
    # import engine tunes glibc's allocator for the whole process, peers included, unless
    # GRADTAPE_TUNE_ALLOCATOR=0 (engine/allocator.py): done before anything is timed
    from engine import allocator

    print(
        f"# bench_replay: {platform.machine()}, python {platform.python_version()}, "
        f"numpy {np.__version__}; threads: OMP={os.environ.get('OMP_NUM_THREADS')} "
        f"OPENBLAS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}; "
        f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}; "
        f"allocator tuned at import: {allocator.tuned_at_import}; "
        f"{args.rounds} interleaved rounds; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    for size_name in args.sizes.split(","):
        prob = be.make_problem(be.SIZES[size_name], args.activation)
        peers = {name: PEERS[name](prob) for name in frameworks}
        calls, inner = {}, {}
        for case in cases:
            for name, peer in peers.items():
                fn = getattr(peer, case)()
                if fn is None:
                    continue
                for _ in range(NEW_VALUES + 1):  # warm-up: captures gradtape's pass (its
                    fn()  # second call), compiles JAX's; every set of values seen once
                wall, _ = timed(fn, 1)
                calls[case, name] = fn
                inner[case, name] = max(1, int(args.seconds / max(wall, 1e-6)))
        samples = {key: [] for key in calls}
        for _ in range(args.rounds):
            for key, fn in calls.items():
                gc.collect()
                samples[key].append(timed(fn, inner[key]))
        per = {case: be.K_VECTORS if case == "hvp_batched" else 1 for case in cases}
        print(
            f"\n## {size_name} ({prob.size.describe()}, {args.activation}): ms per call "
            "(per vector for xK), median wall (CPU)\n"
        )
        print(
            "| case | " + " | ".join(frameworks) + " | gt/floor | gt/torch | gt/jax "
            "| dynamic/compiled |"
        )
        print("|---|" + "---|" * (len(frameworks) + 4))
        for case in cases:
            med = {}
            cells = []
            for name in frameworks:
                if (case, name) not in samples:
                    cells.append("n/a")
                    continue
                wall = statistics.median(s[0] for s in samples[case, name]) / per[case]
                cpu = statistics.median(s[1] for s in samples[case, name]) / per[case]
                med[name] = (wall, cpu)
                cells.append(f"{wall * 1e3:.3f} ({cpu * 1e3:.3f})")

            def ratio(a, b, med=med):
                if a not in med or b not in med:
                    return "n/a"
                return f"{med[a][0] / med[b][0]:.2f}x ({med[a][1] / med[b][1]:.2f}x)"

            print(
                f"| {CASES[case]} | " + " | ".join(cells) + f" | {ratio('gradtape', 'floor')} "
                f"| {ratio('gradtape', 'torch')} | {ratio('gradtape', 'jax')} "
                f"| {ratio('gradtape-dynamic', 'gradtape')} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
