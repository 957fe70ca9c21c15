"""The structured error every check of a definition raises: a list of located problems.

The HTTP layer turns a DefinitionError into one application/problem+json answer (422)
whose entries are `Problem.to_dict()`; nothing here knows about HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# What went wrong, coarsely, so a client (or a test) can branch without parsing text.
KINDS = (
    "syntax",  # not a line of the language (a Python syntax error or a refused construct)
    "name",  # undefined, redefined, reserved or malformed name
    "op",  # unknown op, wrong arity, unknown keyword, bad constant argument
    "shape",  # shapes that do not fit together
    "dtype",  # dtypes that do not fit together, or a dtype an op does not accept
    "limit",  # a size or nesting limit
    "value",  # a malformed variable, input or function entry
    "request",  # a target, source or option of the request
    "unused",  # a line whose result nothing uses
    "runtime",  # a checked program that failed while running (singular matrix, bad label)
    "nonfinite",  # an op whose value or derivative is NaN or infinite at the values given
    "model",  # an imported (ONNX) model that is invalid or runs an op in training mode
)


@dataclass(frozen=True)
class Problem:
    """One error, located in the definition.

    section: "program", "functions.<name>.forward", "functions.<name>.backward",
    "variables.<name>", "inputs.<name>", "functions.<name>", "target", "sources", ...
    line, column: 1-based, within the section's list of lines (None when not a line).
    kind: one of KINDS above.
    """

    message: str
    section: str = "program"
    line: int | None = None
    column: int | None = None
    op: str | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    kind: str = "syntax"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "section": self.section,
            "line": self.line,
            "column": self.column,
            "op": self.op,
            "shapes": None if self.shapes is None else [list(s) for s in self.shapes],
            "message": self.message,
        }

    def __str__(self) -> str:
        where = self.section
        if self.line is not None:
            where += f" line {self.line}"
            if self.column is not None:
                where += f", column {self.column}"
        op = f"{self.op}: " if self.op else ""
        return f"{where}: {op}{self.message}"


class DefinitionError(ValueError):
    """A definition (or a request against it) that cannot run; `problems` lists every
    problem found, not only the first."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("DefinitionError needs at least one problem")
        super().__init__(self._summary())

    def _summary(self) -> str:
        head = f"{len(self.problems)} problem(s) in the definition"
        return head + "".join(f"\n  {p}" for p in self.problems)

    def to_list(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.problems]


class ExecutionError(DefinitionError):
    """A definition that passed every check failed while running (a singular matrix in
    solve, a label out of range, an error in a user function's backward program)."""


class OverBudget(DefinitionError):
    """A run that would need more memory than it may use, even one item at a time: refused
    before it starts (its problem names the largest op, its shape and the budget)."""
