"""How a program's target adds up over the examples of its batch, read from the program
text: a sharded tape needs it to combine its parts (`mean`: weighted by their share of
the rows; `sum`: added). Read only where the program says it plainly, never guessed: the
target's line (or the line it names) is one reduction over every element, `sum(...)` or
`mean(...)` with no axis of an expression in which nothing reduces over the first axis
(no reduction or loss op, but over axes >= 1), or a loss op with its `reduction` ("mean"
by default), possibly negated or scaled by a number. Anything else (a sum of terms, a
reduction over an axis, `reduction="none"`) reads as unknown, and the caller asks the
client."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from engine.language.parse import Call, Constant, Name, Node, Number, Sequence
from engine.registry import REQUIRED, public_ops

REDUCTIONS = ("mean", "sum")


def _argument(call: Call, name: str) -> Node | str | None:
    """The node given for parameter `name` of a public op (by keyword or position), None
    when absent, or "?" when the op takes no such parameter."""
    info = public_ops.get(call.func)
    if info is None:
        return "?"
    names = [p.name for p in info.params]
    if name not in names:
        return "?"
    given = dict(call.kwargs)
    if name in given:
        return given[name]
    at = names.index(name)
    return call.args[at] if at < len(call.args) else None


def _default(op: str, name: str) -> object:
    for p in public_ops[op].params:
        if p.name == name:
            return p.default
    return REQUIRED


def _keeps_first_axis(call: Call) -> bool:
    """A reduction (or loss) op whose axes are all constants >= 1."""
    axis = _argument(call, "axis")
    if axis is None or axis == "?":
        axis = _argument(call, "axes")
    if isinstance(axis, Number):
        return isinstance(axis.value, int) and axis.value >= 1
    if isinstance(axis, Sequence):
        return all(
            isinstance(a, Number) and isinstance(a.value, int) and a.value >= 1 for a in axis.items
        )
    return False


def _per_example(node: Node, lines: Mapping[str, Node], seen: set[str]) -> bool:
    """Nothing in `node` (following the lines it reads) reduces over the first axis."""
    if isinstance(node, Name):
        if node.id in seen or node.id not in lines:
            return True  # a leaf (variable, input), or a line already checked
        seen.add(node.id)
        return _per_example(lines[node.id], lines, seen)
    if isinstance(node, Sequence):
        return all(_per_example(item, lines, seen) for item in node.items)
    if isinstance(node, Call):
        info = public_ops.get(node.func)
        if info is not None and info.family == "loss":
            given = _argument(node, "reduction")
            if not (isinstance(given, Constant) and given.value == "none"):
                return False  # a loss reduced over the examples
        elif info is not None and info.family == "reduction" and not _keeps_first_axis(node):
            return False
        return all(_per_example(a, lines, seen) for a in node.args) and all(
            _per_example(v, lines, seen) for _, v in node.kwargs
        )
    return True


def _reads_any(node: Node, lines: Mapping[str, Node], names: AbstractSet[str]) -> bool:
    """Whether `node` reads (through the lines it names) one of `names`."""
    if isinstance(node, Name):
        if node.id in names:
            return True
        return node.id in lines and _reads_any(lines[node.id], lines, names)
    if isinstance(node, Sequence):
        return any(_reads_any(item, lines, names) for item in node.items)
    if isinstance(node, Call):
        return any(_reads_any(a, lines, names) for a in node.args) or any(
            _reads_any(v, lines, names) for _, v in node.kwargs
        )
    return False


def batch_reduction(
    lines: Mapping[str, Node], target: str, batch: AbstractSet[str] = frozenset()
) -> str | None:
    """The target's reduction over the batch, "mean" or "sum", when its line says it
    plainly (see the module), else None. `lines` maps each line's name to its expression;
    `batch` names the inputs along the examples: a term of a sum that reads none of them
    (a weight penalty) adds the same to every part's mean, so `mean(...) + 0.01 *
    sum(w ** 2)` is a mean (with a sum it would count once per part: unknown)."""
    seen: set[str] = set()

    def read(node: Node) -> str | None:
        if isinstance(node, Name):
            if node.id in seen or node.id not in lines:
                return None
            seen.add(node.id)
            return read(lines[node.id])
        if not isinstance(node, Call):
            return None
        if node.func in ("sum", "mean"):
            axis = _argument(node, "axis")
            whole = axis is None or (isinstance(axis, Constant) and axis.value is None)
            if whole and len(node.args) == 1 and _per_example(node.args[0], lines, set()):
                return node.func
            return None
        if node.func == "negative" and len(node.args) == 1:
            return read(node.args[0])
        if node.func in ("add", "subtract") and len(node.args) == 2 and batch:
            terms = [a for a in node.args if _reads_any(a, lines, batch)]
            found = {read(a) for a in terms}
            if len(terms) == 0 or len(found) != 1:
                return None
            (only,) = found
            free = len(terms) < len(node.args)
            return None if only == "sum" and free else only
        if node.func in ("multiply", "divide") and len(node.args) == 2:
            # scaled by a number, or by anything the batch does not reach (the target
            # is a scalar, so the factor is one too)
            left, right = node.args
            if isinstance(right, Number) or not _reads_any(right, lines, batch):
                return read(left)
            if node.func == "multiply" and (
                isinstance(left, Number) or not _reads_any(left, lines, batch)
            ):
                return read(right)
            return None
        info = public_ops.get(node.func)
        if info is not None and info.kinds.get("reduction") == "reduction":
            given = _argument(node, "reduction")
            if given is None:
                value = _default(node.func, "reduction")
            elif isinstance(given, Constant):
                value = given.value
            else:
                return None
            return value if value in REDUCTIONS else None
        return None

    return read(Name(target, lines[target].pos)) if target in lines else None
