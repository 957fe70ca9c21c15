"""A constant folded at load time is checked against max_elements like any intermediate
(issue 25): ConstantOfShape, Expand and Range of constant inputs are sized from those
inputs before ONNX's reference evaluator allocates them, and every other op (Tile, Pad, a
broadcast, OneHot) from the output shape ONNX's inference gives it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine.language import DefinitionError, Limits, as_definition, compile_definition
from engine.onnx import ModelError, load_model

X = np.ones((2, 3), np.float32)


def model_with(nodes, consts) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "g", [x], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


HUGE_FILL = model_with(
    [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill"),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0, name="total"),
        helper.make_node("Add", ["x", "s"], ["out"], name="add"),
    ],
    {"shape": np.array([60000, 60000], np.int64)},  # 3.6e9 float32: 13.4 GiB
)


def test_a_huge_constant_of_shape_is_refused_before_it_is_made() -> None:
    model = load_model(HUGE_FILL)
    with pytest.raises(ModelError) as info:
        model.specialize([((2, 3), np.float32)], max_elements=1 << 24)
    (found,) = info.value.problems
    assert (found.node, found.op_type, found.kind) == ("fill", "ConstantOfShape", "shape")
    assert "3,600,000,000 elements" in found.message and "16,777,216" in found.message


def test_the_language_passes_its_max_elements_to_the_model() -> None:
    definition = {
        "models": {"net": {"onnx": HUGE_FILL}},
        "inputs": {"x": X},
        "program": ["y = sum(net(x))"],
    }
    with pytest.raises(DefinitionError) as info:
        compile_definition(as_definition(definition), Limits(max_elements=1000))
    assert "ConstantOfShape" in str(info.value) and "max_elements" in str(info.value)


@pytest.mark.parametrize(
    ("node", "consts"),
    [
        (
            helper.make_node("Expand", ["one", "shape"], ["big"], name="grow"),
            # an integer initializer is a constant (a float one would be a parameter)
            {"one": np.ones(1, np.int64), "shape": np.array([5000, 5000], np.int64)},
        ),
        (
            helper.make_node("Range", ["start", "limit", "delta"], ["big"], name="count"),
            {
                "start": np.array(0, np.int64),
                "limit": np.array(10**9, np.int64),
                "delta": np.array(1, np.int64),
            },
        ),
        # Ops that grow their constant inputs, sized from the shapes inference gives
        # them (each 9,000,000 elements; they were made, then only the limit's
        # intermediates were checked).
        (
            helper.make_node("Tile", ["one", "repeats"], ["big"], name="tile"),
            {"one": np.ones((1, 1), np.int64), "repeats": np.array([3000, 3000], np.int64)},
        ),
        (
            helper.make_node("Pad", ["one", "pads"], ["big"], name="pad"),
            {"one": np.ones((1, 1), np.int64), "pads": np.array([0, 0, 2999, 2999], np.int64)},
        ),
        (
            helper.make_node("Mul", ["column", "row"], ["big"], name="outer"),
            {"column": np.ones((3000, 1), np.int64), "row": np.ones((1, 3000), np.int64)},
        ),
        (
            helper.make_node("OneHot", ["indices", "depth", "values"], ["big"], name="onehot"),
            {
                "indices": np.arange(3000, dtype=np.int64),
                "depth": np.array(3000, np.int64),
                "values": np.array([0, 1], np.int64),
            },
        ),
    ],
    ids=["expand", "range", "tile", "pad", "broadcast", "onehot"],
)
def test_constants_that_grow_are_sized_before_they_are_made(node, consts) -> None:
    nodes = [
        node,
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
        helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "f"], ["out"]),
    ]
    model = load_model(model_with(nodes, consts))
    with pytest.raises(ModelError) as info:
        model.specialize([((2, 3), np.float32)], max_elements=1 << 20)
    assert "max_elements" in info.value.problems[0].message


def test_a_small_constant_of_shape_still_folds() -> None:
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["fill"],
            value=numpy_helper.from_array(np.array([2.0], np.float32)),
        ),
        helper.make_node("Mul", ["x", "fill"], ["out"]),
    ]
    model = load_model(model_with(nodes, {"shape": np.array([2, 3], np.int64)}))
    spec = model.specialize([((2, 3), np.float32)], max_elements=1 << 24)
    np.testing.assert_array_equal(spec.consts["fill"], np.full((2, 3), 2.0, np.float32))
