"""Per-example gradients and their statistics in one batched pass (BackPACK's BatchGrad,
BatchL2Grad, Variance, SumGradSquared; torch.func's vmap(grad)).

    found = per_example(curv)            # curv: a Curvature (engine/curvature.py)
    found.gradients["w1"]                # (N, *w1.shape): g_i = d l_i / d w1
    found.norms, found.mean, found.variance, found.sum_squares

Convention: l_i is example i's loss alone (curvature.py's "per-example conventions"), so
g_i is the gradient of a batch of one; the batch gradient is c * sum_i g_i with c the
loss's reduction (1/N for a mean, 1 for a sum; `scale`). BackPACK's BatchGrad answers
c * g_i: multiply by `scale` for it.

How, without N backward passes. The recorded forward is walked once to find where the
parameters meet the data (`ExampleFlow`): every tensor computed from the data carries,
per element, the example it belongs to (an array of example ids pushed through the
ops' own forwards), which proves that no op mixes examples (a batch mean, batch norm in
training mode: refused, naming the op) and says which rows of an op's input belong to
which example. One backward pass of the batch's loss then gives the cotangent of every
op where a parameter (or a tensor computed from parameters only) meets the data; there
the per-example share of the parameter's cotangent is formed without summing over the
examples (for x @ W: the outer products x_i^T g_i, in one batched GEMM; for x + b: g
summed over each example's positions), and the few ops between the parameters and those
meeting points run backward once with a leading example axis. The cost is one gradient
plus the per-example outer products (what the answer holds), in chunks of examples under
a memory bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import backend, trace, tree
from engine.ops import conv
from engine.registry import ELEMENT_FLOW, ZERO, get_vjp, impl_rules
from engine.tape import GradientTape, Record, _plan
from engine.tensor import Tensor, as_tensor

NONE = -1.0  # the id of an element no example's data reaches


class MixedExamplesError(ValueError):
    """The model lets an example's output depend on other examples (or on no fixed one).
    `record`: the op where it was found (None when not one op); `records`: the recorded
    forward it is in (a caller that knows its program's lines can name the line)."""

    record: Record | None = None
    records: list[Record] | None = None


def _flow(rec: Record) -> str | None:
    """How the record's primitive maps input elements to output elements
    (registry.ELEMENT_FLOW; None: unknown to the walk)."""
    return ELEMENT_FLOW.get(rec.prim) if rec.prim is not None else None


def _name(rec: Record) -> str:
    return rec.prim.name if rec.prim is not None else "a custom-gradient function"


def _merge(a: np.ndarray, b: np.ndarray, rec: Record) -> np.ndarray:
    """Elementwise union of two id arrays (broadcast): conflicting ids mix examples."""
    a, b = np.broadcast_arrays(a, b)
    clash = (a >= 0) & (b >= 0) & (a != b)
    if clash.any():
        raise _mixed(rec, "combines elements of different examples")
    return np.where(a >= 0, a, b)


def _mixed(rec: Record, how: str) -> MixedExamplesError:
    shapes = ", ".join(str(list(x.shape)) for x in rec.inputs)
    error = MixedExamplesError(
        f"per-example: the model mixes examples at op {_name(rec)!r} (inputs {shapes}): it "
        f"{how}, so an example's output depends on other examples (a mean or sum over the "
        "batch axis, batch norm in training mode, a matmul across examples); per-example "
        "gradients, Kronecker factors and Laplace need examples along axis 0 that stay "
        "apart until the loss"
    )
    error.record = rec
    return error


def _unknown(rec: Record) -> MixedExamplesError:
    """An op with no declared element flow (registry.ELEMENT_FLOW): not known to mix the
    examples, but the walk cannot show that it keeps them apart."""
    shapes = ", ".join(str(list(x.shape)) for x in rec.inputs)
    error = MixedExamplesError(
        f"per-example: op {_name(rec)!r} (inputs {shapes}) is one the per-example walk cannot "
        "follow, so it cannot tell whether the op keeps the examples apart; per-example "
        "gradients, Kronecker factors and Laplace follow the elementwise, shape, reduction, "
        "softmax, matrix-product and convolution ops (not einsum, solve, scatter_add or a "
        "custom-gradient function)"
    )
    error.record = rec
    return error


def _single(ids: np.ndarray, axes: tuple[int, ...], keepdims: bool, rec: Record) -> np.ndarray:
    """Ids reduced over `axes`, which must each hold one example (or none)."""
    top = ids.max(axis=axes, keepdims=keepdims)
    low = np.where(ids >= 0, ids, np.inf).min(axis=axes, keepdims=keepdims)
    if ((top >= 0) & (low != top)).any():
        raise _mixed(rec, f"reduces over axes {list(axes)} across examples")
    return top


@dataclass
class Meeting:
    """An op where a parameter-only tensor (`argnum`) meets the data."""

    record: Record
    argnum: int
    kind: str  # "matmul" or "elementwise"


@dataclass
class ExampleFlow:
    """The recorded forward of a model, read for its examples (see the module doc)."""

    n: int
    ids: dict[int, np.ndarray]  # tensor id -> example id per element (float32, NONE)
    param_only: dict[int, Tensor]  # tensors computed from the parameters alone
    meetings: list[Meeting]
    plan: list  # the records from the parameters to the output, oldest first
    output: Tensor
    layouts: dict[int, Any] = field(default_factory=dict)  # record id -> MatmulLayout
    made_by: dict[int, Record] = field(default_factory=dict)  # tensor id -> its record


def example_flow(
    records: list[Record], params: list[Tensor], output: Tensor, data: list[Tensor]
) -> ExampleFlow:
    """Walk the records between `params` and `output` (see the module doc). `data`: the
    watched data leaves, row i of each (with the output's N rows) example i's; other
    leaves are constants every example shares."""
    if output.ndim < 1:
        raise MixedExamplesError(
            "per-example: the model's output is a scalar; it needs examples along axis 0"
        )
    n = output.shape[0]
    sources = {id(p) for p in params} | {id(x) for x in data}
    plan = [rec for rec, _ in reversed(_plan(records, {id(output)}, sources))]
    produced = {id(o) for rec in plan for o in rec.outputs}
    param_only: dict[int, Tensor] = {id(p): p for p in params}
    data_ids = {id(x) for x in data}
    ids: dict[int, np.ndarray] = {}
    meetings: list[Meeting] = []

    def ids_of(x: Tensor) -> np.ndarray | None:
        if id(x) in ids:
            return ids[id(x)]
        if id(x) in param_only or id(x) in produced:
            return None
        if id(x) in data_ids and x.ndim >= 1 and x.shape[0] == n:  # row i: example i's
            leaf = np.broadcast_to(
                np.arange(n, dtype=np.float32).reshape((n,) + (1,) * (x.ndim - 1)), x.shape
            )
            ids[id(x)] = leaf
            return leaf
        return None  # a constant every example shares

    for rec in plan:
        ins = [ids_of(x) for x in rec.inputs]
        out = rec.outputs[0]
        if all(i is None for i in ins):
            if all(id(x) in param_only or id(x) not in produced for x in rec.inputs):
                for o in rec.outputs:
                    param_only[id(o)] = o
                continue
            raise _mixed(rec, "reads a tensor the walk did not reach")
        ids[id(out)] = _propagate(rec, ins)
        for j, x in enumerate(rec.inputs):
            if id(x) in param_only and ins[j] is None:
                flow = _flow(rec)
                if flow == "contracts":
                    meetings.append(Meeting(rec, j, "matmul"))
                elif flow in ("elementwise", "rows"):
                    # a row op's rows each hold one example (_propagate checked), so the
                    # elementwise share (its VJP, summed over each example's positions) holds
                    meetings.append(Meeting(rec, j, "elementwise"))
                else:
                    raise MixedExamplesError(
                        f"per-example: a parameter meets the data at op {_name(rec)!r} (inputs "
                        f"{[list(t.shape) for t in rec.inputs]}), which has no per-example "
                        "rule (matmul, convolution and elementwise ops have one)"
                    )
    out_ids = ids.get(id(output))
    if out_ids is None:
        raise MixedExamplesError("per-example: the model's output does not depend on its data")
    rows = np.arange(n, dtype=np.float32).reshape((n,) + (1,) * (output.ndim - 1))
    if ((out_ids >= 0) & (out_ids != rows)).any():
        raise MixedExamplesError(
            "per-example: row i of the model's output depends on other examples' data "
            "(the model reorders or mixes the batch)"
        )
    made_by = {id(o): rec for rec in plan for o in rec.outputs}
    return ExampleFlow(n, ids, param_only, meetings, plan, output, made_by=made_by)


def _propagate(rec: Record, ins: list[np.ndarray | None]) -> np.ndarray:
    """The ids of a record's output from its inputs' (None: no example's)."""
    flow, out = _flow(rec), rec.outputs[0]
    full = [
        np.full(x.shape, NONE, np.float32) if i is None else i
        for x, i in zip(rec.inputs, ins, strict=True)
    ]
    if rec.prim is None or len(rec.outputs) != 1:
        raise _unknown(rec)
    if flow == "rows":
        merged = full[0]
        for other in full[1:]:
            merged = _merge(merged, other, rec)
        merged = np.broadcast_to(merged, out.shape)
        axis = rec.params.get("axis", -1) % out.ndim
        row = _single(merged, (axis,), True, rec)
        return np.ascontiguousarray(np.broadcast_to(row, out.shape))
    if flow == "elementwise":
        merged = full[0]
        for other in full[1:]:
            merged = _merge(merged, other, rec)
        return np.ascontiguousarray(np.broadcast_to(merged, out.shape))
    if flow == "moves":
        params = dict(rec.params)
        if "value" in params:
            params["value"] = NONE
        moved = impl_rules[rec.prim](np, *[np.ascontiguousarray(f) for f in full], **params)
        return np.asarray(moved, np.float32)
    if flow in ("reduces", "scans"):
        axes = rec.params.get("axes", rec.params.get("axis"))
        ndim = rec.inputs[0].ndim
        axes = (
            tuple(range(ndim))
            if axes is None
            else ((axes,) if isinstance(axes, int) else tuple(axes))
        )
        axes = tuple(a % ndim for a in axes)
        if flow == "scans":
            _single(full[0], axes, True, rec)
            return full[0]
        return _single(full[0], axes, bool(rec.params.get("keepdims", False)), rec)
    if flow == "contracts":
        a, b = full
        if rec.params.get("ta"):
            a = np.swapaxes(a, -1, -2)
        if rec.params.get("tb"):
            b = np.swapaxes(b, -1, -2)
        squeeze = None
        if b.ndim == 1:  # NumPy's vector operands: a column on the right, a row on the left
            b, squeeze = b[:, None], -1
        if a.ndim == 1:
            a, squeeze = a[None, :], -2
        rows = _single(a, (a.ndim - 1,), False, rec)[..., :, None]
        cols = _single(b, (b.ndim - 2,), False, rec)[..., None, :]
        merged = _merge(rows, cols, rec)
        if squeeze is not None:
            merged = np.squeeze(merged, squeeze)
        return np.ascontiguousarray(np.broadcast_to(merged, out.shape))
    raise _unknown(rec)


# ----------------------------------------------------------------------------------------
# The per-example share of a parameter-side tensor's cotangent at one meeting
# ----------------------------------------------------------------------------------------


def _runs(ids: np.ndarray, n: int, rec: Record) -> int:
    """ids (positions,) must be n equal contiguous runs 0, 0, .., 1, 1, ..: their length."""
    if ids.size % n:
        raise _mixed(rec, "spreads the examples unevenly over a parameter's positions")
    p = ids.size // n
    if not np.array_equal(ids, np.repeat(np.arange(n, dtype=np.float32), p)):
        raise MixedExamplesError(
            f"per-example: at op {_name(rec)!r} the rows meeting a parameter are not grouped "
            "by example (or some belong to none); this layout has no per-example rule"
        )
    return p


@dataclass
class MatmulLayout:
    """A meeting x @ P (or P @ x, as its transpose) put in the form
    data (K, N, p, k) @ P (K, k, m) -> cotangent (K, N, p, m): K the parameter's own batch
    axes (conv groups), N examples each owning p rows (positions), k the contraction."""

    data: Any
    cotangent_axes: tuple  # how to bring the op's cotangent to (K, N, p, m)
    swap: bool  # P was the left operand: the share is transposed back
    kept: tuple[int, ...]  # P's batch shape
    param_shape: tuple[int, ...]
    rows: int  # p
    vector: int | None = None  # a 1-D operand's axis NumPy drops from the output (-1, -2)
    side: tuple[int, int] = (0, 0)  # the parameter as a matrix (a vector as a column/row)


def matmul_layout(flow: ExampleFlow, meeting: Meeting) -> MatmulLayout:
    rec, j = meeting.record, meeting.argnum
    xp = backend.array_module(rec.inputs[0].value)
    a, b = rec.inputs[0].value, rec.inputs[1].value
    ida, idb = flow.ids.get(id(rec.inputs[0])), flow.ids.get(id(rec.inputs[1]))
    if rec.params.get("ta"):
        a = xp.swapaxes(a, -1, -2)
        ida = None if ida is None else np.swapaxes(ida, -1, -2)
    if rec.params.get("tb"):
        b = xp.swapaxes(b, -1, -2)
        idb = None if idb is None else np.swapaxes(idb, -1, -2)
    # A vector operand as NumPy reads it: a column on the right, a row on the left (the
    # output lacks that axis; the cotangent gets it back in cotangent_rows).
    vector = None
    if b.ndim == 1:
        b, idb, vector = b[:, None], None if idb is None else idb[:, None], -1
    if a.ndim == 1:
        a, ida, vector = a[None, :], None if ida is None else ida[None, :], -2
    side = tuple((a if j == 0 else b).shape[-2:])
    swap = j == 0
    if swap:  # P @ x = (x^T @ P^T)^T
        assert idb is not None  # the data side carries example ids
        data, ids, param = xp.swapaxes(b, -1, -2), np.swapaxes(idb, -1, -2), xp.swapaxes(a, -1, -2)
    else:
        assert ida is not None
        data, ids, param = a, ida, b
    batch = data.ndim - 2
    pshape = (1,) * (batch - (param.ndim - 2)) + tuple(param.shape[:-2])
    if len(pshape) > batch:
        raise _mixed(rec, "broadcasts a parameter over more axes than the data has")
    kept = tuple(i for i in range(batch) if pshape[i] != 1 and pshape[i] == data.shape[i])
    if any(pshape[i] != 1 and i not in kept for i in range(batch)):
        raise _mixed(rec, "broadcasts the data against a parameter's batch axes")
    summed = tuple(i for i in range(batch) if i not in kept)
    order = kept + summed + (batch, batch + 1)
    k_size = math.prod(data.shape[i] for i in kept)
    moved = xp.transpose(data, order).reshape(k_size, -1, data.shape[-1])
    row_ids = _single(ids, (ids.ndim - 1,), False, rec)
    row_ids = np.transpose(row_ids, kept + summed + (batch,)).reshape(k_size, -1)
    if not (row_ids == row_ids[:1]).all():
        raise _mixed(rec, "gives a parameter's batch axes different examples")
    p = _runs(row_ids[0], flow.n, rec)
    return MatmulLayout(
        data=moved.reshape(k_size, flow.n, p, data.shape[-1]),
        cotangent_axes=(order, k_size),
        swap=swap,
        kept=tuple(data.shape[i] for i in kept),
        param_shape=tuple(rec.inputs[j].shape),
        rows=p,
        vector=vector,
        side=side,
    )


def cotangent_rows(flow: ExampleFlow, layout: MatmulLayout, g: Any) -> Any:
    """The op's output cotangent in the layout's form (K, N, p, m)."""
    xp = backend.array_module(g)
    if layout.vector is not None:
        g = xp.expand_dims(g, layout.vector)
    if layout.swap:
        g = xp.swapaxes(g, -1, -2)
    order, k_size = layout.cotangent_axes
    g = xp.broadcast_to(g, g.shape)  # a view; transpose below copies once
    return xp.transpose(g, order).reshape(k_size, flow.n, layout.rows, g.shape[-1])


def _matmul_share(
    flow: ExampleFlow, meeting: Meeting, g: Any, chunk: slice, cache: dict | None = None
) -> Any:
    layout = flow.layouts.get(id(meeting.record))
    if layout is None:
        layout = flow.layouts[id(meeting.record)] = matmul_layout(flow, meeting)
    xp = backend.array_module(g)
    x = layout.data[:, chunk]  # (K, n, p, k)
    rows = None if cache is None else cache.get(id(meeting.record))
    if rows is None:  # the cotangent's copy in rows, once for every chunk (the cache)
        rows = cotangent_rows(flow, layout, g)
        if cache is not None:
            cache[id(meeting.record)] = rows
    gr = rows[:, chunk]  # (K, n, p, m)
    kk, nn, p, k = x.shape
    m = gr.shape[-1]
    if layout.swap:  # the share is made transposed, (n, K, m, k): no copy afterwards
        x, gr, k, m = gr, x, m, k
    if kk == 1:
        x, gr = x[0], gr[0]  # (n, p, k), (n, p, m)
        if p == 1:  # outer products x_i^T g_i (einsum: twice NumPy's broadcast multiply)
            share = xp.einsum("nk,nm->nkm", x[:, 0], gr[:, 0])
            return share.reshape((nn,) + layout.param_shape)
        share = xp.matmul(xp.swapaxes(x, -1, -2), gr)  # (n, k, m)
        return share.reshape((nn,) + layout.param_shape)
    share = xp.matmul(xp.swapaxes(x.reshape(kk * nn, p, k), -1, -2), gr.reshape(kk * nn, p, m))
    share = xp.moveaxis(share.reshape(kk, nn, k, m), 1, 0)  # (n, K, k, m)
    return xp.ascontiguousarray(share).reshape((nn,) + layout.param_shape)


def _elementwise_share(
    flow: ExampleFlow, meeting: Meeting, g: Any, chunk: slice, cache: dict | None = None
) -> Any:
    """g * d out / d P, unreduced (P expanded to the output's shape), then summed over
    each example's positions. Needs the output's example axis to be its first. With a
    cache, the shares of every example are formed once (output-sized: no larger than
    the op's output) and each chunk takes its rows."""
    rec, j = meeting.record, meeting.argnum
    # (keyed by the argument too: layer_norm_affine meets two parameters, scale and shift)
    key = (id(rec), j)
    if cache is not None and key in cache:
        return cache[key][chunk]
    out = rec.outputs[0]
    ids = flow.ids[id(out)]
    rows = np.arange(flow.n, dtype=np.float32).reshape((flow.n,) + (1,) * (out.ndim - 1))
    if not ((ids == rows) | (ids < 0)).all():
        raise MixedExamplesError(
            f"per-example: at op {_name(rec)!r} a parameter meets data whose examples are not "
            "along the first axis; this layout has no per-example rule"
        )
    param = rec.inputs[j]
    xp = backend.array_module(param.value)
    padded = (1,) * (out.ndim - param.ndim) + tuple(param.shape)
    if padded[0] != 1:
        raise MixedExamplesError(
            f"per-example: at op {_name(rec)!r} a parameter of shape {list(param.shape)} has "
            "one row per example; give it no example axis"
        )
    expanded = Tensor(xp.ascontiguousarray(xp.broadcast_to(param.value.reshape(padded), out.shape)))
    inputs = list(rec.inputs)
    inputs[j] = expanded
    ans = rec.outputs[0]
    assert rec.prim is not None  # meetings are primitives' records
    part = get_vjp(rec.prim)(j, ans, *inputs, **rec.params)(Tensor(g))
    value = xp.zeros(out.shape, param.dtype) if part is ZERO else part.value
    if cache is None:
        value = value[chunk]
    axes = tuple(a for a in range(1, out.ndim) if padded[a] == 1 and out.shape[a] != 1)
    if axes:
        value = value.sum(axis=axes, keepdims=True)
    value = value.reshape((value.shape[0],) + tuple(param.shape))
    if cache is None:
        return value
    cache[key] = value
    return value[chunk]


SHARES = {"matmul": _matmul_share, "elementwise": _elementwise_share}


# ----------------------------------------------------------------------------------------
# Per-example gradients
# ----------------------------------------------------------------------------------------


@dataclass
class PerExampleResult:
    """Per-example gradients g_i = d l_i / d params and their statistics.

    gradients: in the parameters' structure, each leaf (N, *shape) (None when not kept);
    norms: (N,) ||g_i||_2 over all parameters; norms_by_source: the same per leaf, in the
    parameters' structure; mean: (1/N) sum_i g_i; variance: (1/N) sum_i (g_i - mean)^2,
    elementwise (BackPACK's Variance of the per-example gradients); sum_squares:
    sum_i g_i^2, elementwise (BackPACK's SumGradSquared of g_i); scale: c (the batch
    gradient is c * sum_i g_i); chunks: the passes over examples it took."""

    n: int
    scale: float
    norms: np.ndarray | None
    norms_by_source: Any
    mean: Any
    variance: Any
    sum_squares: Any
    gradients: Any = None
    chunks: int = 1
    meetings: list[str] = field(default_factory=list)


class PerExample:
    """The per-example machinery on one Curvature recording: its flow (once), the
    cotangents at the meetings (one backward pass, once), then shares per chunk."""

    def __init__(
        self,
        model: Any,
        flat: list[Tensor],
        treedef: Any,
        data: Any,
        recorded: tuple[GradientTape, Tensor, list[Tensor]] | None = None,
    ):
        """`recorded`: (tape, output, watched data) of a forward already recorded with
        the parameters and the floating-point data watched (a Curvature's); else (or
        when that forward has convolutions) the forward runs once more on such a tape
        here."""
        self.flat, self.treedef = flat, treedef
        if recorded is not None and not any(r.prim is conv.conv_p for r in recorded[0]._records):
            self.tape, self.output, watched = recorded
        else:
            # Convolutions recorded as im2col and a matmul, which the walk reads as a
            # parameter meeting the data (the conv primitives' records it cannot).
            leaves, data_def = tree.flatten(data)
            inputs = [None if x is None else as_tensor(x) for x in leaves]
            self.tape = GradientTape(persistent=True, watch_accessed_variables=False)
            with self.tape, conv.unfused():
                self.tape.watch(flat)
                watched = [x for x in inputs if x is not None and x.dtype.kind == "f"]
                self.tape.watch(watched)
                self.output = model(tree.unflatten(treedef, flat), tree.unflatten(data_def, inputs))
        if not isinstance(self.output, Tensor):
            raise MixedExamplesError("per-example: the model must return one tensor")
        try:
            self.flow = example_flow(self.tape._records, flat, self.output, watched)
        except MixedExamplesError as exc:
            exc.records = self.tape._records
            raise

    @classmethod
    def of(cls, curv: Any) -> PerExample:
        """The machinery of a Curvature recording, built once and kept on it."""
        if getattr(curv, "_per_example", None) is None:
            watched = getattr(curv, "_watched_data", None)
            # Its own recording when it watched the data (tensors given); else once more.
            recorded = (curv._inner, curv.output, watched) if watched else None
            curv._per_example = cls(curv._model, curv._flat, curv._treedef, curv.data, recorded)
        return curv._per_example

    def meeting_cotangents(self, seed: Any, batch_ndim: int = 0) -> dict[int, Any]:
        """The cotangents of the meetings' outputs for the output cotangent `seed`
        (with `batch_ndim` leading axes: several seeds in one pass)."""
        outs: list[Tensor] = []
        for m in self.flow.meetings:
            o = m.record.outputs[0]
            if all(o is not x for x in outs):
                outs.append(o)
        with trace.nothing_recording():
            cts = self.tape._run([self.output], [Tensor(seed)], outs, batch_ndim)
        xp = backend.array_module(seed)
        lead = tuple(seed.shape[:batch_ndim])
        return {
            id(o): (cts[id(o)].value if id(o) in cts else xp.zeros(lead + o.shape, o.dtype))
            for o in outs
        }

    def shares(
        self, cotangents: dict[int, Any], chunk: slice, rows: int, cache: dict | None = None
    ) -> list[Tensor]:
        """Per-example gradients of the parameters for the examples in `chunk`: the
        meetings' shares, then the parameter-only ops backward with a leading axis.
        `cache`: a dict kept across the chunks of one set of cotangents, so that what
        every chunk reads (the cotangents in rows) is formed once, not once a chunk."""
        flow = self.flow
        targets: dict[int, Tensor] = {}
        seeds: dict[int, Any] = {}
        for m in flow.meetings:
            p = m.record.inputs[m.argnum]
            with trace.nothing_recording():
                share = SHARES[m.kind](flow, m, cotangents[id(m.record.outputs[0])], chunk, cache)
            targets[id(p)] = p
            seeds[id(p)] = share if id(p) not in seeds else seeds[id(p)] + share
        params = self.flat
        xp = backend.array_module(params[0].value)
        plain = {id(p) for p in params}
        out = {k: v for k, v in seeds.items() if k in plain}
        inner = [k for k in seeds if k not in plain]
        if inner:
            with trace.nothing_recording():
                cts = self.tape._run(
                    [targets[k] for k in inner], [Tensor(seeds[k]) for k in inner], params, 1
                )
            for p in params:
                if id(p) in cts:
                    v = cts[id(p)].value
                    out[id(p)] = v if id(p) not in out else out[id(p)] + v
        return [
            Tensor(out[id(p)] if id(p) in out else xp.zeros((rows,) + p.shape, p.dtype))
            for p in params
        ]


def per_example(
    curv: Any,
    *,
    keep_gradients: bool = True,
    max_bytes: int | None = None,
    seed: Any = None,
    statistics: bool = True,
) -> PerExampleResult:
    """Per-example gradients of a Curvature recording and their statistics (see
    PerExampleResult). `max_bytes` bounds the per-example gradients held at once: the
    examples run in chunks that fit (the statistics accumulate over chunks; with
    keep_gradients the answer itself holds N gradients). `seed`: the output cotangent
    to split by example instead of the loss's (the loss Hessian's square-root columns,
    for the GGN's diagonal); default G / c, which gives g_i. statistics=False: the
    gradients alone (norms, mean, variance and sum_squares None)."""
    if not (statistics or keep_gradients):
        raise ValueError("per_example: ask for the gradients, the statistics or both")
    engine = PerExample.of(curv)
    n, c = curv.examples, curv.scale()
    if seed is None:
        seed = curv.output_grad.value / c
    cotangents = engine.meeting_cotangents(seed)
    params = curv._flat
    per_row = sum(p.size for p in params) * params[0].dtype.itemsize
    step = n if max_bytes is None else max(1, min(n, max_bytes // max(per_row, 1)))
    xp = backend.array_module(params[0].value)
    # Mean and variance merged chunk by chunk (Chan et al.), sums of squares summed;
    # einsum contracts without a temporary the size of the gradients.
    mean = [xp.zeros(p.size, np.float64) for p in params]
    m2 = [xp.zeros(p.size, np.float64) for p in params]
    squares = [xp.zeros(p.size, np.float64) for p in params]
    norms_by = [np.zeros(n) for _ in params]
    kept: list[list[Any]] = [[] for _ in params]
    chunks, seen = 0, 0
    cache: dict[int, Any] | None = {} if step < n else None
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = stop - start
        chunks += 1
        shares = engine.shares(cotangents, slice(start, stop), rows, cache)
        for k, s in enumerate(shares):
            flat = s.value.reshape(rows, -1)
            if statistics:
                flat = flat.astype(np.float64, copy=False)
                row_squares = xp.einsum("ij,ij->i", flat, flat)
                col_squares = xp.einsum("ij,ij->j", flat, flat)
                squares[k] += col_squares
                part_mean = xp.ones(rows) @ flat / rows
                # sum (g - mean)^2 = sum g^2 - rows mean^2, except where that cancels
                # (the examples' gradients nearly equal): there from the differences.
                part_m2 = col_squares - rows * part_mean * part_mean
                risky = part_m2 <= 1e-6 * col_squares
                if risky.any():
                    diff = flat[:, risky] - part_mean[risky]
                    part_m2[risky] = xp.einsum("ij,ij->j", diff, diff)
                delta = part_mean - mean[k]
                total = seen + rows
                mean[k] = mean[k] + delta * (rows / total)
                m2[k] = m2[k] + part_m2 + delta * delta * (seen * rows / total)
                norms_by[k][start:stop] = backend.to_host(xp.sqrt(row_squares))
            if keep_gradients:
                kept[k].append(s.value)
        seen += rows
    variance = [m / n for m in m2]

    def host(arrays: list[Any]) -> Any:
        return tree.unflatten(
            curv._treedef,
            [
                np.asarray(backend.to_host(a)).reshape(p.shape)
                for a, p in zip(arrays, params, strict=True)
            ],
        )

    gradients = None
    if keep_gradients:
        gradients = tree.unflatten(
            curv._treedef,
            [
                np.asarray(
                    backend.to_host(parts[0] if len(parts) == 1 else xp.concatenate(parts, 0))
                )
                for parts in kept
            ],
        )
    return PerExampleResult(
        n=n,
        scale=c,
        norms=np.sqrt(sum(b * b for b in norms_by)) if statistics else None,
        norms_by_source=tree.unflatten(curv._treedef, norms_by) if statistics else None,
        mean=host(mean) if statistics else None,
        variance=host(variance) if statistics else None,
        sum_squares=host(squares) if statistics else None,
        gradients=gradients,
        chunks=chunks,
        meetings=[_name(m.record) for m in engine.flow.meetings],
    )


__all__ = ["MixedExamplesError", "PerExample", "PerExampleResult", "example_flow", "per_example"]
