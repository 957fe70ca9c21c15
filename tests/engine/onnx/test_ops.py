"""Every ONNX op the importer maps, on small graphs: the forward value against ONNX's
reference evaluator (the spec's semantics, per opset), and first and second derivatives
against finite differences (float64), forward and reverse mode."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from engine.onnx import load_model
from engine.tensor import constant
from engine.testing import check_grads
from tests.engine.onnx.graphs import graph_model

N = helper.make_node
rng = np.random.default_rng(7)


def r(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def pos(*shape: int) -> np.ndarray:
    return 0.5 + rng.random(shape)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def one(node, **inputs):
    return [node], inputs


def _all_outputs(node, names: list[str]) -> list:
    """The node and a Concat of its outputs, flattened, as the graph's `out`."""
    flat = [N("Flatten", [n], [f"{n}_flat"], axis=0) for n in names]
    return [node, *flat, N("Concat", [f"{n}_flat" for n in names], ["out"], axis=1)]


# id: (opset, nodes, float inputs (differentiated), constants)
CASES = {
    "Add": (13, [N("Add", ["a", "b"], ["out"])], {"a": r(3, 4), "b": r(4)}, {}),
    "Sub": (13, [N("Sub", ["a", "b"], ["out"])], {"a": r(3, 1), "b": r(1, 4)}, {}),
    "Mul": (13, [N("Mul", ["a", "b"], ["out"])], {"a": r(3, 4), "b": r(3, 4)}, {}),
    "Div": (13, [N("Div", ["a", "b"], ["out"])], {"a": r(3, 4), "b": pos(4)}, {}),
    "Pow": (13, [N("Pow", ["a", "b"], ["out"])], {"a": pos(3, 4), "b": r(3, 4)}, {}),
    "Sqrt": (13, [N("Sqrt", ["a"], ["out"])], {"a": pos(5)}, {}),
    "Exp": (13, [N("Exp", ["a"], ["out"])], {"a": r(5)}, {}),
    "Log": (13, [N("Log", ["a"], ["out"])], {"a": pos(5)}, {}),
    "Neg": (13, [N("Neg", ["a"], ["out"])], {"a": r(5)}, {}),
    "Abs": (13, [N("Abs", ["a"], ["out"])], {"a": r(5)}, {}),
    "Erf": (13, [N("Erf", ["a"], ["out"])], {"a": r(5)}, {}),
    "Tanh": (13, [N("Tanh", ["a"], ["out"])], {"a": r(5)}, {}),
    "Sigmoid": (13, [N("Sigmoid", ["a"], ["out"])], {"a": r(5)}, {}),
    "Relu": (13, [N("Relu", ["a"], ["out"])], {"a": r(5)}, {}),
    "Softplus": (13, [N("Softplus", ["a"], ["out"])], {"a": r(5)}, {}),
    "Reciprocal": (13, [N("Reciprocal", ["a"], ["out"])], {"a": pos(5)}, {}),
    "LeakyRelu": (13, [N("LeakyRelu", ["a"], ["out"], alpha=0.3)], {"a": r(6)}, {}),
    "Elu": (13, [N("Elu", ["a"], ["out"], alpha=0.7)], {"a": r(6)}, {}),
    "Gelu": (20, [N("Gelu", ["a"], ["out"])], {"a": r(6)}, {}),
    "Gelu-tanh": (20, [N("Gelu", ["a"], ["out"], approximate="tanh")], {"a": r(6)}, {}),
    "Softmax-13": (13, [N("Softmax", ["a"], ["out"], axis=1)], {"a": r(2, 3, 4)}, {}),
    "Softmax-11-coerced": (11, [N("Softmax", ["a"], ["out"], axis=1)], {"a": r(2, 3, 4)}, {}),
    "LogSoftmax-13": (13, [N("LogSoftmax", ["a"], ["out"], axis=0)], {"a": r(3, 4)}, {}),
    "LogSoftmax-11-default": (11, [N("LogSoftmax", ["a"], ["out"])], {"a": r(2, 3, 2)}, {}),
    "MatMul-batched": (13, [N("MatMul", ["a", "b"], ["out"])], {"a": r(2, 3, 4), "b": r(4, 5)}, {}),
    "Gemm": (
        13,
        [N("Gemm", ["a", "b", "c"], ["out"], transA=1, transB=1, alpha=0.5, beta=2.0)],
        {"a": r(4, 3), "b": r(5, 4), "c": r(5)},
        {},
    ),
    "Gemm-no-C": (13, [N("Gemm", ["a", "b"], ["out"])], {"a": r(2, 3), "b": r(3, 4)}, {}),
    "Einsum": (
        13,
        [N("Einsum", ["a", "b"], ["out"], equation="bij,bjk->bik")],
        {"a": r(2, 3, 4), "b": r(2, 4, 2)},
        {},
    ),
    "BatchNormalization": (
        15,
        [N("BatchNormalization", ["x", "s", "b", "m", "v"], ["out"], epsilon=1e-3)],
        {"x": r(2, 3, 4, 4), "s": r(3), "b": r(3), "m": r(3), "v": pos(3)},
        {},
    ),
    "LayerNormalization-axis1": (
        17,
        [N("LayerNormalization", ["x", "s", "b"], ["out"], axis=1)],
        {"x": r(2, 3, 4), "s": r(3, 4), "b": r(3, 4)},
        {},
    ),
    "LayerNormalization-nobias": (
        17,
        [N("LayerNormalization", ["x", "s"], ["out"])],
        {"x": r(2, 5), "s": r(5)},
        {},
    ),
    "Dropout-inference": (
        13,
        [N("Dropout", ["x", "ratio", "mode"], ["out"])],
        {"x": r(3, 4)},
        {"ratio": np.array(0.5, np.float32), "mode": np.array(False)},
    ),
    "GlobalAveragePool": (13, [N("GlobalAveragePool", ["x"], ["out"])], {"x": r(2, 3, 4, 5)}, {}),
    "ReduceMean-13-attr": (
        13,
        [N("ReduceMean", ["x"], ["out"], axes=[0, 2], keepdims=0)],
        {"x": r(2, 3, 4)},
        {},
    ),
    "ReduceMean-18-input": (
        18,
        [N("ReduceMean", ["x", "axes"], ["out"])],
        {"x": r(2, 3, 4)},
        {"axes": i64(-1)},
    ),
    "ReduceSum-13-input": (
        13,
        [N("ReduceSum", ["x", "axes"], ["out"], keepdims=0)],
        {"x": r(2, 3, 4)},
        {"axes": i64(1)},
    ),
    "ReduceSum-all": (13, [N("ReduceSum", ["x"], ["out"])], {"x": r(2, 3)}, {}),
    "ReduceSum-noop": (
        13,
        [N("ReduceSum", ["x"], ["out"], noop_with_empty_axes=1)],
        {"x": r(2, 3)},
        {},
    ),
    "ReduceMax-18": (18, [N("ReduceMax", ["x"], ["out"], keepdims=0)], {"x": r(3, 4)}, {}),
    "ReduceMax-13-attr": (13, [N("ReduceMax", ["x"], ["out"], axes=[1])], {"x": r(3, 4)}, {}),
    "CumSum": (
        14,
        [N("CumSum", ["x", "axis"], ["out"], reverse=1)],
        {"x": r(3, 4)},
        {"axis": np.array(1, np.int64)},
    ),
    "Reshape-0-and-minus1": (
        14,
        [N("Reshape", ["x", "shape"], ["out"])],
        {"x": r(2, 3, 4)},
        {"shape": i64(0, -1)},
    ),
    "Flatten-axis2": (13, [N("Flatten", ["x"], ["out"], axis=2)], {"x": r(2, 3, 4, 5)}, {}),
    "Transpose": (13, [N("Transpose", ["x"], ["out"], perm=[2, 0, 1])], {"x": r(2, 3, 4)}, {}),
    "Transpose-default": (13, [N("Transpose", ["x"], ["out"])], {"x": r(2, 3, 4)}, {}),
    "Squeeze-11-attr": (11, [N("Squeeze", ["x"], ["out"], axes=[-1])], {"x": r(3, 1, 1)}, {}),
    "Squeeze-13-input": (
        13,
        [N("Squeeze", ["x", "axes"], ["out"])],
        {"x": r(1, 3, 1)},
        {"axes": i64(0)},
    ),
    "Squeeze-13-all": (13, [N("Squeeze", ["x"], ["out"])], {"x": r(1, 3, 1)}, {}),
    "Unsqueeze-11-attr": (11, [N("Unsqueeze", ["x"], ["out"], axes=[0, 3])], {"x": r(2, 3)}, {}),
    "Unsqueeze-13-negative": (
        13,
        [N("Unsqueeze", ["x", "axes"], ["out"])],
        {"x": r(2, 3)},
        {"axes": i64(-1, 1)},
    ),
    "Concat": (13, [N("Concat", ["a", "b"], ["out"], axis=-1)], {"a": r(2, 3), "b": r(2, 2)}, {}),
    "Split-13-input": (
        13,
        [
            N("Split", ["x", "split"], ["s0", "s1"], axis=1),
            N("Mul", ["s0", "s0"], ["m"]),
            N("Concat", ["m", "s1"], ["out"], axis=1),
        ],
        {"x": r(2, 6)},
        {"split": i64(2, 4)},
    ),
    "Split-11-attr": (
        11,
        [N("Split", ["x"], ["s0", "s1"], axis=0, split=[1, 2]), N("Sub", ["s1", "s0"], ["out"])],
        {"x": r(3, 2)},
        {},
    ),
    "Split-18-num_outputs": (
        18,
        [
            N("Split", ["x"], ["s0", "s1", "s2"], axis=1, num_outputs=3),
            N("Mul", ["s0", "s2"], ["m"]),
            N("Concat", ["m", "s1"], ["out"], axis=1),
        ],
        {"x": r(2, 7)},
        {},
    ),
    # torch.split/chunk/unbind as torch.onnx's dynamo exporter writes them (optimize=False)
    "SplitToSequence-sizes": (
        18,
        [
            N("SplitToSequence", ["x", "split"], ["seq"], axis=1),
            N("SequenceAt", ["seq", "one"], ["s1"]),
            N("SequenceAt", ["seq", "minus_two"], ["s0"]),
            N("Mul", ["s0", "s0"], ["m"]),
            N("Concat", ["s1", "m"], ["c"], axis=1),
            # (ONNX's shape inference does not follow a sequence's parts: a scalar out)
            N("ReduceSum", ["c"], ["out"], keepdims=0),
        ],
        {"x": r(2, 6)},
        {"split": i64(2, 4), "one": np.array(1, np.int64), "minus_two": np.array(-2, np.int64)},
    ),
    "SplitToSequence-chunks": (  # one size: equal chunks, the last one smaller
        18,
        [
            N("SplitToSequence", ["x", "size"], ["seq"], axis=1),
            N("SequenceAt", ["seq", "two"], ["last"]),
            N("SequenceAt", ["seq", "zero"], ["first"]),
            N("Concat", ["first", "last"], ["c"], axis=1),
            N("ReduceSum", ["c"], ["out"], keepdims=0),
        ],
        {"x": r(2, 7)},
        {
            "size": np.array(3, np.int64),
            "two": np.array(2, np.int64),
            "zero": np.array(0, np.int64),
        },
    ),
    "SplitToSequence-unbind": (  # no sizes, keepdims=0: torch.unbind
        18,
        [
            N("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
            N("SequenceAt", ["seq", "zero"], ["a"]),
            N("SequenceAt", ["seq", "two"], ["b"]),
            N("Mul", ["a", "b"], ["out"]),
        ],
        {"x": r(3, 4)},
        {"zero": np.array(0, np.int64), "two": np.array(2, np.int64)},
    ),
    "Slice-negative-clamped": (
        13,
        [N("Slice", ["x", "st", "en", "ax", "sp"], ["out"])],
        {"x": r(5, 6)},
        {"st": i64(-1, 1), "en": i64(-1000, 1000), "ax": i64(0, 1), "sp": i64(-2, 2)},
    ),
    "Slice-default-axes": (
        13,
        [N("Slice", ["x", "st", "en"], ["out"])],
        {"x": r(4, 5)},
        {"st": i64(1, -3), "en": i64(3, 9223372036854775807)},
    ),
    "Slice-9-attrs": (
        9,
        [N("Slice", ["x"], ["out"], starts=[1], ends=[-1], axes=[1])],
        {"x": r(3, 5)},
        {},
    ),
    "Gather-negative": (
        13,
        [N("Gather", ["x", "idx"], ["out"], axis=1)],
        {"x": r(3, 4)},
        {"idx": np.array([[-1, 0], [2, -3]], np.int64)},
    ),
    "Gather-scalar": (
        13,
        [N("Gather", ["x", "idx"], ["out"])],
        {"x": r(3, 4)},
        {"idx": np.array(1, np.int64)},
    ),
    "Expand": (13, [N("Expand", ["x", "shape"], ["out"])], {"x": r(3, 1)}, {"shape": i64(2, 1, 4)}),
    "Tile": (13, [N("Tile", ["x", "reps"], ["out"])], {"x": r(2, 3)}, {"reps": i64(2, 1)}),
    "Where": (
        13,
        [N("Where", ["c", "a", "b"], ["out"])],
        {"a": r(3, 4), "b": r(4)},
        {"c": rng.random((3, 4)) > 0.5},
    ),
    "Where-of-Less": (
        13,
        [N("Less", ["a", "b"], ["c"]), N("Where", ["c", "a", "b"], ["out"])],
        {"a": r(3, 4), "b": r(3, 4)},
        {},
    ),
    "IsNaN-IsInf-masks": (
        13,
        [
            N("Div", ["a", "z"], ["q"]),  # 0/0 = nan, +-1/0 = +-inf
            N("IsNaN", ["q"], ["nan"]),
            N("IsInf", ["q"], ["neg"], detect_positive=0),
            N("IsInf", ["q"], ["inf"]),
            N("Or", ["nan", "neg"], ["drop"]),
            N("Where", ["drop", "z", "b"], ["wb"]),
            N("Where", ["inf", "z", "wb"], ["out"]),
        ],
        {"b": r(6)},
        {
            "a": np.array([0.0, 1.0, -1.0, 2.0, 0.0, 3.0]),
            "z": np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
        },
    ),
    "Greater-Equal-cast": (
        13,
        [
            N("Greater", ["a", "b"], ["g"]),
            N("Equal", ["a", "a"], ["e"]),
            N("And", ["g", "e"], ["c"]),
            N("Cast", ["c"], ["cf"], to=11),
            N("Mul", ["cf", "a"], ["out"]),
        ],
        {"a": r(3, 4), "b": r(3, 4)},
        {},
    ),
    "Max-variadic": (
        13,
        [N("Max", ["a", "b", "c"], ["out"])],
        {"a": r(3, 4), "b": r(4), "c": r(3, 1)},
        {},
    ),
    "Min-variadic": (13, [N("Min", ["a", "b"], ["out"])], {"a": r(3, 4), "b": r(3, 4)}, {}),
    "Clip-13-inputs": (
        13,
        [N("Clip", ["x", "lo", "hi"], ["out"])],
        {"x": r(4, 5)},
        {"lo": np.array(-0.5), "hi": np.array(0.7)},
    ),
    "Clip-13-max-only": (
        13,
        [N("Clip", ["x", "", "hi"], ["out"])],
        {"x": r(4, 5)},
        {"hi": np.array(0.2)},
    ),
    "Clip-6-attrs": (6, [N("Clip", ["x"], ["out"], min=-0.3, max=0.4)], {"x": r(4, 5)}, {}),
    "Pad-constant": (
        13,
        [N("Pad", ["x", "pads", "value"], ["out"])],
        {"x": r(2, 3)},
        {"pads": i64(1, 0, 2, 3), "value": np.array(1.5)},
    ),
    "Pad-18-axes": (
        18,
        [N("Pad", ["x", "pads", "", "axes"], ["out"])],
        {"x": r(2, 3, 4)},
        {"pads": i64(1, 2, 0, 1), "axes": i64(0, -1)},
    ),
    "Trilu-upper": (14, [N("Trilu", ["x", "k"], ["out"])], {"x": r(2, 4, 5)}, {"k": i64(1)}),
    "Trilu-lower": (14, [N("Trilu", ["x", "k"], ["out"], upper=0)], {"x": r(4, 4)}, {"k": i64(-1)}),
    "Conv-2d": (
        13,
        [N("Conv", ["x", "w", "b"], ["out"], strides=[2, 1], pads=[1, 0, 0, 2], dilations=[1, 2])],
        {"x": r(2, 3, 6, 7), "w": r(4, 3, 3, 2), "b": r(4)},
        {},
    ),
    "Conv-1d-groups": (
        13,
        [N("Conv", ["x", "w"], ["out"], group=2, pads=[1, 1])],
        {"x": r(2, 4, 5), "w": r(6, 2, 3)},
        {},
    ),
    "Conv-same-upper": (
        13,
        [N("Conv", ["x", "w"], ["out"], auto_pad="SAME_UPPER", strides=[2, 2])],
        {"x": r(1, 2, 5, 6), "w": r(3, 2, 2, 3)},
        {},
    ),
    "Conv-same-lower": (
        13,
        [N("Conv", ["x", "w"], ["out"], auto_pad="SAME_LOWER")],
        {"x": r(1, 2, 5, 4), "w": r(2, 2, 2, 2)},
        {},
    ),
    "Conv-valid": (
        13,
        [N("Conv", ["x", "w"], ["out"], auto_pad="VALID", kernel_shape=[3])],
        {"x": r(2, 1, 7), "w": r(2, 1, 3)},
        {},
    ),
    "ConvTranspose-1d-stride-pads-output_padding": (
        13,
        [
            N(
                "ConvTranspose",
                ["x", "w", "b"],
                ["out"],
                strides=[3],
                pads=[1, 2],
                output_padding=[1],
            )
        ],
        {"x": r(2, 2, 4), "w": r(2, 3, 3), "b": r(3)},
        {},
    ),
    "ConvTranspose-2d-groups-dilations": (
        13,
        [
            N(
                "ConvTranspose",
                ["x", "w"],
                ["out"],
                group=2,
                strides=[2, 1],
                dilations=[2, 1],
                pads=[1, 0, 0, 1],
            )
        ],
        {"x": r(1, 4, 3, 3), "w": r(4, 3, 3, 2)},
        {},
    ),
    "ConvTranspose-2d-large-pads": (
        13,
        [N("ConvTranspose", ["x", "w"], ["out"], pads=[3, 1, 2, 3])],
        {"x": r(1, 2, 5, 5), "w": r(2, 1, 3, 3)},
        {},
    ),
    "ConvTranspose-output_shape": (
        13,
        [N("ConvTranspose", ["x", "w"], ["out"], strides=[2, 2], output_shape=[8, 7])],
        {"x": r(1, 1, 4, 4), "w": r(1, 2, 3, 3)},
        {},
    ),
    "ConvTranspose-same-upper": (
        13,
        [N("ConvTranspose", ["x", "w"], ["out"], strides=[2], auto_pad="SAME_UPPER")],
        {"x": r(1, 1, 4), "w": r(1, 1, 4)},
        {},
    ),
    "Resize-nearest-asymmetric-floor": (
        13,
        [
            N(
                "Resize",
                ["x", "", "scales"],
                ["out"],
                mode="nearest",
                coordinate_transformation_mode="asymmetric",
                nearest_mode="floor",
            )
        ],
        {"x": r(1, 2, 3, 4)},
        {"scales": np.array([1, 1, 2, 2], np.float32)},
    ),
    "Resize-nearest-half_pixel-down": (
        13,
        [N("Resize", ["x", "", "scales"], ["out"], mode="nearest")],
        {"x": r(1, 1, 5, 7)},
        {"scales": np.array([1, 1, 0.6, 0.5], np.float32)},
    ),
    "Resize-nearest-round_prefer_ceil-sizes": (
        13,
        [N("Resize", ["x", "", "", "sizes"], ["out"], nearest_mode="round_prefer_ceil")],
        {"x": r(1, 1, 4, 3)},
        {"sizes": i64(1, 1, 7, 8)},
    ),
    "Resize-nearest-ceil-align_corners": (
        13,
        [
            N(
                "Resize",
                ["x", "", "", "sizes"],
                ["out"],
                nearest_mode="ceil",
                coordinate_transformation_mode="align_corners",
            )
        ],
        {"x": r(1, 1, 4, 3)},
        {"sizes": i64(1, 1, 6, 5)},
    ),
    "Resize-linear-pytorch_half_pixel": (
        13,
        [
            N(
                "Resize",
                ["x", "", "scales"],
                ["out"],
                mode="linear",
                coordinate_transformation_mode="pytorch_half_pixel",
            )
        ],
        {"x": r(2, 2, 3, 4)},
        {"scales": np.array([1, 1, 2, 2], np.float32)},
    ),
    "Resize-linear-align_corners-sizes": (
        13,
        [
            N(
                "Resize",
                ["x", "", "", "sizes"],
                ["out"],
                mode="linear",
                coordinate_transformation_mode="align_corners",
            )
        ],
        {"x": r(1, 2, 3, 4)},
        {"sizes": i64(1, 2, 5, 9)},
    ),
    "Resize-linear-half_pixel-1d-down": (
        13,
        [N("Resize", ["x", "", "scales"], ["out"], mode="linear")],
        {"x": r(2, 3, 8)},
        {"scales": np.array([1, 1, 0.5], np.float32)},
    ),
    "Resize-linear-asymmetric-axes": (
        18,
        [
            N(
                "Resize",
                ["x", "", "scales"],
                ["out"],
                mode="linear",
                axes=[2],
                coordinate_transformation_mode="asymmetric",
            )
        ],
        {"x": r(1, 2, 3, 4)},
        {"scales": np.array([2.5], np.float32)},
    ),
    "Resize-cubic-half_pixel": (
        13,
        [N("Resize", ["x", "", "scales"], ["out"], mode="cubic")],
        {"x": r(1, 2, 4, 5)},
        {
            "scales": np.array([1, 1, 2, 0.5], np.float32)
        },  # exact coordinates: the reference rounds others
    ),
    "Resize-cubic-align_corners-exclude_outside": (
        13,
        [
            N(
                "Resize",
                ["x", "", "", "sizes"],
                ["out"],
                mode="cubic",
                cubic_coeff_a=-0.5,
                exclude_outside=1,
                coordinate_transformation_mode="align_corners",
            )
        ],
        {"x": r(1, 1, 5, 4)},
        {"sizes": i64(1, 1, 3, 7)},
    ),
    "Resize-10-nearest": (
        10,
        [N("Resize", ["x", "scales"], ["out"])],
        {"x": r(1, 2, 3, 2)},
        {"scales": np.array([1, 1, 2, 3], np.float32)},
    ),
    "Upsample-9-nearest": (
        9,
        [N("Upsample", ["x", "scales"], ["out"])],
        {"x": r(1, 2, 2, 3)},
        {"scales": np.array([1, 1, 3, 2], np.float32)},
    ),
    "LSTM-bidirectional-states-peepholes": (
        14,
        _all_outputs(
            N(
                "LSTM",
                ["x", "w", "r", "b", "", "h0", "c0", "p"],
                ["y", "yh", "yc"],
                hidden_size=3,
                direction="bidirectional",
            ),
            ["y", "yh", "yc"],
        ),
        {
            "x": r(4, 2, 5),
            "w": r(2, 12, 5),
            "r": r(2, 12, 3),
            "b": r(2, 24),
            "h0": r(2, 2, 3),
            "c0": r(2, 2, 3),
            "p": r(2, 9),
        },
        {},
    ),
    "LSTM-batch-first-reverse-clip": (
        14,
        _all_outputs(
            N(
                "LSTM",
                ["x", "w", "r", "b"],
                ["y", "yh", "yc"],
                hidden_size=2,
                layout=1,
                direction="reverse",
                clip=1.5,
            ),
            ["y", "yh", "yc"],
        ),
        {"x": r(3, 4, 2), "w": r(1, 8, 2), "r": r(1, 8, 2), "b": r(1, 16)},
        {},
    ),
    "GRU-linear_before_reset-bidirectional": (
        14,
        _all_outputs(
            N(
                "GRU",
                ["x", "w", "r", "b", "", "h0"],
                ["y", "yh"],
                hidden_size=3,
                direction="bidirectional",
                linear_before_reset=1,
            ),
            ["y", "yh"],
        ),
        {"x": r(3, 2, 4), "w": r(2, 9, 4), "r": r(2, 9, 3), "b": r(2, 18), "h0": r(2, 2, 3)},
        {},
    ),
    "GRU-reset-first-batch-first": (
        14,
        _all_outputs(
            N("GRU", ["x", "w", "r", "b", "", "h0"], ["y", "yh"], hidden_size=2, layout=1),
            ["y", "yh"],
        ),
        {"x": r(2, 4, 3), "w": r(1, 6, 3), "r": r(1, 6, 2), "b": r(1, 12), "h0": r(2, 1, 2)},
        {},
    ),
    "RNN-relu": (
        14,
        _all_outputs(
            N("RNN", ["x", "w", "r", "b"], ["y", "yh"], hidden_size=3, activations=["Relu"]),
            ["y", "yh"],
        ),
        {"x": r(4, 2, 2), "w": r(1, 3, 2), "r": r(1, 3, 3), "b": r(1, 6)},
        {},
    ),
    "LSTM-sequence_lens-bidirectional": (
        14,
        _all_outputs(
            N(
                "LSTM",
                ["x", "w", "r", "b", "lens"],
                ["y", "yh", "yc"],
                hidden_size=2,
                direction="bidirectional",
            ),
            ["y", "yh", "yc"],
        ),
        {"x": r(4, 3, 2), "w": r(2, 8, 2), "r": r(2, 8, 2), "b": r(2, 16)},
        {"lens": np.array([4, 2, 1], np.int32)},
    ),
    "MaxPool-2d": (
        13,
        [N("MaxPool", ["x"], ["out"], kernel_shape=[2, 3], strides=[2, 1], pads=[1, 1, 0, 1])],
        {"x": r(2, 3, 5, 6)},
        {},
    ),
    "MaxPool-ceil-dilated": (
        13,
        [
            N(
                "MaxPool",
                ["x"],
                ["out"],
                kernel_shape=[2, 2],
                strides=[2, 2],
                dilations=[1, 2],
                ceil_mode=1,
            )
        ],
        {"x": r(1, 2, 5, 7)},
        {},
    ),
    "MaxPool-same-upper": (
        13,
        [N("MaxPool", ["x"], ["out"], kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])],
        {"x": r(1, 1, 6, 5)},
        {},
    ),
    "MaxPool-1d": (13, [N("MaxPool", ["x"], ["out"], kernel_shape=[3])], {"x": r(2, 2, 8)}, {}),
    "AveragePool-exclude-pad": (
        13,
        [N("AveragePool", ["x"], ["out"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        {"x": r(2, 2, 4, 5)},
        {},
    ),
    "AveragePool-include-pad": (
        13,
        [
            N(
                "AveragePool",
                ["x"],
                ["out"],
                kernel_shape=[2, 2],
                pads=[1, 0, 0, 1],
                count_include_pad=1,
                strides=[2, 2],
            )
        ],
        {"x": r(1, 3, 5, 5)},
        {},
    ),
    "AveragePool-ceil": (
        13,
        [N("AveragePool", ["x"], ["out"], kernel_shape=[2], strides=[2], ceil_mode=1)],
        {"x": r(1, 2, 7)},
        {},
    ),
    "Identity": (13, [N("Identity", ["x"], ["out"])], {"x": r(3)}, {}),
    "Sum": (13, [N("Sum", ["a", "b", "c"], ["out"])], {"a": r(3), "b": r(3), "c": r(1)}, {}),
    "Shape-folded": (
        15,
        [
            N("Shape", ["x"], ["s"], start=1),
            N(
                "ConstantOfShape",
                ["s"],
                ["z"],
                value=helper.make_tensor("v", onnx.TensorProto.DOUBLE, [1], [2.0]),
            ),
            N("Mul", ["x", "z"], ["out"]),
        ],
        {"x": r(3, 4)},
        {},
    ),
    "Range-Cast-folded": (
        13,
        [
            N("Constant", [], ["n"], value_int=4),
            N("Constant", [], ["z"], value_int=0),
            N("Constant", [], ["o"], value_int=1),
            N("Range", ["z", "n", "o"], ["rg"]),
            N("Cast", ["rg"], ["rf"], to=11),
            N("Mul", ["x", "rf"], ["out"]),
        ],
        {"x": r(3, 4)},
        {},
    ),
    "CastLike": (
        15,
        [N("CastLike", ["x", "like"], ["c"]), N("Mul", ["c", "c"], ["out"])],
        {"x": r(3, 4)},
        {"like": np.zeros((), np.float64)},
    ),
    "HardSigmoid": (
        13,
        [N("HardSigmoid", ["a"], ["out"], alpha=0.4, beta=0.3)],
        {"a": 2 * r(7)},
        {},
    ),
    "HardSwish": (14, [N("HardSwish", ["a"], ["out"])], {"a": 4 * r(9)}, {}),
    "Mish": (18, [N("Mish", ["a"], ["out"])], {"a": 3 * r(7)}, {}),
    "PRelu-per-channel": (
        13,
        [N("PRelu", ["x", "slope"], ["out"])],
        {"x": r(2, 3, 4), "slope": r(3, 1)},
        {},
    ),
    "Selu": (13, [N("Selu", ["a"], ["out"])], {"a": 2 * r(7)}, {}),
    "Celu": (13, [N("Celu", ["a"], ["out"], alpha=0.7)], {"a": 2 * r(7)}, {}),
    "Softsign": (13, [N("Softsign", ["a"], ["out"])], {"a": 2 * r(7)}, {}),
    "ThresholdedRelu": (13, [N("ThresholdedRelu", ["a"], ["out"], alpha=0.3)], {"a": r(9)}, {}),
    "Mean-variadic": (
        13,
        [N("Mean", ["a", "b", "c"], ["out"])],
        {"a": r(3, 4), "b": r(4), "c": r(3, 1)},
        {},
    ),
    "ReduceL1-18": (18, [N("ReduceL1", ["x", "axes"], ["out"])], {"x": r(3, 4)}, {"axes": i64(1)}),
    "ReduceL2-13": (13, [N("ReduceL2", ["x"], ["out"], axes=[0], keepdims=0)], {"x": r(3, 4)}, {}),
    "ReduceSumSquare": (18, [N("ReduceSumSquare", ["x"], ["out"])], {"x": r(3, 4)}, {}),
    "ReduceLogSumExp": (
        18,
        [N("ReduceLogSumExp", ["x", "axes"], ["out"], keepdims=0)],
        {"x": r(3, 4)},
        {"axes": i64(-1)},
    ),
    "Atan": (13, [N("Atan", ["a"], ["out"])], {"a": 2 * r(6)}, {}),
    "Asin": (13, [N("Asin", ["a"], ["out"])], {"a": 0.9 * np.tanh(r(6))}, {}),
    "Acos": (13, [N("Acos", ["a"], ["out"])], {"a": 0.9 * np.tanh(r(6))}, {}),
    "Sinh": (13, [N("Sinh", ["a"], ["out"])], {"a": r(6)}, {}),
    "Cosh": (13, [N("Cosh", ["a"], ["out"])], {"a": r(6)}, {}),
    "Asinh": (13, [N("Asinh", ["a"], ["out"])], {"a": 2 * r(6)}, {}),
    "Acosh": (13, [N("Acosh", ["a"], ["out"])], {"a": 1.2 + pos(6)}, {}),
    "Atanh": (13, [N("Atanh", ["a"], ["out"])], {"a": 0.9 * np.tanh(r(6))}, {}),
    "InstanceNormalization": (
        13,
        [N("InstanceNormalization", ["x", "s", "b"], ["out"], epsilon=1e-3)],
        {"x": r(2, 3, 4, 5), "s": r(3), "b": r(3)},
        {},
    ),
    "InstanceNormalization-1d": (
        13,
        [N("InstanceNormalization", ["x", "s", "b"], ["out"])],
        {"x": r(2, 3, 6), "s": r(3), "b": r(3)},
        {},
    ),
    "GroupNormalization-21-per-channel": (
        21,
        [
            N(
                "GroupNormalization",
                ["x", "s", "b"],
                ["out"],
                num_groups=2,
                epsilon=1e-3,
                stash_type=11,  # the statistics in float64 (the reference's default: float32)
            )
        ],
        {"x": r(2, 4, 3, 2), "s": r(4), "b": r(4)},
        {},
    ),
    "GatherND": (
        13,
        [N("GatherND", ["x", "idx"], ["out"])],
        {"x": r(3, 4, 2)},
        {"idx": np.array([[[0, 1], [2, -1]], [[1, 0], [0, 0]]], np.int64)},
    ),
    "GatherND-batch_dims": (
        13,
        [N("GatherND", ["x", "idx"], ["out"], batch_dims=1)],
        {"x": r(2, 3, 4)},
        {"idx": np.array([[[1], [0]], [[2], [-1]]], np.int64)},
    ),
}


def _coerced(log: bool):
    """Softmax before opset 13 (Operators.md, Softmax-11): the input is coerced to 2-D
    at `axis` (default 1) and each row normalized over the flattened trailing axes.
    (onnx.reference implements only the opset-13 form.)"""

    def closed(x: np.ndarray, axis: int = 1) -> np.ndarray:
        rows = x.reshape(int(np.prod(x.shape[:axis])), -1)
        z = rows - rows.max(axis=1, keepdims=True)
        out = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return (out if log else np.exp(out)).reshape(x.shape)

    return closed


def _conv_transpose(strides, pads, dilations, groups=1, extra=None):
    """ConvTranspose by its definition (each input cell adds its value times the kernel
    into the output at i*stride + k*dilation - pad_begin), for the cases the reference
    evaluator cannot run (groups, output_shape)."""

    def closed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        nd = x.ndim - 2
        n, c_in, size, kernel = x.shape[0], x.shape[1], x.shape[2:], w.shape[2:]
        c_out_g, cg = w.shape[1], c_in // groups
        full = [
            (a - 1) * s + (k - 1) * d + 1 + (extra or [0] * nd)[i]
            for i, (a, k, s, d) in enumerate(zip(size, kernel, strides, dilations))
        ]
        out = np.zeros((n, groups * c_out_g, *full))
        for idx in np.ndindex(*size):
            for kdx in np.ndindex(*kernel):
                at = tuple(i * s + k * d for i, k, s, d in zip(idx, kdx, strides, dilations))
                for g in range(groups):
                    xs = x[(slice(None), slice(g * cg, (g + 1) * cg), *idx)]  # [n, cg]
                    ws = w[(slice(g * cg, (g + 1) * cg), slice(None), *kdx)]  # [cg, c_out_g]
                    out[(slice(None), slice(g * c_out_g, (g + 1) * c_out_g), *at)] += xs @ ws
        crop = tuple(slice(lo, f - hi) for (lo, hi), f in zip(pads, full))
        return out[(slice(None), slice(None), *crop)]

    return closed


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _lstm(direction="forward", layout=0, clip=None, lens=None):
    """LSTM by Operators.md's equations (gates i, o, f, c; no peepholes or initial
    states) with what the reference evaluator ignores: clip and sequence_lens (a
    sequence stops at its length; the reverse direction starts at its last valid step);
    returns Y, Y_h, Y_c flattened and joined like `_all_outputs`."""

    def closed(x, w, r, b):
        if layout:
            x = x.swapaxes(0, 1)
        seq, batch = x.shape[:2]
        hidden = r.shape[-1]
        n = np.full(batch, seq) if lens is None else lens
        cut = (lambda v: v) if clip is None else (lambda v: np.clip(v, -clip, clip))
        y = np.zeros((seq, w.shape[0], batch, hidden))
        yh, yc = np.zeros((w.shape[0], batch, hidden)), np.zeros((w.shape[0], batch, hidden))
        for d in range(w.shape[0]):
            back = direction == "reverse" or d == 1
            for s in range(batch):
                h, c = np.zeros(hidden), np.zeros(hidden)
                for t in range(n[s] - 1, -1, -1) if back else range(n[s]):
                    g = x[t, s] @ w[d].T + h @ r[d].T + b[d, : 4 * hidden] + b[d, 4 * hidden :]
                    i, o, f, cc = (cut(g[k * hidden : (k + 1) * hidden]) for k in range(4))
                    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(cc)
                    h = _sigmoid(o) * np.tanh(c)
                    y[t, d, s] = h
                yh[d, s], yc[d, s] = h, c
        if layout:
            y, yh, yc = y.transpose(2, 0, 1, 3), yh.swapaxes(0, 1), yc.swapaxes(0, 1)
        return np.concatenate([y.reshape(1, -1), yh.reshape(1, -1), yc.reshape(1, -1)], axis=1)

    return closed


def _relu_rnn(x, w, r, b):
    h, ys = np.zeros((x.shape[1], r.shape[-1])), []
    for t in range(x.shape[0]):
        h = np.maximum(x[t] @ w[0].T + h @ r[0].T + b[0, :3] + b[0, 3:], 0)
        ys.append(h)
    return np.concatenate([np.stack(ys)[:, None].reshape(1, -1), h.reshape(1, -1)], axis=1)


CLOSED_FORMS = {
    # The reference evaluator ignores clip and sequence_lens and knows no Relu RNN.
    "LSTM-batch-first-reverse-clip": _lstm("reverse", layout=1, clip=1.5),
    "LSTM-sequence_lens-bidirectional": _lstm("bidirectional", lens=np.array([4, 2, 1])),
    "RNN-relu": _relu_rnn,
    "Softmax-11-coerced": _coerced(False),
    "LogSoftmax-11-default": _coerced(True),
    "ConvTranspose-2d-groups-dilations": _conv_transpose(
        strides=[2, 1], pads=[(1, 0), (0, 1)], dilations=[2, 1], groups=2
    ),
    # The reference evaluator runs Resize-10 only at opset 11+; at integer scales nearest
    # is each cell repeated (ONNX's Upsample reference).
    "Resize-10-nearest": lambda x: np.repeat(np.repeat(x, 2, axis=2), 3, axis=3),
    # output_shape [8, 7] from a full 9 x 9: the spare cells split, the odd one first.
    "ConvTranspose-output_shape": _conv_transpose(
        strides=[2, 2], pads=[(1, 0), (1, 1)], dilations=[1, 1]
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_op_value_and_derivatives(case: str) -> None:
    opset, nodes, inputs, consts = CASES[case]
    data = graph_model(nodes, inputs, consts, opset)
    model = load_model(data)
    spec = model.specialize([(a.shape, a.dtype) for a in inputs.values()])
    if case in CLOSED_FORMS:
        expected = CLOSED_FORMS[case](*inputs.values())
    else:
        expected = ReferenceEvaluator(onnx.load_model_from_string(data)).run(None, inputs)[0]

    params = {name: constant(v) for name, v in model.params.items()}  # clip bounds

    def f(*xs):
        return model.run(spec, xs, params)[0]

    out = f(*[constant(a) for a in inputs.values()])
    # The reference evaluator computes erf and gelu in float32.
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-7, atol=1e-7)
    assert tuple(out.shape) == spec.outputs[0][0]
    check_grads(f, list(inputs.values()), order=2, modes=("rev", "fwd"))


def test_every_mapped_op_has_a_case() -> None:
    from engine.onnx import SUPPORTED_OPS

    covered = {n.op_type for _, nodes, _, _ in CASES.values() for n in nodes}
    # Ops whose tests live elsewhere: comparisons and logic feed Where/Cast cases above;
    # the trigonometric ones and Sign are mapped one to one like the other unary ops.
    elsewhere = {
        "Sin",
        "Cos",
        "Tan",
        "Sign",
        "Not",
        "Or",
        "LessOrEqual",
        "GreaterOrEqual",
        "GlobalMaxPool",
        "ReduceMin",
        "ReduceProd",
        "Size",
    }
    missing = set(SUPPORTED_OPS) - covered - elsewhere
    assert not missing, f"ops without a test case: {sorted(missing)}"


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_memory_grows_with_the_output_not_its_product_with_the_input(mode: str) -> None:
    # A long 1-D axis doubled: 6,000 output cells from 3,000. A dense [out, in]
    # interpolation map would hold 18 million entries (144 MB, past the service's
    # max_elements per tensor, and counted nowhere); the answer itself is 6,000 numbers.
    import tracemalloc

    x = r(1, 1, 3000)
    data = graph_model(
        [N("Resize", ["x", "", "scales"], ["out"], mode=mode)],
        {"x": x},
        {"scales": np.array([1, 1, 2], np.float32)},
        13,
    )
    model = load_model(data)
    spec = model.specialize([(x.shape, x.dtype)])
    tracemalloc.start()
    try:
        out = model.run(spec, [constant(x)], {})[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    expected = ReferenceEvaluator(onnx.load_model_from_string(data)).run(None, {"x": x})[0]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-7, atol=1e-7)


def _f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32).astype(np.float64)  # a float32 constant's value


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (
            [N("Constant", [], ["c"], value_float=0.1), N("Mul", ["x", "c"], ["out"])],
            lambda x: x * _f32(0.1),
        ),
        (
            [N("Constant", [], ["c"], value_floats=[0.1, 0.2, 0.3]), N("Mul", ["x", "c"], ["out"])],
            lambda x: x * _f32(0.1, 0.2, 0.3),
        ),
        (  # ConstantOfShape without `value` makes float32 zeros (Operators.md)
            [
                N("Shape", ["x"], ["s"]),
                N("ConstantOfShape", ["s"], ["c"]),
                N("Add", ["x", "c"], ["out"]),
            ],
            lambda x: x,
        ),
    ],
    ids=["value_float", "value_floats", "ConstantOfShape-default"],
)
def test_a_float32_model_run_in_float64_types_every_float_constant(nodes, expected) -> None:
    # `dtype: float64` on a float32 file: its float32 constants become float64 too (the
    # same values); left float32, the run failed on float64 x float32 ("use gt.cast").
    from engine.language import as_definition, compile_definition

    x = r(2, 3).astype(np.float32)
    definition = as_definition(
        {
            "dtype": "float64",
            "models": {"net": {"onnx": graph_model(nodes, {"x": x}, {}, 17)}},
            "inputs": {"x": x.astype(np.float64)},
            "program": ["y = net(x)"],
        }
    )
    program = compile_definition(definition)
    out = program.run(program.leaves(definition))["y"].numpy()
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, expected(x.astype(np.float64)))
