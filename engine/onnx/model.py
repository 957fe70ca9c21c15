"""An ONNX model as an engine function.

    model = load_model(data)                    # check, list every unsupported node
    spec = model.specialize([((8, 1, 28, 28), np.float32)])   # per input shapes
    spec.outputs                                # [(shape, dtype)] from shape inference
    model.run(spec, [x], params)                # engine Tensors in, engine Tensors out

Loading checks the file (onnx.checker), reads the initializers (floating-point ones
become the model's parameters, the rest are constants) and refuses, all at once, every
node this runtime cannot run and every training-mode op. Specializing fixes the input
shapes, runs ONNX shape inference and folds every subgraph whose inputs are known at load
time (Shape -> Gather -> Concat -> Reshape, Constant, ConstantOfShape, Range, Cast ...)
with ONNX's reference evaluator: those values are NumPy constants, never differentiated.
What is left runs as engine ops (ops.py), so every derivative comes from their rules.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from engine.backend import host
from engine.onnx import recurrent  # noqa: F401 (registers LSTM, GRU and RNN in HANDLERS)
from engine.onnx.errors import ModelError, ModelProblem
from engine.onnx.external import external_data_problems
from engine.onnx.ops import FOLD_ONLY, HANDLERS, STATIC, refusal, run_node
from engine.tensor import Tensor, constant

DEFAULT_DOMAINS = ("", "ai.onnx")
# Ops with a random or stateful result: never folded.
NOT_FOLDABLE = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip
MAX_SPECIALIZATIONS = 16
# Rounds of folding and shape inference when shapes are computed from the inputs'.
MAX_SHAPE_ROUNDS = 4


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    proto: Any  # the NodeProto, for folding by the reference evaluator

    def problem(self, message: str, opset: int | None, kind: str = "op") -> ModelProblem:
        return ModelProblem(
            message,
            kind,
            self.name or f"#{self.index}",
            self.op_type,
            self.domain or "ai.onnx",
            opset,
        )


@dataclass(frozen=True)
class GraphInput:
    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]  # a size, a symbolic name, or unknown


@dataclass(frozen=True)
class Step:
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]


@dataclass
class Specialization:
    """The model for fixed input shapes: what runs, and the output types."""

    steps: list[Step]
    consts: dict[str, np.ndarray]
    outputs: list[tuple[tuple[int, ...], np.dtype]]
    intermediate_elements: int = 0
    folded: int = 0
    sizes: list[tuple[str, tuple[int, ...], np.dtype]] = field(default_factory=list)


class OnnxModel:
    def __init__(self, proto: Any, digest: str):
        from onnx import helper, numpy_helper

        self.proto = proto
        self.digest = digest
        graph = proto.graph
        self.opset = next((o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS), 1)
        self.params: dict[str, np.ndarray] = {}
        self.consts: dict[str, np.ndarray] = {}
        # A float initializer only ever read as a shape, pads, a pad value or a dropout
        # ratio is a constant, not a parameter.
        differentiable = {
            name
            for n in graph.node
            for i, name in enumerate(n.input)
            if i not in STATIC.get(n.op_type, ())
        }
        for init in graph.initializer:
            value = numpy_helper.to_array(init)
            if value.dtype.kind == "f" and init.name in differentiable:
                self.params[init.name] = np.array(value)  # writable, owned
            else:
                self.consts[init.name] = np.array(value)
        initialized = set(self.params) | set(self.consts)
        self.inputs = [_graph_input(v) for v in graph.input if v.name not in initialized]
        self.outputs = [v.name for v in graph.output]
        self.nodes = [
            Node(
                i,
                n.name,
                n.op_type,
                n.domain,
                tuple(n.input),
                tuple(n.output),
                {a.name: _attr(helper.get_attribute_value(a)) for a in n.attribute},
                n,
            )
            for i, n in enumerate(graph.node)
        ]
        self.frozen_by_default = self._frozen_by_default()
        self.structure = self._structure_hash()
        self._specs: OrderedDict[tuple, Specialization] = OrderedDict()
        self._lock = threading.Lock()

    def _frozen_by_default(self) -> dict[str, str]:
        """Parameters that no gradient reaches the outputs from, by why: BatchNorm's
        running statistics (inputs 3 and 4 in inference) and initializers read only by
        shape computations, comparisons, indices and dtype targets. They stay variables
        (a request may set them) but are not trainable unless the definition says so."""
        relevant = set(self.outputs)
        for node in reversed(self.nodes):  # ONNX graphs are topologically sorted
            if not any(n in relevant for n in node.outputs if n):
                continue
            for i, name in enumerate(node.inputs):
                if name and differentiable_input(node.op_type, i, node.attrs):
                    relevant.add(name)
        statistics = {
            n.inputs[i]
            for n in self.nodes
            if n.op_type == "BatchNormalization"
            for i in (3, 4)
            if i < len(n.inputs)
        }
        return {
            name: "a BatchNormalization running statistic"
            if name in statistics
            else "read only by shape computations, comparisons or indices"
            for name in self.params
            if name not in relevant
        }

    # Load-time checks -------------------------------------------------------------------
    def check(self) -> None:
        """Every node that cannot run and every training-mode op, at once."""
        problems: list[ModelProblem] = []
        static = set(self.consts)
        values = dict(self.consts)  # what is known without shapes (for training_mode)
        for node in self.nodes:
            ins = [n for n in node.inputs if n]
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
                value = _constant_value(node)
                if value is not None:
                    values[node.outputs[0]] = value
            is_static = (
                node.domain in DEFAULT_DOMAINS
                and node.op_type not in NOT_FOLDABLE
                and (node.op_type in ("Shape", "Size") or all(n in static for n in ins))
            )
            if is_static:
                static.update(n for n in node.outputs if n)
                continue
            if node.domain not in DEFAULT_DOMAINS:
                problems.append(
                    node.problem(
                        f"domain {node.domain!r} is not supported (only the default ONNX domain)",
                        self._opset(node.domain),
                    )
                )
            elif node.op_type not in HANDLERS or node.op_type in FOLD_ONLY:
                problems.append(
                    node.problem(
                        "not supported on computed values (only where its inputs are constants)"
                        if node.op_type in FOLD_ONLY
                        else "not supported",
                        self.opset,
                    )
                )
            elif (why := refusal(node.op_type, node.attrs, node.outputs)) is not None:
                problems.append(node.problem(why, self.opset))
            problems.extend(self._mode_problems(node, values))
        if problems:
            raise ModelError(problems)

    def _opset(self, domain: str) -> int | None:
        return next((o.version for o in self.proto.opset_import if o.domain == domain), None)

    def _mode_problems(self, node: Node, values: Mapping[str, np.ndarray]) -> list[ModelProblem]:
        """Training-mode ops run differently from inference: refused, never changed."""
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2]:
            mode = values.get(node.inputs[2])
            if mode is None:
                return [
                    node.problem(
                        "training_mode must be a constant false (inference); it is computed",
                        self.opset,
                        "mode",
                    )
                ]
            if bool(np.asarray(mode).reshape(-1)[0]):
                return [
                    node.problem(
                        "training_mode is true: dropout in training mode is random and is not "
                        "supported; export the model in eval mode",
                        self.opset,
                        "mode",
                    )
                ]
        if node.op_type == "BatchNormalization":
            training = node.attrs.get("training_mode", 0) or (
                self.opset < 14 and sum(1 for n in node.outputs[1:] if n) > 0
            )
            if training:
                return [
                    node.problem(
                        "training mode (batch statistics) is not supported; export the model in "
                        "eval mode so it uses its running mean and variance",
                        self.opset,
                        "mode",
                    )
                ]
        return []

    def _structure_hash(self) -> str:
        """Graph, opsets, constants and the parameters' names, shapes and dtypes (not
        their values): what compiling a program that calls the model depends on."""
        import onnx

        graph = onnx.GraphProto()
        graph.CopyFrom(self.proto.graph)
        del graph.initializer[:]
        digest = hashlib.sha256(graph.SerializeToString(deterministic=True))
        for o in self.proto.opset_import:
            digest.update(f"{o.domain}:{o.version};".encode())
        for name, value in self.params.items():
            digest.update(f"{name}:{value.shape}:{value.dtype};".encode())
        for name, value in self.consts.items():
            digest.update(f"{name}:{value.shape}:{value.dtype};".encode() + value.tobytes())
        return digest.hexdigest()

    # Specializing -----------------------------------------------------------------------
    def specialize(
        self, types: Sequence[tuple[tuple[int, ...], Any]], max_elements: int | None = None
    ) -> Specialization:
        """The model for these input (shape, dtype)s; raises ModelError (the inputs that
        do not fit, naming input and axis; shapes that do not follow from them; a constant
        folded at load time of more than `max_elements`, refused before it is made)."""
        key = (tuple((tuple(s), np.dtype(d).str) for s, d in types), max_elements)
        with self._lock:
            if key in self._specs:
                self._specs.move_to_end(key)
                return self._specs[key]
        spec = self._specialize([(tuple(s), np.dtype(d)) for s, d in types], max_elements)
        with self._lock:
            self._specs[key] = spec
            while len(self._specs) > MAX_SPECIALIZATIONS:
                self._specs.popitem(last=False)
        return spec

    def _check_inputs(self, types: list[tuple[tuple[int, ...], np.dtype]]) -> None:
        problems = []
        if len(types) != len(self.inputs):
            names = ", ".join(i.name for i in self.inputs)
            raise ModelError(
                [
                    ModelProblem(
                        f"the model takes {len(self.inputs)} input(s) ({names}), got {len(types)}",
                        "shape",
                    )
                ]
            )
        symbols: dict[str, tuple[int, str, int]] = {}
        for spec, (shape, dtype) in zip(self.inputs, types):
            if dtype != spec.dtype:
                problems.append(
                    ModelProblem(
                        f"input {spec.name!r} must be {spec.dtype}, got {dtype}",
                        "shape",
                        tensor=spec.name,
                    )
                )
            if len(shape) != len(spec.dims):
                problems.append(
                    ModelProblem(
                        f"input {spec.name!r} must have rank {len(spec.dims)} "
                        f"(dims {list(spec.dims)}), got shape {list(shape)}",
                        "shape",
                        tensor=spec.name,
                    )
                )
                continue
            for axis, (want, got) in enumerate(zip(spec.dims, shape)):
                if isinstance(want, int) and want != got:
                    problems.append(
                        ModelProblem(
                            f"input {spec.name!r} axis {axis} must be {want}, got {got}",
                            "shape",
                            tensor=spec.name,
                            axis=axis,
                        )
                    )
                elif isinstance(want, str):
                    seen = symbols.setdefault(want, (got, spec.name, axis))
                    if seen[0] != got:
                        problems.append(
                            ModelProblem(
                                f"input {spec.name!r} axis {axis} is the dimension {want!r}, which "
                                f"is {seen[0]} at input {seen[1]!r} axis {seen[2]}; got {got}",
                                "shape",
                                tensor=spec.name,
                                axis=axis,
                            )
                        )
        if problems:
            raise ModelError(problems)

    def _specialize(
        self, types: list[tuple[tuple[int, ...], np.dtype]], max_elements: int | None = None
    ) -> Specialization:
        self._check_inputs(types)
        # Exports with a dynamic batch compute shapes from the input's (Shape -> Squeeze
        # -> Reshape -> Concat -> Reshape), which ONNX shape inference does not follow:
        # fold what the known shapes allow, infer again with those values in place, and
        # repeat while that reveals more (a few rounds; each folds at least one more value).
        known: dict[str, np.ndarray] = {}
        for _ in range(MAX_SHAPE_ROUNDS):
            shapes = self._infer_shapes(types, known)
            spec, problems = self._fold_and_plan(shapes, max_elements)
            more = {
                n: v
                for n, v in spec.consts.items()
                if n not in self.consts and n not in known and v.dtype.kind in "iub"
            }
            if not problems or not more:
                break
            known.update(more)
        if problems:
            raise ModelError(problems)
        return spec

    def _fold_and_plan(
        self, shapes: dict, max_elements: int | None = None
    ) -> tuple[Specialization, list[ModelProblem]]:
        """Fold what is known at load time (given these inferred shapes; a constant past
        max_elements is refused before it is made) and list the steps that run; the
        problems found instead of raising them."""
        consts: dict[str, np.ndarray] = dict(self.consts)
        steps: list[Step] = []
        problems: list[ModelProblem] = []
        folded = 0
        for node in self.nodes:
            ins = [n for n in node.inputs if n]
            if node.op_type in ("Shape", "Size") and node.inputs[0] not in consts:
                shape = shapes.get(node.inputs[0])
                if node.inputs[0] in self.params:  # a parameter's shape is its own
                    param = self.params[node.inputs[0]]
                    shape = (param.shape, param.dtype)
                if shape is not None and None not in shape[0]:
                    fake = SimpleNamespace(shape=shape[0])
                    out = run_node(node.op_type, [fake], node.attrs, self.opset, 1)
                    consts[node.outputs[0]] = out[0]
                    folded += 1
                    continue
                problems.append(
                    node.problem(
                        f"the shape of {node.inputs[0]!r} does not follow from the inputs' shapes",
                        self.opset,
                        "shape",
                    )
                )
                continue
            if node.op_type not in NOT_FOLDABLE and all(n in consts for n in ins):
                if (why := _oversized_fold(node, consts, max_elements, shapes)) is not None:
                    problems.append(node.problem(why, self.opset, "shape"))
                    continue
                try:
                    outs = _fold(node, consts, self.opset)
                except Exception as exc:  # noqa: BLE001 (the reference evaluator raises anything)
                    problems.append(
                        node.problem(f"cannot be computed at load time: {exc}", self.opset)
                    )
                    continue
                consts.update((n, v) for n, v in zip(node.outputs, outs) if n)
                folded += 1
                continue
            for i in STATIC.get(node.op_type, ()):
                if i < len(node.inputs) and node.inputs[i] and node.inputs[i] not in consts:
                    problems.append(
                        node.problem(
                            f"input {i} ({node.inputs[i]!r}) must be known at load time (a shape, "
                            "axes or pads), but it depends on values computed at run time",
                            self.opset,
                            "shape",
                        )
                    )
            if node.op_type == "Dropout":
                problems.extend(self._mode_problems(node, consts))
            steps.append(Step(node.op_type, node.inputs, node.outputs, node.attrs))
        steps = fuse_erf_gelu(steps, consts, set(self.outputs), shapes)
        outputs = []
        for name in self.outputs:
            if name in consts:
                outputs.append((tuple(consts[name].shape), consts[name].dtype))
                continue
            shape, dtype = shapes.get(name, (None, None))
            if shape is None:
                problems.append(
                    ModelProblem(
                        f"the shape of output {name!r} does not follow from the inputs' shapes",
                        "shape",
                        tensor=name,
                    )
                )
                continue
            for axis, d in enumerate(shape):
                if d is None:
                    problems.append(
                        ModelProblem(
                            f"output {name!r} axis {axis} has a size that does not follow from "
                            "the inputs' shapes",
                            "shape",
                            tensor=name,
                            axis=axis,
                        )
                    )
            outputs.append((shape, dtype))
        sizes = [
            (n, shapes[n][0], shapes[n][1])
            for step in steps
            for n in step.outputs
            if n and n in shapes and None not in shapes[n][0]
        ]
        elements = sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in sizes)
        return Specialization(steps, consts, outputs, elements, folded, sizes), problems

    def _infer_shapes(
        self,
        types: list[tuple[tuple[int, ...], np.dtype]],
        known: Mapping[str, np.ndarray] | None = None,
    ) -> dict:
        """ONNX shape inference with the inputs' shapes fixed: name -> (shape, dtype),
        with None for a size it could not infer. `known`: values folded already (shapes,
        axes), put in place of the nodes that compute them."""
        import onnx
        from onnx import helper, numpy_helper

        model = onnx.ModelProto()
        model.CopyFrom(self.proto)
        if known:
            kept = [n for n in model.graph.node if not all(o in known for o in n.output if o)]
            del model.graph.node[:]
            model.graph.node.extend(kept)
            model.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in known.items())
        by_name = {i.name: t for i, t in zip(self.inputs, types)}
        for value in model.graph.input:
            if value.name in by_name:
                dims = value.type.tensor_type.shape.dim
                for dim, size in zip(dims, by_name[value.name][0]):
                    dim.Clear()
                    dim.dim_value = size
        failures = (onnx.shape_inference.InferenceError, onnx.checker.ValidationError)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except failures as exc:
            # Data propagation (shapes computed from shape-valued tensors) misjudges some
            # graphs of index arithmetic (the dynamo exporter's AdaptiveAvgPool: "Invalid
            # rank for Add broadcasting"); inference without it is still exact, if
            # sometimes less complete.
            try:
                inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
            except failures:
                raise ModelError(
                    [ModelProblem(f"ONNX shape inference failed: {exc}", "shape")]
                ) from exc
        out = {}
        graph = inferred.graph
        for value in (*graph.input, *graph.value_info, *graph.output):
            t = value.type.tensor_type
            if not t.HasField("shape"):
                continue
            shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
            out[value.name] = (shape, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)))
        return out

    # Running ----------------------------------------------------------------------------
    def run(
        self, spec: Specialization, args: Sequence[Any], params: Mapping[str, Tensor]
    ) -> list[Tensor]:
        """The outputs for these inputs, with the parameters taken from `params` (engine
        Variables or tensors by ONNX name), recorded by whatever tapes are open."""
        env: dict[str, Any] = dict(spec.consts)
        env.update((name, params[name]) for name in self.params)
        env.update((i.name, a) for i, a in zip(self.inputs, args))
        for step in spec.steps:
            ins = [env[n] if n else None for n in step.inputs]
            outs = run_node(step.op_type, ins, step.attrs, self.opset, len(step.outputs))
            for name, value in zip(step.outputs, outs):
                if name:
                    env[name] = value
        return [v if isinstance(v, Tensor) else constant(v) for v in (env[n] for n in self.outputs)]


# Ops whose outputs carry no derivative of any input (shapes, comparisons, logic,
# rounding, index results), and per op the inputs that carry none (indices, a condition,
# a dtype target, BatchNorm's running statistics: buffers, not parameters).
NO_DERIVATIVE = frozenset(
    {"Shape", "Size", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not",
     "And", "Or", "Xor", "IsNaN", "IsInf", "Sign", "ArgMax", "ArgMin", "ConstantOfShape",
     "Range", "NonZero", "OneHot", "EyeLike", "Floor", "Ceil", "Round"}
)  # fmt: skip
NO_DERIVATIVE_INPUTS = {
    "CastLike": (1,),
    "Where": (0,),
    "Gather": (1,),
    "GatherND": (1,),
    "GatherElements": (1,),
    "BatchNormalization": (3, 4),
}


def differentiable_input(op_type: str, index: int, attrs: Mapping[str, Any]) -> bool:
    """Whether a derivative of the node's outputs can reach its input `index`."""
    if op_type in NO_DERIVATIVE or index in STATIC.get(op_type, ()):
        return False
    if op_type == "Cast":
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(attrs["to"])).kind == "f"
    return index not in NO_DERIVATIVE_INPUTS.get(op_type, ())


def _graph_input(value: Any) -> GraphInput:
    from onnx import helper

    t = value.type.tensor_type
    dims: tuple[int | str | None, ...] = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
    )
    return GraphInput(value.name, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)), dims)


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
    return value


def _constant_value(node: Node) -> np.ndarray | None:
    try:
        return _fold(node, {}, 13)[0]
    except Exception:  # noqa: BLE001 (an unusual Constant is checked at specialization)
        return None


def _oversized_fold(
    node: Node,
    consts: Mapping[str, np.ndarray],
    max_elements: int | None,
    shapes: Mapping[str, Any] | None = None,
) -> str | None:
    """Why folding this node would make a constant past max_elements, known from its
    constant inputs (or the shape ONNX's inference gives its outputs) before the
    reference evaluator allocates it (None: it fits)."""
    if max_elements is None:
        return None
    # Any op can grow its constant inputs (Tile, Pad, a broadcast Mul, an outer MatMul,
    # OneHot, Resize): where inference knows an output's shape, that is its size.
    for out in node.outputs:
        shape = (shapes or {}).get(out, (None, None))[0] if out else None
        if shape is not None and None not in shape:
            elements = math.prod(max(int(d), 0) for d in shape)
            if elements > max_elements:
                return (
                    f"folding it at load time would make a constant of {elements:,} "
                    f"elements; the limit is {max_elements:,} (max_elements)"
                )
    if node.op_type in ("ConstantOfShape", "Expand"):
        shape_input = node.inputs[0] if node.op_type == "ConstantOfShape" else node.inputs[1]
        dims = [int(d) for d in np.asarray(consts[shape_input]).reshape(-1)]
        elements = math.prod(max(d, 0) for d in dims)
    elif node.op_type == "Range":
        start, limit, delta = (np.asarray(consts[n]).item() for n in node.inputs[:3])
        if not delta or not all(math.isfinite(float(v)) for v in (start, limit, delta)):
            return None  # the evaluator says what is wrong
        elements = max(0, math.ceil((limit - start) / delta))
    else:
        return None
    if elements <= max_elements:
        return None
    return (
        f"folding it at load time would make a constant of {elements:,} elements; the "
        f"limit is {max_elements:,} (max_elements)"
    )


def _fold(node: Node, consts: Mapping[str, np.ndarray], opset: int) -> list[np.ndarray]:
    """The node's outputs from constant inputs, by ONNX's reference evaluator (the
    spec's own semantics for every op, at this opset)."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(node.proto, opsets={"": opset})
    feeds = {n: consts[n] for n in node.inputs if n}
    return [np.asarray(v) for v in evaluator.run(None, feeds)]


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------

_CACHE: OrderedDict[str, OnnxModel] = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 8


def load_model(data: Any, float64: bool = False) -> OnnxModel:
    """A checked model from the bytes of an .onnx file (cached by content); raises
    ModelError naming the checker's complaint or every unsupported node. float64: run a
    float32 model in float64 (as_float64), as a definition with `dtype: float64` asks."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ModelError([ModelProblem(f"an ONNX model is bytes, got {type(data).__name__}")])
    data = bytes(data)
    digest = hashlib.sha256(data).hexdigest() + (":float64" if float64 else "")
    with _CACHE_LOCK:
        if digest in _CACHE:
            _CACHE.move_to_end(digest)
            return _CACHE[digest]
    proto = _parse(data)
    model = OnnxModel(as_float64(proto) if float64 else proto, digest)
    model.check()
    with _CACHE_LOCK:
        _CACHE[digest] = model
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return model


def _parse(data: bytes) -> Any:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            [ModelProblem(f"not a valid ONNX file ({len(data)} bytes; is it truncated?): {exc}")]
        ) from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelError(
            [
                ModelProblem(
                    f"not a valid ONNX file ({len(data)} bytes; is it truncated?): it has no graph"
                )
            ]
        )
    # Before the checker (which opens external files itself) and before any array.
    if refused := external_data_problems(proto):
        raise ModelError(refused)
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        raise ModelError([ModelProblem(f"the ONNX checker refuses the model: {exc}")]) from None
    return proto


def as_float64(proto: Any) -> Any:
    """The same model computing in float64: float32 initializers, graph inputs, outputs
    and value infos, Cast targets and float32 constants (Constant values, value_float(s),
    ConstantOfShape's value and its float32 default) switched to double. Exact for what the file holds: a float32 constant keeps
    its float32 value, now in a float64."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            value = numpy_helper.to_array(init).astype(np.float64)
            graph.initializer[i].CopyFrom(numpy_helper.from_array(value, init.name))
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                value = numpy_helper.to_array(attr.t).astype(np.float64)
                attr.t.CopyFrom(numpy_helper.from_array(value, attr.t.name))
        # Constants typed float32 by their attribute's kind: value_float(s) is a float32
        # tensor, ConstantOfShape without `value` float32 zeros (Operators.md).
        if node.op_type == "Constant" and [a.name for a in node.attribute] in (
            ["value_float"],
            ["value_floats"],
        ):
            attr = node.attribute[0]
            floats = [attr.f] if attr.name == "value_float" else list(attr.floats)
            value = np.asarray(floats, np.float32).astype(np.float64)
            if attr.name == "value_float":
                value = value.reshape(())
            node.ClearField("attribute")
            node.attribute.append(
                helper.make_attribute("value", numpy_helper.from_array(value, node.output[0]))
            )
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            zero = numpy_helper.from_array(np.zeros(1, np.float64), "value")
            node.attribute.append(helper.make_attribute("value", zero))
    return model


def float_dtypes(model: OnnxModel) -> set[np.dtype]:
    """The floating-point dtypes of a model's parameters and inputs."""
    found = {v.dtype for v in model.params.values()}
    found.update(i.dtype for i in model.inputs if i.dtype.kind == "f")
    return found


# ----------------------------------------------------------------------------------------
# The exporters' exact GELU, 0.5 x (1 + erf(x / sqrt 2)), is five nodes (Div, Erf, Add,
# Mul, Mul: torch.onnx's for nn.GELU before opset 20); run as one Gelu step it is the
# fused gelu primitive (engine/ops/elementwise.py): the same forward bit for bit, a
# backward of ~10 passes instead of ~15 NumPy calls and an erf derivative (issue 28).
# ----------------------------------------------------------------------------------------
def _keeps_shape(const_shape: tuple[int, ...], x_shape: tuple | None) -> bool:
    """Whether a one-element constant broadcast against x leaves x's shape as it is (a
    (1, 1) constant makes a vector a matrix: fusing it would change the result's shape).
    x of unknown rank: only a 0-d constant does."""
    if x_shape is None:
        return len(const_shape) == 0
    sized = tuple(2 if d is None else d for d in x_shape)  # any size > 1 for an unknown one
    return host.broadcast_shapes(sized, const_shape) == sized


def _is_scalar(
    consts: Mapping[str, np.ndarray], name: str, value: float, x_shape: tuple | None
) -> bool:
    c = consts.get(name)
    if c is None or c.dtype.kind != "f" or c.size != 1 or not _keeps_shape(c.shape, x_shape):
        return False
    return bool(c.reshape(()) == c.dtype.type(value))


def fuse_erf_gelu(
    steps: list[Step],
    consts: Mapping[str, np.ndarray],
    outputs: set[str],
    shapes: Mapping[str, tuple],
) -> list[Step]:
    """steps with each Div-Erf-Add-Mul-Mul GELU (any association of the products)
    replaced by one Gelu step; its intermediates must be read by nothing else, and its
    constants must be one-element arrays that leave x's shape as it is (`shapes`: the
    inferred name -> (shape, dtype), None for a size or a rank not inferred)."""
    readers: dict[str, int] = {}
    for step in steps:
        for n in step.inputs:
            readers[n] = readers.get(n, 0) + 1
    made = {n: k for k, step in enumerate(steps) for n in step.outputs if n}

    def only_reader(name: str) -> int | None:
        """The step that reads `name`, when exactly one does and it is no graph output."""
        if readers.get(name) != 1 or name in outputs:
            return None
        return next(k for k, s in enumerate(steps) if name in s.inputs)

    def other(step: Step, name: str) -> str | None:
        if len(step.inputs) != 2 or name not in step.inputs:
            return None
        a, b = step.inputs
        return b if a == name else a

    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, div in enumerate(steps):
        if div.op_type != "Div" or len(div.inputs) != 2:
            continue
        x, root = div.inputs
        x_shape = shapes.get(x, (None, None))[0]
        if x in consts or not _is_scalar(consts, root, 1.4142135623730951, x_shape):
            continue
        chain = [k]
        e = only_reader(div.outputs[0])
        if e is None or steps[e].op_type != "Erf":
            continue
        chain.append(e)
        a = only_reader(steps[e].outputs[0])
        if a is None or steps[a].op_type != "Add":
            continue
        one = other(steps[a], steps[e].outputs[0])
        if one is None or not _is_scalar(consts, one, 1.0, x_shape):
            continue
        chain.append(a)
        m1 = only_reader(steps[a].outputs[0])
        if m1 is None or steps[m1].op_type != "Mul":
            continue
        factor = other(steps[m1], steps[a].outputs[0])
        if factor == x:  # x * (1 + erf), then * 0.5
            m2 = only_reader(steps[m1].outputs[0])
            if m2 is None or steps[m2].op_type != "Mul":
                continue
            half = other(steps[m2], steps[m1].outputs[0])
            if half is None or not _is_scalar(consts, half, 0.5, x_shape):
                continue
            chain += [m1, m2]
        elif factor is not None and _is_scalar(
            consts, factor, 0.5, x_shape
        ):  # 0.5 (1 + erf), then * x
            m2 = only_reader(steps[m1].outputs[0])
            if m2 is None or steps[m2].op_type != "Mul":
                continue
            if other(steps[m2], steps[m1].outputs[0]) != x:
                continue
            chain += [m1, m2]
        elif factor is not None and factor in made:  # (x * 0.5) * (1 + erf)
            h = made[factor]
            half = other(steps[h], x)
            if (
                steps[h].op_type != "Mul"
                or half is None
                or not _is_scalar(consts, half, 0.5, x_shape)
            ):
                continue
            if only_reader(factor) != m1 or readers.get(x, 0) < 2:
                continue
            chain += [h, m1]
            m2 = m1
        else:
            continue
        if drop.intersection(chain):
            continue
        last = max(chain)
        drop.update(chain)
        replace[last] = Step("Gelu", (x,), steps[m2].outputs, {"approximate": "none"})
    if not replace:
        return steps
    return [
        replace[k] if k in replace else s
        for k, s in enumerate(steps)
        if k not in drop or k in replace
    ]
