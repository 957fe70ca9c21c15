"""Per-example gradients (engine/per_example.py) against a loop of single-example
gradients, their statistics against NumPy's over those, the chunked path against the
unchunked one, and the refusals of models that mix examples."""

import numpy as np
import pytest

import engine as gt
from engine.curvature import Curvature
from engine.ops.nn import softmax_grad_p
from engine.per_example import MixedExamplesError, per_example
from engine.tensor import bind

RNG = np.random.default_rng(30)


def _tensors(d):
    return {k: gt.Tensor(v) for k, v in d.items()}


def mlp(p, x):
    h = gt.tanh(x @ p["w1"] + p["b1"])
    return h @ (p["w2"] * 2.0) + p["b2"]  # a parameter-only op before the data


def convnet(p, x):
    h = gt.relu(gt.conv(x, p["k"], p["kb"], strides=2, pads=1))
    return gt.reshape(h, (x.shape[0], -1)) @ p["w"]


def block(p, x):
    # the transformer's row-wise fused ops (issue 28): layer norm, GELU, softmax over a
    # row's features; the linear layers stay matmuls the walk meets
    h = gt.layer_norm(x, p["g"], p["b"])
    h = gt.gelu(h @ p["w1"] + p["b1"])
    return gt.softmax(h, -1) @ p["w2"]


def softmax_vjp(p, x):
    # softmax's VJP (softmax_grad, a row op declared broadcasting) in the forward, along
    # the features: a row's output is its own example's
    return bind(softmax_grad_p, gt.tanh(x @ p["w"]), gt.softmax(p["q"], -1), axis=-1)


def elementwise_family(p, x):
    # elementwise primitives the walk knows from their declaration (registry.ELEMENT_FLOW),
    # not from a list of names (log2 was missing from the old one; leaky_relu and rsqrt were on it);
    # atan2 and xlogy take a parameter beside the data
    h = gt.log2(1.0 + gt.exp(x @ p["w1"]))
    h = gt.atan2(h, p["c"]) + gt.xlogy(p["d"], 1.5 + gt.leaky_relu(h))
    return gt.rsqrt(1.0 + h * h) @ p["w2"]


def ce_mean(o, y):
    return gt.mean(gt.softmax_cross_entropy(o, y))


def ce_sum(o, y):
    return gt.sum(gt.softmax_cross_entropy(o, y))


def mse_mean(o, y):
    return gt.mean((o - y) ** 2)


def mse_one(o, y):  # the loss of a batch of one under mse_mean's reduction
    return gt.sum((o - y) ** 2) / y.shape[-1]


CASES = {
    "mlp-ce-mean": (
        mlp,
        {"w1": (5, 4), "b1": (4,), "w2": (4, 3), "b2": (3,)},
        (9, 5),
        ce_mean,
        ce_sum,
        "labels",
    ),
    "block-ce-mean": (
        block,
        {"g": (5,), "b": (5,), "w1": (5, 4), "b1": (4,), "w2": (4, 3)},
        (7, 5),
        ce_mean,
        ce_sum,
        "labels",
    ),
    "softmax-vjp-mse": (
        softmax_vjp,
        {"w": (5, 3), "q": (3,)},
        (6, 5),
        mse_mean,
        mse_one,
        "values",
    ),
    "elementwise-family-mse": (
        elementwise_family,
        {"w1": (5, 4), "c": (4,), "d": (4,), "w2": (4, 3)},
        (6, 5),
        mse_mean,
        mse_one,
        "values",
    ),
    "conv-mse": (
        convnet,
        {"k": (4, 2, 3, 3), "kb": (4,), "w": (36, 3)},
        (5, 2, 6, 6),
        mse_mean,
        mse_one,
        "values",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_bytes", [None, 700])
def test_per_example_equals_a_loop_of_single_example_gradients(case, max_bytes):
    model, shapes, xshape, loss, single_loss, kind = CASES[case]
    params = {k: RNG.standard_normal(s) for k, s in shapes.items()}
    x = RNG.standard_normal(xshape)
    n = xshape[0]
    y = RNG.integers(0, 3, n) if kind == "labels" else RNG.standard_normal((n, 3))
    curv = Curvature(model, loss, _tensors(params), gt.Tensor(x), gt.Tensor(y))
    found = per_example(curv, max_bytes=max_bytes)
    assert (found.chunks > 1) == (max_bytes is not None)
    loop = {k: [] for k in params}
    for i in range(n):
        one = Curvature(
            model, single_loss, _tensors(params), gt.Tensor(x[i : i + 1]), gt.Tensor(y[i : i + 1])
        )
        for k in params:
            loop[k].append(one.grad[k].numpy())
    norms = np.zeros(n)
    for k in params:
        stacked = np.stack(loop[k])
        np.testing.assert_allclose(found.gradients[k], stacked, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(found.mean[k], stacked.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(found.variance[k], stacked.var(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            found.sum_squares[k], (stacked**2).sum(0), rtol=1e-12, atol=1e-12
        )
        by = np.sqrt((stacked.reshape(n, -1) ** 2).sum(1))
        np.testing.assert_allclose(found.norms_by_source[k], by, rtol=1e-13)
        norms += by**2
    np.testing.assert_allclose(found.norms, np.sqrt(norms), rtol=1e-13)
    # The batch gradient is c * sum_i g_i.
    for k in params:
        np.testing.assert_allclose(
            curv.grad[k].numpy(), found.scale * found.gradients[k].sum(0), atol=1e-12
        )


def test_statistics_only_keep_no_gradients():
    params = {"w1": (5, 4), "b1": (4,), "w2": (4, 3), "b2": (3,)}
    params = {k: RNG.standard_normal(s) for k, s in params.items()}
    x, y = RNG.standard_normal((6, 5)), RNG.integers(0, 3, 6)
    curv = Curvature(mlp, ce_mean, _tensors(params), gt.Tensor(x), gt.Tensor(y))
    whole = per_example(curv)
    light = per_example(curv, keep_gradients=False, max_bytes=300)
    assert light.gradients is None and light.chunks > 1
    np.testing.assert_allclose(light.norms, whole.norms, rtol=1e-13)
    for k in params:
        np.testing.assert_allclose(light.variance[k], whole.variance[k], atol=1e-13)


def _batch_mean(p, x):
    h = x @ p["w"]
    return h - gt.mean(h, axis=0)  # batch norm's centring in training mode


def _cross(p, x):
    return gt.transpose(x) @ (x @ p["w"])[:, :1] * 0 + x @ p["w"]  # x^T x mixes rows


@pytest.mark.parametrize(
    ("model", "op"), [(_batch_mean, "sum"), (_cross, "matmul")], ids=["batch-mean", "gram"]
)
def test_models_that_mix_examples_are_refused_naming_the_op(model, op):
    x = RNG.standard_normal((4, 4))
    curv = Curvature(
        model,
        mse_mean,
        {"w": gt.Tensor(RNG.standard_normal((4, 4)))},
        gt.Tensor(x),
        gt.Tensor(RNG.standard_normal((4, 4))),
    )
    with pytest.raises(MixedExamplesError, match=f"mixes examples at op '{op}'"):
        per_example(curv)


# The differentiable primitives the per-example walk does not follow, and why: a new
# primitive must declare its element flow (registry.ELEMENT_FLOW) or join this list.
NOT_FOLLOWED = {
    # a convolutional model is recorded again in its im2col + matmul form (conv.unfused())
    "conv": "unfused",
    "conv_input": "unfused",
    "conv_weight": "unfused",
    "col2im": "unfused",
    # no per-example rule: refused by name (test below)
    "einsum": "refused",
    "solve": "refused",
    "scatter_add": "refused",
    "scatter_slices": "refused",
    # a Variable's read: the walk starts from tensors, never from Variables
    "read_variable": "not reached",
}


def test_every_primitive_declares_its_flow_or_is_listed_as_not_followed():
    import sys

    import engine.registry as registry

    # the engine's own primitives (the modules' names for them): tests declare some too
    engine_prims = {
        value
        for name, module in list(sys.modules.items())
        if name == "engine" or name.startswith("engine.")
        for value in list(vars(module).values())
        if isinstance(value, registry.Primitive)
    }
    assert len(engine_prims) > 60
    unflowed = {
        p.name
        for p in engine_prims
        if p not in registry.ELEMENT_FLOW and p not in registry.NONDIFFERENTIABLE
    }
    assert unflowed == set(NOT_FOLLOWED)
    assert {registry.ELEMENT_FLOW[p] for p in registry.ELEMENT_FLOW} <= set(registry.FLOWS)


def test_an_op_the_walk_cannot_follow_is_named_as_such():
    """einsum declares no element flow: the refusal says the walk cannot follow it (not
    that the model mixes examples, which it does not here)."""

    def contracted(p, x):
        return gt.einsum("nk,km->nm", x, p["w"])

    curv = Curvature(
        contracted,
        mse_mean,
        {"w": gt.Tensor(RNG.standard_normal((4, 3)))},
        gt.Tensor(RNG.standard_normal((5, 4))),
        gt.Tensor(RNG.standard_normal((5, 3))),
    )
    with pytest.raises(
        MixedExamplesError,
        match=r"op 'einsum' \(inputs \[5, 4\], \[4, 3\]\) is one the per-example walk cannot follow",
    ):
        per_example(curv)


def test_a_row_op_across_the_examples_is_refused():
    """softmax_grad over the example axis sums each column over the examples: a row op
    (its declared flow, "rows"), not the elementwise op its broadcasting declaration
    would make it, so it is refused, naming it."""

    def columns(p, x):
        return bind(softmax_grad_p, gt.tanh(x @ p["w"]), gt.softmax(p["q"], 0), axis=-2)

    curv = Curvature(
        columns,
        mse_mean,
        {"w": gt.Tensor(RNG.standard_normal((5, 3))), "q": gt.Tensor(RNG.standard_normal((1, 3)))},
        gt.Tensor(RNG.standard_normal((4, 5))),
        gt.Tensor(RNG.standard_normal((4, 3))),
    )
    with pytest.raises(MixedExamplesError, match=r"op 'softmax_grad' .* reduces over axes \[0\]"):
        per_example(curv)


def test_chunks_form_the_cotangent_sized_work_once(monkeypatch):
    """Under a small memory bound the examples run in many chunks; what every chunk reads
    (a matmul's cotangent in rows, an elementwise op's shares: the op's output size) is
    formed once, not once a chunk (which made the cost grow as N x chunks: 10x for 4x
    the examples at one example a chunk)."""
    import engine.per_example as pe

    calls = {"rows": 0, "vjp": 0}
    rows, vjp = pe.cotangent_rows, pe.get_vjp

    def counted_rows(*args):
        calls["rows"] += 1
        return rows(*args)

    def counted_vjp(*args):
        calls["vjp"] += 1
        return vjp(*args)

    monkeypatch.setattr(pe, "cotangent_rows", counted_rows)
    monkeypatch.setattr(pe, "get_vjp", counted_vjp)
    params = {"w1": (5, 4), "b1": (4,), "w2": (4, 3), "b2": (3,)}
    params = {k: RNG.standard_normal(s) for k, s in params.items()}
    x, y = RNG.standard_normal((12, 5)), RNG.integers(0, 3, 12)
    curv = Curvature(mlp, ce_mean, _tensors(params), gt.Tensor(x), gt.Tensor(y))
    whole = per_example(curv)
    calls.update(rows=0, vjp=0)
    chunked = per_example(curv, max_bytes=1)  # one example a chunk
    assert chunked.chunks == 12
    assert calls == {"rows": 2, "vjp": 2}  # two matmuls, two bias additions
    for k in params:
        np.testing.assert_allclose(chunked.gradients[k], whole.gradients[k], rtol=1e-14)
