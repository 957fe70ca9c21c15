"""How long a run of a checked program takes, estimated before it runs.

Validation knows every op's result type and its arguments' shapes (Intermediate), so the
work of one forward pass is known before anything runs, in three measures that run at
very different speeds on a CPU (bench/bench_cost.py measures each):

- contraction FLOPs: matmul, conv, attention, solve (the products' own counts), at the
  machine's matmul rate;
- transcendental elements: each result element of sin, exp, tanh, softplus, ... (about
  ten times an add's cost per element here);
- bytes moved: every argument read and every result written once, at the rate of an
  elementwise add that allocates its result (what the engine's ops do).

A derivative run is a number of such passes: a gradient is the forward pass and one
backward pass (BACKWARD_COST forward passes); a request with `items` derivative passes
(jacobian rows, HVP vectors, Hessian rows, probes) adds BACKWARD_COST (first order: a
backward pass) or HVP_COST (a forward-over-reverse pass) forward passes per item.
Seconds = the sum of each measure over its throughput (Throughput: the service settings
cost_flops_per_second, cost_transcendentals_per_second, cost_bytes_per_second).

The estimate is a guard against requests orders of magnitude past a time limit, not a
scheduler: it leaves out what it cannot see (an einsum's contraction, an ONNX node
outside ONNX_COSTS beyond its bytes, a user function called many times counts once per
signature), so it errs on the fast side, and a refusal is only for what even this
estimate cannot finish. An ONNX model's nodes count as the language's ops do (its
MatMul as matmul, its Tanh as tanh), from the shapes of the graph specialised to the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.language.validate import CheckedProgram, Intermediate

# What one derivative pass costs, per measure, in forward passes of that measure
# (bench/bench_cost.py, CPU time): a backward pass runs two contractions per forward one
# and moves about twice the bytes, but recomputes few transcendentals (tanh's and exp's
# rules reuse their results; sin's takes a cos); a forward-over-reverse pass (an HVP
# vector) measured 2.4x-4.6x the contractions and about one transcendental per forward
# one. The lower ends are kept, so the estimate errs on the fast side.
BACKWARD = (2.0, 0.25, 2.0)  # (contractions, transcendentals, bytes)
HVP = (2.5, 1.0, 2.5)

CONTRACTIONS = frozenset(
    {"matmul", "conv", "conv1d", "conv2d", "scaled_dot_product_attention", "solve"}
)
TRANSCENDENTAL = frozenset(
    {"sin", "cos", "tan", "exp", "expm1", "log", "log1p", "tanh", "sigmoid", "softplus",
     "erf", "power", "atan2", "gelu", "silu", "elu", "log_sigmoid", "softmax", "log_softmax",
     "logsumexp", "softmax_cross_entropy", "sigmoid_cross_entropy", "xlogy"}
)  # fmt: skip


# An ONNX model's nodes by the language op whose cost they have (a model's graph runs
# inside one call of the program, node by node: each counts as that op would).
ONNX_COSTS = {
    "MatMul": "matmul", "Gemm": "matmul",  # Gemm's A passed k-last: see model_step_costs
    "Conv": "conv",
    "Sin": "sin", "Cos": "cos", "Tan": "tan", "Exp": "exp", "Log": "log", "Tanh": "tanh",
    "Sigmoid": "sigmoid", "Softplus": "softplus", "Erf": "erf", "Pow": "power",
    "Gelu": "gelu", "Elu": "elu", "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "ReduceLogSumExp": "logsumexp",
}  # fmt: skip


def model_step_costs(
    model: Any, spec: Any, input_shapes: list[tuple[int, ...]]
) -> dict[str, tuple[str | None, tuple[tuple[int, ...], ...]]]:
    """Each node output of a specialised ONNX model -> (the language op whose cost it
    has, or None; its operands' shapes), for the Intermediates validation records."""
    shapes: dict[str, tuple[int, ...]] = {
        **{i.name: tuple(s) for i, s in zip(model.inputs, input_shapes, strict=False)},
        **{n: tuple(v.shape) for n, v in model.params.items()},
        **{n: tuple(v.shape) for n, v in spec.consts.items()},
        **{n: tuple(s) for n, s, _ in spec.sizes},
    }
    out: dict[str, tuple[str | None, tuple[tuple[int, ...], ...]]] = {}
    for step in spec.steps:
        operands = tuple(shapes[n] for n in step.inputs if n and n in shapes)
        if step.op_type == "Gemm" and len(operands) >= 2 and len(operands[0]) == 2:
            # Gemm(A, B): A is k-last unless transA (matmul's count reads k there).
            a = operands[0][::-1] if step.attrs.get("transA") else operands[0]
            operands = (a, *operands[1:])
        for name in step.outputs:
            if name:
                out[name] = (ONNX_COSTS.get(step.op_type), operands)
    return out


def _flops(i: Intermediate) -> int:
    """The contraction FLOPs of one op, from its result and its arguments' shapes (0 for
    an op that is not a contraction)."""
    out = i.type.size
    shapes = i.inputs
    op = i.work or i.op
    if op == "matmul" and len(shapes) == 2 and shapes[0]:
        return 2 * out * shapes[0][-1]
    if op in ("conv", "conv1d", "conv2d") and len(shapes) >= 2:
        return 2 * out * math.prod(shapes[1][1:])
    if op == "scaled_dot_product_attention" and len(shapes) >= 3 and len(shapes[0]) >= 2:
        q, k, v = shapes[:3]
        batch = math.prod(q[:-2])
        return 2 * batch * q[-2] * k[-2] * (q[-1] + v[-1])
    if op == "solve" and shapes and len(shapes[0]) >= 2:
        n = shapes[0][-1]
        return math.prod(shapes[0][:-2]) * n**3 + 2 * out * n
    return 0


def _transcendentals(i: Intermediate) -> int:
    if (i.work or i.op) not in TRANSCENDENTAL:
        return 0
    return max(i.type.size, max((math.prod(s) for s in i.inputs), default=0))


def _moved(i: Intermediate) -> int:
    elements = i.type.size + sum(math.prod(s) for s in i.inputs)
    return elements * i.type.dtype.itemsize


@dataclass(frozen=True)
class Throughput:
    """What this machine does per second (0: the guard is off)."""

    flops_per_second: float  # contractions (matmul)
    transcendentals_per_second: float  # elements of sin, exp, tanh, ...
    bytes_per_second: float  # elementwise traffic

    @property
    def enabled(self) -> bool:
        return (
            min(self.flops_per_second, self.transcendentals_per_second, self.bytes_per_second) > 0
        )


@dataclass(frozen=True)
class Estimate:
    """A run's work in all and its seconds at a Throughput."""

    items: int
    flops: float
    transcendentals: float
    bytes_moved: float
    seconds: float

    def describe(self) -> str:
        return (
            f"about {self.seconds:,.1f} s ({_si(self.flops)}FLOP in contractions, "
            f"{_si(self.transcendentals).strip()} transcendental elements, {_si(self.bytes_moved)}B "
            f"moved, over the forward pass and {self.items:,} derivative pass(es))"
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "seconds": round(self.seconds, 3),
            "flops": self.flops,
            "transcendentals": self.transcendentals,
            "bytes_moved": self.bytes_moved,
        }


@dataclass(frozen=True)
class CostModel:
    """Contraction FLOPs, transcendental elements and bytes moved by one forward pass."""

    flops: int
    transcendentals: int
    bytes_moved: int

    @classmethod
    def of(cls, checked: CheckedProgram) -> CostModel:
        ops = checked.intermediates
        return cls(
            sum(_flops(i) for i in ops),
            sum(_transcendentals(i) for i in ops),
            sum(_moved(i) for i in ops),
        )

    def estimate(self, items: int, first_order: bool, rate: Throughput) -> Estimate:
        """A run with `items` derivative passes: first order, the forward pass and one
        backward pass per item (a gradient is one); second order, the recording (the
        forward pass and its gradient) and one forward-over-reverse pass per item."""
        if first_order:
            passes = [(1.0, 1.0, 1.0), BACKWARD]
            scale = [1, max(items, 1)]
        else:
            passes = [(1.0, 1.0, 1.0), BACKWARD, HVP]
            scale = [1, 1, items]
        per_pass = (self.flops, self.transcendentals, self.bytes_moved)
        flops, transcendentals, moved = (
            sum(n * p[m] * per_pass[m] for n, p in zip(scale, passes, strict=True))
            for m in range(3)
        )
        seconds = (
            flops / rate.flops_per_second
            + transcendentals / rate.transcendentals_per_second
            + moved / rate.bytes_per_second
        )
        return Estimate(items, flops, transcendentals, moved, seconds)


def _si(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} "
