"""Export the JAX models below through jax2onnx, as the JAX bridge does, with JAX's own
float64 answers beside each. Run from the repository root, in a venv with `jax` and
`jax2onnx` (the `jax` extra of gradtape-client):

    PYTHONPATH=$PWD:$PWD/clients/python python tests/bridge/make_jax_keras.py

For each model: fixtures/<name>.onnx, jax2onnx's own export (the params as graph inputs
named by their pytree paths, then x: what `jax_bridge.export` feeds to
`jax_bridge.from_export`), and fixtures/<name>.npz holding the params (param/<path>), the
batch (x, y), JAX's float64 loss, the gradient of every leaf (grad/<path>), a direction
(v/<path>) and the Hessian-vector product along it (hvp/<path>, forward-over-reverse),
and `names`, the paths in flattening order. The tests map the stored export without JAX;
where JAX is installed they rebuild each function from here and export it again.

Keras is not exported: tf2onnx 1.17.0's `from_keras` fails on the Keras 3 that pip's
TensorFlow brings (tensorflow-cpu 2.21.0, keras 3.15.1: `KeyError: 'keras_tensor_2'` in
tf2onnx/convert.py), and its `from_function` route drops all-zero biases and names the
weights by graph op ('sequential_1/dense2_1/Cast/ReadVariableOp:0').
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = ("jax_mlp", "jax_listnet")


def _jax() -> Any:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 params and answers
    return jax


def build(name: str) -> tuple[Any, Any, np.ndarray, np.ndarray, str]:
    """(f, params, x, y, loss kind): f(params, x) -> logits."""
    jax = _jax()
    jnp = jax.numpy
    rng = np.random.default_rng(4000 + MODELS.index(name))
    if name == "jax_mlp":  # nested dicts; cross-entropy over integer labels

        def mlp(params: Any, x: Any) -> Any:
            h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
            return h @ params["dense2"]["kernel"] + params["dense2"]["bias"]

        params = {
            "dense1": {"kernel": rng.normal(size=(6, 8)), "bias": 0.3 * rng.normal(size=8)},
            "dense2": {"kernel": rng.normal(size=(8, 4)), "bias": 0.3 * rng.normal(size=4)},
        }
        x = rng.normal(size=(5, 6))
        return mlp, params, x, rng.integers(0, 4, size=5), "cross_entropy"
    # A list of layer tuples, a hand-written LayerNorm, softplus and a closed-over
    # constant scale (an exporter constant, frozen): MSE on 3 outputs.
    scale = np.linspace(0.5, 1.5, 7)

    def listnet(params: Any, x: Any) -> Any:
        (w1, b1), (gamma, beta), (w2, b2) = params
        h = x @ w1 + b1
        mu = h.mean(axis=-1, keepdims=True)
        var = ((h - mu) ** 2).mean(axis=-1, keepdims=True)
        h = (h - mu) / jnp.sqrt(var + 1e-5) * gamma + beta
        return jax.nn.softplus(h * scale) @ w2 + b2

    params = [
        (rng.normal(size=(5, 7)), 0.3 * rng.normal(size=7)),
        (1.0 + 0.3 * rng.normal(size=7), 0.3 * rng.normal(size=7)),
        (rng.normal(size=(7, 3)), 0.3 * rng.normal(size=3)),
    ]
    x = rng.normal(size=(6, 5))
    return listnet, params, x, rng.normal(size=(6, 3)), "mse"


def jax_loss(f: Any, kind: str, x: np.ndarray, y: np.ndarray) -> Any:
    """The loss the service computes for `kind` (JaxModel.definition's lines)."""
    jax = _jax()
    jnp = jax.numpy
    if kind == "cross_entropy":
        return lambda p: -jnp.mean(jax.nn.log_softmax(f(p, x))[jnp.arange(len(y)), y])
    return lambda p: jnp.mean((f(p, x) - y) ** 2)


def answers(name: str) -> dict[str, np.ndarray]:
    """JAX's float64 loss, gradient and HVP of the model on its batch."""
    jax = _jax()
    from gradtape.client import jax_bridge

    f, params, x, y, kind = build(name)
    loss = jax_loss(f, kind, x, y)
    pairs = jax_bridge._named_leaves(jax, params)[0]
    names = [n for n, _ in pairs]
    rng = np.random.default_rng(5000 + MODELS.index(name))
    v_leaves = [rng.normal(size=np.shape(p)) for _, p in pairs]
    v = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), v_leaves)
    grads = jax.grad(loss)(params)
    hvp = jax.jvp(jax.grad(loss), (params,), (v,))[1]
    out: dict[str, np.ndarray] = {
        "x": x,
        "y": y,
        "loss": np.array(float(loss(params))),
        "names": np.array(names),
        "kind": np.array(kind),
    }
    for (n, p), (_, g), vv, (_, h) in zip(
        pairs,
        jax_bridge._named_leaves(jax, grads)[0],
        v_leaves,
        jax_bridge._named_leaves(jax, hvp)[0],
    ):
        out[f"param/{n}"] = p
        out[f"grad/{n}"] = g
        out[f"v/{n}"] = vv
        out[f"hvp/{n}"] = h
    return out


def raw_export(name: str) -> bytes:
    """jax2onnx's file as jax_bridge.export makes it, before the mapping."""
    _jax()
    from gradtape.client import jax_bridge

    f, params, x, _, _ = build(name)
    return jax_bridge.raw_export(f, params, x)


def main(names: list[str]) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]
    FIXTURES.mkdir(exist_ok=True)
    for name in names:
        raw = raw_export(name)
        (FIXTURES / f"{name}.onnx").write_bytes(raw)
        np.savez_compressed(FIXTURES / f"{name}.npz", **answers(name))
        print(f"{name}: {len(raw):,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
