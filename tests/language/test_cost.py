"""The cost model (engine/language/cost.py) counts what one forward pass does from the
inferred shapes: contraction FLOPs, transcendental elements, bytes moved; a run is the
forward pass plus its derivative passes."""

from __future__ import annotations

import numpy as np

from engine.language import as_definition, compile_definition
from engine.language.cost import BACKWARD, HVP, Throughput


def cost_of(program: list[str], **leaves: np.ndarray):
    variables = {k: v for k, v in leaves.items() if k.startswith("w")}
    inputs = {k: v for k, v in leaves.items() if not k.startswith("w")}
    definition = {"program": program, "variables": variables, "inputs": inputs}
    return compile_definition(as_definition(definition)).cost


def test_a_matmul_counts_two_m_n_k_flops_and_its_operands_bytes() -> None:
    x, w = np.ones((8, 16), np.float32), np.ones((16, 4), np.float32)
    cost = cost_of(["y = x @ w", "loss = sum(y)"], x=x, w=w)
    assert cost.flops == 2 * 8 * 16 * 4
    assert cost.transcendentals == 0
    # matmul reads x and w and writes y; sum reads y and writes one element
    assert cost.bytes_moved == 4 * ((8 * 16 + 16 * 4 + 8 * 4) + (8 * 4 + 1))


def test_transcendentals_count_their_elements_and_a_run_scales_with_its_items() -> None:
    cost = cost_of(["z = broadcast_to(sum(w), (64, 64))", "loss = sum(sin(z) * z)"], w=np.ones(4))
    assert cost.transcendentals == 64 * 64 and cost.flops == 0
    rate = Throughput(1e9, 1e8, 1e9)
    one, many = cost.estimate(1, False, rate), cost.estimate(101, False, rate)
    assert many.transcendentals - one.transcendentals == 100 * HVP[1] * cost.transcendentals
    first = cost.estimate(10, True, rate)
    assert first.bytes_moved == cost.bytes_moved * (1 + 10 * BACKWARD[2])
    want = first.flops / 1e9 + first.transcendentals / 1e8 + first.bytes_moved / 1e9
    assert np.isclose(first.seconds, want)


def test_a_zero_throughput_turns_the_guard_off() -> None:
    assert not Throughput(1e9, 0, 1e9).enabled and Throughput(1, 1, 1).enabled


def _onnx_mlp() -> bytes:
    """x -> tanh(x @ W1 + b) -> Gemm(., W2, transB) : the ops of an exported MLP."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W1"),
        numpy_helper.from_array(np.zeros(32, np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((4, 32)).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Tanh", ["hb"], ["a"]),
        helper.make_node("Gemm", ["a", "W2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_an_onnx_models_nodes_count_as_the_languages_ops_do() -> None:
    """A model's MatMul, Gemm and Tanh cost what x @ W, tanh(...) cost written out (they
    counted only their results' bytes: an ONNX model of matmuls passed the guard free)."""
    x = np.ones((8, 16), np.float32)
    definition = {"models": {"net": {"onnx": _onnx_mlp()}}, "inputs": {"x": x}}
    cost = compile_definition(as_definition({**definition, "program": ["loss = sum(net(x))"]})).cost
    assert cost.flops == 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4
    assert cost.transcendentals == 8 * 32
    written = cost_of(
        ["h = tanh(x @ w1 + b)", "y = h @ transpose(w2)", "loss = sum(y)"],
        x=x,
        w1=np.ones((16, 32), np.float32),
        b=np.zeros(32, np.float32),
        w2=np.ones((4, 32), np.float32),
    )
    assert (cost.flops, cost.transcendentals) == (written.flops, written.transcendentals)
