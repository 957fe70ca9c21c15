"""The model/loss definition language: parse, check, compile to engine calls.

A definition names its variables (parameters, `trainable` by default), its inputs
(data) and a program of assignments, one per line:

    h    = relu(x @ w1 + b1)
    out  = h @ w2 + b2
    loss = mean((out - y) ** 2)

Lines are parsed by Python's `ast` into a whitelist of constructs (names, numbers,
`+ - * / ** @`, unary minus, comparisons, calls of catalogue ops with tensor arguments
and constant keyword arguments, constant indexing and slicing) and never evaluated as
Python. Every problem (names, ops, arity, shapes, dtypes, limits) is found before
anything runs and reported at once, with its line and column, as a DefinitionError.

Built-ins: grad(y, x) (a nested tape; differentiable again), stop_gradient(e),
clip_grad_norm(e, max_norm), and user functions with a forward and a backward program
(definition.FunctionDef, the analogue of tf.custom_gradient).

    evaluate(definition, "loss", ["w1", "b1"])        # value and gradients, as NumPy
    program = compile_definition(definition)          # checked once, cached by structure
    leaves = program.leaves(definition)               # Variables and constants by name
    with gt.GradientTape() as tape:                   # the caller owns the tapes
        env = program.run(leaves)                     # every name -> Tensor
    program.check_request("loss", sources)            # target/sources, all problems at once
    program.function("loss", ["w1"], leaves)          # f(w1) for gt.hessian, gt.hvp, ...
    catalogue()                                       # the op catalogue (GET /v1/ops)

This package sits above the tape and the transforms; nothing in the engine imports it.
"""

from engine.language.catalogue import catalogue
from engine.language.compile import (
    CompiledProgram,
    ModelSplit,
    Request,
    cache_size,
    clear_cache,
    compile_definition,
)
from engine.language.definition import (
    Definition,
    FunctionDef,
    VariableDef,
    as_definition,
)
from engine.language.errors import DefinitionError, ExecutionError, OverBudget, Problem
from engine.language.evaluate import Evaluation, evaluate, evaluate_compiled
from engine.language.limits import DEFAULT_LIMITS, Limits
from engine.shapes import TensorType

__all__ = [
    "DEFAULT_LIMITS",
    "CompiledProgram",
    "Definition",
    "DefinitionError",
    "Evaluation",
    "ExecutionError",
    "FunctionDef",
    "Limits",
    "ModelSplit",
    "OverBudget",
    "Problem",
    "Request",
    "TensorType",
    "VariableDef",
    "as_definition",
    "cache_size",
    "catalogue",
    "clear_cache",
    "compile_definition",
    "evaluate",
    "evaluate_compiled",
]
