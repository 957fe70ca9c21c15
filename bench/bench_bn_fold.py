"""Issue 28, item 2: the ONNX BatchNormalization handler folded per channel (y = x * a + c)
against the four full-size ops it replaced, A/B in one process on the issue-sized ResNet's
dynamic gradient (the handler is looked up per call; compiled passes would hide it).

    env -u OPENBLAS_CORETYPE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        PYTHONPATH=. /work/venv/bin/python bench/bench_bn_fold.py
"""

import sys
import time

import numpy as np

sys.path.insert(0, ".")
from bench import onnx_models
from engine.language import as_definition, compile_definition
from engine.onnx import ops as O

OP = O.OP


def old_bn(ins, attrs, opset):
    x, scale, bias, mean, var = ins[:5]
    rank = len(x.shape)
    eps = float(attrs.get("epsilon", 1e-5))
    inv = OP["rsqrt"](OP["add"](O._channel(var, rank), O._like(eps, x)))
    y = OP["multiply"](OP["subtract"](x, O._channel(mean, rank)), inv)
    return [OP["add"](OP["multiply"](y, O._channel(scale, rank)), O._channel(bias, rank))]


new_bn = O.HANDLERS["BatchNormalization"]
data, model, frozen = onnx_models.model("resnet")
x, y = onnx_models.batch("resnet", 64, np.random.default_rng(0))
defn = as_definition(
    {
        "models": {"net": {"onnx": data, "frozen": frozen}},
        "inputs": {"x": x, "y": y},
        "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
    }
)
prog = compile_definition(defn)
leaves = prog.leaves(defn)
req = prog.check_request("loss")
srcs = [leaves[s] for s in req.sources.values()]


def grad(h):
    O.HANDLERS["BatchNormalization"] = h
    return prog.value_and_gradients(req, leaves, compiled=False)


ga = grad(old_bn)
gb = grad(new_bn)
print(
    "max rel diff",
    max(
        float(
            np.abs(ga[1][k].numpy() - gb[1][k].numpy()).max()
            / (np.abs(ga[1][k].numpy()).max() + 1e-30)
        )
        for k in ga[1]
    ),
)
best = {"old": 1e9, "new": 1e9}
for _ in range(7):
    for name, h in (("old", old_bn), ("new", new_bn)):
        c = time.process_time()
        grad(h)
        grad(h)
        best[name] = min(best[name], (time.process_time() - c) / 2 * 1e3)
print(best, best["new"] / best["old"])
