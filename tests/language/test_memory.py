"""The memory model (engine/language/memory.py) against what runs really allocate: the
estimate of a batched HVP pass stays above the measured peak (tracemalloc sees NumPy's
buffers) and within 3x of it, so a budget built on it neither swells nor starves."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import engine as gt
from engine.language import compile_definition
from engine.language.compile import Request

rng = np.random.default_rng(11)

PROGRAMS = {
    "tanh of a matmul": {
        "variables": {"w": rng.random((64, 384), dtype=np.float32)},
        "inputs": {"x": rng.random((384, 64), dtype=np.float32)},
        "program": ["h = tanh(x @ w)", "loss = sum(h * h)"],
    },
    "two-layer mlp": {
        "variables": {"w1": rng.random((64, 256)), "w2": rng.random((256, 10))},
        "inputs": {"x": rng.random((512, 64))},
        "program": ["h = relu(x @ w1)", "o = h @ w2", "loss = mean(o * o)"],
    },
    "softmax regression": {
        "variables": {"w": rng.random((32, 50)), "b": rng.random(50)},
        "inputs": {"x": rng.random((400, 32))},
        "program": ["z = x @ w + b", "loss = sum(logsumexp(z, axis=1) - z[:, 0])"],
    },
    # issue 13: a conv net, whose im2col patches are temporaries of composite ops
    "small cnn": {
        "variables": {"w1": rng.random((16, 3, 3, 3)), "w2": rng.random((1024, 10))},
        "inputs": {"x": rng.random((16, 3, 16, 16))},
        "program": [
            "h = max_pool2d(relu(conv2d(x, w1, padding=1)), 2)",
            "loss = mean((reshape(h, (16, 1024)) @ w2) ** 2)",
        ],
    },
}


def measured_hvp_peak(definition: dict, k: int) -> tuple[int, object]:
    program = compile_definition(definition)
    leaves = program.leaves(definition)
    sources = {name: name for name in definition["variables"]}
    vectors = [
        gt.constant(rng.random((k, *leaves[n].shape)).astype(leaves[n].dtype)) for n in sources
    ]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        operator = program.hessian_operator(Request("loss", sources), leaves)
        operator.hvp_many(*vectors)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, program.memory


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("k", [1, 16])
def test_the_estimate_bounds_a_batched_hvp_from_above_within_3x(name: str, k: int) -> None:
    peak, memory = measured_hvp_peak(PROGRAMS[name], k)
    estimate = memory.peak_bytes(k)
    assert peak <= estimate <= 3 * peak, (name, k, peak, estimate)


def test_max_batch_fits_the_budget_and_one_more_would_not() -> None:
    memory = compile_definition(PROGRAMS["two-layer mlp"]).memory
    budget = memory.peak_bytes(7) + memory.per_item_bytes // 2
    assert memory.max_batch(budget) == 7
    assert memory.peak_bytes(7) <= budget < memory.peak_bytes(8)


def test_a_refusal_names_the_largest_op_its_shape_and_the_budget() -> None:
    memory = compile_definition(PROGRAMS["tanh of a matmul"]).memory
    assert memory.max_batch(memory.recording_bytes) == 0
    problem = memory.refusal(2**20, "an HVP pass")
    assert (problem.line, problem.op, problem.shapes) in {
        (1, "matmul", ((384, 384),)),
        (1, "tanh", ((384, 384),)),
    }
    assert "[384, 384]" in problem.message and "(float32, 0.6 MiB)" in problem.message
    assert "budget of a request is 1.0 MiB" in problem.message
    assert problem.kind == "limit"


# -- the budget applied: batched passes split to fit, what cannot fit refused -------------


def bounded_hvp(definition: dict, k: int, budget: int | None) -> tuple[list, int]:
    """The products of k vectors through an operator held to `budget`, and the peak."""
    program = compile_definition(definition)
    leaves = program.leaves(definition)
    sources = {name: name for name in definition["variables"]}
    g = np.random.default_rng(5)
    vectors = [
        gt.constant(g.random((k, *leaves[n].shape)).astype(leaves[n].dtype)) for n in sources
    ]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        operator = program.hessian_operator(Request("loss", sources), leaves, budget)
        products = [p.numpy() for p in operator.hvp_many(*vectors)]
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return products, peak


def test_a_budget_splits_a_batched_hvp_and_keeps_its_products() -> None:
    definition = PROGRAMS["two-layer mlp"]
    memory = compile_definition(definition).memory
    budget = memory.peak_bytes(4)  # room for 4 vectors a pass: 32 take 8 passes
    free, free_peak = bounded_hvp(definition, 32, None)
    held, held_peak = bounded_hvp(definition, 32, budget)
    for a, b in zip(free, held, strict=True):
        assert a.shape == b.shape == (32, *a.shape[1:])
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    assert held_peak <= budget, (held_peak, budget)
    assert held_peak < free_peak / 2, (held_peak, free_peak)


def test_a_program_that_cannot_fit_one_pass_is_refused_naming_its_largest_op() -> None:
    definition = PROGRAMS["tanh of a matmul"]
    program = compile_definition(definition)
    budget = program.memory.recording_bytes  # the recording fits, not one pass over it
    with pytest.raises(gt.language.OverBudget) as caught:
        program.hessian_operator(Request("loss", {"w": "w"}), program.leaves(definition), budget)
    problem = caught.value.problems[0]
    assert problem.kind == "limit" and problem.line == 1 and problem.shapes == ((384, 384),)
    assert "memory budget" in problem.message and "384, 384" in problem.message
    assert program.batch_within(program.memory.peak_bytes(3), "x") == 3
    assert program.batch_within(None, "x") is None


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_first_order_estimate_bounds_a_gradient_from_above_within_3x(name: str) -> None:
    definition = PROGRAMS[name]
    program = compile_definition(definition)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        gt.language.evaluate(definition, "loss")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    estimate = program.memory.peak_bytes(1, first_order=True)
    assert peak <= estimate <= 3 * peak, (name, peak, estimate)


def test_a_split_hvp_keeps_the_primals_structure() -> None:
    g = np.random.default_rng(2)
    a, b = gt.constant(g.random(3)), gt.constant(g.random((2, 2)))

    def f(pair):
        x, y = pair
        return gt.sum(gt.tanh(x) ** 2) + gt.sum(y**3) * gt.sum(x)

    vectors = ([gt.constant(g.random((5, 3))), gt.constant(g.random((5, 2, 2)))],)
    whole = gt.hessian_operator(f, (a, b)).hvp_many(*vectors)
    split = gt.hessian_operator(f, (a, b), max_batch=2).hvp_many(*vectors)
    assert type(split) is type(whole) and len(split) == len(whole)
    for p, q in zip(gt.tree.flatten(whole)[0], gt.tree.flatten(split)[0], strict=True):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-12)
    ragged = ([gt.constant(g.random((4, 3))), gt.constant(g.random((6, 2, 2)))],)
    with pytest.raises(ValueError):
        gt.hessian_operator(f, (a, b), max_batch=2).hvp_many(*ragged)
