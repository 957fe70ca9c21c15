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

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def __str__(self) -> str:
        if self.op_type is None:
            return self.message
        node = f"node {self.node!r} " if self.node else "a node "
        return (
            f"{node}(op_type {self.op_type}, domain {self.domain or 'ai.onnx'}, "
            f"opset {self.opset}): {self.message}"
        )


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
