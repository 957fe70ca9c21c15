"""Neural-network building blocks, all composites of primitives: softmax, losses,
normalization, clip_by_norm, and stop_gradient."""

from __future__ import annotations

from typing import Any

from engine import backend
from engine.backend import host
from engine.kernels import layernorm as layernorm_kernel
from engine.kernels import layernorm_affine as affine_kernel
from engine.kernels import softmax as softmax_kernel
from engine.ops._util import normalize_axes
from engine.ops.elementwise import (
    abs,
    add,
    divide,
    exp,
    greater,
    less_equal,
    maximum,
    minimum,
    multiply,
    negative,
    softplus,
    sqrt,
    square,
    stop,
    subtract,
    where,
)
from engine.ops.linalg import matmul
from engine.ops.reduce import logsumexp, mean, row_sum, sum, sums_rows, var
from engine.ops.shape import reshape, swapaxes, take
from engine.registry import REPEATS_SHARED, defform, defjvp, defvjp, primitive, public, zero_vjp
from engine.shapes import (
    RuleError,
    TensorType,
    axis_index,
    broadcast,
    check_nonempty,
    check_positive,
    check_same_shape,
    checked,
    concrete,
    pair,
    require,
    same_type,
)
from engine.shapes import normalize_axes as axes_of  # the rules' (RuleError, no op name)
from engine.tensor import Tensor, as_tensor, bind, host_value, pass_constant

LOSS = {"reduction": "reduction"}


@public("control", shape_rule=same_type)
def stop_gradient(x: Any) -> Tensor:
    """x's value, cut off from every tape: no gradient flows through it."""
    return stop(as_tensor(x))


# ---- softmax ----
def softmax_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    check_softmax_axis(x.shape, b.get("axis", -1))
    return x


def check_softmax_axis(shape: tuple[int, ...], axis: int) -> None:
    """A softmax normalizes over its axis: the axis must hold elements."""
    (a,) = axes_of(axis, len(shape))
    if shape[a] == 0:
        raise RuleError(f"axis {axis} of shape {shape} is empty: nothing to normalize over")


@public("nn", shape_rule=softmax_rule, kinds={"axis": "axis"})
def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """x - logsumexp(x) over `axis`."""
    x = as_tensor(x)
    return subtract(x, logsumexp(x, axis, keepdims=True))


# softmax is one primitive (exp(x - max) / sum: 4 passes where the composite
# exp(x - logsumexp(x)) takes 8 and its backward ~10), its VJP another:
# softmax_grad(g, y) = y * (g - sum(g * y)), 4 passes. The Jacobian diag(y) - y y^T is
# symmetric, so softmax_grad is also its own VJP in g and the JVP of softmax.
def _row_sum(xp: Any, x: Any, axis: int) -> Any:
    if xp is host and sums_rows(x.shape, x.flags.c_contiguous, x.dtype, (axis,)):
        return row_sum(x, keepdims=True)
    return xp.sum(x, axis=axis, keepdims=True)


def _row_max(xp: Any, x: Any, axis: int) -> Any:
    """max over `axis` (keepdims). Over a short last axis (attention's rows of 16) as a
    tree of elementwise maximums of halves: NumPy's max runs its inner loop once per row
    (0.23 ms for 65,536 rows of 16 float32, against ~0.05 for the tree)."""
    k = x.shape[-1] if x.ndim else 0
    if xp is not host or axis not in (-1, x.ndim - 1) or not 1 < k <= 256:
        return xp.max(x, axis=axis, keepdims=True)
    top = x
    while k > 1:
        h = k // 2
        halves = xp.maximum(top[..., :h], top[..., h : 2 * h])
        if k % 2:  # the odd one out joins the first column
            xp.maximum(halves[..., :1], top[..., 2 * h :], out=halves[..., :1])
        top, k = halves, h
    return top


def _softmax_into(xp: Any, x: Any, axis: int, out: Any) -> Any:
    # float32 over the last axis: a compiled kernel (engine/kernels/softmax.py), one pass
    # per row in float64, rounded once (not bit-identical: within NumPy's path's error)
    if xp is host and softmax_kernel.softmax(x, axis, out) is not None:
        return out
    return _softmax_numpy(xp, x, axis, out)


def _softmax_numpy(xp: Any, x: Any, axis: int, out: Any) -> Any:
    xp.subtract(x, _row_max(xp, x, axis), out=out)
    xp.exp(out, out=out)
    out /= _row_sum(xp, out, axis)
    return out


def _softmax_impl(xp: Any, x: Any, *, axis: int) -> Any:
    return _softmax_into(xp, x, axis, xp.empty(x.shape, x.dtype))


def _softmax_grad_into(xp: Any, g: Any, y: Any, axis: int, out: Any) -> Any:
    # y * (g - sum(g y)) (PyTorch's softmax backward), in `out` alone: no work array, so
    # nothing a compiled replay keeps beyond its accounted buffers. out is never g (the
    # replay writes in place only into elementwise ops' operands).
    xp.multiply(g, y, out=out)
    xp.subtract(g, _row_sum(xp, out, axis), out=out)
    out *= y
    return out


def _softmax_grad_impl(xp: Any, g: Any, y: Any, *, axis: int) -> Any:
    shape = host.broadcast_shapes(g.shape, y.shape)
    return _softmax_grad_into(xp, g, y, axis, xp.empty(shape, y.dtype))


def _form(into: Any) -> Any:
    """A replay form maker for an `into(*arrays, out, **params)` core (engine.registry.defform)."""

    def maker(params: dict, operands: list, value: Any) -> Any:
        def form(*arrays: Any) -> Any:
            *ins, out = arrays
            if out is None:
                out = host.empty(value.shape, value.dtype)
            return into(*ins, out=out, **params)

        return form

    return maker


softmax_p = primitive("softmax", _softmax_impl, flow="rows")
softmax_grad_p = primitive("softmax_grad", _softmax_grad_impl, broadcasting=True, flow="rows")


def _softmax_grad(g: Tensor, y: Tensor, axis: int) -> Tensor:
    return bind(softmax_grad_p, g, y, axis=axis)


def _softmax_grad_dy(g: Tensor, y: Tensor, ty: Tensor, axis: int) -> Tensor:
    """d/dy of y * (g - sum(g y)) along ty: ty * (g - sum(g y)) - y * sum(g ty)."""
    centered = subtract(g, sum(multiply(g, y), axis, keepdims=True))
    return subtract(multiply(ty, centered), multiply(y, sum(multiply(g, ty), axis, keepdims=True)))


defvjp(softmax_p, lambda ans, x, *, axis: lambda g: _softmax_grad(g, ans, axis))
defjvp(softmax_p, lambda t, ans, x, *, axis: _softmax_grad(t[0], ans, axis))
defvjp(
    softmax_grad_p,
    lambda ans, g, y, *, axis: lambda u: _softmax_grad(u, y, axis),
    # <u, ty * c - y * sum(g ty)> = <ty, u * c - g * sum(u y)>, c = g - sum(g y)
    lambda ans, g, y, *, axis: (
        lambda u: subtract(
            multiply(u, subtract(g, sum(multiply(g, y), axis, keepdims=True))),
            multiply(g, sum(multiply(u, y), axis, keepdims=True)),
        )
    ),
)
defjvp(
    softmax_grad_p,
    lambda t, ans, g, y, *, axis: _sum_terms(
        None if t[0] is None else _softmax_grad(t[0], y, axis),
        None if t[1] is None else _softmax_grad_dy(g, y, t[1], axis),
    ),
)


defform(softmax_p, _form(lambda x, out, axis: _softmax_into(host, x, axis, out)))
defform(softmax_grad_p, _form(lambda g, y, out, axis: _softmax_grad_into(host, g, y, axis, out)))


def _sum_terms(a: Tensor | None, b: Tensor | None) -> Tensor:
    if a is None:
        assert b is not None
        return b
    return a if b is None else add(a, b)


@public("nn", shape_rule=softmax_rule, kinds={"axis": "axis"})
def softmax(x: Any, axis: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) over `axis`, computed stably."""
    x = as_tensor(x)
    checked("softmax", check_softmax_axis, x.shape, axis)
    (axis,) = normalize_axes(axis, x.ndim, "softmax")
    if x.dtype.kind != "f" or x.ndim == 0:
        return exp(log_softmax(x, axis))
    return bind(softmax_p, x, axis=axis)


# ---- losses ----
_REDUCTIONS = ("mean", "sum", "none")


def _reduce(losses: Tensor, reduction: str, opname: str) -> Tensor:
    if reduction == "mean":
        return mean(losses)
    if reduction == "sum":
        return sum(losses)
    if reduction == "none":
        return losses
    raise ValueError(f"{opname}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _reduced_loss(losses: TensorType, reduction: str) -> TensorType:
    if reduction == "none":
        return losses
    if reduction == "mean":
        check_nonempty(losses.shape, axes_of(None, losses.ndim))
    return TensorType((), losses.dtype)


def pointwise_loss_rule(b: dict[str, Any]) -> TensorType:
    p, t = concrete(b["predictions"]), concrete(b["targets"])
    check_same_shape(p.shape, t.shape)
    p, t = pair(p, t)
    require(p, "float", "predictions")
    check_positive("delta", b.get("delta", 1.0))
    return _reduced_loss(p, b.get("reduction", "mean"))


@public("loss", shape_rule=pointwise_loss_rule, kinds=LOSS)
def mean_squared_error(predictions: Any, targets: Any, reduction: str = "mean") -> Tensor:
    """(predictions - targets)**2, averaged over all elements by default."""
    predictions, targets = as_tensor(predictions), as_tensor(targets)
    checked("mean_squared_error", check_same_shape, predictions.shape, targets.shape)
    return _reduce(square(subtract(predictions, targets)), reduction, "mean_squared_error")


@public("loss", shape_rule=pointwise_loss_rule, kinds={"delta": "float", **LOSS})
def huber(predictions: Any, targets: Any, delta: float = 1.0, reduction: str = "mean") -> Tensor:
    """Quadratic within `delta` of the target, linear beyond (Huber loss)."""
    predictions, targets = as_tensor(predictions), as_tensor(targets)
    checked("huber", check_same_shape, predictions.shape, targets.shape)
    checked("huber", check_positive, "delta", delta)
    err = abs(subtract(predictions, targets))
    quadratic = multiply(square(err), 0.5)
    linear = subtract(multiply(err, delta), 0.5 * delta * delta)
    return _reduce(where(less_equal(err, delta), quadratic, linear), reduction, "huber")


def check_label_shape(labels: tuple, expected: tuple, logits: tuple) -> None:
    if labels != expected:
        raise RuleError(
            f"integer labels must have shape {expected} for logits {logits}, got {labels}"
        )


def check_soft_label_shape(labels: tuple, logits: tuple, rest: tuple, dtype: Any) -> None:
    """Float labels are one-hot or soft (the logits' shape); float labels of the shape of
    class indices are class indices sent with the wrong dtype: say so, not "shape"."""
    if labels != logits and labels == rest:
        raise RuleError(
            f"labels of shape {labels} are class indices of logits {logits}, but "
            f"{dtype}: integer class indices need an integer dtype (int32 or int64); "
            f"float labels are one-hot or soft, of the logits' shape {logits}"
        )
    check_same_shape(logits, labels, "logits and labels")


def softmax_cross_entropy_rule(b: dict[str, Any]) -> TensorType:
    logits, labels = concrete(b["logits"]), concrete(b["labels"])
    require(logits, "float", "logits")
    axis = axis_index(b.get("axis", -1), logits.ndim)
    check_nonempty(logits.shape, (axis - logits.ndim,))
    rest = logits.shape[:axis] + logits.shape[axis + 1 :]
    if labels.dtype.kind in "iu":
        check_label_shape(labels.shape, rest, logits.shape)
    else:
        check_soft_label_shape(labels.shape, logits.shape, rest, labels.dtype)
        pair(logits, labels)
    return _reduced_loss(TensorType(rest, logits.dtype), b.get("reduction", "mean"))


@public("loss", shape_rule=softmax_cross_entropy_rule, kinds={"axis": "axis", **LOSS})
def softmax_cross_entropy(
    logits: Any, labels: Any, axis: int = -1, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of softmax(logits) against integer class labels or one-hot/soft labels.

    Integer labels have logits' shape without the class axis; float labels have logits'
    shape.
    """
    logits, labels = as_tensor(logits), as_tensor(labels)
    (axis,) = normalize_axes(axis, logits.ndim, "softmax_cross_entropy")
    logp = log_softmax(logits, axis)
    if labels.dtype.kind in "iu":
        expected = tuple(d for i, d in enumerate(logits.shape) if i - logits.ndim != axis)
        checked("softmax_cross_entropy", check_label_shape, labels.shape, expected, logits.shape)
        classes = logits.shape[axis]
        xp = backend.array_module(labels.value)
        values = host_value(labels)
        if labels.size and (int(values.min()) < 0 or int(values.max()) >= classes):
            raise ValueError(f"softmax_cross_entropy: labels must lie in [0, {classes})")
        lab = xp.expand_dims(values, axis)
        shape = [1] * logits.ndim
        shape[axis] = classes
        one_hot = pass_constant((lab == xp.arange(classes).reshape(shape)).astype(logits.dtype))
    else:
        rest = tuple(d for i, d in enumerate(logits.shape) if i - logits.ndim != axis)
        checked(
            "softmax_cross_entropy",
            check_soft_label_shape,
            labels.shape,
            logits.shape,
            rest,
            labels.dtype,
        )
        one_hot = labels
    losses = negative(sum(multiply(one_hot, logp), axis))
    return _reduce(losses, reduction, "softmax_cross_entropy")


def sigmoid_cross_entropy_rule(b: dict[str, Any]) -> TensorType:
    logits, labels = concrete(b["logits"]), concrete(b["labels"])
    check_same_shape(logits.shape, labels.shape, "logits and labels")
    logits, _ = pair(logits, labels)
    require(logits, "float", "logits")
    return _reduced_loss(logits, b.get("reduction", "mean"))


@public("loss", shape_rule=sigmoid_cross_entropy_rule, kinds=LOSS)
def sigmoid_cross_entropy(logits: Any, labels: Any, reduction: str = "mean") -> Tensor:
    """Binary cross-entropy of sigmoid(logits) against labels in [0, 1], computed stably."""
    logits, labels = as_tensor(logits), as_tensor(labels)
    checked(
        "sigmoid_cross_entropy", check_same_shape, logits.shape, labels.shape, "logits and labels"
    )
    losses = subtract(softplus(logits), multiply(logits, labels))
    return _reduce(losses, reduction, "sigmoid_cross_entropy")


# ---- normalization ----
def _affine(y: Tensor, gamma: Any, beta: Any) -> Tensor:
    if gamma is not None:
        y = multiply(y, as_tensor(gamma))
    if beta is not None:
        y = add(y, as_tensor(beta))
    return y


def check_batch_rank(shape: tuple[int, ...]) -> None:
    if len(shape) < 2:
        raise RuleError(f"needs a batch axis and a feature axis, got shape {shape}")


def _normalization_rule(batch: bool) -> Any:
    """batch_norm's and layer_norm's: statistics over every axis but the last, or the
    last; gamma and beta broadcast against the result."""

    def rule(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        require(x, "float")
        if batch:
            check_batch_rank(x.shape)
        axes = tuple(range(-x.ndim, -1)) if batch else axes_of(-1, x.ndim)
        check_nonempty(x.shape, axes)
        out = x
        for name in ("gamma", "beta"):
            if b.get(name) is not None:
                out, other = pair(out, concrete(b[name]))
                out = TensorType(broadcast(out.shape, other.shape), out.dtype)
        return out

    return rule


@public("nn", shape_rule=_normalization_rule(batch=True), kinds={"eps": "float"})
def batch_norm(x: Any, gamma: Any = None, beta: Any = None, eps: float = 1e-5) -> Tensor:
    """Training-mode batch normalization: statistics over every axis but the last.

    The examples of a batch are *not* independent through it (each output depends on
    the whole batch), which is what a batch jacobian checks for.
    """
    x = as_tensor(x)
    checked("batch_norm", check_batch_rank, x.shape)
    axes = tuple(range(-x.ndim, -1))
    centered = subtract(x, mean(x, axes, keepdims=True))
    scale = sqrt(add(var(x, axes, keepdims=True), eps))
    return _affine(divide(centered, scale), gamma, beta)


# ---- normalize over the last axis (layer norm's core, without its scale and bias) ----
# One primitive, xhat = (x - mean) / sqrt(var + eps) per row, and its VJP another,
# normalize_grad(a, x, xhat) = r (a - mean(a) - xhat mean(a xhat)), r = 1 / sqrt(var +
# eps) recomputed from x rather than kept. The composite of means, variance, sqrt and
# divide took ~9 calls forward and ~20 backward (issue 28). In NumPy alone the fused
# form did not pay (bench/RESULTS.md, "Fused softmax and GELU"): its broadcasts against
# the rows' statistics cost ~2x a plain pass. With those steps as kernels
# (engine/kernels/layernorm.py; the row sums stay GEMVs) it does: 0.067 -> 0.044 ms
# forward, 0.149 -> 0.086 backward on 1,024 rows of 64 float32, and the transformer's
# compiled gradient ~0.4 ms less. normalize_grad is linear in a and self-adjoint (its
# matrix r (I - 11^T/n - xhat xhat^T/n) is symmetric), hence its own VJP in a and
# normalize's JVP; its rule for x is the total derivative (xhat is a cache of
# normalize(x): its rule is zero), written in ops for higher orders. Both are row ops
# (element flow "rows"); normalize_grad broadcasts (batches of tangents meet a record).
def _inverse_std(xp: Any, x: Any, eps: float, centered: Any) -> Any:
    """1 / sqrt(var + eps) over the last axis (keepdims), x - mean written to `centered`.
    On NumPy arrays the broadcast steps run as kernels (engine/kernels/layernorm.py),
    the same operations in the same order: the same bits."""
    inv_n = x.dtype.type(1 / x.shape[-1])
    mean_x = _row_sum(xp, x, -1)
    mean_x *= inv_n
    squares = xp.empty(x.shape, x.dtype)
    if not (xp is host and layernorm_kernel.center(x, mean_x, centered, squares)):
        xp.subtract(x, mean_x, out=centered)
        xp.multiply(centered, centered, out=squares)
    var_x = _row_sum(xp, squares, -1)
    var_x *= inv_n
    var_x += x.dtype.type(eps)
    xp.sqrt(var_x, out=var_x)
    return xp.reciprocal(var_x, out=var_x)


def _normalize_into(xp: Any, x: Any, eps: float, out: Any) -> Any:
    r = _inverse_std(xp, x, eps, out)
    if not (xp is host and layernorm_kernel.scale_rows(out, r)):
        xp.multiply(out, r, out=out)
    return out


def _normalize_impl(xp: Any, x: Any, *, eps: float) -> Any:
    return _normalize_into(xp, x, eps, xp.empty(x.shape, x.dtype))


def _normalize_grad_blocks(a: Any, x: Any, xhat: Any, eps: float, out: Any) -> bool:
    """A batch of cotangents against one x (out (*lead, *x.shape); the fresh HVP's N(t)
    for its vectors) on the host: block by block, each the unbatched call (its kernels
    take one statistic per row; the broadcast NumPy path ran 0.19 ms against 0.13 for a
    batch of one of (64, 16, 64) float32). False where the layouts are not these."""
    lead = out.shape[: out.ndim - x.ndim]
    if not lead or a.shape != out.shape or xhat.shape not in (x.shape, out.shape):
        return False
    if not out.flags.c_contiguous:  # (its blocks must be views to write into)
        return False
    count = int(host.prod(lead))
    a_blocks = a.reshape((count,) + x.shape)
    xhat_blocks = xhat.reshape((-1,) + x.shape)
    out_blocks = out.reshape((count,) + x.shape)
    for b in range(count):
        xhat_b = xhat_blocks[b if xhat_blocks.shape[0] == count else 0]
        _normalize_grad_into(host, a_blocks[b], x, xhat_b, eps, out_blocks[b])
    return True


def _normalize_grad_into(xp: Any, a: Any, x: Any, xhat: Any, eps: float, out: Any) -> Any:
    inv_n = x.dtype.type(1 / x.shape[-1])
    if out.shape != x.shape and xp is host and _normalize_grad_blocks(a, x, xhat, eps, out):
        return out
    if out.shape == x.shape:
        r = _inverse_std(xp, x, eps, out)  # (out is free until the last steps)
    else:  # a batch of cotangents against one x
        r = _inverse_std(xp, x, eps, xp.empty(x.shape, x.dtype))
    mean_a_xhat = _row_sum(xp, a * xhat, -1)
    mean_a_xhat *= inv_n
    mean_a = _row_sum(xp, a, -1)
    mean_a *= inv_n
    if not (xp is host and layernorm_kernel.combine(a, xhat, mean_a_xhat, mean_a, r, out)):
        xp.multiply(xhat, mean_a_xhat, out=out)
        xp.subtract(a, out, out=out)
        out -= mean_a
        out *= r
    return out


def _normalize_grad_impl(xp: Any, a: Any, x: Any, xhat: Any, *, eps: float) -> Any:
    shape = host.broadcast_shapes(a.shape, x.shape)
    return _normalize_grad_into(xp, a, x, xhat, eps, xp.empty(shape, x.dtype))


normalize_p = primitive("normalize", _normalize_impl, flow="rows")
normalize_grad_p = primitive("normalize_grad", _normalize_grad_impl, broadcasting=True, flow="rows")


def _normalize_grad(a: Tensor, x: Tensor, xhat: Tensor, eps: float) -> Tensor:
    return bind(normalize_grad_p, a, x, xhat, eps=eps)


def _row_mean(x: Tensor) -> Tensor:
    return mean(x, -1, keepdims=True)


def _inverse_std_op(x: Tensor, eps: float) -> Tensor:
    return divide(1, sqrt(add(var(x, -1, keepdims=True), eps)))


def _normalize_grad_dx_vjp(ans: Tensor, a: Tensor, x: Tensor, xhat: Tensor, eps: float) -> Any:
    """u -> d<u, normalize_grad(a, x)>/dx = -r (mean(u dx) xhat + mean(u xhat) dx
    + mean(a xhat) normalize_grad(u, x)), dx = normalize_grad(a, x), per row."""

    def vjp(u: Tensor) -> Tensor:
        total = add(
            add(
                multiply(_row_mean(multiply(u, ans)), xhat),
                multiply(_row_mean(multiply(u, xhat)), ans),
            ),
            multiply(_row_mean(multiply(a, xhat)), _normalize_grad(u, x, xhat, eps)),
        )
        return negative(multiply(_inverse_std_op(x, eps), total))

    return vjp


def _normalize_grad_dx_jvp(
    ans: Tensor, a: Tensor, x: Tensor, xhat: Tensor, t: Tensor, eps: float
) -> Tensor:
    """normalize_grad(a, x)'s derivative in x along t: -r (mean(xhat t) dx
    + m dxhat + xhat mean(a dxhat)), dxhat = normalize_grad(t, x), m = mean(a xhat)."""
    dxhat = _normalize_grad(t, x, xhat, eps)
    total = add(
        add(
            multiply(_row_mean(multiply(xhat, t)), ans),
            multiply(_row_mean(multiply(a, xhat)), dxhat),
        ),
        multiply(xhat, _row_mean(multiply(a, dxhat))),
    )
    return negative(multiply(_inverse_std_op(x, eps), total))


defvjp(normalize_p, lambda ans, x, *, eps: lambda g: _normalize_grad(g, x, ans, eps))
defjvp(normalize_p, lambda t, ans, x, *, eps: _normalize_grad(t[0], x, ans, eps))
defvjp(
    normalize_grad_p,
    lambda ans, a, x, xhat, *, eps: lambda u: _normalize_grad(u, x, xhat, eps),
    lambda ans, a, x, xhat, *, eps: _normalize_grad_dx_vjp(ans, a, x, xhat, eps),
    lambda ans, a, x, xhat, *, eps: zero_vjp,
)
defjvp(
    normalize_grad_p,
    lambda t, ans, a, x, xhat, *, eps: _sum_terms(
        None if t[0] is None else _normalize_grad(t[0], x, xhat, eps),
        None if t[1] is None else _normalize_grad_dx_jvp(ans, a, x, xhat, t[1], eps),
    ),
)
# Rules of the second order call normalize(x) and normalize_grad(t, x, xhat) from
# several places (layer_norm_affine's and its VJPs' JVPs each want xhat and the tangent
# N(t)): a compiled replay computes each once (the transformer's fresh HVP: 20
# normalize calls become 5).
REPEATS_SHARED.update((normalize_p, normalize_grad_p))
defform(normalize_p, _form(lambda x, out, eps: _normalize_into(host, x, eps, out)))
defform(
    normalize_grad_p,
    _form(lambda a, x, xhat, out, eps: _normalize_grad_into(host, a, x, xhat, eps, out)),
)


# ---- layer norm with its affine over the last axis: y = normalize(x) * scale + shift ----
# Three primitives whose kernels each take a row at a time from x alone (engine/kernels/
# layernorm_affine.py: the row's statistics summed in its loop, xhat recomputed where
# needed; sums reassociated, so not the NumPy path's bits: the same formula to
# rounding), for scale and shift of shape (k,) and x's dtype (layer_norm_last_axis
# binds them; other layouts take normalize and the ops):
#   layer_norm_affine(x, scale, shift) = normalize(x) * scale + shift
#   layer_norm_affine_grad(g, x, scale) = normalize_grad(g * scale, x, xhat), x's VJP
#   layer_norm_scale_grad(g, x) = sum of g * xhat over x's leading axes, scale's
# (shift's VJP is g, summed by the tape). Where normalize, * scale, + shift and their
# VJPs took eight calls and ~12 passes a layer norm, forward and backward, these take
# three and three: the transformer's layer norms 1.5 -> ~0.8 ms of its compiled
# gradient (bench/RESULTS.md, "Layer norm with its affine as one primitive"). Without
# the kernels (CuPy, GRADTAPE_KERNELS=numpy, no numba) each is the composite of
# normalize's cores. Their rules beyond the first derivative are written in normalize /
# normalize_grad and the elementwise ops (what higher orders record), with
# N = normalize_grad(., x, xhat), symmetric (see normalize's block):
#   affine's JVP: s * N(t_x) + t_s * xhat + t_shift
#   affine_grad's VJP: in g, s * N(u); in x, normalize_grad's x-rule at a = g * s; in
#     s, g * N(u); its JVP along g is itself, along s affine_grad(g, x, t).
#   scale_grad's VJP: in g, u * xhat; in x, affine_grad(g, x, u) (u as the scale).
# Those rules ask for xhat and N(t) from several places: a compiled replay computes
# each once (REPEATS_SHARED, normalize's block). layer_norm_affine and its x-VJP are
# row ops (element flow "rows") declared broadcasting (batches of tangents and
# cotangents meet one x); scale_grad "reduces" over its `axes`.
def _layer_norm_affine_into(xp: Any, x: Any, scale: Any, shift: Any, eps: float, out: Any) -> Any:
    if xp is host and affine_kernel.affine_forward(x, scale, shift, eps, out):
        return out
    xhat = _normalize_into(xp, x, eps, xp.empty(x.shape, x.dtype))
    xp.multiply(xhat, scale, out=out)
    return xp.add(out, shift, out=out)


def _layer_norm_affine_impl(xp: Any, x: Any, scale: Any, shift: Any, *, eps: float) -> Any:
    shape = host.broadcast_shapes(x.shape, scale.shape, shift.shape)
    dtype = xp.result_type(x, scale, shift)
    return _layer_norm_affine_into(xp, x, scale, shift, eps, xp.empty(shape, dtype))


def _layer_norm_affine_grad_into(xp: Any, g: Any, x: Any, scale: Any, eps: float, out: Any) -> Any:
    if xp is host and affine_kernel.affine_grad(g, x, scale, eps, out):
        return out
    xhat = _normalize_into(xp, x, eps, xp.empty(x.shape, x.dtype))
    return _normalize_grad_into(xp, g * scale, x, xhat, eps, out)


def _layer_norm_affine_grad_impl(xp: Any, g: Any, x: Any, scale: Any, *, eps: float) -> Any:
    shape = host.broadcast_shapes(g.shape, x.shape, scale.shape)
    dtype = xp.result_type(g, x, scale)
    return _layer_norm_affine_grad_into(xp, g, x, scale, eps, xp.empty(shape, dtype))


def _layer_norm_scale_grad_into(
    xp: Any, g: Any, x: Any, eps: float, axes: tuple[int, ...], out: Any
) -> Any:
    if xp is host and affine_kernel.scale_grad(g, x, eps, out):
        return out
    xhat = _normalize_into(xp, x, eps, xp.empty(x.shape, x.dtype))
    return xp.sum(g * xhat, axis=axes, out=out)


def _layer_norm_scale_grad_impl(
    xp: Any, g: Any, x: Any, *, eps: float, axes: tuple[int, ...]
) -> Any:
    out = xp.empty(g.shape[: g.ndim - x.ndim] + x.shape[-1:], xp.result_type(g, x))
    return _layer_norm_scale_grad_into(xp, g, x, eps, axes, out)


layer_norm_affine_p = primitive(
    "layer_norm_affine", _layer_norm_affine_impl, broadcasting=True, flow="rows"
)
layer_norm_affine_grad_p = primitive(
    "layer_norm_affine_grad", _layer_norm_affine_grad_impl, broadcasting=True, flow="rows"
)
layer_norm_scale_grad_p = primitive(
    "layer_norm_scale_grad", _layer_norm_scale_grad_impl, flow="reduces"
)


def _xhat(x: Tensor, eps: float) -> Tensor:
    return bind(normalize_p, x, eps=eps)


def _affine_grad(g: Tensor, x: Tensor, scale: Tensor, eps: float) -> Tensor:
    return bind(layer_norm_affine_grad_p, g, x, scale, eps=eps)


def _sum_present(*terms: Tensor | None) -> Tensor:
    """The sum of the terms that are not None (a JVP's, one per argument with a tangent)."""
    present = [term for term in terms if term is not None]
    total = present[0]
    for term in present[1:]:
        total = add(total, term)
    return total


def _column_sum(v: Tensor, x: Tensor) -> Tensor:
    """v (*batch, *x.shape) summed over x's leading axes -> (*batch, k)."""
    return sum(v, tuple(range(v.ndim - x.ndim, v.ndim - 1)))


def _scale_grad(g: Tensor, x: Tensor, eps: float) -> Tensor:
    """sum of g * xhat over x's leading axes, g (*batch, *x.shape) -> (*batch, k)."""
    if g.shape[g.ndim - x.ndim :] == x.shape and x.ndim > 1:
        axes = tuple(range(g.ndim - x.ndim, g.ndim - 1))
        return bind(layer_norm_scale_grad_p, g, x, eps=eps, axes=axes)
    return _column_sum(multiply(g, _xhat(x, eps)), x)


def _scale_cotangent(g: Tensor, x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """scale's cotangent: summed (one kernel) where scale is a row; else g * xhat
    unreduced (a scale the per-example walk expanded to x's shape wants it so; the
    tape sums other shapes)."""
    if scale.shape == x.shape[-1:] and x.ndim > 1:
        return _scale_grad(g, x, eps)
    return multiply(g, _xhat(x, eps))


def _rows_of(u: Tensor, x: Tensor) -> Tensor:
    """A (..., k) cotangent of scale_grad laid out to broadcast against x's rows."""
    return reshape(u, u.shape[:-1] + (1,) * (x.ndim - 1) + x.shape[-1:]) if u.ndim > 1 else u


def _affine_grad_dx_vjp(ans: Tensor, g: Tensor, x: Tensor, scale: Tensor, eps: float) -> Any:
    def vjp(u: Tensor) -> Tensor:
        rule = _normalize_grad_dx_vjp(ans, multiply(g, scale), x, _xhat(x, eps), eps)
        return rule(u)

    return vjp


defvjp(
    layer_norm_affine_p,
    lambda ans, x, scale, shift, *, eps: lambda g: _affine_grad(g, x, scale, eps),
    lambda ans, x, scale, shift, *, eps: lambda g: _scale_cotangent(g, x, scale, eps),
    lambda ans, x, scale, shift, *, eps: lambda g: g,
)
defjvp(
    layer_norm_affine_p,
    lambda t, ans, x, scale, shift, *, eps: _sum_present(
        None if t[0] is None else multiply(_normalize_grad(t[0], x, _xhat(x, eps), eps), scale),
        None if t[1] is None else multiply(t[1], _xhat(x, eps)),
        t[2],  # (broadcast to the output by the accumulator)
    ),
)
defvjp(
    layer_norm_affine_grad_p,
    lambda ans, g, x, scale, *, eps: (
        lambda u: multiply(_normalize_grad(u, x, _xhat(x, eps), eps), scale)
    ),
    _affine_grad_dx_vjp,
    lambda ans, g, x, scale, *, eps: (
        lambda u: multiply(g, _normalize_grad(u, x, _xhat(x, eps), eps))
    ),
)
defjvp(
    layer_norm_affine_grad_p,
    lambda t, ans, g, x, scale, *, eps: _sum_present(
        None if t[0] is None else _affine_grad(t[0], x, scale, eps),
        None
        if t[1] is None
        else _normalize_grad_dx_jvp(ans, multiply(g, scale), x, _xhat(x, eps), t[1], eps),
        None if t[2] is None else _affine_grad(g, x, t[2], eps),
    ),
)
defvjp(
    layer_norm_scale_grad_p,
    lambda ans, g, x, *, eps, axes: lambda u: multiply(_rows_of(u, x), _xhat(x, eps)),
    lambda ans, g, x, *, eps, axes: lambda u: _affine_grad(g, x, _rows_of(u, x), eps),
)
defjvp(
    layer_norm_scale_grad_p,
    lambda t, ans, g, x, *, eps, axes: _sum_terms(
        None if t[0] is None else _scale_grad(t[0], x, eps),
        None
        if t[1] is None
        else _column_sum(multiply(g, _normalize_grad(t[1], x, _xhat(x, eps), eps)), x),
    ),
)
defform(
    layer_norm_affine_p,
    _form(
        lambda x, scale, shift, out, eps: _layer_norm_affine_into(host, x, scale, shift, eps, out)
    ),
)
defform(
    layer_norm_affine_grad_p,
    _form(lambda g, x, scale, out, eps: _layer_norm_affine_grad_into(host, g, x, scale, eps, out)),
)
defform(
    layer_norm_scale_grad_p,
    _form(lambda g, x, out, eps, axes: _layer_norm_scale_grad_into(host, g, x, eps, axes, out)),
)


def layer_norm_last_axis(x: Tensor, scale: Any, shift: Any, eps: float) -> Tensor:
    """normalize(x) * scale + shift over the last axis: the fused primitive where scale
    and shift are both given, of shape (k,) and x's floating dtype; else normalize and
    the ops (layer_norm's and the ONNX LayerNormalization's)."""
    scale = None if scale is None else as_tensor(scale)
    shift = None if shift is None else as_tensor(shift)
    fused = (
        scale is not None
        and shift is not None
        and x.dtype.kind == "f"
        and x.ndim > 0
        and x.shape[-1] > 0
        and scale.shape == shift.shape == x.shape[-1:]
        and scale.dtype == shift.dtype == x.dtype
    )
    if fused:
        return bind(layer_norm_affine_p, x, scale, shift, eps=float(eps))
    return _affine(normalize_last_axis(x, eps), scale, shift)


def normalize_last_axis(x: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the last axis (biased variance): one primitive
    for floating x (layer_norm's and the ONNX LayerNormalization's core)."""
    if x.dtype.kind != "f" or x.ndim == 0 or x.shape[-1] == 0:  # (mean names an empty axis)
        centered = subtract(x, mean(x, -1, keepdims=True))
        return divide(centered, sqrt(add(var(x, -1, keepdims=True), eps)))
    return bind(normalize_p, x, eps=float(eps))


@public("nn", shape_rule=_normalization_rule(batch=False), kinds={"eps": "float"})
def layer_norm(x: Any, gamma: Any = None, beta: Any = None, eps: float = 1e-5) -> Tensor:
    """Layer normalization: statistics over the last axis of each example."""
    return layer_norm_last_axis(as_tensor(x), gamma, beta, eps)


def clip_by_norm_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "float")
    check_positive("clip_norm", b.get("clip_norm", 1.0))
    axes_of(b.get("axis"), x.ndim)
    return x


@public("nn", shape_rule=clip_by_norm_rule, kinds={"clip_norm": "float", "axis": "axes"})
def clip_by_norm(x: Any, clip_norm: float = 1.0, axis: Any = None) -> Tensor:
    """x rescaled so its L2 norm (over `axis`) is at most clip_norm."""
    x = as_tensor(x)
    checked("clip_by_norm", check_positive, "clip_norm", clip_norm)
    # A norm that is safe at 0: sqrt's derivative there is 0/0, which would poison the
    # gradient even though maximum() does not pick that branch.
    l2 = sum(multiply(x, x), axis, keepdims=True)
    positive = greater(l2, 0)
    n = where(positive, sqrt(where(positive, l2, 1)), 0)
    return divide(multiply(x, clip_norm), maximum(n, as_tensor(clip_norm, like=n)))


def moments(x: Any, axes: Any = None, keepdims: bool = False) -> tuple[Tensor, Tensor]:
    """(mean, variance) over `axes` (tf.nn.moments).

    TensorFlow computes the variance around stop_gradient(mean), which leaves its second
    derivative without the -1/n term; here the variance is differentiated exactly (the
    first derivatives agree)."""
    x = as_tensor(x)
    axes = normalize_axes(axes, x.ndim, "moments")
    m = mean(x, axes, keepdims=True)
    v = mean(square(subtract(x, m)), axes, keepdims=True)
    if not keepdims:
        kept = tuple(d for i, d in enumerate(x.shape) if i - x.ndim not in axes)
        m, v = reshape(m, kept), reshape(v, kept)
    return m, v


def clip_by_global_norm(
    t_list: Any, clip_norm: float, use_norm: Any = None
) -> tuple[list[Tensor], Tensor]:
    """(tensors scaled so their joint L2 norm is at most clip_norm, the joint norm), with
    TensorFlow's formula (its derivatives included)."""
    tensors = [as_tensor(t) for t in t_list]
    if use_norm is None:
        half_squares = [multiply(sum(multiply(t, t)), 0.5) for t in tensors]
        total = half_squares[0]
        for h in half_squares[1:]:
            total = add(total, h)
        use_norm = sqrt(multiply(total, 2.0))
    use_norm = as_tensor(use_norm)
    limit = as_tensor(1.0 / clip_norm, like=use_norm)
    scale = multiply(minimum(divide(as_tensor(1.0, like=use_norm), use_norm), limit), clip_norm)
    # A no-op for a finite norm; NaN for an infinite one, as in TensorFlow.
    scale = add(scale, subtract(use_norm, use_norm))
    return [multiply(t, scale) for t in tensors], use_norm


def one_hot(labels: Any, depth: int, dtype: Any = host.float32) -> Tensor:
    """A constant one-hot encoding of integer labels (no gradient)."""
    labels = as_tensor(labels)
    xp = backend.array_module(labels.value)
    return pass_constant((host_value(labels)[..., None] == xp.arange(depth)).astype(dtype))


# ---- embedding and attention ----
def check_table(shape: tuple[int, ...]) -> None:
    if len(shape) < 1:
        raise RuleError(f"table must have rank >= 1, got shape {shape}")


def check_ids(dtype: Any) -> None:
    if dtype.kind not in "iu":
        raise RuleError(f"ids must be an integer tensor, got {dtype}", "dtype", TypeError)


def embedding_rule(b: dict[str, Any]) -> TensorType:
    table, ids = concrete(b["table"]), concrete(b["ids"])
    check_ids(ids.dtype)
    check_table(table.shape)
    return TensorType(ids.shape + table.shape[1:], table.dtype)


@public("nn", shape_rule=embedding_rule)
def embedding(table: Any, ids: Any) -> Tensor:
    """Rows of `table` [V, ...] at integer `ids` (any shape): shape ids.shape + table.shape[1:]."""
    table, ids = as_tensor(table), as_tensor(ids)
    checked("embedding", check_table, table.shape)
    checked("embedding", check_ids, ids.dtype)
    rows = table.shape[0]
    values = host_value(ids)
    if ids.size and (int(values.min()) < 0 or int(values.max()) >= rows):
        bad = int(values.min()) if int(values.min()) < 0 else int(values.max())
        raise IndexError(f"embedding: id {bad} is out of bounds for a table of {rows} rows")
    return take(table, ids, axis=0)


def attention_shape(q: tuple, k: tuple, v: tuple) -> tuple:
    """The output shape of scaled_dot_product_attention, or RuleError."""
    if min(len(q), len(k), len(v)) < 2:
        raise RuleError(f"q {q}, k {k} and v {v} must have rank >= 2 ([..., L, d])")
    if q[-1] != k[-1] or q[-1] < 1:
        raise RuleError(f"q {q} and k {k} must share a non-empty last axis (d)")
    if k[-2] != v[-2] or k[-2] < 1:
        raise RuleError(f"k {k} and v {v} must have the same non-zero number of keys")
    try:
        lead = broadcast(q[:-2], k[:-2], v[:-2])
    except RuleError:
        raise RuleError(f"the leading axes of q {q}, k {k} and v {v} do not broadcast") from None
    return tuple(lead) + (q[-2], v[-1])


def attention_rule(b: dict[str, Any]) -> TensorType:
    q, k, v = (concrete(b[n]) for n in ("q", "k", "v"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        require(t, "float", name)
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise RuleError(f"dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); use cast first", "dtype")
    return TensorType(attention_shape(q.shape, k.shape, v.shape), q.dtype)


def attention_workspace(b: dict[str, Any], out: TensorType) -> int:
    """The score matrix (and its softmax): [..., Lq, Lk]."""
    return out.size // max(b["v"].shape[-1], 1) * b["k"].shape[-2]


@public(
    "nn",
    shape_rule=attention_rule,
    kinds={"causal": "bool"},
    workspace=attention_workspace,
)
def scaled_dot_product_attention(q: Any, k: Any, v: Any, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over leading batch (and head) axes; with causal, query i
    sees keys 0..i only (torch's is_causal, top-left aligned)."""
    q, k, v = (as_tensor(t) for t in (q, k, v))
    for t in (q, k, v):
        if t.dtype.kind != "f":
            raise TypeError(f"scaled_dot_product_attention: needs float tensors, got {t.dtype}")
    checked("scaled_dot_product_attention", attention_shape, q.shape, k.shape, v.shape)
    scores = multiply(matmul(q, swapaxes(k, -1, -2)), 1.0 / float(q.shape[-1]) ** 0.5)
    if causal:
        xp = backend.array_module(scores.value)
        lq, lk = q.shape[-2], k.shape[-2]
        mask = pass_constant(xp.tril(xp.ones((lq, lk), dtype=bool)))
        scores = where(mask, scores, as_tensor(-host.inf, like=scores))
    return matmul(softmax(scores, -1), v)
