"""The fused softmax and exact-GELU primitives (issue 28): their first and higher
derivatives against finite differences (engine.testing.check_grads, to third order, and
jacfwd of jacrev against differences of jacrev), gradients, Hessian-vector products and
Hessians against PyTorch's autograd (torch.nn.functional.softmax / gelu, computed in the
test), GELU's float32 edges (zero, subnormals, near the largest float) against PyTorch and
SciPy's normal CDF, and their compiled replay (bit-equal to the dynamic pass, keeping no
arrays beyond the schedule's accounted buffers). layer_norm, whose core is the fused
normalize primitive since its broadcast steps run as kernels (engine/kernels/layernorm.py,
bench/RESULTS.md), is checked here too. Each test seeds its own generator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.special import ndtr

import engine as gt
from engine import replay
from engine.footprint import held_bytes
from engine.ops.elementwise import gelu_p
from engine.ops.nn import softmax_p
from engine.testing import bound_primitives, check_grads


def _softmax(x):
    return gt.softmax(x, -1)


def _softmax_mid(x):
    return gt.softmax(x, 1)


def _layer_norm(x, gamma, beta):
    return gt.layer_norm(x, gamma, beta, eps=1e-5)


def _gelu(x):
    return gt.gelu(x)


# name -> (engine function, argument shapes, PyTorch's function)
CASES = {
    "softmax": (_softmax, [(3, 4, 5)], lambda x: F.softmax(x, -1)),
    "softmax_axis1": (_softmax_mid, [(3, 4, 5)], lambda x: F.softmax(x, 1)),
    "layer_norm": (
        _layer_norm,
        [(3, 4, 5), (5,), (5,)],
        lambda x, g, b: F.layer_norm(x, (5,), g, b, eps=1e-5),
    ),
    "gelu": (_gelu, [(3, 4, 5)], lambda x: F.gelu(x)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_derivatives_to_third_order_match_finite_differences(name: str) -> None:
    f, shapes, _ = CASES[name]
    rng = np.random.default_rng(0)
    check_grads(
        f,
        [rng.standard_normal(s) for s in shapes],
        order=3,
        modes=("fwd", "rev"),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_and_hvp_match_pytorch(name: str) -> None:
    f, shapes, torch_f = CASES[name]
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s) for s in shapes]
    weights = rng.standard_normal(shapes[0])  # the loss: sum(tanh(f(x)) * weights)
    vs = [rng.standard_normal(s) for s in shapes]

    def loss(*xs):
        return gt.sum(gt.tanh(f(*xs)) * gt.constant(weights))

    xs = [gt.constant(a) for a in args]
    with gt.GradientTape(persistent=True) as outer:
        outer.watch(xs)
        with gt.GradientTape() as inner:
            inner.watch(xs)
            value = loss(*xs)
        grads = inner.gradient(value, xs)
        dot = gt.sum(grads[0] * gt.constant(vs[0]))
        for g, v in zip(grads[1:], vs[1:], strict=True):
            dot = dot + gt.sum(g * gt.constant(v))
    hvps = outer.gradient(dot, xs)
    # forward over reverse (gt.hvp) as well as reverse over reverse
    fwd_hvps = gt.hvp(loss, [gt.constant(a) for a in args], [gt.constant(v) for v in vs])

    txs = [torch.tensor(a, requires_grad=True) for a in args]
    tvalue = (torch.tanh(torch_f(*txs)) * torch.tensor(weights)).sum()
    tgrads = torch.autograd.grad(tvalue, txs, create_graph=True)
    tdot = sum((g * torch.tensor(v)).sum() for g, v in zip(tgrads, vs, strict=True))
    thvps = torch.autograd.grad(tdot, txs)

    np.testing.assert_allclose(float(value.numpy()), float(tvalue.detach()), rtol=1e-12)
    for g, tg in zip(grads, tgrads, strict=True):
        np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-10, atol=1e-12)
    for h, fh, th in zip(hvps, fwd_hvps, thvps, strict=True):
        np.testing.assert_allclose(h.numpy(), th.numpy(), rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(fh.numpy(), th.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_jacfwd_of_jacrev_matches_finite_differences(axis: int) -> None:
    """Second derivatives with two batches of tangents at once (jacrev's cotangent rows,
    jacfwd's tangent columns) meeting in softmax_grad: broadcasting=True aligns them (it
    was off by 0.14 without)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5))

    def f(t):
        return gt.softmax(t, axis)

    second = gt.jacfwd(gt.jacrev(f))(gt.constant(x)).numpy()

    def jac(a):
        return gt.jacrev(f)(gt.constant(a)).numpy()

    step = 1e-6
    differences = np.empty(second.shape)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = step
        differences[(..., *i)] = (jac(x + d) - jac(x - d)) / (2 * step)
    np.testing.assert_allclose(second, differences, atol=1e-8)
    # symmetric in the two differentiated axes, as a second derivative is
    np.testing.assert_allclose(second, np.moveaxis(second, (2, 3), (4, 5)), atol=1e-14)


@pytest.mark.parametrize("name", ["softmax", "softmax_axis1", "gelu"])
def test_hessian_matches_pytorch(name: str) -> None:
    f, _, torch_f = CASES[name]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4))
    weights = rng.standard_normal((2, 3, 4))

    def loss(t):
        return gt.sum(gt.tanh(f(t)) * gt.constant(weights))

    hess = gt.hessian(loss)(gt.constant(x)).numpy()
    expected = torch.autograd.functional.hessian(
        lambda t: (torch.tanh(torch_f(t)) * torch.tensor(weights)).sum(), torch.tensor(x)
    ).numpy()
    np.testing.assert_allclose(hess, expected, rtol=1e-9, atol=1e-12)


def test_softmax_over_an_empty_axis_names_the_axis_and_shape() -> None:
    with pytest.raises(ValueError, match=r"softmax: axis -1 of shape \(3, 0\) is empty"):
        gt.softmax(gt.constant(np.zeros((3, 0))), -1)
    with pytest.raises(ValueError, match=r"softmax: axis 0 of shape \(0, 2\) is empty"):
        gt.softmax(gt.constant(np.zeros((0, 2))), 0)
    assert gt.softmax(gt.constant(np.zeros((0, 2))), -1).shape == (0, 2)  # no rows: fine


def test_the_ops_record_one_fused_primitive_each() -> None:
    x = gt.constant(np.random.default_rng(4).standard_normal((3, 4)))
    seen = bound_primitives(lambda: (gt.softmax(x), gt.gelu(x)))
    assert seen == [softmax_p.name, gelu_p.name]


# ---- GELU's float32 edges ---------------------------------------------------------------
F32 = np.finfo(np.float32)
TINY = F32.smallest_subnormal


def _gelu_and_slope(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = gt.constant(x)
    with gt.GradientTape() as tape:
        tape.watch(t)
        y = gt.gelu(t)
    (slope,) = tape.gradient(y, [t], output_gradients=[gt.constant(np.ones_like(x))])
    return y.numpy(), slope.numpy()


def _torch_gelu_and_slope(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, requires_grad=True)
    y = F.gelu(t)
    (slope,) = torch.autograd.grad(y.sum(), [t])
    return y.detach().numpy(), slope.numpy()


def test_gelu_float32_near_the_largest_float_does_not_overflow() -> None:
    """0.5 x (1 + erf) is x itself out there: 2 x, formed before the halving, was inf."""
    x = np.array([F32.max, -F32.max, F32.max / 2, 3e38, 1e20, -1e20], np.float32)
    with np.errstate(all="raise"):  # no overflow on the way either
        y, slope = _gelu_and_slope(x)
    ty, tslope = _torch_gelu_and_slope(x)
    assert np.isfinite(y).all() and np.isfinite(slope).all()
    np.testing.assert_array_equal(y, ty)
    np.testing.assert_array_equal(y[x > 0], x[x > 0])
    np.testing.assert_array_equal(slope, tslope)
    np.testing.assert_array_equal(slope, np.where(x > 0, 1, 0).astype(np.float32))


def test_gelu_float32_slope_at_zero_and_subnormals() -> None:
    """gelu'(x) = Phi(x) + x phi(x) is 1/2 to within an ulp for |x| < eps: Phi read off
    y / x was 0 at the smallest subnormal (y = x / 2 rounds to 0) and 2/3 at 3 of it."""
    x = np.array(
        [0.0, -0.0, TINY, -TINY, 3 * TINY, -3 * TINY, 1e-39, -1e-39, F32.tiny, 1e-30, 3e-8, -3e-8],
        np.float32,
    )
    _, slope = _gelu_and_slope(x)
    _, tslope = _torch_gelu_and_slope(x)
    np.testing.assert_array_equal(slope, np.float32(0.5))
    np.testing.assert_array_equal(slope, tslope)


def test_gelu_float32_slope_matches_the_normal_cdf_elsewhere() -> None:
    """Against Phi(x) + x phi(x) in float64 (SciPy's ndtr), within float32's rounding of
    its terms (the slope is a difference near x = -0.75, where it crosses zero) and of
    1 + erf (absolute, ~eps / 4: Phi of a negative x is a difference there, as it is in
    PyTorch's float32 derivative, which comes within twice the bound of ours)."""
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [rng.standard_normal(2000) * 4, [-0.75, -0.7518, -1.5, 1.0, 1e-7, -1e-7, 8.0, -8.0]]
    ).astype(np.float32)
    _, slope = _gelu_and_slope(x)
    _, tslope = _torch_gelu_and_slope(x)
    wide = x.astype(np.float64)
    phi = np.exp(-0.5 * wide * wide) / np.sqrt(2 * np.pi)
    exact = ndtr(wide) + wide * phi
    eps = float(F32.eps)
    bound = 4 * eps * (ndtr(wide) + np.abs(wide) * phi) + eps / 2
    assert (np.abs(slope - exact) <= bound).all(), np.max(np.abs(slope - exact) / bound)
    assert (np.abs(tslope - slope) <= 2 * bound).all()


# ---- the compiled replay ----------------------------------------------------------------
def _block(w1, w2, x):
    h = gt.gelu(x @ w1)
    return gt.sum(gt.tanh(gt.softmax(h, -1) @ w2))


def test_a_replayed_fused_pass_is_exact_and_keeps_only_its_buffers() -> None:
    """gt.jit's fresh HVP of a GELU and softmax block: replayed bit-equal to the dynamic
    pass (gelu_slope and softmax_grad run as out= forms), and all it holds beyond its
    constants is its pooled buffers, whose bytes count against the pool limit (the forms
    kept work arrays of their own, outside it)."""
    rng = np.random.default_rng(6)
    jitted = gt.jit(_block)
    x = gt.constant(rng.standard_normal((16, 8)))
    for _ in range(4):
        primals = [gt.constant(rng.standard_normal(s)) for s in [(8, 12), (12, 3)]] + [x]
        tangents = [gt.constant(rng.standard_normal(p.shape)) for p in primals]
        compiled = jitted.hvp(primals, tangents)
        dynamic = gt.hvp(_block, primals, tangents)
        for a, b in zip(compiled, dynamic, strict=True):
            assert np.array_equal(a.numpy(), b.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
    (schedule,) = jitted._passes.entries.values()
    assert isinstance(schedule, replay.Schedule)
    names = {entry[0].name for entry in schedule.plan if entry[0] is not None}
    assert {"gelu", "gelu_slope", "softmax", "softmax_grad"} <= names, names
    assert schedule.pooled_bytes > 0
    assert held_bytes(schedule) == schedule.pooled_bytes + held_bytes(schedule.template)
