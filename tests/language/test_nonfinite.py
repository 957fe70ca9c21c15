"""Where a non-finite answer started (engine/language/nonfinite.py): the first op whose
value is NaN or infinite, else the op whose derivative is; by line, column and name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from engine.language import compile_definition
from engine.language.compile import Request


def diagnose(program: list[str], target: str = "loss", **variables: object):
    definition = {
        "variables": {k: np.asarray(v, dtype=np.float64) for k, v in variables.items()},
        "program": program,
    }
    compiled = compile_definition(definition)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's own divide-by-zero notes
        return compiled.find_nonfinite(
            Request(target, {k: k for k in variables}), compiled.leaves(definition)
        )


def test_the_first_forward_op_with_a_non_finite_value_is_named() -> None:
    found = diagnose(
        ["a = w * 2.0", "b = exp(a)", "loss = sum(log(w - 10.0) + b)"], w=[1.0, 2.0, 12.0]
    )
    assert (found.line, found.column, found.op, found.kind) == (3, 12, "log", "nonfinite")
    assert "2 of 3" in found.message and "from finite arguments" in found.message
    assert found.shapes == ((3,),)


def test_an_op_fed_a_non_finite_value_is_not_blamed_after_the_first() -> None:
    # exp overflows first (line 1); the log of it on line 2 is only a consequence.
    found = diagnose(["e = exp(w)", "loss = sum(log(e))"], w=[1.0, 1000.0])
    assert (found.line, found.op) == (1, "exp")


def test_a_singular_derivative_is_traced_to_its_op() -> None:
    # sqrt(0) = 0 is finite; its derivative 1 / (2 sqrt(0)) is not.
    found = diagnose(["h = w * 3.0", "loss = sum(sqrt(w) + h)"], w=[0.0, 4.0])
    assert (found.line, found.column, found.op) == (2, 12, "sqrt")
    assert "derivative with respect to x" in found.message


def test_the_culprit_is_found_behind_finite_ops() -> None:
    # The gradient reaches sqrt through a matmul and a tanh: only sqrt's VJP breaks it.
    found = diagnose(
        ["r = sqrt(w)", "h = tanh(r @ m)", "loss = sum(h * h)"],
        w=[0.0, 1.0],
        m=[[1.0, 2.0], [3.0, 4.0]],
    )
    assert (found.line, found.op) == (1, "sqrt")


def test_a_jacobian_target_is_diagnosed_over_all_its_rows() -> None:
    found = diagnose(["y = sqrt(w) * 2.0"], target="y", w=[1.0, 0.0])
    assert (found.line, found.op) == (1, "sqrt")


def test_nothing_to_blame_in_a_first_derivative_says_so() -> None:
    found = diagnose(["loss = sum(w * w)"], w=[1.0, 2.0])
    assert found.op is None and found.section == "target"
    assert "second derivative" in found.message


@pytest.mark.parametrize("program", [["loss = sum(w * w)"], ["loss = sum(sqrt(w))"]])
def test_a_checking_run_gives_the_same_values(program: list[str]) -> None:
    # The check only observes: the program's values are those of a normal run.
    definition = {"variables": {"w": np.array([1.0, 4.0])}, "program": program}
    compiled = compile_definition(definition)
    leaves = compiled.leaves(definition)
    from engine.language.nonfinite import NonFiniteCheck

    checked = compiled.run(leaves, check=NonFiniteCheck())["loss"].numpy()
    np.testing.assert_array_equal(checked, compiled.run(leaves)["loss"].numpy())
