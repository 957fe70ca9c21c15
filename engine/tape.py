"""GradientTape: records primitive applications and runs the reverse pass.

A tape watches tensors (by identity). While it is active (inside `with tape:`), every
primitive that consumes a watched tensor is appended to its records, and the output
becomes watched too. The records are therefore already in topological order, and the
backward pass is one reverse sweep over the part of them that connects the sources to
the targets.

Several tapes may be active at once. A tape pauses itself while it computes a gradient,
so its backward operations are recorded by the *other* active tapes only: that is how
an outer tape sees the inner tape's gradient computation and can differentiate it again
(all VJP rules are made of recorded engine ops).

Cotangents may carry leading batch axes (`_backward(..., batch_ndim=k)`): jacobians
and batch jacobians are one backward pass with a stack of cotangents.
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

import numpy as np

from engine import backend, trace, tree
from engine.ops.reduce import sum as reduce_sum
from engine.ops.reduce import sum_p
from engine.ops.shape import broadcast_to, concatenate, reshape, transpose
from engine.registry import (
    NONDIFFERENTIABLE,
    ZERO,
    Primitive,
    argument_vjp,
    term_joined_param,
    vjp_arg_rules,
    vjp_term_rules,
)
from engine.tensor import Tensor, Variable, as_tensor, bind, read_variable_p, unaliased

UNCONNECTED = ("none", "zero")


class UnconnectedGradients(enum.Enum):
    """What a source the target does not depend on gets (tf.UnconnectedGradients)."""

    NONE = "none"
    ZERO = "zero"


class Record:
    """One recorded application: a primitive's, or a custom gradient's (`prim` None)."""

    __slots__ = ("custom_vjp", "inputs", "needed", "outputs", "params", "prim", "vjp_cache")

    def __init__(
        self,
        prim: Primitive | None,
        inputs: tuple[Tensor, ...],
        params: dict[str, Any],
        outputs: tuple[Tensor, ...],
        custom_vjp: Callable[..., Any] | None = None,
        needed: tuple[int, ...] = (),
    ):
        self.prim = prim
        self.inputs = inputs
        self.params = params
        self.outputs = outputs
        self.custom_vjp = custom_vjp
        self.vjp_cache: dict[int, Any] | None = None
        # The argnums whose inputs the recording tape watched when it recorded this (a
        # primitive's record belongs to one tape; a custom gradient's is shared: ()).
        self.needed = needed

    def _custom_cotangents(
        self, gs: list[Tensor | None], needed: tuple[int, ...]
    ) -> list[Tensor | None]:
        upstream = [
            constant_zeros(o.shape, o) if g is None else g
            for g, o in zip(gs, self.outputs, strict=True)
        ]
        assert self.custom_vjp is not None  # only a custom-gradient record gets here
        result = self.custom_vjp(*upstream)
        grads = list(result) if isinstance(result, (list, tuple)) else [result]
        name = getattr(self.custom_vjp, "__qualname__", "grad_fn")
        if len(grads) != len(self.inputs):
            raise ValueError(
                f"custom gradient {name} returned {len(grads)} gradient(s) for "
                f"{len(self.inputs)} input(s)"
            )
        out = []
        for i in needed:
            g, x = grads[i], self.inputs[i]
            if g is not None:
                g = as_tensor(g, like=x)
                nb = g.ndim - x.ndim
                if g.dtype != x.dtype or nb < 0 or g.shape[nb:] != x.shape:
                    raise ValueError(
                        f"custom gradient {name}: gradient {i} has shape {g.shape} and dtype "
                        f"{g.dtype}, but its input has shape {x.shape} and dtype {x.dtype}"
                    )
            out.append(g)
        return out


def _fit(g: Tensor, shape: tuple[int, ...], batch_ndim: int) -> Tensor:
    """Sum (or broadcast) a cotangent to (*batch, *shape): undoes broadcasting, once."""
    if g.shape[batch_ndim:] == shape:  # the common case: nothing was broadcast
        return g
    target = g.shape[:batch_ndim] + shape
    extra = g.ndim - len(target)
    if extra < 0:
        return broadcast_to(g, target)
    if extra and g.shape[batch_ndim + extra :] == shape:
        # only axes in front were added (a bias): their sum has the shape (sum_p directly,
        # its axes as sum normalizes them: negative, sorted)
        first = batch_ndim - g.ndim
        return bind(sum_p, g, axes=tuple(range(first, first + extra)), keepdims=False)
    leading = list(range(batch_ndim, batch_ndim + extra))
    stretched = [
        batch_ndim + extra + i
        for i, d in enumerate(shape)
        if d == 1 and g.shape[batch_ndim + extra + i] != 1
    ]
    if stretched:
        g = reshape(reduce_sum(g, tuple(leading + stretched), keepdims=True), target)
    elif leading:  # (and size-1 axes the input has larger: broadcast below)
        g = bind(sum_p, g, axes=tuple([a - g.ndim for a in leading]), keepdims=False)
    return g if g.shape == target else broadcast_to(g, target)


_FIRST, _SECOND, _BOTH = (0,), (1,), (0, 1)


def _plan(records: list[Record], target_ids: set[int], source_ids: set[int]) -> list:
    """The records on a path from a source to a target, newest first, with the argnums
    whose inputs depend on a source (only those get cotangents)."""
    # Plain loops, with one- and two-input records (almost all) spelled out: this runs
    # once per gradient call, over every record.
    reached = set(source_ids)
    forward = []
    for rec in records:
        inputs = rec.inputs
        if len(inputs) == 1:
            if id(inputs[0]) not in reached:
                continue
        elif len(inputs) == 2:
            if id(inputs[0]) not in reached and id(inputs[1]) not in reached:
                continue
        elif not any(id(x) in reached for x in inputs):
            continue
        forward.append(rec)
        for o in rec.outputs:
            reached.add(id(o))
    live = set(target_ids)
    plan = []
    for rec in reversed(forward):
        for o in rec.outputs:
            if id(o) in live:
                break
        else:
            continue
        inputs = rec.inputs
        needed: tuple[int, ...]
        if len(inputs) == 1:  # reached, or the record would not be in `forward`
            needed = _FIRST
        elif len(inputs) == 2:
            if id(inputs[0]) in reached:
                needed = _BOTH if id(inputs[1]) in reached else _FIRST
            else:
                needed = _SECOND
        else:
            needed = tuple([i for i, x in enumerate(inputs) if id(x) in reached])
        plan.append((rec, needed))
        for i in needed:
            live.add(id(inputs[i]))
    return plan


def _accumulate(cts: dict[int, Tensor], key: int, g: Tensor) -> None:
    prev = cts.get(key)
    cts[key] = g if prev is None else prev + g


def _arrive(cts: dict[int, Tensor], zero: set[int], x: Tensor, gi: Any, batch_ndim: int) -> None:
    """An input's cotangent from one record: ZERO marks it, None is nothing, a tensor is
    fitted to the input's shape (once, as it arrives) and accumulated."""
    if gi is ZERO:
        zero.add(id(x))
    elif gi is not None:
        if gi.shape[batch_ndim:] != x.shape:
            gi = _fit(gi, x.shape, batch_ndim)
        _accumulate(cts, id(x), gi)


# An input's cotangent terms not made yet (registry.vjp_term_rules), by the input's id:
# (the input, {(term primitive, its parameters): (parameters, operands so far)}).
Pending = dict[int, tuple[Tensor, dict[tuple, tuple[dict, list[Tensor]]]]]


def _add_term(pending: Pending, x: Tensor, term: tuple) -> None:
    prim, operands, params = term
    groups = pending.setdefault(id(x), (x, {}))[1]
    joined = term_joined_param.get(prim)  # (its entries concatenate, one per operand)
    key = (prim, tuple(sorted((k, v) for k, v in params.items() if k != joined)))
    group = groups.get(key)
    if group is None:
        groups[key] = (dict(params), list(operands))
        return
    group[1].extend(operands)
    if joined is not None:
        group[0][joined] = group[0][joined] + params[joined]


def _settle(cts: dict[int, Tensor], pending: Pending, key: int, batch_ndim: int) -> None:
    """An input's pending terms made (one call per primitive and parameters), added to
    what its cotangent holds already."""
    x, groups = pending.pop(key)
    for (prim, _), (params, operands) in groups.items():
        gi = bind(prim, *operands, **params)
        if gi.shape[batch_ndim:] != x.shape:
            gi = _fit(gi, x.shape, batch_ndim)
        _accumulate(cts, key, gi)


def backward(
    plan: list,
    targets: list[Tensor],
    seeds: list[Tensor],
    sources: list[Tensor],
    batch_ndim: int,
    defer_sources: bool = False,
    cache_vjps: bool = True,
    consume_plan: bool = False,
) -> dict[int, Tensor]:
    """Run the reverse sweep; return the cotangents of the sources, keyed by id.

    defer_sources: the caller wants the sources' cotangents only for what is computed
    from them by recorders (their tangents), so the ops that make them are deferred
    (tensor.DeferredTensor): a product nobody reads is never computed.
    cache_vjps: keep each rule's outer stage on its record for a later pass over the
    same records (False when there will be none: a non-persistent tape's gradient).
    consume_plan: the plan is this pass's own and no one holds its records (a
    non-persistent tape's last pass): each entry is dropped as the sweep leaves it, so a
    recorded value dies as soon as the records that hold it have been passed, not when
    the whole sweep ends (with it the tangent a ForwardAccumulator keeps for it).

    Every cotangent in `cts` has its tensor's shape (with the batch axes in front): the
    seeds are checked to, and each rule's result is fitted once (`_fit`) as it arrives.
    """
    cts: dict[int, Tensor] = {}
    pending: Pending = {}
    for t, s in zip(targets, seeds, strict=True):
        _accumulate(cts, id(t), s)
    keep = {id(s) for s in sources}
    zero: set[int] = set()  # reached only by ZERO cotangents so far
    cacheable = cache_vjps and not trace.anything_active()
    for step, (rec, needed) in enumerate(plan):
        if consume_plan:
            plan[step] = None  # (rec, below, lives until the next entry rebinds it)
        inputs = rec.inputs
        prim = rec.prim
        if prim is None:  # a custom gradient: several outputs
            for o in rec.outputs:
                if id(o) in pending:
                    _settle(cts, pending, id(o), batch_ndim)
            gs = [cts.get(id(o)) if id(o) in keep else cts.pop(id(o), None) for o in rec.outputs]
            if all(g is None for g in gs):
                if any(id(o) in zero for o in rec.outputs):
                    zero.update(id(inputs[i]) for i in needed)
                continue
            cotangents = rec._custom_cotangents(gs, needed)
            for i, gi in zip(needed, cotangents, strict=True):
                _arrive(cts, zero, inputs[i], gi, batch_ndim)
            continue
        # a primitive: one output
        ans = rec.outputs[0]
        out_id = id(ans)
        if pending and out_id in pending:
            _settle(cts, pending, out_id, batch_ndim)
        g = cts.get(out_id) if out_id in keep else cts.pop(out_id, None)
        if g is None:
            if out_id in zero:
                zero.update(id(inputs[i]) for i in needed)
            continue
        if prim is read_variable_p:  # a variable's read: its cotangent, as is
            _accumulate(cts, id(inputs[0]), g)
            continue
        # Each needed input's cotangent, from its argument's rule (vjp_arg_rules; others
        # through argument_vjp), inline: this loop runs once per cotangent of a pass.
        params = rec.params
        rules = vjp_arg_rules.get(prim, ())
        terms = vjp_term_rules.get(prim, ())
        for i in needed:
            term = terms[i] if i < len(terms) else None
            rule = term or (rules[i] if i < len(rules) else None)
            if rule is None:
                rule = argument_vjp(prim, i)
            if cacheable:
                # The outer stage of a rule (masks, cos(x), ...) depends only on recorded
                # values; when nothing is recording it can be reused by the next pass
                # over this record (repeated HVPs on one tape).
                cache = rec.vjp_cache
                if cache is None:
                    cache = rec.vjp_cache = {}
                vjp = cache.get(i)
                if vjp is None:
                    vjp = cache[i] = rule(ans, *inputs, **params)
            else:
                vjp = rule(ans, *inputs, **params)
            x = inputs[i]
            if term is not None:  # a term of a call made when x's cotangent is read
                _add_term(pending, x, vjp(g))
                continue
            if defer_sources and id(x) in keep:
                with trace.deferring():
                    gi = vjp(g)
            else:
                gi = vjp(g)
            # _arrive, inline for the common case (a cotangent of the input's shape)
            if gi is ZERO or gi is None or gi.shape[batch_ndim:] != x.shape:
                _arrive(cts, zero, x, gi, batch_ndim)
            else:
                prev = cts.get(id(x))
                cts[id(x)] = gi if prev is None else prev + gi
    for k in [k for k in pending if k in keep]:  # (in arrival order: deterministic)
        if defer_sources:
            with trace.deferring():
                _settle(cts, pending, k, batch_ndim)
        else:
            _settle(cts, pending, k, batch_ndim)
    out = {k: cts[k] for k in keep if k in cts}
    if zero & keep:
        # Connected through a zero derivative only: zeros, as TensorFlow answers.
        lead = seeds[0].shape[:batch_ndim]
        for s in sources:
            if id(s) in zero and id(s) not in out:
                out[id(s)] = constant_zeros(lead + s.shape, s)
    return out


def check_source(s: Any, where: str) -> Tensor:
    if not isinstance(s, Tensor):
        raise TypeError(f"{where}: sources must be tensors or variables, got {type(s).__name__}")
    if s.dtype.kind != "f":
        # We raise rather than return None with a warning (TensorFlow's choice): a
        # gradient with respect to integers is always a mistake worth hearing about.
        raise TypeError(
            f"{where}: cannot differentiate with respect to a {s.dtype} tensor of shape "
            f"{s.shape}; only floating-point sources have gradients"
        )
    return s


class GradientTape:
    """Records operations for reverse-mode differentiation (TensorFlow's tf.GradientTape).

    persistent: allow more than one gradient/jacobian call.
    watch_accessed_variables: watch every trainable Variable used while recording.
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True):
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self._records: list[Record] = []
        self._watched: dict[int, Tensor] = {}
        self._variables: dict[int, Variable] = {}
        self._plans: dict[tuple, tuple[int, list]] = {}
        self._used = False
        # The tensors watched as such (watch(), variables at their first read), not as a
        # record's output; and whether every record's `needed` is still what a plan from
        # all of them would find (see _plan_for). A custom gradient's record (shared
        # between tapes, so no `needed` of its own) or a tensor watched after records that
        # might consume it end that.
        self._roots: set[int] = set()
        self._needed_exact = True
        # Set by a transform that reads the gradients' tangents only (tensor.DeferredTensor)
        self._defer_source_primals = False

    # Recording --------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self in trace.active_tapes:
            raise RuntimeError("this GradientTape is already recording (nested `with tape:`)")
        trace.active_tapes.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in trace.active_tapes:
            trace.active_tapes.remove(self)

    def watch(self, tensor: Any) -> None:
        """Record operations on these tensors (a tensor or a nested structure of them)."""
        for t in tree.flatten(tensor)[0]:
            if not isinstance(t, Tensor):
                raise TypeError(f"watch: expected tensors, got {type(t).__name__}")
            self._watch(t)

    def _watch(self, t: Tensor) -> None:
        if id(t) not in self._watched:
            # (a variable at its first read is no input of an earlier primitive record:
            # bind hands reads to the ops; only custom records take variables, and end
            # _needed_exact themselves)
            if self._records and not isinstance(t, Variable):
                self._needed_exact = False
            self._roots.add(id(t))
        self._watched[id(t)] = t
        if isinstance(t, Variable):
            self._variables.setdefault(id(t), t)

    def watched_variables(self) -> tuple[Variable, ...]:
        """The variables this tape watches, in creation order (as TensorFlow)."""
        return tuple(sorted(self._variables.values(), key=lambda v: v._uid))

    @contextmanager
    def stop_recording(self) -> Iterator[None]:
        """Operations inside this block are not recorded by this tape."""
        if self not in trace.active_tapes:
            raise RuntimeError(
                "stop_recording: this tape is not recording (use it inside `with tape:`)"
            )
        with trace.paused(self):
            yield

    def reset(self) -> None:
        """Forget everything recorded and watched so far; keep recording.

        Only inside `with tape:`; outside it raises ValueError, as TensorFlow does.
        """
        if self not in trace.active_tapes:
            raise ValueError("reset: the tape is not recording (call it inside `with tape:`)")
        self._records.clear()
        self._watched.clear()
        self._variables.clear()
        self._plans.clear()
        self._roots.clear()
        self._needed_exact = True
        self._used = False

    def _record_primitive(
        self, prim: Primitive, args: tuple[Tensor, ...], params: dict[str, Any], ans: Tensor
    ) -> None:
        watched = self._watched
        needed: tuple[int, ...]
        # which inputs are watched: the record's `needed`; one and two inputs spelled out
        if len(args) == 1:
            if id(args[0]) not in watched:
                return
            needed = _FIRST
        elif len(args) == 2:
            if id(args[0]) in watched:
                needed = _BOTH if id(args[1]) in watched else _FIRST
            elif id(args[1]) in watched:
                needed = _SECOND
            else:
                return
        else:
            needed = tuple([i for i, a in enumerate(args) if id(a) in watched])
            if not needed:
                return
        if prim not in NONDIFFERENTIABLE:
            self._records.append(Record(prim, args, params, (ans,), None, needed))
            watched[id(ans)] = ans

    def _record_read(self, variable: Variable, r: Tensor) -> None:
        """Link a read of `variable` to it, watching the variable if this tape should."""
        watched = self._watched
        if id(r) in watched:
            return
        if id(variable) not in watched:
            if not (self.watch_accessed_variables and variable.trainable):
                return
            self._watch(variable)
        self._records.append(Record(read_variable_p, (variable,), {}, (r,), None, _FIRST))
        watched[id(r)] = r

    def _record_custom(self, record: Record) -> None:
        watched = self._watched
        if any(id(a) in watched for a in record.inputs):
            self._needed_exact = False  # (the record is shared: it has no `needed`)
            self._records.append(record)
            for o in record.outputs:
                watched[id(o)] = o

    # Differentiation --------------------------------------------------------------------
    def _start_call(self, what: str) -> None:
        if self._used and not self.persistent:
            raise RuntimeError(
                f"{what}: a non-persistent GradientTape can only be used to compute one set "
                "of gradients (or jacobians); create it with persistent=True to ask again"
            )

    def _finish_call(self) -> None:
        if not self.persistent:
            self._used = True
            self._records = []  # free the recorded values now
            self._watched = {}
            self._roots = set()
            self._plans.clear()

    def _plan_for(self, targets: list[Tensor], sources: list[Tensor]) -> list:
        key = (tuple(map(id, targets)), tuple(map(id, sources)))
        cached = self._plans.get(key)
        if cached is not None and cached[0] == len(self._records):
            return cached[1]
        if self._needed_exact and self._roots.issubset(key[1]):
            # Every record was reached from a root when it was recorded, and every root is
            # a source: the sources reach every record, each through the inputs its
            # `needed` names, which is all _plan's forward sweep would find. Records that
            # lead to no target stay in (its backward sweep pruned them): the backward
            # pass finds no cotangent for their outputs and passes over them.
            plan = [(rec, rec.needed) for rec in reversed(self._records)]
        else:
            # A source this tape never watched gets no gradient (None), as in TensorFlow.
            watched_sources = {i for i in key[1] if i in self._watched}
            plan = _plan(self._records, set(key[0]), watched_sources)
        if self.persistent:
            self._plans[key] = (len(self._records), plan)
        return plan

    def _run(
        self,
        targets: list[Tensor],
        seeds: list[Tensor],
        sources: list[Tensor],
        batch_ndim: int,
        last_pass: bool = False,
    ) -> dict[int, Tensor]:
        """One backward pass over the records; last_pass: the caller makes no other over
        them (a non-persistent tape's gradient), so the rules' outer stages are not kept."""
        plan = self._plan_for(targets, sources)
        if self in trace.active_tapes:
            if self.persistent:
                # Inside its own `with` block a persistent tape records its backward pass
                # too, so the gradient can be differentiated again on the same tape.
                return backward(plan, targets, seeds, sources, batch_ndim)
            trace.active_tapes.remove(self)  # a used non-persistent tape stops recording
        if last_pass:
            # The sweep becomes the records' only holder and lets each go once passed:
            # a forward value (and its tangent under an accumulator) dies when the last
            # rule that reads it has run. (_plan_for made the plan for this call alone.)
            self._records, self._watched = [], {}
            # used from here on: a call during the sweep (a custom gradient's rule asking
            # this tape again) is refused as a second use, never answered from no records
            self._used = True
        # (here the tape is off the recording stack: nothing of it to pause)
        return backward(
            plan,
            targets,
            seeds,
            sources,
            batch_ndim,
            self._defer_source_primals,
            cache_vjps=not last_pass,
            consume_plan=last_pass,
        )

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: str = "none",
    ) -> Any:
        """d target / d sources, in the structure of `sources`.

        target may be a tensor or a structure of them (their gradients add up).
        output_gradients: the cotangent for each target (default ones).
        unconnected_gradients: "none" (None for a source the target does not depend on)
        or "zero".
        """
        self._start_call("gradient")
        unconnected = _check_unconnected(unconnected_gradients)
        targets = _targets(target, "gradient")
        flat_sources, treedef = tree.flatten(sources)
        flat_sources = [check_source(s, "gradient") for s in flat_sources]
        if output_gradients is None:
            seeds = [_ones_like(t) for t in targets]
        else:
            seeds = [as_tensor(g) for g in tree.flatten(output_gradients)[0]]
            if len(seeds) != len(targets):
                raise ValueError(
                    f"gradient: {len(seeds)} output_gradients for {len(targets)} target(s)"
                )
            # A scalar cotangent for a larger target is broadcast, as TensorFlow does.
            seeds = [
                broadcast_to(s, t.shape) if s.ndim == 0 and t.ndim else s
                for s, t in zip(seeds, targets, strict=True)
            ]
            for s, t in zip(seeds, targets, strict=True):
                if s.shape != t.shape:
                    raise ValueError(
                        f"gradient: output_gradients of shape {s.shape} for a target of shape {t.shape}"
                    )
                if s.dtype != t.dtype:
                    raise TypeError(
                        f"gradient: output_gradients dtype {s.dtype} differs from the target's {t.dtype}"
                    )
        try:
            cts = self._run(targets, seeds, flat_sources, 0, last_pass=not self.persistent)
        finally:
            self._finish_call()
        results = [_result(cts.get(id(s)), s, unconnected, ()) for s in flat_sources]
        return tree.unflatten(treedef, results)

    def jacobian(
        self,
        target: Tensor,
        sources: Any,
        unconnected_gradients: str = "none",
        parallel_iterations: int | None = None,
        experimental_use_pfor: bool = True,
        *,
        chunk_size: int | None = None,
    ) -> Any:
        """d target / d sources with shape target.shape + source.shape for each source.

        All rows come from one backward pass with a stacked cotangent (the identity), in
        chunks of `chunk_size` rows when given, to bound memory. parallel_iterations and
        experimental_use_pfor are accepted for TensorFlow code and ignored: the engine is
        always vectorized.
        """
        self._start_call("jacobian")
        unconnected = _check_unconnected(unconnected_gradients)
        (target,) = _targets(target, "jacobian", single=True)
        flat_sources, treedef = tree.flatten(sources)
        flat_sources = [check_source(s, "jacobian") for s in flat_sources]
        try:
            rows = _jacobian_rows(self, target, flat_sources, chunk_size)
        finally:
            self._finish_call()
        results = []
        for s, r in zip(flat_sources, rows, strict=True):
            j = _result(r, s, unconnected, (target.size,))
            results.append(None if j is None else reshape(j, target.shape + s.shape))
        return tree.unflatten(treedef, results)

    def batch_jacobian(
        self,
        target: Tensor,
        source: Tensor,
        unconnected_gradients: str = "none",
        parallel_iterations: int | None = None,
        experimental_use_pfor: bool = True,
        *,
        check_independence: bool = True,
    ) -> Tensor:
        """Per-example jacobians: (B, *target.shape[1:], *source.shape[1:]).

        Assumes example b of the target depends only on example b of the source, and
        computes all examples in one backward pass. When that assumption is false (batch
        normalization, a mean over the batch axis, a matmul mixing rows) the answer has
        no meaning: with check_independence, one extra random probe row in the same pass
        detects this and raises BatchDependenceError instead. An unconnected source answers
        zeros whatever `unconnected_gradients` says (as TensorFlow). parallel_iterations
        and experimental_use_pfor are accepted and ignored (always vectorized).
        """
        self._start_call("batch_jacobian")
        _check_unconnected(unconnected_gradients)
        (target,) = _targets(target, "batch_jacobian", single=True)
        source = check_source(source, "batch_jacobian")
        if target.ndim < 2:
            # TensorFlow reads the target's second dimension and fails on a rank-1 target.
            raise ValueError(
                f"batch_jacobian: target must have rank 2 or more (batch, ...), got shape "
                f"{target.shape}"
            )
        return per_example_jacobian(self, target, source, check_independence)


def per_example_jacobian(
    tape: GradientTape, target: Tensor, source: Tensor, check_independence: bool = True
) -> Tensor:
    """batch_jacobian's computation, for targets of any rank >= 1 (the service answers
    rank-1 targets too: one number per example)."""
    rows = per_example_rows(tape, target, source, check_independence)
    if rows is not None and check_independence:
        check_per_example(rows, target)
    return per_example_layout(rows, target, source, check_independence)


def per_example_rows(
    tape: GradientTape, target: Tensor, source: Tensor, check_independence: bool = True
) -> Tensor | None:
    """per_example_jacobian's backward pass alone: (m, B, *source.shape[1:]) for the m
    seeds e_j (m = the size of one target example), and with check_independence one probe
    row more; None when the source is unconnected. Its seeds depend on shapes only, so a
    captured pass (engine/replay.py) replays it; the check, which reads the rows, is
    check_per_example's, run after every pass."""
    if target.ndim < 1 or source.ndim < 1 or target.shape[0] != source.shape[0]:
        raise ValueError(
            f"batch_jacobian: target {target.shape} and source {source.shape} must share "
            "their first (batch) axis"
        )
    tape._start_call("batch_jacobian")
    try:
        return _batch_jacobian_rows(tape, target, source, check_independence)
    finally:
        tape._finish_call()


def check_per_example(rows: Tensor, target: Tensor) -> None:
    """BatchDependenceError when per_example_rows' probe row (checked rows only) shows
    that the examples of the batch are not independent. Reads the rows' values: a pass
    replayed from a capture runs it after every pass."""
    m = math.prod(target.shape[1:])
    xp = backend.array_module(rows.value)
    _check_batch_independence(rows, m, _probe_weights(xp, target.shape[0], m, target.dtype))


def per_example_layout(
    rows: Tensor | None, target: Tensor, source: Tensor, check_independence: bool = True
) -> Tensor:
    """The per-example jacobians (B, *target.shape[1:], *source.shape[1:]) as a view of
    per_example_rows' rows (without the probe row)."""
    out_shape = target.shape + source.shape[1:]
    if rows is None:
        return constant_zeros(out_shape, source)
    if check_independence:
        rows = rows[: math.prod(target.shape[1:])]
    # rows: (m, B, *source.shape[1:]) -> (B, m, *source.shape[1:])
    result = transpose(rows, [1, 0] + list(range(2, rows.ndim)))
    return result if result.shape == out_shape else reshape(result, out_shape)


class BatchDependenceError(ValueError):
    """A batch jacobian was asked of a computation that mixes the examples of a batch."""


def _probe_weights(xp: Any, batch: int, m: int, dtype: Any) -> tuple[Any, Any]:
    """The probe row's weights per example and per seed: fixed, so the pass's seeds are
    the same every time (and a captured pass replays them)."""
    c, u = _host_probe_weights(batch, m, np.dtype(dtype).str)
    return xp.asarray(c), xp.asarray(u)


@functools.lru_cache(maxsize=32)
def _host_probe_weights(batch: int, m: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    # cached: a generator costs more than a small batch jacobian's whole replayed pass
    rng = np.random.default_rng(0x6A7)
    c = rng.uniform(0.5, 1.5, size=batch) * rng.choice([-1.0, 1.0], size=batch)
    u = rng.uniform(-1.0, 1.0, size=m)
    c, u = c.astype(dtype), u.astype(dtype)
    c.flags.writeable = u.flags.writeable = False
    return c, u


def _batch_jacobian_rows(
    tape: GradientTape, target: Tensor, source: Tensor, check: bool
) -> Tensor | None:
    xp = backend.array_module(target.value)
    batch = target.shape[0]
    m = math.prod(target.shape[1:])
    # Seed row j is e_j for every example at once: summing over examples is harmless
    # exactly when examples are independent.
    eye = xp.eye(m, dtype=target.dtype).reshape((m, 1) + target.shape[1:])
    seeds = xp.broadcast_to(eye, (m,) + target.shape)
    if check:
        c, u = _probe_weights(xp, batch, m, target.dtype)
        probe = (c[:, None] * u[None, :]).reshape((1,) + target.shape)
        seeds = xp.concatenate([seeds, probe], axis=0)
    cts = tape._run([target], [_constant_seed(xp.ascontiguousarray(seeds))], [source], 1)
    return cts.get(id(source))


def _check_batch_independence(rows: Tensor, m: int, weights: tuple) -> None:
    c, u = weights
    values = rows.value
    xp = backend.array_module(values)
    per_example = values[:m]  # (m, B, *s)
    probe = values[m]  # (B, *s)
    lead = (-1,) + (1,) * (per_example.ndim - 1)
    expected = (per_example * u.reshape(lead)).sum(axis=0)
    expected = expected * c.reshape((-1,) + (1,) * (expected.ndim - 1))
    if probe.size == 0:
        return
    scale = float(xp.abs(per_example).sum(axis=0).max()) + float(xp.abs(probe).max()) or 1.0
    rtol = 1e-3 if values.dtype.itemsize <= 4 else 1e-9
    err = float(xp.abs(probe - expected).max())
    if err > rtol * scale:
        raise BatchDependenceError(
            "batch_jacobian: the examples of the batch are not independent (an output example "
            "depends on other input examples, as with batch normalization, a mean or sum over "
            f"the batch axis, or a matmul that mixes rows; relative mismatch {err / scale:.2e} "
            "in a random probe). The per-example jacobian would be meaningless: use jacobian() "
            "for the full one, or pass check_independence=False to get the summed blocks anyway"
        )


def _jacobian_rows(
    tape: GradientTape, target: Tensor, sources: list[Tensor], chunk_size: int | None
) -> list[Tensor | None]:
    """All rows of d target / d sources as (n, *source.shape), n = target.size."""
    n = target.size
    xp = backend.array_module(target.value)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"jacobian: chunk_size must be positive, got {chunk_size}")
    step = max(1, n if chunk_size is None else min(chunk_size, n))
    pieces: list[list[Tensor]] = [[] for _ in sources]
    connected = [False] * len(sources)
    for start in range(0, max(n, 1), step):
        stop = min(start + step, n)
        seeds = xp.zeros((stop - start, n), dtype=target.dtype)
        seeds[xp.arange(stop - start), xp.arange(start, stop)] = 1
        seeds = _constant_seed(seeds.reshape((stop - start,) + target.shape))
        cts = tape._run([target], [seeds], sources, 1)
        for k, s in enumerate(sources):
            part = cts.get(id(s))
            if part is not None:
                connected[k] = True
            else:
                part = constant_zeros((stop - start,) + s.shape, s)
            pieces[k].append(part)
        if n == 0:
            break
    out: list[Tensor | None] = []
    for k in range(len(sources)):
        if not connected[k]:
            out.append(None)
        elif len(pieces[k]) == 1:
            out.append(pieces[k][0])
        else:
            out.append(concatenate(pieces[k], axis=0))
    return out


def _targets(target: Any, where: str, single: bool = False) -> list[Tensor]:
    targets = tree.flatten(target)[0]
    if single and len(targets) != 1:
        raise TypeError(f"{where}: target must be a single tensor")
    for t in targets:
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: target must be a tensor, got {type(t).__name__}")
        if t.dtype.kind != "f":
            raise TypeError(f"{where}: target of dtype {t.dtype} is not differentiable")
    return targets


def _check_unconnected(value: Any) -> str:
    value = str(getattr(value, "value", value)).lower()
    if value not in UNCONNECTED:
        raise ValueError(f"unconnected_gradients must be 'none' or 'zero', got {value!r}")
    return value


def _ones_like(t: Tensor) -> Tensor:
    array = t.value
    if type(array) is np.ndarray and array.ndim == 0:  # a loss: NumPy's ones_like is slower
        ones = Tensor(np.array(1, dtype=array.dtype))
    else:
        ones = Tensor(backend.array_module(array).ones_like(array))
    if trace.capture is not None:  # a gradient's seed: a constant of a captured pass
        trace.capture.constant(ones)
    return ones


def _constant_seed(array: Any) -> Tensor:
    """A pass's seed made from shapes alone (a jacobian's identity rows): a constant of a
    pass being captured."""
    seed = Tensor(array)
    if trace.capture is not None:
        trace.capture.constant(seed)
    return seed


def constant_zeros(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Zeros a pass makes whatever its data: a pass being captured for replay is told so
    (any other array made outside the ops would stop the capture)."""
    zeros = _zeros(like, shape)
    if trace.capture is not None:
        trace.capture.constant(zeros)
    return zeros


def _zeros(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    return Tensor(backend.array_module(like.value).zeros(shape, dtype=like.dtype))


def _result(ct: Tensor | None, source: Tensor, unconnected: str, lead: tuple) -> Tensor | None:
    if ct is not None:
        return ct
    return None if unconnected == "none" else constant_zeros(lead + source.shape, source)


# ----------------------------------------------------------------------------------------
# custom_gradient
# ----------------------------------------------------------------------------------------


def custom_gradient(f: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: `f(*xs)` returns `(y, grad_fn)`; `grad_fn(*dy)` returns one gradient per x.

    As tf.custom_gradient: f's own operations are recorded by the active tapes, so a
    grad_fn that uses forward values is differentiated through them by outer tapes;
    the outputs are fresh tensors whose backward is grad_fn. Forward-mode tangents are
    the body's own derivative (as TensorFlow's ForwardAccumulator). When f reads
    trainable Variables, grad_fn must accept `variables=` and return
    `(input_grads, variable_grads)`.
    """

    @functools.wraps(f)
    def wrapper(*args: Any) -> Any:
        inputs = tuple(unaliased(as_tensor(a)) for a in args)
        # A private tape sees which trainable variables the body reads (TensorFlow's
        # VariableWatcher); it records nothing anyone differentiates.
        with GradientTape(watch_accessed_variables=True) as watcher:
            result, grad_fn = f(*inputs)
        variables = watcher.watched_variables()
        flat, treedef = tree.flatten(result)
        body = [as_tensor(o) for o in flat]
        outputs = tuple(Tensor(o.value) for o in body)  # fresh identities
        if trace.capture is not None:
            for o, b in zip(outputs, body, strict=True):
                trace.capture.alias(o, b)
        backward_fn = grad_fn
        if variables:
            if "variables" not in _parameters(grad_fn):
                raise TypeError(
                    f"custom_gradient {f.__qualname__}: the function reads variables "
                    f"{[v.name or v.shape for v in variables]}, so its grad_fn must accept a "
                    "`variables` keyword argument"
                )
            backward_fn = _with_variables(grad_fn, variables, len(inputs))
        record = Record(None, inputs + variables, {}, outputs, custom_vjp=backward_fn)
        for tape in tuple(trace.active_tapes):
            tape._record_custom(record)
        for accumulator in tuple(trace.active_accumulators):
            accumulator._propagate_custom(record, body)
        return tree.unflatten(treedef, list(outputs))

    return wrapper


def _parameters(fn: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    names = {p.name for p in params}
    if any(p.kind == p.VAR_KEYWORD for p in params):
        names.add("variables")
    return names


def _with_variables(grad_fn: Callable[..., Any], variables: tuple, n_inputs: int) -> Any:
    """grad_fn(*dy, variables=...) -> (input_grads, variable_grads), as one flat list."""

    def backward(*dy: Any) -> list:
        result = grad_fn(*dy, variables=list(variables))
        if not (isinstance(result, (list, tuple)) and len(result) == 2):
            raise ValueError(
                "custom gradient with variables: grad_fn must return (input_grads, variable_grads)"
            )
        input_grads, variable_grads = result
        input_grads = list(input_grads) if isinstance(input_grads, (list, tuple)) else [input_grads]
        variable_grads = list(variable_grads)
        if len(variable_grads) != len(variables):
            raise ValueError(
                f"custom gradient: {len(variable_grads)} variable gradient(s) for "
                f"{len(variables)} variable(s)"
            )
        return input_grads + variable_grads

    backward.__qualname__ = getattr(grad_fn, "__qualname__", "grad_fn")
    return backward
