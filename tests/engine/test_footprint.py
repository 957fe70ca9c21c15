"""engine.footprint.held_bytes: the array memory an object graph holds, each buffer once."""

from __future__ import annotations

import numpy as np

import engine as gt
from engine.footprint import held_bytes


def test_held_bytes_counts_each_buffer_once() -> None:
    base = np.zeros(1000)
    view = base[10:20]

    def closure() -> np.ndarray:
        return view

    assert held_bytes(base, view, [base, (view,)], {"a": base}) == base.nbytes
    assert held_bytes(closure) == base.nbytes  # through the closure, to the view's base
    assert held_bytes(np.ones(3), np.ones(5)) == 8 * 8
    assert held_bytes("text", 3, None, np) == 0  # atoms and modules hold no arrays


def test_shared_types_are_not_walked_into() -> None:
    class Program:  # stands for what every recording shares (a compiled program)
        def __init__(self) -> None:
            self.table = np.zeros(500)

    program, own = Program(), np.ones(7)
    assert held_bytes([program, own]) == program.table.nbytes + own.nbytes
    assert held_bytes([program, own], shared=(Program,)) == own.nbytes


def test_a_hessian_operator_counts_its_recording() -> None:
    """The operator holds at least its primal, the (8, 4) intermediate and the gradient,
    and a larger input makes it hold more by about that input's size."""
    w = np.arange(1.0, 5.0)

    def f(w, x):
        return gt.sum(gt.tanh(x @ w) ** 2)

    small = gt.hessian_operator(f, w, np.ones((8, 4)))
    large = gt.hessian_operator(f, w, np.ones((8000, 4)))
    assert small.nbytes() >= w.nbytes * 2 + 8 * 8
    grown = large.nbytes() - small.nbytes()
    assert 7992 * 4 * 8 <= grown <= 10 * 7992 * 4 * 8
