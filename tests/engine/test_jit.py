"""gt.jit: the Python API's transforms compiled per argument layout (engine/jit.py).

Every compiled call answers exactly what the dynamic transform answers (the replay makes
the same NumPy calls in the same order), with every argument new on every call; what
the contract leaves out (a value read on the host, an outside value changed) behaves as
documented."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from tests.engine.test_ops import _args, _cases
from tests.engine.test_replay import SCENARIOS


def _same(a, b) -> None:
    la, da = gt.tree.flatten(a)
    lb, db = gt.tree.flatten(b)
    assert da == db and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if not isinstance(x, gt.Tensor):
            assert x == y
            continue
        x, y = x.numpy(), y.numpy()
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y, equal_nan=True), f"max diff {np.max(np.abs(x - y))}"


def _float_argnums(args) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if np.asarray(a).dtype.kind == "f")


def _row_loss(row, shapes):
    out_shape = np.shape(row.fn(*[gt.constant(a) for a in _args(row, shapes)]).numpy())
    weights = gt.constant(np.random.default_rng(5).uniform(0.5, 1.5, out_shape))
    return lambda *xs: gt.sum(row.fn(*xs) * weights)


CASES = _cases()
# Rows whose function makes an array inside itself on every call (gt.constant of a
# literal: the "_zero" rows' zero patterns, softmax_cross_entropy_int's labels): the
# capture cannot tell it from an array derived from the arguments' values, so some of
# their calls stay dynamic (and still answer right). Every other row compiles (the
# logsumexp, softmax and attention rows included: their shift is made with ops).
MADE_OUTSIDE = {
    "softmax_cross_entropy_int",
    "xlogy_zero",
    "divide_no_nan_zero",
    "prod_zero",
}
# Rows whose gather indices come from the data (a sort's order): a replay would keep the
# captured call's order, so the capture sees the read and the calls stay dynamic. The
# embedding rows read ids the row makes outside the ops on every call (a literal here, but
# the capture cannot tell a literal from ids derived from the arguments' values, which a
# replay would freeze): dynamic too.
READ_ON_HOST = {"sort", "sort_descending", "top_k", "embedding"}


@pytest.mark.parametrize("row, shapes", CASES)
def test_every_op_row_equals_the_dynamic_transforms(row, shapes) -> None:
    """value_and_grad, hvp and jacrev of every op-table row, four calls of new arguments
    each (the second captured, the later two replayed): bit-equal to the dynamic
    transforms, and compiled unless the row makes arrays outside the ops."""
    loss = _row_loss(row, shapes)
    jitted, jitted_fn = gt.jit(loss), gt.jit(row.fn)
    nums = _float_argnums(_args(row, shapes))
    every = nums == tuple(range(len(shapes)))
    for seed in range(4):
        args = [gt.constant(a) for a in _args(row, shapes, seed=seed)]
        _same(jitted.value_and_grad(nums)(*args), gt.value_and_grad(loss, nums)(*args))
        _same(jitted_fn.jacrev(nums)(*args), gt.jacrev(row.fn, nums)(*args))
        if every:
            rng = np.random.default_rng(seed)
            tangents = [gt.constant(rng.standard_normal(a.shape)) for a in args]
            _same(jitted.hvp(args, tangents), gt.hvp(loss, args, tangents))
    status = {**jitted.status(), **jitted_fn.status()}
    assert len(status) == 2 + every, status
    if row.name in MADE_OUTSIDE:
        assert all(s == "compiled" or "outside" in s for s in status.values()), status
    elif row.name in READ_ON_HOST:
        assert all("host" in s for s in status.values()), status
    else:
        assert set(status.values()) == {"compiled"}, status


# ---- scenarios: every argument new on every call ---------------------------------------
def _mlp_with_data(act, dtype=np.float64):
    def loss(params, x, y):
        h = x
        for w, b in params[:-1]:
            h = act(h @ w + b)
        w, b = params[-1]
        return gt.mean((h @ w + b - y) ** 2)

    def draw(rng):
        shapes = [((6, 8), (8,)), ((8, 8), (8,)), ((8, 3), (3,))]
        params = [
            tuple(gt.constant((rng.standard_normal(s) * 0.5).astype(dtype)) for s in p)
            for p in shapes
        ]
        x = gt.constant(rng.standard_normal((16, 6)).astype(dtype))
        y = gt.constant(rng.standard_normal((16, 3)).astype(dtype))
        return params, x, y

    return loss, draw


MODELS = {
    "tanh": lambda: _mlp_with_data(gt.tanh),
    "relu": lambda: _mlp_with_data(gt.relu),
    "softplus float32": lambda: _mlp_with_data(gt.softplus, np.float32),
}


@pytest.mark.parametrize("name", MODELS)
def test_models_with_new_params_and_data_replay_exactly(name) -> None:
    loss, draw = MODELS[name]()
    jitted = gt.jit(loss)
    vg_all, grad_params = jitted.value_and_grad((0, 1, 2)), jitted.grad()
    rng = np.random.default_rng(1)
    answers = []
    for _ in range(4):
        params, x, y = draw(rng)
        ours = vg_all(params, x, y)
        _same(ours, gt.value_and_grad(loss, (0, 1, 2))(params, x, y))
        _same(grad_params(params, x, y), gt.grad(loss)(params, x, y))
        tangents = gt.tree.unflatten(
            gt.tree.flatten(params)[1],
            [
                gt.constant(rng.standard_normal(p.shape).astype(p.dtype))
                for p in gt.tree.flatten(params)[0]
            ],
        )
        zeros = (gt.constant(np.zeros(x.shape, x.dtype)), gt.constant(np.zeros(y.shape, y.dtype)))
        _same(
            jitted.hvp((params, x, y), (tangents, *zeros)),
            gt.hvp(loss, (params, x, y), (tangents, *zeros)),
        )
        answers.append((ours, [g.numpy().copy() for g in gt.tree.flatten(ours[1])[0]]))
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
    # Answers are fresh arrays: a later call never wrote into one handed out before.
    for ours, copies in answers:
        for g, c in zip(gt.tree.flatten(ours[1])[0], copies, strict=True):
            np.testing.assert_array_equal(g.numpy(), c)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenarios_replay_exactly(name) -> None:
    """test_replay's scenarios (data closed over, parameters as arguments): the gradient,
    the HVP and the jacobian of the gradient, compiled, with new parameters each call."""
    loss, params = SCENARIOS[name]()
    jitted = gt.jit(loss)
    nums = tuple(range(len(params)))
    rng = np.random.default_rng(2)
    for _ in range(4):
        ps = [gt.constant(rng.standard_normal(p.shape) * 0.5) for p in params]
        vs = [gt.constant(rng.standard_normal(p.shape)) for p in params]
        _same(jitted.value_and_grad(nums)(*ps), gt.value_and_grad(loss, nums)(*ps))
        _same(jitted.hvp(ps, vs), gt.hvp(loss, ps, vs))
    status = jitted.status()  # (softmax_cross_entropy too: its labels are closed over)
    assert set(status.values()) == {"compiled"}, status


def test_gradients_and_hvps_match_finite_differences() -> None:
    loss, draw = _mlp_with_data(gt.tanh)
    jitted = gt.jit(loss)
    rng = np.random.default_rng(3)
    for _ in range(3):
        params, x, y = draw(rng)
        flat, treedef = gt.tree.flatten(params)
        value, grads = jitted.value_and_grad()(params, x, y)
        grads = gt.tree.flatten(grads)[0]
        direction = [rng.standard_normal(p.shape) for p in flat]

        def at(t, flat=flat, treedef=treedef, direction=direction, x=x, y=y):
            moved = [gt.constant(p.numpy() + t * d) for p, d in zip(flat, direction)]
            return gt.tree.unflatten(treedef, moved), x, y

        eps = 1e-5
        fd = (loss(*at(eps)).numpy() - loss(*at(-eps)).numpy()) / (2 * eps)
        np.testing.assert_allclose(
            sum(np.sum(g.numpy() * d) for g, d in zip(grads, direction)), fd, rtol=1e-7
        )
        np.testing.assert_allclose(value.numpy(), loss(params, x, y).numpy(), rtol=0)
        # H v against differences of the (dynamic) gradient along v
        v = gt.tree.unflatten(treedef, [gt.constant(d) for d in direction])
        zeros = (gt.constant(np.zeros(x.shape)), gt.constant(np.zeros(y.shape)))
        hv = gt.tree.flatten(jitted.hvp((params, x, y), (v, *zeros))[0])[0]
        g_plus = gt.tree.flatten(gt.grad(loss)(*at(eps)))[0]
        g_minus = gt.tree.flatten(gt.grad(loss)(*at(-eps)))[0]
        for h, gp, gm in zip(hv, g_plus, g_minus, strict=True):
            np.testing.assert_allclose(
                h.numpy(), (gp.numpy() - gm.numpy()) / (2 * eps), rtol=1e-5, atol=1e-8
            )
    assert set(jitted.status().values()) == {"compiled"}


# ---- the contract ----------------------------------------------------------------------
def test_a_function_that_reads_a_value_on_the_host_stays_dynamic() -> None:
    """A Python branch on a value: the capture sees the host read, the key stays dynamic,
    and both branches answer right on later calls."""

    def f(w, x):
        z = gt.sum(x * w)
        if float(z) > 0:
            return z * z
        return gt.sin(z)

    jitted = gt.jit(f)
    rng = np.random.default_rng(4)
    signs = []
    for k in range(6):
        w, x = gt.constant(rng.standard_normal(3)), gt.constant(rng.standard_normal(3))
        want = 1.0 if k % 2 else -1.0  # alternate the branch taken
        w = gt.constant(want * np.sign(gt.sum(x * w).numpy()) * w.numpy())
        signs.append(float(gt.sum(x * w).numpy()) > 0)
        _same(jitted.grad()(w, x), gt.grad(f)(w, x))
        _same(jitted(w, x), f(w, x))
    assert True in signs and False in signs
    assert all("host" in s for s in jitted.status().values()), jitted.status()


def test_each_layout_is_its_own_key_and_the_cache_is_bounded() -> None:
    def f(w):
        return gt.sum(gt.tanh(w) ** 2)

    jitted = gt.jit(f, cache_size=2)
    rng = np.random.default_rng(5)
    for shape in [(3,), (4,), (3,), (2, 2)]:
        for _ in range(3):
            w = gt.constant(rng.standard_normal(shape))
            _same(jitted.grad()(w), gt.grad(f)(w))
    status = jitted.status()
    assert len(status) == 2 and set(status.values()) == {"compiled"}, status
    assert {"float64[3]", "float64[2, 2]"} == {k.split("(")[-1].rstrip(")") for k in status}
    # float32 and a non-contiguous view are other layouts; a static number is in the key
    jitted = gt.jit(lambda w, s: gt.sum(w * s), cache_size=8)
    base = rng.standard_normal((4, 4))
    for w, s in [
        (base, 2.0),
        (base.astype(np.float32), 2.0),
        (base.T, 2.0),
        (base, 3.0),
        (base, 3),
    ]:
        for _ in range(3):
            _same(
                jitted.grad()(gt.constant(w), s),
                gt.grad(lambda w, s: gt.sum(w * s))(gt.constant(w), s),
            )
    assert len(jitted.status()) == 5, jitted.status()


def test_decorator_forms_and_bad_arguments() -> None:
    @gt.jit
    def square(w):
        return gt.sum(w * w)

    @gt.jit(cache_size=1)
    def cube(w):
        return gt.sum(w * w * w)

    w = gt.constant(np.array([1.0, -2.0]))
    for _ in range(3):
        np.testing.assert_array_equal(square.grad()(w).numpy(), [2.0, -4.0])
        np.testing.assert_array_equal(cube.grad()(w).numpy(), [3.0, 12.0])
    assert cube.cache_size == 1 and "compiled" in repr(cube.status())
    with pytest.raises(TypeError, match="function"):
        gt.jit(3)
    with pytest.raises(ValueError, match="cache_size"):
        gt.jit(square.fun, cache_size=0)
    with pytest.raises(ValueError, match="argnums"):
        square.grad(argnums=2)(w)


def test_a_changed_outside_value_is_not_seen_once_compiled() -> None:
    """As jax.jit documents: what f reads outside its arguments is a constant of the
    compiled call. A number changed after the capture is not seen (the dynamic calls
    before it did see it); clear() forgets the compiled calls."""
    state = {"scale": 2.0}

    def f(w):
        return gt.sum(w * w) * state["scale"]

    jitted = gt.jit(f)
    w = gt.constant(np.array([1.0, 2.0]))
    for _ in range(3):
        assert float(jitted(w).numpy()) == 10.0
    state["scale"] = 3.0
    assert float(f(w).numpy()) == 15.0
    assert float(jitted(w).numpy()) == 10.0, "the compiled call keeps the value it saw"
    np.testing.assert_array_equal(jitted.grad()(w).numpy(), [6.0, 12.0])  # a new key: seen
    jitted.clear()
    assert float(jitted(w).numpy()) == 15.0


def test_an_assigned_variable_is_seen() -> None:
    """Variables are read anew, as tf.function reads them: an assign to one f reaches
    forgets the compiled keys (which held its old array as a constant), and the answers
    follow the new value."""
    rng = np.random.default_rng(12)
    weights = gt.Variable(rng.standard_normal((3, 2)))
    x = gt.constant(rng.standard_normal((4, 3)))

    def loss(scale):
        return gt.sum(gt.tanh(x @ weights) ** 2) * scale

    jitted = gt.jit(loss)
    scale = gt.constant(np.array(1.5))
    for step in range(4):
        for _ in range(3):
            _same(jitted.value_and_grad()(scale), gt.value_and_grad(loss)(scale))
        assert list(jitted.status().values()) == ["compiled"], (step, jitted.status())
        weights.assign(weights.value - 0.1)
    _same(jitted(scale), loss(scale))


def test_closed_over_tensors_and_arrays_are_constants_and_arguments_are_not() -> None:
    """Data closed over as a tensor or as a NumPy array is compiled in; an argument that
    is also a closed-over tensor is differentiated at both uses, as the dynamic transform
    does, so those calls run dynamically."""
    rng = np.random.default_rng(6)
    x_array = rng.standard_normal((5, 3))
    c = gt.constant(rng.standard_normal(3))

    def f(w):
        return gt.sum(gt.tanh(x_array @ w) ** 2) + gt.sum(w * c)

    jitted = gt.jit(f)
    for _ in range(3):
        w = gt.constant(rng.standard_normal(3))
        _same(jitted.value_and_grad()(w), gt.value_and_grad(f)(w))
    assert set(jitted.status().values()) == {"compiled"}
    _same(jitted.value_and_grad()(c), gt.value_and_grad(f)(c))  # c at both uses
    # A Variable argument enters as its value; one f also closes over is used at both.
    v = gt.Variable(rng.standard_normal(3))
    for _ in range(3):
        _same(jitted.value_and_grad()(v), gt.value_and_grad(f)(v))
    shared = gt.Variable(c.numpy())
    g = gt.jit(lambda w: gt.sum(w * shared) + gt.sum(w * w))
    for _ in range(3):
        _same(g.grad()(shared), gt.grad(g.fun)(shared))
    np.testing.assert_allclose(
        jitted.grad()(c).numpy(), gt.grad(f)(gt.constant(c.numpy())).numpy() + c.numpy(), rtol=1e-12
    )


def test_inside_an_outer_tape_it_runs_dynamically() -> None:
    """A replay records nothing: a jitted function differentiated from outside runs
    dynamically, and the outer gradient is right."""
    jitted = gt.jit(lambda w: gt.sum(gt.sin(w) ** 2))
    w = gt.constant(np.array([0.3, -1.2]))
    for _ in range(3):
        jitted(w)
    assert set(jitted.status().values()) == {"compiled"}
    with gt.GradientTape() as tape:
        tape.watch(w)
        out = jitted(w)
    np.testing.assert_allclose(tape.gradient(out, w).numpy(), np.sin(2 * w.numpy()), rtol=1e-12)
    # second order through the jitted gradient
    h = gt.jacrev(jitted.grad())(w).numpy()
    np.testing.assert_allclose(h, np.diag(2 * np.cos(2 * w.numpy())), rtol=1e-12)


def test_structures_aux_kwargs_and_numbers() -> None:
    def f(params, x, *, power):
        out = gt.sum((x @ params["w"] + params["b"]) ** power)
        return out, {"mean": gt.mean(x), "label": "aux", "n": x.shape[0]}

    jitted = gt.jit(f)
    rng = np.random.default_rng(7)
    for _ in range(4):
        params = {"w": gt.constant(rng.standard_normal((3, 2)).astype(np.float32)), "b": 0.5}
        x = rng.standard_normal((4, 3)).astype(np.float32)  # a NumPy array argument
        ours = jitted.value_and_grad(has_aux=True)(params, x, power=2)
        theirs = gt.value_and_grad(f, has_aux=True)(params, gt.constant(x), power=2)
        _same(ours, theirs)
        assert ours[1]["b"].dtype == np.float32  # 0.5 became a float32 tensor, as there
    assert set(jitted.status().values()) == {"compiled"}
    with pytest.raises(TypeError, match="hashable"):
        jitted(params, x, power={2})  # a set is a leaf, and unhashable


def test_jacobians_and_batch_jacobians() -> None:
    rng = np.random.default_rng(8)

    def model(w, x):
        return gt.tanh(x @ w)

    jitted = gt.jit(model)
    bjac = jitted.batch_jacobian(argnum=1)
    for _ in range(4):
        w, x = gt.constant(rng.standard_normal((3, 2))), gt.constant(rng.standard_normal((5, 3)))
        _same(jitted.jacrev((0, 1), chunk_size=4)(w, x), gt.jacrev(model, (0, 1), 4)(w, x))
        with gt.GradientTape() as tape:
            tape.watch(x)
            out = model(w, x)
        dynamic = tape.batch_jacobian(out, x)
        ours = bjac(w, x)
        _same(ours, dynamic)
        t = np.tanh(x.numpy() @ w.numpy())
        np.testing.assert_allclose(
            ours.numpy(), (1 - t**2)[:, :, None] * w.numpy().T[None], rtol=1e-12
        )
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()

    # The independence check reads the rows: it runs on every call, replayed or not.
    mixing = gt.jit(lambda x: gt.tanh(x) - gt.mean(gt.tanh(x), axis=0))
    for _ in range(4):
        with pytest.raises(gt.BatchDependenceError):
            mixing.batch_jacobian()(gt.constant(rng.standard_normal((5, 3))))
    assert set(mixing.status().values()) == {"compiled"}


def test_a_replayed_fresh_hvp_runs_no_dead_calls() -> None:
    """gt.hvp defers the gradients' own weight products (only their tangents are
    wanted); the capture's pass computes them to see their layouts, and the schedule
    leaves out every call no output needs, so a replay never runs them."""
    loss, draw = _mlp_with_data(gt.tanh)
    rng = np.random.default_rng(10)
    params, x, y = draw(rng)
    flat = gt.tree.flatten(params)[0]
    jitted = gt.jit(lambda *ps: loss(gt.tree.unflatten(gt.tree.flatten(params)[1], ps), x, y))
    for _ in range(3):
        ps = [gt.constant(rng.standard_normal(p.shape)) for p in flat]
        vs = [gt.constant(rng.standard_normal(p.shape)) for p in flat]
        _same(jitted.hvp(ps, vs), gt.hvp(jitted.fun, ps, vs))
    (schedule,) = jitted._passes.entries.values()
    gemms = [e for e in schedule.plan if e[0] is not None and e[0].name == "matmul"]
    assert schedule.dropped >= 3, schedule.dropped  # the three weight-gradient GEMMs
    # what is left: the forward's 3 GEMMs and their tangents' 5 (x is no primal), the
    # backward's 2 (no cotangent for x) and their tangents' 4, the weight gradients'
    # tangents' 5; not the 3 weight gradients themselves
    assert len(gemms) == 19, len(gemms)


def test_any_function_of_tapes_and_transforms_compiles() -> None:
    """gt.jit(f)(...) is f compiled, whatever f does with tapes inside: a GradientTape
    step, gt.hessian and gt.jacfwd (their basis tangents are constants of the shapes)."""
    rng = np.random.default_rng(11)
    x = gt.constant(rng.standard_normal((5, 3)))

    def step(w, lr):
        with gt.GradientTape() as tape:
            tape.watch(w)
            loss = gt.sum(gt.tanh(x @ w) ** 2)
        return w - lr * tape.gradient(loss, w), loss

    def loss(w):
        return gt.sum(gt.tanh(x @ w) ** 2)

    functions = {
        "tape step": lambda w: step(w, 0.1),
        "hessian": gt.hessian(loss),
        "jacfwd": gt.jacfwd(lambda w: gt.tanh(x @ w)),
    }
    for name, f in functions.items():
        jitted = gt.jit(f)
        for _ in range(4):
            w = gt.constant(rng.standard_normal((3, 2)))
            _same(jitted(w), f(w))
        assert list(jitted.status().values()) == ["compiled"], (name, jitted.status())
    h = gt.jit(gt.hessian(loss))(w).numpy().reshape(6, 6)
    np.testing.assert_allclose(h, gt.hessian_operator(loss, w).dense(), rtol=1e-10, atol=1e-12)


def test_one_tensor_given_as_two_arguments_is_differentiated_at_both_uses() -> None:
    """Tied weights: the dynamic transform sums both uses' gradients; a capture would give
    each argument its own seed, so such calls stay dynamic (found by review: from the
    second call on, the replay answered one use's share)."""
    rng = np.random.default_rng(4)
    w, x = gt.constant(rng.normal(size=(3, 2))), gt.constant(rng.normal(size=(5, 3)))

    def f(p, x):
        return gt.sum((x @ p["a"]) * (x @ p["b"]))

    jitted, dynamic = gt.jit(f).grad(), gt.grad(f)
    for _ in range(4):
        got, want = jitted({"a": w, "b": w}, x), dynamic({"a": w, "b": w}, x)
        for k in ("a", "b"):
            np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())
    product = gt.jit(lambda a, b: gt.sum(a * b)).grad(0)
    for _ in range(3):  # d/dw sum(w * w) = 2 w: both uses
        np.testing.assert_array_equal(product(w, w).numpy(), 2 * w.numpy())


def test_labels_made_outside_the_ops_from_an_argument_are_not_frozen() -> None:
    """A one-hot of labels the caller derived from an argument's values (through .value,
    outside the ops) must follow the new values: such a capture fails and the key stays
    dynamic (found by review: the replay kept the captured call's one-hot)."""
    rng = np.random.default_rng(6)
    w = gt.constant(rng.normal(size=(3, 2)))

    def f(w, x):
        labels = gt.constant((x.value[:, 0] > 0).astype(np.int64))
        return gt.sum(gt.one_hot(labels, 2, dtype="float64") * (x @ w))

    compiled = gt.jit(f)
    jitted, dynamic = compiled.value_and_grad(), gt.value_and_grad(f)
    for _ in range(5):
        x = gt.constant(rng.normal(size=(8, 3)))
        (v1, g1), (v2, g2) = jitted(w, x), dynamic(w, x)
        assert v1.numpy() == v2.numpy()
        np.testing.assert_array_equal(g1.numpy(), g2.numpy())
    assert "compiled" not in compiled.status().values(), compiled.status()


def test_status_says_why_a_call_ran_dynamically() -> None:
    """Every key status() lists has a reason when its calls run dynamically: an argument
    the function also reaches (a bound method's object holding it), one tensor given as
    two arguments, a call under an outer tape; the same key compiles once called plainly."""

    class Model:
        def __init__(self) -> None:
            self.w = gt.constant(np.linspace(0.5, 1.5, 6).reshape(3, 2))

        def loss(self, w, x):
            return gt.sum(gt.tanh(x @ self.w) * (x @ w))

    model, x = Model(), np.linspace(-1, 1, 12).reshape(4, 3)
    jitted = gt.jit(model.loss)
    vg = jitted.value_and_grad()
    for _ in range(3):
        _same(vg(model.w, x), gt.value_and_grad(model.loss)(model.w, x))
    (reason,) = jitted.status().values()
    assert "bound method" in reason and reason.startswith("dynamic"), reason
    for _ in range(3):  # a tensor the function does not reach: compiled
        w = gt.constant(np.ones((3, 2)))
        _same(vg(w, x), gt.value_and_grad(model.loss)(w, x))
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()

    tied = gt.jit(lambda a, b: gt.sum(a * b))
    w = gt.constant(np.ones(3))
    _same(tied.grad((0, 1))(w, w), gt.grad(lambda a, b: gt.sum(a * b), (0, 1))(w, w))
    (reason,) = tied.status().values()
    assert "two arguments" in reason, reason

    inner = gt.jit(lambda a: gt.sum(a * a))
    with gt.GradientTape() as tape:
        tape.watch(w)
        y = inner(w)
    np.testing.assert_array_equal(tape.gradient(y, w).numpy(), 2 * np.ones(3))
    (reason,) = inner.status().values()
    assert "tape" in reason, reason
