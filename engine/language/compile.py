"""Compilation: a checked definition -> a CompiledProgram that runs many times.

A program is compiled from the definition's *structure* (its lines, functions, and the
names, shapes, dtypes and trainable flags of its variables and inputs), not from the
values, and cached under a hash of that structure: the service records a tape from it
per request, and re-runs it with new values or to rebuild a lost tape, without parsing
or checking again.

    program = compile_definition(definition)
    leaves = program.leaves(definition)            # Variables and constants, by name
    with gt.GradientTape() as tape:                # the caller owns the tapes
        env = program.run(leaves)                  # every name -> Tensor
    tape.gradient(env["loss"], leaves["w"])
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine import backend, replay
from engine.backend import host
from engine.language.catalogue import suggest
from engine.language.cost import CostModel
from engine.language.definition import Definition, as_definition, structure_key
from engine.language.errors import DefinitionError, OverBudget, Problem
from engine.language.limits import DEFAULT_LIMITS, Limits
from engine.language.memory import MemoryModel
from engine.language.nonfinite import NonFiniteCheck, find_culprit
from engine.language.reduction import batch_reduction
from engine.language.runtime import Builder, Frame, open_grad_tape, user_function
from engine.language.validate import (
    CheckedProgram,
    Leaf,
    calls_made,
    check_definition,
    size_problems,
)
from engine.registry import MissingRuleError
from engine.shapes import TensorType
from engine.tape import GradientTape, check_per_example, per_example_layout, per_example_rows
from engine.tensor import Tensor, Variable, constant
from engine.transforms import HessianOperator, forward_jacobian, hessian_operator

CACHE_SIZE = 256
UNCONNECTED = ("none", "zero")
# Compiled gradient passes (one per program, request shape and leaf layout), kept for all
# programs together, least recently used out, and the scratch buffers each may keep
# between passes: whatever programs a process is sent, their kept buffers stay within
# GRADIENT_PASSES x GRADIENT_POOL_LIMIT (256 MiB), not per cached program (the compile
# cache holds CACHE_SIZE programs).
GRADIENT_PASSES = 16
GRADIENT_POOL_LIMIT = 16 * 1024 * 1024
_gradient_passes = replay.Passes(GRADIENT_PASSES, GRADIENT_POOL_LIMIT)
# Compiled fresh HVP and jacobian passes (the whole pass of one POST /v1/hvp or
# /v1/jacobian request: forward, gradient, second-order or jacobian rows), bounded the
# same way and apart from the gradient passes, so that they never evict a worker's
# gradient passes: at most REQUEST_PASSES x REQUEST_POOL_LIMIT (256 MiB) of kept buffers,
# and as much of the constants a pass makes (a jacobian's identity rows grow with its
# chunk: a pass with more stays dynamic).
REQUEST_PASSES = 16
REQUEST_POOL_LIMIT = 16 * 1024 * 1024
_request_passes = replay.Passes(REQUEST_PASSES, REQUEST_POOL_LIMIT, REQUEST_POOL_LIMIT)


def _digest(values: Any) -> bytes:
    """An integer leaf's values in a pass's key (a program may branch on labels or
    indices), as 16 bytes: a kept key never holds a copy of a large label array."""
    return hashlib.blake2b(values.tobytes(), digest_size=16).digest()


def _leaf_layout(names: list[str], arrays: list[Any]) -> tuple:
    """The leaves' part of a compiled pass's key: each one's layout, and an integer leaf's
    values by digest (a program may branch on labels or indices)."""
    return tuple(
        (n, a.shape, a.strides, a.dtype.str, None if a.dtype.kind == "f" else _digest(a))
        for n, a in zip(names, arrays, strict=True)
    )


CHECKED_REQUESTS = 64  # the most checked requests a program remembers


def _request_key(target: Any, sources: Any, unconnected: Any, allow_unused: bool) -> Any:
    """check_request's arguments as a key, when they are plain names (None otherwise: such
    a request is checked every time, and refused with its problems)."""
    if not isinstance(target, str) or not isinstance(unconnected, str):
        return None
    if sources is None or isinstance(sources, str):
        shape: Any = sources
    elif isinstance(sources, Mapping):
        shape = ("mapping", *sources.items())
    elif isinstance(sources, list | tuple):
        shape = ("names", *sources)
    else:
        return None
    key = (target, shape, unconnected, bool(allow_unused))
    try:
        hash(key)
    except TypeError:
        return None
    return key


@dataclass(frozen=True)
class Request:
    """A checked target and sources: `sources` maps each answer key (the name, or the
    client's alias) to the variable or input it differentiates with respect to."""

    target: str
    sources: dict[str, str]
    unconnected: str = "none"


class CompiledProgram:
    """A checked, compiled definition. Holds no tensor values (`run` takes them), only
    the compiled forms of its gradient passes (`value_and_gradients`)."""

    def __init__(self, key: str, limits: Limits, checked: CheckedProgram):
        self.key = key
        self.limits = limits
        self.leaf_info: dict[str, Leaf] = checked.leaves
        self.types: dict[str, TensorType] = checked.types
        self.line_names: tuple[str, ...] = tuple(line.target for line in checked.lines)
        self._line_numbers = {line.target: line.number for line in checked.lines}
        self._line_columns = {line.target: line.pos.column for line in checked.lines}
        self._reads = checked.reads
        self._exprs = {line.target: line.expr for line in checked.lines}
        # The parameters a line reads through the models it calls (`out1 = net(x)` names
        # none of them), by parameter -> model: split() holds a loss line to them as to a
        # variable it names.
        self._model_reads: dict[str, dict[str, str]] = {
            line.target: {
                param: called
                for called in calls_made(line.expr)
                if called in checked.models
                for param in checked.models[called].model.params
            }
            for line in checked.lines
        }
        # The requests checked already (a service checks the same one on every call):
        # check_request's key -> its Request.
        self._checked_requests: dict[tuple[Any, ...], Request] = {}
        self.memory = MemoryModel.of(checked)  # bytes of a recording and of each pass item
        self.cost = CostModel.of(checked)  # FLOPs and bytes moved by one forward pass
        self._sites = checked.grad_sites
        functions: dict[str, Callable[..., Any]] = {}
        for name, fn in checked.functions.items():
            functions[name] = user_function(fn, functions)
        site_keys = {site.node: i for i, site in enumerate(checked.grad_sites)}
        models = {name: m.model for name, m in checked.models.items()}
        builder = Builder(
            "program", functions, site_keys, checked.grad_sites, models, checked.model_calls
        )
        self._steps = [(line.target, builder.expr(line.expr)) for line in checked.lines]

    # What the program defines -------------------------------------------------------------
    @property
    def variables(self) -> dict[str, Leaf]:
        return {n: leaf for n, leaf in self.leaf_info.items() if leaf.role == "variable"}

    @property
    def inputs(self) -> dict[str, Leaf]:
        return {n: leaf for n, leaf in self.leaf_info.items() if leaf.role == "input"}

    @property
    def trainable(self) -> list[str]:
        """The default sources: every floating-point trainable variable, in order."""
        return [
            n
            for n, leaf in self.variables.items()
            if leaf.trainable and leaf.type.dtype.kind == "f"
        ]

    # Values ---------------------------------------------------------------------------
    def leaves(self, definition: Any, device: str | None = None) -> dict[str, Tensor]:
        """The definition's values as engine tensors: a Variable (with its trainable flag)
        per variable, a constant per input, on `device` (default: where the value is)."""
        defn = definition if isinstance(definition, Definition) else as_definition(definition)
        out: dict[str, Tensor] = {}
        for name, var in defn.variables.items():
            # (as_definition made every value an array: moved, if need be, without a
            # Tensor around it first)
            value = var.value if device is None else backend.asarray(var.value, None, device)
            out[name] = Variable(value, trainable=var.trainable, name=name)
        for name, value in defn.inputs.items():
            out[name] = constant(value, device=device)
        self._check_leaves(out)
        return out

    def _check_leaves(self, leaves: Mapping[str, Any]) -> None:
        problems = []
        for name, leaf in self.leaf_info.items():
            section = f"{leaf.role}s.{name}"
            value = leaves.get(name)
            if value is None:
                problems.append(Problem(f"no value for {name!r}", section, kind="value"))
            elif not isinstance(value, Tensor):
                problems.append(
                    Problem(
                        f"expected an engine Tensor, got {type(value).__name__} (use "
                        "program.leaves(definition))",
                        section,
                        kind="value",
                    )
                )
            elif tuple(value.shape) != leaf.type.shape or value.dtype != leaf.type.dtype:
                problems.append(
                    Problem(
                        f"the program was compiled for {leaf.type}, got {value.dtype}"
                        f"{list(value.shape)}",
                        section,
                        kind="value",
                    )
                )
        for name in leaves:
            if name not in self.leaf_info:
                problems.append(
                    Problem(
                        f"{name!r} is not a variable or input of the program",
                        "definition",
                        kind="value",
                    )
                )
        if problems:
            raise DefinitionError(problems)

    # Running --------------------------------------------------------------------------
    def run(
        self,
        leaves: Mapping[str, Tensor],
        targets: Iterable[str] | None = None,
        check: NonFiniteCheck | None = None,
    ) -> dict[str, Tensor]:
        """Run the program on these leaf tensors under whatever tapes the caller holds
        open; return every name's tensor. With `targets`, only the lines they need run.
        `check` (diagnosis only) stops the run at the first op with a non-finite result."""
        self._check_leaves(leaves)
        return self._run_lines(leaves, self._needed(targets), check)

    def _run_lines(
        self, values: Mapping[str, Tensor], wanted: set[int], check: NonFiniteCheck | None = None
    ) -> dict[str, Tensor]:
        """Run the lines `wanted` (indices) on these values (no leaf check: the split
        halves of a program run on other values, see ModelSplit)."""
        frame = Frame(dict(values), check)
        pending = sorted(
            (site.opens_before, key, site.source)
            for key, site in enumerate(self._sites)
            if site.line_index in wanted
        )
        try:
            for index, (name, step) in enumerate(self._steps):
                if index not in wanted:
                    continue
                while pending and pending[0][0] <= index:
                    _, key, source = pending.pop(0)
                    open_grad_tape(frame, key, source)
                frame.assign(name, step(frame))
        finally:
            frame.close()  # a failed run must not leave a tape recording
        return frame.values

    def value_and_gradients(
        self, request: Request, leaves: Mapping[str, Tensor], compiled: bool = True
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """The target's value and its gradient per answer key of request.sources.

        The first pass of a request and leaf layout runs dynamically, the second under a
        capture (engine/replay.py), later ones replay its array calls with the new leaf
        values, with the same answers. Integer and boolean leaves (labels, indices) are
        part of the layout by value: a program may branch on them. A pass that cannot be
        captured (an op that makes an array outside the ops, as one-hot labels do) stays
        dynamic.
        """
        names = sorted(leaves)
        arrays = [leaves[n].value for n in names]
        if not compiled or not all(type(a) is host.ndarray for a in arrays):
            return replay.run_dynamic(
                replay.why_dynamic(compiled),
                lambda: self._value_and_gradients(request, dict(leaves)),
            )
        key = (
            self.key,
            request.target,
            tuple(request.sources.items()),
            request.unconnected,
            _leaf_layout(names, arrays),
        )
        keys = list(request.sources)

        def run(seeds: list[Tensor]) -> list[Tensor | None]:
            value, grads = self._value_and_gradients(request, dict(zip(names, seeds)))
            return [value, *(grads[k] for k in keys)]

        value, *grads = _gradient_passes.run(
            key, [leaves[n] for n in names], run, lambda: replay.known_tensors(self)
        )
        assert value is not None  # the loss is every pass's first output
        return value, dict(zip(keys, grads, strict=True))

    def gradient_passes(self) -> dict[Any, Any]:
        """This program's kept gradient passes: request and leaf layout -> its Schedule, or
        (why it is not compiled yet, failed captures)."""
        return {k[1:]: v for k, v in list(_gradient_passes.entries.items()) if k[0] == self.key}

    def hessian_vector_products(
        self,
        request: Request,
        leaves: Mapping[str, Tensor],
        vectors: list[Tensor],
        memory_budget: int | None = None,
        compiled: bool = True,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """A fresh HVP: the target's value, its gradient per source and H @ v for K vectors
        at once, in the order of request.sources. `vectors` holds one tensor per source of
        shape (K, *source shape). What a HessianOperator recorded for the request and asked
        for hvp_many answers (reverse-over-reverse; with a memory budget, in passes of as
        many vectors as fit, refused with OverBudget when not even one fits).

        compiled: like value_and_gradients, the whole pass (forward, gradient, and the
        second-order pass seeded by the vectors) of a request, leaf layout and vector
        layout runs dynamically the first time, under a capture the second, and as a
        replayed schedule afterwards, with the same answers; a pass that cannot be
        captured stays dynamic.
        """
        max_batch = self.batch_within(memory_budget, "recording it and one HVP pass")
        count = len(request.sources)

        def run(leaves: dict[str, Tensor], vectors: list[Tensor]) -> list[Tensor | None]:
            value, grads, products = self._hessian_vector_products(
                request, leaves, vectors, max_batch
            )
            return [value, *grads, *products]

        value, *rest = self._request_pass(
            ("hvp", request.target, tuple(request.sources.items()), max_batch),
            leaves,
            vectors,
            run,
            compiled,
        )
        return value, rest[:count], rest[count:]  # type: ignore[return-value]

    def jacobians(
        self,
        request: Request,
        leaves: Mapping[str, Tensor],
        batch: bool = False,
        chunk_size: int | None = None,
        compiled: bool = True,
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """The target's value and its jacobian per answer key of request.sources: full
        (target.shape + source.shape; `chunk_size` rows per backward pass), or with
        `batch` per example (GradientTape.batch_jacobian's, for a target and sources that
        share their first axis; BatchDependenceError when the examples mix). Compiled like
        hessian_vector_products; the batch check runs on every pass's rows."""
        keys = list(request.sources)
        if not batch and self._tall(request, leaves):
            try:
                return self._forward_jacobians(request, leaves, chunk_size, compiled)
            except MissingRuleError:
                pass  # an op without a JVP rule on the way: reverse mode, below

        def run(leaves: dict[str, Tensor], _: list[Tensor]) -> list[Tensor | None]:
            watched = {key: leaves[name] for key, name in request.sources.items()}
            with GradientTape(persistent=True, watch_accessed_variables=False) as tape:
                tape.watch(list(watched.values()))
                y = self.run(leaves, targets=[request.target])[request.target]
            if batch:  # the jacobians, and the rows they are views of (to check)
                rows = [per_example_rows(tape, y, s) for s in watched.values()]
                return [
                    y,
                    *(
                        per_example_layout(r, y, s)
                        for r, s in zip(rows, watched.values(), strict=True)
                    ),
                    *rows,
                ]
            found = tape.jacobian(
                y, watched, unconnected_gradients=request.unconnected, chunk_size=chunk_size
            )
            return [y, *(found[k] for k in keys)]

        y, *found = self._request_pass(
            (
                "jacobian",
                request.target,
                tuple(request.sources.items()),
                request.unconnected,
                batch,
                chunk_size,
            ),
            leaves,
            [],
            run,
            compiled,
        )
        assert y is not None
        if batch:  # the examples' independence, checked on every pass's rows
            for rows in found[len(keys) :]:
                if rows is not None:
                    check_per_example(rows, y)
        return y, dict(zip(keys, found[: len(keys)], strict=True))

    def _tall(self, request: Request, leaves: Mapping[str, Tensor]) -> bool:
        """A jacobian with more rows (the target's elements) than columns (the sources'):
        forward mode's passes then cost O(rows x columns) where reverse mode's cost
        O(rows^2) when the rows are examples of one batch (a per-example loss vector:
        each reverse row carries the whole batch)."""
        target = self.types.get(request.target)
        if target is None or any(not isinstance(d, int) for d in target.shape):
            return False
        rows = 1
        for d in target.shape:
            rows *= d
        columns = sum(leaves[name].size for name in request.sources.values())
        return rows > columns

    def _forward_jacobians(
        self,
        request: Request,
        leaves: Mapping[str, Tensor],
        chunk_size: int | None,
        compiled: bool,
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """jacobians() by forward mode (engine.transforms.forward_jacobian), for a tall
        jacobian; compiled as the reverse passes are (its unit tangents depend on the
        shapes alone)."""
        keys = list(request.sources)

        def run(leaves: dict[str, Tensor], _: list[Tensor]) -> list[Tensor | None]:
            sources = [leaves[name] for name in request.sources.values()]
            y, blocks = forward_jacobian(
                lambda: self.run(leaves, targets=[request.target])[request.target],
                sources,
                chunk_size,
                unconnected_gradients=request.unconnected,
            )
            return [y, *blocks]

        y, *found = self._request_pass(
            (
                "jacobian",
                request.target,
                tuple(request.sources.items()),
                request.unconnected,
                "forward",
                chunk_size,
            ),
            leaves,
            [],
            run,
            compiled,
        )
        assert y is not None
        return y, dict(zip(keys, found, strict=True))

    def request_passes(self) -> dict[Any, Any]:
        """This program's kept HVP and jacobian passes (kind, request, leaf and seed
        layouts -> its Schedule, or why it is not compiled yet), as gradient_passes."""
        return {k[1:]: v for k, v in list(_request_passes.entries.items()) if k[0] == self.key}

    def _request_pass(
        self,
        request_key: tuple,
        leaves: Mapping[str, Tensor],
        seeds: list[Tensor],
        run: Callable[[dict[str, Tensor], list[Tensor]], list[Tensor | None]],
        compiled: bool,
    ) -> list[Tensor | None]:
        """run(leaves, seeds)'s outputs, compiled per request, leaf layout and seed layout
        (the leaves and the seeds being the pass's inputs) in _request_passes."""
        names = sorted(leaves)
        arrays = [leaves[n].value for n in names]
        if not compiled or not all(
            type(a) is host.ndarray for a in (*arrays, *(s.value for s in seeds))
        ):
            return replay.run_dynamic(
                replay.why_dynamic(compiled), lambda: run(dict(leaves), list(seeds))
            )
        key = (
            self.key,
            *request_key,
            _leaf_layout(names, arrays),
            tuple((s.value.shape, s.value.strides, s.value.dtype.str) for s in seeds),
        )
        return _request_passes.run(
            key,
            [*(leaves[n] for n in names), *seeds],
            lambda fresh: run(dict(zip(names, fresh)), fresh[len(names) :]),
            lambda: replay.known_tensors(self),
        )

    def _hessian_vector_products(
        self,
        request: Request,
        leaves: dict[str, Tensor],
        vectors: list[Tensor],
        max_batch: int | None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        names = list(request.sources.values())
        f = self.function(request.target, names, leaves)
        # compiled=False: this operator answers one pass; the request's pass as a whole is
        # what hessian_vector_products compiles.
        operator = hessian_operator(
            f, *[leaves[n] for n in names], max_batch=max_batch, compiled=False
        )
        products = operator.hvp_many(*vectors)
        return operator.value, list(operator.grad), list(products)

    def _value_and_gradients(
        self, request: Request, leaves: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        watched = {key: leaves[name] for key, name in request.sources.items()}
        with GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(list(watched.values()))
            env = self.run(leaves, targets=[request.target])
        value = env[request.target]
        return value, tape.gradient(value, watched, unconnected_gradients=request.unconnected)

    def _needed(self, targets: Iterable[str] | None, given: Iterable[str] = ()) -> set[int]:
        """Indices of the lines the targets depend on (all lines when targets is None),
        not through the lines `given` (their values are supplied)."""
        if targets is None:
            return set(range(len(self._steps)))
        given = set(given)
        targets = [t for t in targets if t not in given]
        unknown = [t for t in targets if t not in self.types]
        if unknown:
            raise DefinitionError(
                [Problem(f"unknown target {t!r}", "target", kind="request") for t in unknown]
            )
        index = {name: i for i, name in enumerate(self.line_names)}
        needed: set[int] = set()
        stack = [t for t in targets if t in index]
        while stack:
            i = index[stack.pop()]
            if i not in needed:
                needed.add(i)
                stack.extend(
                    n for n in self._reads[self.line_names[i]] if n in index and n not in given
                )
        return needed

    def leaves_read(self, name: str) -> set[str]:
        """The variables and inputs `name` (a line or a leaf) depends on."""
        if name in self.leaf_info:
            return {name}
        lines = self._needed([name])
        return {n for i in lines for n in self._reads[self.line_names[i]] if n in self.leaf_info}

    def split(self, output: Any, target: str, sources: Mapping[str, str]) -> ModelSplit:
        """The program as model (the lines the `output` needs) and loss (the lines after
        it that the target needs), for the curvatures that factor through the output.
        DefinitionError naming each problem: the output is no line, or not floating, or
        the target does not use it, or a loss line reads a variable or a line of the
        model other than the output (the loss must be a function of the output and the
        inputs, its targets)."""
        problems: list[Problem] = []
        if not isinstance(output, str) or output not in self._line_numbers:
            names = list(self.line_names)
            hint = suggest(output, names) if isinstance(output, str) else ""
            what = "an input or variable" if output in self.leaf_info else "no line"
            problems.append(
                Problem(
                    f"output {output!r} is {what} of the program{hint}; name the line that "
                    "computes the model's output (the loss's lines follow it)",
                    "output",
                    kind="request",
                )
            )
            raise DefinitionError(problems)
        if self.types[output].dtype.kind != "f":
            problems.append(
                Problem(
                    f"output {output!r} is {self.types[output]}; the model's "
                    "output must be floating-point",
                    "output",
                    kind="dtype",
                )
            )
        model_lines = self._needed([output])
        # The loss's lines stop at the output and at every line of the model: a loss line
        # that reads one of those (other than the output) is refused below.
        model_names = {self.line_names[i] for i in model_lines}
        loss_lines = self._needed([target], given=model_names)
        index = {name: i for i, name in enumerate(self.line_names)}
        if output == target or output not in {
            n for i in loss_lines for n in self._reads[self.line_names[i]]
        }:
            problems.append(
                Problem(
                    f"the target {target!r} does not use the output {output!r}: the loss must be "
                    "computed from the model's output",
                    "output",
                    kind="request",
                )
            )
        targets: set[str] = set()
        source_names = set(sources.values())
        for i in sorted(loss_lines):
            name = self.line_names[i]
            for read in sorted(self._reads[name]):
                if read == output or (read in index and index[read] in loss_lines):
                    continue
                leaf = self.leaf_info.get(read)
                if leaf is not None and read not in source_names:
                    if leaf.role == "input":
                        targets.add(read)
                    continue  # a variable that is no source: held fixed
                what = "a source" if read in source_names else "a line of the model"
                problems.append(
                    Problem(
                        f"the loss line {name!r} reads {read!r}, {what}: with an output named, "
                        f"the lines after {output!r} must be a function of it and of inputs (the "
                        "targets) only; move the term into the model, or add a regulariser of "
                        "the sources as damping",
                        "program",
                        self._line_numbers[name],
                        self._line_columns[name],
                        kind="request",
                    )
                )
            # A model called again after the output reads its sources unnamed.
            by_model: dict[str, list[str]] = {}
            for param, model in self._model_reads[name].items():
                if param in source_names:
                    by_model.setdefault(model, []).append(param)
            for model, params in by_model.items():
                shown = ", ".join(params[:3]) + (
                    f" and {len(params) - 3} more" if len(params) > 3 else ""
                )
                problems.append(
                    Problem(
                        f"the loss line {name!r} calls model {model!r}, which reads sources "
                        f"({shown}): with an output named, the lines after {output!r} must be "
                        "a function of it and of inputs (the targets) only (the curvatures are "
                        "of a loss of that one output): name the output the loss reads, or "
                        "record without one for the Hessian",
                        "program",
                        self._line_numbers[name],
                        self._line_columns[name],
                        kind="request",
                    )
                )
        if problems:
            raise DefinitionError(problems)
        data = {
            n
            for i in model_lines
            for n in self._reads[self.line_names[i]]
            if n in self.leaf_info and n not in source_names
        }
        return ModelSplit(
            self,
            output,
            target,
            model_lines,
            loss_lines,
            tuple(sorted(data)),
            tuple(sorted(targets)),
        )

    def function(
        self, target: str, sources: list[str], leaves: Mapping[str, Tensor]
    ) -> Callable[..., Tensor]:
        """f(*source_values) -> the target, the other leaves held at `leaves`: for the
        engine's functional transforms (gt.hessian, gt.jacfwd, gt.hvp, ...)."""
        names = list(sources)

        def f(*values: Tensor) -> Tensor:
            env = dict(leaves)
            env.update(zip(names, values))
            return self.run(env, targets=[target])[target]

        return f

    def find_nonfinite(self, request: Request, leaves: Mapping[str, Tensor]) -> Problem:
        """Why the request's value or derivatives are not finite at these leaves: the op
        (line, column, name) where a NaN or an infinity first appears, forward or backward
        (see engine/language/nonfinite.py). Runs the program again; call it only then."""
        sources = [leaves[name] for name in request.sources.values()]
        found = find_culprit(
            lambda check: self.run(leaves, targets=[request.target], check=check),
            request.target,
            sources,
        )
        if found is not None:
            return found
        return Problem(
            "no op's value or first derivative is NaN or infinite at these values, so a "
            "second derivative is (or an input or variable itself is not finite)",
            "target",
            kind="nonfinite",
        )

    def hessian_operator(
        self, request: Request, leaves: Mapping[str, Tensor], memory_budget: int | None = None
    ) -> HessianOperator:
        """The forward pass and gradient of the request's target recorded once, for any
        number of HVPs over its sources (in the order of request.sources).

        With a memory budget (bytes), batched HVP passes are split to fit it, and a
        program that cannot fit even one HVP is refused (OverBudget) before it runs."""
        names = list(request.sources.values())
        f = self.function(request.target, names, leaves)
        max_batch = self.batch_within(memory_budget, "recording it and one HVP pass")
        return hessian_operator(f, *[leaves[n] for n in names], max_batch=max_batch)

    def batch_within(
        self, memory_budget: int | None, what: str, first_order: bool = False
    ) -> int | None:
        """The most items (HVP vectors, probes; with first_order, gradients or jacobian
        rows over the forward pass alone) one pass may batch within the budget; None
        without a budget. OverBudget when not even one fits."""
        if memory_budget is None:
            return None
        most = self.memory.max_batch(memory_budget, first_order)
        if most < 1:
            raise OverBudget([self.memory.refusal(memory_budget, what, first_order)])
        return most

    # Requests ---------------------------------------------------------------------------
    def batch_reduction(self, target: str, batch: Iterable[str] | None = None) -> str | None:
        """How `target` adds up over the batch ("mean", "sum"), where its line says it
        plainly; None otherwise (engine/language/reduction.py). `batch`: the inputs along
        the examples (default: every input)."""
        names = set(self.inputs if batch is None else batch)
        return batch_reduction(self._exprs, target, names)

    def check_request(
        self,
        target: Any,
        sources: Any = None,
        unconnected: Any = "none",
        allow_unused: bool = False,
    ) -> Request:
        """Check a target and sources against the program; all problems at once.

        sources: None (every trainable float variable), a name, a list of names, or a
        mapping alias -> name. A line the target does not use is an error unless
        allow_unused (a tape that will serve other targets later).
        """
        key = _request_key(target, sources, unconnected, allow_unused)
        checked = self._checked_requests.get(key) if key is not None else None
        if checked is None:
            checked = self._check_request(target, sources, unconnected, allow_unused)
            if key is not None:
                if len(self._checked_requests) >= CHECKED_REQUESTS:
                    self._checked_requests.clear()  # (a client's aliases are its own choice)
                self._checked_requests[key] = checked
        # A copy: its caller may change the sources it gets
        return Request(checked.target, dict(checked.sources), checked.unconnected)

    def _check_request(
        self, target: Any, sources: Any, unconnected: Any, allow_unused: bool
    ) -> Request:
        problems: list[Problem] = []
        if not isinstance(target, str) or target not in self.types:
            names = list(self.types)
            hint = suggest(target, names) if isinstance(target, str) else ""
            problems.append(Problem(f"unknown target {target!r}{hint}", "target", kind="request"))
        elif self.types[target].dtype.kind != "f":
            problems.append(
                Problem(
                    f"the target {target!r} is {self.types[target]}; only a floating-point "
                    "target has gradients",
                    "target",
                    kind="dtype",
                )
            )
        elif not allow_unused:
            problems.extend(self._unused(target))
        resolved = self._resolve_sources(sources, problems)
        if unconnected not in UNCONNECTED:
            problems.append(
                Problem(
                    f"unconnected must be 'none' or 'zero', got {unconnected!r}",
                    "unconnected",
                    kind="request",
                )
            )
        if problems:
            raise DefinitionError(problems)
        return Request(target, resolved, unconnected)

    def _unused(self, target: str) -> list[Problem]:
        needed = {self.line_names[i] for i in self._needed([target])}
        return [
            Problem(
                f"{name!r} is computed but the target {target!r} does not use it",
                "program",
                self._line_numbers[name],
                self._line_columns[name],
                kind="unused",
            )
            for name in self.line_names
            if name not in needed
        ]

    def _resolve_sources(self, sources: Any, problems: list[Problem]) -> dict[str, str]:
        if sources is None:
            return {name: name for name in self.trainable}
        if isinstance(sources, str):
            pairs = [(sources, sources)]
        elif isinstance(sources, Mapping):
            pairs = list(sources.items())
        elif isinstance(sources, (list, tuple)):
            pairs = [(s, s) for s in sources]
            repeated = sorted({s for s in sources if isinstance(s, str) and sources.count(s) > 1})
            for name in repeated:
                problems.append(
                    Problem(f"source {name!r} is listed twice", "sources", kind="request")
                )
        else:
            problems.append(
                Problem(
                    "sources must be a name, a list of names or a mapping alias -> name",
                    "sources",
                    kind="request",
                )
            )
            return {}
        resolved = {}
        for key, name in pairs:
            if not isinstance(key, str) or not isinstance(name, str):
                problems.append(
                    Problem(f"source {key!r}: names must be strings", "sources", kind="request")
                )
            elif name in self._line_numbers:
                problems.append(
                    Problem(
                        f"source {name!r} is computed by program line {self._line_numbers[name]}; "
                        "sources must be variables or inputs",
                        "sources",
                        kind="request",
                    )
                )
            elif name not in self.leaf_info:
                hint = suggest(name, list(self.leaf_info))
                problems.append(
                    Problem(f"unknown source {name!r}{hint}", "sources", kind="request")
                )
            elif self.leaf_info[name].type.dtype.kind != "f":
                problems.append(
                    Problem(
                        f"source {name!r} is {self.leaf_info[name].type}; only floating-point "
                        "sources have gradients",
                        "sources",
                        kind="dtype",
                    )
                )
            else:
                resolved[key] = name
        return resolved


@dataclass(frozen=True)
class ModelSplit:
    """A program cut at its output: `model(params, data)` runs the model's lines and
    `loss(output, targets)` the loss's (engine.curvature's two functions). params, data
    and targets are mappings name -> tensor; leaves none of them gives come from
    `fixed`. `data` names the leaves the model reads (sources aside), `targets` the
    inputs the loss reads."""

    program: CompiledProgram
    output: str
    target: str
    model_lines: set[int]
    loss_lines: set[int]
    data: tuple[str, ...]
    targets: tuple[str, ...]

    def functions(
        self, fixed: Mapping[str, Tensor], seen: dict[str, Tensor] | None = None
    ) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
        """`seen`, when given, receives every name's value of the model's last run (so
        a caller can tell which line an op of its recording belongs to)."""

        def model(params: Mapping[str, Tensor], data: Mapping[str, Tensor]) -> Tensor:
            env = dict(fixed)
            env.update(data)
            env.update(params)
            values = self.program._run_lines(env, self.model_lines)
            if seen is not None:
                seen.clear()
                seen.update(values)
            return values[self.output]

        def loss(output: Tensor, targets: Mapping[str, Tensor]) -> Tensor:
            env = dict(fixed)
            env.update(targets)
            env[self.output] = output
            return self.program._run_lines(env, self.loss_lines)[self.target]

        return model, loss


# ----------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------

_cache: OrderedDict[str, CompiledProgram] = OrderedDict()
_lock = threading.Lock()


def compile_definition(definition: Any, limits: Limits | None = None) -> CompiledProgram:
    """Parse, check and compile a definition (a Definition or its JSON-like mapping);
    raise DefinitionError listing every problem. Cached by the structure's hash."""
    defn = definition if isinstance(definition, Definition) else as_definition(definition)
    limits = limits or DEFAULT_LIMITS
    oversized = size_problems(defn, limits)
    if oversized:
        raise DefinitionError(oversized)
    key = structure_key(defn, limits)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    program = CompiledProgram(key, limits, check_definition(defn, limits))
    with _lock:
        _cache[key] = program
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return program


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def cache_size() -> int:
    return len(_cache)
