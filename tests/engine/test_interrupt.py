"""Stopping a computation between two ops (gt.interruptible): what the service uses to
free a worker when its client has gone. The check runs before every primitive; once it
raises, nothing more is computed, every tape opened inside closes, and the engine works
as before."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import trace
from engine.hessian_algorithms import FlatOperator, lanczos


class StopAfter:
    """An interrupt check that lets `n` ops run, then raises on every later one."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > self.n:
            raise gt.Interrupted(f"stopped after {self.n} ops")


def loss(w: gt.Tensor) -> gt.Tensor:
    h = w
    for _ in range(50):  # a long chain of small ops
        h = gt.tanh(h * 1.01)
    return gt.sum(h * h)


def test_a_gradient_stops_at_the_next_op_and_the_engine_recovers() -> None:
    w = gt.Variable(np.linspace(-1.0, 1.0, 5))
    check = StopAfter(20)
    with pytest.raises(gt.Interrupted), gt.interruptible(check):
        with gt.GradientTape() as tape:
            y = loss(w)
        tape.gradient(y, w)
    assert check.calls == 21  # the op that would have been the 21st never ran
    assert trace.active_tapes == [] and trace.interrupt_check is None
    # Nothing is left behind: the same gradient afterwards equals finite differences.
    with gt.GradientTape() as tape:
        y = loss(w)
    g = tape.gradient(y, w).numpy()
    eps, x = 1e-6, w.numpy()
    fd = [
        (loss(gt.constant(x + eps * e)).numpy() - loss(gt.constant(x - eps * e)).numpy())
        / (2 * eps)
        for e in np.eye(5)
    ]
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)


def test_a_lanczos_run_stops_between_hvps() -> None:
    w = np.linspace(-1.0, 1.0, 40)  # k = 2 of 40 needs more than three HVPs
    operator = gt.hessian_operator(loss, gt.constant(w))
    flat = FlatOperator(operator)
    counted = StopAfter(10**9)
    with gt.interruptible(counted):  # how many ops one HVP pass applies
        flat.matvec(np.ones((1, 40)))
    check = StopAfter(3 * counted.calls + 1)  # stops inside the fourth HVP
    with pytest.raises(gt.Interrupted), gt.interruptible(check):
        lanczos(flat.matvec, flat.n, k=2)
    assert check.calls == 3 * counted.calls + 2
    # The recorded operator still answers, unchanged.
    v = np.ones(40)
    np.testing.assert_allclose(
        operator.hvp(gt.constant(v))[0].numpy(),
        gt.hessian(loss)(gt.constant(w)).numpy() @ v,
        rtol=1e-9,
    )


def test_no_check_costs_nothing_but_a_test() -> None:
    assert trace.interrupt_check is None
    with gt.interruptible(lambda: None):
        assert trace.interrupt_check is not None
        assert loss(gt.constant(np.ones(3))).numpy() > 0
    assert trace.interrupt_check is None
