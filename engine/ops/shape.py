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
from engine.registry import (
    defform,
    defjvp,
    defvjp,
    defvjp_argnum,
    defvjp_terms,
    primitive,
    public,
    term_joined_param,
)
from engine.shapes import (
    RuleError,
    TensorType,
    axis_index,
    broadcast,
    checked,
    concrete,
    require,
    same_dtypes,
)
from engine.tensor import Tensor, as_tensor, bind, host_value, pass_constant, unaliased


def _keep_dtype(shape_of: Any) -> Any:
    """The rule of an op that moves x's elements around: `shape_of(x.shape, **constants)`
    gives the result's shape, the dtype is x's."""

    def rule(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        constants = {k: v for k, v in b.items() if k != "x"}
        return TensorType(shape_of(x.shape, **constants), x.dtype)

    return rule


# ---- reshape ----
reshape_p = primitive("reshape", lambda xp, x, *, shape: x.reshape(shape), flow="moves")
defvjp(
    reshape_p,
    lambda ans, x, *, shape: lambda g: _reshape(g, g.shape[: batch_ndim(g, ans)] + x.shape),
)
defjvp(
    reshape_p, lambda t, ans, x, *, shape: _reshape(t[0], t[0].shape[: t[0].ndim - x.ndim] + shape)
)


def _reshape(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    return unaliased(x) if x.shape == shape else bind(reshape_p, x, shape=shape)


def resolve_shape(old: tuple[int, ...], shape: Sequence[int] | int = ()) -> tuple[int, ...]:
    """The target of a reshape of `old`, with a -1 entry filled in; RuleError if the
    sizes differ."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    size = math.prod(old)
    if shape.count(-1) > 1:
        raise RuleError(f"at most one -1 in shape {shape}")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or size % known:
            raise RuleError(f"cannot reshape {old} into {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    if math.prod(shape) != size or any(d < 0 for d in shape):
        raise RuleError(f"cannot reshape {old} ({size} elements) into {shape}")
    return shape


@public("shape", shape_rule=_keep_dtype(resolve_shape), kinds={"shape": "shape"})
def reshape(x: Any, shape: Sequence[int] | int = ()) -> Tensor:
    """x with a new shape of the same size (one entry may be -1)."""
    x = as_tensor(x)
    return _reshape(x, checked("reshape", resolve_shape, x.shape, shape))


# ---- transpose ----
transpose_p = primitive("transpose", lambda xp, x, *, axes: xp.transpose(x, axes), flow="moves")


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


def permutation(ndim: int, axes: Sequence[int] | None = None) -> tuple[int, ...]:
    """transpose's axes as non-negative ints (reversed when None); RuleError unless they
    are a permutation."""
    if axes is None:
        return tuple(range(ndim))[::-1]
    axes = tuple(a + ndim if a < 0 else a for a in axes)
    if sorted(axes) != list(range(ndim)):
        raise RuleError(f"axes {axes} are not a permutation of a rank-{ndim} tensor")
    return axes


def _permuted(perm_of: Any) -> Any:
    """The rule of a transpose whose permutation is `perm_of(ndim, *constants)`."""

    def rule(b: dict[str, Any]) -> TensorType:
        x = concrete(b["x"])
        perm = perm_of(x.ndim, **{k: v for k, v in b.items() if k != "x"})
        return TensorType(tuple(x.shape[a] for a in perm), x.dtype)

    return rule


@public("shape", shape_rule=_permuted(permutation), kinds={"axes": "perm"})
def transpose(x: Any, axes: Sequence[int] | None = None) -> Tensor:
    """Permute the axes (reverse them when axes is None)."""
    x = as_tensor(x)
    axes = checked("transpose", permutation, x.ndim, axes)
    if axes == tuple(range(x.ndim)):
        return unaliased(x)
    return bind(transpose_p, x, axes=axes)


def swapaxes_permutation(ndim: int, axis1: int = -2, axis2: int = -1) -> list[int]:
    perm = list(range(ndim))
    a, b = axis_index(axis1, ndim), axis_index(axis2, ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return perm


@public(
    "shape",
    shape_rule=_permuted(swapaxes_permutation),
    kinds={"axis1": "axis", "axis2": "axis"},
)
def swapaxes(x: Any, axis1: int = -2, axis2: int = -1) -> Tensor:
    """Exchange two axes."""
    x = as_tensor(x)
    return transpose(x, checked("swapaxes", swapaxes_permutation, x.ndim, axis1, axis2))


def moveaxis_permutation(ndim: int, source: int = 0, destination: int = -1) -> list[int]:
    src, dst = axis_index(source, ndim), axis_index(destination, ndim)
    perm = [i for i in range(ndim) if i != src]
    perm.insert(dst, src)
    return perm


@public(
    "shape",
    shape_rule=_permuted(moveaxis_permutation),
    kinds={"source": "axis", "destination": "axis"},
)
def moveaxis(x: Any, source: int = 0, destination: int = -1) -> Tensor:
    """Move one axis to a new position."""
    x = as_tensor(x)
    return transpose(x, checked("moveaxis", moveaxis_permutation, x.ndim, source, destination))


# ---- broadcast_to ----
# The VJP is the identity: the tape sums cotangents down to each input's shape in one
# place, which is exactly the transpose of broadcasting.
broadcast_to_p = primitive(
    "broadcast_to", lambda xp, x, *, shape: xp.broadcast_to(x, shape), flow="moves"
)
defvjp(broadcast_to_p, lambda ans, x, *, shape: lambda g: g)


def broadcast_to_jvp(t: list, ans: Tensor, x: Tensor, *, shape: tuple) -> Tensor:
    lead = t[0].shape[: t[0].ndim - x.ndim]
    aligned = _reshape(t[0], lead + (1,) * (len(shape) - x.ndim) + x.shape)
    return bind(broadcast_to_p, aligned, shape=lead + shape)


defjvp(broadcast_to_p, broadcast_to_jvp)


def broadcast_target(old: tuple[int, ...], shape: Sequence[int] = ()) -> tuple[int, ...]:
    """broadcast_to's `shape`, checked: `old` must broadcast to it unchanged."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise RuleError(f"negative dimension in shape {shape}")
    try:
        fits = broadcast(old, shape) == shape
    except RuleError:
        fits = False
    if not fits:
        raise RuleError(f"cannot broadcast {old} to {shape}")
    return shape


@public("shape", shape_rule=_keep_dtype(broadcast_target), kinds={"shape": "shape"})
def broadcast_to(x: Any, shape: Sequence[int] = ()) -> Tensor:
    """x repeated along new or size-1 axes to `shape` (NumPy's broadcasting rules)."""
    x = as_tensor(x)
    shape = checked("broadcast_to", broadcast_target, x.shape, shape)
    return unaliased(x) if x.shape == shape else bind(broadcast_to_p, x, shape=shape)


def expanded_shape(old: tuple[int, ...], axis: int = 0) -> tuple[int, ...]:
    """`old` with a size-1 axis inserted at `axis` (which may be one past the end)."""
    if not -len(old) - 1 <= axis <= len(old):
        raise RuleError(f"axis {axis} out of range for rank {len(old)}")
    position = axis if axis >= 0 else len(old) + 1 + axis
    return old[:position] + (1,) + old[position:]


@public("shape", shape_rule=_keep_dtype(expanded_shape), kinds={"axis": "axis"})
def expand_dims(x: Any, axis: int = 0) -> Tensor:
    """Insert a size-1 axis at `axis`."""
    x = as_tensor(x)
    return _reshape(x, checked("expand_dims", expanded_shape, x.shape, axis))


def squeezed_shape(old: tuple[int, ...], axis: int | Sequence[int] | None = None) -> tuple:
    """`old` without its size-1 axes (all of them, or the ones named, which must be 1)."""
    if axis is None:
        return tuple(d for d in old if d != 1)
    axes = {axis_index(a, len(old)) for a in host.atleast_1d(axis).tolist()}
    for a in sorted(axes):
        if old[a] != 1:
            raise RuleError(f"axis {a} of shape {old} has size {old[a]}, not 1")
    return tuple(d for i, d in enumerate(old) if i not in axes)


@public("shape", shape_rule=_keep_dtype(squeezed_shape), kinds={"axis": "axes"})
def squeeze(x: Any, axis: int | Sequence[int] | None = None) -> Tensor:
    """Remove size-1 axes (all of them, or the ones named)."""
    x = as_tensor(x)
    return _reshape(x, checked("squeeze", squeezed_shape, x.shape, axis))


@public("shape", shape_rule=_keep_dtype(lambda old: (math.prod(old),)))
def flatten(x: Any) -> Tensor:
    """x as a 1-D tensor."""
    x = as_tensor(x)
    return _reshape(x, (x.size,))


# ---- concatenate ----
concatenate_p = primitive(
    "concatenate", lambda xp, *xs, axis: xp.concatenate(xs, axis=axis), flow="moves"
)


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


JOIN = {"xs": "tensors", "axis": "axis"}


def zeros_like_shape(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A constant zero tensor of `shape` with `like`'s dtype and device."""
    xp = backend.array_module(like.value)
    return pass_constant(xp.zeros(shape, dtype=like.dtype))


def _joined(shape_of: Any) -> Any:
    """The rule of an op that joins a list of tensors of one dtype."""

    def rule(b: dict[str, Any]) -> TensorType:
        xs = same_dtypes(b["xs"])
        shape = shape_of([x.shape for x in xs], b.get("axis", 0))
        return TensorType(shape, xs[0].dtype)

    return rule


def concatenated_shape(shapes: list[tuple[int, ...]], axis: int = 0) -> tuple[int, ...]:
    if not shapes:
        raise RuleError("needs at least one tensor", "op")
    first = shapes[0]
    if not first:
        raise RuleError("zero-rank tensors cannot be concatenated; use stack")
    axis = axis_index(axis, len(first))
    for shape in shapes[1:]:
        if len(shape) != len(first) or any(
            d != e for i, (d, e) in enumerate(zip(shape, first)) if i != axis
        ):
            listed = ", ".join(str(u) for u in shapes)
            raise RuleError(f"shapes {listed} differ off axis {axis}")
    total = sum(shape[axis] for shape in shapes)
    return first[:axis] + (total,) + first[axis + 1 :]


@public("shape", shape_rule=_joined(concatenated_shape), kinds=JOIN)
def concatenate(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    tensors = coerce_all("concatenate", xs)
    checked("concatenate", concatenated_shape, [t.shape for t in tensors], axis)
    if len(tensors) == 1:
        return unaliased(tensors[0])
    return bind(concatenate_p, *tensors, axis=normalize_axis(axis, tensors[0].ndim, "concatenate"))


def stacked_shape(shapes: list[tuple[int, ...]], axis: int = 0) -> tuple[int, ...]:
    if not shapes:
        raise RuleError("needs at least one tensor", "op")
    if len(set(shapes)) > 1:
        raise RuleError(f"shapes differ: {list(shapes)}")
    expanded_shape(shapes[0], axis)  # the axis may be one past the end
    position = axis if axis >= 0 else len(shapes[0]) + 1 + axis
    return shapes[0][:position] + (len(shapes),) + shapes[0][position:]


@public("shape", shape_rule=_joined(stacked_shape), kinds=JOIN)
def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join same-shaped tensors along a new axis."""
    tensors = coerce_all("stack", xs)
    checked("stack", stacked_shape, [t.shape for t in tensors], axis)
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
getitem_p = primitive("getitem", lambda xp, x, *, index: x[index], flow="moves")


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


# ---- an input's slices' cotangents as one array: scatter_slices ----
# A tensor read through several indexes (attention's q, k and v as slices of one
# projection) gets one cotangent per index, each scatter_add'ed into zeros of its full
# shape and then added: for q/k/v, three zero-filled (64, 16, 192) arrays and two adds,
# 0.2 ms of the transformer's pass per layer. getitem's cotangent is therefore a term
# (registry.vjp_term_rules): the tape joins an input's terms into one scatter_slices
# call (registry.term_joined_param). Where the indexes are basic and no element is in two
# of them, each g_k is written into its place (zeros only where none reaches): the same
# values as the arrays' sum, except that a -0 in g_k stays -0 (the sum's 0 + g_k made it
# +0; a single slice's cotangent always kept it); NumPy's add into the strided places
# cost 3x the copy. Otherwise the arrays are made and added in the terms' order, as
# before, to the same bits. (Where the input is also used whole, its cotangent adds that
# use's term and the slices' sum in another order than before: rounding, not bits.)
def _basic(index: tuple) -> bool:
    return not any(backend.is_array(i) for i in index)


def _positions(index: tuple, shape: tuple) -> list[range | None]:
    """Per axis of `shape`, the positions a basic index (from normalize_index) takes
    (None: a new axis, no positions of x's)."""
    items = [i for i in index if i is not Ellipsis and i is not None]
    items = [slice(None)] * (len(shape) - len(items)) + items
    out: list[range | None] = []
    for item, size in zip(items, shape, strict=True):
        if isinstance(item, slice):
            out.append(range(*item.indices(size)))
        else:
            out.append(range(item % size, item % size + 1))
    return out


def disjoint_basic(indices: tuple, shape: tuple) -> bool:
    """Whether basic indexes into `shape` never take one element twice."""
    if not all(_basic(i) for i in indices):
        return False
    taken = [_positions(i, shape) for i in indices]
    for a in range(len(taken)):
        for b in range(a):
            # two boxes are apart when they are apart along some axis
            if not any(
                not set(ra).intersection(rb)
                for ra, rb in zip(taken[a], taken[b], strict=True)
                if ra is not None and rb is not None
            ):
                return False
    return True


def _scatter_slices_impl(xp: Any, *gs: Any, indices: tuple, shape: tuple, result_ndim: int) -> Any:
    if len(gs) == 1:
        return _scatter_impl(xp, gs[0], index=indices[0], shape=shape, result_ndim=result_ndim)
    g0 = gs[0]
    lead = g0.shape[: g0.ndim - result_ndim]
    if disjoint_basic(indices, shape):
        out = xp.zeros(lead + shape, dtype=g0.dtype)
        for g, index in zip(gs, indices, strict=True):
            out[index] = g
        return out
    out = _scatter_impl(xp, g0, index=indices[0], shape=shape, result_ndim=result_ndim)
    for g, index in zip(gs[1:], indices[1:], strict=True):
        out = out + _scatter_impl(xp, g, index=index, shape=shape, result_ndim=result_ndim)
    return out


scatter_slices_p = primitive("scatter_slices", _scatter_slices_impl)
term_joined_param[scatter_slices_p] = "indices"


def _scatter_slices_vjp(argnum: int, ans: Tensor, *gs: Tensor, indices: tuple, **_: Any) -> Any:
    return lambda gg: bind(getitem_p, gg, index=indices[argnum])


def _scatter_slices_jvp(t: list, ans: Tensor, *gs: Tensor, **params: Any) -> Tensor:
    k, first = next((k, tt) for k, tt in enumerate(t) if tt is not None)
    lead = first.shape[: first.ndim - gs[k].ndim]  # (a tangent's batch axes)
    parts = [
        zeros_like_shape(first, lead + g.shape)
        if tt is None
        else tt
        if tt.shape == lead + g.shape
        else broadcast_to(tt, lead + g.shape)
        for tt, g in zip(t, gs, strict=True)
    ]
    return bind(scatter_slices_p, *parts, **params)


defvjp_argnum(scatter_slices_p, _scatter_slices_vjp)
defjvp(scatter_slices_p, _scatter_slices_jvp)
defvjp_terms(
    getitem_p,
    lambda ans, x, *, index: (
        lambda g: (
            scatter_slices_p,
            [g],
            {"indices": (index,), "shape": x.shape, "result_ndim": ans.ndim},
        )
    ),
)


def _scatter_slices_form(params: dict, operands: list, value: Any) -> Any:
    """The replay's form where the indexes are basic and apart: each g_k written into its
    place, zeros only where no index reaches (none for q/k/v); None otherwise."""
    indices, shape = params["indices"], params["shape"]
    if len(indices) < 2 or not disjoint_basic(indices, shape):
        return None
    covered = sum(math.prod(len(r) for r in _positions(i, shape) if r is not None) for i in indices)
    whole = covered == math.prod(shape)  # (apart: the counts add up to the elements reached)

    def form(*arrays: Any) -> Any:
        *gs, out = arrays
        if out is None:
            g0 = gs[0]
            out = host.empty(g0.shape[: g0.ndim - params["result_ndim"]] + shape, g0.dtype)
        if not whole:
            out.fill(0)
        for g, index in zip(gs, indices, strict=True):
            out[index] = g
        return out

    return form


defform(scatter_slices_p, _scatter_slices_form)


def normalize_index(index: Any, x: Tensor) -> tuple:
    """An index with every axis of x named, masks as integer arrays, a leading Ellipsis."""
    if not isinstance(index, tuple):
        index = (index,)
    items: list[Any] = []
    for item in index:
        if isinstance(item, Tensor):
            item = host_value(item)
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
    items = _unchecked(expand_index, items, x.shape)
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
            _unchecked(check_index, high if high >= x.shape[axis] else low, axis, x.shape[axis])
        if isinstance(item, int):
            _unchecked(check_index, item, axis, x.shape[axis])
        axis += 1
    return (Ellipsis, *items)


def _unchecked(check: Any, *args: Any) -> Any:
    """A shared check whose error keeps NumPy's own wording (no op name in front)."""
    try:
        return check(*args)
    except RuleError as exc:
        raise exc.error(exc.message) from None


def expand_index(items: list, shape: tuple[int, ...]) -> list:
    """Index items with the Ellipsis spelled out and slices for the axes not named."""
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        raise RuleError("an index can only have a single Ellipsis", error=IndexError)
    if consumed > len(shape):
        raise RuleError(
            f"too many indices ({consumed}) for a tensor of shape {shape}", error=IndexError
        )
    fill = [slice(None)] * (len(shape) - consumed)
    items = list(items)
    if ellipses:
        items[ellipses[0] : ellipses[0] + 1] = fill
    else:
        items.extend(fill)
    return items


def check_index(item: int, axis: int, size: int) -> None:
    if not -size <= item < size:
        raise RuleError(
            f"index {item} is out of bounds for axis {axis} of size {size}", error=IndexError
        )


def index_shape(shape: tuple[int, ...], index: Any = ()) -> tuple[int, ...]:
    """The shape of x[index] for a constant index (ints, slices, None, Ellipsis)."""
    items = expand_index(list(index) if isinstance(index, tuple) else [index], shape)
    out, axis = [], 0
    for item in items:
        if item is None:
            out.append(1)
            continue
        size = shape[axis]
        if isinstance(item, slice):
            out.append(len(range(*item.indices(size))))
        else:
            check_index(item, axis, size)
        axis += 1
    return tuple(out)


@public("indexing", shape_rule=_keep_dtype(index_shape), kinds={"index": "index"})
def getitem(x: Any, index: Any = ()) -> Tensor:
    """x[index]: ints, slices, None, Ellipsis, integer arrays and bool masks."""
    x = as_tensor(x)
    return bind(getitem_p, x, index=normalize_index(index, x))


def check_take_bounds(low: int, high: int, axis: int, size: int) -> None:
    if high >= size or low < -size:
        raise RuleError(
            f"an index is out of bounds for axis {axis} of size {size}", error=IndexError
        )


def take_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    axis = axis_index(b.get("axis", 0), x.ndim)
    indices = b.get("indices", ())
    if isinstance(indices, TensorType):  # an integer tensor: its values are not known yet
        if indices.dtype.kind not in "iu":
            raise RuleError(f"indices must be integers, got {indices.dtype}", "dtype")
        index_shape_ = indices.shape
    else:
        values = host.asarray(indices)
        if values.dtype.kind not in "iu":
            raise RuleError("indices must be integers", "op")
        if values.size:
            check_take_bounds(int(values.min()), int(values.max()), axis, x.shape[axis])
        index_shape_ = values.shape
    return TensorType(x.shape[:axis] + index_shape_ + x.shape[axis + 1 :], x.dtype)


@public("indexing", shape_rule=take_rule, kinds={"indices": "indices", "axis": "axis"})
def take(x: Any, indices: Any, axis: int = 0) -> Tensor:
    """Elements of x at integer `indices` along `axis` (NumPy's take, no wrapping)."""
    x = as_tensor(x)
    axis = normalize_axis(axis, x.ndim, "take") + x.ndim
    if isinstance(indices, Tensor):
        indices = host_value(indices)
    indices = backend.asarray(indices, None, x.device)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"take: indices must be integers, got {indices.dtype}")
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        checked("take", check_take_bounds, low, high, axis, x.shape[axis])
    return getitem(x, (slice(None),) * axis + (indices,))


# ---- gather_nd / scatter_nd (TensorFlow's): getitem and scatter_add with index tuples ----
def _nd_index(indices: Any, shape: tuple[int, ...], opname: str, device: str) -> tuple:
    """(Ellipsis, i_0, ..., i_{K-1}, :, ...) from an integer (..., K) index array."""
    idx = backend.asarray(
        host_value(indices) if isinstance(indices, Tensor) else indices, None, device
    )
    if idx.dtype.kind not in "iu" or idx.ndim < 1:
        raise TypeError(f"{opname}: indices must be an integer tensor of rank >= 1")
    depth = idx.shape[-1]
    checked(opname, check_depth, depth, shape)
    for k in range(depth):
        if idx.size and (int(idx[..., k].min()) < 0 or int(idx[..., k].max()) >= shape[k]):
            raise IndexError(f"{opname}: an index is out of bounds for axis {k} of size {shape[k]}")
    parts = tuple(idx[..., k] for k in range(depth))
    return (Ellipsis, *parts) + (slice(None),) * (len(shape) - depth)


def check_depth(depth: int, shape: tuple[int, ...]) -> None:
    if depth > len(shape):
        raise RuleError(f"indices of depth {depth} for a tensor of shape {shape}")


def _nd_depth(indices: TensorType, shape: tuple[int, ...]) -> int:
    """The depth K of (..., K) integer indices into `shape` (gather_nd, scatter_nd)."""
    indices = concrete(indices)
    if indices.dtype.kind not in "iu" or indices.ndim < 1:
        raise RuleError(f"indices must be an integer tensor of rank >= 1, got {indices}", "dtype")
    check_depth(indices.shape[-1], shape)
    return indices.shape[-1]


def gather_nd_rule(b: dict[str, Any]) -> TensorType:
    params = concrete(b["params"])
    depth = _nd_depth(b["indices"], params.shape)
    return TensorType(b["indices"].shape[:-1] + params.shape[depth:], params.dtype)


@public("indexing", shape_rule=gather_nd_rule)
def gather_nd(params: Any, indices: Any) -> Tensor:
    """Slices of params at the integer (..., K) `indices`: shape indices[:-1] + params[K:]."""
    params = as_tensor(params)
    index = _nd_index(indices, params.shape, "gather_nd", params.device)
    if len(index) == 1:  # no index axes (K = 0): every slice is the whole tensor
        return unaliased(params)
    return bind(getitem_p, params, index=index)


def check_updates(updates: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if updates != expected:
        raise RuleError(f"updates must have shape {expected}, got {updates}")


def scatter_nd_rule(b: dict[str, Any]) -> TensorType:
    updates = concrete(b["updates"])
    shape = b.get("shape", ())
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    depth = _nd_depth(b["indices"], shape)
    check_updates(updates.shape, b["indices"].shape[:-1] + shape[depth:])
    return TensorType(shape, updates.dtype)


@public("indexing", shape_rule=scatter_nd_rule, kinds={"shape": "shape"})
def scatter_nd(indices: Any, updates: Any, shape: Sequence[int] = ()) -> Tensor:
    """Zeros of `shape` with `updates` added at `indices` (repeats add up), as TensorFlow."""
    updates = as_tensor(updates)
    shape = tuple(int(d) for d in shape)
    index = _nd_index(indices, shape, "scatter_nd", updates.device)
    depth = builtins.sum(1 for i in index if backend.is_array(i))
    idx = indices.value if isinstance(indices, Tensor) else host.asarray(indices)
    checked("scatter_nd", check_updates, updates.shape, tuple(idx.shape[:-1]) + shape[depth:])
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


def sort_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    if x.ndim:
        axis_index(b.get("axis", -1), x.ndim)
    return x


@public("indexing", shape_rule=sort_rule, kinds={"axis": "axis", "direction": "direction"})
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
        order = xp.argsort(host_value(x), axis=axis, kind="stable")
    else:
        order = _descending_order(xp, host_value(x), axis)
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
    order = _descending_order(xp, host_value(x), x.ndim - 1)[..., :k]
    return TopK(_take_along(x, order, x.ndim - 1), Tensor(order.astype(host.int32)))


# ---- pad ----
def _pad_impl(xp: Any, x: Any, *, paddings: tuple, value: float) -> Any:
    lead = ((0, 0),) * (x.ndim - len(paddings))
    return xp.pad(x, lead + paddings, constant_values=value)


pad_p = primitive("pad", _pad_impl, flow="moves")


def pad_vjp(ans: Tensor, x: Tensor, *, paddings: tuple, value: float) -> Any:
    index = (Ellipsis,) + tuple(slice(lo, lo + d) for (lo, _), d in zip(paddings, x.shape))
    return lambda g: bind(getitem_p, g, index=index)


defvjp(pad_p, pad_vjp)
# The padding value is a constant: a tangent is padded with zeros (batch axes untouched).
defjvp(pad_p, lambda t, ans, x, *, paddings, value: bind(pad_p, t[0], paddings=paddings, value=0.0))


def check_paddings(pairs: tuple, shape: tuple[int, ...]) -> None:
    if len(pairs) != len(shape) or any(lo < 0 or hi < 0 for lo, hi in pairs):
        raise RuleError(f"paddings {pairs} for a tensor of shape {shape}", "op")


def pad_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    pairs = tuple(b.get("paddings", ()))
    check_paddings(pairs, x.shape)
    check_pad_mode(x.shape, pairs, b.get("mode", "CONSTANT"))
    return TensorType(tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, pairs)), x.dtype)


@public(
    "shape",
    shape_rule=pad_rule,
    kinds={"paddings": "paddings", "mode": "pad_mode", "constant_values": "float"},
)
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
    checked("pad", check_paddings, pairs, x.shape)
    checked("pad", check_pad_mode, x.shape, pairs, mode)
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
        source = host.pad(host.arange(n), (lo, hi), mode=_PAD_MODES[mode])  # type: ignore[call-overload]
        index = (Ellipsis,) + (slice(None),) * axis + (xp.asarray(source),)
        index += (slice(None),) * (x.ndim - axis - 1)
        out = bind(getitem_p, out, index=index)
    return out


def check_pad_mode(shape: tuple, pairs: tuple, mode: str) -> None:
    """RuleError where a mirrored or repeated padding has too few entries to copy."""
    if mode == "CONSTANT":
        return
    for axis, ((lo, hi), n) in enumerate(zip(pairs, shape)):
        limit = n - 1 if mode == "REFLECT" else n
        if (lo or hi) and (n == 0 or (mode != "EDGE" and builtins.max(lo, hi) > limit)):
            raise RuleError(
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
def tiled_shape(old: tuple[int, ...], multiples: Sequence[int] | int = ()) -> tuple[int, ...]:
    multiples = (multiples,) if isinstance(multiples, int) else tuple(int(m) for m in multiples)
    if len(multiples) != len(old) or any(m < 0 for m in multiples):
        raise RuleError(f"multiples {multiples} for a tensor of shape {old}", "op")
    return tuple(m * d for m, d in zip(multiples, old))


@public("shape", shape_rule=_keep_dtype(tiled_shape), kinds={"multiples": "shape"})
def tile(x: Any, multiples: Sequence[int] = ()) -> Tensor:
    """x repeated multiples[i] times along axis i."""
    x = as_tensor(x)
    checked("tile", tiled_shape, x.shape, multiples)
    multiples = (multiples,) if isinstance(multiples, int) else tuple(int(m) for m in multiples)
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
