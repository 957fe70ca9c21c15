"""The reference models exported from PyTorch (fixtures/export.py), through the language:
`logits = net(x)`, `loss = softmax_cross_entropy(logits, y)`.

Forward values against onnx.reference.ReferenceEvaluator; the loss, every parameter's
gradient and an HVP against PyTorch's own answers stored beside each model (float32 as
exported, and a float64 copy of the model against PyTorch's float64 answers); and the
gradient and HVP against central finite differences (float64)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import engine as gt
from engine.language import DefinitionError, as_definition, compile_definition
from engine.registry import public_ops
from tests.engine.onnx.graphs import fixture, float64_model

PROGRAM = ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"]
# The CNNs need the convolution and pooling primitives of issue 13, item 4.
NEEDS_CONV = pytest.mark.skipif(
    "conv" not in public_ops,
    reason="the engine has no `conv`/`max_pool`/`avg_pool` primitives yet (issue 13 item 4, "
    "branch issue-13-prims): ONNX Conv, MaxPool and AveragePool cannot run",
)
MODELS = [
    pytest.param("lenet", marks=NEEDS_CONV),
    pytest.param("resnet", marks=NEEDS_CONV),
    "transformer",
    "transformer_opset18",  # the dynamo exporter: axes, splits and shapes as inputs
]


def program(name: str, dtype: str = "float32"):
    data, record = fixture(name)
    x = record["x"]
    if dtype == "float64":
        data = float64_model(data)
        x = x.astype(np.float64) if x.dtype.kind == "f" else x
    defn = as_definition(
        {
            "models": {"net": {"onnx": data, "frozen": [str(f) for f in record["frozen"]]}},
            "inputs": {"x": x, "y": record["y"]},
            "program": PROGRAM,
        }
    )
    prog = compile_definition(defn)
    return data, record, prog, prog.leaves(defn)


@pytest.mark.parametrize("name", MODELS)
def test_forward_matches_the_reference_evaluator(name: str) -> None:
    data, record, prog, leaves = program(name)
    expected = ReferenceEvaluator(onnx.load_model_from_string(data)).run(None, {"x": record["x"]})[
        0
    ]
    env = prog.run(leaves)
    np.testing.assert_allclose(env["logits"].numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(env["loss"].numpy(), record["f32/loss"], rtol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_sources_are_the_parameters_not_the_buffers(name: str) -> None:
    _, record, prog, _ = program(name)
    grads = {k.removeprefix("f32/grad/") for k in record if k.startswith("f32/grad/")}
    assert set(prog.check_request("loss").sources) == grads
    assert not set(prog.trainable) & {str(f) for f in record["frozen"]}


@pytest.mark.parametrize("name", MODELS)
def test_gradient_matches_pytorch_float32(name: str) -> None:
    _, record, prog, leaves = program(name)
    request = prog.check_request("loss")
    names = list(request.sources.values())
    with gt.GradientTape() as tape:
        env = prog.run(leaves)
    grads = tape.gradient(env["loss"], [leaves[n] for n in names])
    for n, g in zip(names, grads):
        want = record[f"f32/grad/{n}"]
        np.testing.assert_allclose(
            g.numpy(), want, rtol=1e-4, atol=1e-6 * np.abs(want).max(), err_msg=n
        )


@pytest.mark.parametrize("name", MODELS)
def test_gradient_and_hvp_match_pytorch_float64(name: str) -> None:
    _, record, prog, leaves = program(name, "float64")
    request = prog.check_request("loss")
    names = list(request.sources.values())
    op = prog.hessian_operator(request, leaves)
    np.testing.assert_allclose(op.value.numpy(), record["f64/loss"], rtol=1e-9)
    hvps = op.hvp(*[gt.constant(record[f"v/{n}"].astype(np.float64)) for n in names])
    # The file keeps float32 constants (the attention scale, layer-norm epsilon), which
    # PyTorch's float64 run takes exactly: agreement is ~1e-8 relative, not 1e-15.
    for n, g, h in zip(names, op.grad, hvps):
        for got, key in ((g, "grad"), (h, "hvp")):
            want = record[f"f64/{key}/{n}"]
            np.testing.assert_allclose(
                got.numpy(), want, rtol=1e-6, atol=1e-8 * np.abs(want).max(), err_msg=f"{key} {n}"
            )


@pytest.mark.parametrize("name", MODELS)
def test_gradient_and_hvp_match_finite_differences(name: str) -> None:
    _, record, prog, leaves = program(name, "float64")
    request = prog.check_request("loss")
    names = list(request.sources.values())
    f = prog.function("loss", names, leaves)
    point = [leaves[n].numpy() for n in names]
    v = [record[f"v/{n}"].astype(np.float64) for n in names]
    eps = 1e-5

    def at(t: float) -> list:
        return [gt.constant(p + t * d) for p, d in zip(point, v)]

    def loss(t: float) -> float:
        return float(f(*at(t)).numpy())

    def grads(t: float) -> list:
        return gt.grad(f, argnums=tuple(range(len(names))))(*at(t))

    directional = (loss(eps) - loss(-eps)) / (2 * eps)
    exact = sum(float(np.vdot(g.numpy(), d)) for g, d in zip(grads(0.0), v))
    np.testing.assert_allclose(exact, directional, rtol=1e-6)
    op = prog.hessian_operator(request, leaves)
    hvps = op.hvp(*[gt.constant(d) for d in v])
    plus, minus = grads(eps), grads(-eps)
    for n, h, gp, gm in zip(names, hvps, plus, minus):
        numeric = (gp.numpy() - gm.numpy()) / (2 * eps)
        np.testing.assert_allclose(
            h.numpy(), numeric, rtol=1e-5, atol=1e-6 * max(np.abs(numeric).max(), 1.0), err_msg=n
        )


def test_jacobian_forward_and_reverse_agree_on_the_transformer() -> None:
    _, _, prog, leaves = program("transformer", "float64")
    f = prog.function("logits", ["ln1.weight"], leaves)
    w = leaves["ln1.weight"]
    fwd = gt.jacfwd(f)(w).numpy()
    rev = gt.jacrev(f)(w).numpy()
    assert fwd.shape == (4, 10, 16)
    np.testing.assert_allclose(fwd, rev, rtol=1e-10, atol=1e-12)
    assert np.abs(fwd).max() > 1e-3  # not trivially zero


def test_a_variable_replaces_an_initializer_and_frozen_stays_frozen() -> None:
    data, record = fixture("resnet")
    stat = str(record["frozen"][0])  # a batch-norm running statistic
    value = np.full((6,), 0.5, np.float32)  # the stem's 6 channels
    defn = as_definition(
        {
            "models": {"net": {"onnx": data, "frozen": [str(f) for f in record["frozen"]]}},
            "variables": {
                stat: {"value": value, "trainable": True},
                "head.bias": np.zeros(10, np.float32),
            },
            "inputs": {"x": record["x"], "y": record["y"]},
            "program": PROGRAM,
        }
    )
    assert not defn.variables[stat].trainable and defn.variables["head.bias"].trainable
    prog = compile_definition(defn)
    assert stat not in prog.trainable
    moved = prog.run(prog.leaves(defn))["loss"].numpy()
    assert abs(float(moved) - float(record["f32/loss"])) > 1e-4  # the values were used
    with pytest.raises(DefinitionError) as info:
        as_definition(
            {
                "models": {"net": {"onnx": data}},
                "variables": {"head.bias": np.zeros(3, np.float32)},
                "program": [],
            }
        )
    assert "replaces initializer 'head.bias'" in str(info.value)


@NEEDS_CONV
def test_dtype_float64_runs_a_float32_model_in_float64() -> None:
    # A definition asking float64 of a float32 file computes in float64 (answers agree
    # with PyTorch's float64 run, not its float32 one), never quietly in float32.
    data, record = fixture("lenet")
    defn = as_definition(
        {
            "dtype": "float64",
            "models": {"net": {"onnx": data}},
            "inputs": {"x": record["x"].tolist(), "y": record["y"]},
            "program": PROGRAM,
        }
    )
    prog = compile_definition(defn)
    leaves = prog.leaves(defn)
    request = prog.check_request("loss")
    names = list(request.sources.values())
    with gt.GradientTape() as tape:
        env = prog.run(leaves)
    grads = tape.gradient(env["loss"], [leaves[n] for n in names])
    assert env["loss"].dtype == np.float64 and all(g.dtype == np.float64 for g in grads)
    np.testing.assert_allclose(env["loss"].numpy(), record["f64/loss"], rtol=1e-9)
    for n, g in zip(names, grads):
        want = record[f"f64/grad/{n}"]
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-6, atol=1e-9 * np.abs(want).max())

    # float16 is not applied to a model (it would round it): refused, saying so.
    with pytest.raises(DefinitionError) as info:
        as_definition({"dtype": "float16", "models": {"net": {"onnx": data}}, "program": []})
    (problem,) = info.value.problems
    assert problem.section == "dtype"
    assert "dtype float16 is not applied to ONNX models: model 'net' computes in float32" in str(
        problem
    )


@pytest.mark.parametrize("name", ["transformer", "transformer_opset18"])
def test_the_erf_gelu_runs_as_one_fused_step(name: str) -> None:
    # Div-Erf-Add-Mul-Mul (torch.onnx's nn.GELU) is planned as one Gelu step, the fused
    # gelu primitive; the gradients above check it against PyTorch's.
    from engine.onnx.model import load_model

    data, record = fixture(name)
    model = load_model(data)
    spec = model.specialize([(tuple(record["x"].shape), record["x"].dtype)])
    ops = [s.op_type for s in spec.steps]
    erfs = sum(n.op_type == "Erf" for n in onnx.load_model_from_string(data).graph.node)
    assert erfs > 0 and ops.count("Gelu") == erfs and "Erf" not in ops


def test_a_gelu_whose_intermediate_is_read_elsewhere_is_not_fused() -> None:
    from engine.onnx.model import Step, fuse_erf_gelu

    consts = {
        "root2": np.array(1.4142135, np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    steps = [
        Step("Div", ("x", "root2"), ("d",), {}),
        Step("Erf", ("d",), ("e",), {}),
        Step("Add", ("e", "one"), ("a",), {}),
        Step("Mul", ("x", "a"), ("m",), {}),
        Step("Mul", ("m", "half"), ("y",), {}),
    ]
    shapes = {"x": ((None, 3), np.dtype(np.float32))}
    (fused,) = fuse_erf_gelu(steps, consts, {"y"}, shapes)
    assert (fused.op_type, fused.inputs, fused.outputs) == ("Gelu", ("x",), ("y",))
    assert fuse_erf_gelu(steps, consts, {"y", "e"}, shapes) == steps  # erf(x / 2^.5): an output
    read = [*steps, Step("Neg", ("a",), ("n",), {})]
    assert fuse_erf_gelu(read, consts, {"y", "n"}, shapes) == read
    for products in (
        [Step("Mul", ("half", "a"), ("m",), {}), Step("Mul", ("x", "m"), ("y",), {})],
        [Step("Mul", ("x", "half"), ("h",), {}), Step("Mul", ("h", "a"), ("y",), {})],
    ):  # the other two associations of 0.5 * x * (1 + erf)
        (fused,) = fuse_erf_gelu([*steps[:3], *products], consts, {"y"}, shapes)
        assert (fused.op_type, fused.inputs, fused.outputs) == ("Gelu", ("x",), ("y",))
    other_root = {**consts, "root2": np.array(1.5, np.float32)}
    assert fuse_erf_gelu(steps, other_root, {"y"}, shapes) == steps
    # one-element constants of a rank: fused where they leave x's shape as it is
    for name in consts:
        for shape, fuses in [((1,), True), ((1, 1), True), ((1, 1, 1), False)]:
            shaped = {**consts, name: consts[name].reshape(shape)}
            assert (fuse_erf_gelu(steps, shaped, {"y"}, shapes) != steps) == fuses, (name, shape)
        # x of unknown rank: only 0-d constants
        shaped = {**consts, name: consts[name].reshape(1)}
        assert fuse_erf_gelu(steps, shaped, {"y"}, {"x": (None, None)}) == steps
        assert fuse_erf_gelu(steps, shaped, {"y"}, {}) == steps
    assert fuse_erf_gelu(steps, consts, {"y"}, {}) != steps


@pytest.mark.parametrize("root_shape", [(), (1,), (1, 1)])
def test_a_gelu_whose_constant_widens_the_result_keeps_its_shape(root_shape) -> None:
    """A (1, 1) sqrt(2) against a vector makes the exporters' GELU a (1, n) matrix: the
    fused Gelu step (x's shape) would lose an axis, so that chain is not fused, and the
    answer has the reference evaluator's shape and values either way."""
    from onnx import helper, numpy_helper

    from engine.onnx.model import load_model
    from tests.engine.onnx.graphs import graph_model

    consts = {
        "root2": np.full(root_shape, np.sqrt(2), np.float32),
        "one": np.array(1, np.float32),
        "half": np.array(0.5, np.float32),
    }
    nodes = [
        *(
            helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k))
            for k, v in consts.items()
        ),
        helper.make_node("Div", ["x", "root2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["out"]),
    ]
    x = np.linspace(-3, 3, 5).astype(np.float32)
    data = graph_model(nodes, {"x": x})
    (expected,) = ReferenceEvaluator(onnx.load_model_from_string(data)).run(None, {"x": x})
    spec = load_model(data).specialize([(x.shape, x.dtype)])
    fused = [s.op_type for s in spec.steps] == ["Gelu"]
    assert fused == (len(root_shape) <= 1)
    defn = as_definition(
        {"models": {"net": {"onnx": data}}, "inputs": {"x": x}, "program": ["y = net(x)"]}
    )
    prog = compile_definition(defn)
    got = prog.run(prog.leaves(defn))["y"].numpy()
    assert got.shape == expected.shape == np.broadcast_shapes(x.shape, root_shape)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
