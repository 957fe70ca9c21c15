"""Lines of text -> a small expression tree, through an explicit whitelist of Python
syntax.

Each line is parsed by Python's `ast` module (to a syntax tree only: nothing is ever
compiled to code, evaluated or executed) and converted node by node into the classes
below. Any node type not handled here is refused with its line and column, so what a
program can express is exactly what this module builds.

Arithmetic between two number literals is folded here, in exact Python arithmetic with
bounds checked *before* computing (`10 ** 100` is refused without being computed).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Any

from engine import trace
from engine.language.errors import Problem
from engine.language.limits import Limits

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_EXACT_INT = 2**53  # the largest integer a float64 holds exactly

BINARY_OPS = {
    ast.Add: ("add", "+"),
    ast.Sub: ("subtract", "-"),
    ast.Mult: ("multiply", "*"),
    ast.Div: ("divide", "/"),
    ast.Pow: ("power", "**"),
    ast.MatMult: ("matmul", "@"),
}
COMPARE_OPS = {
    ast.Gt: ("greater", ">"),
    ast.GtE: ("greater_equal", ">="),
    ast.Lt: ("less", "<"),
    ast.LtE: ("less_equal", "<="),
    ast.Eq: ("equal", "=="),
    ast.NotEq: ("not_equal", "!="),
}

# Nodes that only mark an operator or a context: not counted as nesting.
MARKERS = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)

# Why a construct is refused, by node type; anything else gets a generic message.
REFUSED = {
    ast.Attribute: "attribute access ('.{attr}') is not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "generator expressions are not allowed",
    ast.JoinedStr: "f-strings are not allowed",
    ast.FormattedValue: "f-strings are not allowed",
    ast.Starred: "starred arguments (*x) are not allowed",
    ast.NamedExpr: "the walrus operator (:=) is not allowed",
    ast.BoolOp: "'and' / 'or' are not allowed; use logical_and / logical_or",
    ast.IfExp: "conditional expressions are not allowed; use where(condition, x, y)",
    ast.Dict: "dict literals are not allowed",
    ast.Set: "set literals are not allowed",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
    ast.Slice: "a slice is only allowed inside [ ]",
}
STATEMENTS = {
    ast.Import: "import is not allowed",
    ast.ImportFrom: "import is not allowed",
    ast.AugAssign: "augmented assignment (+= ...) is not allowed: each name is assigned once",
    ast.AnnAssign: "annotated assignment is not allowed; write name = expression",
    ast.Expr: "a line must assign its result to a name: name = expression",
}


# ----------------------------------------------------------------------------------------
# The expression tree
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Pos:
    line: int  # 1-based, within the section
    column: int  # 1-based


@dataclass(frozen=True, eq=False)
class Name:
    id: str
    pos: Pos


@dataclass(frozen=True, eq=False)
class Number:
    """A number literal (or a folded expression of them): a weakly typed scalar that
    takes the dtype of the tensor it meets, as in the engine."""

    value: int | float
    pos: Pos


@dataclass(frozen=True, eq=False)
class Constant:
    """A literal that is never a tensor: a string, True, False or None."""

    value: str | bool | None
    pos: Pos


@dataclass(frozen=True, eq=False)
class Sequence:
    """A tuple or list literal: axes, a shape, or the tensors of concatenate/stack."""

    items: tuple[Node, ...]
    pos: Pos


@dataclass(frozen=True, eq=False)
class Call:
    """An op, built-in or user function applied to arguments. Operators become calls of
    their ops (`a + b` is add(a, b)); `symbol` remembers the operator for messages."""

    func: str
    args: tuple[Node, ...]
    kwargs: tuple[tuple[str, Node], ...]
    pos: Pos
    symbol: str | None = None


@dataclass(frozen=True, eq=False)
class Subscript:
    """x[index] with a constant basic index: ints, slices, None and Ellipsis."""

    value: Node
    index: tuple[Any, ...]
    pos: Pos


Node = Name | Number | Constant | Sequence | Call | Subscript


@dataclass(frozen=True, eq=False)
class Line:
    target: str
    expr: Node
    number: int  # 1-based position in its section
    pos: Pos  # of the target name


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------


class _Refused(Exception):
    """Raised inside the converter for a construct outside the language."""

    def __init__(self, message: str, pos: Pos):
        super().__init__(message)
        self.message = message
        self.pos = pos


def parse_lines(
    lines: tuple[str, ...], section: str, limits: Limits
) -> tuple[list[Line | None], list[Problem], int]:
    """Parse every line; return one Line (or None for a blank or refused line) per
    entry, the problems found, and the number of syntax-tree nodes seen."""
    parsed: list[Line | None] = []
    problems: list[Problem] = []
    nodes = 0
    for number, text in enumerate(lines, start=1):
        trace.check_interrupt()  # a long program stops between two lines when cancelled
        line, line_problems, count = parse_line(text, number, section, limits)
        parsed.append(line)
        problems.extend(line_problems)
        nodes += count
    return parsed, problems, nodes


def parse_line(
    text: str, number: int, section: str, limits: Limits
) -> tuple[Line | None, list[Problem], int]:
    def problem(message: str, column: int | None = None, kind: str = "syntax") -> Problem:
        return Problem(message, section=section, line=number, column=column, kind=kind)

    if len(text) > limits.max_line_chars:
        msg = f"the line is {len(text)} characters long; the limit is {limits.max_line_chars}"
        return None, [problem(msg, kind="limit")], 0
    if "\n" in text or "\r" in text:
        return None, [problem("one line per entry: the text contains a line break")], 0
    try:
        tree = ast.parse(text, mode="exec")
    except SyntaxError as exc:
        return None, [problem(exc.msg, exc.offset)], 0
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:
        msg = f"cannot parse the line ({type(exc).__name__}: {exc})"
        return (
            None,
            [problem(msg, kind="limit" if isinstance(exc, RecursionError) else "syntax")],
            0,
        )
    count, depth, deepest = _measure(tree)
    if depth > limits.max_depth:
        col = getattr(deepest, "col_offset", -1) + 1 or None
        msg = f"the expression is nested {depth} deep; the limit is {limits.max_depth}"
        return None, [problem(msg, col, kind="limit")], count
    if not tree.body:  # blank or a comment
        return None, [], count
    if len(tree.body) > 1:
        return None, [problem("one assignment per line", tree.body[1].col_offset + 1)], count
    statement = tree.body[0]
    try:
        target, target_pos = _target(statement, number)
        assert isinstance(statement, ast.Assign)  # _target refused every other statement
        converter = _Converter(number)
        expr = converter.expr(statement.value)
    except _Refused as exc:
        return None, [problem(exc.message, exc.pos.column)], count
    if converter.problems:
        return None, [problem(m, p.column) for m, p in converter.problems], count
    return Line(target, expr, number, target_pos), [], count


def _measure(tree: ast.AST) -> tuple[int, int, ast.AST]:
    """Node count and nesting depth, without recursion (deep trees are the attack)."""
    count, max_depth, deepest = 0, 0, tree
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > max_depth:
            max_depth, deepest = depth, node
        stack.extend(
            (child, depth + 1)
            for child in ast.iter_child_nodes(node)
            if not isinstance(child, MARKERS)
        )
    # Module > Assign > expression: count the expression's own nesting.
    return count, max(0, max_depth - 2), deepest


def _target(statement: ast.stmt, number: int) -> tuple[str, Pos]:
    pos = Pos(number, statement.col_offset + 1)
    if type(statement) in STATEMENTS:
        raise _Refused(STATEMENTS[type(statement)], pos)
    if not isinstance(statement, ast.Assign):
        raise _Refused("only assignments 'name = expression' are allowed", pos)
    if len(statement.targets) != 1:
        raise _Refused("chained assignment (a = b = ...) is not allowed", pos)
    target = statement.targets[0]
    if isinstance(target, (ast.Tuple, ast.List)):
        raise _Refused("unpacking (a, b = ...) is not allowed; assign one name per line", pos)
    if not isinstance(target, ast.Name):
        raise _Refused("only a plain name can be assigned", pos)
    check_name(target.id, pos)
    return target.id, pos


def check_name(name: str, pos: Pos) -> None:
    if name.startswith("__"):
        raise _Refused(f"names starting with '__' are not allowed ({name!r})", pos)
    if not NAME_RE.fullmatch(name):
        raise _Refused(f"names must be ASCII letters, digits and '_' ({name!r})", pos)


class _Converter:
    """ast expression -> Node. Refusals inside arguments are collected, so one line can
    report several; a refusal at the top aborts the line."""

    def __init__(self, number: int):
        self.number = number
        self.problems: list[tuple[str, Pos]] = []

    def pos(self, node: ast.AST) -> Pos:
        return Pos(self.number, getattr(node, "col_offset", 0) + 1)

    def expr(self, node: ast.AST) -> Node:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            template = REFUSED.get(type(node), f"{type(node).__name__} is not allowed")
            raise _Refused(template.format(attr=getattr(node, "attr", "")), self.pos(node))
        return method(node)

    def _collect(self, node: ast.AST) -> Node | None:
        try:
            return self.expr(node)
        except _Refused as exc:
            self.problems.append((exc.message, exc.pos))
            return None

    # Leaves ------------------------------------------------------------------------------
    def _Name(self, node: ast.Name) -> Node:
        check_name(node.id, self.pos(node))
        return Name(node.id, self.pos(node))

    def _Constant(self, node: ast.Constant) -> Node:
        value, pos = node.value, self.pos(node)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return Constant(value, pos)
        if value is Ellipsis:
            raise _Refused("'...' is only allowed inside [ ]", pos)
        if isinstance(value, (int, float)):
            return Number(_checked(value, pos), pos)
        raise _Refused(f"{type(value).__name__} literals are not allowed", pos)

    def _Tuple(self, node: ast.Tuple | ast.List) -> Node:
        items = tuple(self._collect(e) for e in node.elts)
        return Sequence(tuple(i for i in items if i is not None), self.pos(node))

    _List = _Tuple

    # Operators ---------------------------------------------------------------------------
    def _UnaryOp(self, node: ast.UnaryOp) -> Node:
        pos = self.pos(node)
        if isinstance(node.op, ast.Not):
            raise _Refused("'not' is not allowed; use logical_not(x)", pos)
        if isinstance(node.op, ast.Invert):
            raise _Refused("'~' is not allowed; use logical_not(x)", pos)
        operand = self.expr(node.operand)
        if isinstance(node.op, ast.UAdd):
            return operand
        if isinstance(operand, Number):
            return Number(_checked(-operand.value, pos), pos)
        return Call("negative", (operand,), (), pos, symbol="-")

    def _BinOp(self, node: ast.BinOp) -> Node:
        pos = self.pos(node)
        if type(node.op) not in BINARY_OPS:
            symbol = {
                ast.FloorDiv: "//",
                ast.Mod: "%",
                ast.LShift: "<<",
                ast.RShift: ">>",
                ast.BitOr: "|",
                ast.BitAnd: "&",
                ast.BitXor: "^",
            }.get(type(node.op), "?")
            raise _Refused(f"operator {symbol} is not allowed", pos)
        op, symbol = BINARY_OPS[type(node.op)]
        left, right = self._collect(node.left), self._collect(node.right)
        if left is None or right is None:
            return Number(0, pos)  # placeholder; the line is refused anyway
        if isinstance(left, Number) and isinstance(right, Number):
            return Number(fold(symbol, left.value, right.value, pos), pos)
        return Call(op, (left, right), (), pos, symbol=symbol)

    def _Compare(self, node: ast.Compare) -> Node:
        pos = self.pos(node)
        if len(node.ops) != 1:
            raise _Refused("chained comparisons are not allowed; use logical_and", pos)
        if type(node.ops[0]) not in COMPARE_OPS:
            raise _Refused("only the comparisons > >= < <= == != are allowed", pos)
        op, symbol = COMPARE_OPS[type(node.ops[0])]
        left, right = self._collect(node.left), self._collect(node.comparators[0])
        if isinstance(left, Number) and isinstance(right, Number):
            raise _Refused("a comparison of two numbers is a constant; write the result", pos)
        if left is None or right is None:
            return Number(0, pos)
        return Call(op, (left, right), (), pos, symbol=symbol)

    # Calls and indexing ------------------------------------------------------------------
    def _Call(self, node: ast.Call) -> Node:
        pos = self.pos(node)
        if not isinstance(node.func, ast.Name):
            if isinstance(node.func, ast.Attribute):
                raise _Refused(f"attribute access ('.{node.func.attr}') is not allowed", pos)
            raise _Refused("only ops can be called, by name: op(x, ...)", pos)
        check_name(node.func.id, pos)
        args = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self.problems.append(("starred arguments (*x) are not allowed", self.pos(arg)))
            elif (converted := self._collect(arg)) is not None:
                args.append(converted)
        kwargs = []
        for kw in node.keywords:
            if kw.arg is None:
                self.problems.append(("'**' arguments are not allowed", self.pos(kw)))
            elif (converted := self._collect(kw.value)) is not None:
                kwargs.append((kw.arg, converted))
        return Call(node.func.id, tuple(args), tuple(kwargs), pos)

    def _Subscript(self, node: ast.Subscript) -> Node:
        value = self.expr(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        index = tuple(self._index_item(item) for item in items)
        return Subscript(value, index, self.pos(node))

    def _index_item(self, node: ast.AST) -> Any:
        pos = self.pos(node)
        if isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis):
            return node.value
        if isinstance(node, ast.Slice):
            bounds = (
                self._index_int(b) if b is not None else None
                for b in (node.lower, node.upper, node.step)
            )
            start, stop, step = bounds
            if step == 0:
                raise _Refused("slice step cannot be zero", pos)
            return slice(start, stop, step)
        return self._index_int(node)

    def _index_int(self, node: ast.AST) -> int:
        value = self.expr(node)
        if isinstance(value, Number) and isinstance(value.value, int):
            return value.value
        raise _Refused(
            "an index must be a constant int, slice, None or '...' (use take(x, indices, "
            "axis) to gather with a tensor)",
            self.pos(node),
        )


# ----------------------------------------------------------------------------------------
# Constant folding with bounds
# ----------------------------------------------------------------------------------------


def _checked(value: float, pos: Pos) -> int | float:
    if isinstance(value, int) and abs(value) > MAX_EXACT_INT:
        raise _Refused(f"the integer constant {_short(value)} is out of range (|n| <= 2**53)", pos)
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("the constant overflows to infinity", pos)
    return value


def _short(value: int) -> str:
    if value.bit_length() <= 64:
        return str(value)
    return f"of about {round(value.bit_length() * math.log10(2))} digits"


def fold(symbol: str, a: float, b: float, pos: Pos) -> int | float:
    """a <symbol> b for two number literals, refusing results out of range."""
    if symbol == "@":
        raise _Refused("'@' needs tensors, not numbers", pos)
    if symbol == "/" and b == 0:
        raise _Refused("division by zero in a constant expression", pos)
    if symbol == "**":
        if a == 0 and b < 0:
            raise _Refused("0 to a negative power in a constant expression", pos)
        if a < 0 and isinstance(b, float) and not b.is_integer():
            raise _Refused("a negative number to a fractional power is not real", pos)
        if abs(a) > 1 and b * math.log2(abs(a)) > 1024:  # too big for any dtype
            raise _Refused(f"the constant {a} ** {b} is out of range", pos)
    try:
        result = {
            "+": lambda: a + b,
            "-": lambda: a - b,
            "*": lambda: a * b,
            "/": lambda: a / b,
            "**": lambda: a**b,
        }[symbol]()
    except (OverflowError, ZeroDivisionError) as exc:
        raise _Refused(f"constant expression {a} {symbol} {b}: {exc}", pos) from None
    if isinstance(result, complex):
        raise _Refused("the constant expression is not real", pos)
    return _checked(result, pos)
