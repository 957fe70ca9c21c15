"""Property tests (Hypothesis, bounded and derandomized).

- A random call of any catalogue op on random tensors and constants: when the checks
  accept it, the engine computes it and the inferred shape and dtype are the engine's;
  when the engine refuses it, the checks refuse it too (the checks may refuse more, but
  only for dtypes: exp(int32) is refused where NumPy would silently upcast).
- Random multi-line programs that pass the checks compute what direct engine calls do.
- Random text, random Python syntax trees and random definition structures are answered
  with a DefinitionError, never with another exception.
"""

from __future__ import annotations

import ast
import string
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine as gt
from engine import trace
from engine.language import DefinitionError, ExecutionError, as_definition, compile_definition
from engine.language.catalogue import SIGNATURES, Param
from engine.registry import public_ops

SETTINGS = settings(
    max_examples=150, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

rng = np.random.default_rng(1)
POOL = {
    "s": rng.standard_normal(()),
    "v3": rng.standard_normal(3),
    "v4": rng.standard_normal(4),
    "m34": rng.standard_normal((3, 4)),
    "m43": rng.standard_normal((4, 3)),
    "m31": rng.standard_normal((3, 1)),
    "m33": rng.standard_normal((3, 3)) + 3 * np.eye(3),
    "t234": rng.standard_normal((2, 3, 4)),
    "f34": rng.standard_normal((3, 4)).astype(np.float32),
    "i3": np.array([0, 2, 1], np.int32),
    "k34": rng.integers(-2, 3, (3, 4)).astype(np.int32),
    "b34": rng.standard_normal((3, 4)) > 0,
}
FLOATS = [n for n, v in POOL.items() if v.dtype == np.float64]
OPERATORS = {
    "+": "add",
    "-": "subtract",
    "*": "multiply",
    "/": "divide",
    "**": "power",
    "@": "matmul",
    ">": "greater",
    "<=": "less_equal",
    "==": "equal",
}
OPS = sorted(name for name in SIGNATURES if name in public_ops)

# ---- random calls ----------------------------------------------------------------------------

shapes = st.sampled_from(
    [(), (12,), (3, 4), (4, 3), (2, -1), (-1,), (2, 3, 4), (1, 3, 4), 3, (3, 1), (2, 2)]
)
small_int = st.integers(-4, 3)
CONSTANTS: dict[str, st.SearchStrategy] = {
    "int": st.integers(-1, 2),
    "float": st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    "bool": st.booleans(),
    "axis": small_int,
    "axis?": st.none() | small_int,
    "axes": st.none() | small_int | st.lists(small_int, max_size=3).map(tuple),
    "perm": st.none() | st.permutations(range(3)).map(tuple) | st.permutations(range(2)).map(tuple),
    "shape": shapes,
    "dtype": st.sampled_from(["float64", "float32", "int32", "bool"]),
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "ord": st.sampled_from([None, 1, 2, "inf"]),
    "index": st.none() | small_int | st.lists(st.none() | small_int, max_size=3).map(tuple),
    "indices": st.integers(-1, 4) | st.lists(st.integers(-1, 4), max_size=4),
    "direction": st.sampled_from(["ASCENDING", "DESCENDING"]),
    "paddings": st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=3).map(tuple),
    "pad_mode": st.sampled_from(["CONSTANT", "REFLECT", "SYMMETRIC", "EDGE"]),
    "ints": st.lists(st.integers(0, 3), max_size=3).map(tuple),
    "window": st.integers(0, 2) | st.lists(st.integers(0, 2), max_size=3).map(tuple),
    "window?": st.none() | st.integers(0, 2) | st.lists(st.integers(0, 2), max_size=3).map(tuple),
    "pads": st.none()
    | st.integers(0, 2)
    | st.lists(st.integers(0, 1), max_size=4).map(tuple)
    | st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), max_size=3).map(tuple)
    | st.sampled_from(["SAME_UPPER", "SAME_LOWER", "VALID", "same", "valid"]),
}


@st.composite
def tensor_arg(draw: Any, names: list[str]) -> tuple[str, Callable[[dict], Any]]:
    """A name (text, value from env) or, now and then, a number literal."""
    if draw(st.integers(0, 9)) == 0:
        number = draw(st.sampled_from([2, 0.5, -1, 0]))
        return repr(number), lambda env: number
    floats = [n for n in names if n in FLOATS or n.startswith("h")]
    name = draw(st.sampled_from(floats if floats and draw(st.booleans()) else names))
    return name, lambda env: env[name]


@st.composite
def einsum_call(draw: Any, names: list[str]) -> tuple[str, Callable]:
    operands = draw(
        st.lists(st.sampled_from([n for n in names if n in POOL]), min_size=1, max_size=3)
    )
    subs = ["".join(draw(st.sampled_from("ijk")) for _ in POOL[n].shape) for n in operands]
    letters = sorted(set("".join(subs)))
    output = "".join(draw(st.permutations(letters))[: draw(st.integers(0, len(letters)))])
    spec = ",".join(subs) + ("" if draw(st.booleans()) else "->" + output)
    text = f"einsum({spec!r}, {', '.join(operands)})"
    return text, lambda env: gt.einsum(spec, *[env[n] for n in operands])


@st.composite
def subscript(draw: Any, names: list[str]) -> tuple[str, Callable]:
    name = draw(st.sampled_from(names))
    bound = st.none() | st.integers(-3, 4)
    item = st.one_of(
        small_int,
        st.tuples(bound, bound, st.none() | st.sampled_from([-2, -1, 1, 2])).map(
            lambda t: slice(*t)
        ),
        st.just(None),
        st.just(Ellipsis),
    )
    index = tuple(draw(st.lists(item, min_size=1, max_size=4)))

    def show(i: Any) -> str:
        if isinstance(i, slice):
            # slice(0, None) is "0:", not "0" (stripping every colon made it an int index)
            start, stop, step = ("" if b is None else str(b) for b in (i.start, i.stop, i.step))
            return f"{start}:{stop}" + (f":{step}" if step else "")
        return "..." if i is Ellipsis else str(i)

    text = f"{name}[{', '.join(show(i) for i in index)}]"
    return text, lambda env: gt.getitem(env[name], index)


@st.composite
def operator_call(draw: Any, names: list[str]) -> tuple[str, Callable]:
    symbol = draw(st.sampled_from(sorted(OPERATORS)))
    (left, lf), (right, rf) = draw(tensor_arg(names)), draw(tensor_arg(names))
    if (left[0].isdigit() and right[0].isdigit()) or "-" in (left[0], right[0]):
        left, lf = draw(st.sampled_from(names)), None
        name = left
        lf = lambda env: env[name]
    fn = public_ops[OPERATORS[symbol]].fn
    return f"{left} {symbol} {right}", lambda env: fn(lf(env), rf(env))


def _param_value(draw: Any, p: Param, names: list[str]) -> tuple[str, Callable] | None:
    """Text and value for one parameter, or None to leave it out."""
    if not p.required and draw(st.integers(0, 2)) == 0:
        return None
    if p.kind == "tensor":
        if p.name == "condition" and draw(st.booleans()):
            return "b34", lambda env: env["b34"]  # where() needs a bool condition
        return draw(tensor_arg(names))
    if p.kind == "tensors":
        items = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
        return f"[{', '.join(items)}]", lambda env: [env[n] for n in items]
    if p.kind == "indices" and draw(st.booleans()):
        return "i3", lambda env: env["i3"]
    value = draw(CONSTANTS[p.kind])
    return repr(value), lambda env: value


@st.composite
def op_call(draw: Any, names: list[str]) -> tuple[str, Callable]:
    """A call of any catalogue op, by position or keyword, in text and as a direct call."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(subscript(names))
    if kind == 1:
        return draw(operator_call(names))
    name = draw(st.sampled_from(OPS))
    if name == "einsum":
        return draw(einsum_call(names))
    sig, fn = SIGNATURES[name], public_ops[name].fn
    chosen = [(p, _param_value(draw, p, names)) for p in sig.params]
    positional = draw(st.integers(0, len(chosen)))
    texts, args, kwargs = [], [], {}
    for i, (p, pair) in enumerate(chosen):
        if pair is None:
            positional = min(positional, i)
            continue
        text, value = pair
        if i < positional:
            texts.append(text)
            args.append(value)
        else:
            texts.append(f"{p.name}={text}")
            kwargs[p.name] = value
    call = f"{name}({', '.join(texts)})"
    return call, lambda env: fn(*[a(env) for a in args], **{k: v(env) for k, v in kwargs.items()})


def env_of(program: Any, defn: dict) -> dict:
    return program.run(program.leaves(defn))


def assert_same(a: gt.Tensor, b: gt.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@SETTINGS
@given(op_call(list(POOL)))
def test_one_call_agrees_with_the_engine(call: tuple[str, Callable]) -> None:
    text, direct = call
    defn = {"inputs": POOL, "program": [f"out = {text}"]}
    leaves = {n: gt.constant(v) for n, v in POOL.items()}
    with np.errstate(all="ignore"):
        try:
            expected = direct(leaves)
        except Exception as exc:  # noqa: BLE001 - any refusal of the engine counts
            expected = exc
        try:
            program = compile_definition(defn)
        except DefinitionError as error:
            if not isinstance(expected, Exception):
                kinds = {p.kind for p in error.problems}
                assert kinds == {"dtype"}, f"{text}: refused, but the engine computes it: {error}"
            return
        if isinstance(expected, Exception):
            # Only values can make a checked call fail (integer powers with negative
            # exponents in a tensor, indices in a tensor out of bounds); then running the
            # program fails the same way.
            assert any(m in str(expected) for m in ("negative integer powers", "out of bounds")), (
                f"{text}: {expected!r}"
            )
            with pytest.raises(ExecutionError):
                env_of(program, defn)
            return
        inferred = program.types["out"]
        assert (inferred.shape, inferred.dtype) == (expected.shape, expected.dtype), text
        assert_same(env_of(program, defn)["out"], expected)


# Where the engine does not run the op's own check: NumPy finds elementwise broadcasting
# mismatches (in one place, engine.tensor.bind), and cumsum's rank message stutters in
# the language ("cumsum: cumsum needs ...") for compatibility.
ENGINE_OWN_WORDS = ("do not broadcast", "cumsum needs")


@SETTINGS
@given(op_call(list(POOL)))
def test_a_refused_call_reads_the_same_from_the_engine(call: tuple[str, Callable]) -> None:
    """One check per op: when the language refuses a call for its shapes or constants
    (one problem), the engine's wrapper refuses it with the same words, its name in front."""
    text, direct = call
    try:
        compile_definition({"inputs": POOL, "program": [f"out = {text}"]})
    except DefinitionError as error:
        problems = error.problems
    else:
        return
    if len(problems) != 1 or problems[0].kind not in ("shape", "op"):
        return
    message = problems[0].message
    if any(words in message for words in ENGINE_OWN_WORDS):
        return
    leaves = {n: gt.constant(v) for n, v in POOL.items()}
    with np.errstate(all="ignore"), pytest.raises(Exception) as refused:
        direct(leaves)
    assert message in str(refused.value), f"{text}: {message!r} vs {refused.value!r}"


@st.composite
def programs(draw: Any) -> list[tuple[str, str, Callable]]:
    names = list(POOL)
    lines = []
    for i in range(draw(st.integers(1, 5))):
        text, direct = draw(op_call(names))
        target = f"h{i}"
        lines.append((target, text, direct))
        names.append(target)
    return lines


@settings(SETTINGS, max_examples=100)
@given(programs())
def test_programs_agree_with_direct_engine_calls(lines: list) -> None:
    defn = {"inputs": POOL, "program": [f"{t} = {text}" for t, text, _ in lines]}
    with np.errstate(all="ignore"):
        try:
            program = compile_definition(defn)
        except DefinitionError:
            return
        env = env_of(program, defn)
        for target, _text, direct in lines:
            inferred = program.types[target]
            assert (inferred.shape, inferred.dtype) == (env[target].shape, env[target].dtype)
            assert_same(env[target], gt.as_tensor(direct(env)))


# ---- never another exception -------------------------------------------------------------------

X = {"x": np.arange(3.0), "w": np.ones((3, 3)), "n": np.array([0, 1], np.int32)}


def answered(program_text: list[str] | str, **extra: Any) -> None:
    """Compiling and running ends in success or a DefinitionError; nothing else."""
    defn = {"inputs": X, "program": program_text, **extra}
    with np.errstate(all="ignore"):
        try:
            program = compile_definition(defn)
            env = program.run(program.leaves(defn))
        except DefinitionError:
            pass
        else:
            assert set(program.line_names) <= set(env)
    assert not trace.active_tapes


PROGRAM_CHARS = "xwn()[]{}+-*/@=,.:;'\"#\\ \t0123456789_eEjJ" + "sumrelugradlambdaimport"


@SETTINGS
@given(
    st.lists(st.text(max_size=60), max_size=4)
    | st.lists(st.text(alphabet=PROGRAM_CHARS, max_size=60), max_size=4)
)
def test_random_text(lines: list[str]) -> None:
    answered(lines)


NAMES = st.sampled_from(
    [
        "x",
        "w",
        "n",
        "y",
        "h",
        "sum",
        "grad",
        "relu",
        "__import__",
        "os",
        "upstream",
        "einsum",
        "take",
        "open",
        "_",
    ]
)
LITERALS = st.one_of(
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(string.ascii_letters + ",.->", max_size=6),
    st.just(Ellipsis),
    st.complex_numbers(max_magnitude=10),
    st.binary(max_size=3),
)
BINOPS = [
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
    ast.MatMult,
    ast.FloorDiv,
    ast.Mod,
    ast.BitOr,
    ast.LShift,
]
CMPOPS = [ast.Gt, ast.Lt, ast.Eq, ast.NotEq, ast.Is, ast.In]


def _load(name: str) -> ast.Name:
    return ast.Name(name, ast.Load())


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    kids = st.lists(children, max_size=3)
    no_args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    return st.one_of(
        st.builds(
            lambda a, op, b: ast.BinOp(a, op(), b), children, st.sampled_from(BINOPS), children
        ),
        st.builds(
            lambda op, a: ast.UnaryOp(op(), a),
            st.sampled_from([ast.USub, ast.UAdd, ast.Not, ast.Invert]),
            children,
        ),
        st.builds(
            lambda f, args, kws, star: ast.Call(
                _load(f),
                args + ([ast.Starred(args[0], ast.Load())] if star and args else []),
                [ast.keyword(k, v) for k, v in kws],
            ),
            NAMES,
            kids,
            st.lists(
                st.tuples(st.sampled_from(["axis", "keepdims", "x", None]), children), max_size=2
            ),
            st.booleans(),
        ),
        st.builds(
            lambda v, a: ast.Attribute(v, a, ast.Load()),
            children,
            st.sampled_from(["T", "__class__", "shape"]),
        ),
        st.builds(
            lambda v, i: ast.Subscript(v, i, ast.Load()),
            children,
            children
            | st.builds(
                lambda a, b, c: ast.Slice(a, b, c),
                st.none() | children,
                st.none() | children,
                st.none() | children,
            ),
        ),
        st.builds(
            lambda a, op, b: ast.Compare(a, [op()], [b]),
            children,
            st.sampled_from(CMPOPS),
            children,
        ),
        st.builds(lambda a, b: ast.BoolOp(ast.And(), [a, b]), children, children),
        st.builds(ast.IfExp, children, children, children),
        st.builds(lambda b: ast.Lambda(no_args, b), children),
        st.builds(
            lambda e, it: ast.ListComp(
                e, [ast.comprehension(ast.Name("i", ast.Store()), it, [], 0)]
            ),
            children,
            children,
        ),
        st.builds(lambda e: ast.JoinedStr([ast.FormattedValue(e, -1, None)]), children),
        st.builds(lambda v: ast.NamedExpr(ast.Name("z", ast.Store()), v), children),
        st.builds(lambda es: ast.Tuple(es, ast.Load()), kids),
        st.builds(lambda es: ast.List(es, ast.Load()), kids),
        st.builds(lambda k, v: ast.Dict([k], [v]), children, children),
        st.builds(lambda v: ast.Set([v]), children),
        st.builds(ast.Await, children),
    )


EXPRESSIONS = st.recursive(NAMES.map(_load) | LITERALS.map(ast.Constant), _extend, max_leaves=12)
STATEMENTS = st.one_of(
    st.builds(lambda t, v: ast.Assign([ast.Name(t, ast.Store())], v), NAMES, EXPRESSIONS),
    st.builds(lambda t, v: ast.Assign([ast.Name(t, ast.Store())], v), NAMES, EXPRESSIONS),
    st.builds(ast.Expr, EXPRESSIONS),
    st.builds(
        lambda t, v: ast.AugAssign(ast.Name(t, ast.Store()), ast.Add(), v), NAMES, EXPRESSIONS
    ),
    st.just(ast.Import([ast.alias("os")])),
)


def _unparse(statement: ast.stmt) -> str:
    module = ast.fix_missing_locations(ast.Module([statement], []))
    try:
        return ast.unparse(module)
    except Exception:  # noqa: BLE001 - a tree ast.unparse cannot print: try something else
        return "y = x"


@SETTINGS
@given(st.lists(STATEMENTS.map(_unparse), min_size=1, max_size=4))
def test_random_syntax_trees(lines: list[str]) -> None:
    answered(lines)


@SETTINGS
@given(
    st.lists(STATEMENTS.map(_unparse), min_size=1, max_size=3),
    st.lists(STATEMENTS.map(_unparse), max_size=3),
    st.lists(NAMES, max_size=2),
)
def test_random_function_bodies(forward: list[str], backward: list[str], params: list) -> None:
    functions = {"f": {"params": params, "forward": forward, "backward": backward}}
    answered(["y = f(x)", "z = f(x, w)"], functions=functions)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(
                [
                    "program",
                    "variables",
                    "inputs",
                    "functions",
                    "value",
                    "trainable",
                    "params",
                    "forward",
                    "backward",
                    "output",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=15,
)


@SETTINGS
@given(JSON)
def test_random_definition_structures(obj: Any) -> None:
    try:
        defn = as_definition(obj)
    except DefinitionError:
        return
    try:
        program = compile_definition(defn)
        program.run(program.leaves(defn))
    except DefinitionError:
        pass
