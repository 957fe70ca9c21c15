"""The dynamic tape's shortcuts (issue 28, item 4) against NumPy and finite differences:
the plan taken from the records' own `needed` (every watched root a source), tanh's fused
VJP primitive (first call fused, later calls by a cached slope, the compiled replay's
form), a bias's cotangent summed in one op, and FlatOperator's single-vector path."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.hessian_algorithms import FlatOperator
from engine.tape import _plan

RNG = np.random.default_rng(28)


def _slow_plan(tape: gt.GradientTape, target: gt.Tensor, sources: list) -> list:
    ids = {id(s) for s in sources if id(s) in tape._watched}
    return [(rec, needed) for rec, needed in _plan(tape._records, {id(target)}, ids)]


def _mlp(act: str = "tanh"):
    shapes = [(5, 6), (6,), (6, 3), (3,)]
    params = [gt.Variable(RNG.standard_normal(s)) for s in shapes]
    x = gt.constant(RNG.standard_normal((4, 5)))
    return params, x, getattr(gt, act)


def _loss(params, x, act):
    h = act(x @ params[0] + params[1])
    return gt.mean((h @ params[2] + params[3]) ** 2)


def _numpy_grads(values, x, act):
    w1, b1, w2, b2 = values
    z = x @ w1 + b1
    h = np.tanh(z) if act == "tanh" else np.maximum(z, 0)
    out = h @ w2 + b2
    g = 2 * out / out.size
    gh = g @ w2.T
    gz = gh * (1 - h**2) if act == "tanh" else gh * (z > 0)
    return [x.T @ gz, gz.sum(0), h.T @ g, g.sum(0)]


@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_a_step_with_every_root_a_source_matches_numpy(act: str) -> None:
    params, x, fn = _mlp(act)
    with gt.GradientTape(persistent=True) as tape:
        loss = _loss(params, x, fn)
    assert tape._needed_exact and tape._roots == {id(p) for p in params}
    fast = tape._plan_for([loss], params)
    # the same records (the fast plan keeps the ones no target needs) with the same argnums
    slow = _slow_plan(tape, loss, params)
    assert [(id(r), n) for r, n in fast if any(r is s for s, _ in slow)] == [
        (id(r), n) for r, n in slow
    ]
    grads = tape.gradient(loss, params)
    want = _numpy_grads([p.numpy() for p in params], x.numpy(), act)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-14)
    # a subset of the sources takes _plan's sweep, and answers the same
    part = tape.gradient(loss, params[2:])
    for g, w in zip(part, grads[2:], strict=True):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_a_tensor_watched_after_a_record_that_used_it_keeps_its_gradient() -> None:
    a = gt.constant(RNG.standard_normal(3))
    x = gt.constant(RNG.standard_normal(3))
    with gt.GradientTape() as tape:
        tape.watch(a)
        y = a * x  # x is not watched yet
        tape.watch(x)
        z = gt.sum(y + x)
    assert not tape._needed_exact
    ga, gx = tape.gradient(z, [a, x])
    # _plan reaches x's use in y through the sources, as before the shortcut
    np.testing.assert_allclose(ga.numpy(), x.numpy())
    np.testing.assert_allclose(gx.numpy(), a.numpy() + 1)


def test_records_no_target_needs_and_zero_connected_sources() -> None:
    v = gt.Variable(RNG.standard_normal(4))
    w = gt.Variable(RNG.standard_normal(4))
    with gt.GradientTape(persistent=True) as tape:
        unused = gt.exp(w) * v  # recorded, leads to no target below
        target = gt.sum(gt.relu(v * 0.0 - 1.0))  # connected to v through a zero slope
        other = gt.sum(v * w)
    assert tape._needed_exact
    gv, gw = tape.gradient(target, [v, w], unconnected_gradients="zero")
    np.testing.assert_array_equal(gv.numpy(), np.zeros(4))
    np.testing.assert_array_equal(gw.numpy(), np.zeros(4))
    assert tape.gradient(target, [v, w])[1] is None
    gv, gw = tape.gradient(other, [v, w])
    np.testing.assert_allclose(gv.numpy(), w.numpy())
    np.testing.assert_allclose(gw.numpy(), v.numpy())
    assert unused is not None


def test_a_custom_gradient_on_the_tape_takes_the_full_plan() -> None:
    @gt.custom_gradient
    def double(x):
        return x * 2.0, lambda g: g * 3.0  # a deliberately different gradient

    v = gt.Variable(RNG.standard_normal(3))
    with gt.GradientTape() as tape:
        y = gt.sum(double(v) * v)
    assert not tape._needed_exact
    # d/dv sum(double(v) * v) with double's gradient 3: 3 v + 2 v
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), 5 * v.numpy())


def test_a_persistent_tape_plans_again_after_more_records() -> None:
    v = gt.Variable(RNG.standard_normal(3))
    with gt.GradientTape(persistent=True) as tape:
        y = gt.sum(v * v)
        first = tape.gradient(y, v)
        z = gt.sum(first * v)  # first = 2 v (recorded): z = 2 v.v
    np.testing.assert_allclose(tape.gradient(z, v).numpy(), 4 * v.numpy())


# ---- tanh's VJP primitive ----------------------------------------------------------------


def _tanh_problem():
    x = RNG.standard_normal((3, 4))
    w = RNG.standard_normal((3, 4))
    return x, w


def test_tanh_gradient_second_and_third_order_against_numpy() -> None:
    x0, w0 = _tanh_problem()
    x, w = gt.constant(x0), gt.constant(w0)
    t = np.tanh(x0)
    with gt.GradientTape() as t3:
        t3.watch(x)
        with gt.GradientTape() as t2:
            t2.watch(x)
            with gt.GradientTape() as t1:
                t1.watch(x)
                y = gt.sum(gt.tanh(x) * w)
            g1 = t1.gradient(y, x)
            s2 = gt.sum(g1)
        g2 = t2.gradient(s2, x)
        s3 = gt.sum(g2)
    g3 = t3.gradient(s3, x)
    d1 = 1 - t**2
    d2 = -2 * t * d1
    d3 = -2 * d1**2 + 4 * t**2 * d1
    np.testing.assert_allclose(g1.numpy(), w0 * d1, rtol=1e-13)
    np.testing.assert_allclose(g2.numpy(), w0 * d2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g3.numpy(), w0 * d3, rtol=1e-11, atol=1e-13)


def test_tanh_grad_is_the_unfused_arithmetic_bit_for_bit() -> None:
    """The fused first call and the cached-slope later calls of a persistent tape give
    the same bits as g * (1 - y * y) in NumPy."""
    x0, w0 = _tanh_problem()
    x = gt.constant(x0.astype(np.float32))
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = gt.tanh(x)
        s = gt.sum(y * w0.astype(np.float32))
    answers = [tape.gradient(s, x).numpy() for _ in range(4)]
    yv = y.numpy()
    want = w0.astype(np.float32) * (np.float32(1) - yv * yv)
    for a in answers:
        assert a.tobytes() == want.tobytes()


def test_tanh_hvps_fresh_reused_and_replayed_against_numpy() -> None:
    x0, w0 = _tanh_problem()
    w = gt.constant(w0)

    def f(x):
        return gt.sum(gt.tanh(x) ** 2 * w)

    t = np.tanh(x0)
    # d/dx w t^2 = 2 w t (1 - t^2); d2 = 2 w (1 - t^2) (1 - 3 t^2)
    diag = 2 * w0 * (1 - t**2) * (1 - 3 * t**2)
    v0 = RNG.standard_normal(x0.shape)
    fresh = gt.hvp(f, [gt.constant(x0)], [gt.constant(v0)])[0]
    np.testing.assert_allclose(fresh.numpy(), diag * v0, rtol=1e-12, atol=1e-14)
    op = gt.hessian_operator(f, gt.constant(x0))
    # dynamic, captured, then replayed passes: the same answer each time
    answers = [op.hvp(gt.constant(v0))[0].numpy() for _ in range(4)]
    for a in answers:
        np.testing.assert_allclose(a, diag * v0, rtol=1e-12, atol=1e-14)
        assert a.tobytes() == answers[0].tobytes()
    assert "compiled" in op.replay_status().values()
    # finite differences of the gradient, as a check independent of the formula
    eps = 1e-6
    grad = gt.grad(f)
    fd = (grad(gt.constant(x0 + eps * v0)).numpy() - grad(gt.constant(x0 - eps * v0)).numpy()) / (
        2 * eps
    )
    np.testing.assert_allclose(answers[0], fd, rtol=1e-6, atol=1e-8)


def test_tanh_grad_jit_compiled_gradient_matches_dynamic_bits() -> None:
    params, x, _ = _mlp("tanh")
    values = [gt.constant(p.numpy()) for p in params]

    def loss(ps):
        return _loss(ps, x, gt.tanh)

    dynamic = [g.numpy() for g in gt.grad(loss)(values)]
    jitted = gt.jit(gt.grad(loss))
    compiled = [[g.numpy() for g in jitted(values)] for _ in range(4)][-1]
    for a, b in zip(dynamic, compiled, strict=True):
        assert a.tobytes() == b.tobytes()


# ---- a bias's cotangent, batched ----------------------------------------------------------


def test_bias_jacobian_rows_sum_the_broadcast_axes() -> None:
    b = gt.constant(RNG.standard_normal(3))
    m = gt.constant(RNG.standard_normal((2, 4, 3)))
    with gt.GradientTape() as tape:
        tape.watch(b)
        out = gt.tanh(m + b)  # b broadcast over two leading axes
    jac = tape.jacobian(out, b).numpy()  # (2, 4, 3, 3)
    d = 1 - np.tanh(m.numpy() + b.numpy()) ** 2
    want = np.einsum("ijk,kl->ijkl", d, np.eye(3))
    np.testing.assert_allclose(jac, want, rtol=1e-12, atol=1e-14)


# ---- FlatOperator's single vector ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_flat_single_vector_is_the_direct_product(dtype: str) -> None:
    params, x, _ = _mlp("tanh")
    values = [gt.constant(p.numpy().astype(dtype)) for p in params]
    xd = gt.constant(x.numpy().astype(dtype))
    op = gt.hessian_operator(lambda *ps: _loss(list(ps), xd, gt.tanh), *values)
    flat = FlatOperator(op)
    rows = RNG.standard_normal((3, flat.n))
    for _ in range(3):  # dynamic, captured, replayed
        one = flat.matvec(rows[:1].astype(dtype))
        direct = np.concatenate(
            [a.numpy().ravel() for a in op.hvp(*flat.unflatten(rows[0].astype(dtype)))]
        )
        assert one.shape == (1, flat.n) and one.dtype == np.dtype(dtype)
        assert one[0].tobytes() == direct.tobytes()
    many = flat.matvec(rows.astype(dtype))
    rtol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(many[0], one[0], rtol=rtol, atol=rtol)
    # float64 rows over these primals: the answer in float64, the product cast once
    wide = flat.matvec(rows[:1])
    assert wide.dtype == np.float64
    np.testing.assert_allclose(wide[0], direct, rtol=rtol, atol=rtol)
