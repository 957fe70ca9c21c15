"""Forward mode: ForwardAccumulator pushes tangents alongside the forward computation.

As tf.autodiff.ForwardAccumulator: while active, every primitive that consumes a tensor
with a tangent gets its output tangent from the primitive's JVP rule. JVP rules are made
of engine ops, so tapes record them (forward-over-reverse Hessians) and outer
accumulators push tangents through them (higher-order forward mode).

Tangents may carry leading batch axes (all the same count): one forward pass then gives
many directional derivatives at once (`jacfwd`, `hessian`).
"""

from __future__ import annotations

import weakref
from typing import Any, Self

from engine import trace, tree
from engine.ops.shape import broadcast_to, reshape
from engine.registry import BROADCASTING, NONDIFFERENTIABLE, Primitive, get_jvp
from engine.tensor import Tensor, as_tensor


class ForwardAccumulator:
    """Computes Jacobian-vector products in the forward pass.

    primals: tensors (or a structure of them); tangents: the same structure, each with the
    primal's shape, or with `batch_ndim` extra leading axes.
    """

    def __init__(self, primals: Any, tangents: Any, batch_ndim: int = 0):
        flat_p, _ = tree.flatten(primals)
        flat_t, _ = tree.flatten(tangents)
        if len(flat_p) != len(flat_t):
            raise ValueError(
                f"ForwardAccumulator: {len(flat_t)} tangents for {len(flat_p)} primals"
            )
        self.batch_ndim = batch_ndim
        # Tangents by id(primal), each entry dropped when its primal dies (a weak
        # reference's callback): a tangent is only asked for through its primal, and the
        # tangents of a pass's intermediates (a fresh HVP's cotangents, say) are then
        # freed as the pass frees the intermediates, instead of living as long as this
        # accumulator. (CPython runs the callback before the id can be reused.)
        self._tangents: dict[int, Tensor] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._watched = list(flat_p)  # the primals given: their tangents stay answerable
        lead: tuple | None = None
        for p, t in zip(flat_p, flat_t, strict=True):
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"ForwardAccumulator: primals must be tensors, got {type(p).__name__}"
                )
            if p.dtype.kind != "f":
                raise TypeError(f"ForwardAccumulator: primal of dtype {p.dtype} has no tangent")
            t = as_tensor(t, like=p)
            if t.dtype != p.dtype:
                raise TypeError(
                    f"ForwardAccumulator: tangent dtype {t.dtype} differs from primal {p.dtype}"
                )
            if t.shape[batch_ndim:] != p.shape or t.ndim != p.ndim + batch_ndim:
                raise ValueError(
                    f"ForwardAccumulator: tangent of shape {t.shape} for a primal of shape {p.shape}"
                    + (f" with {batch_ndim} batch axes" if batch_ndim else "")
                )
            if lead is not None and t.shape[:batch_ndim] != lead:
                raise ValueError("ForwardAccumulator: tangents disagree on their batch axes")
            lead = t.shape[:batch_ndim]
            self._set(p, t)
        self._lead = lead if lead is not None else ()

    def _set(self, primal: Tensor, tangent: Tensor) -> None:
        key = id(primal)
        tangents, refs = self._tangents, self._refs

        def forget(ref: weakref.ref, key: int = key) -> None:
            if refs.get(key) is ref:
                del refs[key]
                tangents.pop(key, None)

        tangents[key] = tangent
        refs[key] = weakref.ref(primal, forget)

    def __enter__(self) -> Self:
        trace.active_accumulators.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in trace.active_accumulators:
            trace.active_accumulators.remove(self)

    def jvp(self, primals: Any, unconnected_gradients: str = "none") -> Any:
        """The tangents of these tensors (None, or zeros, where they do not depend on the
        watched primals), in their structure."""
        flat, treedef = tree.flatten(primals)
        out = []
        for p in flat:
            t = self._tangents.get(id(p)) if isinstance(p, Tensor) else None
            if (
                t is None
                and str(getattr(unconnected_gradients, "value", unconnected_gradients)) == "zero"
            ):
                t = _zeros_tangent(p, self)
            out.append(t)
        return tree.unflatten(treedef, out)

    # Called by bind ------------------------------------------------------------------
    def _record_read(self, variable: Any, r: Tensor) -> None:
        tangent = self._tangents.get(id(variable))
        if tangent is not None and id(r) not in self._tangents:
            self._set(r, tangent)

    def _propagate(
        self, prim: Primitive, args: tuple[Tensor, ...], params: dict[str, Any], ans: Tensor
    ) -> None:
        tangents = self._tangents
        ts = [tangents.get(id(a)) for a in args]
        if all(t is None for t in ts) or prim in NONDIFFERENTIABLE:
            return
        with trace.paused(self):
            if self.batch_ndim and prim in BROADCASTING:
                ts = _align(ts, args, self.batch_ndim)
            out = get_jvp(prim)(ts, ans, *args, **params)
        if out is not None:
            self._set(ans, self._fit(out, ans))

    def _propagate_custom(self, record: Any, body: list[Tensor]) -> None:
        """Through a custom gradient: the tangents of the body's outputs (the body ran
        under this accumulator), as TensorFlow's forward mode does."""
        for b, o in zip(body, record.outputs, strict=True):
            tangent = self._tangents.get(id(b))
            if tangent is not None:
                self._set(o, tangent)

    def _fit(self, t: Tensor, ans: Tensor) -> Tensor:
        """Broadcast a tangent to (*batch, *ans.shape): rules may return it unbroadcast."""
        target = t.shape[: self.batch_ndim] + ans.shape
        if t.ndim < len(target):
            target = self._lead + ans.shape
        return t if t.shape == target else broadcast_to(t, target)


def _align(ts: list, args: tuple, batch_ndim: int) -> list:
    """Insert size-1 axes after the batch axes of lower-rank arguments' tangents, so
    they broadcast against the others as their primals do."""
    rank = max(a.ndim for a in args)
    out = []
    for t, a in zip(ts, args, strict=True):
        if t is not None and a.ndim < rank:
            t = reshape(t, t.shape[:batch_ndim] + (1,) * (rank - a.ndim) + a.shape)
        out.append(t)
    return out


def _zeros_tangent(p: Any, acc: ForwardAccumulator) -> Tensor:
    from engine import backend

    p = as_tensor(p)
    zeros = Tensor(backend.array_module(p.value).zeros(acc._lead + p.shape, dtype=p.dtype))
    if trace.capture is not None:  # zeros whatever the data: a constant of a captured pass
        trace.capture.constant(zeros)
    return zeros
