"""Tape behaviour: fan-out, reuse, unconnected sources, structures, persistence,
nesting, custom gradients, variables, dtype policy and the errors users meet."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import backend, trace


def test_fan_out_and_reuse_accumulate() -> None:
    x = gt.constant(1.5, dtype="float64")
    with gt.GradientTape() as tape:
        tape.watch(x)
        a = x * x  # used three times below
        y = a + a * x + gt.sin(a)
    expected = 2 * 1.5 + 3 * 1.5**2 + np.cos(1.5**2) * 2 * 1.5
    assert float(tape.gradient(y, x)) == pytest.approx(expected)


def test_unconnected_sources_none_or_zero() -> None:
    x, y = gt.Variable([1.0, 2.0]), gt.Variable([[3.0]])
    with gt.GradientTape(persistent=True) as tape:
        z = gt.sum(x * 2.0)
    assert tape.gradient(z, y) is None
    zero = tape.gradient(z, y, unconnected_gradients="zero")
    assert zero.shape == (1, 1) and zero.dtype == np.float32 and float(zero.numpy().sum()) == 0
    with pytest.raises(ValueError, match="'none' or 'zero'"):
        tape.gradient(z, y, unconnected_gradients="nan")


def test_nested_structures_come_back_in_shape() -> None:
    a, b, c = gt.Variable(1.0), gt.Variable(2.0), gt.Variable(3.0)
    with gt.GradientTape() as tape:
        z = a * b * c
    grads = tape.gradient(z, {"first": [a, (b,)], "second": {"c": c}})
    assert float(grads["first"][0]) == 6.0
    assert isinstance(grads["first"][1], tuple) and float(grads["first"][1][0]) == 3.0
    assert float(grads["second"]["c"]) == 2.0


def test_multiple_targets_add_up_and_output_gradients_weight_them() -> None:
    x = gt.Variable([1.0, 2.0])
    with gt.GradientTape(persistent=True) as tape:
        y1, y2 = x * x, 3.0 * x
    np.testing.assert_allclose(tape.gradient([y1, y2], x).numpy(), [5.0, 7.0])
    weights = [gt.constant([1.0, 0.0]), gt.constant([0.0, 2.0])]
    np.testing.assert_allclose(
        tape.gradient([y1, y2], x, output_gradients=weights).numpy(), [2.0, 6.0]
    )
    with pytest.raises(ValueError, match="shape"):
        tape.gradient(y1, x, output_gradients=gt.constant([1.0]))


def test_broadcasting_is_undone() -> None:
    w = gt.Variable(np.ones((1, 3)))
    b = gt.Variable(2.0, dtype="float64")
    x = gt.constant(np.arange(12.0).reshape(4, 3))
    with gt.GradientTape() as tape:
        y = gt.sum(x * w + b)
    gw, gb = tape.gradient(y, [w, b])
    assert gw.shape == (1, 3) and gb.shape == ()
    np.testing.assert_allclose(gw.numpy(), x.numpy().sum(0, keepdims=True))
    assert float(gb) == 12.0


def test_the_backward_walks_shortcuts_agree_with_numpy_and_with_repeated_passes() -> None:
    # The walk's common cases take shortcuts (a variable's read passes its cotangent on
    # as is; a bias's leading axes are summed without a reshape; a sum over leading axes
    # broadcasts back without one; a record whose second input alone is reached; a
    # non-persistent tape keeps no rule stages): each against NumPy, through one pass,
    # a persistent tape's repeated passes, and a jacobian's batch axes.
    rng = np.random.default_rng(3)
    x_np, w_np = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    b_np, s_np = rng.standard_normal(3), rng.standard_normal((1, 3))
    x, w, b, s = (gt.Variable(a, dtype="float64") for a in (x_np, w_np, b_np, s_np))
    two = gt.constant(2.0, dtype="float64")

    def loss() -> gt.Tensor:
        h = gt.tanh(x @ w + b) * s  # a bias (3,) and a stretched (1, 3) broadcast
        col = gt.sum(h, axis=0)  # leading axis reduced: broadcast back without reshape
        return gt.mean(two * (col * col)) + gt.sum(w * w)  # `two`: only input 1 reached

    h_np = np.tanh(x_np @ w_np + b_np)
    col_np = (h_np * s_np).sum(0)
    g_h = (np.broadcast_to(4 * col_np / 3, h_np.shape) * s_np) * (1 - h_np**2)
    want = [g_h @ w_np.T, x_np.T @ g_h + 2 * w_np, g_h.sum(0), (h_np * 4 * col_np / 3).sum(0)]
    with gt.GradientTape() as once:
        y = loss()
    for got, expected in zip(once.gradient(y, [x, w, b, s]), want, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.reshape(got.shape), rtol=1e-10, atol=1e-12)
    with gt.GradientTape(persistent=True) as tape:
        y = loss()
    first = [g.numpy() for g in tape.gradient(y, [x, w, b, s])]
    again = [g.numpy() for g in tape.gradient(y, [x, w, b, s])]
    for a, c, expected in zip(first, again, want, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_allclose(a, expected.reshape(a.shape), rtol=1e-10, atol=1e-12)
    with gt.GradientTape() as tape:
        col = gt.sum(gt.tanh(x @ w + b), axis=0)
    jac = tape.jacobian(col, b).numpy()  # batch axes in front of every cotangent
    np.testing.assert_allclose(jac, np.diag((1 - h_np**2).sum(0)), rtol=1e-10, atol=1e-12)


def test_watch_accessed_variables_false_and_non_trainable() -> None:
    w = gt.Variable(2.0)
    frozen = gt.Variable(3.0, trainable=False)
    with gt.GradientTape(watch_accessed_variables=False) as tape:
        y = w * frozen
    assert tape.gradient(y, w) is None
    with gt.GradientTape() as tape:
        y = w * frozen
    assert tape.watched_variables() == (w,)
    with gt.GradientTape() as tape:
        tape.watch(frozen)
        y = w * frozen
    assert set(map(id, tape.watched_variables())) == {id(w), id(frozen)}


def test_variables_assign() -> None:
    v = gt.Variable([1.0, 2.0], name="v")
    v.assign_sub([0.5, 0.5])
    v.assign_add(gt.constant([1.0, 1.0]))
    np.testing.assert_allclose(v.numpy(), [1.5, 2.5])
    with pytest.raises(ValueError, match="shape"):
        v.assign([1.0])
    assert v.dtype == np.float32


def test_gradient_inside_the_context_is_not_recorded_on_itself() -> None:
    x = gt.Variable(3.0)
    with gt.GradientTape(persistent=True) as tape:
        y = x * x
        g = tape.gradient(y, x)
        before = len(tape._records)
        z = y * 2.0
    assert float(g) == 6.0
    assert len(tape._records) == before + 1
    assert float(tape.gradient(z, x)) == 12.0


def test_custom_gradient_with_two_inputs_and_forward_mode() -> None:
    @gt.custom_gradient
    def scaled_product(a, b):
        def grad_fn(g):
            return g * b * 10.0, g * a  # a deliberately "wrong" gradient for a

        return a * b, grad_fn

    a, b = gt.constant(2.0, "float64"), gt.constant(5.0, "float64")
    with gt.GradientTape() as tape:
        tape.watch([a, b])
        y = scaled_product(a, b)
    ga, gb = tape.gradient(y, [a, b])
    assert float(ga) == 50.0 and float(gb) == 2.0
    # Forward mode uses the body's own derivative, as TensorFlow: J = [b, a].
    _, t = gt.jvp(
        scaled_product, (a, b), (gt.constant(1.0, "float64"), gt.constant(1.0, "float64"))
    )
    assert float(t) == pytest.approx(7.0)
    with pytest.raises(ValueError, match="returned 1 gradient"):

        @gt.custom_gradient
        def bad(a, b):
            return a * b, lambda g: g

        with gt.GradientTape() as tape:
            tape.watch([a, b])
            y = bad(a, b)
        tape.gradient(y, [a, b])


def test_integer_sources_are_an_error_and_integers_flow() -> None:
    i = gt.constant([1, 2, 3])
    assert i.dtype == np.int32
    x = gt.Variable([1.0, 2.0, 3.0])
    with gt.GradientTape() as tape:
        tape.watch(i)
        y = gt.sum(x * gt.cast(i, "float32"))
    with pytest.raises(TypeError, match="int32"):
        tape.gradient(y, i)


def test_dtype_policy() -> None:
    assert gt.constant(1.0).dtype == np.float32
    assert gt.constant(np.float64(1.0)).dtype == np.float64
    assert gt.constant(np.ones(2)).dtype == np.float64
    assert gt.constant(True).dtype == np.bool_
    assert (gt.constant(np.ones(2)) * 2.0).dtype == np.float64
    with pytest.raises(TypeError, match=r"gt\.cast"):
        gt.constant(np.ones(2, np.float32)) + gt.constant(np.ones(2))
    with pytest.raises(TypeError, match="cast the tensor"):
        gt.constant([1, 2]) * 0.5
    with pytest.raises(TypeError, match="true division"):
        gt.constant([1, 2]) / 2


def test_clear_errors_for_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"matmul: inner dimensions differ: \(2, 3\) @ \(4, 5\)"):
        gt.ones((2, 3)) @ gt.ones((4, 5))
    with pytest.raises(ValueError, match=r"add: .*\(2, 3\) and \(4,\)"):
        gt.ones((2, 3)) + gt.ones((4,))
    with pytest.raises(ValueError, match="reshape"):
        gt.reshape(gt.ones((2, 3)), (4, 2))
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        gt.sum(gt.ones((2, 3)), axis=3)
    with pytest.raises(IndexError, match="out of bounds"):
        gt.ones((2, 3))[5]


def test_missing_rule_names_the_op() -> None:
    from engine.registry import MissingRuleError, get_vjp, primitive

    p = primitive("undifferentiable_test_op", lambda xp, x: x)
    with pytest.raises(MissingRuleError, match="undifferentiable_test_op"):
        get_vjp(p)


def test_cuda_device_is_a_clear_error_without_a_gpu() -> None:
    if backend.cuda_available():
        pytest.skip("a GPU is present; the error path is for hosts without one")
    with pytest.raises(gt.DeviceError, match="cuda"):
        gt.constant([1.0], device="cuda")
    with pytest.raises(gt.DeviceError, match="unknown device"):
        gt.constant([1.0], device="tpu")


def test_tensor_conveniences() -> None:
    x = gt.constant([[1.0, 2.0], [3.0, 4.0]])
    assert len(x) == 2 and x.ndim == 2 and x.size == 4 and x.device == "cpu"
    np.testing.assert_array_equal(np.asarray(x), x.numpy())
    np.testing.assert_array_equal(x.T.numpy(), x.numpy().T)
    np.testing.assert_array_equal(x.reshape(4).numpy(), [1, 2, 3, 4])
    np.testing.assert_array_equal((np.ones(2) * gt.constant(np.ones(2))).numpy(), [1, 1])
    assert "shape=(2, 2)" in repr(x)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x)


def test_seeded_random_and_creation_helpers() -> None:
    a = gt.random.normal((3, 4), seed=1)
    b = gt.random.normal((3, 4), seed=1)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.dtype == np.float32
    u = gt.random.uniform((1000,), seed=2, minval=-1, maxval=1)
    assert -1 <= float(gt.min(u)) and float(gt.max(u)) < 1
    np.testing.assert_array_equal(gt.eye(2).numpy(), np.eye(2))
    np.testing.assert_allclose(gt.linspace(0, 1, 5).numpy(), np.linspace(0, 1, 5))
    assert gt.zeros((2,)).dtype == np.float32 and gt.ones((2,), "float64").dtype == np.float64


def test_nested_gradient_through_jacobian_of_gradient_and_forward_over_reverse() -> None:
    x = gt.constant([0.3, -0.7, 1.1], dtype="float64")

    def f(t):
        return gt.sum(gt.sin(t) * t**2)

    h_fwd = gt.hessian(f)(x).numpy()
    h_rev = gt.jacrev(gt.grad(f))(x).numpy()
    h_fwd_fwd = gt.jacfwd(gt.jacfwd(f))(x).numpy()
    np.testing.assert_allclose(h_fwd, h_rev, atol=1e-12)
    np.testing.assert_allclose(h_fwd, h_fwd_fwd, atol=1e-12)
    xs = x.numpy()
    expected = np.diag(2 * np.sin(xs) + 4 * xs * np.cos(xs) - xs**2 * np.sin(xs))
    np.testing.assert_allclose(h_fwd, expected, atol=1e-12)


def test_tune_allocator_on_glibc() -> None:
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt tuning is for glibc")
    assert gt.tune_allocator() is True


def test_index_arrays_and_ints_split_by_a_slice_are_refused_clearly() -> None:
    x = gt.ones((2, 3, 4))
    with pytest.raises(IndexError, match="separated by a slice"):
        x[np.array([0, 1]), :, 0]
    np.testing.assert_array_equal(x[np.array([0, 1]), 0].numpy(), np.ones((2, 4)))
    with pytest.raises(TypeError, match="axis must be an int"):
        gt.argmax(x, axis=(0, 1))


# ---- semantics settled by review (each of these was once wrong) -------------------------
def test_assign_after_the_forward_pass_does_not_change_the_gradient() -> None:
    v = gt.Variable(2.0)
    with gt.GradientTape() as tape:
        y = v * v
    v.assign(10.0)
    assert float(tape.gradient(y, v)) == 4.0
    same = gt.reshape(v, ())  # an op that returns its input hands back a snapshot
    v.assign(3.0)
    assert float(same) == 10.0


def test_sources_the_tape_never_watched_get_none() -> None:
    a, b = gt.constant(3.0), gt.constant(5.0)
    with gt.GradientTape() as tape:
        tape.watch(a)
        y = a * b
    ga, gb = tape.gradient(y, [a, b])
    assert float(ga) == 5.0 and gb is None
    w, frozen = gt.Variable(5.0), gt.Variable(2.0, trainable=False)
    with gt.GradientTape() as tape:
        y = w * frozen
    gw, gf = tape.gradient(y, [w, frozen])
    assert float(gw) == 2.0 and gf is None


def test_persistent_tape_differentiates_its_own_gradient_inside_its_context() -> None:
    x = gt.constant(2.0)
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = x**3
        dy = tape.gradient(y, x)
    assert float(dy) == 12.0
    assert float(tape.gradient(dy, x)) == 12.0


def test_non_persistent_tape_stops_recording_and_lets_go_after_gradient() -> None:
    import gc
    import weakref

    x = gt.constant(np.ones(1000))
    with gt.GradientTape() as tape:
        tape.watch(x)
        h = x * 2.0
        y = gt.sum(h * h)
        tape.gradient(y, x)
        z = y * 3.0
    assert tape._records == [] and not tape._watched
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None
    assert float(z) == 12000.0


def test_last_pass_lets_each_recorded_value_go_once_the_sweep_has_passed_it() -> None:
    """A non-persistent tape's gradient frees a forward value (and, under an accumulator,
    its tangent) when the last record that holds it has been passed, not when the sweep
    ends (issue 28: the fresh HVP's peak held every layer's activations and tangents)."""
    import weakref

    alive_at_probe: list[tuple[bool, bool]] = []
    refs: dict[str, weakref.ref] = {}

    @gt.custom_gradient
    def probe(a):
        def grad_fn(g):
            # The sweep reaches this after every record made later in the forward pass.
            tangent = refs.get("tangent")  # (under an accumulator only)
            alive_at_probe.append(
                (refs["later"]() is not None, tangent is not None and tangent() is not None)
            )
            return g

        return a * 1.0, grad_fn

    def f(x):
        a = probe(gt.sin(x))
        later = gt.tanh(a + 0.5)  # read by tanh's own rule and by the multiply's
        refs["later"] = weakref.ref(later)
        if trace.active_accumulators:
            refs["tangent"] = weakref.ref(trace.active_accumulators[-1].jvp(later))
        return gt.sum(later * later)

    x = gt.constant(np.linspace(-1.0, 1.0, 5))
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
    g = tape.gradient(y, x)
    t = np.tanh(np.sin(x.numpy()) + 0.5)
    np.testing.assert_allclose(g.numpy(), 2 * t * (1 - t * t) * np.cos(x.numpy()), rtol=1e-12)
    assert alive_at_probe == [(False, False)]
    alive_at_probe.clear()

    # A fresh HVP: the inner tape's last pass under the accumulator; the tangent goes too.
    (hv,) = gt.hvp(f, [x], [gt.constant(np.ones(5))])
    assert alive_at_probe == [(False, False)]
    eps = 1e-6
    grad = gt.grad(f)
    fd = (grad(x + eps).numpy() - grad(x - eps).numpy()) / (2 * eps)
    np.testing.assert_allclose(hv.numpy(), fd, rtol=1e-6, atol=1e-8)

    # A persistent tape keeps its records for the next call: the value is still there.
    with gt.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = f(x)
    tape.gradient(y, x)
    assert alive_at_probe[-1][0] is True
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), g.numpy())


def test_derivatives_at_zero() -> None:
    zero = gt.constant(0.0, "float64")
    assert float(gt.grad(gt.softplus)(zero)) == 0.5
    assert float(gt.grad(gt.log_sigmoid)(zero)) == 0.5
    sce = gt.grad(lambda t: gt.sigmoid_cross_entropy(t, gt.constant(1.0, "float64")))(zero)
    assert float(sce) == -0.5
    np.testing.assert_array_equal(
        gt.jacrev(lambda t: gt.clip_by_norm(t, 1.0))(gt.zeros((3,), "float64")).numpy(), np.eye(3)
    )
    # integer powers stay finite at 0 to every order
    d = gt.grad(gt.grad(gt.grad(lambda t: t**2)))(zero)
    assert float(d) == 0.0
    assert float(gt.grad(gt.grad(lambda t: t**3))(zero)) == 0.0
    assert float(gt.grad(lambda t: t**-2)(gt.constant(2.0, "float64"))) == -0.25


def test_casts_to_integers_carry_no_gradient() -> None:
    x = gt.constant([1.7, 2.2])
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = gt.sum(gt.cast(gt.cast(x, "int32"), "float32") * 3.0 + x)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [1.0, 1.0])


def test_integer_reductions_keep_their_dtype() -> None:
    i = gt.constant([1, 2, 3])
    assert gt.sum(i).dtype == np.int32 and gt.prod(i).dtype == np.int32
    assert int(gt.sum(i) + i[0]) == 7
    assert gt.sum(gt.constant([True, False, True])).dtype == np.int32


def test_prod_gradient_with_zeros_and_large_groups() -> None:
    x = gt.constant([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0], [1.0, 2.0, 4.0]], "float64")
    g = gt.grad(lambda t: gt.sum(gt.prod(t, axis=1)))(x).numpy()
    np.testing.assert_array_equal(g, [[0.0, 6.0, 0.0], [0.0, 0.0, 0.0], [8.0, 4.0, 2.0]])
    big = gt.constant(np.full(200_000, 1.0000001))  # no (n, n) workspace
    assert gt.grad(lambda t: gt.prod(t))(big).shape == (200_000,)


def test_hessian_operator_records_nothing_on_tapes_around_it() -> None:
    w = gt.Variable([1.0, 2.0], dtype="float64")
    op = gt.hessian_operator(lambda k: gt.sum(k * k * w), gt.constant([3.0, 4.0], "float64"))
    with gt.GradientTape() as unrelated:
        for _ in range(10):
            (hv,) = op.hvp(gt.constant([1.0, 1.0], "float64"))
    assert unrelated._records == []
    np.testing.assert_array_equal(hv.numpy(), [2.0, 4.0])


def test_custom_gradient_checks_what_grad_fn_returns() -> None:
    @gt.custom_gradient
    def wrong_shape(a):
        return a * 2.0, lambda g: gt.ones((5,))

    x = gt.constant([1.0, 2.0])
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = wrong_shape(x)
    with pytest.raises(ValueError, match=r"wrong_shape.*shape"):
        tape.gradient(y, x)


def test_stop_recording_outside_the_context_is_an_error() -> None:
    tape = gt.GradientTape()
    with pytest.raises(RuntimeError, match="not recording"), tape.stop_recording():
        pass


def test_index_arrays_are_bounds_checked_and_tensors_iterate() -> None:
    x = gt.ones((3, 2))
    with pytest.raises(IndexError, match="index 3 is out of bounds for axis 0 of size 3"):
        x[np.array([0, 3])]
    assert [r.shape for r in x] == [(2,), (2,), (2,)]
    with pytest.raises(TypeError, match="0-d"):
        list(gt.constant(1.0))


# ---- TensorFlow's behaviour (issue 19); the numbers are in test_tf_parity.py ----


def test_custom_gradient_reading_a_variable_needs_a_variables_keyword() -> None:
    v = gt.Variable(np.array([1.0, 2.0]))

    @gt.custom_gradient
    def scale(x):
        return x * v, lambda dy: dy * v

    with gt.GradientTape() as tape:
        tape.watch(x := gt.constant(np.array([3.0, 4.0])))
        with pytest.raises(TypeError, match="variables"):
            scale(x)

    @gt.custom_gradient
    def scale_ok(x):
        def grad_fn(dy, variables=None):
            (var,) = variables
            assert var is v
            return dy * v, [dy * x]

        return x * v, grad_fn

    with gt.GradientTape() as tape:
        tape.watch(x)
        y = gt.sum(scale_ok(x))
    gx, gv = tape.gradient(y, [x, v])
    assert gx.numpy().tolist() == [1.0, 2.0] and gv.numpy().tolist() == [3.0, 4.0]


def test_custom_gradient_body_is_recorded_for_outer_tapes() -> None:
    @gt.custom_gradient
    def f(x):
        e = gt.exp(x)
        return e, lambda g: g * e

    x = gt.constant(np.array([0.5, -1.0]))
    with gt.GradientTape() as outer:
        outer.watch(x)
        with gt.GradientTape() as inner:
            inner.watch(x)
            y = gt.sum(f(x))
        g = inner.gradient(y, x)
    np.testing.assert_allclose(outer.gradient(g, x).numpy(), np.exp([0.5, -1.0]))


def test_tensorflow_misuse_raises_as_tensorflow() -> None:
    x = gt.constant(np.array([1.0, 2.0]))
    tape = gt.GradientTape(persistent=True)
    with tape:
        tape.watch(x)
        y = x * x
        tape.reset()  # inside the context: fine
        tape.watch(x)
        y = x * x
    with pytest.raises(ValueError, match="not recording"):
        tape.reset()
    with pytest.raises(ValueError, match="rank 2"):
        tape.batch_jacobian(y, x)
    np.testing.assert_allclose(
        tape.gradient(y, x, output_gradients=gt.constant(3.0, "float64")).numpy(), [6.0, 12.0]
    )


def test_namedtuple_sources_and_enum() -> None:
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    x, z = gt.constant(np.array(2.0)), gt.constant(np.array(5.0))
    with gt.GradientTape() as tape:
        tape.watch([x, z])
        y = x * x
    out = tape.gradient(y, Pair(x, z), unconnected_gradients=gt.UnconnectedGradients.ZERO)
    assert isinstance(out, Pair) and float(out.a) == 4.0 and float(out.b) == 0.0


def test_watched_variables_in_creation_order() -> None:
    a, b, c = gt.Variable(1.0), gt.Variable(2.0), gt.Variable(3.0)
    with gt.GradientTape() as tape:
        _ = c * b * a
    assert tape.watched_variables() == (a, b, c)


def test_a_call_from_inside_the_last_sweep_is_refused_as_a_second_use() -> None:
    """A custom gradient's rule asking the same non-persistent tape again, while the tape's
    last pass is sweeping (its records already handed to the sweep): the second-use error,
    not an answer from no records (found by review r9: it answered None)."""
    seen: dict = {}

    @gt.custom_gradient
    def probe(a):
        def grad_fn(g):
            try:
                seen["inner"] = seen["tape"].gradient(seen["y"], seen["x"])
            except RuntimeError as exc:
                seen["inner"] = exc
            return g

        return a * 1.0, grad_fn

    x = gt.constant(np.linspace(-1.0, 1.0, 6).reshape(2, 3))
    with gt.GradientTape() as tape:
        tape.watch(x)
        y = gt.sum(probe(gt.sin(x)) ** 2)
    seen.update(tape=tape, y=y, x=x)
    outer = tape.gradient(y, x)
    assert isinstance(seen["inner"], RuntimeError)
    assert "can only be used to compute one set" in str(seen["inner"])
    np.testing.assert_allclose(outer.numpy(), 2 * np.sin(x.numpy()) * np.cos(x.numpy()), rtol=1e-14)
