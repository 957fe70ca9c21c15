"""Flat vectors for optimizers (SciPy's minimize takes and returns one float64 vector):
inside a worker, answers keyed by source are concatenated into one vector in the order
of the sources, and flat vectors given by a client are split back by the sources'
shapes. The order is the answer's `flat.order`: the sources as the request resolved
them (its list or mapping order, or the trainable variables in definition order)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class FlatError(ValueError):
    """A flat vector whose length does not fit the sources (message names both)."""


def order(keys: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> list[dict[str, Any]]:
    out, offset = [], 0
    for key, shape in zip(keys, shapes, strict=True):
        size = math.prod(shape)
        out.append({"source": key, "shape": list(shape), "offset": offset, "size": size})
        offset += size
    return out


def split(vector: Any, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], where: str
          ) -> dict[str, np.ndarray]:
    """A flat vector -> one array per source (float64, the callers cast)."""
    flat = np.asarray(vector, dtype=np.float64)
    total = sum(math.prod(s) for s in shapes)
    if flat.ndim != 1 or flat.size != total:
        layout = ", ".join(f"{k}{list(s)}" for k, s in zip(keys, shapes, strict=True))
        raise FlatError(
            f"{where}: a flat vector of the sources needs shape [{total}] ({layout}), "
            f"got {list(flat.shape)}"
        )
    out, offset = {}, 0
    for key, shape in zip(keys, shapes, strict=True):
        size = math.prod(shape)
        out[key] = flat[offset:offset + size].reshape(shape)
        offset += size
    return out


def _concat(parts: Mapping[str, Any]) -> np.ndarray:
    arrays = [np.asarray(v, dtype=np.float64).reshape(-1) for v in parts.values()]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def flatten(result: dict[str, Any]) -> dict[str, Any]:
    """The answer with its per-source gradients and products as one flat float64 vector
    each, under `flat` (with the order); the per-source forms are emptied."""
    keyed = result.get("gradients") or result.get("hvp") or (result.get("hvps") or [None])[0]
    if not keyed:
        return result
    flat: dict[str, Any] = {
        "order": order(list(keyed), [tuple(np.shape(v)) for v in keyed.values()])
    }
    out = dict(result)
    if result.get("gradients"):
        flat["gradient"] = _concat(result["gradients"])
        out["gradients"] = {}
    if result.get("hvp"):
        flat["hvp"] = _concat(result["hvp"])
        out["hvp"] = None
    if result.get("hvps"):
        flat["hvps"] = np.stack([_concat(h) for h in result["hvps"]])
        out["hvps"] = None
    out["flat"] = flat
    return out
