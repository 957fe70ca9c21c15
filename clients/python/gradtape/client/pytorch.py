"""The PyTorch bridge (`pip install 'gradtape-client[torch]'`): an `nn.Module` to the
service with every parameter kept as itself, and answers keyed and shaped like the module.

    with Client(url) as client:
        with client.tape(model, loss="cross_entropy", data=(X, y)) as tape:
            top = tape.eigenvalues(k=3)                  # the Hessian over every parameter
            grads = tape.gradients                       # {torch name: array}, in
                                                         # named_parameters() order

    net = client.models.put_torch("resnet", model, X[:8])   # stored (any batch size)
    tape = client.tape(net, loss="mse", data=(X, Y))

How a module gets there (`export`):
- Exported by `torch.onnx.export(dynamo=True, optimize=False)`: the exporter's
  optimizer is what folds eval-mode BatchNorm into convolution weights, drops all-zero
  biases and merges equal-valued weights; without it every parameter stays an
  initializer of its own. (The TorchScript exporter's constant folding, on by default,
  folds BatchNorm too.) The batch axis (axis 0 of every input) is dynamic, so one
  stored model serves any batch size.
- Every floating-point initializer is matched to `named_parameters()` and
  `named_buffers()` BY VALUE (the initializer's name only breaks ties between equal
  values): a parameter becomes a variable under its torch name and its torch value; an
  initializer holding a parameter's transpose (a known rewrite) reads the parameter
  through a Transpose node, and one holding a copy through an Identity node, so the
  gradient lands on the parameter. Buffers (BatchNorm's running statistics) and the
  exporter's constants become Constant nodes: never trainable, whoever uses the file.
- A parameter the forward uses but no initializer holds (folded, fused, merged with an
  equal-valued one, or dropped) is refused with a `BridgeError` naming it and what
  happened. A parameter the forward does not use has a zero gradient.
- Then verified on the service: its forward on the example inputs must equal the
  module's, and its gradient of sum(r * output) (r fixed, random) must equal torch's for
  every parameter; a mismatch is an `ExportMismatch` naming the first output or
  parameter that differs. Tolerances: |service - torch| <= rtol * |torch| + atol * scale,
  scale the largest |torch| of that output or gradient, with rtol = atol = 1e-9 in
  float64 and 1e-4 in float32 (float16/bfloat16 modules are not bridged).

The flat parameter vector (`tape.vector`, `tape.unflatten`, `tape.size`) is the
trainable parameters in `named_parameters()` order, each raveled: the order of
`torch.nn.utils.parameters_to_vector(p for p in model.parameters() if p.requires_grad)`.
Every per-parameter answer of a TorchTape is over that layout (zeros for a parameter
the loss does not use), as a dict by torch name or, where the call passed a flat vector,
a flat vector; in the dtype of the vector passed (else the module's), as NumPy arrays or
`torch.Tensor`s where the call passed tensors (`data` or a vector); see `TorchTape`.
`tape.state_dict(v)` turns a flat vector or a dict into tensors that
`model.load_state_dict(..., strict=False)` takes. A built-in loss reads the module's
only output, or the one named by `output=` (several outputs without it: a BridgeError).

Training mode: a module with BatchNorm, Dropout or another layer that behaves
differently while training must be in eval mode (`model.eval()`), or the bridge refuses
it; curvature in training mode (batch statistics, random masks) is not what the service
computes. Only `Client` (not `AsyncClient`) takes modules.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import re
import secrets
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from .definition import dataset as dataset_input

if TYPE_CHECKING:
    from ._client import ApiMethods
    from .tape import RemoteTape

# Forward and gradient agreement on the example inputs, by the module's dtype.
TOLERANCE = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}
# Data at least this large goes up as a stored dataset (inputs bound to it by name).
UPLOAD_BYTES = 8 * 2**20
LOSSES = ("cross_entropy", "mse", "nll", "bce_with_logits")


class BridgeError(ValueError):
    """A module the bridge cannot bring to the service faithfully (a parameter the
    export changed, a training-mode module, an export the exporter refused)."""


class ExportMismatch(BridgeError):
    """The service's forward or gradient on the example inputs differs from torch's."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ImportError(
            "the PyTorch bridge needs torch, onnx and onnxscript: "
            "pip install 'gradtape-client[torch]'"
        ) from exc
    return torch


def is_torch_module(obj: Any) -> bool:
    """An nn.Module, without importing torch when the caller has not."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


# --------------------------------------------------------------------------- export


@dataclass
class ParameterRecord:
    """Where one torch parameter is in the exported file."""

    name: str
    shape: tuple[int, ...]
    how: str  # "kept", "renamed from X", "transposed ...", "unused", "frozen"


@dataclass
class TorchModel:
    """A module as the service runs it: the .onnx file (initializers renamed to torch
    names; buffers and constants frozen as Constant nodes), its trainable parameters in
    `named_parameters()` order, and how each was found in the export. `stored`: the
    name it is stored under (`client.models.put_torch`), else None."""

    onnx: bytes
    inputs: list[str]
    outputs: list[str]
    parameters: list[ParameterRecord]
    buffers: list[str]
    constants: int
    dtype: np.dtype
    example_inputs: tuple[Any, ...] = field(repr=False)
    expected: list[np.ndarray] = field(repr=False)
    probe_weights: list[np.ndarray | None] = field(repr=False)
    probe_gradients: list[dict[str, np.ndarray]] = field(repr=False)
    state_digest: str = ""
    stored: str | None = None
    verified: bool = False
    # The clients (servers) that checked it: a cached export is checked once per client.
    checked_by: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet, repr=False)

    @property
    def trainable(self) -> list[str]:
        """The parameters the service differentiates, in named_parameters() order."""
        return [p.name for p in self.parameters if p.how not in ("unused", "frozen")]

    @property
    def unused(self) -> list[str]:
        """Parameters the forward does not read (their gradients are zeros)."""
        return [p.name for p in self.parameters if p.how == "unused"]

    def model_spec(self) -> dict[str, Any]:
        """The definition's `models` entry: the file, or the stored name."""
        return {"stored": self.stored} if self.stored else {"onnx": self.onnx}


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    torch = _torch()
    items = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise BridgeError(
                f"example_inputs[{i}] is a {type(item).__name__}; the bridge takes tensors "
                "(one, or a tuple of them, as the module's forward takes them)"
            )
    return tuple(items)


def _outputs(value: Any) -> list[Any]:
    torch = _torch()
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise BridgeError(
                f"the module's output {i} is a {type(item).__name__}; the bridge takes "
                "modules returning a tensor or a tuple of tensors"
            )
    return items


def _check_mode(module: Any) -> None:
    torch = _torch()
    mode_dependent = (
        torch.nn.modules.batchnorm._BatchNorm,
        torch.nn.modules.dropout._DropoutNd,
        torch.nn.modules.instancenorm._InstanceNorm,
        torch.nn.RNNBase,
        torch.nn.MultiheadAttention,
        torch.nn.TransformerEncoderLayer,
        # Spectral norm's power iteration runs (and updates its vectors, under no_grad)
        # only while training: the export would differentiate through it.
        torch.nn.utils.parametrizations._SpectralNorm,
    )
    # The hook-based version (torch.nn.utils.spectral_norm, the function, hides its module).
    old_spectral = importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm
    for name, sub in module.named_modules():
        hooked = any(isinstance(h, old_spectral) for h in sub._forward_pre_hooks.values())
        if sub.training and (isinstance(sub, mode_dependent) or hooked):
            raise BridgeError(
                f"{name or 'the module'} ({type(sub).__name__}) is in training mode, where it "
                "uses batch statistics or random masks; call model.eval() before bridging it "
                "(the service differentiates the deterministic eval-mode function)"
            )


def _state_digest(module: Any, args: tuple[Any, ...]) -> str:
    """What an export depends on: the values and shapes of the state (parameters,
    buffers, tensor attributes), which parameters require grad (a frozen one is a
    constant of the export, not a variable), and the inputs' shapes and dtypes (a cached
    export is reused only while they are unchanged, and the forward with them:
    _same_forward)."""
    h = hashlib.sha256()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(name.encode() + (b" trainable" if t.requires_grad else b" fixed"))
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for name, a in _tensor_attributes(module).items():  # constants of the export
        h.update(name.encode() + str(a.shape).encode() + str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    for a in args:
        h.update(str(tuple(a.shape[1:])).encode() + str(a.dtype).encode())
    return h.hexdigest()


_CACHE: weakref.WeakKeyDictionary[Any, TorchModel] = weakref.WeakKeyDictionary()


def export(
    module: Any,
    example_inputs: Any,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    opset: int | None = None,
    onnx_model: bytes | None = None,
) -> TorchModel:
    """The module as an .onnx file whose variables are exactly its parameters (see the
    module docstring). `onnx_model`: map a file you exported yourself instead (the same
    checks; a refusal says which parameter your export changed). Not yet verified
    against the service: `client.models.put_torch` and `client.tape` do that."""
    torch = _torch()
    import onnx

    _check_mode(module)
    args = _as_tuple(example_inputs)
    dtypes = {p.dtype for p in module.parameters()} or {torch.float32}
    if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.float64}:
        raise BridgeError(
            f"the module's parameters are {sorted(str(d) for d in dtypes)}; the bridge takes "
            "modules entirely in float32 or entirely in float64 (module.double())"
        )
    dtype = np.dtype(str(next(iter(dtypes))).removeprefix("torch."))
    for i, a in enumerate(args):  # torch would fail in the forward, without a name
        if a.is_floating_point() and a.dtype != next(iter(dtypes)):
            raise BridgeError(
                f"input {i} is {str(a.dtype).removeprefix('torch.')} and the module's "
                f"parameters are {dtype}; send the data in {dtype} (NumPy arrays are "
                "float64 by default: X.astype(np.float32)) or convert the module "
                "(module.double())"
            )
    names_in = list(
        input_names or (["x"] if len(args) == 1 else [f"x{i}" for i in range(len(args))])
    )
    if len(names_in) != len(args):
        raise BridgeError(f"{len(names_in)} input_names for {len(args)} example inputs")
    for name, p in module.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:  # the value matching below would call it folded (NaN != NaN)
            raise BridgeError(
                f"parameter {name!r} holds {bad} NaN or infinite value(s) (a diverged "
                "training?); the service differentiates finite parameters only"
            )
    try:
        with torch.no_grad():
            expected = _outputs(module(*args))
    except Exception as exc:  # a shape or dtype the module does not take, named
        shapes = ", ".join(f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}" for a in args)
        raise BridgeError(
            f"the module's forward failed on the data's first rows ({shapes}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    names_out = list(
        output_names
        or (["logits"] if len(expected) == 1 else [f"out{i}" for i in range(len(expected))])
    )
    if len(names_out) != len(expected):
        raise BridgeError(f"{len(names_out)} output_names for {len(expected)} outputs")
    if onnx_model is None:
        onnx_model = _run_exporter(module, args, names_in, names_out, dynamic_batch, opset)
    proto = onnx.load_model_from_string(bytes(onnx_model))
    params, used = _parameters(module, args)
    records, buffers, constants = _restore(proto, module, params, used)
    _fold_integer_constants(proto)
    _strip_debug_info(proto)
    # The exporter's intermediate shapes name the batch symbolically; the service infers
    # them anew for each batch size.
    del proto.graph.value_info[:]
    probe_weights, probe_grads = _probe(module, args, records)
    return TorchModel(
        onnx=proto.SerializeToString(),
        inputs=[i.name for i in proto.graph.input],
        outputs=[o.name for o in proto.graph.output],
        parameters=records,
        buffers=buffers,
        constants=constants,
        dtype=dtype,
        example_inputs=args,
        expected=[e.detach().cpu().numpy() for e in expected],
        probe_weights=probe_weights,
        probe_gradients=probe_grads,
        state_digest=_state_digest(module, args),
    )


def _run_exporter(
    module: Any,
    args: tuple[Any, ...],
    input_names: list[str],
    output_names: list[str],
    dynamic_batch: bool,
    opset: int | None,
) -> bytes:
    torch = _torch()
    dynamic = None
    if dynamic_batch:
        # AUTO: the batch axis stays dynamic unless the module fixes it (then the file
        # takes only the example's batch size, and says so in its input shapes).
        dynamic = tuple({0: torch.export.Dim.AUTO} if a.ndim else {} for a in args)
    options: dict[str, Any] = {}
    if opset is not None:
        options["opset_version"] = opset
    try:
        # The exporter prints progress and warns about optional packages (torchvision).
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                optimize=False,  # the optimizer folds, fuses, merges and drops parameters
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic,
                external_data=False,
                verbose=False,
                **options,
            )
    except Exception as exc:  # the exporter's own refusal (an untraceable forward ...)
        # torch.export colours its messages for a terminal: the escapes go.
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
        raise BridgeError(f"torch.onnx.export failed: {type(exc).__name__}: {message}") from exc
    return program.model_proto.SerializeToString()


def _parameters(module: Any, args: tuple[Any, ...]) -> tuple[list[tuple[str, Any]], set[str]]:
    """named_parameters() (ties once, under their first name) and the names the
    forward reads (a gradient of every float output reaches them)."""
    torch = _torch()
    params = list(module.named_parameters())
    trainable = [(n, p) for n, p in params if p.requires_grad]
    with torch.enable_grad():
        outs = [o for o in _outputs(module(*args)) if o.is_floating_point() and o.requires_grad]
        grads: Sequence[Any] = [None] * len(trainable)
        if outs and trainable:
            total = sum((o * o).sum() for o in outs)  # o*o: a zero mean cannot hide a use
            grads = torch.autograd.grad(
                total, [p for _, p in trainable], allow_unused=True, materialize_grads=False
            )
    used = {n for (n, _), g in zip(trainable, grads) if g is not None}
    return params, used


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _graph_names(graph: Any) -> set[str]:
    out = {i.name for i in graph.input} | {o.name for o in graph.output}
    for node in graph.node:
        out.update(node.output)
    return out


def _restore(
    proto: Any, module: Any, params: list[tuple[str, Any]], used: set[str]
) -> tuple[list[ParameterRecord], list[str], int]:
    """Match every float initializer to a parameter or buffer by value and rewrite the
    graph so that the variables are exactly the trainable parameters (module docstring).
    Answers the parameter records, the buffers found, and the count of constants."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    trainable = {n: _np(p) for n, p in params if p.requires_grad}
    frozen_params = {n: _np(p) for n, p in params if not p.requires_grad}
    buffers = {n: _np(b) for n, b in module.named_buffers()}
    inits = list(graph.initializer)
    arrays = {i.name: numpy_helper.to_array(i) for i in inits}
    floats = [i.name for i in inits if arrays[i.name].dtype.kind == "f"]

    def distinct(a: np.ndarray) -> bool:
        # All-equal values (zeros, ones) cannot tell a parameter from a constant.
        return a.size > 1 and not np.all(a == a.reshape(-1)[0])

    # Tensors the module holds as plain attributes: the exporter lifts them to
    # initializers under their attribute path. A constant, whatever values it holds (a
    # copy of the initial weights for a penalty towards them is not the weight).
    attributes = _tensor_attributes(module)

    # initializer -> (torch name, "param" | "buffer", rewrite: "", "transpose")
    role: dict[str, tuple[str, str, str]] = {}
    # initializer -> the (torch name, rewrite)s its values fit: more than one, no guess.
    ambiguous: dict[str, list[tuple[str, str]]] = {}
    for iname in floats:
        a = arrays[iname]
        if iname in trainable and _same(a, trainable[iname]):
            role[iname] = (iname, "param", "")
            continue
        if iname in buffers and _same(a, buffers[iname]):
            role[iname] = (iname, "buffer", "")
            continue
        if iname in frozen_params and _same(a, frozen_params[iname]):
            role[iname] = (iname, "buffer", "")
            continue
        if iname in attributes and _same(a, attributes[iname]):
            continue  # a constant under its own name
        if not distinct(a):
            continue  # a constant
        fits = [(n, "") for n, p in trainable.items() if _same(a, p)]
        if len(fits) > 1:
            continue  # equal-valued parameters: the uncovered ones are refused below
        if a.ndim == 2:  # a transpose is a known rewrite (the optimizer's Linear weights)
            fits += [
                (n, "transpose") for n, p in trainable.items() if p.ndim == 2 and _same(a, p.T)
            ]
        if len(fits) == 1:
            role[iname] = (fits[0][0], "param", fits[0][1])
            continue
        if fits:  # a symmetric weight, or one parameter the transpose of another
            ambiguous[iname] = fits
            continue
        held = [n for n, b in {**buffers, **frozen_params}.items() if _same(a, b)]
        if len(held) == 1:
            role[iname] = (held[0], "buffer", "")

    covered: dict[str, list[tuple[str, str]]] = {}
    for iname, (tname, kind, rewrite) in role.items():
        if kind == "param":
            covered.setdefault(tname, []).append((iname, rewrite))

    problems = []
    for iname, fits in ambiguous.items():
        # Either reading gives the forward's values; only one gives the parameter's
        # gradient, and nothing in the file says which.
        what = " and ".join(f"{n!r}" + (" transposed" if r else "") for n, r in fits)
        problems.append(
            f"{fits[0][0]}: the export's initializer {iname!r} holds the values of {what}, "
            "so which one it is is ambiguous (a symmetric weight, or a parameter equal to "
            "another's transpose); let the bridge export (parameters keep their names)"
        )
    for tname, value in trainable.items():
        if tname in covered or tname not in used:
            continue
        if any(tname == n for fits in ambiguous.values() for n, _ in fits):
            continue  # said above
        problems.append(f"{tname}: {_what_happened(tname, value, arrays, covered, trainable)}")
    if problems:
        raise BridgeError(
            "the export changed parameters it cannot give back, so its gradients would not "
            "be theirs: " + "; ".join(problems)
        )

    taken = _graph_names(graph) - set(arrays)
    clash = [n for n in list(trainable) + list(buffers) if n in taken]
    if clash:
        raise BridgeError(
            f"the export has values named like the module's parameters or buffers ({clash[0]!r}) "
            "that are not them; rename the module's attribute or the export's values"
        )

    new_inits = []
    front = []  # nodes reading the parameters, before every other node
    records = []
    for tname, p in trainable.items():
        if tname not in covered:
            records.append(ParameterRecord(tname, p.shape, "unused"))
            continue
        new_inits.append(numpy_helper.from_array(p, tname))
        hows = []
        for iname, rewrite in covered[tname]:
            if rewrite == "transpose":
                front.append(helper.make_node("Transpose", [tname], [iname], perm=[1, 0]))
                hows.append(f"transposed in the export as {iname} (read through a Transpose)")
            elif iname != tname:
                front.append(helper.make_node("Identity", [tname], [iname]))
                hows.append(f"renamed from {iname}")
            else:
                hows.append("kept")
        records.append(ParameterRecord(tname, p.shape, "; ".join(hows)))
    for tname, p in frozen_params.items():
        records.append(ParameterRecord(tname, p.shape, "frozen"))
    # Buffers and constants: Constant nodes, so that no user of the file trains them.
    buffers_found: list[str] = []
    constants = 0
    for iname in floats:
        if iname in role and role[iname][1] == "param":
            continue
        if iname in role:
            tname = role[iname][0]
            buffers_found.append(tname)
            value = {**buffers, **frozen_params}[tname]
            if tname != iname:
                front.append(helper.make_node("Identity", [tname], [iname]))
            if tname not in {n.output[0] for n in front if n.op_type == "Constant"}:
                front.append(_constant(tname, value))
        else:
            constants += 1
            front.append(_constant(iname, arrays[iname]))
    keep = [i for i in inits if i.name not in floats]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    # Initializers listed as graph inputs (keep_initializers_as_inputs): not inputs.
    leaving = set(floats)
    kept_inputs = [i for i in graph.input if i.name not in leaving]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    nodes = list(graph.node)
    # Constants first, then the Identity/Transpose nodes that read them.
    front.sort(key=lambda n: n.op_type != "Constant")
    del graph.node[:]
    graph.node.extend(front + nodes)
    return records, buffers_found, constants


# Ops whose result is random: never evaluated ahead.
_RANDOM = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip


def _fold_integer_constants(proto: Any) -> int:
    """Evaluate the nodes that compute integers (shapes, axes, indices) from constants
    alone and keep their values as Constant nodes: ONNX shape inference cannot see
    through a Reshape of constant axes (the exporter writes ReduceMean's axes so), and
    would leave the batch axis of the output unknown. Float values are never folded, so
    no parameter, buffer or constant the gradient passes through changes."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    known = {
        i.name: numpy_helper.to_array(i)
        for i in graph.initializer
        if numpy_helper.to_array(i).dtype.kind in "iub"
    }
    nodes, folded = [], 0
    for node in graph.node:
        ins = [n for n in node.input if n]
        static = (
            node.domain in ("", "ai.onnx")
            and node.op_type not in _RANDOM
            and all(n in known for n in ins)
            and not any(a.type in (5, 10) for a in node.attribute)  # no subgraphs
        )
        if static:
            try:
                values = ReferenceEvaluator(node, opsets={"": opset}).run(
                    None, {n: known[n] for n in ins}
                )
            except Exception:  # noqa: BLE001 - left for the service to run (or refuse)
                values = None
            if values is not None and all(np.asarray(v).dtype.kind in "iub" for v in values):
                for name, v in zip(node.output, values):
                    known[name] = np.asarray(v)
                    if node.op_type != "Constant":
                        nodes.append(_constant(name, np.asarray(v)))
                if node.op_type == "Constant":
                    nodes.append(node)
                else:
                    folded += 1
                continue
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def _strip_debug_info(proto: Any) -> None:
    """The exporter's per-node metadata and doc strings (stack traces, FX names): not
    part of the model, and most of a small file's bytes."""
    graph = proto.graph
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for value in (*graph.input, *graph.output):
        del value.metadata_props[:]
        value.doc_string = ""
    for init in graph.initializer:
        del init.metadata_props[:]
    del graph.metadata_props[:]


def _tensor_attributes(module: Any) -> dict[str, np.ndarray]:
    """The plain tensors (neither parameters nor buffers) the module's submodules hold
    as attributes, by their path (`block.mask`): what the exporter lifts to constants."""
    torch = _torch()
    found = {}
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found[f"{prefix}.{key}" if prefix else key] = _np(value)
    return found


def _constant(name: str, value: np.ndarray) -> Any:
    from onnx import helper, numpy_helper

    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name)
    )


def _what_happened(
    tname: str,
    value: np.ndarray,
    arrays: Mapping[str, np.ndarray],
    covered: Mapping[str, Any],
    trainable: Mapping[str, np.ndarray],
) -> str:
    if tname in arrays and arrays[tname].shape == value.shape:
        return (
            f"the export's initializer {tname!r} holds other values (folded: e.g. a "
            "BatchNorm folded into this weight, or a constant-folding pass); export with "
            "torch.onnx.export(dynamo=True, optimize=False) or let the bridge export"
        )
    twins = [n for n, p in trainable.items() if n != tname and n in covered and _same(p, value)]
    if twins:
        return (
            f"merged with {twins[0]!r}: they hold equal values and the export kept one "
            "initializer for both (change one, or tie them in the module)"
        )
    if not value.size or np.all(value == value.reshape(-1)[0]):
        return (
            "its values are all equal, so no initializer can be told to be it by value "
            "(dropped, or indistinguishable from a constant); perturb it or keep its name "
            "in the export"
        )
    return (
        "no initializer holds its values or their transpose (dropped, fused into another "
        "value, or rewritten)"
    )


def _probe(
    module: Any, args: tuple[Any, ...], records: list[ParameterRecord]
) -> tuple[list[np.ndarray | None], list[dict[str, np.ndarray]]]:
    """Per output: r (a fixed random weight; None for an integer output) and torch's
    gradient of sum(r * output) over the trainable parameters, what the service must
    answer on the example inputs."""
    torch = _torch()
    named = dict(module.named_parameters())
    names = [r.name for r in records if r.how not in ("unused", "frozen")]
    gen = np.random.default_rng(20261127)
    weights: list[np.ndarray | None] = []
    gradients: list[dict[str, np.ndarray]] = []
    with torch.enable_grad():
        outs = _outputs(module(*args))
        for o in outs:
            if not o.is_floating_point():
                weights.append(None)
                gradients.append({})
                continue
            w = (0.5 + gen.random(tuple(o.shape))).astype(_np(o).dtype)
            grads: Sequence[Any] = [None] * len(names)
            if o.requires_grad and names:
                grads = torch.autograd.grad(
                    (o * torch.as_tensor(w)).sum(),
                    [named[n] for n in names],
                    allow_unused=True,
                    retain_graph=True,
                )
            weights.append(w)
            gradients.append(
                {
                    n: np.zeros(named[n].shape, _np(named[n]).dtype) if g is None else _np(g)
                    for n, g in zip(names, grads)
                }
            )
    return weights, gradients


# ------------------------------------------------------------------- verification


def _close(
    got: np.ndarray, want: np.ndarray, dtype: np.dtype, scale: float | None = None
) -> tuple[bool, str]:
    """Within the tolerance of `dtype`, relative and absolute (times `scale`: the
    largest finite |torch| of the output, or of the whole gradient, so that a parameter
    whose gradient is zero in exact arithmetic may hold rounding noise). Where torch has
    an infinity or NaN (masked logits) the service must have the same; the finite
    entries are compared as the rest."""
    tol = TOLERANCE[dtype]
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return False, f"shape {got.shape} where torch has {want.shape}"
    finite = np.isfinite(want)
    if scale is None:
        scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
    # Non-finite entries agree when they are the same (both NaN, or the same infinity).
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):  # inf - inf where torch is infinite: not read
        err = np.where(finite, np.abs(got - want), np.where(same, 0.0, np.inf))
    bound = np.where(finite, tol * np.abs(want) + tol * scale, 0.0)
    if np.all(err <= bound):
        return True, ""
    i = int(np.argmax(np.where(np.isnan(err), np.inf, err - bound)))
    return False, (
        f"differs at flat index {i}: service {got.reshape(-1)[i]!r}, torch "
        f"{want.reshape(-1)[i]!r} (tolerance {tol:g} relative, {tol:g} x {scale:.3g} absolute)"
    )


def _call_line(model: TorchModel, output: str) -> str:
    """The program line that computes one output of the model (a model with several
    outputs is called once per output it is asked for, by name)."""
    call = ", ".join(model.inputs)
    if len(model.outputs) == 1:
        return f"{output} = net({call})"
    return f"{output} = net({call}, output={output!r})"


def _verify_op(client: ApiMethods, model: TorchModel) -> Any:
    """One gradient request per float output on the example inputs: the value of
    r * output against torch's, then the gradient of its sum against torch's."""
    from . import _core

    for out, weight, expected, want in zip(
        model.outputs, model.probe_weights, model.expected, model.probe_gradients
    ):
        if weight is None:
            continue
        definition = {
            "models": {"net": model.model_spec()},
            "inputs": {
                **{n: _np(a) for n, a in zip(model.inputs, model.example_inputs)},
                "probe_weight": weight,
            },
            "program": [_call_line(model, out), f"probed = {out} * probe_weight"],
        }
        # Infinities where torch has them (masked logits) are compared here, not refused.
        body = _core.compute_body(definition, "probed", None, None, allow_nonfinite=True)
        answer = yield from client._core.call("POST", "/v1/gradient", body, definition=definition)
        ok, why = _close(np.asarray(answer["value"]) / weight, expected, model.dtype)
        if not ok:
            raise ExportMismatch(
                f"the service's forward differs from torch's on the example inputs: "
                f"output {out!r} {why}"
            )
        grads = answer["gradients"] or {}
        scale = max(
            (float(np.abs(g[np.isfinite(g)]).max()) for g in want.values() if np.isfinite(g).any()),
            default=0.0,
        )
        for name in model.trainable:
            got = grads.get(name)
            if got is None:  # unconnected on the service: right only where torch agrees
                if np.any(want[name]):
                    raise ExportMismatch(
                        f"the service finds output {out!r} independent of parameter "
                        f"{name!r}; in torch it is not"
                    )
                continue
            ok, why = _close(got, want[name], model.dtype, scale)
            if not ok:
                raise ExportMismatch(
                    f"the service's gradient of output {out!r} for parameter {name!r} "
                    f"differs from torch's on the example inputs: {why}"
                )
    model.verified = True
    model.checked_by.add(client)
    return model


def verify(client: ApiMethods, model: TorchModel) -> TorchModel:
    """Check the service's forward (and gradient) on the example inputs against torch."""
    return client._run(_verify_op(client, model))


def bridge(client: ApiMethods, module: Any, example_inputs: Any, **options: Any) -> TorchModel:
    """`export` then `verify` (cached per module while its state and input shapes stay
    the same)."""
    if isinstance(module, TorchModel):
        return module
    args = _as_tuple(example_inputs)
    cached = _CACHE.get(module)
    if (
        cached is not None
        and not options
        and cached.state_digest == _state_digest(module, args)
        and _same_forward(module, cached)
    ):
        if client not in cached.checked_by:  # the export is reused; each server checks it
            verify(client, cached)
        return cached
    model = export(module, args, **options)
    verify(client, model)
    if not options:
        _CACHE[module] = model
    return model


def _same_forward(module: Any, cached: TorchModel) -> bool:
    """Whether the module still computes what was exported: its outputs on the cached
    example inputs, bit for bit. The state digest sees parameters and buffers, not the
    code or plain attributes (an activation swapped, a temperature, a mask)."""
    torch = _torch()
    with torch.no_grad():
        try:
            now = _outputs(module(*cached.example_inputs))
        except Exception:  # noqa: BLE001 - it no longer takes them: export it anew
            return False
    return len(now) == len(cached.expected) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        for a, b in zip((_np(t) for t in now), cached.expected)
    )


def put_torch(
    client: ApiMethods,
    name: str,
    module: Any,
    example_inputs: Any,
    *,
    description: str | None = None,
    **options: Any,
) -> TorchModel:
    """Export, verify (the file sent inline), then store under `name` (PUT
    /v1/models/{name}): a module that fails the check is not stored, and a model stored
    before under that name is left as it was."""
    from .models import Models

    model = export(module, example_inputs, **options)
    verify(client, model)
    Models(client).put_onnx(name, model.onnx, description=description)
    model.stored = name
    return model


# ------------------------------------------------------------------------- tapes


def _loss_lines(
    loss: Any,
    logits: str,
    outputs: list[str],
    target: np.ndarray | None,
    out_shape: tuple[int, ...],
) -> tuple[list[str], dict[str, np.ndarray]]:
    """The program lines after the model's, and extra inputs they need: a built-in loss
    reads the output `logits`."""
    if isinstance(loss, (list, tuple)) or (isinstance(loss, str) and "=" in loss):
        from .definition import program_lines

        lines = program_lines(loss)
        if not lines or not lines[-1].split("=", 1)[0].strip() == "loss":
            raise BridgeError("a loss written as lines must assign `loss` on its last line")
        return lines, {}
    if loss not in LOSSES:
        raise BridgeError(
            f"loss must be one of {', '.join(LOSSES)}, or lines of the definition language "
            f"over {', '.join(outputs)} (the last assigning `loss`); got {loss!r}"
        )
    if target is None:
        raise BridgeError(f"loss {loss!r} needs targets: data=(inputs..., y)")
    if loss == "cross_entropy":
        axis = ", axis=1" if len(out_shape) > 2 else ""  # torch's class axis
        return [f"loss = softmax_cross_entropy({logits}, y{axis})"], {}
    if loss == "mse":
        return [f"loss = mean_squared_error({logits}, y)"], {}
    if loss == "bce_with_logits":
        return [f"loss = sigmoid_cross_entropy({logits}, y)"], {}
    # nll: the output holds log-probabilities over axis 1 (torch.nn.NLLLoss).
    if len(out_shape) != 2:
        raise BridgeError("loss 'nll' takes (N, C) log-probabilities; write other shapes as lines")
    return [f"loss = -mean(sum(y_one_hot * {logits}, axis=1))"], {}


@dataclass(frozen=True)
class _Form:
    """How the caller gave a per-parameter input, so that the answer comes back the same
    way: a flat vector or a dict, tensors or arrays, and each parameter's dtype."""

    flat: bool
    tensors: bool
    dtypes: dict[str, np.dtype]


def _replace(result: Any, **changes: Any) -> Any:
    """A frozen result with some fields changed, without running __post_init__ again
    (an unconverged result has warned once already)."""
    import copy

    out = copy.copy(result)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


class TorchTape:
    """A tape recorded from a module (`client.tape(module, loss=..., data=...)`).

    Every per-parameter answer is over `layout` (every parameter that requires grad, in
    named_parameters() order), with zeros where the loss does not use a parameter (its
    gradient and its curvature rows and columns are zero). Inputs (`v`, `b`, `vector`,
    `point`) are a dict by torch name or a flat vector in parameters_to_vector order
    (array or tensor); the answer comes back in the same form and in the caller's dtype
    (a float32 vector in, a float32 vector out), as `torch.Tensor`s when the input or
    the data were tensors. Answers without such an input are in the module's dtype.

    Methods, and which treatment each gets:
    - shaped like the module (explicit below): gradients, gradient, jacobian, hvp, hvp_many,
      eigenvalues (eigenvectors), diagonal, solve, influence (s_test; test data as
      tensors), kfac (vector and product), per_example, laplace (samples),
      linear_operator, fun / jac / hessp, update.
    - plain pass-throughs to the RemoteTape (`__getattr__`: no per-parameter tensor in
      or out): trace, frobenius_norm, spectral_density, info, call, id, target, bytes,
      ttl, expires_at, device, nonfinite.
    - sources, shapes and flatten of the RemoteTape are over the parameters the loss
      uses, in the service's keys: `tape.remote.sources`, ... (not passed through).
    """

    # The RemoteTape's attributes that carry no per-parameter tensor, passed through.
    _PASS_THROUGH = frozenset(
        {
            "trace",
            "frobenius_norm",
            "spectral_density",
            "info",
            "call",
            "id",
            "target",
            "bytes",
            "ttl",
            "expires_at",
            "device",
            "nonfinite",
        }
    )

    def __init__(
        self,
        remote: RemoteTape,
        model: TorchModel,
        tensors: bool,
        loss: Any = None,
        output: str | None = None,
    ) -> None:
        self.remote = remote
        self.model = model
        self.loss = loss  # as given to client.tape: influence converts test targets alike
        self.output = output  # the module output the loss and curvature read
        self._tensors = tensors

    # structure -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The parameters the service differentiates, in named_parameters() order."""
        return self.model.trainable

    @property
    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter that requires grad, in named_parameters() order, with its
        shape: the order of flat vectors (unused ones included, as zeros)."""
        return [(p.name, p.shape) for p in self.model.parameters if p.how != "frozen"]

    @property
    def size(self) -> int:
        """The length of a flat vector: parameters_to_vector over `layout`."""
        return sum(int(np.prod(shape, dtype=np.int64)) for _, shape in self.layout)

    def _kept(self) -> np.ndarray:
        """The positions in a flat vector of the parameters the loss uses (the tape's
        sources, flattened in the same order)."""
        used, parts, start = set(self.names), [], 0
        for n, shape in self.layout:
            size = int(np.prod(shape, dtype=np.int64))
            if n in used:
                parts.append(np.arange(start, start + size))
            start += size
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _default_form(self) -> _Form:
        return _Form(False, self._tensors, {n: self.model.dtype for n, _ in self.layout})

    def _form(self, v: Any, partial: bool = False) -> tuple[dict[str, np.ndarray], _Form]:
        """A dict by torch name or a flat vector (array or tensor) -> a dict of arrays
        over `layout` (zeros for unused parameters left out), and its form. `partial`: a
        dict may leave out parameters the loss uses too (zeros there: the caller reads
        only the names it gave)."""
        torch = _torch()

        def dtype_of(a: np.ndarray) -> np.dtype:
            return a.dtype if a.dtype.kind == "f" else self.model.dtype

        tensors = False
        if isinstance(v, torch.Tensor):
            v, tensors = _np(v), True
        if isinstance(v, Mapping):
            out: dict[str, np.ndarray] = {}
            for k, x in v.items():
                if isinstance(x, torch.Tensor):
                    x, tensors = _np(x), True
                out[k] = np.asarray(x)
            shapes = dict(self.layout)
            unknown = [k for k in out if k not in shapes]
            if unknown:
                raise ValueError(
                    f"the vector has an entry {unknown[0]!r}, which is not a parameter "
                    f"that requires grad (they are {', '.join(shapes)})"
                )
            missing = [n for n in self.names if n not in out]
            if missing and not partial:
                raise ValueError(f"the vector has no entry for parameter {missing[0]!r}")
            for k, a in out.items():
                if a.shape != shapes[k]:
                    raise ValueError(
                        f"the vector's entry {k!r} has shape {a.shape}; the parameter's is "
                        f"{shapes[k]}"
                    )
            dtypes = {n: dtype_of(out[n]) if n in out else self.model.dtype for n in shapes}
            full = {n: out.get(n, np.zeros(s, self.model.dtype)) for n, s in self.layout}
            return full, _Form(False, tensors, dtypes)
        if isinstance(v, torch.nn.Module) or (
            isinstance(v, (list, tuple)) and any(np.ndim(x) > 0 for x in v)
        ):
            # torch's habits (a module after optimizer.step(), the tuple
            # torch.autograd.grad answers): named, not guessed from an order.
            what = "a module" if isinstance(v, torch.nn.Module) else f"a {type(v).__name__}"
            raise TypeError(
                f"a vector is a dict by torch name or a flat vector, not {what}: pass "
                "dict(zip(tape.names, tensors)), {n: p for n, p in model.named_parameters()"
                " if p.requires_grad}, or parameters_to_vector(tensors)"
            )
        flat = np.asarray(v)
        if sum(d > 1 for d in flat.shape) > 1:  # (n,), (n, 1), (1, n) are one vector
            raise ValueError(
                f"a flat vector is 1-D; got shape {flat.shape}: hvp_many takes several "
                "vectors, and linear_operator() @ block multiplies a block of columns"
            )
        flat = flat.reshape(-1)
        if flat.size != self.size:
            raise ValueError(
                f"a flat vector over this module has {self.size} entries "
                f"(parameters_to_vector order), got {flat.size}"
            )
        arrays, start = {}, 0
        for n, shape in self.layout:
            size = int(np.prod(shape, dtype=np.int64))
            arrays[n] = flat[start : start + size].reshape(shape)
            start += size
        return arrays, _Form(True, tensors, {n: dtype_of(flat) for n, _ in self.layout})

    def _give(
        self,
        answer: Mapping[str, Any],
        form: _Form,
        unused: Mapping[str, np.ndarray] | None = None,
    ) -> Any:
        """An answer over `names` -> over `layout` in the caller's form: `unused` the
        entries of the parameters the loss does not use (default zeros)."""
        full: dict[str, np.ndarray] = {}
        for n, shape in self.layout:
            # (None: a parameter the target does not reach, e.g. one feeding only another
            # of the module's outputs, answered under unconnected="none")
            if answer.get(n) is not None:
                a = np.asarray(answer[n])
            elif unused is not None:
                a = np.asarray(unused[n])
            else:
                a = np.zeros(shape, self.model.dtype)
            full[n] = a.astype(form.dtypes.get(n, self.model.dtype), copy=False)
        torch = _torch() if form.tensors else None
        if form.flat:
            dtype = np.result_type(*full.values()) if full else self.model.dtype
            flat = np.concatenate(
                [a.reshape(-1) for a in full.values()] or [np.zeros(0, dtype)]
            ).astype(dtype, copy=False)
            return torch.from_numpy(np.array(flat)) if torch else flat
        if torch:
            return {n: torch.from_numpy(np.array(a)) for n, a in full.items()}
        return full

    def _to_service(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The entries the tape has (the parameters the loss uses)."""
        return {n: arrays[n] for n in self.names}

    def vector(self, values: Any) -> Any:
        """A dict by torch name (arrays or tensors) -> one flat vector in
        parameters_to_vector order, in the entries' dtype (a tensor if the dict held
        tensors)."""
        arrays, form = self._form(values)
        if not form.flat:  # the entries given decide the dtype, not the zeros filled in
            given = [form.dtypes[n] for n in values if n in form.dtypes]
            common = np.dtype(np.result_type(*given)) if given else self.model.dtype
            form = _Form(True, form.tensors, dict.fromkeys(form.dtypes, common))
        return self._give(arrays, form)

    def unflatten(self, x: Any) -> Any:
        """A flat vector -> {torch name: array or tensor} shaped like the parameters."""
        arrays, form = self._form(x)
        return self._give(arrays, _Form(False, form.tensors, form.dtypes))

    def state_dict(self, values: Any) -> dict[str, Any]:
        """A flat vector or a dict by torch name -> {torch name: torch.Tensor} in the
        parameters' dtype, for `model.load_state_dict(sd, strict=False)` (an
        eigenvector, an influence direction, a Newton step)."""
        arrays, _ = self._form(values)
        form = _Form(False, True, {n: self.model.dtype for n, _ in self.layout})
        return dict(self._give(arrays, form))

    # answers --------------------------------------------------------------------
    @property
    def value(self) -> float:
        return float(self.remote.value)

    @property
    def gradients(self) -> Any:
        """{torch name: gradient} at the recorded point (zeros for unused parameters)."""
        return self._give(self.remote.gradients, self._default_form())

    def gradient(self, **options: Any) -> Any:
        """`RemoteTape.gradient` of the tape's loss over every parameter (a Gradient
        whose `gradients` are shaped like the module; `flat=True`: a flat vector in
        parameters_to_vector order). Other targets or sources: `tape.remote.gradient`."""
        flat = bool(options.pop("flat", False))
        if options.get("target") is not None or options.get("sources") is not None:
            raise TypeError(
                "tape.gradient is over the module's parameters; for other targets or "
                "sources use tape.remote.gradient(...)"
            )
        result = self.remote.gradient(**options)
        form = self._default_form()
        if flat:
            form = _Form(True, form.tensors, form.dtypes)
        return _replace(result, gradients=self._give(result.gradients, form), order=None)

    def jacobian(self, target: str | None = None, *, flat: bool = False, **options: Any) -> Any:
        """`RemoteTape.jacobian` of `target` (default the loss; e.g. the module's output
        line, `tape.output`) over every parameter: `jacobians` by torch name, each
        target.shape + parameter shape (zeros for unused parameters), or with
        `flat=True` one float64 matrix [target size, size] whose columns are in
        parameters_to_vector order. Other sources: `tape.remote.jacobian`."""
        if options.get("sources") is not None or (flat and options.get("batch")):
            raise TypeError(
                "tape.jacobian is over the module's parameters (flat: not per example); "
                "for other sources use tape.remote.jacobian(...)"
            )
        if flat:
            result = self.remote.jacobian(target, flat=True, **options)
            matrix = np.asarray(result.jacobians, np.float64)
            full = np.zeros((matrix.shape[0], self.size))
            full[:, self._kept()] = matrix
            answer = _torch().from_numpy(full) if self._tensors else full
            return _replace(result, jacobians=answer, order=None)
        result = self.remote.jacobian(target, **options)
        used = {n: np.asarray(a) for n, a in result.jacobians.items() if a is not None}
        shapes = dict(self.layout)
        first = next(iter(used), None)
        lead = () if first is None else used[first].shape[: used[first].ndim - len(shapes[first])]
        zeros = {n: np.zeros((*lead, *s), self.model.dtype) for n, s in self.layout}
        return _replace(result, jacobians=self._give(used, self._default_form(), unused=zeros))

    def hvp(self, v: Any, **options: Any) -> Any:
        """H v (or another curvature's product: `curvature="ggn"`, ...); `v` a dict by
        torch name or a flat vector; the answer in the same form and dtype."""
        arrays, form = self._form(v)
        return self._give(self.remote.hvp(self._to_service(arrays), **options), form)

    def hvp_many(self, vectors: Sequence[Any], **options: Any) -> list[Any]:
        """[H v_i] in one batched request, each answer in its vector's form."""
        parsed = [self._form(v) for v in vectors]
        answers = self.remote.hvp_many([self._to_service(a) for a, _ in parsed], **options)
        return [self._give(h, form) for h, (_, form) in zip(answers, parsed, strict=True)]

    def eigenvalues(self, k: int = 1, **options: Any) -> Any:
        """`RemoteTape.eigenvalues`; with `eigenvectors=True` each eigenvector is a dict
        by torch name (`tape.state_dict(vec)` makes it loadable)."""
        result = self.remote.eigenvalues(k, **options)
        if result.eigenvectors:
            form = self._default_form()
            result = _replace(
                result, eigenvectors=[self._give(v, form) for v in result.eigenvectors]
            )
        return result

    def diagonal(self, **options: Any) -> Any:
        """`RemoteTape.diagonal`, its `diagonal` and `stderr` by torch name (zeros for
        unused parameters). A partial exact run's `partial` stays flat over `names`."""
        result = self.remote.diagonal(**options)
        form = self._default_form()
        return _replace(
            result,
            diagonal=None if result.diagonal is None else self._give(result.diagonal, form),
            stderr=None if result.stderr is None else self._give(result.stderr, form),
        )

    def solve(self, b: Any = None, *, damping: float | None = None, **options: Any) -> Any:
        """`RemoteTape.solve`: x of (H + damping I) x = b, `b` a dict by torch name or a
        flat vector (default the gradient: x the damped Newton step), x in b's form.
        Where the loss does not use a parameter H is zero, so x there is b / damping: a
        `b` nonzero there needs an explicit positive `damping`."""
        if b is None:
            result = self.remote.solve(damping=damping, **options)
            return _replace(result, solution=self._give(result.solution, self._default_form()))
        arrays, form = self._form(b)
        unused = {n: arrays[n] for n in self.model.unused if n in arrays}
        if any(a.any() for a in unused.values()) and not (damping and damping > 0):
            first = next(n for n, a in unused.items() if a.any())
            raise BridgeError(
                f"b is nonzero on {first!r}, a parameter the loss does not use (its Hessian "
                "rows are zero, so x there is b / damping): give damping= (> 0) explicitly"
            )
        result = self.remote.solve(self._to_service(arrays), damping=damping, **options)
        scaled = {n: a / damping if damping else a for n, a in arrays.items()}
        return _replace(result, solution=self._give(result.solution, form, unused=scaled))

    def influence(self, test_inputs: Any = None, **options: Any) -> Any:
        """`RemoteTape.influence`: `test_inputs` as the tape's `data` was given, a tuple
        `(inputs..., y)` or a dict by the module's input names and "y" (arrays or
        tensors; the targets as the loss takes them, converted as for the data),
        `s_test` by torch name (zeros for unused parameters)."""
        if test_inputs is not None and not isinstance(test_inputs, Mapping):
            arrays, target, _ = _data_arrays(test_inputs, self.model, self.loss)
            test_inputs = arrays if target is None else {**arrays, "y": target}
        if test_inputs is not None and "dataset" not in test_inputs:
            test_inputs = self._test_inputs(test_inputs)
        result = self.remote.influence(test_inputs, **options)
        return _replace(result, s_test=self._give(result.s_test, self._default_form()))

    def _test_inputs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        torch = _torch()
        out = {
            k: _np(v) if isinstance(v, torch.Tensor) else v for k, v in given.items() if k != "y"
        }
        if "y" in given:
            target = given["y"]
            target = _np(target) if isinstance(target, torch.Tensor) else np.asarray(target)
            rows = next((np.shape(v)[0] for v in out.values() if np.ndim(v)), len(target))
            index = (
                self.model.outputs.index(self.output) if self.output in self.model.outputs else 0
            )
            shape = (rows, *self.model.expected[index].shape[1:])
            out.update(_target_inputs(self.loss, target, self.model, shape))
        return out

    def kfac(self, vector: Any = None, **options: Any) -> Any:
        """`RemoteTape.kfac`: `vector` a dict by torch name or a flat vector, `product`
        in its form. Where the loss does not use a parameter the curvature is zero: the
        product there is zero, the inverse product vector / damping."""
        if vector is None:
            return self.remote.kfac(**options)
        arrays, form = self._form(vector)
        result = self.remote.kfac(self._to_service(arrays), **options)
        unused = {n: np.zeros_like(a) for n, a in arrays.items()}
        if options.get("inverse"):
            nonzero = [n for n in self.model.unused if n in arrays and arrays[n].any()]
            if nonzero and not result.damping > 0:
                raise BridgeError(
                    f"the vector is nonzero on {nonzero[0]!r}, a parameter the loss does "
                    "not use (zero curvature): its inverse product needs damping > 0"
                )
            unused = {n: a / result.damping if a.any() else a for n, a in arrays.items()}
        return _replace(result, product=self._give(result.product, form, unused=unused))

    def per_example(self, **options: Any) -> Any:
        """`RemoteTape.per_example`, its per-source statistics (and gradients, N first)
        by torch name, zeros for unused parameters."""
        result = self.remote.per_example(**options)
        form = self._default_form()
        n = result.examples
        norms_form = _Form(False, form.tensors, {k: np.dtype(np.float64) for k in form.dtypes})
        per_param = _Form(False, form.tensors, form.dtypes)
        changes: dict[str, Any] = {
            "norms_by_source": self._give(
                result.norms_by_source,
                norms_form,
                unused={k: np.zeros(n) for k, _ in self.layout},
            ),
            "mean": self._give(result.mean, form),
            "variance": self._give(result.variance, form),
            "sum_squares": self._give(result.sum_squares, form),
        }
        if result.gradients is not None:
            changes["gradients"] = self._give(
                result.gradients,
                per_param,
                unused={k: np.zeros((n, *s), self.model.dtype) for k, s in self.layout},
            )
        return _replace(result, **changes)

    def laplace(self, **options: Any) -> Any:
        """`RemoteTape.laplace`: the fit covers the parameters the loss uses (of its
        `subset`); `sample()` answers them by torch name, as tensors where the tape's
        data were tensors."""
        return _TorchLaplace(self.remote.laplace(**options), self)

    def linear_operator(self, **options: Any) -> Any:
        """The Hessian (or `curvature`) as a SciPy LinearOperator of shape (size, size),
        float64, over flat vectors in parameters_to_vector order (`layout`): the rows
        and columns of parameters the loss does not use are zero."""
        from scipy.sparse.linalg import LinearOperator

        remote = self.remote.linear_operator(**options)
        kept, size = self._kept(), self.size

        def matmat(x: np.ndarray) -> np.ndarray:
            x = np.asarray(x, dtype=np.float64).reshape(size, -1)
            out = np.zeros_like(x)
            out[kept] = remote.matmat(x[kept])
            return out

        def matvec(x: np.ndarray) -> np.ndarray:
            return matmat(x)[:, 0]

        return LinearOperator(
            (size, size),
            matvec=matvec,
            rmatvec=matvec,
            matmat=matmat,
            rmatmat=matmat,
            dtype=np.float64,
        )

    # SciPy's optimizers: flat float64 vectors in parameters_to_vector order.
    def _point(self, x: Any) -> np.ndarray:
        arrays, _ = self._form(x)
        return np.concatenate(
            [np.asarray(arrays[n], np.float64).reshape(-1) for n in self.names] or [np.zeros(0)]
        )

    def fun(self, x: Any) -> float:
        """The loss at the flat parameters x (re-recording the tape there if x moved)."""
        return self.remote.fun(self._point(x))

    def jac(self, x: Any) -> np.ndarray:
        """The gradient at x, flat (float64; zeros for unused parameters)."""
        grad = self.remote.jac(self._point(x))
        out = np.zeros(self.size)
        out[self._kept()] = grad
        return out

    def hessp(self, x: Any, p: Any) -> np.ndarray:
        """H(x) p, flat (float64)."""
        kept = self._kept()
        hp = self.remote.hessp(self._point(x), np.asarray(p, np.float64).reshape(-1)[kept])
        out = np.zeros(self.size)
        out[kept] = hp
        return out

    def update(
        self,
        values: Any = None,
        /,
        *,
        point: Any = None,
        inputs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Self:
        """Record the tape again at new parameter values: a dict by torch name (the
        parameters it names change, the others keep their values) or a flat vector
        (`point`, in parameters_to_vector order), arrays or tensors of any float dtype
        (cast to the module's, as load_state_dict does: a SciPy optimizer's float64
        point updates a float32 module; unused parameters change nothing), and/or new
        `inputs` by the module's input names."""
        torch = _torch()
        if point is not None:
            if values is not None:
                raise TypeError("give a flat point or values by name, not both")
            values = point
        if inputs is not None and "dataset" not in inputs:
            inputs = {k: _np(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if values is None:
            self.remote.update(inputs=inputs, **options)
            return self
        arrays, _ = self._form(values, partial=True)
        given = values if isinstance(values, Mapping) else arrays  # a dict: its names only
        self.remote.update(
            {n: np.asarray(arrays[n], self.model.dtype) for n in self.names if n in given},
            inputs=inputs,
            **options,
        )
        return self

    def __getattr__(self, name: str) -> Any:
        if name in TorchTape._PASS_THROUGH:
            return getattr(self.remote, name)
        raise AttributeError(
            f"TorchTape has no {name!r}; the RemoteTape's (over the parameters the loss "
            f"uses, in the service's keys) is tape.remote.{name}"
        )

    def delete(self, **options: Any) -> Any:
        return self.remote.delete(**options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remote.__exit__(*exc)

    def __repr__(self) -> str:
        return f"TorchTape({self.remote!r}, {len(self.names)} parameters)"


class _TorchLaplace:
    """A RemoteLaplace whose samples come back by torch name (tensors where the tape's
    data were tensors); everything else is the RemoteLaplace's."""

    def __init__(self, remote: Any, tape: TorchTape) -> None:
        self.remote = remote
        self._tape = tape

    def sample(self, count: int = 10, **options: Any) -> Any:
        """`count` draws per parameter of the fit ((count, *shape) each), by torch name."""
        draws = self.remote.sample(count, **options)
        if not self._tape._tensors:
            return draws
        torch = _torch()
        return {n: torch.from_numpy(np.array(a, self._tape.model.dtype)) for n, a in draws.items()}

    def predictive(self, test_inputs: Mapping[str, Any], **options: Any) -> Any:
        """`RemoteLaplace.predictive`, the test inputs arrays or tensors."""
        torch = _torch()
        if "dataset" not in test_inputs:
            test_inputs = {
                k: _np(v) if isinstance(v, torch.Tensor) else v for k, v in test_inputs.items()
            }
        return self.remote.predictive(test_inputs, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.remote, name)

    def __repr__(self) -> str:
        return repr(self.remote)


def _data_arrays(
    data: Any, model: TorchModel, loss: Any
) -> tuple[dict[str, np.ndarray], np.ndarray | None, bool]:
    """The module's inputs by name, the target (None for a loss written as lines
    without one), and whether the caller passed tensors."""
    torch = _torch()
    tensors = False

    def arr(x: Any) -> np.ndarray:
        nonlocal tensors
        if isinstance(x, torch.Tensor):
            tensors = True
            return _np(x)
        return np.asarray(x)

    if isinstance(data, Mapping):
        arrays = {k: arr(v) for k, v in data.items()}
        target = arrays.pop("y", None)
        return arrays, target, tensors
    items = list(data) if isinstance(data, (tuple, list)) else [data]
    n = len(model.inputs)
    if len(items) not in (n, n + 1):
        raise BridgeError(
            f"data has {len(items)} arrays; the module takes {n} input(s)"
            + (", then the targets" if isinstance(loss, str) and loss in LOSSES else "")
        )
    arrays = {name: arr(x) for name, x in zip(model.inputs, items)}
    target = arr(items[n]) if len(items) > n else None
    return arrays, target, tensors


def tape_op(
    client: ApiMethods,
    module: Any,
    *,
    loss: Any,
    data: Any,
    example_inputs: Any = None,
    upload_above: int | None = None,
    **tape_options: Any,
) -> TorchTape:
    """`client.tape(module, loss=..., data=...)`: bridge the module (or take a
    TorchModel), write the loss over its output (`output=`: which one, required for a
    built-in loss on a module with several outputs) and record the tape with the
    trainable parameters as sources, in named_parameters() order."""
    if client.is_async:
        raise TypeError("the PyTorch bridge runs with Client, not AsyncClient")
    if data is None:
        raise BridgeError("client.tape(module, ...) needs data=(inputs..., targets)")
    torch = _torch()
    if isinstance(module, TorchModel):
        model = module
    else:
        if example_inputs is None:  # the first rows of the data are the example
            if isinstance(data, Mapping):
                raise BridgeError("with data as a dict, give example_inputs too")
            items = list(data) if isinstance(data, (tuple, list)) else [data]
            example_inputs = tuple(
                (x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x)))[:8]
                for x in items[: _forward_arity(module)]
            )
        model = bridge(client, module, example_inputs)
    arrays, target, tensors = _data_arrays(data, model, loss)
    output = tape_options.pop("output", None)
    head = _loss_output(loss, model, output)
    out_shape = (next(iter(arrays.values())).shape[0],) + tuple(
        model.expected[model.outputs.index(head)].shape[1:]
    )
    lines, extra = _loss_lines(loss, head, model.outputs, target, out_shape)
    inputs: dict[str, Any] = dict(arrays)
    if target is not None:
        inputs.update(_target_inputs(loss, target, model, out_shape))
    inputs.update(extra)
    limit = UPLOAD_BYTES if upload_above is None else upload_above
    uploaded = None
    if sum(a.nbytes for a in inputs.values()) >= limit:
        # A dataset of this recording's own (a name no other tape or client shares), bound
        # by the recording and deleted once it is recorded: the tape keeps the arrays it
        # was bound to (the store's blobs, which a rebuilt tape reads), so nothing stays
        # against the key's dataset quota after the tape.
        uploaded = f"torch-data-{secrets.token_hex(12)}"
        client.put_dataset(uploaded, inputs)
        inputs = {k: dataset_input(uploaded, k) for k in inputs}
    definition = {
        "models": {"net": model.model_spec()},
        "inputs": inputs,
        "program": [*(_call_line(model, o) for o in model.outputs), *lines],
    }
    # The curvatures (GGN, Fisher, KFAC, Laplace) read the loss as a function of
    # `output`: never guessed for lines over several outputs (out0 was taken, and the
    # GGN of a loss over out0 and out1 silently left out1's term; a loss over out1 only
    # was a 422 about out0, which the caller never named).
    if output is None and len(model.outputs) == 1:
        output = head
    try:
        remote = client.tape(
            definition, "loss", list(model.trainable), output=output, **tape_options
        )
    finally:
        if uploaded is not None:
            client.delete_dataset(uploaded)
    return TorchTape(remote, model, tensors, loss=loss, output=output)


def _loss_output(loss: Any, model: TorchModel, output: str | None) -> str:
    """The module output a built-in loss reads: `output=`, or the only one. With
    several outputs and no `output=`, taking the first would be a guess: refused."""
    if not (isinstance(loss, str) and loss in LOSSES):  # lines name their outputs
        return output if output in model.outputs else model.outputs[0]
    if output is None:
        if len(model.outputs) > 1:
            raise BridgeError(
                f"the module has {len(model.outputs)} outputs ({', '.join(model.outputs)}); "
                f"say which one loss {loss!r} reads with output=..., or write the loss as "
                "lines over them (the last assigning `loss`)"
            )
        return model.outputs[0]
    if output not in model.outputs:
        raise BridgeError(
            f"output={output!r} is not an output of the module; its outputs are "
            f"{', '.join(model.outputs)}"
        )
    return output


def _target_inputs(
    loss: Any, target: np.ndarray, model: TorchModel, out_shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """The targets as the loss lines read them: 'nll' labels as one-hot rows
    (`y_one_hot`), float targets in the module's dtype, integer labels as they are."""
    if loss == "nll":
        _check_class_labels(target, out_shape)
        one_hot = target.reshape(-1, 1) == np.arange(out_shape[1])
        return {"y_one_hot": one_hot.astype(model.dtype)}
    return {"y": target.astype(model.dtype) if target.dtype.kind == "f" else target}


def _check_class_labels(target: np.ndarray, out_shape: tuple[int, ...]) -> None:
    """'nll' labels become one-hot rows: one integer in [0, C) per example, or a label
    would silently be a zero row (torch raises for it; its ignore_index is not taken)."""
    n, classes = out_shape[0], out_shape[1]
    if target.dtype.kind not in "iu":
        raise BridgeError(
            f"loss 'nll' takes integer class labels; the targets are {target.dtype} "
            "(probabilities or one-hot rows: write the loss as lines)"
        )
    if target.shape != (n,):
        raise BridgeError(
            f"loss 'nll' takes one class label per example, shape ({n},); the targets have "
            f"shape {tuple(target.shape)}"
        )
    outside = (target < 0) | (target >= classes)
    if outside.any():
        i = int(np.argmax(outside))
        raise BridgeError(
            f"loss 'nll': label {int(target[i])} of example {i} is not a class of the "
            f"model's {classes} outputs (labels lie in [0, {classes}); torch's ignore_index "
            "is not supported: leave those examples out of the data)"
        )


def _forward_arity(module: Any) -> int:
    import inspect

    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return 1
    positional = [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return max(1, len(positional))
