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
_NOT_RESULTS = frozenset({"tape", "seconds", "ttl"})


def nonfinite_fields(result: Any, path: str = "") -> list[str]:
    """Dotted paths of the arrays and numbers in `result` that hold NaN or infinity."""
    found: list[str] = []
    if isinstance(result, Mapping):
        for key, value in result.items():
            if key not in _NOT_RESULTS:
                found += nonfinite_fields(value, f"{path}.{key}" if path else str(key))
    elif isinstance(result, list | tuple):
        for i, value in enumerate(result):
            found += nonfinite_fields(value, f"{path}.{i}" if path else str(i))
    elif isinstance(result, np.ndarray):
        if result.dtype.kind in "fc" and not np.isfinite(result).all():
            found.append(path)
    elif isinstance(result, float | np.floating) and not math.isfinite(result):
        found.append(path)
    return found


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
    detail = (
        f"the answer is not finite ({shown} hold NaN or infinite values): {problem}. "
        "Send allow_nonfinite: true to receive it anyway, flagged"
    )
    raise refuse(detail, problem)
