"""The op catalogue: what a program can call, with signatures, generated from the
engine's registry (names, parameter order, defaults, docs, and which parameters are
constants of what kind, as each op declares beside its shape rule), plus the language's
built-ins.

`catalogue()` is what the service serves at GET /v1/ops; `bind` matches a call in a
program against a signature.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from engine.language.constants import KINDS, ArgError, convert, describe
from engine.language.definition import FunctionDef
from engine.language.parse import (
    BINARY_OPS,
    COMPARE_OPS,
    Call,
    Constant,
    Name,
    Node,
    Number,
    Sequence,
    Subscript,
)
from engine.registry import Param, public_ops

TENSOR_NODES = (Name, Number, Call, Subscript)  # what can stand where a tensor is expected
OPERATORS = dict([*BINARY_OPS.values(), *COMPARE_OPS.values()])
OPERATORS.update({"negative": "-x", "getitem": "x[index]"})
BUILTIN_FAMILY = "builtin"


@dataclass(frozen=True)
class Signature:
    name: str
    family: str
    doc: str
    params: tuple[Param, ...]

    def text(self) -> str:
        parts = []
        for p in self.params:
            if p.variadic:
                parts.append(f"*{p.name}")
            elif p.required:
                parts.append(p.name)
            else:
                parts.append(f"{p.name}={p.default!r}")
        return f"{self.name}({', '.join(parts)})"

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


def _from_registry(name: str) -> Signature | None:
    info = public_ops[name]
    if info.shape_rule is None:  # an engine op without a shape rule is not callable (a test fails)
        return None
    return Signature(name, info.family, info.doc, info.params)


BUILTINS = {
    "grad": Signature(
        "grad",
        BUILTIN_FAMILY,
        "d sum(y) / d x by a nested tape; the result is differentiable again. x must be a "
        "name (a variable, an input or an earlier line).",
        (Param("y", "tensor"), Param("x", "tensor")),
    ),
    "clip_grad_norm": Signature(
        "clip_grad_norm",
        BUILTIN_FAMILY,
        "x unchanged; on the way back its gradient is rescaled to an L2 norm of at most max_norm.",
        (Param("x", "tensor"), Param("max_norm", "float")),
    ),
}

SIGNATURES: dict[str, Signature] = {
    name: sig for name in public_ops if (sig := _from_registry(name)) is not None
}
SIGNATURES.update(BUILTINS)


def function_signature(name: str, fn: FunctionDef) -> Signature:
    params = tuple(Param(p, "tensor") for p in fn.params)
    return Signature(name, "function", "a user function with a custom gradient", params)


# ----------------------------------------------------------------------------------------
# Binding a call to a signature
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """tensors: tensor parameters -> node, or list of nodes (a list or variadic one).
    constants: every constant parameter -> its value (defaults filled in).
    given: the names the call gave, which are all that is passed to the engine."""

    tensors: dict[str, Node | list[Node] | None]
    constants: dict[str, Any]
    given: tuple[str, ...]


def bind(sig: Signature, call: Call) -> Bound:
    """Match the call's arguments to the signature; raise ArgError on the first misfit."""
    fixed = [p for p in sig.params if not p.variadic]
    variadic = next((p for p in sig.params if p.variadic), None)
    if len(call.args) > len(fixed) and variadic is None:
        names = ", ".join(p.name for p in fixed)
        raise ArgError(f"takes at most {len(fixed)} argument(s) ({names}), got {len(call.args)}")
    given: dict[str, Node] = {p.name: node for p, node in zip(fixed, call.args)}
    for name, node in call.kwargs:
        p = sig.param(name)
        if p is None or p.variadic:
            known = [q.name for q in fixed]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (it takes {', '.join(known)})"
            raise ArgError(f"unknown keyword argument {name!r}{hint}")
        if name in given:
            raise ArgError(f"argument {name!r} given twice")
        given[name] = node
    missing = [p.name for p in fixed if p.required and p.name not in given]
    if missing:
        raise ArgError(f"missing argument(s) {', '.join(repr(m) for m in missing)}")
    tensors: dict[str, Node | list[Node] | None] = {}
    constants: dict[str, Any] = {}
    for p in fixed:
        node = given.get(p.name)  # type: ignore[assignment]  # None: not given
        if p.kind == "tensor":
            if node is None or (
                isinstance(node, Constant) and node.value is None and p.default is None
            ):
                tensors[p.name] = None  # an optional tensor left out
                given.pop(p.name, None)
            else:
                tensors[p.name] = _tensor(p, node)
        elif p.kind == "tensors":
            tensors[p.name] = _tensor_list(p, node)
        elif node is None:
            constants[p.name] = p.default
        elif p.kind == "indices" and not isinstance(node, (Number, Sequence)):
            tensors[p.name] = _tensor(p, node)  # take's indices as an integer tensor
        else:
            constants[p.name] = convert(p.kind, node, p.name)
    if variadic is not None:
        tensors[variadic.name] = [_tensor(variadic, node) for node in call.args[len(fixed) :]]
    return Bound(tensors, constants, tuple(given))


def _tensor(p: Param, node: Node) -> Node:
    if not isinstance(node, TENSOR_NODES):
        raise ArgError(f"{p.name} must be a tensor, got {describe(node)}")
    return node


def _tensor_list(p: Param, node: Node | None) -> list[Node]:
    if not isinstance(node, Sequence):
        got = "nothing" if node is None else describe(node)
        raise ArgError(f"{p.name} must be a list of tensors such as [a, b], got {got}")
    return [_tensor(p, item) for item in node.items]


# ----------------------------------------------------------------------------------------
# The catalogue served to clients
# ----------------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_default(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _entry(sig: Signature) -> dict[str, Any]:
    params = []
    for p in sig.params:
        if p.kind in ("tensor", "tensors"):
            type_ = "tensor" if p.kind == "tensor" else "list[tensor]"
            if p.kind == "tensor" and p.default is None:
                type_ = "tensor | None"
        else:
            type_ = KINDS[p.kind][0]
        entry = {
            "name": p.name,
            "kind": p.kind if p.kind in ("tensor", "tensors") else "constant",
            "type": type_,
            "required": p.required,
            "variadic": p.variadic,
        }
        if not p.required and not p.variadic:
            entry["default"] = _json_default(p.default)
        params.append(entry)
    return {
        "name": sig.name,
        "family": sig.family,
        "signature": sig.text(),
        "doc": sig.doc,
        "operator": OPERATORS.get(sig.name),
        "params": params,
    }


def catalogue(functions: dict[str, FunctionDef] | None = None) -> list[dict[str, Any]]:
    """Every callable name with its signature, as JSON-ready dicts: the engine's public
    ops, the built-ins (grad, clip_grad_norm) and, when given, a definition's functions."""
    entries = [_entry(sig) for sig in SIGNATURES.values()]
    for name, fn in (functions or {}).items():
        entries.append(_entry(function_signature(name, fn)))
    return entries


def suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=2)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
