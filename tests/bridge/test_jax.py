"""The JAX bridge (gradtape.client.jax_bridge; fixtures made by make_jax_keras.py): each
model's float64 loss, gradient over every pytree leaf (keyed by its path) and HVP agree
with JAX's at rtol 1e-6 through the engine, through HTTP and through the SDK, from
jax2onnx's stored export mapped by the SDK without JAX. Where JAX and jax2onnx are
installed, the live round trip exports each function again and checks it on the service."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from gradtape.client import BridgeError, Client, jax_bridge

from tests.bridge.make_jax_keras import MODELS
from tests.bridge.zoo import engine_pass
from tests.service.wire import t64, tape_and_hvp

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HAVE_JAX = all(importlib.util.find_spec(m) for m in ("jax", "jax2onnx"))


def record(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as data:
        return dict(data)


def mapped(name: str) -> tuple[jax_bridge.JaxModel, dict[str, np.ndarray]]:
    """The stored jax2onnx export through the SDK's mapping (no JAX needed)."""
    r = record(name)
    names = [str(n) for n in r["names"]]
    params = {n: r[f"param/{n}"] for n in names}
    return jax_bridge.from_export((FIXTURES / f"{name}.onnx").read_bytes(), params), r


def close(got: np.ndarray, want: np.ndarray, what: str, scale: float = 0.0) -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9 * scale, err_msg=what
    )


def check(name: str, value: float, grads: dict, hvps: dict) -> None:
    """Loss, gradients and HVPs against JAX's, for every leaf, keyed by its path."""
    r = record(name)
    names = [str(n) for n in r["names"]]
    close(value, r["loss"], f"{name} loss")
    assert sorted(grads) == sorted(names), (name, list(grads))
    for key, answer in (("grad", grads), ("hvp", hvps)):
        scale = max(float(np.abs(r[f"{key}/{n}"]).max()) for n in names)
        for n in names:
            close(answer[n], r[f"{key}/{n}"], f"{name} {key} {n}", scale)


def test_the_mapping_makes_exactly_the_leaves_variables_and_freezes_constants() -> None:
    model, r = mapped("jax_listnet")
    proto = onnx.load_model_from_string(model.onnx)
    assert [i.name for i in proto.graph.input] == ["x"]
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    floats = sorted(n for n, v in inits.items() if v.dtype.kind == "f")
    assert floats == sorted(model.names)  # nothing else is trainable
    assert model.names == ["0/0", "0/1", "1/0", "1/1", "2/0", "2/1"]  # list/tuple paths
    for n in model.names:
        np.testing.assert_array_equal(inits[n], r[f"param/{n}"])
    # The closed-over scale and jax2onnx's own constants became Constant nodes.
    assert model.constants >= 1
    consts = [n for n in proto.graph.node if n.op_type == "Constant"]
    scale = np.linspace(0.5, 1.5, 7)
    assert any(
        np.array_equal(onnx.numpy_helper.to_array(n.attribute[0].t).reshape(-1), scale)
        for n in consts
    )


def test_the_mapping_refuses_params_the_export_does_not_take() -> None:
    r = record("jax_mlp")
    raw = (FIXTURES / "jax_mlp.onnx").read_bytes()
    params = {str(n): r[f"param/{n}"] for n in r["names"]}
    with pytest.raises(BridgeError, match=r"no input for params \['extra/w'\]"):
        jax_bridge.from_export(raw, {**params, "extra/w": np.ones(3)})
    wrong = {**params, "dense1/bias": np.ones(3)}
    with pytest.raises(BridgeError, match=r"param 'dense1/bias': the export's input is \(8,\)"):
        jax_bridge.from_export(raw, wrong)
    as_float32 = {n: v.astype(np.float32) for n, v in params.items()}
    with pytest.raises(BridgeError, match=r"the export's input is float64, the value float32"):
        jax_bridge.from_export(raw, as_float32)
    # A leaf left out stays an input beside x: refused, naming it.
    del params["dense2/bias"]
    with pytest.raises(BridgeError, match=r"takes \['dense2/bias', 'x'\] besides the params"):
        jax_bridge.from_export(raw, params)


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_agrees_with_jax(name: str) -> None:
    model, r = mapped(name)
    vectors = {n: r[f"v/{n}"] for n in model.names}
    names, answers = engine_pass(model.definition((r["x"], r["y"]), str(r["kind"])), vectors)
    assert sorted(names) == sorted(model.names)  # every leaf, nothing else
    check(name, *answers)


@pytest.mark.parametrize("name", MODELS)
def test_http_agrees_with_jax(server, name: str) -> None:
    model, r = mapped(name)
    kind = str(r["kind"])
    defn = model.definition((r["x"], r["y"]), kind)
    defn["models"]["net"] = {"onnx": base64.b64encode(model.onnx).decode()}
    defn["inputs"] = {k: t64(v, str(v.dtype)) for k, v in defn["inputs"].items()}
    vector = {n: t64(r[f"v/{n}"], "float64") for n in model.names}
    check(name, *tape_and_hvp(server.base_url, {"definition": defn, "target": "loss"}, vector))


@pytest.mark.parametrize("name", MODELS)
def test_the_sdk_agrees_with_jax_from_the_stored_export(server, name: str) -> None:
    model, r = mapped(name)
    with Client(server.base_url) as client:
        client.models.put_onnx(f"{name}-stored", model.onnx)
        model.stored = f"{name}-stored"
        defn = model.definition((r["x"], r["y"]), str(r["kind"]))
        with client.tape(defn, "loss", output="logits") as tape:
            grads = dict(tape.gradients)
            hvps = dict(tape.hvp({n: r[f"v/{n}"] for n in model.names}))
            value = float(tape.value)
        client.models.delete(f"{name}-stored")
    check(name, value, grads, hvps)


@pytest.mark.skipif(not HAVE_JAX, reason="jax and jax2onnx are not installed (the jax extra)")
@pytest.mark.parametrize("name", MODELS)
def test_live_round_trip_from_the_jax_function(server, name: str) -> None:
    from tests.bridge.make_jax_keras import build

    f, params, x, y, kind = build(name)
    r = record(name)
    np.testing.assert_array_equal(x, r["x"])  # the function the fixture was made of
    with Client(server.base_url) as client:
        model = client.models.put_jax(f"{name}-live", f, params, x[:3])  # verified vs JAX
        assert model.verified and model.stored == f"{name}-live"
        assert model.names == [str(n) for n in r["names"]]
        v = model.to_pytree({n: r[f"v/{n}"] for n in model.names})  # a pytree like params
        with client.tape(model.definition((x, y), kind), "loss", output="logits") as tape:
            grads = dict(tape.gradients)
            hvps = dict(tape.hvp(model.from_pytree(v)))
            value = float(tape.value)
        client.models.delete(f"{name}-live")
    check(name, value, grads, hvps)
    # Loadable back into the params' structure, leaf by leaf.
    tree = model.to_pytree(grads)
    for n, leaf in model.from_pytree(tree).items():
        np.testing.assert_array_equal(leaf, np.asarray(grads[n]))


@pytest.mark.skipif(not HAVE_JAX, reason="jax and jax2onnx are not installed (the jax extra)")
def test_live_verification_refuses_a_service_forward_that_differs(server) -> None:
    from tests.bridge.make_jax_keras import build

    f, params, x, _, _ = build("jax_mlp")
    model = jax_bridge.export(f, params, x)
    model.expected = model.expected + 1e-3  # as if the file computed something else
    with (
        Client(server.base_url) as client,
        pytest.raises(jax_bridge.ExportMismatch, match="forward differs from JAX's"),
    ):
        jax_bridge.verify(client, model)


@pytest.mark.skipif(not HAVE_JAX, reason="jax and jax2onnx are not installed (the jax extra)")
def test_live_a_leaf_f_does_not_read_has_a_zero_gradient(server) -> None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(7)
    params = {"w": rng.normal(size=(3, 4)), "v": rng.normal(size=(4, 2)), "spare": np.ones(2)}
    x, y = rng.normal(size=(5, 3)), rng.normal(size=(5, 2))

    def f(p, x):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    want = jax.grad(lambda p: jnp.mean((f(p, x) - y) ** 2))(params)
    with Client(server.base_url) as client:
        model = client.models.put_jax("unused-live", f, params, x)
        assert model.names == ["spare", "v", "w"]  # jax.tree_util's (sorted) order
        with client.tape(model.definition((x, y), "mse"), "loss", output="logits") as tape:
            grads = model.to_pytree(tape.gradients)
        client.models.delete("unused-live")
    np.testing.assert_array_equal(grads["spare"], np.zeros(2))
    for n in ("v", "w"):
        np.testing.assert_allclose(grads[n], np.asarray(want[n]), rtol=1e-9, err_msg=n)
