"""ONNX operators as engine ops: one handler per op_type, written in differentiable
engine ops (so gradients, jacobians and HVPs of every order come from the ops' own
rules), following the semantics of onnx/docs/Operators.md for opsets 7 to 23+.

A handler takes (inputs, attrs, opset): inputs are engine Tensors (computed values),
NumPy arrays (constants known at load time: folded shape subgraphs, integer
initializers, Constant nodes) or None (an omitted optional input), and returns one
value per output (None for an output it does not produce). STATIC lists the inputs that
must be constants (shapes, axes, pads): the loader refuses a model where one is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine import backend, trace
from engine.ops.nn import layer_norm_last_axis, normalize_last_axis
from engine.registry import public_ops
from engine.tensor import Tensor, constant, pass_constant


def _graph_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, taking the NumPy arrays a handler hands it (the graph's constants, and what
    handlers make from attributes and shapes: an epsilon in x's dtype, a Trilu mask) as
    constants of the pass: declared to a capture for replay (engine/replay.py), which
    refuses arrays made outside the ops otherwise, and moved to the device of the
    tensors they meet (a model run on CuPy). None of them depends on the pass's values:
    a handler that reads a tensor on the host (np.asarray of one) is seen by the
    capture, and such a pass stays dynamic."""

    def op(*args: Any, **kwargs: Any) -> Any:
        if trace.capture is not None or backend.gpu_loaded():
            device = _device_of(args)
            args = tuple(_declared(a, device) for a in args)
        return fn(*args, **kwargs)

    op.__name__ = op.__qualname__ = getattr(fn, "__name__", "op")
    op.__doc__ = fn.__doc__
    return op


def _device_of(args: Sequence[Any]) -> str | None:
    """The device of the first tensor among args (one level into lists) not in host
    memory, or None."""
    for a in args:
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, Tensor) and type(t.value) is not np.ndarray:
                return backend.device_of(t.value)
    return None


def _declared(value: Any, device: str | None) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        if device is not None:
            return constant(value, device=device)
        return pass_constant(np.asarray(value))
    if isinstance(value, list | tuple) and any(isinstance(v, np.ndarray) for v in value):
        return type(value)(_declared(v, device) for v in value)
    return value


OP = {name: _graph_op(info.fn) for name, info in public_ops.items()}

Handler = Callable[[list[Any], dict[str, Any], int], list[Any]]
HANDLERS: dict[str, Handler] = {}
# op_type -> indices of inputs that must be known at load time.
STATIC: dict[str, tuple[int, ...]] = {}
# op_type -> why a node's attributes cannot run here (None when they can), asked at load.
REFUSALS: dict[str, Callable[[dict[str, Any]], str | None]] = {}


def handler(*names: str, static: tuple[int, ...] = ()) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = fn
            if static:
                STATIC[name] = static
        return fn

    return register


class OpError(ValueError):
    """A node whose attributes or inputs this runtime does not handle (caught by the
    loader, which names the node)."""


def ints(value: Any) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


# ----------------------------------------------------------------------------------------
# Elementwise
# ----------------------------------------------------------------------------------------

_UNARY = {
    "Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Neg": "negative", "Abs": "abs",
    "Erf": "erf", "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu",
    "Softplus": "softplus", "Reciprocal": "reciprocal", "Sin": "sin", "Cos": "cos",
    "Tan": "tan", "Sign": "sign", "Not": "logical_not",
}  # fmt: skip
_BINARY = {
    "Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Pow": "power",
    "Equal": "equal", "Less": "less", "Greater": "greater", "LessOrEqual": "less_equal",
    "GreaterOrEqual": "greater_equal", "And": "logical_and", "Or": "logical_or",
}  # fmt: skip


def _unary(op: str) -> Handler:
    fn = OP[op]
    return lambda ins, attrs, opset: [fn(ins[0])]


def _binary(op: str) -> Handler:
    fn = OP[op]
    return lambda ins, attrs, opset: [fn(ins[0], ins[1])]


for _name, _op in _UNARY.items():
    HANDLERS[_name] = _unary(_op)
for _name, _op in _BINARY.items():
    HANDLERS[_name] = _binary(_op)


@handler("Identity")
def _identity(ins, attrs, opset):
    return [ins[0]]


@handler("LeakyRelu")
def _leaky_relu(ins, attrs, opset):
    return [OP["leaky_relu"](ins[0], alpha=float(attrs.get("alpha", 0.01)))]


@handler("Elu")
def _elu(ins, attrs, opset):
    return [OP["elu"](ins[0], alpha=float(attrs.get("alpha", 1.0)))]


@handler("Gelu")
def _gelu(ins, attrs, opset):
    approximate = attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise OpError(f"approximate={approximate!r} is not 'none' or 'tanh'")
    return [OP["gelu"](ins[0], approximate=approximate == "tanh")]


def _variadic(op: str) -> Handler:
    fn = OP[op]

    def run(ins, attrs, opset):
        out = ins[0]
        for x in ins[1:]:
            out = fn(out, x)
        return [out]

    return run


HANDLERS["Max"] = _variadic("maximum")
HANDLERS["Min"] = _variadic("minimum")
HANDLERS["Sum"] = _variadic("add")


@handler("Clip")
def _clip(ins, attrs, opset):
    x = ins[0]
    if opset < 11:
        lo, hi = attrs.get("min"), attrs.get("max")
    else:
        lo = ins[1] if len(ins) > 1 else None
        hi = ins[2] if len(ins) > 2 else None
    for bound, fn in ((lo, OP["maximum"]), (hi, OP["minimum"])):
        if bound is not None:
            x = fn(x, _like(bound, x))
    return [x]


def _like(value: Any, x: Any) -> Any:
    """A constant in x's dtype (ONNX constants are typed; NumPy would promote)."""
    if isinstance(value, np.ndarray | np.generic | float | int):
        return np.asarray(value, dtype=x.dtype)
    return value


@handler("CastLike")
def _cast_like(ins, attrs, opset):
    # Only the second input's element type is read (the dynamo exporter's scalar
    # constants are CastLike'd to the tensor they meet).
    return [OP["cast"](ins[0], dtype=np.dtype(ins[1].dtype))]


@handler("HardSigmoid")
def _hard_sigmoid(ins, attrs, opset):
    return [_hard_sigmoid_of(ins[0], float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5)))]


def _hard_sigmoid_of(x: Any, alpha: float, beta: float) -> Any:
    """max(0, min(1, alpha x + beta)): an exact composite (no gradient where clipped)."""
    y = OP["add"](OP["multiply"](x, _like(alpha, x)), _like(beta, x))
    return OP["minimum"](OP["maximum"](y, _like(0.0, x)), _like(1.0, x))


@handler("HardSwish")
def _hard_swish(ins, attrs, opset):
    x = ins[0]  # x * HardSigmoid(x) with alpha 1/6, beta 1/2 (torch's x * relu6(x + 3) / 6)
    return [OP["multiply"](x, _hard_sigmoid_of(x, 1.0 / 6.0, 0.5))]


@handler("Mish")
def _mish(ins, attrs, opset):
    x = ins[0]
    return [OP["multiply"](x, OP["tanh"](OP["softplus"](x)))]


@handler("PRelu")
def _prelu(ins, attrs, opset):
    x, slope = ins[0], ins[1]  # slope broadcasts to x (unidirectionally)
    return [OP["where"](OP["greater"](x, _like(0.0, x)), x, OP["multiply"](x, slope))]


@handler("Selu")
def _selu(ins, attrs, opset):
    x = ins[0]
    alpha = float(attrs.get("alpha", 1.67326319217681884765625))
    gamma = float(attrs.get("gamma", 1.05070102214813232421875))
    return [OP["multiply"](OP["elu"](x, alpha=alpha), _like(gamma, x))]


@handler("Celu")
def _celu(ins, attrs, opset):
    # max(0, x) + min(0, alpha (exp(x / alpha) - 1)) = alpha elu(x / alpha)
    x, alpha = ins[0], _like(float(attrs.get("alpha", 1.0)), ins[0])
    return [OP["multiply"](OP["elu"](OP["divide"](x, alpha), alpha=1.0), alpha)]


@handler("Softsign")
def _softsign(ins, attrs, opset):
    x = ins[0]
    return [OP["divide"](x, OP["add"](OP["abs"](x), _like(1.0, x)))]


@handler("ThresholdedRelu")
def _thresholded_relu(ins, attrs, opset):
    x = ins[0]
    above = OP["greater"](x, _like(float(attrs.get("alpha", 1.0)), x))
    return [OP["where"](above, x, _like(0.0, x))]


@handler("Mean")
def _mean_of(ins, attrs, opset):
    total = ins[0]
    for x in ins[1:]:
        total = OP["add"](total, x)
    return [OP["divide"](total, _like(float(len(ins)), total))]


def _inverse_trig(name: str) -> Handler:
    def run(ins, attrs, opset):
        x = ins[0]
        one = _like(1.0, x)
        if name == "Atan":
            return [OP["atan2"](x, OP["add"](OP["multiply"](x, _like(0.0, x)), one))]
        if name in ("Asin", "Acos"):  # atan2 of the sine and cosine sides of the angle
            side = OP["sqrt"](OP["subtract"](one, OP["multiply"](x, x)))
            return [OP["atan2"](x, side) if name == "Asin" else OP["atan2"](side, x)]
        if name == "Sinh":
            return [
                OP["multiply"](
                    OP["subtract"](OP["exp"](x), OP["exp"](OP["negative"](x))), _like(0.5, x)
                )
            ]
        if name == "Cosh":
            return [
                OP["multiply"](OP["add"](OP["exp"](x), OP["exp"](OP["negative"](x))), _like(0.5, x))
            ]
        if name == "Asinh":
            return [OP["log"](OP["add"](x, OP["sqrt"](OP["add"](OP["multiply"](x, x), one))))]
        if name == "Acosh":
            return [OP["log"](OP["add"](x, OP["sqrt"](OP["subtract"](OP["multiply"](x, x), one))))]
        # Atanh: log((1 + x) / (1 - x)) / 2
        ratio = OP["divide"](OP["add"](one, x), OP["subtract"](one, x))
        return [OP["multiply"](OP["log"](ratio), _like(0.5, x))]

    return run


for _name in ("Atan", "Asin", "Acos", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"):
    HANDLERS[_name] = _inverse_trig(_name)


@handler("IsNaN")
def _is_nan(ins, attrs, opset):
    x = ins[0]  # NaN is the one value unequal to itself (torch's masked attention asks)
    return [OP["not_equal"](x, x)]


@handler("IsInf")
def _is_inf(ins, attrs, opset):
    x = ins[0]
    out = None
    for sign, wanted in ((1.0, "detect_positive"), (-1.0, "detect_negative")):
        if attrs.get(wanted, 1):
            hit = OP["equal"](x, _like(sign * np.inf, x))
            out = hit if out is None else OP["logical_or"](out, hit)
    return [out if out is not None else OP["not_equal"](x, x)]


@handler("Where")
def _where(ins, attrs, opset):
    return [OP["where"](ins[0], ins[1], ins[2])]


@handler("Cast")
def _cast(ins, attrs, opset):
    from onnx import helper

    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(attrs["to"]))
    return [OP["cast"](ins[0], dtype=dtype)]


# ----------------------------------------------------------------------------------------
# Linear algebra and normalization
# ----------------------------------------------------------------------------------------


@handler("MatMul")
def _matmul(ins, attrs, opset):
    return [OP["matmul"](ins[0], ins[1])]


@handler("Gemm")
def _gemm(ins, attrs, opset):
    a, b = ins[0], ins[1]
    if attrs.get("transA", 0):
        a = OP["transpose"](a)
    if attrs.get("transB", 0):
        b = OP["transpose"](b)
    y = OP["matmul"](a, b)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if alpha != 1.0:
        y = OP["multiply"](y, _like(alpha, y))
    c = ins[2] if len(ins) > 2 else None
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = OP["multiply"](c, _like(beta, c))
        y = OP["add"](y, c)
    return [y]


@handler("Einsum")
def _einsum(ins, attrs, opset):
    return [OP["einsum"](attrs["equation"], *ins)]


def _channel(v: Any, rank: int) -> Any:
    """A per-channel vector shaped (C, 1, ..., 1) to broadcast over N, C, spatial..."""
    return OP["reshape"](v, (-1,) + (1,) * (rank - 2))


@handler("BatchNormalization")
def _batch_norm(ins, attrs, opset):
    x, scale, bias, mean, var = ins[:5]
    rank = len(x.shape)
    eps = float(attrs.get("epsilon", 1e-5))
    # Inference mode, folded per channel: y = x * a + c with a = scale / sqrt(var + eps)
    # and c = bias - mean * a, so the full-size work is one multiply and one add (and
    # their two VJPs) instead of four ops; scale, bias, mean and var stay differentiable
    # through the channel-sized a and c.
    inv = OP["rsqrt"](OP["add"](var, _like(eps, var)))
    a = OP["multiply"](scale, inv)
    c = OP["subtract"](bias, OP["multiply"](mean, a))
    return [OP["add"](OP["multiply"](x, _channel(a, rank)), _channel(c, rank))]


@handler("LayerNormalization")
def _layer_norm(ins, attrs, opset):
    return layer_norm_node(ins, attrs, opset, 3)


def layer_norm_node(ins: list, attrs: dict[str, Any], opset: int, outputs: int) -> list:
    """LayerNormalization; `outputs`: how many of Y, Mean, InvStdDev the node names. Over
    the last axis, with only Y named (what the exporters write), Y is the fused
    layer_norm_affine primitive's where the scale and bias have the row's shape and x's
    dtype (engine/ops/nn.py: one kernel forward, two backward), else the normalize
    primitive's times the scale plus the bias; otherwise the composite."""
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    rank = len(x.shape)
    axis = int(attrs.get("axis", -1)) % rank
    if outputs == 1 and axis == rank - 1 and isinstance(x, Tensor) and x.dtype.kind == "f":
        eps_value = float(attrs.get("epsilon", 1e-5))
        if bias is not None:
            return [layer_norm_last_axis(x, scale, bias, eps_value)]
        y = OP["multiply"](normalize_last_axis(x, eps_value), scale)
        return [y if bias is None else OP["add"](y, bias)]
    axes = tuple(range(axis, rank))
    eps = _like(float(attrs.get("epsilon", 1e-5)), x)
    mean = OP["mean"](x, axis=axes, keepdims=True)
    d = OP["subtract"](x, mean)
    var = OP["mean"](OP["multiply"](d, d), axis=axes, keepdims=True)
    inv = OP["rsqrt"](OP["add"](var, eps))
    y = OP["multiply"](OP["multiply"](d, inv), scale)
    if bias is not None:
        y = OP["add"](y, bias)
    return [y, mean, inv]


def _normalized(x: Any, axes: tuple[int, ...], eps: float) -> Any:
    """(x - mean) / sqrt(var + eps) over `axes` (biased variance, as every ONNX norm)."""
    d = OP["subtract"](x, OP["mean"](x, axis=axes, keepdims=True))
    var = OP["mean"](OP["multiply"](d, d), axis=axes, keepdims=True)
    return OP["multiply"](d, OP["rsqrt"](OP["add"](var, _like(eps, x))))


@handler("InstanceNormalization")
def _instance_norm(ins, attrs, opset):
    x, scale, bias = ins[:3]
    rank = len(x.shape)
    y = _normalized(x, tuple(range(2, rank)), float(attrs.get("epsilon", 1e-5)))
    return [OP["add"](OP["multiply"](y, _channel(scale, rank)), _channel(bias, rank))]


@handler("GroupNormalization")
def _group_norm(ins, attrs, opset):
    # Statistics over each group of C/G channels and all spatial positions; scale and
    # bias per channel (opset 21: the checker refuses version 18's per-group form, which
    # ONNX deprecated). The statistics are computed in the input's dtype whatever
    # stash_type says (its default asks float32, which would round a float64 model).
    x, scale, bias = ins[:3]
    shape = shape_of(x)
    groups, channels, rank = int(attrs["num_groups"]), shape[1], len(shape)
    if channels % groups:
        raise OpError(f"num_groups={groups} does not divide the {channels} channels")
    grouped = OP["reshape"](x, (shape[0], groups, -1))
    y = OP["reshape"](_normalized(grouped, (2,), float(attrs.get("epsilon", 1e-5))), shape)
    return [OP["add"](OP["multiply"](y, _channel(scale, rank)), _channel(bias, rank))]


def _softmax_like(op: str) -> Handler:
    fn = OP[op]

    def run(ins, attrs, opset):
        x = ins[0]
        rank = len(x.shape)
        if opset >= 13:  # one axis, default the last
            return [fn(x, axis=int(attrs.get("axis", -1)))]
        # Before 13: the input is coerced to 2-D at `axis` (default 1), normalized per row.
        axis = int(attrs.get("axis", 1)) % max(rank, 1)
        shape = shape_of(x)
        rows = int(np.prod(shape[:axis], dtype=np.int64))
        y = fn(OP["reshape"](x, (rows, -1)), axis=-1)
        return [OP["reshape"](y, shape)]

    return run


HANDLERS["Softmax"] = _softmax_like("softmax")
HANDLERS["LogSoftmax"] = _softmax_like("log_softmax")


@handler("Dropout", static=(1, 2))
def _dropout(ins, attrs, opset):
    # The loader refused training mode; in inference Dropout is the identity and the
    # mask is all true.
    x = ins[0]
    return [x, np.ones(shape_of(x), dtype=bool)]


# ----------------------------------------------------------------------------------------
# Convolution and pooling (the engine's conv, max_pool, avg_pool: windows and GEMMs)
# ----------------------------------------------------------------------------------------


def _window_pads(x: Any, kernel: Sequence[int], attrs: dict[str, Any]) -> tuple:
    """((begin, end), ...) per spatial axis from pads or auto_pad (Operators.md, Conv:
    SAME_UPPER/SAME_LOWER keep ceil(in / stride) outputs, the odd cell at the end or
    the beginning; VALID pads nothing)."""
    nd = len(kernel)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(attrs.get("pads", [0] * 2 * nd))
        return tuple((pads[i], pads[i + nd]) for i in range(nd))
    if auto == "VALID":
        return ((0, 0),) * nd
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise OpError(f"auto_pad {auto!r} is not NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    strides = list(attrs.get("strides", [1] * nd))
    dilations = list(attrs.get("dilations", [1] * nd))
    out = []
    for size, k, s, d in zip(shape_of(x)[2:], kernel, strides, dilations):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        out.append((small, large) if auto == "SAME_UPPER" else (large, small))
    return tuple(out)


@handler("Conv")
def _conv(ins, attrs, opset):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    kernel = shape_of(w)[2:]
    return [
        OP["conv"](
            x,
            w,
            b,
            strides=attrs.get("strides"),
            pads=_window_pads(x, kernel, attrs),
            dilations=attrs.get("dilations"),
            groups=int(attrs.get("group", 1)),
        )
    ]


@handler("ConvTranspose")
def _conv_transpose(ins, attrs, opset):
    """The transpose of Conv as a Conv (an exact composite, so every derivative is the
    conv's own): insert stride - 1 zeros between the input's cells, pad by the kernel's
    reach less `pads` (cropping where that is negative), and correlate with the kernel
    flipped and its in/out channels swapped per group, at stride 1 and the dilation."""
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    shape, kernel = shape_of(x), shape_of(w)[2:]
    nd, groups = len(kernel), int(attrs.get("group", 1))
    strides = list(attrs.get("strides", [1] * nd))
    dilations = list(attrs.get("dilations", [1] * nd))
    extra = list(attrs.get("output_padding", [0] * nd))
    pads = _transpose_pads(shape[2:], kernel, strides, dilations, extra, attrs)
    # Zeros between cells, axis by axis: [..., L] -> [..., L, s] (pad) -> [..., L*s] ->
    # the first (L - 1) s + 1.
    for axis, s in enumerate(strides):
        if s == 1:
            continue
        axis += 2
        length = shape_of(x)[axis]
        moved = OP["moveaxis"](x, axis, -1)
        widths = ((0, 0),) * len(shape) + ((0, s - 1),)
        spread = OP["pad"](OP["reshape"](moved, shape_of(moved) + (1,)), paddings=widths)
        spread = OP["reshape"](spread, shape_of(moved)[:-1] + (length * s,))
        spread = OP["getitem"](spread, (Ellipsis, slice(0, (length - 1) * s + 1)))
        x = OP["moveaxis"](spread, -1, axis)
    reach = [(k - 1) * d for k, d in zip(kernel, dilations)]
    widths = [(r - lo, r - hi + e) for r, (lo, hi), e in zip(reach, pads, extra)]
    crop = [
        slice(max(-lo, 0), shape_of(x)[i + 2] - max(-hi, 0)) for i, (lo, hi) in enumerate(widths)
    ]
    if any(sl.start or sl.stop != shape_of(x)[i + 2] for i, sl in enumerate(crop)):
        x = OP["getitem"](x, (slice(None), slice(None), *crop))
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    # w [C_in, C_out/g, *k] -> [C_out, C_in/g, *k], flipped in space.
    c_in, c_out_g = shape_of(w)[:2]
    w = OP["reshape"](w, (groups, c_in // groups, c_out_g, *kernel))
    w = OP["reshape"](OP["swapaxes"](w, 1, 2), (groups * c_out_g, c_in // groups, *kernel))
    w = OP["getitem"](w, (slice(None), slice(None), *[slice(None, None, -1)] * nd))
    return [OP["conv"](x, w, b, pads=tuple(widths), dilations=dilations, groups=groups)]


def _transpose_pads(size, kernel, strides, dilations, extra, attrs) -> list[tuple[int, int]]:
    """(begin, end) pads of a ConvTranspose (Operators.md): given, or from output_shape
    or auto_pad SAME_* (the total split in half, the odd cell at the end for SAME_UPPER
    and at the beginning otherwise)."""
    nd = len(kernel)
    auto = attrs.get("auto_pad", "NOTSET")
    target = attrs.get("output_shape")
    if target is None and auto not in ("SAME_UPPER", "SAME_LOWER"):
        flat = list(attrs.get("pads", [0] * 2 * nd))
        return [(flat[i], flat[i + nd]) for i in range(nd)]
    if target is None:
        target = [n * s for n, s in zip(size, strides)]
    target = list(target)[-nd:]
    out = []
    for n, k, s, d, e, t in zip(size, kernel, strides, dilations, extra, target):
        total = s * (n - 1) + e + (k - 1) * d + 1 - t
        if total < 0:
            raise OpError(f"output_shape {list(target)} is larger than the full output")
        half = total // 2
        out.append((total - half, half) if auto != "SAME_UPPER" else (half, total - half))
    return out


@handler("MaxPool")
def _max_pool(ins, attrs, opset):
    x = ins[0]
    kernel = list(attrs["kernel_shape"])
    if attrs.get("storage_order", 0):
        raise OpError("storage_order=1 (column-major Indices) is not supported")
    y = OP["max_pool"](
        x,
        kernel_shape=kernel,
        strides=attrs.get("strides"),
        pads=_window_pads(x, kernel, attrs),
        dilations=attrs.get("dilations"),
        ceil_mode=bool(attrs.get("ceil_mode", 0)),
    )
    return [y, None]  # Indices: refused by the loader when a node uses them


@handler("AveragePool")
def _avg_pool(ins, attrs, opset):
    x = ins[0]
    kernel = list(attrs["kernel_shape"])
    if any(d != 1 for d in attrs.get("dilations", [])):
        raise OpError("dilations other than 1 are not supported by AveragePool here")
    return [
        OP["avg_pool"](
            x,
            kernel_shape=kernel,
            strides=attrs.get("strides"),
            pads=_window_pads(x, kernel, attrs),
            count_include_pad=bool(attrs.get("count_include_pad", 0)),
            ceil_mode=bool(attrs.get("ceil_mode", 0)),
        )
    ]


@handler("GlobalAveragePool")
def _global_average_pool(ins, attrs, opset):
    x = ins[0]
    return [OP["mean"](x, axis=tuple(range(2, len(x.shape))), keepdims=True)]


@handler("GlobalMaxPool")
def _global_max_pool(ins, attrs, opset):
    x = ins[0]
    return [OP["max"](x, axis=tuple(range(2, len(x.shape))), keepdims=True)]


# ----------------------------------------------------------------------------------------
# Resize and Upsample: per resized axis constant taps from output to input cells (one
# index for nearest; for linear and cubic the 2 or 4 cells each output cell mixes, and
# their weights), so the result is a take (and a weighted sum) and every derivative is
# theirs. Memory grows with the output, never with output x input (a dense interpolation
# map of a long axis would be gigabytes for an answer of kilobytes).
# ----------------------------------------------------------------------------------------

RESIZE_MODES = ("nearest", "linear", "cubic")
RESIZE_COORDINATES = (
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
    "half_pixel_symmetric",
)  # fmt: skip
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _source_coordinates(size: int, out: int, scale: float, mode: str) -> np.ndarray:
    """x_original for each output cell (Operators.md, Resize: coordinate_transformation_mode)."""
    x = np.arange(out, dtype=np.float64)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if mode == "align_corners":
        return x * (size - 1) / (out - 1) if out > 1 else np.zeros(out)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / (scale * size))
        return offset + (x + 0.5) / scale - 0.5
    raise OpError(f"coordinate_transformation_mode {mode!r} is not supported")


def _nearest_index(x: np.ndarray, size: int, mode: str) -> np.ndarray:
    frac = x - np.floor(x)
    if mode == "round_prefer_floor":
        index = np.where(frac == 0.5, np.floor(x), np.round(x))
    elif mode == "round_prefer_ceil":
        index = np.where(frac == 0.5, np.ceil(x), np.round(x))
    elif mode == "floor":
        index = np.floor(x)
    else:
        index = np.ceil(x)
    return np.clip(index, 0, size - 1).astype(np.int64)


def _linear_taps(x: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """([out, 2] cells, [out, 2] weights): the two cells around x (clamped to the edge
    cells, as the spec's edge padding does)."""
    x = np.clip(x, 0, size - 1)
    low = np.floor(x).astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    weight = x - low
    return np.stack([low, high], axis=1), np.stack([1 - weight, weight], axis=1)


def _cubic_taps(
    x: np.ndarray, size: int, a: float, exclude_outside: bool
) -> tuple[np.ndarray, np.ndarray]:
    """([out, 4] cells, [out, 4] weights): Keys' cubic convolution (coefficient a) over
    the four cells around x, cells beyond the edge read as the edge cell (or, with
    exclude_outside, dropped and the rest renormalized), as the spec and torch's bicubic
    do."""

    def kernel(d: np.ndarray) -> np.ndarray:
        d = np.abs(d)
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        return np.where(d <= 1, near, np.where(d < 2, far, 0.0))

    low = np.floor(x).astype(np.int64)
    cells = low[:, None] + np.arange(-1, 3)[None, :]  # [out, 4]
    weights = kernel(x[:, None] - cells)
    if exclude_outside:
        weights = np.where((cells < 0) | (cells >= size), 0.0, weights)
        weights = weights / weights.sum(axis=1, keepdims=True)
    return np.clip(cells, 0, size - 1), weights


def _resize(
    x: Any, scales: list[float], sizes: list[int], attrs: dict[str, Any], coords: str
) -> Any:
    mode = attrs.get("mode", "nearest")
    nearest = attrs.get("nearest_mode", "round_prefer_floor")
    for axis, (size, out, scale) in enumerate(zip(shape_of(x), sizes, scales)):
        if out == size and scale == 1.0:
            continue
        source = _source_coordinates(size, out, scale, coords)
        if mode == "nearest":
            x = OP["take"](x, _nearest_index(source, size, nearest), axis=axis)
            continue
        if mode == "linear":
            cells, weights = _linear_taps(source, size)
        else:
            a = float(attrs.get("cubic_coeff_a", -0.75))
            cells, weights = _cubic_taps(source, size, a, bool(attrs.get("exclude_outside", 0)))
        # x[..., cells, ...] is [..., out, taps, ...]: weight the taps and sum them.
        trailing = (1,) * (len(shape_of(x)) - axis - 1)
        weights = np.ascontiguousarray(weights.reshape(weights.shape + trailing), dtype=x.dtype)
        taken = OP["take"](x, cells, axis=axis)
        x = OP["sum"](OP["multiply"](taken, weights), axis=axis + 1)
    return x


@handler("Resize", static=(1, 2, 3))
def _resize_handler(ins, attrs, opset):
    x = ins[0]
    shape = shape_of(x)
    rank = len(shape)
    if opset < 11:  # Resize-10: (X, scales), asymmetric like Upsample
        scales_in, sizes_in, coords = ins[1], None, "asymmetric"
        attrs = {**attrs, "nearest_mode": "floor"}
    else:
        scales_in = ins[2] if len(ins) > 2 else None
        sizes_in = ins[3] if len(ins) > 3 else None
        coords = attrs.get("coordinate_transformation_mode", "half_pixel")
    axes = [a % rank for a in attrs.get("axes", range(rank))]
    scales, sizes = [1.0] * rank, list(shape)
    if sizes_in is not None and np.size(sizes_in):
        for a, n in zip(axes, ints(sizes_in)):
            sizes[a], scales[a] = n, n / shape[a]
    elif scales_in is not None and np.size(scales_in):
        for a, f in zip(axes, np.asarray(scales_in, dtype=np.float64).reshape(-1)):
            scales[a], sizes[a] = float(f), int(np.floor(shape[a] * float(f)))
    else:
        raise OpError("neither scales nor sizes is given")
    return [_resize(x, scales, sizes, attrs, coords)]


@handler("Upsample", static=(1,))
def _upsample(ins, attrs, opset):
    # Deprecated since opset 10: Resize-10 with asymmetric coordinates (nearest: floor);
    # scales an attribute before opset 9, an input after.
    x = ins[0]
    factors = attrs["scales"] if opset < 9 else np.asarray(ins[1], dtype=np.float64).reshape(-1)
    scales = [float(f) for f in factors]
    sizes = [int(np.floor(n * f)) for n, f in zip(shape_of(x), scales)]
    return [_resize(x, scales, sizes, {**attrs, "nearest_mode": "floor"}, "asymmetric")]


def resize_refusal(attrs: dict[str, Any]) -> str | None:
    mode = attrs.get("mode", "nearest")
    if mode not in RESIZE_MODES:
        return f"mode {mode!r} is not supported (only 'nearest', 'linear' and 'cubic')"
    coords = attrs.get("coordinate_transformation_mode", "half_pixel")
    if coords not in RESIZE_COORDINATES:
        return f"coordinate_transformation_mode {coords!r} is not supported"
    if attrs.get("nearest_mode", "round_prefer_floor") not in NEAREST_MODES:
        return f"nearest_mode {attrs['nearest_mode']!r} is not a valid value"
    if attrs.get("antialias", 0):
        return "antialias=1 is not supported"
    if attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return f"keep_aspect_ratio_policy {attrs['keep_aspect_ratio_policy']!r} is not supported"
    return None


REFUSALS["Resize"] = REFUSALS["Upsample"] = resize_refusal


# ----------------------------------------------------------------------------------------
# Reductions: axes an attribute before opset 18 (ReduceSum: before 13), an input after
# ----------------------------------------------------------------------------------------


def _reduce(op: str | Callable[..., Any], input_since: int) -> Handler:
    fn = OP[op] if isinstance(op, str) else op

    def run(ins, attrs, opset):
        x = ins[0]
        if opset >= input_since:
            axes = ins[1] if len(ins) > 1 else None
            axes = None if axes is None else ints(axes)
        else:
            axes = attrs.get("axes")
        keepdims = bool(attrs.get("keepdims", 1))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = None
        axis = None if axes is None else tuple(axes)
        return [fn(x, axis=axis, keepdims=keepdims)]

    return run


def _sum_of(f: Callable[[Any], Any]) -> Callable[..., Any]:
    return lambda x, axis, keepdims: OP["sum"](f(x), axis=axis, keepdims=keepdims)


def _l2(x: Any, axis: Any, keepdims: bool) -> Any:
    return OP["sqrt"](_sum_of(lambda v: OP["multiply"](v, v))(x, axis, keepdims))


_REDUCERS: tuple[tuple[str, str | Callable[..., Any], int], ...] = (
    ("ReduceL1", _sum_of(OP["abs"]), 18),
    ("ReduceL2", _l2, 18),
    ("ReduceSumSquare", _sum_of(lambda v: OP["multiply"](v, v)), 18),
    ("ReduceLogSumExp", "logsumexp", 18),
    ("ReduceSum", "sum", 13), ("ReduceMean", "mean", 18), ("ReduceMax", "max", 18),
    ("ReduceMin", "min", 18), ("ReduceProd", "prod", 18),
)  # fmt: skip
for _name, _reducer, _since in _REDUCERS:
    HANDLERS[_name] = _reduce(_reducer, _since)
    STATIC[_name] = (1,)


@handler("CumSum", static=(1,))
def _cumsum(ins, attrs, opset):
    return [
        OP["cumsum"](
            ins[0],
            axis=ints(ins[1])[0],
            exclusive=bool(attrs.get("exclusive", 0)),
            reverse=bool(attrs.get("reverse", 0)),
        )
    ]


# ----------------------------------------------------------------------------------------
# Shapes and indexing (their shape arguments are constants: folded or initializers)
# ----------------------------------------------------------------------------------------


@handler("Reshape", static=(1,))
def _reshape(ins, attrs, opset):
    x = ins[0]
    target = ints(ins[1])
    if not attrs.get("allowzero", 0):  # 0 copies the input's dimension
        target = [shape_of(x)[i] if d == 0 else d for i, d in enumerate(target)]
    return [OP["reshape"](x, tuple(target))]


@handler("Flatten")
def _flatten(ins, attrs, opset):
    x = ins[0]
    shape = shape_of(x)
    axis = int(attrs.get("axis", 1)) % (len(shape) + 1) if shape else 0
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    return [OP["reshape"](x, (rows, int(np.prod(shape[axis:], dtype=np.int64))))]


@handler("Transpose")
def _transpose(ins, attrs, opset):
    perm = attrs.get("perm")
    return [OP["transpose"](ins[0], axes=None if perm is None else tuple(perm))]


def _axes(ins, attrs, opset, since=13) -> list[int] | None:
    if opset >= since:
        return ints(ins[1]) if len(ins) > 1 and ins[1] is not None else None
    axes = attrs.get("axes")
    return None if axes is None else list(axes)


@handler("Squeeze", static=(1,))
def _squeeze(ins, attrs, opset):
    x = ins[0]
    axes = _axes(ins, attrs, opset)
    shape = shape_of(x)
    if axes is None:
        axes = [i for i, d in enumerate(shape) if d == 1]
    axes = {a % len(shape) for a in axes}
    return [OP["reshape"](x, tuple(d for i, d in enumerate(shape) if i not in axes))]


@handler("Unsqueeze", static=(1,))
def _unsqueeze(ins, attrs, opset):
    x = ins[0]
    axes = _axes(ins, attrs, opset)
    rank = len(x.shape) + len(axes)
    axes = sorted(a % rank for a in axes)
    shape = list(shape_of(x))
    for a in axes:
        shape.insert(a, 1)
    return [OP["reshape"](x, tuple(shape))]


@handler("Concat")
def _concat(ins, attrs, opset):
    parts = [x for x in ins if x is not None]
    ref = next((x for x in parts if not isinstance(x, np.ndarray)), parts[0])
    parts = [_like(x, ref) if isinstance(x, np.ndarray) else x for x in parts]
    return [OP["concatenate"](parts, axis=int(attrs["axis"]))]


def split(ins, attrs, opset, outputs: int) -> list[Any]:
    x = ins[0]
    shape = shape_of(x)
    axis = int(attrs.get("axis", 0)) % len(shape)
    if opset >= 13:
        sizes = ints(ins[1]) if len(ins) > 1 and ins[1] is not None else None
    else:
        sizes = attrs.get("split")
    dim = shape[axis]
    if sizes is None:
        n = int(attrs.get("num_outputs", outputs))
        chunk = -(-dim // n)  # ceil: the last chunk is smaller when dim % n != 0
        sizes = [min(chunk, dim - i * chunk) for i in range(n)]
    out, start = [], 0
    for size in sizes:
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, start + size)
        out.append(OP["getitem"](x, tuple(index)))
        start += size
    return out


@handler("Slice", static=(1, 2, 3, 4))
def _slice(ins, attrs, opset):
    x = ins[0]
    shape = shape_of(x)
    if opset < 10:
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = ints(ins[1]), ints(ins[2])
        axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    index = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= len(shape)
        dim = shape[axis]
        if step == 0:
            raise OpError("a step of 0")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:  # clamped to [0, dim]
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            index[axis] = slice(start, end, step)
        else:  # clamped to [0, dim-1] and [-1, dim-1]; -1 means "past the front"
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            index[axis] = slice(start, None if end < 0 else end, step)
    return [OP["getitem"](x, tuple(index))]


@handler("Gather")
def _gather(ins, attrs, opset):
    x, indices = ins[0], ins[1]
    axis = int(attrs.get("axis", 0))
    if isinstance(indices, np.ndarray):  # negative indices count from the end
        dim = shape_of(x)[axis]
        indices = np.where(indices < 0, indices + dim, indices)
    return [OP["take"](x, indices, axis=axis)]


@handler("GatherND", static=(1,))
def _gather_nd(ins, attrs, opset):
    # Constant indices (AdaptiveAvgPool's windows, the dynamo exporter's linear resize):
    # the batch axes become explicit leading coordinates, negative indices count from the
    # end, and the engine's gather_nd (a getitem, differentiable in the data) does the rest.
    x, indices = ins[0], np.asarray(ins[1], dtype=np.int64)
    batch = int(attrs.get("batch_dims", 0))
    shape = shape_of(x)
    depth = indices.shape[-1]
    dims = np.array(shape[batch : batch + depth], dtype=np.int64)
    if np.any(indices >= dims) or np.any(indices < -dims):
        raise OpError(f"an index is out of bounds for the data's shape {list(shape)}")
    indices = np.where(indices < 0, indices + dims, indices)
    if batch:
        grid = np.indices(indices.shape[:batch])  # [batch, *batch shape]
        lead = np.broadcast_to(
            np.moveaxis(grid, 0, -1).reshape(
                indices.shape[:batch] + (1,) * (indices.ndim - batch - 1) + (batch,)
            ),
            indices.shape[:-1] + (batch,),
        )
        indices = np.concatenate([lead, indices], axis=-1)
    return [OP["gather_nd"](x, indices)]


@handler("Expand", static=(1,))
def _expand(ins, attrs, opset):
    x = ins[0]
    shape = np.broadcast_shapes(shape_of(x), tuple(ints(ins[1])))
    return [OP["broadcast_to"](x, shape)]


@handler("Tile", static=(1,))
def _tile(ins, attrs, opset):
    return [OP["tile"](ins[0], multiples=tuple(ints(ins[1])))]


@handler("Pad", static=(1, 2, 3))
def _pad(ins, attrs, opset):
    x = ins[0]
    rank = len(x.shape)
    mode = attrs.get("mode", "constant")
    if mode != "constant":
        raise OpError(f"mode {mode!r}: only 'constant' padding is supported")
    if opset < 11:
        pads, value = list(attrs["pads"]), float(attrs.get("value", 0.0))
        axes = list(range(rank))
    else:
        pads = ints(ins[1])
        value = ins[2] if len(ins) > 2 and ins[2] is not None else 0.0
        value = float(np.asarray(value).reshape(-1)[0]) if np.size(value) else 0.0
        axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(rank))
    n = len(axes)
    widths = [[0, 0] for _ in range(rank)]
    for i, axis in enumerate(axes):
        widths[axis % rank] = [pads[i], pads[i + n]]
    if any(w < 0 for pair in widths for w in pair):
        raise OpError("negative pads (cropping) are not supported")
    return [OP["pad"](x, paddings=tuple(map(tuple, widths)), constant_values=value)]


@handler("Trilu", static=(1,))
def _trilu(ins, attrs, opset):
    x = ins[0]
    k = ints(ins[1])[0] if len(ins) > 1 and ins[1] is not None else 0
    rows, cols = shape_of(x)[-2:]
    tri = np.triu if attrs.get("upper", 1) else np.tril
    mask = tri(np.ones((rows, cols), dtype=bool), k)
    return [OP["where"](mask, x, np.zeros((), dtype=x.dtype))]


@handler("Shape")
def _shape(ins, attrs, opset):
    shape = np.array(shape_of(ins[0]), dtype=np.int64)
    start, end = attrs.get("start", 0), attrs.get("end")
    return [shape[start:end]]


@handler("Size")
def _size(ins, attrs, opset):
    return [np.array(int(np.prod(shape_of(ins[0]), dtype=np.int64)), dtype=np.int64)]


# Split needs its number of outputs (run_node passes it); listed here as supported.
HANDLERS["Split"] = lambda ins, attrs, opset: split(ins, attrs, opset, len(ins))
STATIC["Split"] = (1,)


# Sequences: what torch.onnx's dynamo exporter (optimize=False, as the bridge exports)
# writes for torch.split/chunk/unbind, a SplitToSequence read back by SequenceAt at
# constant positions. A sequence is a Python list of the parts while the graph runs.
@handler("SplitToSequence", static=(1,))
def _split_to_sequence(ins, attrs, opset):
    x = ins[0]
    shape = shape_of(x)
    axis = int(attrs.get("axis", 0)) % len(shape)
    given = ins[1] if len(ins) > 1 and ins[1] is not None else None
    if given is None:  # parts of one along the axis, that axis dropped unless keepdims
        parts = split([x], {"axis": axis}, 13, shape[axis])
        if not attrs.get("keepdims", 1):
            kept = tuple(d for i, d in enumerate(shape) if i != axis)
            parts = [OP["reshape"](p, kept) for p in parts]
        return [parts]
    sizes = ints(given)
    if np.ndim(given) == 0:  # one size: equal parts, the last one smaller
        size, dim = sizes[0], shape[axis]
        sizes = [min(size, dim - start) for start in range(0, dim, size)]
    return [split([x, np.array(sizes, dtype=np.int64)], {"axis": axis}, 13, len(sizes))]


@handler("SequenceAt", static=(1,))
def _sequence_at(ins, attrs, opset):
    parts, position = ins[0], ints(ins[1])[0]
    if not -len(parts) <= position < len(parts):
        raise OpError(f"position {position} is outside a sequence of {len(parts)} tensors")
    return [parts[position]]


def refusal(op_type: str, attrs: dict[str, Any], outputs: Sequence[str]) -> str | None:
    """Why a node of a supported op cannot run here (an attribute or output this runtime
    does not implement), known from the node alone; None when it can."""
    used = [bool(n) for n in outputs]
    if op_type == "MaxPool":
        if len(used) > 1 and any(used[1:]):
            return "the Indices output is not supported"
        if attrs.get("storage_order", 0):
            return "storage_order=1 is not supported"
    if op_type == "AveragePool" and any(d != 1 for d in attrs.get("dilations", [])):
        return "dilations other than 1 are not supported"
    if op_type == "Pad" and attrs.get("mode", "constant") != "constant":
        return f"mode {attrs['mode']!r} is not supported (only 'constant')"
    if op_type in ("Conv", "MaxPool", "AveragePool") and attrs.get("auto_pad", "NOTSET") not in (
        "NOTSET",
        "",
        "VALID",
        "SAME_UPPER",
        "SAME_LOWER",
    ):
        return f"auto_pad {attrs['auto_pad']!r} is not a valid value"
    if op_type in REFUSALS:
        return REFUSALS[op_type](attrs)
    if op_type == "Gelu" and attrs.get("approximate", "none") not in ("none", "tanh"):
        return f"approximate={attrs['approximate']!r} is not 'none' or 'tanh'"
    return None


def run_node(
    op_type: str, ins: Sequence[Any], attrs: dict[str, Any], opset: int, outputs: int
) -> list[Any]:
    if op_type == "Split":
        return split(list(ins), attrs, opset, outputs)
    if op_type == "LayerNormalization":
        return layer_norm_node(list(ins), attrs, opset, outputs)
    return HANDLERS[op_type](list(ins), attrs, opset)


# Ops whose value is only ever computed at load time (from constants): folded by the
# reference evaluator, never run on tensors. Listed so a graph using them on computed
# values says so precisely.
FOLD_ONLY = frozenset({"Constant", "ConstantOfShape", "Range", "NonZero", "OneHot", "EyeLike"})
