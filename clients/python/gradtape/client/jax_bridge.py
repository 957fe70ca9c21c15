"""The JAX bridge (`pip install 'gradtape-client[jax]'`): a function `f(params, x)`, its
params a pytree, to the service with every leaf kept as itself, and answers keyed by the
leaves' pytree paths and loadable back into the pytree.

    net = jax_bridge.export(f, params, x[:8])            # jax2onnx, mapped, not yet checked
    net = client.models.put_jax("mlp", f, params, x[:8])  # checked on the service, stored
    with client.tape(net.definition((x, y), "cross_entropy"), "loss") as tape:
        grads = net.to_pytree(tape.gradients)             # the params' structure

Names: a leaf is named by its path with the keys joined by "/": `{"dense1": {"kernel":
...}}` gives "dense1/kernel", a list index or a tuple position its number
("layers/0/w"), a dataclass field or a flax/equinox attribute its name; params that are
one bare array are "params". The service's
answers (gradients, HVPs, eigenvectors) come back as `{path: array}`; `to_pytree` puts
them back into the params' structure, `from_pytree` makes such a dict of a pytree (an HVP
direction, say). Paths that collide (a key containing "/") are refused, naming them.

How a function gets there (`export`): jax2onnx exports `f` with the parameters as graph
INPUTS, not closed-over constants, so no exporter pass can fold, merge, transpose or drop
them; the bridge then turns those inputs into initializers named by their paths and
holding the params' own values (nothing is matched by guesswork), and every other float
initializer (jax2onnx's constants, values `f` closes over) into a Constant node: never
trainable. The batch axis (axis 0 of x) is dynamic. A leaf `f` does not read has a zero
gradient. Float64 params need `jax.config.update("jax_enable_x64", True)` before they are
made (else JAX holds them in float32). `put_jax` (and `verify`) check the service's
forward and its gradient of sum(r * f(params, x)) on the example input against JAX's
(tolerances as the PyTorch bridge's: 1e-9 in float64, 1e-4 in float32).

`from_export(onnx, params_by_path, ...)` is the mapping alone, on NumPy arrays: it needs
neither JAX nor jax2onnx (the tests run it on a stored export).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .pytorch import TOLERANCE, BridgeError, ExportMismatch, _close, _constant

if TYPE_CHECKING:
    from ._client import ApiMethods

LOSSES = ("cross_entropy", "mse")


def _jax() -> Any:
    try:
        import jax
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ImportError(
            "the JAX bridge needs jax, jax2onnx and onnx: pip install 'gradtape-client[jax]'"
        ) from exc
    return jax


@dataclass
class JaxModel:
    """A JAX function as the service runs it: the .onnx file (its variables exactly the
    params' leaves, named by path), the paths in `jax.tree_util` flattening order, and
    what the checks against JAX need. `stored`: its name in the model store, else None."""

    onnx: bytes = field(repr=False)
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: np.dtype
    input: str = "x"
    output: str = "logits"
    constants: int = 0
    treedef: Any = field(default=None, repr=False)
    example_input: np.ndarray | None = field(default=None, repr=False)
    expected: np.ndarray | None = field(default=None, repr=False)
    probe_weight: np.ndarray | None = field(default=None, repr=False)
    probe_gradients: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    stored: str | None = None
    verified: bool = False

    def model_spec(self) -> dict[str, Any]:
        """The definition's `models` entry: the file, or the stored name."""
        return {"stored": self.stored} if self.stored else {"onnx": self.onnx}

    def definition(self, data: tuple[Any, Any], loss: str | Sequence[str]) -> dict[str, Any]:
        """A definition computing `loss` of `logits = f(params, x)` on `data = (x, y)`:
        "cross_entropy" (softmax over the last axis, integer labels y) or "mse", or lines
        of the definition language over `logits` and `y` whose last assigns `loss`.
        `client.tape(model.definition(...), "loss", output="logits")`."""
        x, y = data
        if isinstance(loss, str) and loss in LOSSES:
            line = (
                f"loss = softmax_cross_entropy({self.output}, y)"
                if loss == "cross_entropy"
                else f"loss = mean_squared_error({self.output}, y)"
            )
            lines = [line]
        elif isinstance(loss, (list, tuple)) and loss and str(loss[-1]).startswith("loss"):
            lines = [str(line) for line in loss]
        else:
            raise BridgeError(
                f"loss must be one of {', '.join(LOSSES)}, or lines of the definition "
                f"language over {self.output!r} and 'y' whose last assigns `loss`; got {loss!r}"
            )
        return {
            "models": {"net": self.model_spec()},
            "inputs": {self.input: np.asarray(x), "y": np.asarray(y)},
            "program": [f"{self.output} = net({self.input})", *lines],
        }

    def from_pytree(self, tree: Any) -> dict[str, np.ndarray]:
        """A pytree shaped like the params as `{path: array}` (an HVP direction, say)."""
        jax = _jax()
        pairs = _named_leaves(jax, tree)[0]
        if [n for n, _ in pairs] != self.names:
            raise BridgeError(
                f"the pytree's paths {[n for n, _ in pairs]} are not the params' {self.names}"
            )
        return {n: np.asarray(v) for n, v in pairs}

    def to_pytree(self, answer: Mapping[str, Any]) -> Any:
        """`{path: array}` (the service's gradients, an HVP, an eigenvector) back into
        the params' structure; a leaf the answer lacks (unused by f) is zeros."""
        if self.treedef is None:
            raise BridgeError("this model was not exported from a pytree (from_export)")
        jax = _jax()
        unknown = sorted(set(answer) - set(self.names))
        if unknown:
            raise BridgeError(f"the answer names {unknown}, which are not params' paths")
        leaves = [
            np.asarray(answer[n]).reshape(s) if n in answer else np.zeros(s, self.dtype)
            for n, s in zip(self.names, self.shapes)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


# --------------------------------------------------------------------------- export


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _named_leaves(jax: Any, tree: Any) -> tuple[list[tuple[str, np.ndarray]], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # A bare array as params (no path) is named "params".
    pairs = [
        ("/".join(_key_name(k) for k in path) or "params", np.asarray(v)) for path, v in leaves
    ]
    names = [n for n, _ in pairs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise BridgeError(
            f"pytree paths {clashes} name more than one leaf once joined by '/' "
            "(a key containing '/'); rename the keys"
        )
    return pairs, treedef


def _check_dtype(pairs: list[tuple[str, np.ndarray]]) -> np.dtype:
    dtypes = {v.dtype for _, v in pairs}
    if len(dtypes) != 1 or not dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}:
        raise BridgeError(
            f"the params' leaves are {sorted(str(d) for d in dtypes)}; the bridge takes params "
            "entirely in float32 or entirely in float64 (jax_enable_x64 for float64)"
        )
    return next(iter(dtypes))


def raw_export(
    fn: Any, params: Any, example_input: Any, *, dynamic_batch: bool = True, opset: int = 21
) -> bytes:
    """jax2onnx's own file of `fn`: the params as inputs named by their paths (in
    flattening order), then x; what `from_export` maps."""
    jax = _jax()
    from jax2onnx import to_onnx

    pairs, treedef = _named_leaves(jax, params)
    dtype = _check_dtype(pairs)
    x = np.asarray(example_input)

    def flat(*args: Any) -> Any:  # the params as positional inputs, then x
        return fn(jax.tree_util.tree_unflatten(treedef, list(args[:-1])), args[-1])

    x_spec: Any = ("B", *x.shape[1:]) if dynamic_batch and x.ndim else x.shape
    try:
        proto = to_onnx(
            flat,
            [v.shape for _, v in pairs] + [x_spec],
            enable_double_precision=dtype == np.float64,
            opset=opset,
            input_names=[*(n for n, _ in pairs), "x"],
            output_names=["logits"],
        )
    except Exception as exc:  # the exporter's own refusal (an unsupported primitive ...)
        raise BridgeError(f"jax2onnx.to_onnx failed: {type(exc).__name__}: {exc}") from exc
    return bytes(proto.SerializeToString())


def export(
    fn: Any, params: Any, example_input: Any, *, dynamic_batch: bool = True, opset: int = 21
) -> JaxModel:
    """`fn(params, x)` as an .onnx file whose variables are exactly the params' leaves
    (module docstring). Not yet checked against the service: `put_jax` does that."""
    jax = _jax()
    pairs, treedef = _named_leaves(jax, params)
    x = np.asarray(example_input)
    raw = raw_export(fn, params, x, dynamic_batch=dynamic_batch, opset=opset)
    model = from_export(raw, dict(pairs))
    model.treedef = treedef
    # What the service must answer on the example input: f's output, and the gradient
    # of sum(r * output) for a fixed random r.
    out = np.asarray(fn(params, x))
    r = (0.5 + np.random.default_rng(20261127).random(out.shape)).astype(out.dtype)
    grads = jax.grad(lambda p: (fn(p, x) * r).sum())(params)
    model.example_input = x
    model.expected = out
    model.probe_weight = r
    model.probe_gradients = {n: np.asarray(g) for n, g in _named_leaves(jax, grads)[0]}
    return model


def from_export(onnx_model: bytes, params: Mapping[str, np.ndarray]) -> JaxModel:
    """Map a jax2onnx export made with the params as inputs named by their paths (as
    `export` calls it) and then x: those inputs become initializers holding `params`
    (in flattening order), every other float initializer a Constant node."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_model_from_string(bytes(onnx_model))
    graph = proto.graph
    inputs = [i.name for i in graph.input]
    missing = [n for n in params if n not in inputs]
    if missing:
        raise BridgeError(
            f"the export has no input for params {missing}: export with the params as "
            "inputs named by their paths (jax_bridge.export does)"
        )
    others = [i for i in graph.input if i.name not in params]
    if len(others) != 1:
        raise BridgeError(f"the export takes {[i.name for i in others]} besides the params; one x")
    for name, value in params.items():
        declared = next(i for i in graph.input if i.name == name).type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(declared.elem_type)
        if dtype != np.asarray(value).dtype:
            raise BridgeError(
                f"param {name!r}: the export's input is {dtype}, the value "
                f"{np.asarray(value).dtype} (float64 needs jax_enable_x64 before export)"
            )
        shape = tuple(d.dim_value for d in declared.shape.dim)
        if shape != np.shape(value):
            raise BridgeError(
                f"param {name!r}: the export's input is {shape}, the value {np.shape(value)}"
            )
    # Exporter constants: frozen, whoever uses the file.
    frozen = [
        init
        for init in graph.initializer
        if numpy_helper.to_array(init).dtype.kind == "f" and init.name not in params
    ]
    frozen_names = {init.name for init in frozen}
    # Integer initializers (shapes, axes) stay: the service never differentiates them.
    kept = [init for init in graph.initializer if init.name not in frozen_names]
    constants = [_constant(init.name, numpy_helper.to_array(init)) for init in frozen]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(
        numpy_helper.from_array(np.asarray(value), name) for name, value in params.items()
    )
    nodes = [*constants, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    x = others[0]
    del graph.input[:]
    graph.input.extend([x])
    del graph.value_info[:]
    values = [np.asarray(v) for v in params.values()]
    return JaxModel(
        onnx=proto.SerializeToString(),
        names=list(params),
        shapes=[v.shape for v in values],
        dtype=values[0].dtype if values else np.dtype(np.float32),
        input=x.name,
        output=graph.output[0].name,
        constants=len(constants),
    )


# ------------------------------------------------------------------- verification


def _verify_op(client: ApiMethods, model: JaxModel) -> Any:
    from . import _core

    if model.example_input is None or model.expected is None or model.probe_weight is None:
        raise BridgeError("only a model made by jax_bridge.export can be verified")
    definition = {
        "models": {"net": model.model_spec()},
        "inputs": {model.input: model.example_input, "probe_weight": model.probe_weight},
        "program": [
            f"{model.output} = net({model.input})",
            f"probed = {model.output} * probe_weight",
        ],
    }
    body = _core.compute_body(definition, "probed", None, None)
    answer = yield from client._core.call("POST", "/v1/gradient", body, definition=definition)
    ok, why = _close(np.asarray(answer["value"]) / model.probe_weight, model.expected, model.dtype)
    if not ok:
        raise ExportMismatch(
            f"the service's forward differs from JAX's on the example input: {why}"
        )
    grads = answer["gradients"] or {}
    want = model.probe_gradients
    scale = max((float(np.abs(g).max()) for g in want.values() if g.size), default=0.0)
    for name in model.names:
        got = grads.get(name, np.zeros_like(want[name]))
        ok, why = _close(got, want[name], model.dtype, scale)
        if not ok:
            raise ExportMismatch(
                f"the service's gradient for {name!r} differs from JAX's on the example input: {why}"
            )
    model.verified = True
    return model


def verify(client: ApiMethods, model: JaxModel) -> JaxModel:
    """Check the service's forward and gradient on the example input against JAX's."""
    return client._run(_verify_op(client, model))


def put_jax(
    client: ApiMethods, name: str, fn: Any, params: Any, example_input: Any, **options: Any
) -> JaxModel:
    """Export, store under `name` (PUT /v1/models/{name}) and verify the stored model (a
    mismatch deletes it again and raises), as `client.models.put_jax`."""
    from .models import Models

    model = export(fn, params, example_input, **options)
    Models(client).put_onnx(name, model.onnx)
    model.stored = name
    try:
        verify(client, model)
    except BridgeError:
        Models(client).delete(name)
        raise
    return model


__all__ = ["TOLERANCE", "JaxModel", "export", "from_export", "put_jax", "raw_export", "verify"]
