"""Small ONNX graphs for the tests, built with onnx.helper, and a float64 copy of a model
(so finite differences and the float64 PyTorch answers can be compared tightly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.onnx.model import as_float64

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def graph_model(
    nodes: list,
    inputs: dict[str, np.ndarray],
    consts: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    outputs: tuple[str, ...] = ("out",),
    dynamic: dict[str, list] | None = None,
    domains: dict[str, int] | None = None,
) -> bytes:
    """A model of `nodes` whose graph inputs are `inputs` (shapes as given, or the dims
    in `dynamic`) and whose initializers are `consts`; outputs of unknown shape."""
    dynamic = dynamic or {}
    graph_inputs = [
        helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(a.dtype), dynamic.get(name, list(a.shape))
        )
        for name, a in inputs.items()
    ]
    graph_outputs = [helper.make_empty_tensor_value_info(n) for n in outputs]
    inits = [numpy_helper.from_array(np.asarray(a), name) for name, a in (consts or {}).items()]
    graph = helper.make_graph(nodes, "g", graph_inputs, graph_outputs, inits)
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid(d, v) for d, v in {"": opset, **(domains or {})}.items()
        ],
    )
    model.ir_version = 8
    # The outputs' types from shape inference (an output needs one for the checker).
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type for v in inferred.graph.value_info}
    for value in model.graph.output:
        if value.name in types and types[value.name].tensor_type.HasField("shape"):
            value.type.CopyFrom(types[value.name])
        else:  # what inference cannot tell: the reference evaluator's answer's type
            value.CopyFrom(_evaluated_type(model, value.name, inputs))
    return model.SerializeToString()


def _evaluated_type(model: onnx.ModelProto, name: str, inputs: dict[str, np.ndarray]) -> object:
    """The type of output `name` as the reference evaluator computes it (ONNX's shape
    inference skips function ops such as GroupNormalization); some float tensor for an
    op it cannot run (the unsupported-op tests)."""
    from onnx.reference import ReferenceEvaluator

    try:
        out = ReferenceEvaluator(model).run([name], inputs)[0]
    except Exception:  # noqa: BLE001 (an op the evaluator lacks: any float tensor will do)
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["d"])
    return helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(out.dtype), list(out.shape)
    )


def float64_model(data: bytes) -> bytes:
    """The same model computing in float64 (the engine's own conversion, which the
    service runs for a `dtype: float64` request on a float32 model)."""
    return as_float64(onnx.load_model_from_string(data)).SerializeToString()


def fixture(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    data = (FIXTURES / f"{name}.onnx").read_bytes()
    with np.load(FIXTURES / f"{name}.npz") as z:
        record = {k: z[k] for k in z.files}
    return data, record
