"""A definition cut at its output (CompiledProgram.split) drives engine.curvature: the
GGN of a program (an MLP, and the ONNX LeNet through `net(x)`) against its dense
J^T H_L J, and every way the cut can be refused, with the line and the reason."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.curvature import Curvature
from engine.hessian_algorithms import FlatOperator
from engine.language import DefinitionError, as_definition, compile_definition
from engine.registry import public_ops
from tests.engine.onnx.graphs import fixture, float64_model

MLP = ["h = tanh(x @ w1 + b1)", "logits = h @ w2", "loss = softmax_cross_entropy(logits, y)"]


def mlp_definition(program=MLP, seed=0):
    rng = np.random.default_rng(seed)
    return as_definition(
        {
            "variables": {
                "w1": rng.standard_normal((3, 4)).tolist(),
                "b1": rng.standard_normal(4).tolist(),
                "w2": rng.standard_normal((4, 3)).tolist(),
            },
            "inputs": {
                "x": rng.standard_normal((6, 3)).tolist(),
                "y": np.array([0, 1, 2, 1, 0, 2]),
            },
            "program": program,
            "dtype": "float64",
        }
    )


def curvature_of(defn, output="logits", target="loss"):
    program = compile_definition(defn)
    leaves = program.leaves(defn)
    request = program.check_request(target, None, "zero", allow_unused=True)
    split = program.split(output, request.target, request.sources)
    model, loss = split.functions(leaves)
    params = {n: leaves[n] for n in request.sources.values()}
    data = {n: leaves[n] for n in split.data}
    targets = {n: leaves[n] for n in split.targets}
    return split, Curvature(model, loss, params, data, targets), params


def dense_ggn(curv: Curvature, params: dict) -> np.ndarray:
    names = list(params)
    flat = np.concatenate([params[n].numpy().ravel() for n in names])

    def unflat(t):
        out, start = {}, 0
        for n in names:
            out[n] = gt.reshape(t[start : start + params[n].size], params[n].shape)
            start += params[n].size
        return out

    jac = gt.jacrev(lambda t: curv._model(unflat(t), curv.data))(gt.constant(flat)).numpy()
    jac = jac.reshape(-1, flat.size)
    h = gt.hessian(lambda o: curv._loss(o, curv.targets))(curv.output).numpy()
    h = h.reshape(jac.shape[0], jac.shape[0])
    return jac.T @ h @ jac


def test_the_split_names_data_and_targets_and_gives_the_dense_ggn() -> None:
    split, curv, params = curvature_of(mlp_definition())
    assert split.data == ("x",) and split.targets == ("y",)
    assert curv.likelihood().family == "categorical"
    flat = FlatOperator(curv.operator("ggn"))
    np.testing.assert_allclose(
        flat.matvec(np.eye(flat.n)), dense_ggn(curv, params), rtol=1e-10, atol=1e-12
    )
    # The cut program computes what the whole program does.
    program = compile_definition(mlp_definition())
    whole = program.run(program.leaves(mlp_definition()))["loss"].numpy()
    assert float(curv.value.numpy()) == pytest.approx(float(whole), rel=1e-14)


@pytest.mark.skipif("conv" not in public_ops, reason="the engine has no conv primitive")
def test_the_onnx_lenet_ggn_products_match_dense_j_h_j() -> None:
    data, record = fixture("lenet")
    defn = as_definition(
        {
            "models": {"net": {"onnx": float64_model(data)}},
            "inputs": {"x": record["x"].astype(np.float64), "y": record["y"]},
            "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
        }
    )
    _, curv, params = curvature_of(defn)
    op = curv.operator("ggn")
    flat = FlatOperator(op)
    vs = np.random.default_rng(0).standard_normal((2, flat.n))
    np.testing.assert_allclose(
        flat.matvec(vs), vs @ dense_ggn(curv, params).T, rtol=1e-8, atol=1e-10
    )
    # The exact Fisher of softmax cross-entropy is the GGN.
    np.testing.assert_allclose(
        FlatOperator(curv.operator("fisher")).matvec(vs), flat.matvec(vs), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize(
    "program, output, message, line",
    [
        (MLP, "logit", "output 'logit' is no line of the program; did you mean 'logits'", None),
        (MLP, "x", "output 'x' is an input or variable of the program", None),
        (
            MLP + ["acc = sum(logits)"],
            "acc",
            "the target 'loss' does not use the output 'acc'",
            None,
        ),
        (
            [
                "h = tanh(x @ w1 + b1)",
                "logits = h @ w2",
                "loss = softmax_cross_entropy(logits, y) + mean(h ** 2)",
            ],
            "logits",
            "the loss line 'loss' reads 'h', a line of the model",
            3,
        ),
        (
            [
                "h = tanh(x @ w1 + b1)",
                "logits = h @ w2",
                "loss = softmax_cross_entropy(logits, y) + sum(w1 ** 2)",
            ],
            "logits",
            "the loss line 'loss' reads 'w1', a source",
            3,
        ),
    ],
)
def test_a_refused_cut_says_where_and_why(program, output, message, line) -> None:
    defn = mlp_definition(program)
    compiled = compile_definition(defn)
    request = compiled.check_request("loss", None, "zero", allow_unused=True)
    with pytest.raises(DefinitionError) as caught:
        compiled.split(output, "loss", request.sources)
    problem = caught.value.problems[0]
    assert message in problem.message
    assert problem.line == line


def test_leaves_read_follows_the_lines_a_name_needs() -> None:
    """The variables and inputs a name depends on, through the lines it reads (a sharded
    tape's jacobian asks whether a name reads the split batch)."""
    program = compile_definition(
        mlp_definition(
            [*MLP[:2], "pen = 0.1 * sum(w1 ** 2)", "loss = softmax_cross_entropy(logits, y) + pen"]
        )
    )
    assert program.leaves_read("pen") == {"w1"}
    assert program.leaves_read("logits") == {"x", "w1", "b1", "w2"}
    assert program.leaves_read("loss") == {"x", "y", "w1", "b1", "w2"}
    assert program.leaves_read("x") == {"x"}


def test_a_loss_line_calling_the_model_again_is_refused() -> None:
    """A model call reads the model's parameters without naming them: a loss line that
    calls the model again after the output (`again = net(x)`, as the PyTorch bridge's
    lines over a module's second output do) depends on the sources, and the cut let it
    through (the GGN then treated it as a constant: torch's J^T H J over both outputs
    differed by 78%). Refused with the line and the model, as a named source is; with
    the model's parameters frozen the cut stands."""
    data, record = fixture("lenet")
    program = [
        "logits = net(x)",
        "again = net(2.0 * x)",
        "loss = softmax_cross_entropy(logits, y) + mean(again ** 2)",
    ]
    spec = {
        "models": {"net": {"onnx": float64_model(data)}},
        "inputs": {"x": record["x"].astype(np.float64), "y": record["y"]},
        "program": program,
    }
    compiled = compile_definition(as_definition(spec))
    request = compiled.check_request("loss", None, "zero", allow_unused=True)
    with pytest.raises(DefinitionError) as caught:
        compiled.split("logits", "loss", request.sources)
    (problem,) = caught.value.problems
    assert "the loss line 'again' calls model 'net', which reads sources (" in problem.message
    assert problem.line == 2
    # With the model's parameters held fixed (no source of it), the cut stands.
    names = [n for n in request.sources.values() if n not in ("x", "y")]
    fixed = as_definition(
        {**spec, "models": {"net": {"onnx": float64_model(data), "frozen": names}}}
    )
    held = compile_definition(fixed)
    assert held.split("logits", "loss", {}).loss_lines == {1, 2}
