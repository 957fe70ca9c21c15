"""Non-finite answers are never silent (runs in a worker, after every handler).

An answer holding NaN or an infinity is refused as a 422 that names the op where the
first non-finite value appeared (line, column, op; the engine's diagnosis), unless the
request set `allow_nonfinite`: then the answer carries `nonfinite`, the list of its
fields that hold such values, so a client cannot miss them either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engine.language import Problem

# Bookkeeping in answers, never a computed value.
_NOT_RESULTS = frozenset({"tape", "seconds", "ttl", "execution"})


def nonfinite_fields(result: Any, path: str = "") -> list[str]:
    """Dotted paths of the arrays and numbers in `result` that hold NaN or infinity."""
    found: list[str] = []
    _walk(result, path, found)
    return found


# Leaves that are never numbers with a non-finite value.
_PLAIN = frozenset({str, bool, int, bytes, type(None)})


def _walk(value: Any, path: str, found: list[str]) -> None:
    # Exact types first (an answer is dicts, lists and arrays): the ABC checks below cost
    # a few microseconds each, and this runs over every answer.
    kind = type(value)
    if kind in _PLAIN:
        return
    if kind is np.ndarray or (kind is not dict and isinstance(value, np.ndarray)):
        numeric = value.dtype.kind
        if numeric == "f" and value.ndim == 0 and value.itemsize <= 8:
            # A scalar answer (a loss, a gradient of a scalar): 0.2 us, not ~3 for the
            # reduction below (a Python float holds every such value exactly).
            if not math.isfinite(value):
                found.append(path)
        elif numeric in "fc" and not np.isfinite(value).all():
            found.append(path)
    elif kind is dict or isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _NOT_RESULTS:
                _walk(item, f"{path}.{key}" if path else str(key), found)
    elif kind is list or isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(item, f"{path}.{i}" if path else str(i), found)
    elif isinstance(value, float | np.floating) and not math.isfinite(value):
        found.append(path)


def guard(
    result: Any,
    payload: Any,
    diagnose: Callable[[], Problem],
    refuse: Callable[[str, Problem], Exception],
) -> Any:
    """`result` as it is when finite; flagged when the request allows non-finite values;
    else `refuse(detail, problem)` is raised, with the op `diagnose()` names."""
    if not isinstance(result, dict):
        return result
    fields = nonfinite_fields(result)
    if not fields:
        return result
    if isinstance(payload, Mapping) and payload.get("allow_nonfinite"):
        result["nonfinite"] = fields
        return result
    problem = diagnose()
    shown = ", ".join(fields[:5]) + (f" and {len(fields) - 5} more" if len(fields) > 5 else "")
    verb = "holds" if len(fields) == 1 else "hold"
    detail = (
        f"the answer is not finite ({shown} {verb} NaN or infinite values): {problem}. "
        "Send allow_nonfinite: true to receive it anyway, flagged"
    )
    raise refuse(detail, problem)
