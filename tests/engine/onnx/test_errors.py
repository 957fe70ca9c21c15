"""Models that cannot run are refused with every reason at once, precisely: unsupported
nodes (name, op_type, domain, opset), an invalid or truncated file (the parser's or the
checker's complaint), training-mode ops, inputs that do not fit (input and axis), and
shapes that do not follow from the inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from engine.language import DefinitionError, as_definition, compile_definition
from engine.onnx import ModelError, load_model
from tests.engine.onnx.graphs import fixture, graph_model

N = helper.make_node
X = np.zeros((2, 3), np.float32)


def problems_of(data: bytes, *shapes) -> list:
    with pytest.raises(ModelError) as info:
        model = load_model(data)
        model.specialize(list(shapes))
    return list(info.value.problems)


def test_every_unsupported_node_is_listed_at_once() -> None:
    data = graph_model(
        [
            N("Relu", ["x"], ["a"], name="ok"),
            N("Hardmax", ["a"], ["b"], name="hard"),
            N("FusedGemm", ["b", "b"], ["c"], name="fused", domain="com.microsoft"),
            N("LpNormalization", ["c"], ["out"], name="lp"),
        ],
        {"x": X},
        opset=17,
        domains={"com.microsoft": 1},
    )
    found = problems_of(data)
    assert [(p.node, p.op_type, p.domain, p.kind) for p in found] == [
        ("hard", "Hardmax", "ai.onnx", "op"),
        ("fused", "FusedGemm", "com.microsoft", "op"),
        ("lp", "LpNormalization", "ai.onnx", "op"),
    ]
    assert found[0].opset == 17
    assert "node 'hard' (op_type Hardmax, domain ai.onnx, opset 17)" in str(found[0])


def test_truncated_and_garbage_files_name_the_complaint() -> None:
    data, _ = fixture("transformer")
    for broken in (data[: len(data) // 2], data[:100]):
        (problem,) = problems_of(broken)
        assert problem.kind == "model"
        assert "truncated" in problem.message or "checker" in problem.message
    (problem,) = problems_of(b"definitely not protobuf \xff\xfe")
    assert "not a valid ONNX file" in problem.message


def test_checker_complaint_is_quoted() -> None:
    model = helper.make_model(
        helper.make_graph(
            [N("Relu", ["nowhere"], ["out"])],
            "g",
            [helper.make_tensor_value_info("x", 1, [2])],
            [helper.make_tensor_value_info("out", 1, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    (problem,) = problems_of(model.SerializeToString())
    assert problem.message.startswith("the ONNX checker refuses the model:")
    assert "nowhere" in problem.message


def test_dropout_in_training_mode_is_refused() -> None:
    data = graph_model(
        [N("Dropout", ["x", "ratio", "mode"], ["out"], name="drop")],
        {"x": X},
        {"ratio": np.array(0.5, np.float32), "mode": np.array(True)},
        opset=13,
    )
    (problem,) = problems_of(data)
    assert (problem.node, problem.op_type, problem.kind) == ("drop", "Dropout", "mode")
    assert "training_mode is true" in problem.message


def test_dropout_with_a_computed_training_mode_is_refused() -> None:
    data = graph_model(
        [
            N("ReduceSum", ["x"], ["s"], keepdims=0),
            N("Cast", ["s"], ["mode"], to=9),
            N("Dropout", ["x", "", "mode"], ["out"], name="drop"),
        ],
        {"x": X},
        opset=13,
    )
    (problem,) = problems_of(data)
    assert problem.op_type == "Dropout" and "computed" in problem.message


def test_batch_norm_in_training_mode_is_refused() -> None:
    c = np.ones(3, np.float32)
    data = graph_model(
        [
            N(
                "BatchNormalization",
                ["x", "s", "b", "m", "v"],
                ["out", "rm", "rv"],
                name="bn",
                training_mode=1,
            )
        ],
        {"x": np.zeros((2, 3, 4), np.float32)},
        {"s": c, "b": c, "m": c, "v": c},
        opset=15,
        outputs=("out",),
    )
    (problem,) = problems_of(data)
    assert (problem.node, problem.kind) == ("bn", "mode")
    assert "eval mode" in problem.message


def test_inputs_that_do_not_fit_name_input_and_axis() -> None:
    data = graph_model(
        [N("Add", ["x", "z"], ["out"])],
        {"x": X, "z": X},
        opset=13,
        dynamic={"x": ["batch", 3], "z": ["batch", 3]},
    )
    found = problems_of(data, ((2, 4), np.float32), ((5, 3), np.float64))
    messages = [p.message for p in found]
    assert "input 'x' axis 1 must be 3, got 4" in messages
    assert "input 'z' must be float32, got float64" in messages
    assert any(
        "input 'z' axis 0 is the dimension 'batch', which is 2 at input 'x' axis 0" in m
        for m in messages
    )
    assert {(p.tensor, p.axis) for p in found} >= {("x", 1), ("z", 0)}


def test_a_shape_computed_from_values_is_refused_naming_the_node() -> None:
    data = graph_model(
        [
            N("Abs", ["x"], ["a"]),
            N("Cast", ["a"], ["shape"], to=7),
            N("Reshape", ["x", "shape"], ["out"], name="reshape"),
        ],
        {"x": np.zeros(2, np.float32)},
        opset=13,
    )
    problem, *rest = problems_of(data, ((2,), np.float32))
    assert (problem.node, problem.kind) == ("reshape", "shape")
    assert "must be known at load time" in problem.message
    assert [(p.tensor, p.axis) for p in rest] in ([], [("out", 0)])


def test_language_reports_model_problems_located() -> None:
    # Five unsupported nodes of two op types: a summary first (op types with counts,
    # what to do), then one problem per op type with its count and first node names.
    nodes = [N("Hardmax", ["x"], ["h0"], name="hard0")]
    for i in range(1, 4):
        nodes.append(N("Hardmax", [f"h{i - 1}"], [f"h{i}"], name=f"hard{i}"))
    nodes.append(N("LpNormalization", ["h3"], ["out"], name="lp"))
    bad = graph_model(nodes, {"x": X}, opset=13)
    with pytest.raises(DefinitionError) as info:
        as_definition(
            {"models": {"net": {"onnx": bad}}, "inputs": {"x": X}, "program": ["y = net(x)"]}
        )
    lead, hard, lp = info.value.problems
    assert all((p.section, p.kind) == ("models.net", "op") for p in (lead, hard, lp))
    assert lead.message.startswith(
        "5 node(s) of 2 op type(s) cannot run here (Hardmax x4, "
        "LpNormalization x1): export the model again with ops this runtime supports"
    )
    assert "do_constant_folding=False" in lead.message
    assert hard.message == (
        "op_type Hardmax (domain ai.onnx, opset 13), 4 node(s) ('hard0', 'hard1', 'hard2', "
        "...): not supported"
    )
    assert lp.message == (
        "op_type LpNormalization (domain ai.onnx, opset 13), 1 node(s) ('lp'): not supported"
    )

    good = graph_model([N("Relu", ["x"], ["out"])], {"x": X}, opset=13)
    with pytest.raises(DefinitionError) as info:
        as_definition({"models": {"net": {"onnx": good, "frozen": ["nope"]}}, "program": ["y = 1"]})
    assert info.value.problems[0].section == "models.net.frozen"

    defn = as_definition(
        {
            "models": {"net": {"onnx": good}},
            "inputs": {"x": np.zeros((2, 4), np.float32)},
            "program": ["y = net(x)", "z = net(x, x)", "w = net(q=x)"],
        }
    )
    with pytest.raises(DefinitionError) as info:
        compile_definition(defn)
    found = [(p.line, p.op, p.kind) for p in info.value.problems]
    assert found == [(1, "net", "shape"), (2, "net", "shape"), (3, "net", "op")]
    assert "input 'x' axis 1 must be 3, got 4" in info.value.problems[0].message


def test_attributes_this_runtime_does_not_implement_are_refused_at_load() -> None:
    x4 = np.zeros((1, 1, 4, 4), np.float32)
    data = graph_model(
        [
            N("MaxPool", ["x"], ["out", "idx"], name="pool", kernel_shape=[2, 2]),
            N("Pad", ["x", "pads"], ["padded"], name="pad", mode="reflect"),
        ],
        {"x": x4},
        {"pads": np.zeros(8, np.int64)},
        opset=13,
        outputs=("out", "idx", "padded"),
    )
    found = problems_of(data)
    assert [(p.node, p.message) for p in found] == [
        ("pool", "the Indices output is not supported"),
        ("pad", "mode 'reflect' is not supported (only 'constant')"),
    ]


def test_a_recurrent_node_with_the_wrong_number_of_activations_is_refused_at_load() -> None:
    # One function for an LSTM (it takes three per direction): said at load, naming the
    # attribute, not a Python unpacking error at run time.
    x = np.zeros((4, 3, 2), np.float32)
    weights = {"w": np.zeros((1, 8, 2), np.float32), "r": np.zeros((1, 8, 2), np.float32)}
    data = graph_model(
        [N("LSTM", ["x", "w", "r"], ["out"], name="lstm", hidden_size=2, activations=["Tanh"])],
        {"x": x},
        weights,
        opset=14,
    )
    (found,) = problems_of(data, (x.shape, x.dtype))
    assert (found.node, found.op_type) == ("lstm", "LSTM")
    assert found.message == (
        "activations lists 1 function(s); LSTM takes 3 per direction (1 direction(s): 3)"
    )


def test_statistics_and_shape_only_initializers_are_frozen_by_default() -> None:
    # BN's running mean/var, a float initializer read only through Shape (the size of a
    # reshape) and one only compared with: variables, not trainable; the scale, bias and
    # the weight that meets the input stay trainable.
    x4 = np.zeros((2, 3, 2, 2), np.float32)
    consts = {
        "s": np.ones(3, np.float32),
        "b": np.zeros(3, np.float32),
        "m": np.full(3, 0.5, np.float32),
        "v": np.full(3, 2.0, np.float32),
        "like": np.zeros((2, 12), np.float32),
        "limit": np.zeros((), np.float32),
        "w": np.ones((12, 4), np.float32),
    }
    nodes = [
        N("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"]),
        N("Shape", ["like"], ["shape"]),
        N("Reshape", ["bn", "shape"], ["flat"]),
        N("Greater", ["flat", "limit"], ["pos"]),
        N("Where", ["pos", "flat", "b0"], ["kept"]),
        N("MatMul", ["kept", "w"], ["out"]),
    ]
    consts["b0"] = np.zeros((), np.float32)
    data = graph_model(nodes, {"x": x4}, consts, opset=15)
    defn = as_definition({"models": {"net": {"onnx": data}}, "program": []})
    trainable = {n for n, v in defn.variables.items() if v.trainable}
    assert trainable == {"s", "b", "w", "b0"}
    model = defn.models["net"].model
    assert model.frozen_by_default == {
        "m": "a BatchNormalization running statistic",
        "v": "a BatchNormalization running statistic",
        "like": "read only by shape computations, comparisons or indices",
        "limit": "read only by shape computations, comparisons or indices",
    }
