"""The error an ONNX model raises when it cannot run here: every problem at once.

Engine-side (no HTTP): the language turns each entry into a located Problem of a
DefinitionError, which the service answers as one 422 problem+json.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelProblem:
    """One reason a model cannot run. node/op_type/domain/opset are set for a node's
    problem; tensor/axis for a shape that does not follow from the inputs."""

    message: str
    kind: str = "model"  # "model" (invalid file), "op" (unsupported), "shape", "mode"
    node: str | None = None
    op_type: str | None = None
    domain: str | None = None
    opset: int | None = None
    tensor: str | None = None
    axis: int | None = None
    count: int | None = None  # a group's number of nodes (grouped(): node is then None)
    nodes: tuple[str, ...] | None = None  # a group's first node names

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        if self.nodes is not None:
            out["nodes"] = list(self.nodes)
        return out

    def __str__(self) -> str:
        if self.op_type is None:
            return self.message
        where = f"domain {self.domain or 'ai.onnx'}, opset {self.opset}"
        if self.count is not None:
            names = ", ".join(repr(n) for n in self.nodes or ())
            more = ", ..." if self.count > len(self.nodes or ()) else ""
            return (
                f"op_type {self.op_type} ({where}), {self.count} node(s) ({names}{more}): "
                f"{self.message}"
            )
        node = f"node {self.node!r} " if self.node else "a node "
        return f"{node}(op_type {self.op_type}, {where}): {self.message}"


NODES_NAMED = 3  # a group names its first few nodes; the count says how many there are
WHAT_TO_DO = (
    "export the model again with ops this runtime supports (replace the layer, or export "
    "with torch.onnx.export(..., dynamo=False, do_constant_folding=False) or "
    "dynamo=True, optimize=False, which keep the parameters), or write that part in the "
    "definition language; the ONNX ops supported are listed in docs/guides/pytorch.md "
    "(Any ONNX file)"
)


def grouped(problems: Iterable[ModelProblem]) -> list[ModelProblem]:
    """Node problems of the same op type, domain and reason as one problem with their
    count and first node names (a model with 52 unsupported Slice nodes says so once);
    every other problem as it is. The order is that of each group's first node."""
    groups: dict[tuple, list[ModelProblem]] = {}
    out: list[Any] = []
    for p in problems:
        if p.kind != "op" or p.op_type is None:
            out.append(p)
            continue
        key = (p.op_type, p.domain, p.opset, p.message)
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(p)
    return [
        item
        if isinstance(item, ModelProblem)
        else ModelProblem(
            item[3],
            "op",
            op_type=item[0],
            domain=item[1],
            opset=item[2],
            count=len(groups[item]),
            nodes=tuple(str(p.node) for p in groups[item][:NODES_NAMED]),
        )
        for item in out
    ]


def summary(problems: Iterable[ModelProblem]) -> str | None:
    """One line over the unsupported ops (op types with their node counts) and what to
    do about them; None when no node is unsupported."""
    counts: dict[str, int] = {}
    for p in problems:
        if p.kind == "op" and p.op_type is not None:
            counts[p.op_type] = counts.get(p.op_type, 0) + (p.count or 1)
    if not counts:
        return None
    listed = ", ".join(f"{op} x{n}" for op, n in counts.items())
    nodes = sum(counts.values())
    return f"{nodes} node(s) of {len(counts)} op type(s) cannot run here ({listed}): {WHAT_TO_DO}"


class ModelError(ValueError):
    """An ONNX model that cannot run; `problems` lists all of them."""

    def __init__(self, problems: Iterable[ModelProblem]):
        self.problems = tuple(problems)
        if not self.problems:
            raise ValueError("ModelError needs at least one problem")
        super().__init__(
            f"{len(self.problems)} problem(s) in the model"
            + "".join(f"\n  {p}" for p in self.problems)
        )
