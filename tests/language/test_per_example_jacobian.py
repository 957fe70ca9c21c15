"""Issue 27, item 8: the jacobian of a per-example loss vector over the parameters is not
quadratic in the batch. Reverse mode's rows each carry the whole batch (O(N^2): 0.24 s
at N = 100, 2.2 s at 300, a 504 at 1,500); a jacobian with more rows than columns is
taken by forward mode instead, a pass per chunk of parameter columns, each O(N).

Checked by counting passes, not timing: the number of forward passes depends on the
parameters and the chunk size only, the number of backward sweeps is zero, at N = 40 and
at N = 400; and the answer equals per-example gradients taken one example at a time."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import forward, tape
from engine.language import compile_definition

D, H, C = 3, 4, 2
P = D * H + H + H * C  # 24 parameters


def definition(n: int) -> dict:
    rng = np.random.default_rng(8)
    return {
        "variables": {
            "w1": rng.standard_normal((D, H)) * 0.7,
            "b1": rng.standard_normal(H) * 0.1,
            "w2": rng.standard_normal((H, C)) * 0.7,
        },
        "inputs": {"x": rng.standard_normal((n, D)), "y": rng.standard_normal((n, C))},
        "program": [
            "h = tanh(x @ w1 + b1)",
            "out = h @ w2",
            "losses = sum((out - y) ** 2, axis=1)",  # one loss per example
        ],
    }


def per_example_loop(d: dict) -> dict[str, np.ndarray]:
    """d losses[i] / d params, one example at a time."""
    params = [gt.constant(d["variables"][k]) for k in ("w1", "b1", "w2")]

    def loss_of(i: int):
        def f(w1, b1, w2):
            h = gt.tanh(d["inputs"]["x"][i : i + 1] @ w1 + b1)
            return gt.sum((h @ w2 - d["inputs"]["y"][i : i + 1]) ** 2)

        return f

    rows = [gt.grad(loss_of(i), argnums=(0, 1, 2))(*params) for i in range(len(d["inputs"]["x"]))]
    return {k: np.stack([r[j].numpy() for r in rows]) for j, k in enumerate(("w1", "b1", "w2"))}


class Passes:
    """Counts forward-mode passes (ForwardAccumulator entries) and backward sweeps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forward = self.backward = 0
        enter, sweep = forward.ForwardAccumulator.__enter__, tape.GradientTape._run

        def counted_enter(acc):
            self.forward += 1
            return enter(acc)

        def counted_sweep(t, *args, **kwargs):
            self.backward += 1
            return sweep(t, *args, **kwargs)

        monkeypatch.setattr(forward.ForwardAccumulator, "__enter__", counted_enter)
        monkeypatch.setattr(tape.GradientTape, "_run", counted_sweep)


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_a_per_example_loss_jacobian_is_linear_in_the_batch(monkeypatch, chunk_size) -> None:
    counts = {}
    for n in (40, 400):
        d = definition(n)
        program = compile_definition(d)
        request = program.check_request("losses", ["w1", "b1", "w2"], "none")
        passes = Passes(monkeypatch)
        y, jac = program.jacobians(request, program.leaves(d), chunk_size=chunk_size)
        counts[n] = (passes.forward, passes.backward)
        want = per_example_loop(d)
        assert y.shape == (n,)
        for key, value in want.items():
            np.testing.assert_allclose(jac[key].numpy(), value, rtol=1e-12, atol=1e-12)
    # The passes do not grow with N: one per chunk of each parameter's columns.
    expected = 3 if chunk_size is None else sum(-(-k // 8) for k in (D * H, H, H * C))
    assert counts[40] == counts[400] == (expected, 0), counts


def test_a_wide_jacobian_stays_in_reverse_mode(monkeypatch) -> None:
    """Fewer rows than columns (3 examples, 24 parameters): reverse mode, one backward
    sweep (rows x batch is small), the same numbers."""
    d = definition(3)
    program = compile_definition(d)
    request = program.check_request("losses", ["w1", "b1", "w2"], "none")
    passes = Passes(monkeypatch)
    _, jac = program.jacobians(request, program.leaves(d), compiled=False)
    assert passes.forward == 0 and passes.backward >= 1
    for key, value in per_example_loop(d).items():
        np.testing.assert_allclose(jac[key].numpy(), value, rtol=1e-12, atol=1e-12)
