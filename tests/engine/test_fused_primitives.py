"""The fused softmax and exact-GELU primitives (issue 28): their
first and higher derivatives against finite differences (engine.testing.check_grads, to
third order), and gradients and Hessian-vector products against PyTorch's autograd
(torch.nn.functional.softmax / gelu, float64, computed in the test). layer_norm, a
composite again (a fused normalize primitive did not pay: bench/RESULTS.md), is checked
here too, as the per-example test's block uses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engine as gt
from engine.ops.elementwise import gelu_p
from engine.ops.nn import softmax_p
from engine.testing import check_grads

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 4, 5))
GAMMA = RNG.standard_normal(5)
BETA = RNG.standard_normal(5)
R = RNG.standard_normal((3, 4, 5))  # the loss's weights: loss = sum(tanh(f(x)) * R)


def _softmax(x):
    return gt.softmax(x, -1)


def _softmax_mid(x):
    return gt.softmax(x, 1)


def _layer_norm(x, gamma, beta):
    return gt.layer_norm(x, gamma, beta, eps=1e-5)


def _gelu(x):
    return gt.gelu(x)


CASES = {
    "softmax": (_softmax, [X], lambda x: F.softmax(x, -1)),
    "softmax_axis1": (_softmax_mid, [X], lambda x: F.softmax(x, 1)),
    "layer_norm": (
        _layer_norm,
        [X, GAMMA, BETA],
        lambda x, g, b: F.layer_norm(x, (5,), g, b, eps=1e-5),
    ),
    "gelu": (_gelu, [X], lambda x: F.gelu(x)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_derivatives_to_third_order_match_finite_differences(name: str) -> None:
    f, args, _ = CASES[name]
    check_grads(f, args, order=3, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_and_hvp_match_pytorch(name: str) -> None:
    f, args, torch_f = CASES[name]
    vs = [RNG.standard_normal(a.shape) for a in args]

    def loss(*xs):
        return gt.sum(gt.tanh(f(*xs)) * gt.constant(R))

    xs = [gt.constant(a) for a in args]
    with gt.GradientTape(persistent=True) as outer:
        outer.watch(xs)
        with gt.GradientTape() as inner:
            inner.watch(xs)
            value = loss(*xs)
        grads = inner.gradient(value, xs)
        dot = gt.sum(grads[0] * gt.constant(vs[0]))
        for g, v in zip(grads[1:], vs[1:]):
            dot = dot + gt.sum(g * gt.constant(v))
    hvps = outer.gradient(dot, xs)

    txs = [torch.tensor(a, requires_grad=True) for a in args]
    tvalue = (torch.tanh(torch_f(*txs)) * torch.tensor(R)).sum()
    tgrads = torch.autograd.grad(tvalue, txs, create_graph=True)
    tdot = sum((g * torch.tensor(v)).sum() for g, v in zip(tgrads, vs))
    thvps = torch.autograd.grad(tdot, txs)

    np.testing.assert_allclose(float(value.numpy()), float(tvalue.detach()), rtol=1e-12)
    for g, tg in zip(grads, tgrads):
        np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-10, atol=1e-12)
    for h, th in zip(hvps, thvps):
        np.testing.assert_allclose(h.numpy(), th.numpy(), rtol=1e-9, atol=1e-11)


def test_the_ops_record_one_fused_primitive_each() -> None:
    seen = []
    from engine import trace

    class Recorder:  # what bind reports to a capture
        def record(self, prim, args, params, ans):
            seen.append(prim)

        def constant(self, t):
            pass

        def alias(self, t, of):
            pass

        def host_read(self, t):
            pass

    saved, trace.capture = trace.capture, Recorder()
    try:
        x = gt.constant(X)
        gt.softmax(x)
        gt.gelu(x)
    finally:
        trace.capture = saved
    assert seen == [softmax_p, gelu_p]


def test_gelu_float32_derivative_at_zero_and_far_out() -> None:
    # gelu_grad reads Phi(x) off y / x: at x = 0 it is 1/2; far out it is 0 and 1.
    x = gt.constant(np.array([0.0, -30.0, 30.0, 1e-30, -1.5], np.float32))
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = gt.sum(gt.gelu(x))
    (g,) = tape.gradient(y, [x])
    tx = torch.tensor(x.numpy(), requires_grad=True)
    (tg,) = torch.autograd.grad(F.gelu(tx).sum(), [tx])
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=2e-6, atol=1e-30)
    assert g.numpy()[0] == np.float32(0.5)
