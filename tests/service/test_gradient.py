"""POST /v1/gradient: SCENARIOS.md over HTTP through the definition language.

Scenarios 1 and 2 (stop_recording, reset) are tape calls a program cannot make; their
effect on a program, a value that carries no gradient, is stop_gradient. 13 and 14
(persistent tapes, HVP reuse across requests) are the stateful tapes of issue 6; the
stateless parts of 14 are in test_hvp.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.api.schemas import GRADIENT_EXAMPLE
from tests.service.wire import arr, dense, num, nums, post, problem, t

# ---- 15: the DESIGN.md example, exactly ------------------------------------------------


def test_design_example_exactly(client) -> None:
    response = client.post("/v1/gradient", json=GRADIENT_EXAMPLE)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    answer = response.json()
    # Beside the design's fields: how the worker ran the passes (test_compiled_passes.py).
    assert set(answer.pop("execution")) == {"compiled", "reason"}
    assert answer == {
        "value": {"dtype": "float32", "shape": [], "data": [31.0]},
        "gradients": {
            "w1": {"dtype": "float32", "shape": [], "data": [5.0]},
            "w2": {"dtype": "float32", "shape": [], "data": [7.0]},
        },
    }


SUM = {"inputs": {"x1": 5.0, "x2": 7.0}, "program": ["s = w1 * x1 + w2 * x2"]}


def test_three_ways_to_ask(client) -> None:
    defn = {**SUM, "variables": {"w1": 2.0, "w2": 3.0}}
    one = post(client, "/v1/gradient", {"definition": defn, "target": "s", "sources": "w1"})
    assert num(one["value"]) == 31.0
    assert nums(one["gradients"]) == {"w1": 5.0}
    args = post(
        client, "/v1/gradient", {"definition": defn, "target": "s", "sources": ["x1", "x2"]}
    )
    assert nums(args["gradients"]) == {"x1": 2.0, "x2": 3.0}
    implicit = post(client, "/v1/gradient", {"definition": defn, "target": "s"})
    assert num(implicit["value"]) == 31.0  # value and gradients in one call
    assert nums(implicit["gradients"]) == {"w1": 5.0, "w2": 7.0}


def test_only_trainable_variables_by_default(client) -> None:
    defn = {**SUM, "variables": {"w1": {"value": 2.0, "trainable": False}, "w2": 3.0}}
    body = post(client, "/v1/gradient", {"definition": defn, "target": "s"})
    assert nums(body["gradients"]) == {"w2": 7.0}


def test_sources_by_alias(client) -> None:
    defn = {**SUM, "variables": {"w1": 2.0, "w2": 3.0}}
    body = post(
        client,
        "/v1/gradient",
        {"definition": defn, "target": "s", "sources": {"a": "w2", "b": "x1"}},
    )
    assert nums(body["gradients"]) == {"a": 7.0, "b": 2.0}


# ---- 1, 2, 3: values that carry no gradient -----------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        ["x_sq = x * x", "y_sq = stop_gradient(y * y)", "z = x_sq + y_sq"],  # 1: stop_recording
        ["y_sq = stop_gradient(y * y)", "z = x * x + y_sq"],  # 2: reset
        ["z = x ** 2 + stop_gradient(y ** 2)"],  # 3: stop_gradient
    ],
)
def test_unconnected_sources(client, program: list[str]) -> None:
    body = {
        "definition": {"variables": {"x": 2.0, "y": 3.0}, "program": program},
        "target": "z",
        "sources": {"x": "x", "y": "y"},
    }
    answer = post(client, "/v1/gradient", body)
    assert num(answer["value"]) == 13.0
    assert nums(answer["gradients"]) == {"x": 4.0, "y": None}
    zero = post(client, "/v1/gradient", {**body, "unconnected": "zero"})
    assert nums(zero["gradients"]) == {"x": 4.0, "y": 0.0}


# ---- 4: custom gradients -------------------------------------------------------------------

CLIP = {"params": ["x"], "forward": ["y = x"], "backward": ["grad_x = clip_by_norm(upstream, 0.5)"]}


def test_custom_gradient_builtin(client) -> None:
    defn = {"variables": {"v": 2.0}, "program": ["output = clip_grad_norm(v * v, 0.5)"]}
    answer = post(client, "/v1/gradient", {"definition": defn, "target": "output"})
    assert num(answer["value"]) == 4.0
    assert nums(answer["gradients"]) == {"v": 2.0}


def test_custom_gradient_user_function(client) -> None:
    defn = {
        "variables": {"v": 2.0},
        "functions": {"clip_gradient": CLIP},
        "program": ["output = clip_gradient(v * v)"],
    }
    answer = post(client, "/v1/gradient", {"definition": defn, "target": "output"})
    assert nums(answer["gradients"]) == {"v": 2.0}


# ---- 5: two sources, as two tapes or one request -------------------------------------------


def test_multiple_tapes(client) -> None:
    defn = {"inputs": {"x0": 0.0, "x1": 0.0}, "program": ["ys = sum(sin(x0) + sigmoid(x1))"]}
    for source, expected in (("x0", 1.0), ("x1", 0.25)):
        answer = post(
            client, "/v1/gradient", {"definition": defn, "target": "ys", "sources": [source]}
        )
        assert nums(answer["gradients"]) == {source: expected}
    both = post(
        client, "/v1/gradient", {"definition": defn, "target": "ys", "sources": ["x0", "x1"]}
    )
    assert nums(both["gradients"]) == {"x0": 1.0, "x1": 0.25}


# ---- 6 and 16: higher order by nested grad -------------------------------------------------

HIGHER = ["y = x * x * x", "dy = grad(y, x)", "d2y = grad(dy, x)", "d3y = grad(d2y, x)"]


@pytest.mark.parametrize(
    "target,value,derivative",
    [
        ("y", 1.0, 3.0),
        ("dy", 3.0, 6.0),
        ("d2y", 6.0, 6.0),
        ("d3y", 6.0, 0.0),
    ],
)
def test_higher_order(client, target: str, value: float, derivative: float) -> None:
    body = {
        "definition": {"variables": {"x": 1.0}, "program": HIGHER},
        "target": target,
        "allow_unused": True,
        "unconnected": "zero",
    }
    answer = post(client, "/v1/gradient", body)
    assert (num(answer["value"]), nums(answer["gradients"])) == (value, {"x": derivative})


def test_unused_lines_are_reported_unless_allowed(client) -> None:
    body = {"definition": {"variables": {"x": 1.0}, "program": HIGHER}, "target": "dy"}
    found = problem(client.post("/v1/gradient", json=body), 422, "definition")
    assert {e["line"] for e in found["errors"]} == {3, 4}
    assert all(e["kind"] == "unused" for e in found["errors"])


def test_nested_tapes_by_hand(client) -> None:
    consts = {"x": 3.0, "y": 2.0}

    def ask(program, target, sources, inputs=consts):
        return post(
            client,
            "/v1/gradient",
            {
                "definition": {"inputs": inputs, "program": program},
                "target": target,
                "sources": sources,
                "allow_unused": True,
            },
        )

    assert nums(ask(["z = x * x"], "z", ["x"])["gradients"]) == {"x": 6.0}
    answer = ask(["z = x * y * y", "dz_dx = grad(z, x)"], "dz_dx", ["y"])
    assert (num(answer["value"]), nums(answer["gradients"])) == (4.0, {"y": 4.0})
    answer = ask(["y = x * x", "dy_dx = grad(y, x)"], "dy_dx", ["x"], {"x": 3.0})
    assert (num(answer["value"]), nums(answer["gradients"])) == (6.0, {"x": 2.0})
    two = ["z = x * x + y", "m = y + y * y + x"]
    assert nums(ask(two, "z", ["x"])["gradients"]) == {"x": 6.0}
    assert nums(ask(two, "m", ["y"])["gradients"]) == {"y": 5.0}


# ---- 7: input-gradient regularisation ------------------------------------------------------


def _g1_mag(x, kernel, bias) -> float:
    z = x @ kernel + bias
    g1 = (2 * np.maximum(z, 0)) @ kernel.T  # d sum(relu(z)**2) / dx
    return float(np.linalg.norm(g1))


def test_input_gradient_regularisation(client) -> None:
    rng = np.random.default_rng(7)
    x, kernel, bias = (
        rng.standard_normal((7, 5)),
        rng.standard_normal((5, 10)),
        rng.standard_normal(10),
    )
    body = {
        "definition": {
            "variables": {"kernel": t(kernel, "float64"), "bias": t(bias, "float64")},
            "inputs": {"x": t(x, "float64")},
            "program": [
                "out = sum(relu(x @ kernel + bias) ** 2)",
                "g1 = grad(out, x)",
                "g1_mag = norm(g1)",
            ],
        },
        "target": "g1_mag",
    }
    answer = post(client, "/v1/gradient", body)
    grads = {k: arr(v) for k, v in answer["gradients"].items()}
    assert [g.shape for g in grads.values()] == [(5, 10), (10,)]
    assert num(answer["value"]) == pytest.approx(_g1_mag(x, kernel, bias), rel=1e-12)
    for _ in range(3):  # random directions against central differences
        dk, db = rng.standard_normal(kernel.shape), rng.standard_normal(bias.shape)
        eps = 1e-6
        fd = (
            _g1_mag(x, kernel + eps * dk, bias + eps * db)
            - _g1_mag(x, kernel - eps * dk, bias - eps * db)
        ) / (2 * eps)
        assert np.sum(grads["kernel"] * dk) + np.sum(grads["bias"] * db) == pytest.approx(
            fd, rel=1e-6, abs=1e-8
        )


# ---- 17: gradient penalty (WGAN-GP) --------------------------------------------------------

WGAN = [
    "fake = tanh(z @ gw1 + gb1) @ gw2 + gb2",
    "interp = eps * real + (1 - eps) * fake",
    "critic = tanh(interp @ cw1 + cb1) @ cw2 + cb2",
    "g = grad(sum(critic), interp)",
    "penalty = mean((sqrt(sum(g * g, axis=1)) - 1) ** 2)",
]


def _penalty(p: dict[str, np.ndarray]) -> float:
    fake = np.tanh(p["z"] @ p["gw1"] + p["gb1"]) @ p["gw2"] + p["gb2"]
    interp = p["eps"] * p["real"] + (1 - p["eps"]) * fake
    h = np.tanh(interp @ p["cw1"] + p["cb1"])
    g = ((1 - h**2) * p["cw2"][:, 0]) @ p["cw1"].T  # d sum(critic) / d interp
    return float(np.mean((np.sqrt(np.sum(g * g, axis=1)) - 1) ** 2))


def test_gradient_penalty(client) -> None:
    rng = np.random.default_rng(17)
    shapes = {
        "gw1": (3, 8),
        "gb1": (8,),
        "gw2": (8, 4),
        "gb2": (4,),
        "cw1": (4, 8),
        "cb1": (8,),
        "cw2": (8, 1),
        "cb2": (1,),
    }
    params = {k: rng.standard_normal(s) * 0.7 for k, s in shapes.items()}
    data = {
        "z": rng.standard_normal((6, 3)),
        "real": rng.standard_normal((6, 4)),
        "eps": rng.uniform(size=(6, 1)),
    }
    critic = ["cw1", "cb1", "cw2", "cb2"]
    body = {
        "definition": {
            "variables": {k: t(v, "float64") for k, v in params.items()},
            "inputs": {k: t(v, "float64") for k, v in data.items()},
            "program": WGAN,
        },
        "target": "penalty",
        "sources": critic,
        # The critic's last bias drops out of its input gradient: with "zero" it answers a
        # real zero array rather than null.
        "unconnected": "zero",
    }
    answer = post(client, "/v1/gradient", body)
    grads = {k: arr(v) for k, v in answer["gradients"].items()}
    assert set(grads) == set(critic)
    for name in critic:
        assert grads[name] is not None and np.isfinite(grads[name]).all()
        assert grads[name].shape == shapes[name]
    assert not grads["cb2"].any()
    both = {**params, **data}
    assert num(answer["value"]) == pytest.approx(_penalty(both), rel=1e-12)
    for _ in range(3):
        direction = {k: rng.standard_normal(shapes[k]) for k in critic}
        eps = 1e-6
        plus = _penalty({**both, **{k: both[k] + eps * d for k, d in direction.items()}})
        minus = _penalty({**both, **{k: both[k] - eps * d for k, d in direction.items()}})
        inner = sum(np.sum(grads[k] * d) for k, d in direction.items())
        assert inner == pytest.approx((plus - minus) / (2 * eps), rel=1e-6, abs=1e-9)


# ---- dtypes, shapes, the non-scalar convention --------------------------------------------


def test_float64_and_tensor_shapes(client) -> None:
    rng = np.random.default_rng(0)
    x, kernel, bias = (
        rng.standard_normal((7, 5)),
        rng.standard_normal((5, 10)),
        rng.standard_normal(10),
    )
    body = {
        "definition": {
            "variables": {"kernel": t(kernel, "float64"), "bias": t(bias, "float64")},
            "inputs": {"x": t(x, "float64")},
            "program": ["y = relu(x @ kernel + bias)"],
        },
        "target": "y",
    }
    answer = post(client, "/v1/gradient", body)
    value = arr(answer["value"])
    assert value.dtype == np.float64 and value.shape == (7, 10)
    np.testing.assert_allclose(value, dense(x, kernel, bias), rtol=1e-12)
    mask = (x @ kernel + bias > 0).astype(float)
    np.testing.assert_allclose(arr(answer["gradients"]["kernel"]), x.T @ mask, rtol=1e-12)
    np.testing.assert_allclose(arr(answer["gradients"]["bias"]), mask.sum(0), rtol=1e-12)


def test_same_request_twice_gives_the_same_answer(client) -> None:
    # Each request records a fresh tape: nothing leaks from one to the next.
    # (All but `execution`: the second of a layout is captured where the first was not.)
    first = post(client, "/v1/gradient", GRADIENT_EXAMPLE)
    first.pop("execution")
    second = post(client, "/v1/gradient", GRADIENT_EXAMPLE)
    second.pop("execution")
    assert second == first


def test_definition_errors_point_at_line_column_and_shapes(client) -> None:
    body = {
        "definition": {
            "variables": {"w": t(np.ones((2, 3)))},
            "inputs": {"x": t(np.ones((4, 5)))},
            "program": ["h = x @ w", "loss = sum(h) + nope"],
        },
        "target": "loss",
    }
    found = problem(client.post("/v1/gradient", json=body), 422, "definition")
    assert "line 1" in found["detail"]
    by_line = {e["line"]: e for e in found["errors"]}
    assert by_line[1]["op"] == "matmul" and by_line[1]["shapes"] == [[4, 5], [2, 3]]
    assert by_line[1]["column"] == 5 and by_line[1]["section"] == "program"
    assert by_line[2]["kind"] == "name" and "nope" in by_line[2]["message"]


def test_unknown_target_and_source(client) -> None:
    body = {
        "definition": {"variables": {"w": 1.0}, "program": ["loss = w * w"]},
        "target": "los",
        "sources": ["v"],
    }
    found = problem(client.post("/v1/gradient", json=body), 422, "definition")
    sections = {e["section"] for e in found["errors"]}
    assert sections == {"target", "sources"}
    assert "loss" in found["detail"]  # the suggestion


@pytest.mark.parametrize("empty", [[], {}], ids=["list", "aliases"])
def test_no_sources_is_refused_naming_sources(client, empty) -> None:
    """`"sources": []` (or `{}`) asks for the derivative over nothing: a 422 naming
    `sources`, on every route that takes them (before: 200 with no gradients, or no
    jacobian, Hessian or HVP, an answer of nothing that looked like success)."""
    definition = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]}
    stateless = {"definition": definition, "target": "loss", "sources": empty}
    vector = {"vector": {"w": [1.0, 0.0]}}
    requests = [
        ("/v1/gradient", stateless),
        ("/v1/jacobian", stateless),
        ("/v1/hessian", stateless),
        ("/v1/hvp", {**stateless, **vector}),
        ("/v1/tapes", stateless),
    ]
    made = client.post("/v1/tapes", json={"definition": definition, "target": "loss"})
    assert made.status_code == 201, made.text
    tape = made.json()["tape_id"]
    requests += [
        (f"/v1/tapes/{tape}/gradient", {"sources": empty}),
        (f"/v1/tapes/{tape}/jacobian", {"sources": empty}),
    ]
    for path, body in requests:
        found = problem(client.post(path, json=body), 422)
        assert [e["field"] for e in found["errors"]] == ["sources"], (path, found)
        assert found["detail"].startswith("sources: "), (path, found)
        assert "at least 1" in found["detail"], (path, found)
    # One source is fine: the gradient over it.
    ok = post(client, f"/v1/tapes/{tape}/gradient", {"sources": ["w"]})
    np.testing.assert_allclose(arr(ok["gradients"]["w"]), [2.0, 4.0])
    client.delete(f"/v1/tapes/{tape}")
