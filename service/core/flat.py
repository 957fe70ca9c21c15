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


def split(
    vector: Any, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], where: str
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
        out[key] = flat[offset : offset + size].reshape(shape)
        offset += size
    return out


def _concat(parts: Mapping[str, Any]) -> np.ndarray:
    arrays = [np.asarray(v, dtype=np.float64).reshape(-1) for v in parts.values()]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def _flat_jacobian(
    value: Any, jacobians: Mapping[str, Any], batch: bool
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Jacobians keyed by source -> (order, one matrix): [target size, n] with the sources'
    elements along the columns in order (SciPy's least_squares `jac`); per example with
    `batch`: [B, target size per example, n per example], the order over source.shape[1:]."""
    y_shape = tuple(np.shape(value))
    shapes = [tuple(np.shape(j))[len(y_shape) :] for j in jacobians.values()]
    lead = (y_shape[0],) if batch else ()
    rows = math.prod(y_shape[len(lead) :])
    blocks = [
        np.asarray(j, dtype=np.float64).reshape(*lead, rows, math.prod(s))
        for j, s in zip(jacobians.values(), shapes, strict=True)
    ]
    matrix = np.concatenate(blocks, axis=-1) if blocks else np.zeros((*lead, rows, 0))
    return order(list(jacobians), shapes), matrix


def flatten(result: dict[str, Any], batch: bool = False) -> dict[str, Any]:
    """The answer with its per-source gradients, products and jacobians as one flat
    float64 vector (or matrix) each, under `flat` (with the order); the per-source forms
    are emptied. `batch`: the jacobians are per example (their first axis)."""
    if result.get("jacobians"):
        slots, matrix = _flat_jacobian(result["value"], result["jacobians"], batch)
        return {**result, "jacobians": {}, "flat": {"order": slots, "jacobian": matrix}}
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
