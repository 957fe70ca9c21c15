"""Shared values for the language tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.language import compile_definition


def leaves_for_ops() -> dict[str, np.ndarray]:
    """A small zoo of inputs that every op in the catalogue can be called on."""
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((3, 4)),
        "b": rng.standard_normal((3, 4)),
        "c": rng.standard_normal(4),
        "r": rng.standard_normal(3),
        "col": rng.standard_normal((3, 1)),
        "t": rng.standard_normal((2, 3, 4)),
        "sq": rng.standard_normal((3, 3)) + 4 * np.eye(3),
        "s": np.float64(0.7),
        "p": rng.uniform(0.5, 2.0, (3, 4)),
        "f": rng.standard_normal((3, 4)).astype(np.float32),
        "k": rng.integers(-3, 4, (3, 4)).astype(np.int32),
        "lab": np.array([0, 3, 1], dtype=np.int32),
        "m": rng.standard_normal((3, 4)) > 0,
        # issue 13: images, filters, a token batch and attention heads
        "img": rng.standard_normal((2, 3, 6, 5)),
        "filt": rng.standard_normal((4, 3, 3, 2)),
        "seq": rng.standard_normal((2, 3, 7)),
        "ids": np.array([[0, 2, 1], [3, 3, 0]], dtype=np.int32),
        "heads": rng.standard_normal((2, 2, 5, 4)),
    }


def run_line(expr: str, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """Compile and run `result = expr`; return (its inferred type, its tensor)."""
    defn = {"inputs": inputs, "program": [f"result = {expr}"]}
    program = compile_definition(defn)
    env = program.run(program.leaves(defn))
    return program.types["result"], env["result"]
