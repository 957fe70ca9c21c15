"""Neural-network building blocks, all composites of primitives: softmax, losses,
normalization, clip_by_norm, and stop_gradient."""

from __future__ import annotations

from typing import Any

from engine import backend
from engine.backend import host
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
from engine.ops.reduce import logsumexp, mean, sum, var
from engine.ops.shape import reshape, swapaxes, take
from engine.registry import public
from engine.tensor import Tensor, as_tensor


@public("control")
def stop_gradient(x: Any) -> Tensor:
    """x's value, cut off from every tape: no gradient flows through it."""
    return stop(as_tensor(x))


# ---- softmax ----
@public("nn")
def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """x - logsumexp(x) over `axis`."""
    x = as_tensor(x)
    return subtract(x, logsumexp(x, axis, keepdims=True))


@public("nn")
def softmax(x: Any, axis: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) over `axis`, computed stably."""
    return exp(log_softmax(x, axis))


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


def _check_same_shape(a: Tensor, b: Tensor, opname: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{opname}: predictions {a.shape} and targets {b.shape} differ in shape")


@public("loss")
def mean_squared_error(predictions: Any, targets: Any, reduction: str = "mean") -> Tensor:
    """(predictions - targets)**2, averaged over all elements by default."""
    predictions, targets = as_tensor(predictions), as_tensor(targets)
    _check_same_shape(predictions, targets, "mean_squared_error")
    return _reduce(square(subtract(predictions, targets)), reduction, "mean_squared_error")


@public("loss")
def huber(predictions: Any, targets: Any, delta: float = 1.0, reduction: str = "mean") -> Tensor:
    """Quadratic within `delta` of the target, linear beyond (Huber loss)."""
    predictions, targets = as_tensor(predictions), as_tensor(targets)
    _check_same_shape(predictions, targets, "huber")
    if delta <= 0:
        raise ValueError(f"huber: delta must be positive, got {delta}")
    err = abs(subtract(predictions, targets))
    quadratic = multiply(square(err), 0.5)
    linear = subtract(multiply(err, delta), 0.5 * delta * delta)
    return _reduce(where(less_equal(err, delta), quadratic, linear), reduction, "huber")


@public("loss")
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
        if labels.shape != expected:
            raise ValueError(
                f"softmax_cross_entropy: integer labels must have shape {expected} for logits "
                f"{logits.shape}, got {labels.shape}"
            )
        classes = logits.shape[axis]
        xp = backend.array_module(labels.value)
        if labels.size and (int(labels.value.min()) < 0 or int(labels.value.max()) >= classes):
            raise ValueError(f"softmax_cross_entropy: labels must lie in [0, {classes})")
        lab = xp.expand_dims(labels.value, axis)
        shape = [1] * logits.ndim
        shape[axis] = classes
        one_hot = Tensor((lab == xp.arange(classes).reshape(shape)).astype(logits.dtype))
    else:
        _check_same_shape(logits, labels, "softmax_cross_entropy")
        one_hot = labels
    losses = negative(sum(multiply(one_hot, logp), axis))
    return _reduce(losses, reduction, "softmax_cross_entropy")


@public("loss")
def sigmoid_cross_entropy(logits: Any, labels: Any, reduction: str = "mean") -> Tensor:
    """Binary cross-entropy of sigmoid(logits) against labels in [0, 1], computed stably."""
    logits, labels = as_tensor(logits), as_tensor(labels)
    _check_same_shape(logits, labels, "sigmoid_cross_entropy")
    losses = subtract(softplus(logits), multiply(logits, labels))
    return _reduce(losses, reduction, "sigmoid_cross_entropy")


# ---- normalization ----
def _affine(y: Tensor, gamma: Any, beta: Any) -> Tensor:
    if gamma is not None:
        y = multiply(y, as_tensor(gamma))
    if beta is not None:
        y = add(y, as_tensor(beta))
    return y


@public("nn")
def batch_norm(x: Any, gamma: Any = None, beta: Any = None, eps: float = 1e-5) -> Tensor:
    """Training-mode batch normalization: statistics over every axis but the last.

    The examples of a batch are *not* independent through it (each output depends on
    the whole batch), which is what a batch jacobian checks for.
    """
    x = as_tensor(x)
    if x.ndim < 2:
        raise ValueError(f"batch_norm: needs a batch axis and a feature axis, got shape {x.shape}")
    axes = tuple(range(-x.ndim, -1))
    centered = subtract(x, mean(x, axes, keepdims=True))
    scale = sqrt(add(var(x, axes, keepdims=True), eps))
    return _affine(divide(centered, scale), gamma, beta)


@public("nn")
def layer_norm(x: Any, gamma: Any = None, beta: Any = None, eps: float = 1e-5) -> Tensor:
    """Layer normalization: statistics over the last axis of each example."""
    x = as_tensor(x)
    centered = subtract(x, mean(x, -1, keepdims=True))
    scale = sqrt(add(var(x, -1, keepdims=True), eps))
    return _affine(divide(centered, scale), gamma, beta)


@public("nn")
def clip_by_norm(x: Any, clip_norm: float = 1.0, axis: Any = None) -> Tensor:
    """x rescaled so its L2 norm (over `axis`) is at most clip_norm."""
    x = as_tensor(x)
    if clip_norm <= 0:
        raise ValueError(f"clip_by_norm: clip_norm must be positive, got {clip_norm}")
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
    return Tensor((labels.value[..., None] == xp.arange(depth)).astype(dtype))


# ---- embedding and attention ----
@public("nn")
def embedding(table: Any, ids: Any) -> Tensor:
    """Rows of `table` [V, ...] at integer `ids` (any shape): shape ids.shape + table.shape[1:]."""
    table, ids = as_tensor(table), as_tensor(ids)
    if table.ndim < 1:
        raise ValueError(f"embedding: table must have rank >= 1, got shape {table.shape}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be an integer tensor, got {ids.dtype}")
    rows = table.shape[0]
    if ids.size and (int(ids.value.min()) < 0 or int(ids.value.max()) >= rows):
        bad = int(ids.value.min()) if int(ids.value.min()) < 0 else int(ids.value.max())
        raise IndexError(f"embedding: id {bad} is out of bounds for a table of {rows} rows")
    return take(table, ids, axis=0)


def attention_shape(q: tuple, k: tuple, v: tuple) -> tuple:
    """The output shape of scaled_dot_product_attention, or ValueError (shared with the
    definition language's rule)."""
    if min(len(q), len(k), len(v)) < 2:
        raise ValueError(f"q {q}, k {k} and v {v} must have rank >= 2 ([..., L, d])")
    if q[-1] != k[-1] or q[-1] < 1:
        raise ValueError(f"q {q} and k {k} must share a non-empty last axis (d)")
    if k[-2] != v[-2] or k[-2] < 1:
        raise ValueError(f"k {k} and v {v} must have the same non-zero number of keys")
    try:
        lead = host.broadcast_shapes(q[:-2], k[:-2], v[:-2])
    except ValueError:
        raise ValueError(f"the leading axes of q {q}, k {k} and v {v} do not broadcast") from None
    return tuple(lead) + (q[-2], v[-1])


@public("nn")
def scaled_dot_product_attention(q: Any, k: Any, v: Any, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over leading batch (and head) axes; with causal, query i
    sees keys 0..i only (torch's is_causal, top-left aligned)."""
    q, k, v = (as_tensor(t) for t in (q, k, v))
    for t in (q, k, v):
        if t.dtype.kind != "f":
            raise TypeError(f"scaled_dot_product_attention: needs float tensors, got {t.dtype}")
    try:
        attention_shape(q.shape, k.shape, v.shape)
    except ValueError as exc:
        raise ValueError(f"scaled_dot_product_attention: {exc}") from None
    scores = multiply(matmul(q, swapaxes(k, -1, -2)), 1.0 / float(q.shape[-1]) ** 0.5)
    if causal:
        xp = backend.array_module(scores.value)
        lq, lk = q.shape[-2], k.shape[-2]
        mask = Tensor(xp.tril(xp.ones((lq, lk), dtype=bool)))
        scores = where(mask, scores, as_tensor(-host.inf, like=scores))
    return matmul(softmax(scores, -1), v)
