"""Checks a definition before anything runs, and collects *every* problem.

Names are resolved line by line (undefined, redefined, used before defined), calls are
bound to the catalogue (unknown ops, arity, keywords, constant arguments), and the
shape and dtype of every intermediate are inferred with each op's shape rule (registered
beside the op, engine/ops/), so a size limit can refuse a program without allocating
anything.

User functions are checked on their own (names and ops) and again at each call, with
the caller's argument types (shapes and dtypes). `grad(y, x)` calls are recorded as
`GradSite`s: the compiled program opens a tape for each right after x is defined.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import trace
from engine.language.catalogue import (
    SIGNATURES,
    Signature,
    bind,
    function_signature,
    suggest,
)
from engine.language.constants import ArgError
from engine.language.cost import model_step_costs
from engine.language.definition import Definition, FunctionDef
from engine.language.errors import DefinitionError, Problem
from engine.language.limits import Limits
from engine.language.parse import (
    NAME_RE,
    Call,
    Constant,
    Line,
    Name,
    Node,
    Number,
    Pos,
    Sequence,
    Subscript,
    parse_lines,
)
from engine.registry import public_ops
from engine.shapes import (
    RuleError,
    TensorType,
    check_positive,
    concrete,
    literal_type,
    require,
)

UPSTREAM = "upstream"  # the incoming gradient, in a function's backward program
GRAD_PREFIX = "grad_"  # the backward program assigns grad_<param>
TARGET_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)")


@dataclass(frozen=True)
class Leaf:
    name: str
    type: TensorType
    role: str  # "variable" or "input"
    trainable: bool = False


@dataclass(frozen=True)
class GradSite:
    """A grad(y, x) call: its tape opens before program line `opens_before` (0 for a
    variable or input) and closes at the call, on line `line_index`."""

    node: Call
    source: str
    opens_before: int
    line_index: int


@dataclass(frozen=True)
class CheckedFunction:
    """plain: no backward program (differentiated through). owned: the variables the
    function owns, as (the name in its body, the variable's name `<function>.<name>`)."""

    name: str
    params: tuple[str, ...]
    forward: tuple[Line, ...]
    backward: tuple[Line, ...]
    output: str
    plain: bool = False
    owned: tuple[tuple[str, str], ...] = ()


@dataclass
class CheckedProgram:
    """A definition that passed every check: what compile.py builds from."""

    leaves: dict[str, Leaf]
    lines: list[Line]  # the program's assignments, blank lines dropped
    types: dict[str, TensorType]  # every name: leaves and lines
    reads: dict[str, frozenset[str]]  # line target -> the names its expression reads
    grad_sites: list[GradSite]
    functions: dict[str, CheckedFunction]
    intermediates: list[Intermediate] = field(default_factory=list)  # every op's result
    # call -> (Specialization, the output it answers)
    model_calls: dict[Call, object] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)  # name -> definition.ModelDef


@dataclass(frozen=True)
class Intermediate:
    """One op's result as inference sized it: what a run holds in memory."""

    section: str
    line: int
    column: int
    op: str
    type: TensorType
    inputs: tuple[tuple[int, ...], ...] = ()  # the op's tensor arguments' shapes (cost.py)
    # The op whose cost this is, when `op` names something else (a model's node: the
    # language's name for its ONNX op, cost.py's ONNX_COSTS); None: `op` itself.
    work: str | None = None


@dataclass
class _Scope:
    """The names visible while checking one section, and where they came from."""

    section: str
    types: dict[str, TensorType | None]
    origins: dict[str, str]
    later: dict[str, int] = field(default_factory=dict)  # defined further down
    in_function: bool = False
    call_note: str = ""  # set while checking a function body for one call
    line_index: int = 0  # position of the current program line among the kept lines
    line_of: dict[str, int] = field(default_factory=dict)  # program name -> line index


def check_definition(defn: Definition, limits: Limits) -> CheckedProgram:
    """Every check, in one pass; raises DefinitionError with all the problems found."""
    return _Checker(defn, limits).run()


class _Checker:
    def __init__(self, defn: Definition, limits: Limits):
        self.defn = defn
        self.limits = limits
        self.problems: list[Problem] = []
        self.seen: set[tuple] = set()
        self.total_elements = 0
        self.intermediates: list[Intermediate] = []  # every op result sized, in order
        self.functions: dict[str, CheckedFunction] = {}
        self.function_types: dict[tuple, TensorType | None] = {}
        self.grad_sites: list[GradSite] = []
        self.model_calls: dict[Call, object] = {}
        self.owned = set(defn.model_params)  # variables named by a model's initializers
        self.leaves: dict[str, Leaf] = {}
        self.nodes = 0  # syntax nodes in the function bodies
        self.oversized = False  # one tensor over the limit already says it all

    # Reporting --------------------------------------------------------------------------
    def add(
        self,
        message: str,
        scope: _Scope | str,
        pos: Pos | None = None,
        kind: str = "name",
        op: str | None = None,
        shapes: tuple | None = None,
    ) -> None:
        section = scope if isinstance(scope, str) else scope.section
        key = (section, pos and pos.line, pos and pos.column, message)
        if key in self.seen:
            return
        self.seen.add(key)
        if isinstance(scope, _Scope) and scope.call_note:
            message += f" ({scope.call_note})"
        self.problems.append(
            Problem(
                message,
                section,
                pos.line if pos else None,
                pos.column if pos else None,
                op,
                shapes,
                kind,
            )
        )

    def fail_if_problems(self) -> None:
        if not self.problems:
            return
        problems = sorted(self.problems, key=_reading_order)
        cap = self.limits.max_problems
        if len(problems) > cap:
            rest = len(problems) - cap
            problems = problems[:cap] + [
                Problem(f"... and {rest} more problem(s)", "definition", kind="limit")
            ]
        raise DefinitionError(problems)

    # The pass ---------------------------------------------------------------------------
    def run(self) -> CheckedProgram:
        self.check_sizes()
        self.fail_if_problems()  # nothing below is safe on an oversized definition
        leaves = self.leaves = self.check_leaves()
        self.check_models()
        self.check_functions()
        lines, types, reads = self.check_program(leaves)
        if self.total_elements > self.limits.max_total_elements and not self.oversized:
            self.add(
                f"the intermediates would hold {self.total_elements} elements in all; the "
                f"limit is {self.limits.max_total_elements}",
                "program",
                kind="limit",
            )
        self.fail_if_problems()
        return CheckedProgram(
            leaves,
            lines,
            types,
            reads,
            self.grad_sites,
            self.functions,
            self.intermediates,
            self.model_calls,
            dict(self.defn.models),
        )

    def check_sizes(self) -> None:
        self.problems.extend(size_problems(self.defn, self.limits))

    def check_name(self, name: str, section: str, what: str) -> bool:
        if not NAME_RE.fullmatch(name) or name.startswith("__"):
            self.add(
                f"{what} name {name!r} must be ASCII letters, digits and '_', not "
                "starting with a digit or '__'",
                section,
            )
            return False
        if len(name) > self.limits.max_name_chars:
            self.add(
                f"{what} name is {len(name)} characters; the limit is {self.limits.max_name_chars}",
                section,
                kind="limit",
            )
            return False
        return True

    # Leaves -----------------------------------------------------------------------------
    def check_leaves(self) -> dict[str, Leaf]:
        leaves: dict[str, Leaf] = {}
        entries = [(n, v.value, "variable", v.trainable) for n, v in self.defn.variables.items()]
        entries += [(n, a, "input", False) for n, a in self.defn.inputs.items()]
        for name, value, role, trainable in entries:
            section = f"{role}s.{name}"
            owner, dot, local = name.partition(".")
            if name in self.owned and role == "variable":
                # ONNX names ("fc1.weight", "onnx::MatMul_7") are never written in a
                # program; they are only request keys, so only their length is bounded.
                if len(name) > self.limits.max_name_chars:
                    self.add(
                        f"variable name is {len(name)} characters; the limit is "
                        f"{self.limits.max_name_chars}",
                        section,
                        kind="limit",
                    )
                    continue
            elif dot and role == "variable":
                # A function's own variable, `<function>.<name>` (as tf.Module's
                # `critic/w1`, flax's params["critic"]["w1"]): `name` in its body only.
                if not (
                    self.check_name(owner, section, "function")
                    and self.check_name(local, section, "variable")
                ):
                    continue
                if owner not in self.defn.functions:
                    hint = suggest(owner, list(self.defn.functions))
                    self.add(
                        "a dotted variable belongs to the function before the dot, and "
                        f"no function is named {owner!r}{hint}",
                        section,
                    )
                    continue
            elif not self.check_name(name, section, role):
                continue
            if name in leaves:
                self.add(f"{name!r} is both a variable and an input", section)
                continue
            leaf_type = TensorType(tuple(int(d) for d in value.shape), value.dtype)
            if leaf_type.ndim > self.limits.max_rank:
                self.add(
                    f"rank {leaf_type.ndim}; the limit is {self.limits.max_rank}",
                    section,
                    kind="limit",
                    shapes=(leaf_type.shape,),
                )
            if leaf_type.size > self.limits.max_elements:
                self.add(
                    f"{leaf_type.size} elements; the limit is {self.limits.max_elements}",
                    section,
                    kind="limit",
                    shapes=(leaf_type.shape,),
                )
            leaves[name] = Leaf(name, leaf_type, role, trainable)
        return leaves

    # Models -----------------------------------------------------------------------------
    def check_models(self) -> None:
        for name in self.defn.models:
            section = f"models.{name}"
            if not self.check_name(name, section, "model"):
                continue
            if name in SIGNATURES or name in self.defn.functions:
                self.add(
                    f"model name {name!r} is already an op or a function; choose another", section
                )

    def model_call(self, node: Call, scope: _Scope) -> TensorType | None:
        """A call of an imported model: its outputs' types from ONNX shape inference for
        the arguments' shapes (the model is specialized, and its shape subgraphs folded,
        once per call signature)."""
        from engine.onnx import ModelError

        model = self.defn.models[node.func].model
        usage = f"{node.func}({', '.join(i.name for i in model.inputs)}"
        unknown = [k for k, _ in node.kwargs if k != "output"]
        if scope.in_function or unknown:
            self.infer_all(node, scope)
            why = (
                "a function body cannot call a model"
                if scope.in_function
                else f"a model takes its inputs by position and one keyword, output: {usage})"
            )
            self.add(why, scope, node.pos, "op", node.func)
            return None
        inferred = [self.infer(arg, scope) for arg in node.args]
        if any(t is None for t in inferred):
            return None
        types = [concrete(t) for t in inferred if t is not None]
        try:
            spec = model.specialize(
                [(t.shape, t.dtype) for t in types], max_elements=self.limits.max_elements
            )
        except ModelError as exc:
            for p in exc.problems:
                kind = "shape" if p.kind == "shape" else "model"
                self.add(str(p), scope, node.pos, kind, node.func, tuple(t.shape for t in types))
            return None
        index = self.model_output(node, model, usage, scope)
        if index is None:
            return None
        self.model_calls[node] = (spec, index)
        # The graph's intermediates count as ops do, memory and cost (its MatMuls' FLOPs).
        work = model_step_costs(model, spec, [t.shape for t in types])
        for name, shape, dtype in spec.sizes:
            self.total_elements += math.prod(shape)
            op, operands = work.get(name, (None, ()))
            self.intermediates.append(
                Intermediate(
                    scope.section,
                    node.pos.line,
                    node.pos.column,
                    node.func,
                    TensorType(tuple(shape), dtype),
                    operands,
                    op,
                )
            )
        shape, dtype = spec.outputs[index]
        return self.sized(TensorType(tuple(shape), np.dtype(dtype)), node, scope, node.func)

    def model_output(self, node: Call, model: Any, usage: str, scope: _Scope) -> int | None:
        """Which of the model's outputs a call answers: its only one, or the one named
        (or numbered from 0) by `output=`."""
        names = model.outputs
        listed = ", ".join(repr(n) for n in names)
        chosen = dict(node.kwargs).get("output")
        if chosen is None:
            if len(names) == 1:
                return 0
            self.add(
                f"the model has {len(names)} outputs ({listed}); choose one with output=, "
                f"e.g. {usage}, output={names[0]!r})",
                scope,
                node.pos,
                "op",
                node.func,
            )
            return None
        if isinstance(chosen, Constant) and isinstance(chosen.value, str) and chosen.value in names:
            return names.index(chosen.value)
        if (
            isinstance(chosen, Number)
            and isinstance(chosen.value, int)
            and 0 <= chosen.value < len(names)
        ):
            return chosen.value
        self.add(
            f"output= must name one of the model's outputs ({listed}) or give its position "
            f"(0 to {len(names) - 1})",
            scope,
            chosen.pos,
            "op",
            node.func,
        )
        return None

    # Functions --------------------------------------------------------------------------
    def check_functions(self) -> None:
        nodes = 0
        parsed: dict[str, tuple[list, list, bool, bool]] = {}
        for name, fn in self.defn.functions.items():
            section = f"functions.{name}"
            if not self.check_name(name, section, "function"):
                continue
            if name in SIGNATURES:
                self.add(f"function name {name!r} is already an op; choose another", section)
                continue
            params_ok = True
            for p in fn.params:
                params_ok &= self.check_name(p, section + ".params", "parameter")
                if p == UPSTREAM:
                    self.add(
                        f"{UPSTREAM!r} is reserved for the incoming gradient", section + ".params"
                    )
                    params_ok = False
            if len(set(fn.params)) != len(fn.params):
                self.add("a parameter is listed twice", section + ".params")
                params_ok = False
            forward, problems, count = parse_lines(fn.forward, section + ".forward", self.limits)
            backward, more, count2 = parse_lines(
                fn.backward or (), section + ".backward", self.limits
            )
            nodes += count + count2
            self.problems.extend(problems + more)
            parsed[name] = (forward, backward, params_ok, not problems and not more)
        self.nodes = nodes
        recursive = self.check_recursion(
            {
                name: [line for lines in body[:2] for line in lines if line is not None]
                for name, body in parsed.items()
            }
        )
        for name, (forward, backward, params_ok, clean) in parsed.items():
            fn = self.defn.functions[name]
            if not params_ok:
                continue
            checked = self.check_function_body(name, fn, forward, backward)
            if checked is not None and clean and name not in recursive:
                self.functions[name] = checked  # only a clean function is checked per call

    def check_recursion(self, bodies: dict[str, list[Line]]) -> set[str]:
        """Functions may call functions, but not themselves through any chain: report each
        cycle once, naming it; return the functions on one."""
        calls = {
            name: sorted({c for line in lines for c in calls_made(line.expr) if c in bodies})
            for name, lines in bodies.items()
        }
        on_cycle: set[str] = set()
        state: dict[str, int] = {}  # 1: on the current path, 2: done

        def visit(name: str, path: list[str]) -> None:
            state[name] = 1
            path.append(name)
            for callee in calls[name]:
                if state.get(callee) == 1:
                    cycle = path[path.index(callee) :] + [callee]
                    on_cycle.update(cycle)
                    self.add(
                        f"recursion: {' -> '.join(cycle)}; a function may call other "
                        "functions but never itself, directly or through others",
                        f"functions.{callee}",
                        kind="op",
                    )
                elif callee not in state:
                    visit(callee, path)  # noqa: F821 (ruff reads the `del visit` below as unbinding it here)
            path.pop()
            state[name] = 2

        for name in calls:
            if name not in state:
                visit(name, [])
        # `visit` refers to itself through its cell: a cycle that would keep this checker,
        # and the definition's arrays with it, alive until the garbage collector runs (the
        # service's workers receive those arrays as views of shared memory they must give
        # back). Emptying the cell breaks it.
        del visit
        return on_cycle

    def check_function_body(
        self,
        name: str,
        fn: FunctionDef,
        forward: list[Line | None],
        backward: list[Line | None],
    ) -> CheckedFunction | None:
        """Names and ops of both programs, with the parameters' types unknown."""
        fwd = tuple(line for line in forward if line is not None)
        bwd = tuple(line for line in backward if line is not None)
        output = fn.output or (fwd[-1].target if fwd else None)
        section = f"functions.{name}"
        if output is None:
            self.add("the forward program is empty and no output is named", section)
            return None
        prefix = name + "."
        owned = tuple(
            (leaf[len(prefix) :], leaf) for leaf in self.leaves if leaf.startswith(prefix)
        )
        if owned and not fn.plain:
            self.add(
                f"a function with a backward program takes its variables as parameters "
                f"({', '.join(leaf for _, leaf in owned)} belong to it)",
                section,
            )
            return None
        for local, leaf in owned:
            if local in fn.params:
                self.add(
                    f"{local!r} is both a parameter and the function's own variable {leaf!r}",
                    section + ".params",
                )
                return None
        checked = CheckedFunction(name, fn.params, fwd, bwd, output, fn.plain, owned)
        before = len(self.problems)
        refused = (
            recovered_targets(fn.forward, forward),
            recovered_targets(fn.backward or (), backward),
        )
        self.run_function(checked, dict.fromkeys(fn.params), note="", refused=refused)
        if output not in fn.params and output not in {line.target for line in fwd}:
            self.add(f"the output {output!r} is not assigned by the forward program", section)
        return checked if len(self.problems) == before else None

    def run_function(
        self,
        fn: CheckedFunction,
        params: dict[str, TensorType | None],
        note: str,
        refused: tuple[set[str], set[str]] = (set(), set()),
    ) -> TensorType | None:
        """Check the forward and backward programs with these parameter types; return
        the output's type (None when unknown). `refused`: names assigned by lines that
        did not parse, known to exist with an unknown type."""
        base = f"functions.{fn.name}"
        origins = dict.fromkeys(fn.params, "a parameter")
        types = dict(params)
        for local, leaf in fn.owned:
            types[local] = self.leaves[leaf].type
            origins[local] = f"the function's variable {leaf!r}"
        forward = _Scope(base + ".forward", types, dict(origins), in_function=True, call_note=note)
        forward.later.update(dict.fromkeys(refused[0], -1))
        self.check_lines(fn.forward, forward)
        forward.types.update({n: None for n in refused[0] if n not in forward.types})
        out = forward.types.get(fn.output)
        if fn.plain:
            return out
        backward = _Scope(
            base + ".backward",
            dict(forward.types),
            dict(forward.origins),
            in_function=True,
            call_note=note,
        )
        if UPSTREAM in backward.types:
            self.add(f"{UPSTREAM!r} is reserved for the incoming gradient", forward)
        backward.types[UPSTREAM] = out
        backward.origins[UPSTREAM] = "the incoming gradient"
        backward.later.update(dict.fromkeys(refused[1], -1))
        self.check_lines(fn.backward, backward)
        assigned = {line.target for line in fn.backward} | refused[1]
        for p, t in params.items():
            gname = GRAD_PREFIX + p
            if t is None or t.dtype.kind != "f":
                continue
            if gname not in assigned:
                self.add(
                    f"the backward program must assign {gname} (the gradient for {p})", backward
                )
                continue
            g = backward.types.get(gname)
            if g is not None and (g.shape != t.shape or g.dtype != t.dtype):
                self.add(
                    f"{gname} is {g} but {p} is {t}",
                    backward,
                    kind="shape",
                    shapes=(g.shape, t.shape),
                )
        return out

    # The program ------------------------------------------------------------------------
    def check_program(self, leaves: dict[str, Leaf]) -> tuple:
        parsed, problems, nodes = parse_lines(self.defn.program, "program", self.limits)
        self.problems.extend(problems)
        nodes += self.nodes
        if nodes > self.limits.max_nodes:
            self.add(
                f"the definition has {nodes} syntax nodes; the limit is {self.limits.max_nodes}",
                "program",
                kind="limit",
            )
        scope = _Scope(
            "program",
            {n: leaf.type for n, leaf in leaves.items()},
            {
                n: f"a{'n' if leaf.role == 'input' else ''} {leaf.role}"
                for n, leaf in leaves.items()
            },
        )
        # Names of refused lines still count as defined, so one typo reports once.
        scope.later.update(dict.fromkeys(recovered_targets(self.defn.program, parsed), -1))
        lines = [line for line in parsed if line is not None]
        reads = {line.target: frozenset(names_read(line.expr)) for line in lines}
        self.check_lines(lines, scope)
        for name, number in scope.later.items():
            if number == -1 and name not in scope.types:  # a refused line: unknown type
                scope.types[name] = None
        types = {n: t for n, t in scope.types.items() if t is not None}
        return lines, types, reads

    def check_lines(self, lines: tuple[Line, ...] | list[Line], scope: _Scope) -> None:
        for line in lines:
            if line.target not in scope.types:
                scope.later.setdefault(line.target, line.number)
        orders: dict[str, int] = {}
        for index, line in enumerate(lines):
            trace.check_interrupt()  # a long program stops between two lines when cancelled
            scope.line_index = index
            out = self.infer(line.expr, scope)
            if line.target in scope.types:
                self.add(
                    f"{line.target!r} is already defined "
                    f"({scope.origins.get(line.target, 'above')}); each name is assigned "
                    "once",
                    scope,
                    line.pos,
                )
                continue
            if not scope.in_function:
                order = self.grad_order(line.expr, orders, scope)
                orders[line.target] = order
            scope.types[line.target] = None if out is None else concrete(out)
            scope.origins[line.target] = f"line {line.number}"
            scope.line_of[line.target] = index
            scope.later.pop(line.target, None)

    # Inference --------------------------------------------------------------------------
    def infer(self, node: Node, scope: _Scope) -> TensorType | None:
        if isinstance(node, Name):
            return self.lookup(node, scope)
        if isinstance(node, Number):
            return literal_type(node.value)
        if isinstance(node, Subscript):
            value = self.infer(node.value, scope)
            if value is None:
                return None
            try:
                rule = public_ops["getitem"].shape_rule
                assert rule is not None  # every public op has one (tests/engine/test_ops.py)
                out = rule({"x": value, "index": node.index})
            except RuleError as exc:
                self.add(exc.message, scope, node.pos, exc.kind, "getitem", (value.shape,))
                return None
            return self.sized(out, node, scope, "getitem")
        if isinstance(node, Call):
            return self.call(node, scope)
        what = "a tuple or list" if isinstance(node, Sequence) else repr(node.value)
        self.add(
            f"{what} is not a tensor; it can only be a constant argument such as axis=(0, 1)",
            scope,
            node.pos,
            "syntax",
        )
        return None

    def lookup(self, node: Name, scope: _Scope) -> TensorType | None:
        if node.id in scope.types:
            return scope.types[node.id]
        if node.id in scope.later:
            if scope.later[node.id] != -1:
                self.add(
                    f"{node.id!r} is used before it is defined (line {scope.later[node.id]})",
                    scope,
                    node.pos,
                )
        elif node.id in SIGNATURES or node.id in self.defn.functions or node.id in self.defn.models:
            self.add(f"{node.id!r} is an op; call it: {node.id}(...)", scope, node.pos)
        else:
            hint = suggest(node.id, list(scope.types))
            self.add(f"undefined name {node.id!r}{hint}", scope, node.pos)
        return None

    def sized(
        self,
        out: TensorType,
        node: Node,
        scope: _Scope,
        op: str,
        inputs: tuple[tuple[int, ...], ...] = (),
    ) -> TensorType:
        """Count an intermediate against the limits."""
        self.total_elements += out.size
        self.intermediates.append(
            Intermediate(scope.section, node.pos.line, node.pos.column, op, out, inputs)
        )
        if out.size > self.limits.max_elements:
            self.oversized = True
            self.add(
                f"the result would have {out.size} elements (shape {out.shape}); the "
                f"limit is {self.limits.max_elements}",
                scope,
                node.pos,
                "limit",
                op,
                (out.shape,),
            )
        if out.ndim > self.limits.max_rank:
            self.add(
                f"the result would have rank {out.ndim}; the limit is {self.limits.max_rank}",
                scope,
                node.pos,
                "limit",
                op,
                (out.shape,),
            )
        return out

    def call(self, node: Call, scope: _Scope) -> TensorType | None:
        if node.func == "grad":
            return self.grad(node, scope)
        if node.func in self.defn.models:
            return self.model_call(node, scope)
        if node.func in self.defn.functions:
            return self.user_call(node, scope)
        sig = SIGNATURES.get(node.func)
        if sig is None:
            self.infer_all(node, scope)  # problems inside the arguments still count
            known = list(SIGNATURES) + list(self.defn.functions) + list(self.defn.models)
            hint = suggest(node.func, known)
            self.add(f"unknown op {node.func!r}{hint}", scope, node.pos, "op", node.func)
            return None
        types = self.bind_and_infer(sig, node, scope)
        if types is None:
            return None
        values, shapes = types
        op = public_ops.get(node.func)
        try:
            if op is None:  # a built-in (grad has its own path above)
                out = _clip_grad_norm_rule(values)
            else:
                assert op.shape_rule is not None  # every public op has one (test_ops.py)
                out = op.shape_rule(values)
        except RuleError as exc:
            self.add(exc.message, scope, node.pos, exc.kind, node.func, shapes)
            return None
        if op is not None and op.workspace is not None:
            need = op.workspace(values, out)
            if need > self.limits.max_elements:
                self.add(
                    f"its gradient needs {need} elements of workspace; the limit is "
                    f"{self.limits.max_elements}",
                    scope,
                    node.pos,
                    "limit",
                    node.func,
                    shapes,
                )
        return self.sized(out, node, scope, node.func, shapes)

    def infer_all(self, node: Call, scope: _Scope) -> None:
        for arg in (*node.args, *(value for _, value in node.kwargs)):
            if not isinstance(arg, (Constant, Sequence)):
                self.infer(arg, scope)

    def bind_and_infer(
        self, sig: Signature, node: Call, scope: _Scope
    ) -> tuple[dict, tuple] | None:
        """The rule's arguments (constants and the tensors' types) and the tensors'
        shapes; None when a problem was reported or a type is unknown."""
        try:
            bound = bind(sig, node)
        except ArgError as exc:
            self.infer_all(node, scope)
            self.add(exc.message, scope, node.pos, "op", node.func)
            return None
        values = dict(bound.constants)
        shapes: list[tuple[int, ...]] = []
        known = True
        for name, arg in bound.tensors.items():
            if arg is None:
                values[name] = None
            elif isinstance(arg, list):
                types = [self.infer(a, scope) for a in arg]
                known &= all(t is not None for t in types)
                values[name] = types
                shapes.extend(t.shape for t in types if t is not None)
            else:
                t = self.infer(arg, scope)
                known &= t is not None
                values[name] = t
                if t is not None:
                    shapes.append(t.shape)
        return (values, tuple(shapes)) if known else None

    def grad(self, node: Call, scope: _Scope) -> TensorType | None:
        if scope.in_function:
            self.infer_all(node, scope)
            self.add("grad is not allowed inside a function body", scope, node.pos, "op", "grad")
            return None
        source = node.args[1] if len(node.args) == 2 else None
        if not isinstance(source, Name) or node.kwargs:
            self.infer_all(node, scope)
            self.add(
                "grad takes two arguments, grad(y, x), where x is a name (a variable, an "
                "input or an earlier line)",
                scope,
                node.pos,
                "op",
                "grad",
            )
            return None
        y, x = self.infer(node.args[0], scope), self.infer(source, scope)
        if y is None or x is None:
            return None
        try:
            require(concrete(y), "float", "the differentiated expression")
            require(x, "float", f"the source {source.id!r}")
        except RuleError as exc:
            self.add(exc.message, scope, node.pos, exc.kind, "grad", (y.shape, x.shape))
            return None
        line = scope.line_of.get(source.id)
        opens = 0 if line is None else line + 1
        self.grad_sites.append(GradSite(node, source.id, opens, scope.line_index))
        return self.sized(x, node, scope, "grad")

    def grad_order(self, node: Node, orders: dict[str, int], scope: _Scope) -> int:
        """How many grads are nested in this expression, through names too."""
        if isinstance(node, Name):
            return orders.get(node.id, 0)
        if isinstance(node, Subscript):
            return self.grad_order(node.value, orders, scope)
        if not isinstance(node, Call):
            return 0
        inner = max((self.grad_order(a, orders, scope) for a in call_args(node)), default=0)
        if node.func != "grad":
            return inner
        order = inner + 1
        if order > self.limits.max_grad_depth:
            self.add(
                f"nested {order} deep; the limit is {self.limits.max_grad_depth}",
                scope,
                node.pos,
                "limit",
                "grad",
            )
        return order

    def user_call(self, node: Call, scope: _Scope) -> TensorType | None:
        fn = self.functions.get(node.func)
        sig = function_signature(node.func, self.defn.functions[node.func])
        types = self.bind_and_infer(sig, node, scope)
        if types is None or fn is None:  # fn is None: its body has problems of its own
            return None
        values, _ = types
        concrete_params = {p: concrete(values[p]) for p in fn.params}
        key = (fn.name, tuple((t.shape, t.dtype) for t in concrete_params.values()))
        params: dict[str, TensorType | None] = dict(concrete_params)
        if key not in self.function_types:
            where = scope.section.replace("functions.", "function ").replace(".", " ")
            note = (
                f"when called from {'program' if where == 'program' else where} line "
                f"{node.pos.line}"
            )
            self.function_types[key] = self.run_function(fn, params, note)
        out = self.function_types[key]
        return None if out is None else self.sized(out, node, scope, fn.name)


def recovered_targets(texts: tuple[str, ...], parsed: list[Line | None]) -> set[str]:
    """The names that refused lines seem to assign (`name = ...`)."""
    return {
        match.group(1)
        for text, line in zip(texts, parsed)
        if line is None and (match := TARGET_RE.match(text))
    }


def size_problems(defn: Definition, limits: Limits) -> list[Problem]:
    """The limits that are checked before anything else (even before hashing)."""
    problems = []
    bodies = [f.forward + (f.backward or ()) for f in defn.functions.values()]
    lines = len(defn.program) + sum(len(b) for b in bodies)
    if lines > limits.max_lines:
        problems.append(
            Problem(
                f"the definition has {lines} lines; the limit is {limits.max_lines}",
                "program",
                kind="limit",
            )
        )
    chars = sum(len(t) for t in defn.program) + sum(len(t) for b in bodies for t in b)
    if chars > limits.max_text_chars:
        problems.append(
            Problem(
                f"the program text is {chars} characters; the limit is {limits.max_text_chars}",
                "program",
                kind="limit",
            )
        )
    if len(defn.functions) > limits.max_functions:
        problems.append(
            Problem(
                f"{len(defn.functions)} functions; the limit is {limits.max_functions}",
                "functions",
                kind="limit",
            )
        )
    return problems


SECTION_ORDER = ("definition", "variables", "inputs", "functions", "program")


def _reading_order(p: Problem) -> tuple:
    """Problems sorted as a reader meets them: section, line, column (a stable sort)."""
    parts = p.section.split(".")
    rank = SECTION_ORDER.index(parts[0]) if parts[0] in SECTION_ORDER else len(SECTION_ORDER)
    if parts[0] != "functions":
        return (rank, "", 0, p.line or 0, p.column or 0)
    part = parts[2] if len(parts) > 2 else ""
    within = ("", "params", "output", "forward", "backward")
    order = within.index(part) if part in within else len(within)
    return (rank, parts[1] if len(parts) > 1 else "", order, p.line or 0, p.column or 0)


def _clip_grad_norm_rule(values: dict) -> TensorType:
    x = concrete(values["x"])
    require(x, "float")
    check_positive("max_norm", values["max_norm"])
    return x


def call_args(node: Call) -> Iterator[Node]:
    yield from node.args
    for _, value in node.kwargs:
        yield value


def calls_made(node: Node) -> Iterator[str]:
    """The ops and functions an expression calls."""
    if isinstance(node, Subscript):
        yield from calls_made(node.value)
    elif isinstance(node, Sequence):
        for item in node.items:
            yield from calls_made(item)
    elif isinstance(node, Call):
        yield node.func
        for arg in call_args(node):
            yield from calls_made(arg)


def names_read(node: Node) -> Iterator[str]:
    if isinstance(node, Name):
        yield node.id
    elif isinstance(node, Subscript):
        yield from names_read(node.value)
    elif isinstance(node, Sequence):
        for item in node.items:
            yield from names_read(item)
    elif isinstance(node, Call):
        for arg in call_args(node):
            yield from names_read(arg)
