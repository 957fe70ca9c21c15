"""The CuPy backend: the same ops and transforms on an NVIDIA GPU give NumPy's answers.

Skipped, with the reason, where CuPy or a GPU is absent (CI has neither).
"""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from tests.engine.test_ops import ROWS, _args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gt.cuda_available(), reason="needs CuPy and an NVIDIA GPU"),
]

GPU_ROWS = [row for row in ROWS if row.name not in {"prod_zero"}]


@pytest.mark.parametrize("row", GPU_ROWS, ids=[row.name for row in GPU_ROWS])
def test_op_on_gpu_matches_cpu(row) -> None:
    shapes = row.shapes[-1]
    arrays = _args(row, shapes)
    cpu = [gt.constant(a) for a in arrays]
    gpu = [gt.constant(a, device="cuda") for a in arrays]
    results = []
    for args in (cpu, gpu):
        with gt.GradientTape() as tape:
            tape.watch(args)
            out = row.fn(*args)
            total = gt.sum(out * out)
        results.append((out, tape.gradient(total, args)))
    (out_c, g_c), (out_g, g_g) = results
    assert out_g.device == "cuda:0"
    np.testing.assert_allclose(out_g.numpy(), out_c.numpy(), rtol=1e-10, atol=1e-12)
    for a, b in zip(g_c, g_g):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-9, atol=1e-11)


def test_hessian_operator_on_gpu() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    v = rng.standard_normal((8, 4)).astype(np.float32)
    answers = []
    for device in ("cpu", "cuda"):
        xt = gt.constant(x, device=device)

        def loss(k, xt=xt):
            return gt.mean(gt.tanh(xt @ k) ** 2)

        op = gt.hessian_operator(loss, gt.constant(w, device=device))
        answers.append(op.hvp(gt.constant(v, device=device))[0].numpy())
    np.testing.assert_allclose(answers[1], answers[0], rtol=1e-4, atol=1e-6)


def test_jit_runs_cupy_arguments_dynamically_with_numpys_answers() -> None:
    """gt.jit captures NumPy passes only: CuPy arguments take the dynamic transforms
    (their key says why), and answer as the NumPy ones, which are compiled."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 4))

    def loss(w, x):
        return gt.sum(gt.tanh(x @ w) ** 2)

    jitted = gt.jit(loss)
    for _ in range(3):
        w = rng.standard_normal((4, 2))
        cpu = jitted.value_and_grad()(gt.constant(w), gt.constant(x))
        gpu = jitted.value_and_grad()(gt.constant(w, device="cuda"), gt.constant(x, device="cuda"))
        assert gpu[1].device == "cuda:0"
        np.testing.assert_allclose(gpu[0].numpy(), cpu[0].numpy(), rtol=1e-10)
        np.testing.assert_allclose(gpu[1].numpy(), cpu[1].numpy(), rtol=1e-10)
    status = sorted(jitted.status().values())
    assert len(status) == 2 and status[0] == "compiled", status
    assert "CuPy" in status[1], status


@pytest.mark.parametrize("name", ["lenet", "resnet", "transformer"])
def test_onnx_models_on_gpu_match_cpu(name) -> None:
    """A stored ONNX model run on CuPy (its graph constants moved to the device as they
    meet its tensors): loss, gradients and an HVP as on the CPU (float64)."""
    pytest.importorskip("onnx")
    from engine.language import as_definition, compile_definition
    from tests.engine.onnx.graphs import fixture, float64_model

    data, record = fixture(name)
    x = record["x"].astype(np.float64) if record["x"].dtype.kind == "f" else record["x"]
    defn = as_definition(
        {
            "models": {
                "net": {"onnx": float64_model(data), "frozen": [str(f) for f in record["frozen"]]}
            },
            "inputs": {"x": x, "y": record["y"]},
            "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
        }
    )
    prog = compile_definition(defn)
    request = prog.check_request("loss")
    answers = []
    for device in ("cpu", "cuda"):
        leaves = prog.leaves(defn, device=device)
        value, grads = prog.value_and_gradients(request, leaves)
        rng = np.random.default_rng(0)
        vectors = [
            gt.constant(rng.standard_normal(leaves[n].shape), device=device)
            for n in request.sources.values()
        ]
        products = prog.hessian_operator(request, leaves).hvp(*vectors)
        answers.append([value.numpy(), *(g.numpy() for g in grads.values())])
        answers[-1] += [p.numpy() for p in products]
    for cpu, gpu in zip(*answers, strict=True):
        np.testing.assert_allclose(gpu, cpu, rtol=1e-9, atol=1e-12)
