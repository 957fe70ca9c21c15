"""Errors: hostile programs, each with its exact error; every problem of a definition
reported at once with line, column, op and shapes; requests, functions, limits, and
failures while running."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import trace
from engine.language import (
    DefinitionError,
    ExecutionError,
    Limits,
    as_definition,
    compile_definition,
    evaluate,
)

X = {"x": np.zeros((3, 4), np.float32), "v": np.zeros(4, np.float32)}


def problems(defn: dict, limits: Limits | None = None) -> list[str]:
    with pytest.raises(DefinitionError) as info:
        compile_definition(defn, limits)
    return [str(p) for p in info.value.problems]


def line_error(text: str) -> str:
    (only,) = problems({"inputs": X, "program": [text]})
    return only


L1 = "program line 1"
INDEX = (
    "an index must be a constant int, slice, None or '...' (use take(x, indices, axis) "
    "to gather with a tensor)"
)
ASSIGN_ONLY = "only assignments 'name = expression' are allowed"

HOSTILE = [
    # reaching out of the language
    ("y = x.__class__", f"{L1}, column 5: attribute access ('.__class__') is not allowed"),
    (
        "y = x.__globals__['os']",
        f"{L1}, column 5: attribute access ('.__globals__') is not allowed",
    ),
    (
        "y = __import__('os')",
        f"{L1}, column 5: names starting with '__' are not allowed ('__import__')",
    ),
    (
        "y = getattr(x, '__class__')",
        f"{L1}, column 5: getattr: unknown op 'getattr'; did you mean 'greater'?",
    ),
    ("y = eval('x')", f"{L1}, column 5: eval: unknown op 'eval'; did you mean 'equal'?"),
    ("y = exec('import os')", f"{L1}, column 5: exec: unknown op 'exec'"),
    ("y = open('/etc/passwd')", f"{L1}, column 5: open: unknown op 'open'"),
    ("y = globals()", f"{L1}, column 5: globals: unknown op 'globals'"),
    ("import os", f"{L1}, column 1: import is not allowed"),
    ("from os import system", f"{L1}, column 1: import is not allowed"),
    ("y = x; import os", f"{L1}, column 8: one assignment per line"),
    ("y = x\nimport os", f"{L1}: one line per entry: the text contains a line break"),
    ("y = x\x00", f"{L1}: source code string cannot contain null bytes"),
    ("def f(): pass", f"{L1}, column 1: {ASSIGN_ONLY}"),
    ("class A: pass", f"{L1}, column 1: {ASSIGN_ONLY}"),
    ("for i in x: pass", f"{L1}, column 1: {ASSIGN_ONLY}"),
    ("del x", f"{L1}, column 1: {ASSIGN_ONLY}"),
    ("await x", f"{L1}, column 1: a line must assign its result to a name: name = expression"),
    # constructs outside the whitelist
    ("y = lambda: x", f"{L1}, column 5: lambda is not allowed"),
    ("y = [i for i in x]", f"{L1}, column 5: comprehensions are not allowed"),
    ("y = f'{x}'", f"{L1}, column 5: f-strings are not allowed"),
    ("y = (z := x)", f"{L1}, column 6: the walrus operator (:=) is not allowed"),
    ("y = sum(*x)", f"{L1}, column 9: starred arguments (*x) are not allowed"),
    ("y = sum(**x)", f"{L1}, column 9: '**' arguments are not allowed"),
    (
        "y = x if x else x",
        f"{L1}, column 5: conditional expressions are not allowed; use where(condition, x, y)",
    ),
    ("y = not x", f"{L1}, column 5: 'not' is not allowed; use logical_not(x)"),
    ("y = x and x", f"{L1}, column 5: 'and' / 'or' are not allowed; use logical_and / logical_or"),
    ("y = x < x < x", f"{L1}, column 5: chained comparisons are not allowed; use logical_and"),
    ("y = x is x", f"{L1}, column 5: only the comparisons > >= < <= == != are allowed"),
    ("y = yield x", f"{L1}, column 5: yield is not allowed"),
    ("y = {'a': x}", f"{L1}, column 5: dict literals are not allowed"),
    ("y = x // 2", f"{L1}, column 5: operator // is not allowed"),
    ("y = 1j * x", f"{L1}, column 5: complex literals are not allowed"),
    ("y = b'abc'", f"{L1}, column 5: bytes literals are not allowed"),
    (
        "y += x",
        (
            f"{L1}, column 1: augmented assignment (+= ...) is not allowed: each name is "
            "assigned once"
        ),
    ),
    ("y = z = x", f"{L1}, column 1: chained assignment (a = b = ...) is not allowed"),
    (
        "y, z = x",
        (f"{L1}, column 1: unpacking (a, b = ...) is not allowed; assign one name per line"),
    ),
    ("x.y = 1", f"{L1}, column 1: only a plain name can be assigned"),
    ("é = x", f"{L1}, column 1: names must be ASCII letters, digits and '_' ('é')"),
    ("y = relu", f"{L1}, column 5: 'relu' is an op; call it: relu(...)"),
    # huge numbers are refused before they are computed
    (
        "y = x ** 10**100",
        f"{L1}, column 10: the integer constant of about 100 digits is out of range (|n| <= 2**53)",
    ),
    ("y = 2 ** 2 ** 2 ** 2 ** 2 ** 2", f"{L1}, column 10: the constant 2 ** 65536 is out of range"),
    ("y = x ** 1e400", f"{L1}, column 10: the constant overflows to infinity"),
    ("y = x * (1 / 0)", f"{L1}, column 10: division by zero in a constant expression"),
    (
        "y = x * 1" + "0" * 1500,
        f"{L1}, column 9: the integer constant of about 1500 digits is out of range (|n| <= 2**53)",
    ),
    # deep nesting, long lines
    (
        "y = " + "-(" * 100 + "x" + ")" * 100,
        f"{L1}, column 205: the expression is nested 100 deep; the limit is 64",
    ),
    ("y = " + "(" * 250 + "x" + ")" * 250, f"{L1}, column 205: too many nested parentheses"),
    ("y = x" + " + x" * 1000, f"{L1}: the line is 4005 characters long; the limit is 2000"),
    # indexing
    ("y = x[x]", f"{L1}, column 7: {INDEX}"),
    ("y = x[0.5]", f"{L1}, column 7: {INDEX}"),
    ("y = x[::0]", f"{L1}, column 7: slice step cannot be zero"),
    ("y = x[:, 9]", f"{L1}, column 5: getitem: index 9 is out of bounds for axis 1 of size 4"),
    (
        "y = x[0, 0, 0]",
        (f"{L1}, column 5: getitem: too many indices (3) for a tensor of shape (3, 4)"),
    ),
    # big results, refused from their shapes
    (
        "y = broadcast_to(v, (100000, 100000, 4))",
        (
            f"{L1}, column 5: broadcast_to: the result would have 40000000000 elements (shape "
            "(100000, 100000, 4)); the limit is 16777216"
        ),
    ),
    (
        "y = x[..., None, None, None, None, None, None, None]",
        f"{L1}, column 5: getitem: the result would have rank 9; the limit is 8",
    ),
    (
        "y = prod(broadcast_to(v, (4000, 4)))",
        (
            f"{L1}, column 5: prod: its gradient needs 256000000 elements of workspace; the limit is "
            "16777216"
        ),
    ),
    (
        "y = sum(grad(sum(grad(sum(grad(sum(grad(sum(grad(sum(x ** 6), x)), x)), x)), x)), x))",
        f"{L1}, column 9: grad: nested 5 deep; the limit is 4",
    ),
    # arguments
    ("y = relu(x, x)", f"{L1}, column 5: relu: takes at most 1 argument(s) (x), got 2"),
    (
        "y = sum(x, keepdim=True)",
        f"{L1}, column 5: sum: unknown keyword argument 'keepdim'; did you mean 'keepdims'?",
    ),
    ("y = sum(x, keepdims=1)", f"{L1}, column 5: sum: keepdims must be bool, got the number 1"),
    (
        "y = sum(x, axis=v)",
        f"{L1}, column 5: sum: axis must be int | tuple[int, ...] | None, got a tensor expression",
    ),
    ("y = clip(x)", f"{L1}, column 5: clip: missing argument(s) 'min_value', 'max_value'"),
    (
        "y = concatenate(x, v)",
        (
            f"{L1}, column 5: concatenate: xs must be a list of tensors "
            "such as [a, b], got a tensor expression"
        ),
    ),
    ("y = x + 'a'", f"{L1}, column 5: add: y must be a tensor, got 'a'"),
    (
        "y = (x, x)",
        (
            f"{L1}, column 5: a tuple or list is not a tensor; it can only be a constant "
            "argument such as axis=(0, 1)"
        ),
    ),
    # shapes and dtypes
    ("y = x @ x", f"{L1}, column 5: matmul: inner dimensions differ: (3, 4) @ (3, 4) (4 != 3)"),
    ("y = x + v[:3]", f"{L1}, column 5: add: shapes (3, 4) and (3,) do not broadcast"),
    (
        "y = exp(cast(x, 'int32'))",
        f"{L1}, column 5: exp: x must be a floating-point tensor, got int32; cast it first",
    ),
    (
        "y = x + cast(x, 'float64')",
        (
            f"{L1}, column 5: add: dtypes differ (float32 and "
            "float64); gradtape never casts silently, use cast on one side"
        ),
    ),
    (
        "y = cast(x, 'int32') * 0.5",
        (
            f"{L1}, column 5: multiply: cannot combine a int32 tensor "
            "with the float 0.5; cast the tensor first"
        ),
    ),
    ("y = sum(x, axis=(0, 0))", f"{L1}, column 5: sum: repeated axis in (0, 0)"),
    (
        "y = einsum('ii->i', x)",
        (
            f"{L1}, column 5: einsum: repeated subscript in 'ii' (a "
            "diagonal or trace) is not supported"
        ),
    ),
]


@pytest.mark.parametrize("text,expected", HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_hostile_line(text: str, expected: str) -> None:
    assert line_error(text) == expected


def test_million_element_broadcasts() -> None:
    small = {"a": np.zeros((1000, 1), np.float32), "b": np.zeros((1, 1000), np.float32)}
    assert problems({"inputs": small, "program": ["c = a + b"]}, Limits(max_elements=10**5)) == [
        (
            f"{L1}, column 5: add: the result would have 1000000 elements (shape (1000, 1000)); "
            "the limit is 100000"
        )
    ]
    big = {"a": np.zeros((10**6, 1), np.float32), "b": np.zeros((1, 10**6), np.float32)}
    assert problems({"inputs": big, "program": ["c = a * b"]}) == [
        (
            f"{L1}, column 5: multiply: the result would have 1000000000000 elements (shape "
            "(1000000, 1000000)); the limit is 16777216"
        )
    ]


def test_all_intermediates_together_are_limited() -> None:
    lines = [f"h{i} = x * {i}" for i in range(20)]
    limits = Limits(max_total_elements=100)
    assert problems({"inputs": X, "program": lines}, limits) == [
        "program: the intermediates would hold 240 elements in all; the limit is 100"
    ]


def test_definition_size_limits() -> None:
    assert problems({"inputs": X, "program": ["y = x"] * 1001}) == [
        "program: the definition has 1001 lines; the limit is 1000"
    ]
    long = {"inputs": X, "program": ["y = x" + " + x" * 400] * 130}
    assert problems(long) == [
        ("program: the program text is 208650 characters; the limit is 200000")
    ]
    lines = [f"y{i} = x" + " + x" * 40 for i in range(10)]
    nodes = problems({"inputs": X, "program": lines}, Limits(max_nodes=500))
    assert nodes == ["program: the definition has 840 syntax nodes; the limit is 500"]


def test_problems_are_capped() -> None:
    found = problems({"inputs": X, "program": [f"y{i} = nope" for i in range(150)]})
    assert len(found) == 101
    assert found[-1] == "definition: ... and 50 more problem(s)"


def test_every_problem_at_once_with_position_op_and_shapes() -> None:
    defn = {
        "variables": {"w": np.zeros((4, 10), np.float32), "b": np.zeros(9, np.float32)},
        "inputs": {"x": np.zeros((7, 5), np.float32)},
        "program": [
            "h = relu(x @ w + b)",
            "y = foo(h)",
            "z = h.T",
            "loss = sum(h) + k",
            "h = 1",
            "q = sum(x, axis=2)",
            "later = after * 2",
            "after = x",
        ],
    }
    with pytest.raises(DefinitionError) as info:
        compile_definition(defn)
    found = info.value.problems
    assert [(p.line, p.column, p.kind, p.op) for p in found] == [
        (1, 10, "shape", "matmul"),
        (2, 5, "op", "foo"),
        (3, 5, "syntax", None),
        (4, 17, "name", None),
        (5, 1, "name", None),
        (6, 5, "shape", "sum"),
        (7, 9, "name", None),
    ]
    assert found[0].shapes == ((7, 5), (4, 10))
    assert found[0].message == "inner dimensions differ: (7, 5) @ (4, 10) (5 != 4)"
    assert found[4].message == "'h' is already defined (line 1); each name is assigned once"
    assert found[6].message == "'after' is used before it is defined (line 8)"
    assert found[0].to_dict() == {
        "kind": "shape",
        "section": "program",
        "line": 1,
        "column": 10,
        "op": "matmul",
        "shapes": [[7, 5], [4, 10]],
        "message": "inner dimensions differ: (7, 5) @ (4, 10) (5 != 4)",
    }
    assert info.value.to_list()[1]["message"] == "unknown op 'foo'"


def test_undefined_names_suggest() -> None:
    defn = {"inputs": {"weights": 1.0}, "program": ["y = weight * 2"]}
    assert problems(defn) == [(f"{L1}, column 5: undefined name 'weight'; did you mean 'weights'?")]


# ---- the structure of a definition ---------------------------------------------------------


@pytest.mark.parametrize(
    "defn,expected",
    [
        ("nope", ["definition: a definition must be a mapping"]),
        (
            {"program": "y = x", "extra": 1},
            [
                "definition: unknown field 'extra'; expected program, variables, inputs, functions, models, dtype"
            ],
        ),
        ({"program": [1, 2]}, ["program: program must be a list of strings (one line each)"]),
        (
            {"program": [], "variables": {"w": {"trainable": True}}},
            ["variables.w: a variable needs a value"],
        ),
        (
            {"program": [], "variables": {"w": {"value": 1.0, "trainable": "yes"}}},
            ["variables.w: trainable must be true or false, got 'yes'"],
        ),
        (
            {"program": [], "inputs": {"x": "text"}},
            [
                (
                    "inputs.x: not a number or a (nested) list of numbers: could not convert string to "
                    "float: 'text'"
                )
            ],
        ),
        (
            {"program": [], "inputs": {"x": [[1.0], [2.0, 3.0]]}},
            [
                (
                    "inputs.x: not a number or a (nested) list of numbers: setting an array element with a "
                    "sequence. The requested array has an inhomogeneous shape after 1 dimensions. The "
                    "detected shape was (2,) + inhomogeneous part."
                )
            ],
        ),
        ({"program": [], "inputs": {"x": np.array(["a"])}}, ["inputs.x: unsupported dtype <U1"]),
        (
            {"program": [], "functions": {"f": {"params": ["x"]}}},
            [
                "functions.f.forward: functions.f.forward must be a list of strings (one line each)",
            ],
        ),
    ],
)
def test_malformed_definitions(defn: object, expected: list[str]) -> None:
    with pytest.raises(DefinitionError) as info:
        as_definition(defn)
    assert [str(p) for p in info.value.problems] == expected


def test_bad_names_of_leaves() -> None:
    defn = {"variables": {"x": 1.0, "1x": 1.0, "__x": 1.0}, "inputs": {"x": 2.0}, "program": []}
    assert problems(defn) == [
        (
            "variables.1x: variable name '1x' must be ASCII letters, digits and '_', not starting "
            "with a digit or '__'"
        ),
        (
            "variables.__x: variable name '__x' must be ASCII letters, digits and '_', not "
            "starting with a digit or '__'"
        ),
        "inputs.x: 'x' is both a variable and an input",
    ]


def test_leaf_size_limits() -> None:
    defn = {
        "inputs": {"x": np.zeros((1,) * 9, np.float32), "y": np.zeros(2000, np.float32)},
        "program": [],
    }
    assert problems(defn, Limits(max_elements=1000)) == [
        "inputs.x: rank 9; the limit is 8",
        "inputs.y: 2000 elements; the limit is 1000",
    ]


# ---- user functions --------------------------------------------------------------------------


def function_problems(fn: dict, program: list[str], inputs: dict | None = None) -> list[str]:
    return problems({"inputs": inputs or X, "functions": {"f": fn}, "program": program})


def test_function_errors() -> None:
    assert function_problems(
        {"params": ["a"], "forward": ["b = a * 2"], "backward": ["grad_a = upstream * 3"]},
        ["y = f(x, x)"],
    ) == [f"{L1}, column 5: f: takes at most 1 argument(s) (a), got 2"]
    assert function_problems(
        {"params": ["a"], "forward": ["b = a * 2"], "backward": ["g = upstream * 2"]},
        ["y = f(x)"],
    ) == [
        (
            "functions.f.backward: the backward program must assign grad_a (the gradient for a) "
            "(when called from program line 1)"
        )
    ]
    assert function_problems(
        {"params": ["a"], "forward": ["b = sum(a)"], "backward": ["grad_a = upstream * 2"]},
        ["y = f(x)"],
    ) == [
        (
            "functions.f.backward: grad_a is float32[] but a is float32[3, 4] (when called from "
            "program line 1)"
        )
    ]
    assert function_problems(
        {"params": ["a"], "forward": ["b = a @ a"], "backward": ["grad_a = upstream"]},
        ["y = f(x)"],
    ) == [
        (
            "functions.f.forward line 1, column 5: matmul: inner dimensions differ: (3, 4) @ "
            "(3, 4) (4 != 3) (when called from program line 1)"
        )
    ]
    assert function_problems(
        {
            "params": ["a"],
            "forward": ["b = grad(a, a)", "c = f(a)", "d = nope"],
            "backward": ["upstream = a", "grad_a = a.T"],
        },
        ["y = f(x)"],
    ) == [
        (
            "functions.f: recursion: f -> f; a function may call other functions but never "
            "itself, directly or through others"
        ),
        "functions.f.forward line 1, column 5: grad: grad is not allowed inside a function body",
        "functions.f.forward line 3, column 5: undefined name 'nope'",
        (
            "functions.f.backward line 1, column 1: 'upstream' is already defined (the incoming "
            "gradient); each name is assigned once"
        ),
        "functions.f.backward line 2, column 10: attribute access ('.T') is not allowed",
    ]


def test_function_names_and_params() -> None:
    body = {"forward": ["y = a"], "backward": ["grad_a = upstream"]}
    defn = {
        "inputs": X,
        "program": ["y = x"],
        "functions": {
            "relu": {"params": ["a"], **body},
            "g": {"params": ["a", "a"], **body},
            "h": {"params": ["upstream"], "forward": ["y = upstream"], "backward": []},
            "k": {"params": ["a"], "forward": [], "backward": []},
            "m": {"params": ["a"], "forward": ["y = a"], "output": "z", "backward": []},
        },
    }
    assert problems(defn) == [
        "functions.g.params: a parameter is listed twice",
        "functions.h.params: 'upstream' is reserved for the incoming gradient",
        "functions.k: the forward program is empty and no output is named",
        "functions.m: the output 'z' is not assigned by the forward program",
        "functions.relu: function name 'relu' is already an op; choose another",
    ]


def test_function_with_an_integer_parameter_needs_no_gradient_for_it() -> None:
    fn = {
        "params": ["a", "n"],
        "forward": ["b = a * cast(n, 'float32')"],
        "backward": ["grad_a = upstream * cast(n, 'float32')"],
    }
    defn = {
        "variables": {"w": np.ones(3, np.float32)},
        "inputs": {"count": np.array(3, np.int32)},
        "functions": {"scale": fn},
        "program": ["y = sum(scale(w, count))"],
    }
    np.testing.assert_array_equal(evaluate(defn, "y").gradients["w"], [3.0, 3.0, 3.0])


# ---- requests ------------------------------------------------------------------------------


def request_problems(target: object, sources: object = None, **kw: object) -> list[str]:
    defn = {
        "variables": {"w": 1.0, "n": np.array(2, np.int32)},
        "inputs": {"x": 2.0, "k": np.array([1, 2], np.int32)},
        "program": ["h = w * x", "unused = h * 2", "loss = h * h", "count = n * 2"],
    }
    program = compile_definition(defn)
    with pytest.raises(DefinitionError) as info:
        program.check_request(target, sources, **kw)
    return [str(p) for p in info.value.problems]


def test_request_errors() -> None:
    assert request_problems("los") == ["target: unknown target 'los'; did you mean 'loss'?"]
    assert request_problems("count") == [
        ("target: the target 'count' is int32[]; only a floating-point target has gradients")
    ]
    assert request_problems("loss") == [
        "program line 2, column 1: 'unused' is computed but the target 'loss' does not use it",
        "program line 4, column 1: 'count' is computed but the target 'loss' does not use it",
    ]
    kw = {"allow_unused": True}
    assert request_problems("loss", ["h", "q", "k", "w", "w"], **kw) == [
        "sources: source 'w' is listed twice",
        "sources: source 'h' is computed by program line 1; sources must be variables or inputs",
        "sources: unknown source 'q'",
        "sources: source 'k' is int32[2]; only floating-point sources have gradients",
    ]
    assert request_problems("loss", 3, **kw) == [
        "sources: sources must be a name, a list of names or a mapping alias -> name"
    ]
    assert request_problems("loss", {"a": 1}, **kw) == [
        "sources: source 'a': names must be strings"
    ]
    assert request_problems("loss", None, unconnected="zeros", **kw) == [
        "unconnected: unconnected must be 'none' or 'zero', got 'zeros'"
    ]


def test_leaves_must_match_the_compiled_structure() -> None:
    defn = {"inputs": {"x": np.zeros(3, np.float32)}, "program": ["y = x * 2"]}
    program = compile_definition(defn)
    with pytest.raises(DefinitionError) as info:
        program.run({"x": gt.constant(np.zeros(4, np.float32)), "z": gt.constant(1.0)})
    assert [str(p) for p in info.value.problems] == [
        "inputs.x: the program was compiled for float32[3], got float32[4]",
        "definition: 'z' is not a variable or input of the program",
    ]


def test_run_checks_its_arguments() -> None:
    defn = {"inputs": {"x": np.zeros(3, np.float32)}, "program": ["y = x * 2"]}
    program = compile_definition(defn)
    with pytest.raises(DefinitionError) as info:
        program.run({"x": np.zeros(3, np.float32)}, targets=["y", "z"])
    assert [str(p) for p in info.value.problems] == [
        "inputs.x: expected an engine Tensor, got ndarray (use program.leaves(definition))"
    ]
    with pytest.raises(DefinitionError, match="unknown target 'z'"):
        program.run(program.leaves(defn), targets=["y", "z"])


def test_limits_are_checked_and_deep_programs_run_at_the_limit() -> None:
    with pytest.raises(ValueError, match="max_depth 500 is too deep; at most 200"):
        Limits(max_depth=500)
    with pytest.raises(ValueError, match="limit max_lines must be a positive int, got 0"):
        Limits(max_lines=0)
    deep = Limits(max_depth=200)
    for text in [
        "y = " + "-" * 199 + "x",
        "y = x" + " + x" * 199,
        "y = " + "sin(" * 199 + "x" + ")" * 199,
    ]:
        defn = {"inputs": {"x": np.zeros(2)}, "program": [text]}
        assert evaluate(defn, "y", ["x"], limits=deep).gradients["x"].shape == (2,)


# ---- failures while running ----------------------------------------------------------------


def test_runtime_errors_name_the_line_and_op() -> None:
    defn = {
        "inputs": {
            "a": np.zeros((2, 2)),
            "b": np.ones(2),
            "logits": np.zeros((2, 3)),
            "labels": np.array([0, 7], np.int32),
        },
        "program": ["ok = b * 2", "x = solve(a, b)", "loss = sum(x)"],
    }
    with pytest.raises(ExecutionError) as info:
        evaluate(defn, "loss", ["b"], allow_unused=True)
    (problem,) = info.value.problems
    assert (problem.line, problem.column, problem.op, problem.kind) == (2, 5, "solve", "runtime")
    assert problem.message == "Singular matrix"
    defn["program"] = ["loss = softmax_cross_entropy(logits, labels)"]
    with pytest.raises(ExecutionError, match=r"labels must lie in \[0, 3\)"):
        evaluate(defn, "loss", ["logits"])
    assert not trace.active_tapes


def test_a_failing_backward_program_is_located() -> None:
    # The backward runs inside the caller's tape.gradient, after program.run returned;
    # an op failing there (a singular solve) still names its function, line and op.
    fn = {
        "params": ["a"],
        "forward": ["b = a"],
        "backward": ["grad_a = solve(a - a, upstream)"],
    }
    defn = {
        "variables": {"w": np.ones((2, 2))},
        "functions": {"f": fn},
        "program": ["y = f(w)", "loss = sum(y)"],
    }
    with pytest.raises(ExecutionError) as info:
        evaluate(defn, "loss")
    (problem,) = info.value.problems
    assert (problem.section, problem.line, problem.op) == ("functions.f.backward", 1, "solve")
    assert not trace.active_tapes


def test_grad_tapes_are_closed_when_a_run_fails() -> None:
    defn = {
        "inputs": {"a": np.zeros((2, 2)), "b": np.ones(2)},
        "program": ["g = grad(sum(b * b), b)", "x = solve(a, g)", "loss = sum(x)"],
    }
    with pytest.raises(ExecutionError):
        evaluate(defn, "loss", ["b"])
    assert not trace.active_tapes


def test_float_class_indices_say_they_need_an_integer_dtype() -> None:
    """Issue 27, item 9: float labels of the shape of class indices are indices sent as
    floats; the error says so (not a shape mismatch), in the language and the engine."""
    defn = {
        "variables": {"logits": np.zeros((4, 3))},
        "inputs": {"labels": np.array([0.0, 2.0, 1.0, 1.0])},
        "program": ["loss = softmax_cross_entropy(logits, labels)"],
    }
    (only,) = problems(defn)
    assert "integer class indices need an integer dtype" in only and "float64" in only
    with pytest.raises(ValueError, match="integer class indices need an integer dtype"):
        gt.softmax_cross_entropy(np.zeros((4, 3)), np.array([0.0, 2.0, 1.0, 1.0]))
    # Soft labels of the logits' shape still work; so do integer indices.
    soft = np.full((4, 3), 1 / 3)
    assert np.isfinite(gt.softmax_cross_entropy(np.zeros((4, 3)), soft).numpy())
    assert gt.softmax_cross_entropy(np.zeros((4, 3)), np.array([0, 2, 1, 1])).numpy() == (
        pytest.approx(np.log(3))
    )
