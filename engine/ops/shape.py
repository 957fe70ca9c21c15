"""Shape primitives: reshape, transpose, broadcast_to, concatenate, indexing and scatter.

Cotangents and tangents may carry leading batch axes; rules find how many by comparing
ranks (`batch_ndim`) and keep them in front.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from engine import backend
from engine.backend import host
from engine.ops._util import batch_ndim, coerce_all, normalize_axis
from engine.registry import defjvp, defvjp, defvjp_argnum, primitive, public
from engine.tensor import Tensor, as_tensor, bind, unaliased

# ---- reshape ----
reshape_p = primitive("reshape", lambda xp, x, *, shape: x.reshape(shape))
defvjp(
    reshape_p,
    lambda ans, x, *, shape: lambda g: _reshape(g, g.shape[: batch_ndim(g, ans)] + x.shape),
)
defjvp(
    reshape_p, lambda t, ans, x, *, shape: _reshape(t[0], t[0].shape[: t[0].ndim - x.ndim] + shape)
)


def _reshape(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    return unaliased(x) if x.shape == shape else bind(reshape_p, x, shape=shape)


@public("shape")
def reshape(x: Any, shape: Sequence[int] | int = ()) -> Tensor:
    """x with a new shape of the same size (one entry may be -1)."""
    x = as_tensor(x)
    try:
        return _reshape(x, resolve_shape(x.shape, shape))
    except ValueError as exc:
        raise ValueError(f"reshape: {exc}") from None


def resolve_shape(old: tuple[int, ...], shape: Sequence[int] | int) -> tuple[int, ...]:
    """The target of a reshape of `old`, with a -1 entry filled in; ValueError if the
    sizes differ. Shared with the definition language's shape inference."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    size = math.prod(old)
    if shape.count(-1) > 1:
        raise ValueError(f"at most one -1 in shape {shape}")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape {old} into {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    if math.prod(shape) != size or any(d < 0 for d in shape):
        raise ValueError(f"cannot reshape {old} ({size} elements) into {shape}")
    return shape


# ---- transpose ----
transpose_p = primitive("transpose", lambda xp, x, *, axes: xp.transpose(x, axes))


def _batched_perm(nb: int, axes: Sequence[int]) -> tuple[int, ...]:
    return tuple(range(nb)) + tuple(nb + a for a in axes)


def transpose_vjp(ans: Tensor, x: Tensor, *, axes: tuple[int, ...]) -> Any:
    inverse = tuple(int(i) for i in host.argsort(axes))
    return lambda g: bind(transpose_p, g, axes=_batched_perm(batch_ndim(g, ans), inverse))


defvjp(transpose_p, transpose_vjp)
defjvp(
    transpose_p,
    lambda t, ans, x, *, axes: bind(
        transpose_p, t[0], axes=_batched_perm(t[0].ndim - x.ndim, axes)
    ),
)


@public("shape")
def transpose(x: Any, axes: Sequence[int] | None = None) -> Tensor:
    """Permute the axes (reverse them when axes is None)."""
    x = as_tensor(x)
    if axes is None:
        axes = tuple(range(x.ndim))[::-1]
    axes = tuple(a + x.ndim if a < 0 else a for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"transpose: axes {axes} are not a permutation of a rank-{x.ndim} tensor")
    if axes == tuple(range(x.ndim)):
        return unaliased(x)
    return bind(transpose_p, x, axes=axes)


@public("shape")
def swapaxes(x: Any, axis1: int = -2, axis2: int = -1) -> Tensor:
    """Exchange two axes."""
    x = as_tensor(x)
    perm = list(range(x.ndim))
    a, b = normalize_axis(axis1, x.ndim, "swapaxes"), normalize_axis(axis2, x.ndim, "swapaxes")
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


@public("shape")
def moveaxis(x: Any, source: int = 0, destination: int = -1) -> Tensor:
    """Move one axis to a new position."""
    x = as_tensor(x)
    src = normalize_axis(source, x.ndim, "moveaxis") + x.ndim
    dst = normalize_axis(destination, x.ndim, "moveaxis") + x.ndim
    perm = [i for i in range(x.ndim) if i != src]
    perm.insert(dst, src)
    return transpose(x, perm)


# ---- broadcast_to ----
# The VJP is the identity: the tape sums cotangents down to each input's shape in one
# place, which is exactly the transpose of broadcasting.
broadcast_to_p = primitive("broadcast_to", lambda xp, x, *, shape: xp.broadcast_to(x, shape))
defvjp(broadcast_to_p, lambda ans, x, *, shape: lambda g: g)


def broadcast_to_jvp(t: list, ans: Tensor, x: Tensor, *, shape: tuple) -> Tensor:
    lead = t[0].shape[: t[0].ndim - x.ndim]
    aligned = _reshape(t[0], lead + (1,) * (len(shape) - x.ndim) + x.shape)
    return bind(broadcast_to_p, aligned, shape=lead + shape)


defjvp(broadcast_to_p, broadcast_to_jvp)


@public("shape")
def broadcast_to(x: Any, shape: Sequence[int] = ()) -> Tensor:
    """x repeated along new or size-1 axes to `shape` (NumPy's broadcasting rules)."""
    x = as_tensor(x)
    shape = tuple(int(d) for d in shape)
    try:
        host.broadcast_shapes(x.shape, shape)
    except ValueError:
        raise ValueError(f"broadcast_to: cannot broadcast {x.shape} to {shape}") from None
    if host.broadcast_shapes(x.shape, shape) != shape:
        raise ValueError(f"broadcast_to: cannot broadcast {x.shape} to {shape}")
    return unaliased(x) if x.shape == shape else bind(broadcast_to_p, x, shape=shape)


@public("shape")
def expand_dims(x: Any, axis: int = 0) -> Tensor:
    """Insert a size-1 axis at `axis`."""
    x = as_tensor(x)
    if not -x.ndim - 1 <= axis <= x.ndim:
        raise ValueError(f"expand_dims: axis {axis} out of range for rank {x.ndim}")
    position = axis if axis >= 0 else x.ndim + 1 + axis
    return _reshape(x, x.shape[:position] + (1,) + x.shape[position:])


@public("shape")
def squeeze(x: Any, axis: int | Sequence[int] | None = None) -> Tensor:
    """Remove size-1 axes (all of them, or the ones named)."""
    x = as_tensor(x)
    if axis is None:
        return _reshape(x, tuple(d for d in x.shape if d != 1))
    axes = {normalize_axis(a, x.ndim, "squeeze") + x.ndim for a in host.atleast_1d(axis).tolist()}
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"squeeze: axis {a} of shape {x.shape} has size {x.shape[a]}, not 1")
    return _reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


@public("shape")
def flatten(x: Any) -> Tensor:
    """x as a 1-D tensor."""
    x = as_tensor(x)
    return _reshape(x, (x.size,))


# ---- concatenate ----
concatenate_p = primitive("concatenate", lambda xp, *xs, axis: xp.concatenate(xs, axis=axis))


def _axis_slice(axis: int, start: int, stop: int) -> tuple:
    """An index that takes [start:stop] along a negative `axis`, whatever leads it."""
    return (Ellipsis, slice(start, stop)) + (slice(None),) * (-axis - 1)


def concatenate_vjp(argnum: int, ans: Tensor, *xs: Tensor, axis: int) -> Any:
    start = sum(x.shape[axis] for x in xs[:argnum])
    index = _axis_slice(axis, start, start + xs[argnum].shape[axis])
    return lambda g: bind(getitem_p, g, index=index)


def concatenate_jvp(t: list, ans: Tensor, *xs: Tensor, axis: int) -> Tensor:
    first = next(tt for tt in t if tt is not None)
    lead = first.shape[: first.ndim - ans.ndim]
    parts = [
        zeros_like_shape(first, lead + x.shape) if tt is None else broadcast_to(tt, lead + x.shape)
        for tt, x in zip(t, xs, strict=True)
    ]
    return bind(concatenate_p, *parts, axis=axis)


defvjp_argnum(concatenate_p, concatenate_vjp)
defjvp(concatenate_p, concatenate_jvp)


def zeros_like_shape(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A constant zero tensor of `shape` with `like`'s dtype and device."""
    xp = backend.array_module(like.value)
    return Tensor(xp.zeros(shape, dtype=like.dtype))


@public("shape", tensors=0)
def concatenate(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    tensors = coerce_all("concatenate", xs)
    if not tensors:
        raise ValueError("concatenate: needs at least one tensor")
    ndim = tensors[0].ndim
    if ndim == 0:
        raise ValueError("concatenate: zero-rank tensors cannot be concatenated; use stack")
    axis = normalize_axis(axis, ndim, "concatenate")
    for t in tensors[1:]:
        others = [d for i, d in enumerate(t.shape) if i - t.ndim != axis]
        firsts = [d for i, d in enumerate(tensors[0].shape) if i - ndim != axis]
        if t.ndim != ndim or others != firsts:
            shapes = ", ".join(str(u.shape) for u in tensors)
            raise ValueError(f"concatenate: shapes {shapes} differ off axis {axis}")
    if len(tensors) == 1:
        return unaliased(tensors[0])
    return bind(concatenate_p, *tensors, axis=axis)


@public("shape", tensors=0)
def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join same-shaped tensors along a new axis."""
    tensors = coerce_all("stack", xs)
    if not tensors:
        raise ValueError("stack: needs at least one tensor")
    if len({t.shape for t in tensors}) > 1:
        raise ValueError(f"stack: shapes differ: {[t.shape for t in tensors]}")
    expanded = [expand_dims(t, axis) for t in tensors]
    return (
        expanded[0]
        if len(expanded) == 1
        else bind(concatenate_p, *expanded, axis=normalize_axis(axis, tensors[0].ndim + 1, "stack"))
    )


# ---- indexing: getitem and its transpose, scatter_add ----
# Indices are normalized once (Ellipsis expanded, every axis named, bool masks turned
# into integer arrays) and stored with a leading Ellipsis, so the same index applies to
# a cotangent or tangent with any number of leading batch axes.
getitem_p = primitive("getitem", lambda xp, x, *, index: x[index])


def _scatter_impl(xp: Any, g: Any, *, index: tuple, shape: tuple, result_ndim: int) -> Any:
    lead = g.shape[: g.ndim - result_ndim]
    out = xp.zeros(lead + shape, dtype=g.dtype)
    if any(backend.is_array(i) for i in index):
        backend.scatter_add(xp, out, index, g)
    else:  # basic indexing never selects an element twice
        out[index] = g
    return out


scatter_add_p = primitive("scatter_add", _scatter_impl)

defvjp(
    getitem_p,
    lambda ans, x, *, index: (
        lambda g: bind(scatter_add_p, g, index=index, shape=x.shape, result_ndim=ans.ndim)
    ),
)
defjvp(getitem_p, lambda t, ans, x, *, index: bind(getitem_p, t[0], index=index))
defvjp(
    scatter_add_p, lambda ans, g, **params: lambda gg: bind(getitem_p, gg, index=params["index"])
)
defjvp(scatter_add_p, lambda t, ans, g, **params: bind(scatter_add_p, t[0], **params))


def normalize_index(index: Any, x: Tensor) -> tuple:
    """An index with every axis of x named, masks as integer arrays, a leading Ellipsis."""
    if not isinstance(index, tuple):
        index = (index,)
    items: list[Any] = []
    for item in index:
        if isinstance(item, Tensor):
            item = item.value
        if isinstance(item, list) or (backend.is_array(item) and not host.isscalar(item)):
            arr = backend.asarray(item, None, x.device)
            if arr.dtype == host.bool_:
                items.extend(arr.nonzero())
                continue
            if arr.dtype.kind not in "iu":
                raise IndexError(f"index arrays must be integer or bool, got {arr.dtype}")
            items.append(arr)
        elif isinstance(item, (bool, host.bool_)):
            raise IndexError("a bare bool is not a valid index")
        elif isinstance(item, (int, host.integer)):
            items.append(int(item))
        elif item is None or item is Ellipsis or isinstance(item, slice):
            items.append(item)
        else:
            raise IndexError(f"invalid index {item!r} of type {type(item).__name__}")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError("an index can only have a single Ellipsis")
    if consumed > x.ndim:
        raise IndexError(f"too many indices ({consumed}) for a tensor of shape {x.shape}")
    fill = [slice(None)] * (x.ndim - consumed)
    if ellipses:
        items[ellipses[0] : ellipses[0] + 1] = fill
    else:
        items.extend(fill)
    # With an integer array present, NumPy treats plain ints as advanced indices too.
    arrays = any(backend.is_array(i) for i in items)
    advanced = [
        k for k, i in enumerate(items) if backend.is_array(i) or (arrays and isinstance(i, int))
    ]
    if advanced and advanced[-1] - advanced[0] + 1 != len(advanced):
        raise IndexError(
            "integer-array indices separated by a slice are not supported (NumPy would move "
            "their axes to the front); index in two steps instead"
        )
    axis = 0
    for item in items:  # bounds-check now, for a clear message (CuPy would wrap)
        if item is None:
            continue
        if backend.is_array(item) and item.size:
            low, high = int(item.min()), int(item.max())
            if low < -x.shape[axis] or high >= x.shape[axis]:
                bad = high if high >= x.shape[axis] else low
                raise IndexError(
                    f"index {bad} is out of bounds for axis {axis} of size {x.shape[axis]}"
                )
        if isinstance(item, int) and not -x.shape[axis] <= item < x.shape[axis]:
            raise IndexError(
                f"index {item} is out of bounds for axis {axis} of size {x.shape[axis]}"
            )
        axis += 1
    return (Ellipsis, *items)


@public("indexing", tensors=1)
def getitem(x: Any, index: Any = ()) -> Tensor:
    """x[index]: ints, slices, None, Ellipsis, integer arrays and bool masks."""
    x = as_tensor(x)
    return bind(getitem_p, x, index=normalize_index(index, x))


@public("indexing")
def take(x: Any, indices: Any, axis: int = 0) -> Tensor:
    """Elements of x at integer `indices` along `axis` (NumPy's take, no wrapping)."""
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim, "take") + x.ndim
    if isinstance(indices, Tensor):
        indices = indices.value
    indices = backend.asarray(indices, None, x.device)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"take: indices must be integers, got {indices.dtype}")
    if indices.size and (
        int(indices.max()) >= x.shape[axis] or int(indices.min()) < -x.shape[axis]
    ):
        raise IndexError(f"take: an index is out of bounds for axis {axis} of size {x.shape[axis]}")
    return getitem(x, (slice(None),) * axis + (indices,))


# ---- gather_nd / scatter_nd (TensorFlow's): getitem and scatter_add with index tuples ----
def _nd_index(indices: Any, shape: tuple[int, ...], opname: str, device: str) -> tuple:
    """(Ellipsis, i_0, ..., i_{K-1}, :, ...) from an integer (..., K) index array."""
    idx = backend.asarray(indices.value if isinstance(indices, Tensor) else indices, None, device)
    if idx.dtype.kind not in "iu" or idx.ndim < 1:
        raise TypeError(f"{opname}: indices must be an integer tensor of rank >= 1")
    depth = idx.shape[-1]
    if depth > len(shape):
        raise ValueError(f"{opname}: indices of depth {depth} for a tensor of shape {shape}")
    for k in range(depth):
        if idx.size and (int(idx[..., k].min()) < 0 or int(idx[..., k].max()) >= shape[k]):
            raise IndexError(f"{opname}: an index is out of bounds for axis {k} of size {shape[k]}")
    parts = tuple(idx[..., k] for k in range(depth))
    return (Ellipsis, *parts) + (slice(None),) * (len(shape) - depth)


@public("indexing")
def gather_nd(params: Any, indices: Any) -> Tensor:
    """Slices of params at the integer (..., K) `indices`: shape indices[:-1] + params[K:]."""
    params = as_tensor(params)
    index = _nd_index(indices, params.shape, "gather_nd", params.device)
    if len(index) == 1:  # no index axes (K = 0): every slice is the whole tensor
        return unaliased(params)
    return bind(getitem_p, params, index=index)


@public("indexing")
def scatter_nd(indices: Any, updates: Any, shape: Sequence[int] = ()) -> Tensor:
    """Zeros of `shape` with `updates` added at `indices` (repeats add up), as TensorFlow."""
    updates = as_tensor(updates)
    shape = tuple(int(d) for d in shape)
    index = _nd_index(indices, shape, "scatter_nd", updates.device)
    depth = builtins.sum(1 for i in index if backend.is_array(i))
    idx = indices.value if isinstance(indices, Tensor) else host.asarray(indices)
    expected = tuple(idx.shape[:-1]) + shape[depth:]
    if updates.shape != expected:
        raise ValueError(f"scatter_nd: updates must have shape {expected}, got {updates.shape}")
    return bind(scatter_add_p, updates, index=index, shape=shape, result_ndim=updates.ndim)


# ---- sort / top_k: a constant permutation, then a gather ----
def _take_along(x: Tensor, order: Any, axis: int) -> Tensor:
    """x's elements in `order` (an integer array of x's shape but `axis`) along `axis`."""
    xp = backend.array_module(order)
    index = []
    for i in range(x.ndim):
        if i == axis:
            index.append(order)
        else:
            shape = [1] * x.ndim
            shape[i] = order.shape[i]
            index.append(xp.arange(order.shape[i]).reshape(shape))
    return bind(getitem_p, x, index=(Ellipsis, *index))


def _descending_order(xp: Any, values: Any, axis: int) -> Any:
    # Stable on the negated values: ties keep their index order, as TensorFlow's top_k.
    return xp.argsort(-values, axis=axis, kind="stable")


@public("indexing")
def sort(x: Any, axis: int = -1, direction: str = "ASCENDING") -> Tensor:
    """x sorted along `axis`; the gradient follows each element to its place."""
    x = as_tensor(x)
    if direction not in ("ASCENDING", "DESCENDING"):
        raise ValueError(f"sort: direction must be 'ASCENDING' or 'DESCENDING', got {direction!r}")
    if x.ndim == 0:
        return unaliased(x)
    axis = normalize_axis(axis, x.ndim, "sort") + x.ndim
    xp = backend.array_module(x.value)
    if direction == "ASCENDING":
        order = xp.argsort(x.value, axis=axis, kind="stable")
    else:
        order = _descending_order(xp, x.value, axis)
    return _take_along(x, order, axis)


class TopK(NamedTuple):
    values: Tensor
    indices: Tensor


def top_k(x: Any, k: int = 1, sorted: bool = True) -> TopK:
    """(values, indices) of the k largest entries along the last axis, largest first
    (a namedtuple, as tf.math.top_k's); `sorted` is accepted, the answer is sorted."""
    x = as_tensor(x)
    if x.ndim == 0 or not 0 <= k <= x.shape[-1]:
        raise ValueError(f"top_k: k={k} for a tensor of shape {x.shape}")
    xp = backend.array_module(x.value)
    order = _descending_order(xp, x.value, x.ndim - 1)[..., :k]
    return TopK(_take_along(x, order, x.ndim - 1), Tensor(order.astype(host.int32)))


# ---- pad ----
def _pad_impl(xp: Any, x: Any, *, paddings: tuple, value: float) -> Any:
    lead = ((0, 0),) * (x.ndim - len(paddings))
    return xp.pad(x, lead + paddings, constant_values=value)


pad_p = primitive("pad", _pad_impl)


def pad_vjp(ans: Tensor, x: Tensor, *, paddings: tuple, value: float) -> Any:
    index = (Ellipsis,) + tuple(slice(lo, lo + d) for (lo, _), d in zip(paddings, x.shape))
    return lambda g: bind(getitem_p, g, index=index)


defvjp(pad_p, pad_vjp)
# The padding value is a constant: a tangent is padded with zeros (batch axes untouched).
defjvp(pad_p, lambda t, ans, x, *, paddings, value: bind(pad_p, t[0], paddings=paddings, value=0.0))


@public("shape")
def pad(
    x: Any,
    paddings: Sequence[Sequence[int]] = (),
    mode: str = "CONSTANT",
    constant_values: float = 0.0,
) -> Tensor:
    """x with paddings[i] = (before, after) entries around axis i: constant_values, or
    mirrored (REFLECT, SYMMETRIC, as TensorFlow) or repeated (EDGE, as ONNX) entries."""
    x = as_tensor(x)
    mode = str(mode).upper()
    if mode not in _PAD_MODES:
        raise ValueError(f"pad: mode must be one of {sorted(_PAD_MODES)}, got {mode!r}")
    pairs = tuple((int(lo), int(hi)) for lo, hi in paddings)
    if len(pairs) != x.ndim or any(lo < 0 or hi < 0 for lo, hi in pairs):
        raise ValueError(f"pad: paddings {pairs} for a tensor of shape {x.shape}")
    try:
        check_pad_mode(x.shape, pairs, mode)
    except ValueError as exc:
        raise ValueError(f"pad: {exc}") from None
    if mode == "CONSTANT":
        return bind(pad_p, x, paddings=pairs, value=float(constant_values))
    # The other modes copy entries of x: one gather per padded axis, of the source index
    # of each output entry (NumPy's pad of an arange), so the rules are getitem's.
    xp = backend.array_module(x.value)
    out = x
    for axis, (lo, hi) in enumerate(pairs):
        if not lo and not hi:
            continue
        n = x.shape[axis]
        source = host.pad(host.arange(n), (lo, hi), mode=_PAD_MODES[mode])
        index = (Ellipsis,) + (slice(None),) * axis + (xp.asarray(source),)
        index += (slice(None),) * (x.ndim - axis - 1)
        out = bind(getitem_p, out, index=index)
    return out


def check_pad_mode(shape: tuple, pairs: tuple, mode: str) -> None:
    """ValueError where a mirrored or repeated padding has too few entries to copy
    (shared with the definition language's rule)."""
    if mode == "CONSTANT":
        return
    for axis, ((lo, hi), n) in enumerate(zip(pairs, shape)):
        limit = n - 1 if mode == "REFLECT" else n
        if (lo or hi) and (n == 0 or (mode != "EDGE" and builtins.max(lo, hi) > limit)):
            raise ValueError(
                f"{mode} padding of ({lo}, {hi}) needs at most {limit} entries on each side "
                f"of axis {axis} (size {n})"
            )


_PAD_MODES = {
    "CONSTANT": "constant",
    "REFLECT": "reflect",
    "SYMMETRIC": "symmetric",
    "EDGE": "edge",
}


# ---- tile, split, unstack: composites of reshape, broadcast and slices ----
@public("shape")
def tile(x: Any, multiples: Sequence[int] = ()) -> Tensor:
    """x repeated multiples[i] times along axis i."""
    x = as_tensor(x)
    multiples = tuple(int(m) for m in multiples)
    if len(multiples) != x.ndim or any(m < 0 for m in multiples):
        raise ValueError(f"tile: multiples {multiples} for a tensor of shape {x.shape}")
    spread = tuple(d for pair in ((1, n) for n in x.shape) for d in pair)
    repeated = tuple(d for pair in zip(multiples, x.shape) for d in pair)
    out = broadcast_to(_reshape(x, spread), repeated)
    return _reshape(out, tuple(m * n for m, n in zip(multiples, x.shape)))


def split(x: Any, num_or_size_splits: Any, axis: int = 0) -> list[Tensor]:
    """Pieces of x along `axis`: that many equal ones, or of the given sizes (one -1)."""
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim, "split")
    n = x.shape[axis]
    if isinstance(num_or_size_splits, int):
        count = num_or_size_splits
        if count <= 0 or n % count:
            raise ValueError(f"split: {n} entries along axis {axis} do not split into {count}")
        sizes = [n // count] * count
    else:
        sizes = [int(s) for s in num_or_size_splits]
        if sizes.count(-1) == 1:
            sizes[sizes.index(-1)] = n - (sum(sizes) + 1)
        if sum(sizes) != n or any(s < 0 for s in sizes):
            raise ValueError(f"split: sizes {sizes} do not add up to {n} along axis {axis}")
    pieces, start = [], 0
    for size in sizes:
        pieces.append(bind(getitem_p, x, index=_axis_slice(axis, start, start + size)))
        start += size
    return pieces


def unstack(x: Any, num: int | None = None, axis: int = 0) -> list[Tensor]:
    """The slices of x along `axis`, each without that axis."""
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim, "unstack")
    if num is not None and num != x.shape[axis]:
        raise ValueError(f"unstack: num={num} but axis {axis} has size {x.shape[axis]}")
    rest = (slice(None),) * (-axis - 1)
    return [bind(getitem_p, x, index=(Ellipsis, i) + rest) for i in range(x.shape[axis])]
