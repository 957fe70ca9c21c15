"""Compilation: caching by structure, running many times, running part of a program,
and the pieces the service builds on (leaves, functions for transforms, HVP operators)."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import trace
from engine.language import (
    Definition,
    DefinitionError,
    FunctionDef,
    Limits,
    VariableDef,
    cache_size,
    clear_cache,
    compile_definition,
    evaluate,
)

MLP = {
    "variables": {"w1": np.full((3, 4), 0.5), "b1": np.zeros(4), "w2": np.ones((4, 1))},
    "inputs": {"x": np.arange(6.0).reshape(2, 3), "y": np.ones((2, 1))},
    "program": [
        "h = relu(x @ w1 + b1)",
        "out = h @ w2",
        "loss = mean((out - y) ** 2)",
    ],
}


def with_values(defn: dict, **values: object) -> dict:
    out = dict(defn)
    out["variables"] = {
        **defn["variables"],
        **{k: v for k, v in values.items() if k in defn["variables"]},
    }
    out["inputs"] = {**defn["inputs"], **{k: v for k, v in values.items() if k in defn["inputs"]}}
    return out


def test_cached_by_structure_not_values() -> None:
    clear_cache()
    first = compile_definition(MLP)
    again = compile_definition(with_values(MLP, x=np.ones((2, 3)), w1=np.zeros((3, 4))))
    assert again is first
    assert cache_size() == 1
    reshaped = compile_definition(with_values(MLP, x=np.ones((5, 3)), y=np.ones((5, 1))))
    assert reshaped is not first and reshaped.key != first.key
    assert compile_definition(MLP, Limits(max_depth=10)) is not first  # limits count too
    frozen = dict(
        MLP, variables={**MLP["variables"], "w2": {"value": np.ones((4, 1)), "trainable": False}}
    )
    assert compile_definition(frozen).key != first.key


def test_every_part_of_the_structure_is_in_the_key() -> None:
    """Two definitions share a compiled program only when everything compilation reads
    is the same: a leaf's dtype, its role, a line, a function's body."""
    first = compile_definition(MLP)
    float32 = dict(
        MLP,
        variables={k: np.asarray(v, np.float32) for k, v in MLP["variables"].items()},
        inputs={k: np.asarray(v, np.float32) for k, v in MLP["inputs"].items()},
    )
    as_input = dict(
        MLP,
        variables={k: v for k, v in MLP["variables"].items() if k != "b1"},
        inputs={**MLP["inputs"], "b1": np.zeros(4)},
    )
    relu = {"params": ["a"], "forward": ["out = relu(a)"]}
    tanh = {"params": ["a"], "forward": ["out = tanh(a)"]}
    other_line = dict(MLP, program=[*MLP["program"][:2], "loss = sum((out - y) ** 2)"])
    keys = {
        first.key,
        compile_definition(float32).key,
        compile_definition(as_input).key,
        compile_definition(dict(MLP, functions={"act": relu})).key,
        compile_definition(dict(MLP, functions={"act": tanh})).key,
        compile_definition(other_line).key,
    }
    assert len(keys) == 6
    assert compile_definition(dict(MLP, functions={"act": dict(tanh)})).key in keys


def test_a_remembered_structure_key_is_the_one_computed_afresh() -> None:
    """structure_key remembers the hashes of the structures it has seen, found by the
    structure itself: the same key as hashing it again, and never another structure's
    (including ones a repr could confuse: a trainable flag beside a size of 1, a line
    split differently, a leaf renamed)."""
    from engine.language import definition

    defn = definition.as_definition(MLP)
    limits = Limits()
    remembered = definition.structure_key(defn, limits)
    definition._structure_keys.clear()
    assert definition.structure_key(defn, limits) == remembered
    variants = [
        dict(
            MLP, program=["h = relu(x @ w1 + b1)", "out = h @ w2", "loss = mean((out - y) ** 2) "]
        ),
        dict(MLP, program=["h = relu(x @ w1 + b1)\nout = h @ w2", "loss = mean((out - y) ** 2)"]),
        dict(
            MLP,
            variables={**MLP["variables"], "w2": {"value": np.ones((4, 1)), "trainable": False}},
        ),
        dict(MLP, variables={"w1": np.full((3, 4), 0.5), "b2": np.zeros(4), "w2": np.ones((4, 1))}),
    ]
    keys = {remembered}
    for variant in variants:
        one = definition.as_definition(variant)
        seen = definition.structure_key(one, limits)
        definition._structure_keys.clear()
        assert definition.structure_key(one, limits) == seen  # remembered = afresh
        keys.add(seen)
    assert len(keys) == 1 + len(variants)


def test_a_long_structure_is_never_remembered_even_when_refused() -> None:
    """A client's long names or lines are not kept by the structure-key memory: a
    definition refused after its key was computed (a name too long for the language)
    leaves nothing behind, and neither does a long valid one; a short one is kept."""
    from engine.language import definition
    from engine.language.compile import DefinitionError

    definition._structure_keys.clear()
    long_name = "x" * 2**20
    refused = dict(MLP, inputs={**MLP["inputs"], long_name: np.ones(2)})
    with pytest.raises(DefinitionError):
        compile_definition(refused)
    lines = [f"extra{i} = loss" + " + 0.5" * 20 for i in range(40)]  # ~5,400 characters
    compile_definition(dict(MLP, program=[*MLP["program"], *lines]))
    assert definition._structure_keys == {}
    compile_definition(MLP)
    assert len(definition._structure_keys) == 1
    assert all(
        len(repr(k)) <= definition.REMEMBERED_STRUCTURE_CHARS for k in definition._structure_keys
    )


def test_coercion_takes_any_mapping_and_refuses_what_it_refused() -> None:
    """as_definition's short ways for plain dicts give what the general ones give for
    other mappings, and the same problems for bad names and fields."""
    from types import MappingProxyType

    from engine.language import definition

    plain = definition.as_definition(MLP)
    proxied = definition.as_definition(
        MappingProxyType(
            {
                **MLP,
                "variables": MappingProxyType(dict(MLP["variables"])),
                "inputs": MappingProxyType(dict(MLP["inputs"])),
                "program": tuple(MLP["program"]),
            }
        )
    )
    assert plain.program == proxied.program
    for a, b in ((plain.variables, proxied.variables), (plain.inputs, proxied.inputs)):
        assert list(a) == list(b)
        for name in a:
            left = getattr(a[name], "value", a[name])
            right = getattr(b[name], "value", b[name])
            assert left.dtype == right.dtype and np.array_equal(left, right)
    with pytest.raises(DefinitionError) as refused:
        definition.as_definition(
            dict(MLP, variables={**MLP["variables"], 3: np.zeros(2), "v": {"value": 1, "x": 2}})
        )
    messages = [p.message for p in refused.value.problems]
    assert any("name 3 is not a string" in m for m in messages)
    assert any("unknown field(s) ['x']" in m for m in messages)


def test_one_program_runs_many_times() -> None:
    program = compile_definition(MLP)
    for scale in (0.1, 1.0, 2.0):
        defn = with_values(MLP, w1=np.full((3, 4), scale))
        leaves = program.leaves(defn)
        with gt.GradientTape() as tape:
            env = program.run(leaves)
        grads = tape.gradient(env["loss"], [leaves["w1"], leaves["b1"], leaves["w2"]])
        expected = evaluate(defn, "loss")
        np.testing.assert_allclose(env["loss"].numpy(), expected.value)
        for got, want in zip(grads, expected.gradients.values()):
            np.testing.assert_allclose(got.numpy(), want)


def test_leaves_are_variables_and_constants() -> None:
    frozen = dict(
        MLP, variables={**MLP["variables"], "b1": {"value": np.zeros(4), "trainable": False}}
    )
    program = compile_definition(frozen)
    leaves = program.leaves(frozen, device="cpu")
    assert isinstance(leaves["w1"], gt.Variable) and leaves["w1"].trainable
    assert isinstance(leaves["b1"], gt.Variable) and not leaves["b1"].trainable
    assert not isinstance(leaves["x"], gt.Variable)
    assert program.trainable == ["w1", "w2"]
    assert list(program.variables) == ["w1", "b1", "w2"]
    assert list(program.inputs) == ["x", "y"]
    assert program.line_names == ("h", "out", "loss")
    assert str(program.types["out"]) == "float64[2, 1]"


def test_run_only_what_the_targets_need() -> None:
    defn = {
        "inputs": {"x": 2.0, "a": np.zeros((2, 2))},
        "program": ["y = x * 3", "broken = solve(a, a)", "dy = grad(y * y, x)"],
    }
    program = compile_definition(defn)
    env = program.run(program.leaves(defn), targets=["dy"])
    assert float(env["dy"]) == 36.0
    assert "broken" not in env


def test_a_bare_number_line_and_blank_lines() -> None:
    defn = {
        "inputs": {"x": 2.0},
        "program": "# a comment\nc = 0.5\n\nk = 3\ny = x * c + cast(k, 'float32')",
    }
    result = evaluate(defn, "y", ["x"])
    assert (float(result.value), float(result.gradients["x"])) == (4.0, 0.5)
    program = compile_definition(defn)
    assert str(program.types["c"]) == "float32[]" and str(program.types["k"]) == "int32[]"


def test_aliases_are_separate_tensors() -> None:
    # h is x by value, r is h by value (reshape to the same shape hands back its input):
    # a grad over h sees h's uses (directly and through r) but not x's own.
    defn = {
        "inputs": {"x": 3.0},
        "program": [
            "h = x",
            "r = reshape(h, ())",
            "y = h * x + r",
            "g = grad(y, h)",
            "gr = grad(y, r)",
        ],
    }
    program = compile_definition(defn)
    env = program.run(program.leaves(defn))
    assert float(env["g"]) == 4.0  # x + 1, not 2 x + 1
    assert float(env["gr"]) == 1.0
    assert len({id(env[n]) for n in ("x", "h", "r")}) == 3


def test_grad_of_an_intermediate_and_of_non_scalars() -> None:
    defn = {
        "inputs": {"x": np.array([1.0, 2.0])},
        "program": ["h = x * x", "y = h * 3", "g = grad(y, h)", "gx = grad(y, x)"],
    }
    program = compile_definition(defn)
    env = program.run(program.leaves(defn))
    np.testing.assert_array_equal(env["g"].numpy(), [3.0, 3.0])  # d sum(y) / d h
    np.testing.assert_array_equal(env["gx"].numpy(), [6.0, 12.0])


def test_functions_for_transforms() -> None:
    program = compile_definition(MLP)
    leaves = program.leaves(MLP)
    f = program.function("loss", ["w2"], leaves)
    hessian = gt.hessian(f)(leaves["w2"])
    jac = gt.jacfwd(program.function("out", ["w2"], leaves))(leaves["w2"])
    assert hessian.shape == (4, 1, 4, 1)
    assert jac.shape == (2, 1, 4, 1)
    h = program.run(leaves)["h"].numpy()
    np.testing.assert_allclose(hessian.numpy().reshape(4, 4), 2 * h.T @ h / 2, rtol=1e-12)


def test_hessian_operator_reuses_the_recording() -> None:
    program = compile_definition(MLP)
    leaves = program.leaves(MLP)
    request = program.check_request("loss", {"first": "w1", "last": "w2"})
    operator = program.hessian_operator(request, leaves)
    v = (np.ones((3, 4)), np.ones((4, 1)))
    fresh = gt.hvp(program.function("loss", ["w1", "w2"], leaves), (leaves["w1"], leaves["w2"]), v)
    for got, want in zip(operator.hvp(*v), fresh):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
    many = operator.hvp_many(np.stack([v[0], 2 * v[0]]), np.stack([v[1], 2 * v[1]]))
    np.testing.assert_allclose(many[0].numpy()[1], 2 * fresh[0].numpy(), rtol=1e-12)


def test_definition_objects_are_accepted() -> None:
    defn = Definition(
        program=("y = double(w) + x",),
        variables={"w": VariableDef(np.array([1.0, 2.0], np.float32))},
        inputs={"x": np.float32(1.0)},
        functions={"double": FunctionDef(("a",), ("b = a * 2",), ("grad_a = upstream * 2",))},
    )
    result = evaluate(defn, "y")
    np.testing.assert_array_equal(result.gradients["w"], [2.0, 2.0])


def test_user_function_under_nested_grad_and_jacobian() -> None:
    fn = {"params": ["a"], "forward": ["b = a * a"], "backward": ["grad_a = 2 * a * upstream"]}
    defn = {
        "variables": {"w": np.array([1.0, 3.0])},
        "functions": {"sq": fn},
        "program": ["y = sum(sq(w))", "g = grad(y, w)", "z = sum(g * g)"],
    }
    result = evaluate(defn, "z")
    np.testing.assert_allclose(result.gradients["w"], 8 * np.array([1.0, 3.0]))
    program = compile_definition(defn)
    leaves = program.leaves(defn)
    with gt.GradientTape() as tape:
        env = program.run(leaves, targets=["g"])
    np.testing.assert_allclose(tape.jacobian(env["g"], leaves["w"]).numpy(), 2 * np.eye(2))


def test_clip_grad_norm_clips_each_jacobian_row() -> None:
    defn = {
        "variables": {"w": np.array([3.0, 4.0])},
        "program": ["y = clip_grad_norm(w * 10, 1.0)"],
    }
    program = compile_definition(defn)
    leaves = program.leaves(defn)
    with gt.GradientTape() as tape:
        env = program.run(leaves)
    # Each row of the jacobian is one cotangent e_i, of norm 1: nothing to clip.
    np.testing.assert_allclose(tape.jacobian(env["y"], leaves["w"]).numpy(), 10 * np.eye(2))
    # The gradient of sum(y) has cotangent (1, 1), of norm sqrt(2): clipped to norm 1.
    grad = evaluate(defn, "y").gradients["w"]
    np.testing.assert_allclose(grad, 10 / np.sqrt(2) * np.ones(2))


def test_no_tape_is_left_recording() -> None:
    evaluate(
        {"inputs": {"x": 1.0}, "program": ["y = x ** 3", "g = grad(y, x)", "h = grad(g, x)"]},
        "h",
        ["x"],
    )
    assert not trace.active_tapes


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dtypes_flow_through(dtype: str) -> None:
    defn = {
        "variables": {"w": np.ones(3, dtype)},
        "inputs": {"x": np.ones(3, dtype)},
        "program": ["y = sum(w * x * 0.5)"],
    }
    result = evaluate(defn, "y")
    assert result.value.dtype == np.dtype(dtype)
    assert result.gradients["w"].dtype == np.dtype(dtype)


def test_the_order_of_the_leaves_is_part_of_the_structure() -> None:
    """Two definitions that differ only in the order of their variables are two programs:
    the default sources, a flat answer and a flat `point` follow each one's own order (a
    shared program would split one client's point in another client's order)."""
    reordered = {**MLP, "variables": dict(reversed(list(MLP["variables"].items())))}
    first = compile_definition(MLP)
    second = compile_definition(reordered)
    assert first.trainable == ["w1", "b1", "w2"]
    assert second.trainable == ["w2", "b1", "w1"]
    value, grads = second.value_and_gradients(
        second.check_request("loss", None), second.leaves(reordered)
    )
    assert list(grads) == ["w2", "b1", "w1"]
    ref, ref_grads = first.value_and_gradients(first.check_request("loss", None), first.leaves(MLP))
    assert float(value.value) == float(ref.value)
    for name in ref_grads:
        np.testing.assert_array_equal(grads[name].value, ref_grads[name].value)


def test_a_definitions_arrays_are_freed_without_the_garbage_collector() -> None:
    """Checking and running a definition leaves no reference cycle holding its arrays (a
    recursive checker closure and a variable's cached read were two): a service worker
    receives them as views of shared memory, which it gives back when they die."""
    import gc
    import weakref

    clear_cache()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):  # compiled once, then from the cache; dynamic pass, then capture
            w = np.full((3, 4), 0.5)
            alive = weakref.ref(w)
            definition = {**MLP, "variables": {**MLP["variables"], "w1": w}}
            program = compile_definition(definition)
            value, grads = program.value_and_gradients(
                program.check_request("loss", None), program.leaves(definition)
            )
            assert grads["w1"].shape == (3, 4) and np.isfinite(value.value)
            del w, definition, value, grads
            assert alive() is None
    finally:
        gc.enable()


def test_a_checked_request_is_remembered_and_each_caller_gets_its_own() -> None:
    """check_request remembers what it checked (a service asks the same on every call),
    by every argument: the same request answers equal, a different one is checked anew,
    and a bad one is refused every time."""
    program = compile_definition(MLP)
    first = program.check_request("loss", {"a": "w1", "b": "b1"})
    first.sources["c"] = "w2"  # the caller's own copy
    again = program.check_request("loss", {"a": "w1", "b": "b1"})
    assert again.sources == {"a": "w1", "b": "b1"} and again is not first
    assert program.check_request("loss", ["w1", "b1"]).sources == {"w1": "w1", "b1": "b1"}
    assert program.check_request("loss", {"b": "b1", "a": "w1"}).sources == {"b": "b1", "a": "w1"}
    assert program.check_request("loss", "w2", "zero").unconnected == "zero"
    for _ in range(2):
        with pytest.raises(DefinitionError, match="unknown target"):
            program.check_request("los")
        with pytest.raises(DefinitionError, match="does not use it"):
            program.check_request("h")
    assert program.check_request("h", allow_unused=True).target == "h"
