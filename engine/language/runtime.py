"""What a compiled program runs on: evaluators built from the checked expression tree
(plain closures over engine ops; no Python code is generated), the built-ins grad and
clip_grad_norm, and user functions: plain ones run inline (their ops are recorded like the
program's), those with a backward program as engine custom gradients.

An evaluator takes a `Frame` (the values computed so far, and the tapes of the grad
calls still open) and returns a tensor. Every op call is wrapped so that an error while
running names the line, the column and the op: an ExecutionError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine import trace
from engine.language.catalogue import SIGNATURES, bind
from engine.language.errors import DefinitionError, ExecutionError, Problem
from engine.language.nonfinite import NonFiniteCheck
from engine.language.parse import Call, Name, Node, Number, Pos, Subscript
from engine.language.validate import GRAD_PREFIX, UPSTREAM, CheckedFunction, GradSite
from engine.ops.elementwise import multiply
from engine.ops.nn import clip_by_norm
from engine.registry import public_ops
from engine.tape import GradientTape, custom_gradient
from engine.tensor import Tensor, as_tensor

# What an op raises for bad data that the checks cannot see (a singular matrix, a label
# out of range); anything else is a bug and propagates as it is.
RUNTIME_ERRORS = (ValueError, TypeError, IndexError, ArithmeticError, NotImplementedError)


class Frame:
    """The state of one run: values by name, and the tapes of open grad calls."""

    __slots__ = ("check", "ids", "root", "tapes", "values")

    def __init__(
        self,
        values: dict[str, Tensor],
        check: NonFiniteCheck | None = None,
        root: dict[str, Tensor] | None = None,
    ):
        self.values = values
        # the program's values, where a function finds the variables it owns
        self.root = values if root is None else root
        self.tapes: dict[int, GradientTape] = {}
        self.ids = {id(v) for v in values.values()}
        self.check = check  # set only when diagnosing a non-finite answer

    def assign(self, name: str, value: Any) -> None:
        value = as_tensor(value)
        if id(value) in self.ids:
            # Some ops hand back their input unchanged (reshape to the same shape, `h = x`).
            # Each name gets its own tensor, so a tape watching one name never sees
            # operations on the other.
            value = _fresh(value)
        self.values[name] = value
        self.ids.add(id(value))

    def close(self) -> None:
        for tape in self.tapes.values():
            tape.__exit__(None, None, None)
        self.tapes.clear()


def _fresh(value: Tensor) -> Tensor:
    if value.dtype.kind == "f":
        return multiply(value, as_tensor(1, like=value))  # recorded: gradients flow through
    fresh = Tensor(value.value)  # integers and bools carry no gradient
    if trace.capture is not None:  # the same array under a new identity
        trace.capture.alias(fresh, value)
    return fresh


Evaluator = Callable[[Frame], Any]


def located(evaluate: Evaluator, section: str, pos: Pos, op: str) -> Evaluator:
    def run(frame: Frame) -> Any:
        try:
            out = evaluate(frame)
            if frame.check is not None:
                frame.check.after(out, section, pos, op)
            return out
        except DefinitionError:
            raise
        except RUNTIME_ERRORS as exc:
            message = str(exc).removeprefix(f"{op}: ")  # the engine often names the op too
            problem = Problem(message, section, pos.line, pos.column, op, kind="runtime")
            raise ExecutionError([problem]) from exc

    return run


class Builder:
    """Expression tree -> evaluator, for one section of a checked definition."""

    def __init__(
        self,
        section: str,
        functions: dict[str, Callable[..., Any]],
        sites: dict[Call, int] | None = None,
        grad_sites: list[GradSite] | None = None,
        models: dict[str, Any] | None = None,
        model_calls: dict[Call, Any] | None = None,
    ):
        self.section = section
        self.functions = functions
        self.models = models or {}  # name -> engine.onnx.OnnxModel
        self.model_calls = model_calls or {}  # call node -> (its Specialization, output)
        self.sites = sites or {}  # grad call node -> its index in grad_sites
        self.grad_sites = grad_sites or []

    def expr(self, node: Node) -> Evaluator:
        if isinstance(node, Name):
            name = node.id
            return lambda frame: frame.values[name]
        if isinstance(node, Number):
            value = node.value
            return lambda frame: value
        if isinstance(node, Subscript):
            operand, index = self.expr(node.value), node.index
            getitem = public_ops["getitem"].fn
            return located(
                lambda frame: getitem(operand(frame), index), self.section, node.pos, "getitem"
            )
        if isinstance(node, Call):
            return located(self.call(node), self.section, node.pos, node.func)
        raise AssertionError(f"unchecked node {node!r}")  # validation refuses the rest

    def call(self, node: Call) -> Evaluator:
        if node.func == "grad":
            return self.grad(node)
        if node.func in self.models:
            model, (spec, index) = self.models[node.func], self.model_calls[node]
            args = [self.expr(a) for a in node.args]
            # The model's parameters are variables of the run, by their ONNX names; the
            # call answers the output it chose (validate.model_output).
            return lambda frame: model.run(spec, [a(frame) for a in args], frame.values)[index]
        if node.func in self.functions:
            # Looked up when run: functions may call functions defined after them.
            functions, name, args = self.functions, node.func, [self.expr(a) for a in node.args]
            return lambda frame: functions[name](frame.root, *[a(frame) for a in args])
        sig = SIGNATURES[node.func]
        bound = bind(sig, node)
        tensors: dict[str, Any] = {
            name: [self.expr(a) for a in arg] if isinstance(arg, list) else self.expr(arg)
            for name, arg in bound.tensors.items()
            if arg is not None
        }
        constants = {name: bound.constants[name] for name in bound.given if name in bound.constants}
        if node.func == "clip_grad_norm":
            x, max_norm = tensors["x"], constants["max_norm"]
            return lambda frame: clip_grad_norm(x(frame), max_norm)
        fn = public_ops[node.func].fn
        variadic = next((p for p in sig.params if p.variadic), None)
        if variadic is not None:  # einsum(spec, *operands): spec goes by position
            fixed = [constants.get(p.name, p.default) for p in sig.params if not p.variadic]
            operands = tensors[variadic.name]
            return lambda frame: fn(*fixed, *[o(frame) for o in operands])

        def run(frame: Frame) -> Any:
            kwargs = {
                name: [a(frame) for a in arg] if isinstance(arg, list) else arg(frame)
                for name, arg in tensors.items()
            }
            out = fn(**kwargs, **constants)
            if frame.check is not None:
                frame.check.note_inputs(kwargs, lambda **again: fn(**again, **constants))
            return out

        return run

    def grad(self, node: Call) -> Evaluator:
        key = self.sites[node]
        target, source = self.expr(node.args[0]), self.grad_sites[key].source

        def run(frame: Frame) -> Tensor:
            y = as_tensor(target(frame))
            tape = frame.tapes.pop(key)
            tape.__exit__(None, None, None)
            # Every tape still open (the caller's, outer grads) records this backward
            # pass, which is what makes the result differentiable again.
            return tape.gradient(y, frame.values[source], unconnected_gradients="zero")

        return run


def open_grad_tape(frame: Frame, key: int, source: str) -> None:
    tape = GradientTape(watch_accessed_variables=False)
    tape.__enter__()
    frame.tapes[key] = tape
    tape.watch(frame.values[source])


# ----------------------------------------------------------------------------------------
# Built-ins and user functions
# ----------------------------------------------------------------------------------------


def clip_grad_norm(x: Any, max_norm: float) -> Tensor:
    """x unchanged; its gradient on the way back is rescaled to an L2 norm <= max_norm."""

    @custom_gradient
    def identity(x: Tensor) -> Any:
        def grad_fn(g: Tensor) -> Tensor:
            # The norm is taken over x's own axes: leading batch axes of g (jacobian rows,
            # batched HVPs) are separate cotangents, each clipped on its own.
            return clip_by_norm(g, max_norm, axis=tuple(range(-x.ndim, 0)))

        return x, grad_fn

    return identity(x)


def user_function(
    fn: CheckedFunction, functions: dict[str, Callable[..., Any]]
) -> Callable[..., Any]:
    """A user function, called as f(root, *args) (root: the program's values, where the
    variables it owns are). `functions`: every user function by name, for the calls in
    its body (filled in by the caller; the checks refused recursion)."""
    if fn.plain:
        return plain_function(fn, functions)
    return custom_function(fn, functions)


def plain_function(
    fn: CheckedFunction, functions: dict[str, Callable[..., Any]]
) -> Callable[..., Any]:
    """A function without a backward program: its lines run inline, under whatever tapes
    are open, so it is differentiated through like the program (to any order)."""
    forward = Builder(f"functions.{fn.name}.forward", functions)
    steps = [(line.target, forward.expr(line.expr)) for line in fn.forward]
    params, owned, output = fn.params, fn.owned, fn.output

    def call(root: dict[str, Tensor], *args: Any) -> Any:
        values = dict(zip(params, args))
        values.update({local: root[leaf] for local, leaf in owned})
        frame = Frame(values, root=root)
        for name, step in steps:
            frame.assign(name, step(frame))
        return frame.values[output]

    call.__name__ = fn.name
    return call


def custom_function(
    fn: CheckedFunction, functions: dict[str, Callable[..., Any]]
) -> Callable[..., Any]:
    """A user function as an engine custom gradient: its forward program computes the
    value and its backward program the gradients, from the forward's names and
    `upstream`. The forward is recorded by the open tapes (as tf.custom_gradient does),
    so a backward that uses forward names is differentiated through them again."""
    forward = Builder(f"functions.{fn.name}.forward", functions)
    backward = Builder(f"functions.{fn.name}.backward", functions)
    forward_steps = [(line.target, forward.expr(line.expr)) for line in fn.forward]
    backward_steps = [(line.target, backward.expr(line.expr)) for line in fn.backward]
    params, output = fn.params, fn.output

    @custom_gradient
    def gradient_of(*args: Tensor) -> Any:
        frame = Frame(dict(zip(params, args)))
        for name, step in forward_steps:
            frame.assign(name, step(frame))

        def grad_fn(upstream: Tensor) -> tuple:
            back = Frame({**frame.values, UPSTREAM: upstream})
            for name, step in backward_steps:
                back.assign(name, step(back))
            return tuple(back.values.get(GRAD_PREFIX + p) for p in params)

        return frame.values[output], grad_fn

    gradient_of.__name__ = fn.name

    def call(root: dict[str, Tensor], *args: Any) -> Any:
        return gradient_of(*args)

    call.__name__ = fn.name
    return call
