"""Nested structures of tensors (dicts, lists, tuples): flatten and rebuild.

Sources and results of `gradient`, `jacobian` and the functional transforms may be any
such nesting; the answer comes back in the same structure.
"""

from __future__ import annotations

from typing import Any

# A treedef is ("leaf",), ("none",), ("dict", keys, children), ("list"/"tuple", children),
# or ("namedtuple", type, children): a namedtuple comes back as the same namedtuple.
TreeDef = tuple


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    leaves: list[Any] = []

    def walk(node: Any) -> TreeDef:
        if isinstance(node, dict):
            keys = list(node.keys())
            return ("dict", keys, [walk(node[k]) for k in keys])
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return ("namedtuple", type(node), [walk(child) for child in node])
        if isinstance(node, (list, tuple)):
            kind = "list" if isinstance(node, list) else "tuple"
            return (kind, [walk(child) for child in node])
        leaves.append(node)
        return ("leaf",)

    return leaves, walk(tree)


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
    it = iter(leaves)

    def build(d: TreeDef) -> Any:
        if d[0] == "leaf":
            return next(it)
        if d[0] == "dict":
            return {k: build(c) for k, c in zip(d[1], d[2], strict=True)}
        if d[0] == "namedtuple":
            return d[1](*[build(c) for c in d[2]])
        children = [build(c) for c in d[1]]
        return children if d[0] == "list" else tuple(children)

    return build(treedef)
