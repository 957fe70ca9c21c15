"""Functional transforms agree with each other and with finite differences:
jacrev == jacfwd, HVP == Hessian @ v (every route), linearize == jvp, batched == looped."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt

RNG = np.random.default_rng(3)
X = gt.constant(RNG.standard_normal((6, 4)))
Y = gt.constant(RNG.standard_normal((6, 2)))
PARAMS = [gt.constant(RNG.standard_normal(s) * 0.5) for s in [(4, 5), (5,), (5, 2), (2,)]]


def vector_fn(w):
    return gt.tanh(X @ w)  # (6, 5) from (4, 5)


def loss_fn(k1, b1, k2, b2):
    h = gt.elu(X @ k1 + b1)
    return gt.mean(gt.softplus(h @ k2 + b2 - Y) ** 2) + 0.1 * gt.sum(gt.sin(k1))


def numeric_jacobian(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    out_shape = f(gt.constant(x)).shape
    jac = np.zeros(out_shape + x.shape)
    for idx in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[idx] = eps
        jac[(...,) + idx] = (f(gt.constant(x + d)).numpy() - f(gt.constant(x - d)).numpy()) / (
            2 * eps
        )
    return jac


def test_jacrev_jacfwd_and_finite_differences_agree() -> None:
    w = PARAMS[0]
    rev = gt.jacrev(vector_fn)(w).numpy()
    fwd = gt.jacfwd(vector_fn)(w).numpy()
    assert rev.shape == (6, 5, 4, 5)
    np.testing.assert_allclose(rev, fwd, atol=1e-12)
    np.testing.assert_allclose(rev, numeric_jacobian(vector_fn, w.numpy()), atol=1e-7)
    for chunk in (1, 7, 30, 1000):
        np.testing.assert_allclose(
            gt.jacrev(vector_fn, chunk_size=chunk)(w).numpy(), rev, atol=1e-12
        )


def test_jacobian_of_several_arguments_and_structures() -> None:
    def f(a, pair):
        return a * pair["u"] + gt.sum(pair["v"]) * a

    a = gt.constant([1.0, 2.0], "float64")
    pair = {"u": gt.constant([3.0, 4.0], "float64"), "v": gt.constant([[1.0, 1.0]], "float64")}
    ja, jp = gt.jacrev(f, argnums=(0, 1))(a, pair)
    np.testing.assert_allclose(ja.numpy(), np.diag([3.0 + 2.0, 4.0 + 2.0]))
    np.testing.assert_allclose(jp["u"].numpy(), np.diag([1.0, 2.0]))
    assert jp["v"].shape == (2, 1, 2)
    np.testing.assert_allclose(
        jp["v"].numpy(), np.ones((2, 1, 2)) * np.array([1.0, 2.0])[:, None, None]
    )
    fa, fp = gt.jacfwd(f, argnums=(0, 1))(a, pair)
    np.testing.assert_allclose(fa.numpy(), ja.numpy())
    np.testing.assert_allclose(fp["v"].numpy(), jp["v"].numpy())


def _dense_hessian() -> np.ndarray:
    blocks = gt.hessian(loss_fn, argnums=(0, 1, 2, 3))(*PARAMS)
    rows = [
        np.concatenate([b.numpy().reshape(p.size, q.size) for b, q in zip(row, PARAMS)], axis=1)
        for row, p in zip(blocks, PARAMS)
    ]
    return np.concatenate(rows, axis=0)


def test_every_hvp_route_equals_hessian_times_v() -> None:
    h = _dense_hessian()
    np.testing.assert_allclose(h, h.T, atol=1e-10)
    v = [RNG.standard_normal(p.shape) for p in PARAMS]
    expected = h @ np.concatenate([a.ravel() for a in v])

    def flat(ts):
        return np.concatenate([t.numpy().ravel() for t in ts])

    vt = [gt.constant(a) for a in v]
    fresh = gt.hvp(loss_fn, PARAMS, vt)
    np.testing.assert_allclose(flat(fresh), expected, atol=1e-10)
    op = gt.hessian_operator(loss_fn, *PARAMS)
    np.testing.assert_allclose(flat(op.hvp(*vt)), expected, atol=1e-10)
    # reverse-over-reverse by hand, through nested tapes
    with gt.GradientTape() as outer:
        outer.watch(PARAMS)
        with gt.GradientTape() as inner:
            inner.watch(PARAMS)
            loss = loss_fn(*PARAMS)
        g = inner.gradient(loss, PARAMS)
    np.testing.assert_allclose(
        flat(outer.gradient(g, PARAMS, output_gradients=vt)), expected, atol=1e-10
    )
    # K vectors in one batched pass == the loop
    many = [RNG.standard_normal((5,) + p.shape) for p in PARAMS]
    batched = op.hvp_many(*[gt.constant(m) for m in many])
    for k in range(5):
        vk = np.concatenate([m[k].ravel() for m in many])
        np.testing.assert_allclose(
            np.concatenate([b.numpy()[k].ravel() for b in batched]), h @ vk, atol=1e-10
        )
    # the gradient finite-differenced along v
    eps = 1e-6
    plus = gt.grad(loss_fn, argnums=(0, 1, 2, 3))(
        *[gt.constant(p.numpy() + eps * d) for p, d in zip(PARAMS, v)]
    )
    minus = gt.grad(loss_fn, argnums=(0, 1, 2, 3))(
        *[gt.constant(p.numpy() - eps * d) for p, d in zip(PARAMS, v)]
    )
    np.testing.assert_allclose((flat(plus) - flat(minus)) / (2 * eps), expected, atol=1e-6)


def test_hessian_operator_reports_value_and_gradient() -> None:
    op = gt.hessian_operator(loss_fn, *PARAMS)
    value, grads = gt.value_and_grad(loss_fn, argnums=(0, 1, 2, 3))(*PARAMS)
    assert float(op.value) == pytest.approx(float(value))
    for a, b in zip(op.grad, grads):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="vector of shape"):
        op.hvp(gt.zeros((3,), "float64"), *PARAMS[1:])
    with pytest.raises(ValueError, match="vector leaves"):
        op.hvp(PARAMS[0])


def test_jvp_linearize_vjp_agree() -> None:
    w = PARAMS[0]
    t = gt.constant(RNG.standard_normal(w.shape))
    out, tangent = gt.jvp(vector_fn, (w,), (t,))
    out2, f_jvp = gt.linearize(vector_fn, w)
    np.testing.assert_allclose(out.numpy(), out2.numpy())
    np.testing.assert_allclose(f_jvp(t).numpy(), tangent.numpy(), atol=1e-12)
    # linear: twice the tangent, twice the answer; batched tangents at once
    np.testing.assert_allclose(f_jvp(t * 2.0).numpy(), 2 * tangent.numpy(), atol=1e-12)
    ts = RNG.standard_normal((3,) + w.shape)
    batched = f_jvp(gt.constant(ts)).numpy()
    for k in range(3):
        np.testing.assert_allclose(
            batched[k], gt.jvp(vector_fn, (w,), (gt.constant(ts[k]),))[1].numpy(), atol=1e-12
        )
    # <u, J t> == <J^T u, t>
    u = RNG.standard_normal(out.shape)
    _, pullback = gt.vjp(vector_fn, w)
    (ct,) = pullback(gt.constant(u))
    assert np.sum(u * tangent.numpy()) == pytest.approx(np.sum(ct.numpy() * t.numpy()))


def test_linearize_does_not_rerun_the_function() -> None:
    calls = {"n": 0}

    def f(w):
        calls["n"] += 1
        return vector_fn(w)

    _, f_jvp = gt.linearize(f, PARAMS[0])
    for _ in range(3):
        f_jvp(gt.constant(RNG.standard_normal((4, 5))))
    assert calls["n"] == 1


def test_grad_requires_a_scalar_and_supports_aux() -> None:
    with pytest.raises(ValueError, match="scalar"):
        gt.grad(vector_fn)(PARAMS[0])
    (g, aux) = gt.grad(lambda w: (gt.sum(w * w), "aux"), has_aux=True)(gt.constant([1.0, 2.0]))
    assert aux == "aux"
    np.testing.assert_allclose(g.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(gt.grad(lambda a, b: a * b, argnums=1)(3.0, 4.0).numpy(), 3.0)


def test_forward_accumulator_directly() -> None:
    x = gt.constant([0.5, 1.0], "float64")
    with gt.ForwardAccumulator(x, gt.constant([1.0, 0.0], "float64")) as acc:
        y = gt.sum(gt.exp(x) * x)
        z = gt.constant(2.0, "float64") * 3.0  # unconnected
    assert float(acc.jvp(y)) == pytest.approx(np.exp(0.5) * 1.5)
    assert acc.jvp(z) is None
    assert float(acc.jvp(z, unconnected_gradients="zero")) == 0.0
    with pytest.raises(ValueError, match="tangent of shape"):
        gt.ForwardAccumulator(x, gt.constant([1.0], "float64"))


def test_batch_jacobian_detects_row_mixing_ops() -> None:
    x = gt.constant(RNG.standard_normal((5, 3)))
    mixers = {
        "mean over the batch": lambda t: t - gt.mean(t, axis=0),
        "matmul mixing rows": lambda t: gt.constant(RNG.standard_normal((5, 5))) @ t,
        "softmax over the batch": lambda t: gt.softmax(t, axis=0),
    }
    for mix in mixers.values():
        with gt.GradientTape() as tape:
            tape.watch(x)
            y = gt.tanh(mix(x))
        with pytest.raises(gt.BatchDependenceError, match="not independent"):
            tape.batch_jacobian(y, x)
    with gt.GradientTape() as tape:  # independent: per-row ops only
        tape.watch(x)
        y = gt.softmax(x, axis=1) * gt.sum(x * x, axis=1, keepdims=True)
    assert tape.batch_jacobian(y, x).shape == (5, 3, 3)


def _two_source_loss(w, b):
    return gt.sum(gt.tanh(X_DENSE @ w + b) ** 2) + gt.sum(w**4) / 4


X_DENSE = np.random.default_rng(11).standard_normal((6, 3))
W_DENSE = np.random.default_rng(12).standard_normal((3, 2))
B_DENSE = np.random.default_rng(13).standard_normal(2)


def _hessian_by_finite_differences(eps: float = 1e-5) -> np.ndarray:
    """Central differences of the analytic gradient (gt.grad), column by column."""
    x0 = np.concatenate([W_DENSE.ravel(), B_DENSE])

    def grad_at(x: np.ndarray) -> np.ndarray:
        g = gt.grad(_two_source_loss, argnums=(0, 1))(x[:6].reshape(3, 2), x[6:])
        return np.concatenate([g[0].numpy().ravel(), g[1].numpy()])

    cols = [(grad_at(x0 + eps * e) - grad_at(x0 - eps * e)) / (2 * eps) for e in np.eye(8)]
    return np.stack(cols, axis=1)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 100])
def test_dense_hessian_in_row_chunks(chunk_size: int) -> None:
    op = gt.hessian_operator(_two_source_loss, W_DENSE, B_DENSE)
    seen = []
    h = op.dense(chunk_size, progress=lambda done, total: seen.append((done, total)))
    assert h.shape == (8, 8) and h.dtype == np.float64
    np.testing.assert_allclose(h, _hessian_by_finite_differences(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(h, h.T, atol=1e-12)
    assert seen[-1] == (8, 8) and len(seen) == -(-8 // chunk_size)


def test_newton_step_solves_the_damped_system_in_the_sources_structure() -> None:
    op = gt.hessian_operator(_two_source_loss, W_DENSE, B_DENSE)
    h = op.dense()
    g = np.concatenate([op.grad[0].numpy().ravel(), op.grad[1].numpy()])
    step_w, step_b = op.newton_step(0.5)
    assert step_w.shape == (3, 2) and step_b.shape == (2,)
    s = np.concatenate([step_w.ravel(), step_b])
    np.testing.assert_allclose((h + 0.5 * np.eye(8)) @ s, g, rtol=1e-9, atol=1e-12)


def test_newton_step_of_a_singular_hessian_raises() -> None:
    op = gt.hessian_operator(lambda w: gt.sum(w) * 2.0, np.ones(3))  # H = 0
    with pytest.raises(gt.transforms.SingularHessianError, match="singular"):
        op.newton_step(0.0)
    (step,) = op.newton_step(1.0)  # (0 + 1 I) s = g = (2, 2, 2)
    np.testing.assert_allclose(step, [2.0, 2.0, 2.0])


def test_forward_accumulator_frees_the_tangents_of_dead_intermediates() -> None:
    """A tangent lives as long as its primal (issue 28: a fresh HVP's peak): once an
    intermediate dies its tangent is freed, while live tensors' tangents still answer."""
    import weakref

    x = gt.constant(np.linspace(-1.0, 1.0, 6))
    with gt.ForwardAccumulator(x, gt.constant(np.ones(6))) as acc:
        y = gt.tanh(x)
        ref = weakref.ref(acc.jvp(y))
        z = y * y
        del y
        assert ref() is None
        t = np.tanh(np.linspace(-1.0, 1.0, 6))
        np.testing.assert_allclose(acc.jvp(z).numpy(), 2 * t * (1 - t * t), rtol=1e-12)
    np.testing.assert_array_equal(acc.jvp(x).numpy(), np.ones(6))
