"""SCENARIOS.md, written as definitions, checked against the scenario's numbers and
against the same computation through the engine API.

Scenarios 1 and 2 (stop_recording, reset) are tape-control calls a program cannot make;
their effect on a program, a value that does not carry gradient, is stop_gradient.
Jacobians, Hessians and batch jacobians (8-12) are taken by the caller's tape around
`program.run`, as the service will. 14's timing and memory are the engine's tests; here
the reused HVPs of a compiled program equal fresh ones.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine as gt
from engine.language import (
    DefinitionError,
    clear_cache,
    compile_definition,
    evaluate,
)


def numbers(result: dict) -> dict:
    return {k: None if v is None else float(v) for k, v in result.items()}


def run_under_tape(defn: dict, persistent: bool = False, watch: tuple = ()) -> tuple:
    program = compile_definition(defn)
    leaves = program.leaves(defn)
    with gt.GradientTape(persistent=persistent) as tape:
        tape.watch([leaves[n] for n in watch])
        env = program.run(leaves)
    return tape, env, leaves


def finite_difference(program, leaves: dict, target: str, source: str, eps: float = 1e-6):
    """d target / d source by central differences, element by element (float64)."""
    base = leaves[source].numpy()
    grad = np.zeros_like(base)
    for i in np.ndindex(base.shape):
        values = []
        for sign in (1, -1):
            moved = base.copy()
            moved[i] += sign * eps
            env = dict(leaves, **{source: gt.constant(moved)})
            values.append(float(program.run(env, targets=[target])[target].numpy()))
        grad[i] = (values[0] - values[1]) / (2 * eps)
    return grad


# ---- 1, 2, 3: a value that carries no gradient --------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        ["x_sq = x * x", "y_sq = stop_gradient(y * y)", "z = x_sq + y_sq"],  # 1: stop_recording
        ["y_sq = stop_gradient(y * y)", "z = x * x + y_sq"],  # 2: reset
        ["z = x ** 2 + stop_gradient(y ** 2)"],  # 3: stop_gradient
    ],
)
def test_values_without_gradient(program: list[str]) -> None:
    defn = {"variables": {"x": 2.0, "y": 3.0}, "program": program}
    result = evaluate(defn, "z", {"x": "x", "y": "y"})
    assert float(result.value) == 13.0
    assert numbers(result.gradients) == {"x": 4.0, "y": None}


# ---- 4: custom gradient ------------------------------------------------------------------

CLIP_FUNCTION = {
    "params": ["x"],
    "forward": ["y = x"],
    "backward": ["grad_x = clip_by_norm(upstream, 0.5)"],
}


def test_custom_gradient_user_function() -> None:
    defn = {
        "variables": {"v": 2.0},
        "functions": {"clip_gradient": CLIP_FUNCTION},
        "program": ["output = clip_gradient(v * v)"],
    }
    result = evaluate(defn, "output", ["v"])
    assert float(result.value) == 4.0
    assert numbers(result.gradients) == {"v": 2.0}


def test_custom_gradient_builtin() -> None:
    defn = {"variables": {"v": 2.0}, "program": ["output = clip_grad_norm(v * v, 0.5)"]}
    assert numbers(evaluate(defn, "output").gradients) == {"v": 2.0}


def test_custom_gradient_survives_a_restart() -> None:
    # Stored as JSON, loaded into a fresh cache: the same model, the same 2.0.
    stored = json.dumps(
        {
            "variables": {"v": {"value": 2.0, "trainable": True}},
            "functions": {"clip_gradient": CLIP_FUNCTION},
            "program": ["output = clip_gradient(v * v)"],
        }
    )
    clear_cache()
    result = evaluate(json.loads(stored), "output")
    assert numbers(result.gradients) == {"v": 2.0}


def test_custom_gradient_matches_the_engine_api() -> None:
    @gt.custom_gradient
    def clip_gradient(x):
        return x, lambda g: gt.clip_by_norm(g, 0.5)

    v = gt.Variable(np.array([1.0, -2.0, 0.5]))
    with gt.GradientTape() as tape:
        out = gt.sum(clip_gradient(v * v) * 3.0)
    expected = tape.gradient(out, v).numpy()
    defn = {
        "variables": {"v": v.numpy()},
        "functions": {"clip_gradient": CLIP_FUNCTION},
        "program": ["output = sum(clip_gradient(v * v) * 3.0)"],
    }
    np.testing.assert_allclose(evaluate(defn, "output").gradients["v"], expected)


# ---- 5: two sources, two tapes -----------------------------------------------------------


def test_multiple_tapes() -> None:
    defn = {"inputs": {"x0": 0.0, "x1": 0.0}, "program": ["ys = sum(sin(x0) + sigmoid(x1))"]}
    assert numbers(evaluate(defn, "ys", ["x0"]).gradients) == {"x0": 1.0}
    assert numbers(evaluate(defn, "ys", ["x1"]).gradients) == {"x1": 0.25}


# ---- 6 and 16: higher order by nested grad -----------------------------------------------

HIGHER = ["y = x * x * x", "dy = grad(y, x)", "d2y = grad(dy, x)", "d3y = grad(d2y, x)"]


def test_higher_order() -> None:
    defn = {"inputs": {"x": 1.0}, "program": HIGHER}
    kw = {"sources": ["x"], "allow_unused": True}
    assert float(evaluate(defn, "dy", **kw).value) == 3.0
    assert numbers(evaluate(defn, "dy", **kw).gradients) == {"x": 6.0}  # second order
    assert float(evaluate(defn, "d2y", **kw).value) == 6.0
    assert numbers(evaluate(defn, "d2y", **kw).gradients) == {"x": 6.0}  # third order
    assert float(evaluate(defn, "d3y", **kw).value) == 6.0


def test_nested_tapes_by_hand() -> None:
    consts = {"x": 3.0, "y": 2.0}
    assert numbers(
        evaluate({"inputs": consts, "program": ["z = x * x"]}, "z", ["x"]).gradients
    ) == {"x": 6.0}
    defn = {"inputs": consts, "program": ["z = x * y * y", "dz_dx = grad(z, x)"]}
    result = evaluate(defn, "dz_dx", ["y"])
    assert float(result.value) == 4.0
    assert numbers(result.gradients) == {"y": 4.0}
    defn = {"inputs": {"x": 3.0}, "program": ["y = x * x", "dy_dx = grad(y, x)"]}
    result = evaluate(defn, "dy_dx", ["x"])
    assert (float(result.value), numbers(result.gradients)) == (6.0, {"x": 2.0})
    defn = {"inputs": consts, "program": ["z = x * x + y", "m = y + y * y + x"]}
    assert numbers(evaluate(defn, "z", ["x"], allow_unused=True).gradients) == {"x": 6.0}
    assert numbers(evaluate(defn, "m", ["y"], allow_unused=True).gradients) == {"y": 5.0}
    # One persistent tape around one run gives the same.
    tape, env, leaves = run_under_tape(defn, persistent=True, watch=("x", "y"))
    assert float(tape.gradient(env["z"], leaves["x"])) == 6.0
    assert float(tape.gradient(env["m"], leaves["y"])) == 5.0


# ---- 7: input-gradient regularisation ----------------------------------------------------


def test_input_gradient_regularisation() -> None:
    rng = np.random.default_rng(7)
    x, kernel, bias = (
        rng.standard_normal((7, 5)),
        rng.standard_normal((5, 10)),
        rng.standard_normal(10),
    )
    defn = {
        "variables": {"kernel": kernel, "bias": bias},
        "inputs": {"x": x},
        "program": [
            "out = sum(relu(x @ kernel + bias) ** 2)",
            "g1 = grad(out, x)",
            "g1_mag = norm(g1)",
        ],
    }
    result = evaluate(defn, "g1_mag")
    assert [g.shape for g in result.gradients.values()] == [(5, 10), (10,)]

    k, b, xt = gt.Variable(kernel), gt.Variable(bias), gt.constant(x)
    with gt.GradientTape() as outer:
        with gt.GradientTape(watch_accessed_variables=False) as inner:
            inner.watch(xt)
            out = gt.sum(gt.relu(xt @ k + b) ** 2)
        g1_mag = gt.norm(inner.gradient(out, xt))
    expected = outer.gradient(g1_mag, [k, b])
    for got, want in zip(result.gradients.values(), expected):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12)

    program = compile_definition(defn)
    leaves = program.leaves(defn)
    for name in ("kernel", "bias"):
        fd = finite_difference(program, leaves, "g1_mag", name)
        np.testing.assert_allclose(result.gradients[name], fd, rtol=1e-5, atol=1e-6)


# ---- 8, 9: jacobians of a program's values -----------------------------------------------


def test_jacobian_scalar_source() -> None:
    x = np.linspace(-10, 10, 201).astype(np.float32)
    defn = {"variables": {"delta": 0.0}, "inputs": {"x": x}, "program": ["y = sigmoid(x + delta)"]}
    tape, env, leaves = run_under_tape(defn)
    jac = tape.jacobian(env["y"], leaves["delta"])
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    assert jac.shape == (201,)
    np.testing.assert_allclose(jac.numpy(), s * (1 - s), atol=1e-6)


def test_jacobian_tensor_source() -> None:
    rng = np.random.default_rng(9)
    defn = {
        "variables": {"kernel": rng.standard_normal((5, 10)), "bias": rng.standard_normal(10)},
        "inputs": {"x": rng.standard_normal((7, 5))},
        "program": ["y = relu(x @ kernel + bias)", "total = sum(y)"],
    }
    tape, env, leaves = run_under_tape(defn, persistent=True)
    jac = tape.jacobian(env["y"], leaves["kernel"])
    assert jac.shape == (7, 10, 5, 10)
    grad = tape.gradient(env["total"], leaves["kernel"])
    assert np.max(np.abs(gt.sum(jac, axis=(0, 1)).numpy() - grad.numpy())) < 1e-6


# ---- 10: Hessian and a Newton step -------------------------------------------------------


def test_hessian_of_a_two_layer_network() -> None:
    rng = np.random.default_rng(10)
    defn = {
        "variables": {
            "kernel1": rng.standard_normal((5, 8)) * 0.5,
            "bias1": np.zeros(8),
            "kernel2": rng.standard_normal((8, 6)) * 0.5,
            "bias2": np.zeros(6),
        },
        "inputs": {"x": rng.standard_normal((7, 5))},
        "program": [
            "h = relu(x @ kernel1 + bias1)",
            "out = relu(h @ kernel2 + bias2)",
            "loss = mean(out ** 2)",
            "g = grad(loss, kernel1)",
        ],
    }
    tape, env, leaves = run_under_tape(defn)
    hess = tape.jacobian(env["g"], leaves["kernel1"])
    assert hess.shape == (5, 8, 5, 8)
    flat = hess.numpy().reshape(40, 40)
    np.testing.assert_allclose(flat, flat.T, atol=1e-10)
    program = compile_definition(defn)
    f = program.function("loss", ["kernel1"], leaves)
    np.testing.assert_allclose(gt.hessian(f)(leaves["kernel1"]).numpy(), hess.numpy(), atol=1e-10)


def test_newton_step_reaches_the_minimum_of_a_quadratic() -> None:
    rng = np.random.default_rng(11)
    x, target = rng.standard_normal((7, 5)), rng.standard_normal((7, 8))
    defn = {
        "variables": {"kernel1": rng.standard_normal((5, 8))},
        "inputs": {"x": x, "target": target},
        "program": ["loss = sum((x @ kernel1 - target) ** 2)", "g = grad(loss, kernel1)"],
    }
    tape, env, leaves = run_under_tape(defn, persistent=True)
    h = tape.jacobian(env["g"], leaves["kernel1"]).numpy().reshape(40, 40)
    g = env["g"].numpy().reshape(40)
    step = np.linalg.solve(h + 1e-3 * np.eye(40), g).reshape(5, 8)
    moved = dict(defn, variables={"kernel1": leaves["kernel1"].numpy() - step})
    best = np.linalg.lstsq(x, target, rcond=None)[0]
    minimum = np.sum((x @ best - target) ** 2)
    loss = float(evaluate(moved, "loss", allow_unused=True).value)
    assert float(env["loss"]) > 2 * minimum
    assert loss == pytest.approx(minimum, rel=1e-6)


# ---- 11, 12: batch jacobians -------------------------------------------------------------


def _two_elu_layers(middle: str) -> dict:
    rng = np.random.default_rng(12)
    return {
        "variables": {
            "k1": rng.standard_normal((5, 8)),
            "b1": rng.standard_normal(8),
            "k2": rng.standard_normal((8, 6)),
            "b2": rng.standard_normal(6),
        },
        "inputs": {"x": rng.standard_normal((7, 5))},
        "program": [f"h = {middle}", "y = elu(h @ k2 + b2)"],
    }


def test_batch_jacobian() -> None:
    tape, env, leaves = run_under_tape(
        _two_elu_layers("elu(x @ k1 + b1)"), persistent=True, watch=("x",)
    )
    full = tape.jacobian(env["y"], leaves["x"]).numpy()
    assert full.shape == (7, 6, 7, 5)
    for i in range(7):
        for j in range(7):
            if i != j:
                assert np.all(full[i, :, j, :] == 0)
    batch = tape.batch_jacobian(env["y"], leaves["x"])
    assert batch.shape == (7, 6, 5)
    np.testing.assert_allclose(batch.numpy(), full.sum(axis=2), atol=1e-12)


def test_batch_jacobian_misuse_is_told() -> None:
    tape, env, leaves = run_under_tape(
        _two_elu_layers("batch_norm(elu(x @ k1 + b1))"), watch=("x",)
    )
    with pytest.raises(gt.BatchDependenceError):
        tape.batch_jacobian(env["y"], leaves["x"])


# ---- 13, 14: persistent tapes, reusable HVPs ---------------------------------------------


def test_persistent_tapes() -> None:
    defn = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]}
    tape, env, leaves = run_under_tape(defn)
    tape.gradient(env["loss"], leaves["w"])
    with pytest.raises(RuntimeError, match="non-persistent"):
        tape.gradient(env["loss"], leaves["w"])
    tape, env, leaves = run_under_tape(defn, persistent=True)
    for _ in range(3):
        np.testing.assert_array_equal(tape.gradient(env["loss"], leaves["w"]).numpy(), [2, 4])


def test_hvp_reuse() -> None:
    rng = np.random.default_rng(14)
    defn = {
        "variables": {"w1": rng.standard_normal((4, 6)), "w2": rng.standard_normal(6)},
        "inputs": {"x": rng.standard_normal((5, 4))},
        "program": ["loss = mean(tanh(x @ w1) @ w2) ** 2"],
    }
    program = compile_definition(defn)
    request = program.check_request("loss")
    leaves = program.leaves(defn)
    operator = program.hessian_operator(request, leaves)
    f = program.function("loss", ["w1", "w2"], leaves)
    for seed in range(3):
        v = np.random.default_rng(seed)
        vectors = (v.standard_normal((4, 6)), v.standard_normal(6))
        fresh = gt.hvp(f, (leaves["w1"], leaves["w2"]), vectors)
        for got, want in zip(operator.hvp(*vectors), fresh):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)


# ---- 15: three ways to ask ---------------------------------------------------------------

THREE_WAYS = {
    "variables": {"w1": {"value": 2.0}, "w2": {"value": 3.0, "trainable": True}},
    "inputs": {"x1": 5.0, "x2": 7.0},
    "program": ["s = w1 * x1 + w2 * x2"],
}


def test_three_ways_to_ask() -> None:
    result = evaluate(THREE_WAYS, "s", ["w1", "w2"])
    assert float(result.value) == 31.0
    assert numbers(result.gradients) == {"w1": 5.0, "w2": 7.0}
    assert numbers(evaluate(THREE_WAYS, "s", "w1").gradients) == {"w1": 5.0}
    args = evaluate(THREE_WAYS, "s", {"first": "x1", "second": "x2"})
    assert numbers(args.gradients) == {"first": 2.0, "second": 3.0}
    assert numbers(evaluate(THREE_WAYS, "s").gradients) == {"w1": 5.0, "w2": 7.0}
    frozen = dict(
        THREE_WAYS, variables={"w1": {"value": 2.0, "trainable": False}, "w2": {"value": 3.0}}
    )
    assert numbers(evaluate(frozen, "s").gradients) == {"w2": 7.0}


def test_unconnected_sources() -> None:
    defn = {"variables": {"w": 2.0, "unused": [1.0, 2.0]}, "program": ["s = w * w"]}
    assert evaluate(defn, "s", ["w", "unused"]).gradients["unused"] is None
    zeros = evaluate(defn, "s", ["unused"], unconnected="zero").gradients["unused"]
    np.testing.assert_array_equal(zeros, [0.0, 0.0])


# ---- 17: gradient penalty (WGAN-GP) ------------------------------------------------------


def _wgan() -> dict:
    rng = np.random.default_rng(17)

    def layer(n_in: int, n_out: int) -> tuple:
        return rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), rng.standard_normal(n_out) * 0.1

    gw1, gb1 = layer(4, 8)
    gw2, gb2 = layer(8, 3)
    cw1, cb1 = layer(3, 8)
    cw2, cb2 = layer(8, 1)
    return {
        "variables": {
            "gw1": gw1,
            "gb1": gb1,
            "gw2": gw2,
            "gb2": gb2,
            "cw1": cw1,
            "cb1": cb1,
            "cw2": cw2,
            "cb2": cb2,
        },
        "inputs": {
            "z": rng.standard_normal((6, 4)),
            "real": rng.standard_normal((6, 3)),
            "eps": rng.uniform(size=(6, 1)),
        },
        "program": [
            "fake = tanh(z @ gw1 + gb1) @ gw2 + gb2",
            "xhat = eps * real + (1 - eps) * fake",
            "critic = sum(tanh(xhat @ cw1 + cb1) @ cw2 + cb2)",
            "g = grad(critic, xhat)",
            "penalty = mean((norm(g, axis=1) - 1) ** 2)",
        ],
    }


def test_gradient_penalty() -> None:
    defn = _wgan()
    critic_params = ["cw1", "cb1", "cw2", "cb2"]
    # The critic's last bias does not reach the penalty (it drops out of the gradient
    # of the critic): with unconnected="zero" it answers a real zero array, not None.
    result = evaluate(defn, "penalty", critic_params, unconnected="zero")
    program = compile_definition(defn)
    leaves = program.leaves(defn)
    for name in critic_params:
        grad = result.gradients[name]
        assert grad is not None and np.all(np.isfinite(grad))
        fd = finite_difference(program, leaves, "penalty", name)
        np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)
    # The generator's parameters are reached through xhat as well.
    generator = evaluate(defn, "penalty", ["gw1"]).gradients["gw1"]
    np.testing.assert_allclose(
        generator, finite_difference(program, leaves, "penalty", "gw1"), rtol=1e-5, atol=1e-7
    )


def test_gradient_penalty_matches_the_engine_api() -> None:
    defn = _wgan()
    v = {k: gt.Variable(val) for k, val in defn["variables"].items()}
    z, real, eps = (gt.constant(defn["inputs"][k]) for k in ("z", "real", "eps"))
    with gt.GradientTape() as outer:
        fake = gt.tanh(z @ v["gw1"] + v["gb1"]) @ v["gw2"] + v["gb2"]
        xhat = eps * real + (1 - eps) * fake
        with gt.GradientTape(watch_accessed_variables=False) as inner:
            inner.watch(xhat)
            critic = gt.sum(gt.tanh(xhat @ v["cw1"] + v["cb1"]) @ v["cw2"] + v["cb2"])
        g = inner.gradient(critic, xhat)
        penalty = gt.mean((gt.norm(g, axis=1) - 1) ** 2)
    expected = outer.gradient(penalty, [v["cw1"], v["cb1"]])
    result = evaluate(defn, "penalty", ["cw1", "cb1"])
    np.testing.assert_allclose(float(result.value), float(penalty), rtol=1e-12)
    for got, want in zip(result.gradients.values(), expected):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10)


def test_grad_source_must_be_a_name() -> None:
    defn = {"inputs": {"x": 1.0}, "program": ["y = grad(x * x, x + 1)"]}
    with pytest.raises(DefinitionError, match=r"grad\(y, x\), where x is a name"):
        compile_definition(defn)
