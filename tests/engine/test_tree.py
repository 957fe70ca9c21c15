"""engine.tree: flatten/unflatten round trips, and they leave no reference cycle behind
(a call's results are freed as soon as the caller drops them, with the garbage
collector off: issue 17's growing peak memory over repeated gradients)."""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple

import numpy as np

import engine as gt
from engine import tree

Pair = namedtuple("Pair", "a b")


def test_round_trip_of_every_kind_of_node() -> None:
    nested = {"x": [1, (2, 3)], "y": Pair(4, {"z": 5}), "n": 6}
    leaves, treedef = tree.flatten(nested)
    assert leaves == [1, 2, 3, 4, 5, 6]
    assert tree.unflatten(treedef, [10 * v for v in leaves]) == {
        "x": [10, (20, 30)],
        "y": Pair(40, {"z": 50}),
        "n": 60,
    }


def test_a_gradients_results_are_freed_without_the_garbage_collector() -> None:
    w = gt.Variable(np.ones(1000))
    gc.collect()
    gc.disable()
    try:
        with gt.GradientTape() as tape:
            y = gt.sum(w * w)
        grads = tape.gradient(y, {"w": w, "again": [w]})  # nested sources: tree walks
        alive = weakref.ref(grads["w"])
        del grads, tape, y
        assert alive() is None, "a reference cycle holds the gradient until gc runs"
    finally:
        gc.enable()
