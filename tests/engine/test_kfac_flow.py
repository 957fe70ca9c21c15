"""K-FAC finds its layers from what the primitives declare (registry.ELEMENT_FLOW,
registry.LINEAR_FORM), not from their names: every primitive declares what K-FAC needs
or is listed here as one it does not look through; a model whose weights, outputs and
biases pass through copies and moves outside the old name lists (identity, a full
slice, a pad by nothing) gets curvlinops' recorded factors; a bias along another
axis than the layer's columns is not taken for the layer's bias."""

import sys
import tracemalloc

import numpy as np
import pytest

import engine as gt
import engine.registry as registry
from engine.curvature import Curvature, CurvatureError
from engine.hessian_algorithms import FlatOperator
from engine.kfac import find_layers, kfac
from engine.per_example import PerExample
from tests.engine.test_kfac_laplace import (
    _close,
    _vector,
    ce_mean,
    params_of,
    ref,
    sse,
    tensors,
)

# The differentiable primitives that are neither elementwise (probed below), a move
# (ELEMENT_FLOW "moves": K-FAC runs its impl on the elements' positions) nor a matmul
# (a layer), and why K-FAC does not look through them: a new primitive declares its
# element flow and linear form (registry.LINEAR_FORM) or joins this list.
NOT_LOOKED_THROUGH = {
    # combine elements: what comes out is no longer a layer's weight, output or data rows
    "sum": "reduces",
    "max": "reduces",
    "min": "reduces",
    "prod": "reduces",
    "cumsum": "scans",
    "softmax": "rows",
    "softmax_grad": "rows",
    "normalize": "rows",
    "normalize_grad": "rows",
    "layer_norm_affine": "rows",
    "layer_norm_affine_grad": "rows",
    "layer_norm_scale_grad": "reduces",
    # a convolutional model is recorded again as im2col and a matmul (conv.unfused())
    "conv": "unfused",
    "conv_input": "unfused",
    "conv_weight": "unfused",
    "col2im": "unfused",
    # no per-example rule (the per-example walk refuses them first)
    "einsum": "refused",
    "solve": "refused",
    "scatter_add": "refused",
    "scatter_slices": "refused",
}

# A constant for each keyword parameter of an elementwise impl (none is a copy or a sum
# for these: integer_pow 3, leaky_relu 0.25).
PROBE_PARAMS = {"n": 3, "alpha": 0.25, "dtype": np.float64}


def _engine_primitives():
    return {
        value
        for name, module in list(sys.modules.items())
        if name == "engine" or name.startswith("engine.")
        for value in list(vars(module).values())
        if isinstance(value, registry.Primitive) and value not in registry.NONDIFFERENTIABLE
    }


def _probe(prim):
    """(copies, sums): the impl on random arguments hands its one argument back
    unchanged; adds its two."""
    import inspect

    impl = registry.impl_rules[prim]
    sig = inspect.signature(impl).parameters.values()
    positional = [p for p in sig if p.kind is p.POSITIONAL_OR_KEYWORD][1:]  # after xp
    params = {p.name: PROBE_PARAMS[p.name] for p in sig if p.kind is p.KEYWORD_ONLY}
    gen = np.random.default_rng(0)
    args = [gen.uniform(0.1, 2.0, (3, 4)) * gen.choice([-1, 1], (3, 4)) for _ in positional]
    with np.errstate(all="ignore"):
        out = np.asarray(impl(np, *args, **params))
    copies = len(args) == 1 and np.array_equal(out, args[0])
    sums = len(args) == 2 and np.array_equal(out, args[0] + args[1])
    return copies, sums


def test_every_primitive_declares_what_kfac_needs_or_is_listed_as_not_looked_through():
    prims = _engine_primitives()
    assert len(prims) > 60
    for form in registry.LINEAR_FORM.values():
        assert form in registry.LINEAR_FORMS
    unlisted = set()
    for prim in prims:
        form = registry.LINEAR_FORM.get(prim)
        flow = registry.ELEMENT_FLOW.get(prim)
        if flow == "elementwise" or form in ("copies", "sums"):
            # the declaration is what the impl does, and an elementwise primitive that
            # copies or sums does not leave it out
            copies, sums = _probe(prim)
            assert (form == "copies") == copies, prim.name
            assert (form == "sums") == sums, prim.name
        elif form == "windows":
            assert flow == "moves", prim.name  # a gather K-FAC walks back through
        elif flow not in ("moves", "contracts"):
            unlisted.add(prim.name)
    assert unlisted == set(NOT_LOOKED_THROUGH)
    # what the old name lists held, now from declarations
    declared = {p.name: f for p, f in registry.LINEAR_FORM.items()}
    assert declared == {
        "identity": "copies",
        "cast": "copies",
        "read_variable": "copies",
        "add": "sums",
        "im2col": "windows",
    }


def mlp_through_copies(p, x):
    """The recorded linear_ce MLP, its weights, outputs and biases passed through ops
    K-FAC's old name lists did not hold: a copy between a matmul and its bias (K-FAC
    refused the bias), a pad by nothing and a full slice of a weight (refused the
    weight)."""
    w0 = gt.pad(p["0_weight"], ((0, 0), (0, 0)))
    h = gt.tanh(gt.identity(x @ w0) + p["0_bias"])
    w2 = p["2_weight"][:, :]
    return gt.identity(gt.squeeze(gt.expand_dims(h @ w2, 1), 1)) + gt.expand_dims(p["2_bias"], 0)


@pytest.mark.parametrize("fisher", ["type-2", "mc"])
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_layers_through_copies_and_moves_equal_curvlinops(fisher, sharing):
    tag, order = "linear_ce", ["0_weight", "0_bias", "2_weight", "2_bias"]
    params = params_of(tag)
    names = list(params)
    curv = Curvature(
        mlp_through_copies,
        ce_mean,
        tensors(params),
        gt.Tensor(ref(f"{tag}/X")),
        gt.Tensor(ref(f"{tag}/Y")),
    )
    plan = {rec.prim.name for rec in PerExample.of(curv).flow.plan if rec.prim is not None}
    assert {"identity", "pad", "getitem", "reshape"} <= plan
    for bias in ("separate", "joint"):
        key = f"{tag}/{fisher}/{sharing}/{bias}"
        options = {"sharing": sharing, "names": names, "separate_bias": bias == "separate"}
        if fisher == "mc":
            options.update(sampled_targets=[ref(f"{key}/labels/{s}") for s in range(2)])
        curvature = "fisher" if fisher == "mc" else "ggn"
        fitted = kfac(curv, curvature, **options)
        assert [layer.name for layer in fitted.layers] == ["0_weight+0_bias", "2_weight+2_bias"]
        assert [layer.kind for layer in fitted.layers] == ["linear", "linear"]
        for j, layer in enumerate(fitted.layers):
            np.testing.assert_allclose(layer.A, ref(f"{key}/A/{j}"), rtol=1e-10, atol=1e-13)
            np.testing.assert_allclose(layer.G, ref(f"{key}/G/{j}"), rtol=1e-10, atol=1e-13)
        v = _vector(tag, order, names)
        _close(fitted.apply(v), order, names, f"{key}/kfac_v")
        refit = kfac(curv, curvature, ekfac=True, **options)
        _close(refit.apply(v), order, names, f"{key}/ekfac_v", rtol=1e-8, atol=1e-11)


def _dense_ggn(curv, size):
    return FlatOperator(curv.operator("ggn")).matvec(np.eye(size))


def test_a_bias_added_after_moves_is_the_layers_when_it_runs_along_its_columns():
    """One linear layer, one row per example, a squared error (the same G for every
    example): K-FAC with the bias as [W; b]'s ones row is the exact GGN, here with the output transposed, the bias added as a column (m, 1),
    and transposed back (the bias's entry j on the output's column j)."""
    rng = np.random.default_rng(5)
    p = {"W": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}

    def model(p, x):
        return gt.transpose(gt.transpose(x @ p["W"]) + gt.reshape(p["b"], (3, 1)))

    x, y = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    curv = Curvature(model, sse, tensors(p), gt.Tensor(x), gt.Tensor(y))
    fitted = kfac(curv, "ggn", names=["W", "b"], separate_bias=False)
    assert [layer.name for layer in fitted.layers] == ["W+b"]
    dense = FlatOperator(fitted.operator()).matvec(np.eye(15))
    np.testing.assert_allclose(dense, _dense_ggn(curv, 15), rtol=1e-10, atol=1e-13)


def test_a_bias_along_another_axis_than_the_layers_columns_is_not_its_bias():
    """x (N, T, k) @ W (k, m) with T = m, swapped to (N, m, T), plus b (m,): b broadcasts
    along the positions T, not the layer's columns, so it is no bias of the layer (the
    old name lists took it for one: a transpose and an add of the right size); it is
    refused, or kept exact."""
    rng = np.random.default_rng(6)
    p = {"W": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}

    def model(p, x):
        return gt.reshape(gt.swapaxes(x @ p["W"]) + p["b"], (x.shape[0], 9))

    x, y = rng.standard_normal((5, 3, 4)), rng.integers(0, 9, 5)
    curv = Curvature(model, ce_mean, tensors(p), gt.Tensor(x), gt.Tensor(y))
    with pytest.raises(CurvatureError, match=r"b \[3\] are in no matmul"):
        kfac(curv, "ggn", names=["W", "b"])
    fitted = kfac(curv, "ggn", names=["W", "b"], others="exact")
    assert [layer.name for layer in fitted.layers] == ["W"] and fitted.others == [1]
    exact = _dense_ggn(curv, 15)
    np.testing.assert_allclose(fitted.other_block, exact[12:, 12:], rtol=1e-12, atol=1e-14)


def test_a_linear_layer_after_a_pool_is_linear_and_a_convolution_is_conv():
    """The window gather (LINEAR_FORM "windows", im2col) marks a layer as a convolution
    only when its data comes from it through moves: a max pool's windows reduced by max
    before a linear layer do not (the old walk went back through any op)."""
    rng = np.random.default_rng(7)
    p = {"k": rng.standard_normal((2, 1, 3, 3)) / 3, "W": rng.standard_normal((8, 3)) / 3}

    def model(p, x):
        h = gt.max_pool(gt.relu(gt.conv(x, p["k"], pads=1)), kernel_shape=(2, 2), strides=2)
        return gt.reshape(h, (x.shape[0], -1)) @ p["W"]

    x, y = rng.standard_normal((3, 1, 4, 4)), rng.integers(0, 3, 3)
    curv = Curvature(model, ce_mean, tensors(p), gt.Tensor(x), gt.Tensor(y))
    fitted = kfac(curv, "ggn", names=list(p))
    assert [(layer.name, layer.kind) for layer in fitted.layers] == [("k", "conv"), ("W", "linear")]


def test_finding_a_layer_holds_about_its_weights_bytes() -> None:
    # The weight's entries' positions are int32 and compared with the running count a
    # block at a time: ~1x a float32 weight's bytes (int64 positions, an int64 count and a
    # boolean result held 4.25x: review r10).
    k = m = 2048
    rng = np.random.default_rng(0)
    p = {
        "W": gt.Tensor(rng.standard_normal((k, m)).astype(np.float32)),
        "b": gt.Tensor(np.zeros(m, np.float32)),
    }
    x = gt.Tensor(rng.standard_normal((4, k)).astype(np.float32))
    y = gt.Tensor(rng.standard_normal((4, m)).astype(np.float32))
    curv = Curvature(lambda p, x: x @ p["W"] + p["b"], sse, p, x, y)
    curv.scale()
    engine = PerExample.of(curv)
    tracemalloc.start()
    try:
        layers, _ = find_layers(engine, curv._flat, ["W", "b"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(layer.name, layer.frame) for layer in layers] == [("W+b", ((k, m), False))]
    assert peak <= 1.25 * k * m * 4, f"{peak / (k * m * 4):.2f}x the weight's bytes"


@pytest.mark.gpu
@pytest.mark.skipif(not gt.cuda_available(), reason="needs CuPy and an NVIDIA GPU")
def test_a_layer_through_a_gather_on_the_gpu() -> None:
    # The positions run on the host: a getitem's index array on the device is copied
    # there (a CuPy array cannot index a NumPy one; review r10).
    rng = np.random.default_rng(0)

    def c(a):
        return gt.constant(a, device="cuda")

    p = {"W": c(rng.standard_normal((4, 3))), "b": c(rng.standard_normal(3))}
    x, y = c(rng.standard_normal((5, 4))), c(rng.standard_normal((5, 3)))
    curv = Curvature(lambda p, x: x @ p["W"][np.arange(4)] + p["b"], sse, p, x, y)
    curv.scale()
    layers, _ = find_layers(PerExample.of(curv), curv._flat, ["W", "b"])
    assert [layer.name for layer in layers] == ["W+b"]
