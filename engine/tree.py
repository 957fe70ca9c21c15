"""Nested structures of tensors (dicts, lists, tuples): flatten and rebuild.

Sources and results of `gradient`, `jacobian` and the functional transforms may be any
such nesting; the answer comes back in the same structure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# A treedef is ("leaf",), ("none",), ("dict", keys, children), ("list"/"tuple", children),
# or ("namedtuple", type, children): a namedtuple comes back as the same namedtuple. All
# tuples, so a treedef is hashable (engine.jit keys its compiled calls by it).
TreeDef = tuple


# The walks are module-level functions that take their accumulator as an argument, not
# nested closures: a recursive closure refers to itself through its cell, a reference
# cycle that would keep the leaves (a call's gradients, say) alive until the garbage
# collector runs, long after the call returned.


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    leaves: list[Any] = []
    return leaves, _walk(tree, leaves)


_LEAF = ("leaf",)


def _walk(node: Any, leaves: list[Any]) -> TreeDef:
    if not isinstance(node, (dict, list, tuple)):  # a leaf: the common case, one test
        leaves.append(node)
        return _LEAF
    if isinstance(node, dict):
        keys = list(node)
        return ("dict", tuple(keys), tuple([_walk(node[k], leaves) for k in keys]))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return ("namedtuple", type(node), tuple([_walk(child, leaves) for child in node]))
    kind = "list" if isinstance(node, list) else "tuple"
    children = []
    for child in node:  # (leaves inline: a list of tensors is the usual structure)
        if isinstance(child, (dict, list, tuple)):
            children.append(_walk(child, leaves))
        else:
            leaves.append(child)
            children.append(_LEAF)
    return (kind, tuple(children))


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
    return _build(treedef, iter(leaves))


def _build(d: TreeDef, it: Iterator[Any]) -> Any:
    if d[0] == "leaf":
        return next(it)
    if d[0] == "dict":
        return {k: _build(c, it) for k, c in zip(d[1], d[2], strict=True)}
    if d[0] == "namedtuple":
        return d[1](*[_build(c, it) for c in d[2]])
    children = [next(it) if c[0] == "leaf" else _build(c, it) for c in d[1]]
    return children if d[0] == "list" else tuple(children)
