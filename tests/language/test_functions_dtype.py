"""Plain functions (no backward program; calls between functions; variables a function
owns, `critic.w1`) and a definition's default dtype, through the engine API."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.language import DefinitionError, compile_definition, evaluate

RNG = np.random.default_rng(12)
N, D, H = 6, 3, 4

CRITIC = {
    "params": ["x"],
    "forward": ["h = tanh(x @ w1 + b1)", "out = h @ w2 + b2"],
}
WGAN_LINES = [
    "real = critic(x_real)",
    "fake = critic(x_fake)",
    "xh = eps * x_real + (1 - eps) * x_fake",
    "score = critic(xh)",
    "g = grad(sum(score), xh)",
    "gp = mean((sqrt(sum(g ** 2, axis=1)) - 1) ** 2)",
    "loss = mean(fake) - mean(real) + 10.0 * gp",
]
# The same program written out three times, as before plain functions.
EXPANDED_LINES = [
    "real = tanh(x_real @ w1 + b1) @ w2 + b2",
    "fake = tanh(x_fake @ w1 + b1) @ w2 + b2",
    "xh = eps * x_real + (1 - eps) * x_fake",
    "score = tanh(xh @ w1 + b1) @ w2 + b2",
    "g = grad(sum(score), xh)",
    "gp = mean((sqrt(sum(g ** 2, axis=1)) - 1) ** 2)",
    "loss = mean(fake) - mean(real) + 10.0 * gp",
]
PARAMS = {
    "w1": RNG.normal(size=(D, H)),
    "b1": RNG.normal(size=(H,)) * 0.1,
    "w2": RNG.normal(size=(H, 1)),
    "b2": np.array([0.3]),
}
DATA = {
    "x_real": RNG.normal(size=(N, D)),
    "x_fake": RNG.normal(size=(N, D)) + 1.0,
    "eps": RNG.uniform(size=(N, 1)),
}


def wgan(params: dict[str, np.ndarray] = PARAMS) -> dict:
    """The critic written once, owning its variables as critic.w1 ..."""
    return {
        "dtype": "float64",
        "variables": {f"critic.{k}": v for k, v in params.items()},
        "inputs": DATA,
        "functions": {"critic": CRITIC},
        "program": WGAN_LINES,
    }


def expanded(params: dict[str, np.ndarray] = PARAMS) -> dict:
    return {"variables": dict(params), "inputs": DATA, "program": EXPANDED_LINES}


def test_wgan_gp_critic_once_matches_the_program_written_out() -> None:
    once = evaluate(wgan(), "loss")
    out = evaluate(expanded(), "loss")
    assert once.value.dtype == np.float64
    np.testing.assert_allclose(once.value, out.value, rtol=1e-14)
    assert list(once.gradients) == [f"critic.{k}" for k in PARAMS]
    for k in PARAMS:
        np.testing.assert_allclose(once.gradients[f"critic.{k}"], out.gradients[k], rtol=1e-12)


def test_wgan_gp_gradient_against_finite_differences() -> None:
    grads = evaluate(wgan(), "loss").gradients
    step = 1e-6
    for k, value in PARAMS.items():
        direction = RNG.normal(size=value.shape)
        plus = evaluate(wgan({**PARAMS, k: value + step * direction}), "loss").value
        minus = evaluate(wgan({**PARAMS, k: value - step * direction}), "loss").value
        fd = (plus - minus) / (2 * step)
        np.testing.assert_allclose(
            np.sum(grads[f"critic.{k}"] * direction), fd, rtol=1e-6, atol=1e-8
        )  # b2's gradient is 0: the bias cancels


def hvps(defn: dict, names: list[str], vectors: list[np.ndarray]) -> list[np.ndarray]:
    program = compile_definition(defn)
    request = program.check_request("loss", names)
    leaves = program.leaves(defn)
    return [
        np.asarray(h.numpy())
        for h in program.hessian_operator(request, leaves).hvp(*[gt.constant(v) for v in vectors])
    ]


def test_wgan_gp_second_order_matches_written_out_and_finite_differences() -> None:
    vectors = [RNG.normal(size=v.shape) for v in PARAMS.values()]
    once = hvps(wgan(), [f"critic.{k}" for k in PARAMS], vectors)
    out = hvps(expanded(), list(PARAMS), vectors)
    for a, b in zip(once, out):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    # H v against differences of gradients along v
    step = 1e-6

    def grads(sign: float) -> list[np.ndarray]:
        moved = {k: v + sign * step * t for (k, v), t in zip(PARAMS.items(), vectors)}
        g = evaluate(wgan(moved), "loss").gradients
        return [g[f"critic.{k}"] for k in PARAMS]

    for h, p, m in zip(once, grads(1.0), grads(-1.0)):
        np.testing.assert_allclose(h, (p - m) / (2 * step), rtol=1e-5, atol=1e-7)


def test_plain_functions_call_functions_and_take_variables_as_arguments() -> None:
    defn = {
        "dtype": "float64",
        "variables": {"w": [[1.0, 2.0], [3.0, -1.0]], "b": [0.5, -0.5]},
        "inputs": {"x": [[0.2, -0.4], [1.0, 0.3]]},
        "functions": {
            "dense": {"params": ["x", "w", "b"], "forward": ["y = x @ w + b"]},
            "block": {"params": ["x", "w", "b"], "forward": ["y = tanh(dense(x, w, b))"]},
        },
        "program": ["y = block(block(x, w, b), w, b)", "loss = sum(y ** 2)"],
    }
    written = {
        **defn,
        "functions": {},
        "program": ["h = tanh(x @ w + b)", "y = tanh(h @ w + b)", "loss = sum(y ** 2)"],
    }
    a, b = evaluate(defn, "loss"), evaluate(written, "loss")
    np.testing.assert_allclose(a.value, b.value, rtol=1e-15)
    for k in ("w", "b"):
        np.testing.assert_allclose(a.gradients[k], b.gradients[k], rtol=1e-13)
    # third order through the nested functions: d/dw of a grad-of-grad
    defn3 = {
        **defn,
        "program": [
            "y = block(block(x, w, b), w, b)",
            "l1 = sum(y ** 2)",
            "g1 = grad(l1, b)",
            "l2 = sum(g1 ** 2)",
            "g2 = grad(l2, b)",
            "loss = sum(g2 * g2)",
        ],
    }
    wr3 = {
        **defn3,
        "functions": {},
        "program": ["h = tanh(x @ w + b)", "y = tanh(h @ w + b)"] + defn3["program"][1:],
    }
    a, b = evaluate(defn3, "loss", ["w"]), evaluate(wr3, "loss", ["w"])
    np.testing.assert_allclose(a.gradients["w"], b.gradients["w"], rtol=1e-11)


def problems(defn: dict) -> list[str]:
    with pytest.raises(DefinitionError) as info:
        compile_definition(defn)
    return [str(p) for p in info.value.problems]


def test_recursion_is_refused_naming_the_cycle() -> None:
    defn = {
        "inputs": {"x": [1.0]},
        "functions": {
            "f": {"params": ["a"], "forward": ["b = g(a)"]},
            "g": {"params": ["a"], "forward": ["b = h(a) * 2"]},
            "h": {"params": ["a"], "forward": ["b = f(a)"]},
        },
        "program": ["y = f(x)"],
    }
    assert problems(defn) == [
        (
            "functions.f: recursion: f -> g -> h -> f; a function may call other functions but "
            "never itself, directly or through others"
        )
    ]


def test_owned_variables_are_checked() -> None:
    body = {"params": ["x"], "forward": ["y = x * w"]}
    assert problems(
        {
            "variables": {"critc.w": 1.0},
            "inputs": {"x": 1.0},
            "functions": {"critic": body},
            "program": ["y = critic(x)"],
        }
    ) == [
        (
            "variables.critc.w: a dotted variable belongs to the function before the dot, and "
            "no function is named 'critc'; did you mean 'critic'?"
        ),
        "functions.critic.forward line 1, column 9: undefined name 'w'",
    ]
    found = problems(
        {
            "variables": {"critic.x": 1.0},
            "inputs": {"x": 1.0},
            "functions": {"critic": body},
            "program": ["y = critic(x)"],
        }
    )
    assert found[0] == (
        "functions.critic.params: 'x' is both a parameter and the "
        "function's own variable 'critic.x'"
    )
    custom = {**body, "backward": ["grad_x = upstream * w"]}
    found = problems(
        {
            "variables": {"critic.w": 1.0},
            "inputs": {"x": 1.0},
            "functions": {"critic": custom},
            "program": ["y = critic(x)"],
        }
    )
    assert found[0] == (
        "functions.critic: a function with a backward program takes its "
        "variables as parameters (critic.w belong to it)"
    )


def test_default_dtype_makes_bare_values_float64() -> None:
    defn = {
        "dtype": "float64",
        "variables": {"w": [1.0, 2.0]},
        "inputs": {"x": [0.1, 0.2], "c": 1e-300},
        "program": ["y = sum(w * x) + c"],
    }
    out = evaluate(defn, "y")
    assert out.value.dtype == np.float64 and out.gradients["w"].dtype == np.float64
    assert float(out.value) == pytest.approx(0.5 + 1e-300, rel=1e-15)
    np.testing.assert_array_equal(out.gradients["w"], np.array([0.1, 0.2]))  # exact in f64
    # without it, float32 as before
    assert (
        evaluate({**defn, "dtype": None, "inputs": {"x": [0.1, 0.2], "c": 0.0}}, "y").value.dtype
        == np.float32
    )


def test_default_dtype_mixing_stays_an_error() -> None:
    defn = {
        "dtype": "float64",
        "variables": {"w": [1.0, 2.0]},
        "inputs": {"x": np.array([0.1, 0.2], np.float32)},
        "program": ["y = sum(w * x)"],
    }
    (only,) = problems(defn)
    assert "float64" in only and "float32" in only and "line 1" in only


def test_default_dtype_must_be_a_float_dtype() -> None:
    assert problems({"dtype": "int32", "program": []}) == [
        "dtype: dtype must be one of float16, float32, float64, got 'int32'"
    ]
