"""The tape against TensorFlow 2.21 (issue 19): each program in tf_parity/programs.py
run on the engine, compared with TensorFlow's answer stored in tf_parity/reference.json
(recorded by tf_parity/record.py; CI needs no TensorFlow) at rtol 1e-6, float64,
first and second order. None must be None where TensorFlow says None, NaN must be NaN
where TensorFlow gives NaN, and errors must be of the same class."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import engine as gt
from engine.language import compile_definition
from tests.engine.tf_parity.programs import PROGRAMS, X3
from tests.engine.tf_parity.serialize import from_json_data, to_json

REFERENCE = json.loads((Path(__file__).parent / "tf_parity" / "reference.json").read_text())
ROWS = REFERENCE["rows"]
# Rows at singular points (sqrt or log at 0) compute infinities on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
RTOL = 1e-6
ATOL = 1e-12  # for answers that are exactly 0 on TensorFlow's side

# TensorFlow's names on the left, the engine's on the right: the porting table.
GT = SimpleNamespace(
    GradientTape=gt.GradientTape,
    ForwardAccumulator=gt.ForwardAccumulator,
    UnconnectedGradients=gt.UnconnectedGradients,
    custom_gradient=gt.custom_gradient,
    Variable=gt.Variable,
    constant=gt.constant,
    reduce_sum=gt.sum,
    exact_variance=lambda x, axis: gt.moments(x, axes=axis)[1],
    zeros_like=gt.zeros_like,
    ones_like=gt.ones_like,
    where=gt.where,
    exp=gt.exp,
    log=gt.log,
    sin=gt.sin,
    cos=gt.cos,
    sqrt=gt.sqrt,
    rsqrt=gt.rsqrt,
    reciprocal=gt.reciprocal,
    abs=gt.abs,
    sign=gt.sign,
    relu=gt.relu,
    leaky_relu=gt.leaky_relu,
    gelu=gt.gelu,
    norm=gt.norm,
    identity=gt.identity,
    erf=gt.erf,
    xlogy=gt.xlogy,
    divide_no_nan=gt.divide_no_nan,
    gather_nd=gt.gather_nd,
    scatter_nd=gt.scatter_nd,
    cumsum=gt.cumsum,
    sort=gt.sort,
    top_k=gt.top_k,
    pad=gt.pad,
    tile=gt.tile,
    split=gt.split,
    unstack=gt.unstack,
    moments=gt.moments,
    clip_by_global_norm=gt.clip_by_global_norm,
)


def assert_same(ours: Any, theirs: Any, path: str = "answer") -> None:
    """Compare two JSON answers: structures exactly, numbers at RTOL."""
    if isinstance(theirs, dict) and "data" in theirs:
        assert isinstance(ours, dict) and "data" in ours, (
            f"{path}: TensorFlow has a tensor, we {ours!r}"
        )
        assert ours["shape"] == theirs["shape"], (
            f"{path}: shape {ours['shape']} vs {theirs['shape']}"
        )
        a, b = from_json_data(ours["data"]), from_json_data(theirs["data"])
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=path)
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), f"{path}: keys differ"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{path}.{k}")
        return
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{path}: lengths differ"
        for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(o, t, f"{path}[{i}]")
        return
    if isinstance(theirs, float) and isinstance(ours, float):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=path)
        return
    assert ours == theirs, f"{path}: {ours!r} vs TensorFlow's {theirs!r}"


def run(name: str) -> Any:
    _, fn, inputs = PROGRAMS[name]
    return to_json(fn(GT, *[gt.constant(x) for x in inputs]))


def test_the_reference_was_recorded_from_these_programs() -> None:
    assert REFERENCE["tensorflow"] == "2.21.0"
    assert set(ROWS) == set(PROGRAMS), "re-run tf_parity/record.py after changing programs"
    for name, (item, _, inputs) in PROGRAMS.items():
        assert ROWS[name]["item"] == item
        assert ROWS[name]["inputs"] == [x.tolist() for x in inputs], name


def test_rows_cover_every_item_and_every_new_op() -> None:
    assert {row["item"] for row in ROWS.values()} == {str(i) for i in range(1, 8)}
    new_ops = [
        "identity", "erf", "rsqrt", "xlogy", "divide_no_nan", "gather_nd", "scatter_nd",
        "cumsum", "sort", "top_k", "pad", "tile", "split", "unstack", "moments",
        "clip_by_global_norm",
    ]  # fmt: skip
    for op in new_ops:
        assert any(name.startswith(f"op_{op}") for name in ROWS), op


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_engine_agrees_with_tensorflow(name: str) -> None:
    assert_same(run(name), ROWS[name]["answer"])


def test_the_comparison_can_fail() -> None:
    """A wrong number, a None for a zero, or a NaN for a number is caught."""
    theirs = ROWS["where_safe_sqrt"]["answer"]
    ours = json.loads(json.dumps(theirs))
    ours["grad"][0]["data"][0] = "nan"  # the bug issue 19 reported
    with pytest.raises(AssertionError):
        assert_same(ours, theirs)
    ours = json.loads(json.dumps(theirs))
    ours["hvp"][0]["data"][1] *= 1 + 1e-5
    with pytest.raises(AssertionError):
        assert_same(ours, theirs)
    ours = json.loads(json.dumps(ROWS["relu_second_derivative"]["answer"]))
    ours["hvp"][0] = None
    with pytest.raises(AssertionError):
        assert_same(ours, ROWS["relu_second_derivative"]["answer"])


def test_language_user_function_records_its_forward() -> None:
    """Over HTTP a user function with a backward is TensorFlow's custom_gradient: its
    forward is recorded, so the gradient of its gradient matches TensorFlow's."""
    defn = {
        "inputs": {"x": X3, "v": np.linspace(0.3, 1.7, 3)},
        "functions": {
            "log1pexp": {
                "params": ["z"],
                "forward": ["e = exp(z)", "out = log(1 + e)"],
                "backward": ["grad_z = upstream * (1 - 1 / (1 + e))"],
                "output": "out",
            }
        },
        "program": ["y = sum(log1pexp(x))", "g = grad(y, x)", "s = sum(g * v)", "h = grad(s, x)"],
    }  # fmt: skip
    program = compile_definition(defn)
    env = program.run(program.leaves(defn))
    answer = ROWS["custom_gradient_body_alone"]["answer"]
    assert_same(to_json(env["g"]), answer["grad"][0], "grad")
    assert_same(to_json(env["h"]), answer["hvp"][0], "hvp")
