"""A small builder for definitions, where it reads better than a nested dict.

A definition is a plain dict (`{"variables", "inputs", "program", "functions"}`, as the
API takes it), and every method of the client accepts one. `Definition` is that dict,
built from a program written as one indented block, with frozen (non-trainable)
variables named in one place:

    d = Definition('''
            h    = relu(x @ w1 + b1)
            loss = mean((h @ w2 - y) ** 2)
        ''',
        variables={"w1": W1, "b1": b1, "w2": W2},
        inputs={"x": X, "y": Y},
        frozen=["b1"])

Blank lines are dropped, so `program` line numbers (in errors) count the lines kept.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def program_lines(program: str | Sequence[str]) -> list[str]:
    """A program as its list of lines: a block of text dedented, blank lines dropped."""
    if isinstance(program, str):
        return [line.rstrip() for line in textwrap.dedent(program).splitlines() if line.strip()]
    return list(program)


def function(
    params: Sequence[str], forward: str | Sequence[str], backward: str | Sequence[str]
) -> dict[str, Any]:
    """A user function with a custom gradient: `backward` sees `upstream` and assigns
    `grad_<param>` for each parameter."""
    return {
        "params": list(params),
        "forward": program_lines(forward),
        "backward": program_lines(backward),
    }


class Definition(dict[str, Any]):
    """A definition dict, built from keyword arguments (see the module docstring)."""

    def __init__(
        self,
        program: str | Sequence[str],
        *,
        variables: Mapping[str, Any] | None = None,
        inputs: Mapping[str, Any] | None = None,
        functions: Mapping[str, Any] | None = None,
        frozen: Iterable[str] = (),
    ):
        super().__init__(program=program_lines(program))
        frozen = set(frozen)
        unknown = frozen - set(variables or {})
        if unknown:
            raise ValueError(f"frozen names no variable: {sorted(unknown)}")
        if variables:
            self["variables"] = {
                name: {"value": value, "trainable": False} if name in frozen else value
                for name, value in variables.items()
            }
        if inputs:
            self["inputs"] = dict(inputs)
        if functions:
            self["functions"] = dict(functions)


def dataset(name: str, array: str | None = None, *, rows: Any = None) -> dict[str, Any]:
    """An input bound to a stored dataset (`client.put_dataset`), in a definition's
    `inputs` or in `tape.update(inputs=...)`: `dataset("d", "X")` one array (as the value
    of an input), `dataset("d")` every array, each the input of its name (as `inputs`
    itself). `rows`: a mini-batch of axis 0, as row indices (a list, range or integer
    array) or a Python slice (`slice(0, 64)`)."""
    out: dict[str, Any] = {"dataset": name}
    if array is not None:
        out["array"] = array
    if isinstance(rows, slice):
        out["rows"] = {
            k: v
            for k, v in (("start", rows.start), ("stop", rows.stop), ("step", rows.step))
            if v is not None
        }
    elif rows is not None:
        out["rows"] = [int(r) for r in np.asarray(rows).reshape(-1)]
    return out
