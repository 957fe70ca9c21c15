"""Constant arguments: the kinds an op's non-tensor parameters take, and how a literal
in the program becomes the Python value the engine receives.

A constant is written as a literal (`axis=1`, `keepdims=True`, `shape=(2, -1)`,
`reduction='sum'`); a tensor expression is never accepted where a constant is expected,
so everything a shape depends on is known before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.language.definition import ALLOWED_DTYPES
from engine.language.parse import Constant, Node, Number, Sequence
from engine.ops.conv import AUTO_PADS

DTYPE_NAMES = tuple(sorted(str(d) for d in ALLOWED_DTYPES))
REDUCTIONS = ("mean", "sum", "none")
ORDS = (None, 1, 2, "inf", "euclidean", "fro")
PAD_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC", "EDGE")


class ArgError(Exception):
    """A call whose arguments do not fit the op's signature."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class _Mismatch(Exception):
    """A literal that is not of the kind asked for (convert() says which)."""


def describe(node: Node) -> str:
    if isinstance(node, Number):
        return f"the number {node.value!r}"
    if isinstance(node, Constant):
        return repr(node.value) if isinstance(node.value, str) else str(node.value)
    if isinstance(node, Sequence):
        return "a tuple or list"
    return "a tensor expression"


def _int(node: Node) -> int:
    if isinstance(node, Number) and isinstance(node.value, int):
        return node.value
    raise _Mismatch


def _ints(node: Node) -> tuple[int, ...]:
    if isinstance(node, Sequence):
        return tuple(_int(item) for item in node.items)
    raise _Mismatch


def _int_or_ints(node: Node) -> int | tuple[int, ...]:
    return _int(node) if isinstance(node, Number) else _ints(node)


def _optional(convert: Callable[[Node], Any]) -> Callable[[Node], Any]:
    def optional(node: Node) -> Any:
        if isinstance(node, Constant) and node.value is None:
            return None
        return convert(node)

    return optional


def _float(node: Node) -> float:
    if isinstance(node, Number):
        return float(node.value)
    raise _Mismatch


def _bool(node: Node) -> bool:
    if isinstance(node, Constant) and isinstance(node.value, bool):
        return node.value
    raise _Mismatch


def _string(node: Node) -> str:
    if isinstance(node, Constant) and isinstance(node.value, str):
        return node.value
    raise _Mismatch


def _choice(choices: tuple[Any, ...]) -> Callable[[Node], Any]:
    def choice(node: Node) -> Any:
        value = node.value if isinstance(node, (Constant, Number)) else object()
        if isinstance(value, bool) or value not in choices:
            raise _Mismatch
        return value

    return choice


def _index(node: Node) -> Any:
    item = _optional(_int)
    if isinstance(node, Sequence):
        return tuple(item(i) for i in node.items)
    return item(node)


def _indices(node: Node) -> Any:
    return _int(node) if isinstance(node, Number) else list(_ints(node))


def _pairs(node: Node) -> tuple[tuple[int, int], ...]:
    if isinstance(node, Sequence):
        pairs = tuple(_ints(item) for item in node.items)
        if all(len(p) == 2 for p in pairs):
            return pairs  # type: ignore[return-value]
    raise _Mismatch


def _pads(node: Node) -> Any:
    """An int, ints, (begin, end) pairs or an auto_pad name (issue 13's convolution and
    pooling pads)."""
    if isinstance(node, Constant) and isinstance(node.value, str):
        return _choice(AUTO_PADS)(node)
    if (
        isinstance(node, Sequence)
        and node.items
        and all(isinstance(item, Sequence) for item in node.items)
    ):
        return _pairs(node)
    return _int_or_ints(node)


# kind -> (the type as the catalogue shows it, converter)
KINDS: dict[str, tuple[str, Callable[[Node], Any]]] = {
    "int": ("int", _int),
    "float": ("float", _float),
    "bool": ("bool", _bool),
    "axis": ("int", _int),
    "axis?": ("int | None", _optional(_int)),
    "axes": ("int | tuple[int, ...] | None", _optional(_int_or_ints)),
    "perm": ("tuple[int, ...] | None", _optional(_ints)),
    "shape": ("int | tuple[int, ...]", _int_or_ints),
    "dtype": (" | ".join(repr(d) for d in DTYPE_NAMES), _choice(DTYPE_NAMES)),
    "reduction": (" | ".join(repr(r) for r in REDUCTIONS), _choice(REDUCTIONS)),
    "ord": ("None | 1 | 2 | 'inf'", _choice(ORDS)),
    "spec": ("str", _string),
    "index": ("int | None | tuple[int | None, ...]", _index),
    # take's indices: constant ints here, or else an integer tensor (see catalogue.bind)
    "indices": ("int | tuple[int, ...] | tensor (integer)", _indices),
    # issue 19
    "direction": ("'ASCENDING' | 'DESCENDING'", _choice(("ASCENDING", "DESCENDING"))),
    "paddings": ("tuple[tuple[int, int], ...]", _pairs),
    "pad_mode": (" | ".join(repr(m) for m in PAD_MODES), _choice(PAD_MODES)),
    # issue 13: convolution and pooling windows
    "ints": ("tuple[int, ...]", _ints),
    "window": ("int | tuple[int, ...]", _int_or_ints),
    "window?": ("int | tuple[int, ...] | None", _optional(_int_or_ints)),
    "pads": (
        "int | tuple[int, ...] | tuple[tuple[int, int], ...] | "
        + " | ".join(repr(m) for m in AUTO_PADS)
        + " | None",
        _optional(_pads),
    ),
}


def convert(kind: str, node: Node, name: str) -> Any:
    """The value of a literal for a parameter `name` of this kind; ArgError if it is not
    one."""
    type_name, converter = KINDS[kind]
    try:
        return converter(node)
    except _Mismatch:
        raise ArgError(f"{name} must be {type_name}, got {describe(node)}") from None
