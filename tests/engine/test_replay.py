"""Compiled replay of a HessianOperator's passes (engine/replay.py) answers exactly what
the dynamic sweep answers: every op-table row and the scenarios, both ways, bit for bit
(the replay makes the same NumPy calls in the same order). Passes that cannot be
captured fall back to the dynamic sweep and still answer right."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import replay
from tests.engine.test_ops import _args, _cases


def _pair(f, *primals, **kw):
    return (
        gt.hessian_operator(f, *primals, compiled=True, **kw),
        gt.hessian_operator(f, *primals, compiled=False, **kw),
    )


def _assert_same(a, b) -> None:
    for x, y in zip(gt.tree.flatten(a)[0], gt.tree.flatten(b)[0], strict=True):
        x, y = x.numpy(), y.numpy()
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y, equal_nan=True), f"max diff {np.max(np.abs(x - y))}"


def _both_ways(compiled, dynamic, shapes, rng, k: int = 3, passes: int = 3) -> None:
    """Several passes of one vector and of K vectors: the first is captured, the later
    ones replayed; each equals the dynamic operator's answer."""
    for _ in range(passes):
        v = [rng.standard_normal(s) for s in shapes]
        _assert_same(compiled.hvp(*v), dynamic.hvp(*v))
        vs = [rng.standard_normal((k, *s)) for s in shapes]
        _assert_same(compiled.hvp_many(*vs), dynamic.hvp_many(*vs))


def _row_loss(row, shapes):
    args = _args(row, shapes)
    out_shape = np.shape(row.fn(*[gt.constant(a) for a in args]).numpy())
    # A weighted sum: the Hessian of every output element takes part.
    weights = gt.constant(np.random.default_rng(5).uniform(0.5, 1.5, out_shape))
    return (lambda *xs: gt.sum(row.fn(*xs) * weights)), args


@pytest.mark.parametrize("row, shapes", [c for c in _cases() if c.values[0].order >= 2])
def test_every_op_row_replays_exactly(row, shapes) -> None:
    f, args = _row_loss(row, shapes)
    compiled, dynamic = _pair(f, *[gt.constant(a) for a in args])
    _both_ways(compiled, dynamic, [a.shape for a in args], np.random.default_rng(3))


def test_every_row_is_compiled() -> None:
    """The replay is not a fallback in disguise: every row's pass is captured (rows whose
    Hessian is zero by construction, relu's and abs's, included)."""
    dynamic_rows = {}
    cases = [c for c in _cases() if c.values[0].order >= 2]
    for case in cases:
        row, shapes = case.values
        f, args = _row_loss(row, shapes)
        op = gt.hessian_operator(f, *[gt.constant(a) for a in args])
        for _ in range(2):
            op.hvp(*[np.ones(a.shape) for a in args])
        status = set(op.replay_status().values())
        if status != {"compiled"}:
            dynamic_rows[case.id] = status
    assert not dynamic_rows, dynamic_rows


# ---- scenarios -------------------------------------------------------------------------
def _mlp(act, dtype=np.float64):
    rng = np.random.default_rng(14)
    x = gt.constant(rng.standard_normal((16, 6)).astype(dtype))
    y = gt.constant(rng.standard_normal((16, 3)).astype(dtype))
    shapes = [(6, 8), (8,), (8, 8), (8,), (8, 3), (3,)]
    params = [gt.constant((rng.standard_normal(s) * 0.5).astype(dtype)) for s in shapes]

    def loss(w1, b1, w2, b2, w3, b3):
        h = act(x @ w1 + b1)
        h = act(h @ w2 + b2)
        return gt.mean((h @ w3 + b3 - y) ** 2)

    return loss, params


def _softmax_classifier():
    rng = np.random.default_rng(7)
    x = gt.constant(rng.standard_normal((10, 5)))
    labels = gt.constant(rng.integers(0, 4, 10).astype(np.int32))
    params = [gt.constant(rng.standard_normal(s) * 0.5) for s in [(5, 4), (4,)]]

    def loss(w, b):
        return gt.softmax_cross_entropy(x @ w + b, labels)

    return loss, params


def _input_gradient_penalty():
    """Scenario 7: a gradient inside the loss (third derivatives in the HVP pass)."""
    rng = np.random.default_rng(9)
    x = gt.constant(rng.standard_normal((6, 3)))
    params = [gt.constant(rng.standard_normal(s) * 0.5) for s in [(3, 5), (5, 1)]]

    def loss(w1, w2):
        with gt.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(x)
            out = gt.sum(gt.tanh(x @ w1) @ w2)
        gx = tape.gradient(out, x)
        return out + gt.sum(gx * gx)

    return loss, params


def _variables_and_broadcasting():
    rng = np.random.default_rng(11)
    x = gt.constant(rng.standard_normal((4, 3)))
    params = [gt.constant(rng.standard_normal(s)) for s in [(3,), (1, 3), ()]]

    def loss(a, b, c):
        z = gt.sigmoid(x * a + b) * c
        return gt.sum(gt.exp(z) / (1.0 + z * z)) + gt.sum(gt.log1p(a * a)) * c

    return loss, params


def _conv_batchnorm_relu():
    """Two convolutions, each followed by a per-channel affine map (an inference batch
    norm, folded) and relu: the elementwise ops work on a convolution's result, a
    transposed view of its GEMM's memory, and the replay writes them into buffers of
    that layout or into the operand that dies there."""
    rng = np.random.default_rng(12)
    x = gt.constant(rng.standard_normal((3, 2, 6, 6)))
    shapes = [(4, 2, 3, 3), (4, 1, 1), (4, 1, 1), (3, 4, 3, 3), (3, 1, 1), (3, 1, 1)]
    params = [gt.constant(rng.standard_normal(s) * 0.5) for s in shapes]

    def loss(w1, a1, c1, w2, a2, c2):
        h = gt.relu(gt.conv(x, w1, pads=1) * a1 + c1)
        h = gt.relu(gt.conv(h, w2, strides=2, pads=1) * a2 + c2)
        return gt.mean(h * h)

    return loss, params


SCENARIOS = {
    "conv_batchnorm_relu": _conv_batchnorm_relu,
    "mlp_tanh": lambda: _mlp(gt.tanh),
    "mlp_relu": lambda: _mlp(gt.relu),
    "mlp_softplus": lambda: _mlp(gt.softplus),
    "softmax_cross_entropy": _softmax_classifier,
    "input_gradient_penalty": _input_gradient_penalty,
    "broadcasting": _variables_and_broadcasting,
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenarios_replay_exactly(name) -> None:
    loss, params = SCENARIOS[name]()
    compiled, dynamic = _pair(loss, *params)
    _both_ways(compiled, dynamic, [p.shape for p in params], np.random.default_rng(4))
    assert set(compiled.replay_status().values()) == {"compiled"}, compiled.replay_status()


def test_float32_and_max_batch_replay_exactly() -> None:
    loss, params = _mlp(gt.tanh, np.float32)
    compiled, dynamic = _pair(loss, *params, max_batch=4)
    rng = np.random.default_rng(8)
    for _ in range(3):  # 10 vectors: passes of 4, 4 and 2, each layout captured once
        vs = [rng.standard_normal((10, *p.shape)).astype(np.float32) for p in params]
        _assert_same(compiled.hvp_many(*vs), dynamic.hvp_many(*vs))
    assert len(compiled.replay_status()) == 2


def test_replayed_products_are_hessian_times_v_and_fresh_arrays() -> None:
    loss, params = _mlp(gt.tanh)
    op = gt.hessian_operator(loss, *params)
    h = op.dense()
    rng = np.random.default_rng(2)
    answers = []
    for _ in range(3):
        v = [rng.standard_normal(p.shape) for p in params]
        hv = op.hvp(*v)
        flat = np.concatenate([t.numpy().ravel() for t in hv])
        np.testing.assert_allclose(
            flat, h @ np.concatenate([a.ravel() for a in v]), rtol=1e-10, atol=1e-12
        )
        answers.append((hv, flat))
    # A later pass never writes into an answer already handed out (buffers are internal).
    for hv, flat in answers:
        np.testing.assert_array_equal(np.concatenate([t.numpy().ravel() for t in hv]), flat)


def test_a_data_dependent_rule_falls_back_and_answers_right() -> None:
    """A custom gradient whose backward branches in Python on the cotangent's norm: the
    HVP pass runs it with the vector's cotangent, so the schedule would depend on the
    data. The pass is not captured; it stays dynamic and answers right."""

    @gt.custom_gradient
    def halve_large(x):
        def grad_fn(dy):
            return dy * 0.5 if float(gt.sum(dy * dy)) > 1.0 else dy

        return x, grad_fn

    rng = np.random.default_rng(6)
    x = gt.constant(rng.standard_normal((4,)))

    def loss(w):
        return gt.sum(halve_large(x * w) ** 3)

    w = gt.constant(rng.standard_normal(4))
    compiled, dynamic = _pair(loss, w)
    _both_ways(compiled, dynamic, [(4,)], np.random.default_rng(1))
    status = compiled.replay_status()
    assert status and all("host" in s for s in status.values()), status
    # Small and large vectors take different branches: a replay would get one wrong.
    for scale in (1e-3, 1e3):
        v = np.full(4, scale)
        _assert_same(compiled.hvp(v), dynamic.hvp(v))


def test_an_array_made_outside_the_ops_falls_back() -> None:
    """A custom gradient that builds an array from the cotangent's values with NumPy:
    the capture cannot know what that array depends on, so the pass stays dynamic."""

    @gt.custom_gradient
    def scaled(x):
        def grad_fn(dy):
            return gt.constant(np.tanh(dy.value) * 3.0) * x

        return x * x, grad_fn

    rng = np.random.default_rng(12)
    w = gt.constant(rng.standard_normal(3))
    compiled, dynamic = _pair(lambda w: gt.sum(scaled(w) * w), w)
    _both_ways(compiled, dynamic, [(3,)], rng)
    status = compiled.replay_status()
    assert status and all("outside" in s for s in status.values()), status


def test_a_dead_tensors_id_is_not_inherited_by_a_new_one() -> None:
    """CPython hands a freed object's id to the next one. A pass's intermediates die as
    it goes: an array made during the pass with such an id is still new (a constant
    made in the pass is registered, one made outside the ops fails the capture), and a
    constant is only ever the known tensor itself, held for the capture's length."""
    from engine.tensor import Tensor

    cap = replay.Capture([Tensor(np.ones(2))], {})
    for _ in range(1000):
        dead = Tensor(np.zeros(2))
        cap._new(dead, replay._STEP)
        dead_id = id(dead)
        del dead
        new = Tensor(np.zeros(2))
        if id(new) == dead_id:
            break
    else:
        raise AssertionError("CPython reused no id in 1000 tries: the test proves nothing")
    with pytest.raises(replay.CaptureFailed, match="outside"):
        cap._slot_of(new)
    cap.constant(new)
    assert cap.kinds[cap._slot_of(new)] == replay._CONST
    other = Tensor(np.zeros(2))
    impostor = replay.Capture([Tensor(np.ones(2))], {id(other): Tensor(np.zeros(2))})
    with pytest.raises(replay.CaptureFailed, match="outside"):
        impostor._slot_of(other)


def test_schedule_keeps_buffers_and_reuses_them() -> None:
    loss, params = _mlp(gt.tanh)
    op = gt.hessian_operator(loss, *params)
    v = [np.ones(p.shape) for p in params]
    op.hvp(*v)
    assert set(op.replay_status().values()) == {replay.NOT_YET}, "a one-off pass: dynamic"
    op.hvp(*v)
    (schedule,) = op._passes.entries.values()
    assert isinstance(schedule, replay.Schedule)
    # Fewer persistent buffers than calls that write into one: liveness reuses them.
    assert (
        0 < schedule.pooled_bytes < sum(8 * np.prod(p.shape) for p in params) * len(schedule.plan)
    )


def test_elementwise_ops_on_convolutions_write_into_buffers_of_their_layout() -> None:
    loss, params = _conv_batchnorm_relu()
    op = gt.hessian_operator(loss, *params)
    v = [np.ones(p.shape) for p in params]
    first = op.hvp(*v)
    op.hvp(*v)
    replayed = op.hvp(*v)
    _assert_same(replayed, first)
    (schedule,) = op._passes.entries.values()
    # A convolution's result is (N, C, H, W) over memory in (C, N, H, W) order: buffers
    # of that layout are made (with its strides exactly), and relu's VJP writes into a
    # buffer or the cotangent that dies there (the forward's relu is a constant here).
    transposed = [b for b in schedule.buffers if b.layout.order == "P"]
    assert transposed, [b.layout.order for b in schedule.buffers]
    for b in transposed:
        assert b.array.strides == b.layout.strides and not b.array.flags.c_contiguous
    masks = [e for e in schedule.plan if e[0] is not None and e[0].name == "relu_grad"]
    assert masks and all(e[5] is not None for e in masks), [e[5] for e in masks]


def test_a_convolutions_windows_are_gathered_once_per_operand() -> None:
    # The second backward of an HVP gathers a cotangent's windows for conv_input's VJP
    # in its cotangent and again for its VJP in its kernel: the schedule keeps one.
    loss, params = _conv_batchnorm_relu()
    compiled, dynamic = _pair(loss, *params)
    _both_ways(compiled, dynamic, [p.shape for p in params], np.random.default_rng(6))
    for schedule in compiled._passes.entries.values():
        gathers = [
            (tuple(e[2]), tuple(sorted(e[1].items())))
            for e in schedule.plan
            if e[0] is not None and e[0].name == "conv_gather"
        ]
        assert gathers and len(set(gathers)) == len(gathers), gathers


@pytest.mark.parametrize(
    "shape, strides, dense",
    [
        ((2, 3, 4), (12, 4, 1), True),  # C order
        ((2, 3, 4), (4, 8, 1), True),  # axes 0 and 1 swapped over dense memory
        ((2, 1, 4), (4, 999, 1), True),  # a size-1 axis's stride is never read
        ((2, 3, 4), (24, 8, 2), False),  # every other element
        ((2, 3), (0, 1), False),  # a broadcast
    ],
)
def test_dense_layouts(shape, strides, dense) -> None:
    assert replay._dense(shape, strides, 1) is dense


# ---- no dead work: a fresh HVP's gradient GEMMs --------------------------------------
def test_a_fresh_hvp_never_runs_the_gradients_own_gemms(monkeypatch) -> None:
    """gt.hvp wants the gradient's tangent only: the weight-gradient products are
    deferred (tensor.DeferredTensor) and never computed, and the answer is bit-equal to
    forward-over-reverse computing everything."""
    from engine import tensor

    loss, params = _mlp(gt.tanh)
    v = [gt.constant(np.random.default_rng(3).standard_normal(p.shape)) for p in params]
    made, computed = [], []
    real_init = tensor.DeferredTensor.__init__
    real_value = tensor.DeferredTensor.value.fget

    def init(self, *args):
        made.append(self)
        real_init(self, *args)

    def value(self):
        if self._thunk is not None:
            computed.append(self)
        return real_value(self)

    monkeypatch.setattr(tensor.DeferredTensor, "__init__", init)
    monkeypatch.setattr(tensor.DeferredTensor, "value", property(value))
    fresh = gt.hvp(loss, params, v)
    assert len(made) == 3 and not computed, "the three weight GEMMs are deferred, none run"

    # The same forward-over-reverse with every primal computed.
    with gt.ForwardAccumulator(params, v) as acc:
        with gt.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(params)
            value = loss(*params)
        grads = tape.gradient(value, params)
    _assert_same(fresh, [acc.jvp(g) for g in grads])
    # A deferred product read later is the product (the first made: the last layer's).
    assert not computed
    np.testing.assert_array_equal(made[0].numpy(), grads[4].numpy())
    assert computed == [made[0]]


def test_a_deferred_gradient_that_is_read_is_computed() -> None:
    """gt.hessian (forward-over-reverse too) defers the same products; a source used
    twice accumulates its deferred products, which computes them: right either way."""
    rng = np.random.default_rng(5)
    x = gt.constant(rng.standard_normal((5, 3)))

    def loss(w):
        return gt.sum(gt.tanh(x @ w) ** 2) + gt.sum((x @ w) * (x @ w))

    w = gt.constant(rng.standard_normal((3, 2)))
    h = gt.hessian(loss)(w).numpy().reshape(6, 6)
    dense = gt.hessian_operator(loss, w, compiled=False).dense()
    np.testing.assert_allclose(h, dense, rtol=1e-10, atol=1e-12)


# ---- definitions: what the service's tapes run -----------------------------------------
_rng = np.random.default_rng(21)
DEFINITIONS = {
    "relu mlp": {
        "variables": {"w1": _rng.random((4, 8)), "w2": _rng.random((8, 2))},
        "inputs": {"x": _rng.random((5, 4)), "y": _rng.random((5, 2))},
        "program": ["h = relu(x @ w1)", "o = h @ w2", "loss = mean((o - y) ** 2)"],
    },
    "clip_grad_norm": {
        "variables": {"w": _rng.random((4, 3))},
        "inputs": {"x": _rng.random((5, 4))},
        "program": ["h = clip_grad_norm(tanh(x @ w), 0.5)", "loss = sum(h * h * h)"],
    },
    "gradient penalty": {
        "variables": {"w": _rng.random((4, 3))},
        "inputs": {"x": _rng.random((5, 4))},
        "program": ["o = sum(tanh(x @ w))", "g = grad(o, x)", "loss = o + sum(g * g)"],
    },
    "softmax regression": {
        "variables": {"w": _rng.random((4, 3)), "b": _rng.random(3)},
        "inputs": {"x": _rng.random((6, 4))},
        "program": ["z = x @ w + b", "loss = sum(logsumexp(z, axis=1) - z[:, 0])"],
    },
    "user function": {  # a forward and a backward program (tf.custom_gradient's analogue)
        "variables": {"w": _rng.random((4, 3))},
        "inputs": {"x": _rng.random((5, 4))},
        "functions": {
            "log1pexp": {
                "params": ["z"],
                "forward": ["e = exp(z)", "out = log(1 + e)"],
                "backward": ["grad_z = upstream * (1 - 1 / (1 + e))"],
                "output": "out",
            }
        },
        "program": ["h = log1pexp(x @ w)", "loss = sum(h * h)"],
    },
}


@pytest.mark.parametrize("name", DEFINITIONS)
def test_definitions_tapes_replay_exactly(name) -> None:
    from engine.language import compile_definition
    from engine.language.compile import Request

    definition = DEFINITIONS[name]
    program = compile_definition(definition)
    leaves = program.leaves(definition)
    request = Request("loss", {n: n for n in definition["variables"]})
    compiled = program.hessian_operator(request, leaves)
    dynamic = program.hessian_operator(request, leaves)
    dynamic.compiled = False
    shapes = [leaves[n].shape for n in definition["variables"]]
    _both_ways(compiled, dynamic, shapes, np.random.default_rng(2))
    assert set(compiled.replay_status().values()) == {"compiled"}, compiled.replay_status()


# ---- item 3: a definition's gradient pass, compiled ------------------------------------
def _evaluate_both_ways(definition, target="loss", sources=None, **kw):
    from engine.language.evaluate import evaluate

    compiled = evaluate(definition, target, sources, **kw)
    dynamic = evaluate(definition, target, sources, compiled=False, **kw)
    np.testing.assert_array_equal(compiled.value, dynamic.value)
    assert compiled.gradients.keys() == dynamic.gradients.keys()
    for key, g in compiled.gradients.items():
        if g is None:
            assert dynamic.gradients[key] is None
        else:
            assert g.dtype == dynamic.gradients[key].dtype
            np.testing.assert_array_equal(g, dynamic.gradients[key])
    return compiled


def _with_values(definition, rng):
    """The same structure with new values (what a service's later requests send)."""
    fresh = {**definition}
    for section in ("variables", "inputs"):
        fresh[section] = {
            n: rng.standard_normal(np.shape(v)).astype(np.asarray(v).dtype)
            if np.asarray(v).dtype.kind == "f"
            else v
            for n, v in definition[section].items()
        }
    return fresh


@pytest.mark.parametrize("name", DEFINITIONS)
def test_definition_gradients_replay_exactly(name) -> None:
    from engine.language import compile_definition

    rng = np.random.default_rng(31)
    definition = DEFINITIONS[name]
    for _ in range(3):  # captured, then replayed with new values
        _evaluate_both_ways(_with_values(definition, rng))
    passes = compile_definition(definition).gradient_passes()
    # (softmax regression too: logsumexp's shift is computed with ops on stop(x), so the
    # replay computes it from the new values)
    assert passes and all(isinstance(p, replay.Schedule) for p in passes.values()), passes


def test_definition_gradients_with_aliases_and_zero_unconnected() -> None:
    rng = np.random.default_rng(32)
    definition = {
        "variables": {"w": rng.random((3, 2)), "unused": rng.random(2)},
        "inputs": {"x": rng.random((4, 3))},
        "program": ["loss = sum(tanh(x @ w) ** 2)"],
    }
    for _ in range(3):
        result = _evaluate_both_ways(
            _with_values(definition, rng),
            sources={"a": "w", "b": "unused", "c": "w"},
            unconnected="zero",
            allow_unused=True,
        )
        np.testing.assert_array_equal(result.gradients["b"], np.zeros(2))
        np.testing.assert_array_equal(result.gradients["a"], result.gradients["c"])


def test_integer_leaves_are_part_of_the_compiled_layout() -> None:
    """Indices are read on the host by their op's checks: a pass is compiled per index
    value, so new indices are captured afresh (and a bad one is still refused)."""
    from engine.language import compile_definition
    from engine.language.errors import DefinitionError, ExecutionError

    rng = np.random.default_rng(33)
    base = {
        "variables": {"w": rng.random((5, 3))},
        "inputs": {"i": np.array([0, 2, 4], dtype=np.int32)},
        "program": ["loss = sum(take(w, i, axis=0) ** 2)"],
    }
    for idx in ([0, 2, 4], [1, 1, 3], [0, 2, 4]):
        definition = {**base, "inputs": {"i": np.array(idx, dtype=np.int32)}}
        result = _evaluate_both_ways(_with_values(definition, rng))
        assert result.gradients["w"].shape == (5, 3)
    assert len(compile_definition(base).gradient_passes()) == 2
    with pytest.raises((DefinitionError, ExecutionError, IndexError, ValueError)):
        from engine.language.evaluate import evaluate

        evaluate({**base, "inputs": {"i": np.array([0, 9, 4], dtype=np.int32)}}, "loss")


def test_a_classifier_definition_compiles_and_a_data_steered_one_stays_dynamic() -> None:
    """softmax_cross_entropy's one-hot labels come from integer labels, which are part of
    the key by value, and its logsumexp shift is made with ops: its gradient pass is
    replayed. A pass that reads a float value of the pass on the host (sort's order)
    falls back to the dynamic path, with the same answers and the reason kept."""
    from engine.language import compile_definition

    rng = np.random.default_rng(34)
    definition = {
        "variables": {"w": rng.random((4, 3))},
        "inputs": {"x": rng.random((6, 4)), "y": rng.integers(0, 3, 6).astype(np.int32)},
        "program": ["loss = softmax_cross_entropy(x @ w, y)"],
    }
    for _ in range(3):
        _evaluate_both_ways(_with_values(definition, rng))
    passes = compile_definition(definition).gradient_passes()
    assert passes and all(isinstance(p, replay.Schedule) for p in passes.values()), passes

    steered = {**definition, "program": ["loss = sum(sort(x @ w) * x[:, :3])"]}
    for _ in range(3):
        _evaluate_both_ways(_with_values(steered, rng))
    passes = compile_definition(steered).gradient_passes()
    assert passes and all(isinstance(p, tuple) and "host" in p[0] for p in passes.values()), passes


def test_kept_gradient_passes_are_bounded_across_programs() -> None:
    """Whatever programs a worker is sent, the compiled gradient passes it keeps (and their
    buffers) are bounded for all of them together, least recently used out."""
    from engine.language import compile as compile_module
    from engine.language.evaluate import evaluate

    rng = np.random.default_rng(35)
    count = compile_module.GRADIENT_PASSES + 4
    for k in range(count):  # distinct programs: a different constant in each
        definition = {
            "variables": {"w": rng.random((3, 3))},
            "inputs": {"x": rng.random(3)},
            "program": [f"loss = sum(tanh(w @ x) ** 2) * {k + 1}.0"],
        }
        for _ in range(3):
            evaluate(definition, "loss")
    kept = compile_module._gradient_passes.entries
    assert len(kept) == compile_module.GRADIENT_PASSES
    pooled = sum(p.pooled_bytes for p in kept.values() if isinstance(p, replay.Schedule))
    assert 0 < pooled <= compile_module.GRADIENT_PASSES * compile_module.GRADIENT_POOL_LIMIT


def test_replay_changes_count_what_the_passes_keep() -> None:
    """replay_changes moves when a layout is first seen, when its pass is captured and
    when the schedule's first replay allocates its buffers, and then stays put: what an
    owner that accounts for memory (the service's tapes) measures again by."""
    from engine.footprint import held_bytes

    x = np.random.default_rng(36).standard_normal((64, 64))
    op = gt.hessian_operator(lambda w: gt.sum(gt.tanh(gt.constant(x) @ w) ** 2), x)
    seen, sizes = [op.replay_changes], [held_bytes(op)]
    for _ in range(5):
        op.hvp(np.ones((64, 64)))
        seen.append(op.replay_changes)
        sizes.append(held_bytes(op))
    assert seen == [0, 1, 2, 3, 3, 3], seen
    assert sizes[3] > sizes[2] and sizes[3:] == [sizes[3]] * 3, sizes  # buffers, then flat


# ---- a fresh HVP of a definition (POST /v1/hvp), compiled ------------------------------
def _hvps_both_ways(program, request, leaves, vectors, **kw):
    compiled = program.hessian_vector_products(request, leaves, vectors, **kw)
    dynamic = program.hessian_vector_products(request, leaves, vectors, compiled=False, **kw)
    _assert_same([compiled[0], *compiled[1], *compiled[2]], [dynamic[0], *dynamic[1], *dynamic[2]])
    return compiled


@pytest.mark.parametrize("name", DEFINITIONS)
def test_definition_hvps_replay_exactly(name) -> None:
    """Requests of one structure with new values and new vectors, one vector and K: the
    second of each layout is captured, later ones replayed, all equal to the dynamic
    path bit for bit."""
    from engine.language import compile_definition
    from engine.language.compile import Request

    rng = np.random.default_rng(37)
    program = compile_definition(DEFINITIONS[name])
    request = Request("loss", {n: n for n in DEFINITIONS[name]["variables"]}, "zero")
    for _ in range(4):
        definition = _with_values(DEFINITIONS[name], rng)
        leaves = program.leaves(definition)
        for k in (1, 3):
            vectors = [
                gt.constant(rng.standard_normal((k, *leaves[n].shape)))
                for n in request.sources.values()
            ]
            _hvps_both_ways(program, request, leaves, vectors)
    passes = program.request_passes()
    assert len(passes) == 2, passes
    assert all(isinstance(p, replay.Schedule) for p in passes.values()), passes


def test_replayed_fresh_hvps_are_the_hessian_times_v() -> None:
    """Against the closed form of loss = sum(tanh(x @ k + b) ** 2): value, gradients and
    products of every request, the replayed ones included, with a source under two
    aliases and a parameter the target does not reach (zeros)."""
    from engine.language import compile_definition

    rng = np.random.default_rng(38)
    base = {
        "variables": {"k": rng.random((4, 3)), "b": rng.random(3), "unused": rng.random(2)},
        "inputs": {"x": rng.random((6, 4))},
        "program": ["loss = sum(tanh(x @ k + b) ** 2)"],
    }
    program = compile_definition(base)
    request = program.check_request(
        "loss", {"k": "k", "b": "b", "again": "k", "u": "unused"}, "zero", allow_unused=True
    )
    for _ in range(4):
        definition = _with_values(base, rng)
        leaves = program.leaves(definition)
        x, k, b = (
            definition["inputs"]["x"],
            definition["variables"]["k"],
            definition["variables"]["b"],
        )
        vk, vb, vk2, vu = (rng.standard_normal((2, *s)) for s in [(4, 3), (3,), (4, 3), (2,)])
        value, grads, products = program.hessian_vector_products(
            request, leaves, [gt.constant(v) for v in (vk, vb, vk2, vu)]
        )
        t = np.tanh(x @ k + b)
        dz = 2 * t * (1 - t**2)
        s = 2 * (1 - t**2) * (1 - 3 * t**2)  # d2 loss / dz2, elementwise
        np.testing.assert_allclose(value.numpy(), np.sum(t**2), rtol=1e-12)
        for g, want in zip(grads, [x.T @ dz, dz.sum(0), x.T @ dz, np.zeros(2)], strict=True):
            np.testing.assert_allclose(g.numpy(), want, rtol=1e-12, atol=1e-14)
        # the Hessian's product with the stacked vector (vk + vk2 both move k)
        dzv = s * (x @ (vk + vk2) + vb[:, None, :])
        hk = np.einsum("ij,kil->kjl", x, dzv)
        for p, want in zip(products, [hk, dzv.sum(1), hk, np.zeros((2, 2))], strict=True):
            np.testing.assert_allclose(p.numpy(), want, rtol=1e-10, atol=1e-12)
    assert all(isinstance(p, replay.Schedule) for p in program.request_passes().values())


def test_fresh_hvps_in_passes_of_the_memory_budget_replay_exactly() -> None:
    """A memory budget that fits two vectors per pass: five vectors in three passes,
    joined, compiled as one schedule per budget (part of its key)."""
    from engine.language import compile_definition
    from engine.language.errors import OverBudget

    rng = np.random.default_rng(39)
    definition = {
        "variables": {"w": rng.random((8, 8))},
        "inputs": {"x": rng.random((16, 8))},
        "program": ["loss = sum(tanh(x @ w) ** 2)"],
    }
    program = compile_definition(definition)
    request = program.check_request("loss", None, "zero")
    budget = next(b for b in range(1 << 10, 1 << 24, 256) if program.memory.max_batch(b) == 2)
    leaves = program.leaves(definition)
    for _ in range(3):
        vectors = [gt.constant(rng.standard_normal((5, 8, 8)))]
        _, _, (batched,) = _hvps_both_ways(program, request, leaves, vectors, memory_budget=budget)
        _, _, (whole,) = program.hessian_vector_products(request, leaves, vectors)
        np.testing.assert_allclose(batched.numpy(), whole.numpy(), rtol=1e-12)
    passes = program.request_passes()
    assert {k[3] for k in passes} == {2, None}
    assert all(isinstance(p, replay.Schedule) for p in passes.values()), passes
    with pytest.raises(OverBudget):
        program.hessian_vector_products(request, leaves, vectors, memory_budget=64)


def test_kept_request_passes_are_bounded_across_programs() -> None:
    from engine.language import compile as compile_module
    from engine.language import compile_definition

    rng = np.random.default_rng(40)
    for k in range(compile_module.REQUEST_PASSES + 3):
        definition = {
            "variables": {"w": rng.random((3, 3))},
            "inputs": {"x": rng.random(3)},
            "program": [f"loss = sum(tanh(w @ x) ** 2) * {k + 1}.0"],
        }
        program = compile_definition(definition)
        request = program.check_request("loss", None, "zero")
        leaves = program.leaves(definition)
        for _ in range(3):
            program.hessian_vector_products(
                request, leaves, [gt.constant(rng.standard_normal((1, 3, 3)))]
            )
    kept = compile_module._request_passes.entries
    assert len(kept) == compile_module.REQUEST_PASSES
    pooled = sum(p.pooled_bytes for p in kept.values() if isinstance(p, replay.Schedule))
    assert 0 < pooled <= compile_module.REQUEST_PASSES * compile_module.REQUEST_POOL_LIMIT


# ---- jacobians of a definition (POST /v1/jacobian), compiled ---------------------------
def _jacobians_both_ways(program, request, leaves, batch, chunk_size=None):
    compiled = program.jacobians(request, leaves, batch, chunk_size)
    dynamic = program.jacobians(request, leaves, batch, chunk_size, compiled=False)
    assert compiled[1].keys() == dynamic[1].keys()
    _assert_same([compiled[0], *compiled[1].values()], [dynamic[0], *dynamic[1].values()])
    return compiled


@pytest.mark.parametrize("name", DEFINITIONS)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_definition_jacobians_replay_exactly(name, chunk_size) -> None:
    """A full jacobian of every variable, in one backward pass or in chunks of rows."""
    from engine.language import compile_definition

    rng = np.random.default_rng(41)
    program = compile_definition(DEFINITIONS[name])
    target = {
        "relu mlp": "o",
        "clip_grad_norm": "h",
        "gradient penalty": "g",
        "softmax regression": "z",
        "user function": "h",
    }[name]
    request = program.check_request(
        target, list(DEFINITIONS[name]["variables"]), "zero", allow_unused=True
    )
    for _ in range(4):
        leaves = program.leaves(_with_values(DEFINITIONS[name], rng))
        _jacobians_both_ways(program, request, leaves, False, chunk_size)
    passes = [
        p for k, p in program.request_passes().items() if k[0] == "jacobian" and k[5] == chunk_size
    ]
    assert len(passes) == 1 and isinstance(passes[0], replay.Schedule), passes


def test_replayed_batch_jacobians_are_the_closed_form_and_fresh() -> None:
    """Per-example jacobians of o = tanh(x @ w) (with a source the target does not reach:
    zeros), replayed, against diag(1 - t_b^2) w^T per example."""
    from engine.language import compile_definition

    rng = np.random.default_rng(42)
    base = {
        "variables": {"w": rng.random((4, 3))},
        "inputs": {"x": rng.random((5, 4)), "z": rng.random((5, 2))},
        "program": ["o = tanh(x @ w)"],
    }
    program = compile_definition(base)
    request = program.check_request("o", ["x", "z"], "zero")
    answers = []
    for _ in range(4):
        definition = _with_values(base, rng)
        x, w = definition["inputs"]["x"], definition["variables"]["w"]
        _, found = _jacobians_both_ways(program, request, program.leaves(definition), True)
        t = np.tanh(x @ w)
        np.testing.assert_allclose(
            found["x"].numpy(), (1 - t**2)[:, :, None] * w.T[None], rtol=1e-12
        )
        np.testing.assert_array_equal(found["z"].numpy(), np.zeros((5, 3, 2)))
        answers.append(found["x"].numpy())
    assert not any(np.shares_memory(a, b) for a in answers for b in answers if a is not b)
    assert all(isinstance(p, replay.Schedule) for p in program.request_passes().values())


def test_a_replayed_batch_jacobian_still_checks_the_examples_independence() -> None:
    """The check reads the pass's rows: it runs after the replayed pass too, so a batch
    that mixes its examples is refused on every request."""
    from engine.language import compile_definition

    rng = np.random.default_rng(43)
    base = {
        "variables": {"w": rng.random((4, 3))},
        "inputs": {"x": rng.random((5, 4))},
        "program": ["h = tanh(x @ w)", "o = h - mean(h, axis=0)"],
    }
    program = compile_definition(base)
    request = program.check_request("o", ["x"], "zero")
    for _ in range(4):
        with pytest.raises(gt.BatchDependenceError):
            program.jacobians(request, program.leaves(_with_values(base, rng)), True)
    assert all(isinstance(p, replay.Schedule) for p in program.request_passes().values())


def test_a_pass_whose_constants_exceed_the_limit_stays_dynamic(monkeypatch) -> None:
    """A jacobian's identity rows are constants its schedule would hold while kept: a
    pass that makes more than the request passes' constant limit is never compiled."""
    from engine.language import compile as compile_module
    from engine.language import compile_definition

    monkeypatch.setattr(compile_module._request_passes, "constant_limit", 1000)
    rng = np.random.default_rng(44)
    base = {
        "variables": {"w": rng.random((4, 3))},
        "inputs": {"x": rng.random((5, 4))},
        "program": ["o = tanh(x @ w)"],
    }  # 15 rows, 12 columns: forward mode, 12 unit tangents of 12 float64: 1,152 bytes
    program = compile_definition(base)
    request = program.check_request("o", ["w"], "zero")
    for _ in range(4):
        _jacobians_both_ways(program, request, program.leaves(_with_values(base, rng)), False)
    (status,) = program.request_passes().values()
    assert isinstance(status, tuple) and "1,152 bytes" in status[0], status


def test_a_definition_that_sorts_its_values_stays_dynamic_and_right() -> None:
    """sort's order comes from the data and becomes its gather's indices: a replay kept
    the captured call's order (stale gradients from the third call on). The order is read
    through host_value, so the capture fails and every call answers like the dynamic
    path."""
    from engine.language import compile_definition

    rng = np.random.default_rng(45)
    base = {
        "variables": {"w": rng.standard_normal(5)},
        "inputs": {"c": np.arange(1.0, 6.0)},
        "program": ["s = sort(w)", "loss = sum(s * s * s * c)"],
    }
    for _ in range(5):
        result = _evaluate_both_ways({**base, "variables": {"w": rng.standard_normal(5)}})
        w = result.gradients["w"]
        assert w.shape == (5,)
    passes = compile_definition(base).gradient_passes()
    assert passes and all("host" in p[0] for p in passes.values()), passes


class _Holder:
    def __init__(self, array: np.ndarray):
        self.array = array


_GLOBAL_ARRAY = np.arange(3.0)
_GLOBAL_TABLE = {"w": np.ones(2), "pair": (np.zeros(1),)}
_GLOBAL_OBJECT = _Holder(np.full(4, 7.0))


def _names_globals() -> object:
    return _GLOBAL_ARRAY, _GLOBAL_TABLE, _GLOBAL_OBJECT


def test_known_tensors_look_at_globals_shallowly() -> None:
    """A function's globals are looked at, not walked through: arrays and containers of
    them are constants; an array inside a global object is not (walking global objects
    reached every module's registries: seconds and tens of MB per capture)."""
    found = replay.known_tensors(_names_globals)
    ids = set(found)
    assert id(_GLOBAL_ARRAY) in ids
    assert id(_GLOBAL_TABLE["w"]) in ids and id(_GLOBAL_TABLE["pair"][0]) in ids
    assert id(_GLOBAL_OBJECT.array) not in ids
    # through a closure (not a global), an object is walked as before
    holder = _Holder(np.ones(5))
    assert id(holder.array) in replay.known_tensors(lambda: holder)


def test_observe_reports_how_each_outermost_pass_ran() -> None:
    """replay.observe() hears, per outermost pass, what the pass did as it did it: the
    first of a layout dynamic, the second captured, later ones replayed; a capture that
    fails, its reason every time; the operator an HVP request runs inside its own pass
    nothing; compiled=False and nothing observed say why."""
    from engine.language import compile_definition

    rng = np.random.default_rng(46)
    base = {
        "variables": {"w": rng.random((4, 3))},
        "inputs": {"x": rng.random((6, 4))},
        "program": ["loss = sum(tanh(x @ w) * tanh(x @ w))"],
    }
    program = compile_definition(base)
    request = program.check_request("loss")

    def seen(call) -> list[replay.Execution]:
        with replay.observe() as observed:
            call(program.leaves(_with_values(base, rng)))
        return observed.passes

    first, captured, replayed = replay.NOT_YET, replay.CAPTURED, None
    for run in (
        lambda leaves: program.value_and_gradients(request, leaves),
        lambda leaves: program.hessian_vector_products(
            request, leaves, [gt.constant(rng.random((2, 4, 3)))]
        ),
        lambda leaves: program.jacobians(request, leaves),
    ):
        got = [seen(run) for _ in range(4)]
        assert got == [
            [replay.Execution(False, first)],
            [replay.Execution(False, captured)],
            [replay.Execution(True, replayed)],
            [replay.Execution(True, replayed)],
        ]
    (dynamic,) = seen(lambda leaves: program.value_and_gradients(request, leaves, False))
    assert not dynamic.compiled and "compiled=False" in (dynamic.reason or "")

    steered = {**base, "program": ["loss = sum(sort(x @ w) * x[:, :3])"]}
    sorting = compile_definition(steered)
    reasons = []
    for _ in range(4):
        with replay.observe() as observed:
            sorting.value_and_gradients(
                sorting.check_request("loss"), sorting.leaves(_with_values(steered, rng))
            )
        reasons.append(observed.summary())
    assert reasons[0] == replay.Execution(False, first)
    assert len(set(reasons[1:])) == 1 and "host" in (reasons[1].reason or "")
    assert not reasons[1].compiled

    nothing = replay.Observed().summary()
    assert not nothing.compiled and "no pass" in (nothing.reason or "")
    # Outside observe(), passes report nowhere (and answer as ever).
    program.value_and_gradients(request, program.leaves(_with_values(base, rng)))


def test_an_operator_that_does_not_replay_says_why() -> None:
    """A Hessian or curvature operator whose products skip the compiled passes (asked
    for compiled=False, or a GPU's arrays) reports the reason to observe(), as the
    definitions' passes do, not the blank "no pass ran through a compiled entry point"
    (a tape's HVP on a GPU answered that before)."""
    from engine.curvature import curvature_operator

    rng = np.random.default_rng(47)
    x, y = gt.constant(rng.random((6, 4))), gt.constant(rng.random((6, 3)))
    w, v = gt.constant(rng.random((4, 3))), gt.constant(rng.random((4, 3)))
    ggn = curvature_operator(
        lambda k, data: data @ k, lambda out, target: gt.mean((out - target) ** 2), w, x, y
    )
    ggn.compiled = False  # (what a GPU's arrays do to it, on this CPU-only machine)
    operators = [
        gt.hessian_operator(lambda k: gt.sum(gt.tanh(x @ k) ** 2), w, compiled=False),
        ggn,
    ]
    for operator in operators:
        with replay.observe() as observed:
            operator.hvp(v)
        assert observed.summary() == replay.Execution(False, replay.why_dynamic(False))
