"""Bounds on what a definition may ask for, checked before anything runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    """Every limit has a default meant for a shared service; the service's settings
    override them. Element counts are inferred from shapes, so nothing is allocated to
    find out that a program is too big."""

    max_lines: int = 1_000  # program lines plus function-body lines
    max_line_chars: int = 2_000
    max_text_chars: int = 200_000  # all lines together
    max_nodes: int = 50_000  # syntax-tree nodes over the whole definition
    max_depth: int = 64  # nesting of one expression
    max_functions: int = 32
    max_name_chars: int = 64
    max_rank: int = 8
    max_elements: int = 1 << 24  # in any one tensor (value or intermediate)
    max_total_elements: int = 1 << 27  # in all the intermediates of one run together
    max_grad_depth: int = 4  # grad of grad of ... inside a program (3rd order needs 3)
    max_problems: int = 100  # reported in one error; the rest are counted

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be a positive int, got {value!r}")
        # Checking and running an expression recurse once per level of nesting, a few
        # Python frames each: keep well inside Python's recursion limit.
        if self.max_depth > 200:
            raise ValueError(f"max_depth {self.max_depth} is too deep; at most 200")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_LIMITS = Limits()
