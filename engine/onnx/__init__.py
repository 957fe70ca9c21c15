"""ONNX models as engine functions (no HTTP here).

    from engine.onnx import load_model, ModelError
    model = load_model(open("lenet.onnx", "rb").read())   # checked; all problems at once
    model.params                                        # {onnx initializer name: array}
    spec = model.specialize([((8, 1, 28, 28), "float32")])
    (logits,) = model.run(spec, [x], variables_by_name)

The definition language calls a model as a function (`logits = net(x)`): see
engine/language (definition.py `models`, validate.py, runtime.py).
Needs the `onnx` package (imported on first use, so the engine alone does not).
"""

from engine.onnx.errors import ModelError, ModelProblem
from engine.onnx.model import OnnxModel, Specialization, load_model
from engine.onnx.ops import HANDLERS

SUPPORTED_OPS = sorted(HANDLERS)

__all__ = [
    "SUPPORTED_OPS",
    "ModelError",
    "ModelProblem",
    "OnnxModel",
    "Specialization",
    "load_model",
]
