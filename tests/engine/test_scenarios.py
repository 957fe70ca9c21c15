"""SCENARIOS.md through the Python engine API, with the scenarios' numbers."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import scipy.optimize

import engine as gt


def dense(x: gt.Tensor, kernel: gt.Tensor, bias: gt.Tensor, act=gt.relu) -> gt.Tensor:
    return act(x @ kernel + bias)


def layer_vars(rng: np.random.Generator, n_in: int, n_out: int, dtype=np.float64):
    kernel = gt.Variable(rng.standard_normal((n_in, n_out)).astype(dtype) / np.sqrt(n_in))
    bias = gt.Variable(rng.standard_normal(n_out).astype(dtype) * 0.1)
    return kernel, bias


def fd_grad(f, params: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    """Central finite differences of a float64 scalar function of NumPy arrays."""
    grads = []
    for i, p in enumerate(params):
        g = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            plus = [q.copy() for q in params]
            minus = [q.copy() for q in params]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            g[idx] = (f(*plus) - f(*minus)) / (2 * eps)
        grads.append(g)
    return grads


# ---- 1. stop recording -------------------------------------------------------------------
def test_1_stop_recording() -> None:
    x, y = gt.Variable(2.0), gt.Variable(3.0)
    with gt.GradientTape() as tape:
        x_sq = x * x
        with tape.stop_recording():
            y_sq = y * y
        z = x_sq + y_sq
    grads = tape.gradient(z, {"x": x, "y": y})
    assert isinstance(grads, dict) and set(grads) == {"x", "y"}
    assert float(grads["x"]) == 4.0
    assert grads["y"] is None


# ---- 2. reset ------------------------------------------------------------------------------
def test_2_reset() -> None:
    x, y = gt.Variable(2.0), gt.Variable(3.0)
    with gt.GradientTape() as tape:
        y_sq = y * y
        tape.reset()
        z = x * x + y_sq
    grads = tape.gradient(z, {"x": x, "y": y})
    assert float(grads["x"]) == 4.0
    assert grads["y"] is None


# ---- 3. stop_gradient ----------------------------------------------------------------------
def test_3_stop_gradient() -> None:
    x, y = gt.Variable(2.0), gt.Variable(3.0)
    with gt.GradientTape() as tape:
        z = x**2 + gt.stop_gradient(y**2)
    grads = tape.gradient(z, {"x": x, "y": y})
    assert float(grads["x"]) == 4.0
    assert grads["y"] is None


# ---- 4. custom gradient --------------------------------------------------------------------
@gt.custom_gradient
def clip_gradient_by_norm(x):
    def grad_fn(upstream):
        return gt.clip_by_norm(upstream, 0.5)

    return x, grad_fn


def test_4_custom_gradient() -> None:
    v = gt.Variable(2.0)
    with gt.GradientTape() as tape:
        output = clip_gradient_by_norm(v * v)
    assert float(output) == 4.0
    assert float(tape.gradient(output, v)) == pytest.approx(2.0)


def test_4_custom_gradient_under_nested_tapes() -> None:
    """The custom node is recorded on both tapes; the outer tape differentiates grad_fn."""
    v = gt.Variable(2.0, dtype="float64")
    with gt.GradientTape() as outer:
        with gt.GradientTape() as inner:
            output = clip_gradient_by_norm(v * v * v)
        g = inner.gradient(output, v)  # dy/dx = 3 v^2 * 0.5/|1| -> 0.5 * 3 * 4 = ... clipped
    # upstream is 1.0, clipped to 0.5; d/dv (0.5 * 3 v^2) = 3 v = 6.0
    assert float(g) == pytest.approx(0.5 * 3 * 4.0)
    assert float(outer.gradient(g, v)) == pytest.approx(6.0)


# ---- 5. multiple tapes ---------------------------------------------------------------------
def test_5_multiple_tapes() -> None:
    x0, x1 = gt.constant(0.0), gt.constant(0.0)
    with gt.GradientTape() as tape0, gt.GradientTape() as tape1:
        tape0.watch(x0)
        tape1.watch(x1)
        ys = gt.sum(gt.sin(x0) + gt.sigmoid(x1))
    assert float(tape0.gradient(ys, x0)) == 1.0
    assert float(tape1.gradient(ys, x1)) == 0.25


# ---- 6. higher order -----------------------------------------------------------------------
def test_6_higher_order() -> None:
    x = gt.Variable(1.0)
    with gt.GradientTape() as t3:
        with gt.GradientTape() as t2:
            with gt.GradientTape() as t1:
                y = x * x * x
            dy_dx = t1.gradient(y, x)
        d2y_dx2 = t2.gradient(dy_dx, x)
    d3y_dx3 = t3.gradient(d2y_dx2, x)
    assert float(dy_dx) == 3.0
    assert float(d2y_dx2) == 6.0
    assert float(d3y_dx3) == 6.0


# ---- 7. input-gradient regularisation ------------------------------------------------------
def test_7_input_gradient_regularisation() -> None:
    rng = np.random.default_rng(7)
    x_np = rng.standard_normal((7, 5))
    kernel, bias = layer_vars(rng, 5, 10)

    x = gt.constant(x_np)
    with gt.GradientTape() as t2:
        with gt.GradientTape(watch_accessed_variables=False) as t1:
            t1.watch(x)
            out = gt.sum(dense(x, kernel, bias) ** 2)
        g1 = t1.gradient(out, x)
        g1_mag = gt.norm(g1)
    grads = t2.gradient(g1_mag, [kernel, bias])
    assert [g.shape for g in grads] == [(5, 10), (10,)]
    assert t1.watched_variables() == ()

    def reference(k: np.ndarray, b: np.ndarray) -> float:
        pre = x_np @ k + b
        h = np.maximum(pre, 0)
        g = (2 * h * (pre > 0)) @ k.T
        return float(np.linalg.norm(g))

    expected = fd_grad(reference, [kernel.numpy(), bias.numpy()])
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)


# ---- 8. jacobian, scalar source ------------------------------------------------------------
def test_8_jacobian_scalar_source() -> None:
    x = gt.linspace(-10.0, 10.0, 201)
    delta = gt.Variable(0.0)
    with gt.GradientTape() as tape:
        y = gt.sigmoid(x + delta)
    dy_dx = tape.jacobian(y, delta)
    assert dy_dx.shape == (201,)
    s = 1 / (1 + np.exp(-x.numpy().astype(np.float64)))
    np.testing.assert_allclose(dy_dx.numpy(), s * (1 - s), atol=1e-7)


# ---- 9. jacobian, tensor source ------------------------------------------------------------
def test_9_jacobian_tensor_source() -> None:
    rng = np.random.default_rng(9)
    x = gt.constant(rng.standard_normal((7, 5)))
    kernel, bias = layer_vars(rng, 5, 10)
    with gt.GradientTape(persistent=True) as tape:
        y = dense(x, kernel, bias)
        total = gt.sum(y)
    assert y.shape == (7, 10)
    j = tape.jacobian(y, kernel)
    assert j.shape == (7, 10, 5, 10)
    g = tape.gradient(total, kernel)
    assert np.max(np.abs(j.numpy().sum(axis=(0, 1)) - g.numpy())) < 1e-6
    chunked = tape.jacobian(y, kernel, chunk_size=9)
    np.testing.assert_allclose(chunked.numpy(), j.numpy(), atol=1e-12)


# ---- 10. Hessian and a Newton step ---------------------------------------------------------
def test_10_hessian_and_newton_step() -> None:
    rng = np.random.default_rng(10)
    x = gt.constant(rng.standard_normal((7, 5)))
    kernel1, bias1 = layer_vars(rng, 5, 8)
    kernel2, bias2 = layer_vars(rng, 8, 6)
    with gt.GradientTape() as t2:
        with gt.GradientTape() as t1:
            out = dense(dense(x, kernel1, bias1), kernel2, bias2)
            loss = gt.mean(out**2)
        g = t1.gradient(loss, kernel1)
    h = t2.jacobian(g, kernel1)
    assert g.shape == (5, 8)
    assert h.shape == (5, 8, 5, 8)
    h_mat = h.numpy().reshape(40, 40)
    np.testing.assert_allclose(h_mat, h_mat.T, atol=1e-10)

    # The same Hessian from the functional, forward-over-reverse route.
    def loss_of_kernel(k):
        return gt.mean(dense(dense(x, k, bias1), kernel2, bias2) ** 2)

    np.testing.assert_allclose(
        gt.hessian(loss_of_kernel)(kernel1).numpy().reshape(40, 40), h_mat, atol=1e-10
    )


def test_10_newton_step_reaches_the_minimum_of_a_quadratic() -> None:
    rng = np.random.default_rng(100)
    # Well conditioned (Hessian eigenvalues >> the 1e-3 damping), so the damped Newton
    # step lands on the minimum to within the tolerance.
    a = rng.standard_normal((12, 5)) * 10
    target = rng.standard_normal((12, 8))
    kernel = gt.Variable(rng.standard_normal((5, 8)))
    a_t, y_t = gt.constant(a), gt.constant(target)

    def loss_value() -> gt.Tensor:
        return gt.mean((a_t @ kernel - y_t) ** 2)

    with gt.GradientTape() as t2:
        with gt.GradientTape() as t1:
            loss = loss_value()
        g = t1.gradient(loss, kernel)
    h_mat = t2.jacobian(g, kernel).numpy().reshape(40, 40)
    step = np.linalg.solve(h_mat + 1e-3 * np.eye(40), g.numpy().reshape(40))
    kernel.assign_sub(step.reshape(5, 8))
    minimum = np.mean((a @ np.linalg.lstsq(a, target, rcond=None)[0] - target) ** 2)
    assert float(loss_value()) == pytest.approx(minimum, rel=1e-5)
    assert float(loss_value()) < float(loss)


# ---- 11 and 12. batch jacobian -------------------------------------------------------------
def _two_layers(rng: np.random.Generator):
    k1, b1 = layer_vars(rng, 5, 8)
    k2, b2 = layer_vars(rng, 8, 6)
    return k1, b1, k2, b2


def test_11_batch_jacobian() -> None:
    rng = np.random.default_rng(11)
    x = gt.constant(rng.standard_normal((7, 5)))
    k1, b1, k2, b2 = _two_layers(rng)
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = dense(dense(x, k1, b1, gt.elu), k2, b2, gt.elu)
    assert y.shape == (7, 6)
    j = tape.jacobian(y, x).numpy()
    assert j.shape == (7, 6, 7, 5)
    for b in range(7):
        for c in range(7):
            if b != c:
                assert np.all(j[b, :, c, :] == 0)
    bj = tape.batch_jacobian(y, x).numpy()
    assert bj.shape == (7, 6, 5)
    np.testing.assert_allclose(bj, j.sum(axis=2), atol=1e-12)
    # and the diagonal blocks, one by one
    for b in range(7):
        np.testing.assert_allclose(bj[b], j[b, :, b, :], atol=1e-12)


def test_12_batch_jacobian_misuse_is_reported() -> None:
    rng = np.random.default_rng(12)
    x = gt.constant(rng.standard_normal((7, 5)))
    k1, b1, k2, b2 = _two_layers(rng)
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        h = gt.batch_norm(dense(x, k1, b1, gt.elu))
        y = dense(h, k2, b2, gt.elu)
    j = tape.jacobian(y, x).numpy()
    off_diagonal = max(np.abs(j[b, :, c, :]).max() for b in range(7) for c in range(7) if b != c)
    assert off_diagonal > 1e-3, "batch norm mixes the examples"
    with pytest.raises(gt.BatchDependenceError, match="not independent"):
        tape.batch_jacobian(y, x)
    # Unchecked, it is what TensorFlow returns: each example's rows summed over the
    # output examples, which here has no per-example meaning.
    summed = tape.batch_jacobian(y, x, check_independence=False)
    np.testing.assert_allclose(summed.numpy(), j.sum(axis=0).transpose(1, 0, 2), atol=1e-12)


# ---- 13. persistent tapes ------------------------------------------------------------------
def test_13_persistent_tapes() -> None:
    x = gt.constant(3.0)
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    assert float(tape.gradient(y, x)) == 6.0
    with pytest.raises(RuntimeError, match="non-persistent GradientTape"):
        tape.gradient(y, x)

    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = x * x
        z = y * y
    assert float(tape.gradient(z, x)) == 108.0
    assert float(tape.gradient(y, x)) == 6.0
    assert float(tape.gradient(z, y)) == 18.0


# ---- 14. HVP reuse -------------------------------------------------------------------------
def _mlp_loss(x: gt.Tensor, y: gt.Tensor):
    def loss(k1, b1, k2, b2):
        return gt.mean((gt.tanh(x @ k1 + b1) @ k2 + b2 - y) ** 2)

    return loss


def test_14_hvp_reuse() -> None:
    rng = np.random.default_rng(14)
    x, y = gt.constant(rng.standard_normal((16, 6))), gt.constant(rng.standard_normal((16, 3)))
    params = [gt.constant(rng.standard_normal(s) * 0.5) for s in [(6, 8), (8,), (8, 3), (3,)]]
    calls = {"n": 0}
    base = _mlp_loss(x, y)

    def loss(*ps):
        calls["n"] += 1
        return base(*ps)

    op = gt.hessian_operator(loss, *params)
    assert calls["n"] == 1
    records = len(op._tape._records)
    for _ in range(5):
        v = [gt.constant(rng.standard_normal(p.shape)) for p in params]
        reused = op.hvp(*v)
        fresh = gt.hvp(base, params, v)
        for a, b in zip(reused, fresh):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-11)
    assert calls["n"] == 1, "no forward pass after the first"
    assert len(op._tape._records) == records, "HVPs record nothing new"

    # HVP == Hessian @ v, and the batched form equals the loop.
    flat_h = gt.hessian(lambda k1: base(k1, *params[1:]))(params[0]).numpy().reshape(48, 48)
    v0 = rng.standard_normal((4, 6, 8))
    many = op.hvp_many(gt.constant(v0), *[gt.zeros((4,) + p.shape, "float64") for p in params[1:]])
    for k in range(4):
        # the k1 block of H v where v only has a k1 part
        np.testing.assert_allclose(
            many[0].numpy()[k].ravel(), flat_h @ v0[k].ravel(), rtol=1e-9, atol=1e-11
        )


def test_14_hvp_memory_is_flat_over_10000_calls() -> None:
    rng = np.random.default_rng(140)
    x, y = gt.constant(rng.standard_normal((8, 4))), gt.constant(rng.standard_normal((8, 2)))
    params = [gt.constant(rng.standard_normal(s)) for s in [(4, 5), (5,), (5, 2), (2,)]]
    op = gt.hessian_operator(_mlp_loss(x, y), *params)
    records = len(op._tape._records)
    v = [gt.constant(rng.standard_normal(p.shape)) for p in params]
    tracemalloc.start()
    try:
        for _ in range(1000):  # warm up: plans, cached VJP closures, allocator free lists
            op.hvp(*v)
        checkpoints = []
        for _ in range(5):
            for _ in range(2_000):
                op.hvp(*v)
            checkpoints.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # Each HVP allocates and frees the same temporaries, so the bytes still allocated
    # after 2,000, 4,000, ... 10,000 more calls only wobble (free lists); a leak of 8 bytes per
    # HVP would add 48 KB between the first two and the last two checkpoints.
    growth = (checkpoints[-1] + checkpoints[-2]) / 2 - (checkpoints[0] + checkpoints[1]) / 2
    assert growth < 48_000, f"allocated bytes grew by {growth:.0f}: {checkpoints}"
    assert len(op._tape._records) == records


def test_14_scipy_trust_ncg_uses_the_operator() -> None:
    rng = np.random.default_rng(141)
    a = gt.constant(rng.standard_normal((20, 4)))
    b = gt.constant(rng.standard_normal(20))

    def loss(w):  # a smooth, strictly convex objective
        r = a @ w - b
        return gt.mean(r * r) + 0.1 * gt.sum(gt.softplus(w) ** 2)

    w0 = gt.constant(np.zeros(4))
    op = gt.hessian_operator(loss, w0)
    result = scipy.optimize.minimize(
        op.fun, np.zeros(4), jac=op.jac, hessp=op.hessp, method="trust-ncg", options={"gtol": 1e-9}
    )
    assert result.success
    np.testing.assert_allclose(op.jac(result.x), 0, atol=1e-6)
    # the same minimum as BFGS on the plain gradient
    ref = scipy.optimize.minimize(
        lambda w: float(loss(gt.constant(w))),
        np.zeros(4),
        jac=lambda w: gt.grad(loss)(gt.constant(w)).numpy(),
        method="BFGS",
    )
    np.testing.assert_allclose(result.x, ref.x, atol=1e-5)


# ---- 15. three ways to ask -----------------------------------------------------------------
def test_15_three_ways_to_ask() -> None:
    w1, w2 = gt.Variable(2.0), gt.Variable(3.0)
    x1, x2 = gt.constant(5.0), gt.constant(7.0)

    def s_of(a, b):
        return a * x1 + b * x2

    # value
    assert float(s_of(w1, w2)) == 31.0
    # gradient over one variable
    with gt.GradientTape() as tape:
        s = s_of(w1, w2)
    assert float(tape.gradient(s, w1)) == 5.0
    # gradient over the arguments (x1, x2)
    g = gt.grad(lambda a, b: w1 * a + w2 * b, argnums=(0, 1))(x1, x2)
    assert [float(t) for t in g] == [2.0, 3.0]
    # gradient over all trainable variables the function touched
    pairs = gt.implicit_gradients(lambda: s_of(w1, w2))()
    assert [(float(gr), v) for gr, v in pairs] == [(5.0, w1), (7.0, w2)]
    # w1 not trainable: only w2 comes back
    w1_frozen = gt.Variable(2.0, trainable=False)
    pairs = gt.implicit_gradients(lambda: s_of(w1_frozen, w2))()
    assert [(float(gr), v) for gr, v in pairs] == [(7.0, w2)]
    # value and gradients in one call
    value, pairs = gt.implicit_value_and_gradients(lambda: s_of(w1, w2))()
    assert float(value) == 31.0 and [float(gr) for gr, _ in pairs] == [5.0, 7.0]
    value, grads = gt.value_and_grad(s_of, argnums=(0, 1))(w1, w2)
    assert float(value) == 31.0 and [float(t) for t in grads] == [5.0, 7.0]


# ---- 16. nested tapes, by hand -------------------------------------------------------------
def test_16_nested_tapes_by_hand() -> None:
    x, y = gt.constant(3.0), gt.constant(2.0)
    with gt.GradientTape() as tape:
        tape.watch(x)
        z = x * x
    assert float(tape.gradient(z, x)) == 6.0

    with gt.GradientTape() as outer:
        outer.watch(y)
        with gt.GradientTape() as inner:
            inner.watch(x)
            z = x * y * y
        dz_dx = inner.gradient(z, x)
    assert float(dz_dx) == 4.0
    assert float(outer.gradient(dz_dx, y)) == 4.0

    with gt.GradientTape() as outer:
        outer.watch(x)
        with gt.GradientTape() as inner:
            inner.watch(x)
            yy = x * x
        dy_dx = inner.gradient(yy, x)
    assert float(dy_dx) == 6.0
    assert float(outer.gradient(dy_dx, x)) == 2.0

    with gt.GradientTape() as tz, gt.GradientTape() as tm:
        tz.watch(x)
        tm.watch(y)
        z = x * x + y
        m = y + y * y + x
    assert float(tz.gradient(z, x)) == 6.0
    assert float(tm.gradient(m, y)) == 5.0

    with gt.GradientTape(persistent=True) as tape:
        tape.watch([x, y])
        z = x * x + y
        m = y + y * y + x
    assert float(tape.gradient(z, x)) == 6.0
    assert float(tape.gradient(m, y)) == 5.0


# ---- 17. gradient penalty (WGAN-GP) --------------------------------------------------------
def test_17_gradient_penalty() -> None:
    rng = np.random.default_rng(17)
    gen = [*layer_vars(rng, 3, 8), *layer_vars(rng, 8, 4)]
    critic = [*layer_vars(rng, 4, 8), *layer_vars(rng, 8, 1)]
    z_np, real_np = rng.standard_normal((6, 3)), rng.standard_normal((6, 4))
    alpha_np = rng.uniform(size=(6, 1))

    def mlp(h, p, act):
        return dense(act(h @ p[0] + p[1]), p[2], p[3], act=lambda t: t)

    def penalty(critic_params) -> gt.Tensor:
        fake = mlp(gt.constant(z_np), gen, gt.tanh)
        inter = gt.constant(alpha_np) * gt.constant(real_np) + (
            1 - gt.constant(alpha_np)
        ) * gt.stop_gradient(fake)
        with gt.GradientTape() as gp_tape:
            gp_tape.watch(inter)
            score = mlp(inter, critic_params, gt.tanh)
        g = gp_tape.gradient(score, inter)
        return gt.mean((gt.norm(g, axis=1) - 1.0) ** 2)

    with gt.GradientTape(persistent=True) as tape:
        gp = penalty(critic)
    grads = tape.gradient(gp, critic)
    # The penalty sees the critic only through its input gradient, which does not involve
    # the output bias: that one is truly unconnected (None, as in TensorFlow)...
    assert grads[3] is None
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads[:3])
    # ...and asked with unconnected_gradients="zero", every gradient is a finite array.
    grads = tape.gradient(gp, critic, unconnected_gradients="zero")
    assert all(np.all(np.isfinite(g.numpy())) for g in grads)
    np.testing.assert_array_equal(grads[3].numpy(), 0)

    def reference(*arrays):
        return float(penalty([gt.constant(a) for a in arrays]).numpy())

    expected = fd_grad(reference, [p.numpy() for p in critic])
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
