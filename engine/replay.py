"""Compiled replay: a pass of array calls captured once, then run as a flat schedule.

A reused tape answers many passes that differ only in their seed arrays (a
HessianOperator's HVPs at one point). The dynamic sweep pays, per primitive, the
tape's bookkeeping, `bind`'s dispatch and wrapping, the rules' closures and the
undoing of broadcasts; the NumPy work itself is a fraction of it at small sizes. So
the first pass of a given seed layout runs dynamically under a `Capture`, which sees
every primitive applied (`bind` reports to `trace.capture`) and keeps, per call, the
primitive, its parameters and where its operands come from: a seed, an earlier call,
or a constant (a recorded value, a rule's cached outer stage, an engine scalar). Calls
whose operands are all constant are folded: their result is a constant. What is left
is a `Schedule`: a list of array calls with every broadcasting, dtype, shape and layout
decision already taken, run on the next passes with no engine objects in the loop.

Memory: each call's result is dropped after its last use, as the dynamic sweep drops
cotangents. Calls with a replayable form (ufuncs, GEMMs, sums: `_FORMS`) write into
buffers with `out=`: buffers kept by the schedule between passes (reused across calls
by liveness, up to `POOL_LIMIT` bytes), or, in place, the buffer of an operand that
dies at that call (cotangents accumulate in place). A result handed back to the caller
is always a fresh array.

The answers are those of the dynamic pass exactly: the same NumPy calls on the same
operands in the same order, into buffers of the same layout. A pass that cannot be
captured runs dynamically, always: one that reads a seed-dependent value on the host
(a rule branching on data), or one that feeds an operation an array made outside the
engine's ops during the pass (which may depend on the data). Only NumPy arrays are
captured; CuPy passes stay dynamic.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine import trace
from engine.registry import Primitive, impl_rules
from engine.tensor import Tensor, _scalars

# Buffers a schedule keeps between passes, at most (bytes): beyond it a call allocates
# its result each pass, as the dynamic sweep does (large K-vector passes would otherwise
# hold several of their largest temporaries per tape for the tape's lifetime).
POOL_LIMIT = 64 * 1024 * 1024

_CONST, _SEED, _STEP = 0, 1, 2


class CaptureFailed(Exception):
    """The pass cannot be replayed; the reason says why (the dynamic path answers)."""


class Capture:
    """Watches one dynamic pass (as `trace.capture`) and builds its Schedule."""

    def __init__(self, seeds: Sequence[Tensor], known: set[int]):
        self.known = known  # ids of tensors alive before the pass (constants)
        self.kinds: list[int] = []
        # Per slot: the array for constants; for the pass's own arrays only their layout
        # (holding them would keep every intermediate of the pass alive at once).
        self.values: list[Any] = []
        self.owner: list[int] = []  # the slot whose memory a slot's array is (views)
        self.slots: dict[int, tuple[int, Any]] = {}  # id(tensor) -> (slot, weakref)
        self.steps: list[tuple[Primitive, tuple[int, ...], dict[str, Any]]] = []
        self.step_slot: list[int] = []
        self.failure: str | None = None
        self.seed_slots = [self._new(s, _SEED) for s in seeds]

    def _new(self, t: Tensor, kind: int) -> int:
        slot = len(self.kinds)
        self.kinds.append(kind)
        self.values.append(t.value if kind == _CONST else _Layout(t.value))
        self.owner.append(slot)
        # A weak reference: the pass frees its intermediates as it goes, and a dead
        # tensor's id may be reused by a new one, which must not inherit its slot.
        self.slots[id(t)] = (slot, weakref.ref(t))
        return slot

    def _slot_of(self, t: Tensor) -> int:
        entry = self.slots.get(id(t))
        if entry is not None and entry[1]() is t:
            return entry[0]
        if id(t) in self.known:
            return self._new(t, _CONST)
        raise CaptureFailed(
            "an operation received an array made outside the engine's ops during the pass"
        )

    def record(self, prim: Primitive, args: tuple[Tensor, ...], params: dict, ans: Tensor) -> None:
        if self.failure is not None:
            return
        try:
            if type(ans.value) is not np.ndarray:
                raise CaptureFailed("only NumPy passes are captured")
            ins = tuple(self._slot_of(a) for a in args)
        except CaptureFailed as exc:
            self.failure = str(exc)
            return
        if all(self.kinds[i] == _CONST for i in ins):
            self._new(ans, _CONST)  # folded: its value is known now
            return
        self.steps.append((prim, ins, params))
        slot = self._new(ans, _STEP)
        self.step_slot.append(slot)
        for a, i in zip(args, ins, strict=True):
            if np.may_share_memory(ans.value, a.value):  # a view: its operand's memory
                self.owner[slot] = self.owner[i]
                break

    def constant(self, t: Tensor) -> None:
        """t was made during the pass but depends on nothing in it (zeros of a shape)."""
        if id(t) not in self.slots:
            self._new(t, _CONST)

    def host_read(self, t: Tensor) -> None:
        entry = self.slots.get(id(t))
        if entry is not None and entry[1]() is t and self.kinds[entry[0]] != _CONST:
            self.failure = "a rule read a value of the pass on the host (data-dependent)"

    def schedule(self, outputs: Sequence[Tensor | None]) -> Schedule:
        if self.failure is not None:
            raise CaptureFailed(self.failure)
        out_slots: list[int | None] = []
        for t in outputs:
            out_slots.append(None if t is None else self._slot_of(t))
        if self.failure is not None:
            raise CaptureFailed(self.failure)
        return Schedule(self, out_slots)


def known_tensors(*roots: Any) -> set[int]:
    """Ids of the tensors reachable from `roots` (through objects, containers and
    closures, as engine.footprint walks): the values a pass may use as constants."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(
            obj,
            (
                type,
                types.ModuleType,
                str,
                bytes,
                int,
                float,
                bool,
                Primitive,
                np.ndarray,
                type(None),
            ),
        ):
            continue
        if isinstance(obj, Tensor):
            found.add(id(obj))
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:
                    pass
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return found


def capture(
    run: Callable[[list[Tensor]], list[Tensor | None]], seeds: Sequence[Tensor], known: set[int]
) -> tuple[list[Tensor | None], Schedule | str]:
    """Run `run(seeds)` dynamically under a Capture: its outputs, and the Schedule (or the
    reason the pass cannot be replayed)."""
    # Fresh identities: a seed passed twice, or a seed that is also a recorded value,
    # must still be one slot per seed.
    fresh = [Tensor(s.value) for s in seeds]
    cap = Capture(fresh, known | {id(t) for t in _scalars.values()})
    saved, trace.capture = trace.capture, cap
    try:
        outputs = run(fresh)
    finally:
        trace.capture = saved
    try:
        return outputs, cap.schedule(outputs)
    except CaptureFailed as exc:
        return outputs, str(exc)


# ----------------------------------------------------------------------------------------
# Replayable forms: out= versions of the calls that dominate a pass. Each maker sees the
# call's parameters, its capture-time operands (None where the operand varies between
# passes) and result, and returns `form(out, *operands)`, the same NumPy call writing
# into `out` (None: allocate), or None where the call has no such form.
# ----------------------------------------------------------------------------------------


def _ufunc(fn: Any) -> Callable[..., Any]:
    def make(params: dict, consts: list, value: Any) -> Any:
        return lambda out, *xs: fn(*xs, out=out)

    return make


def _matmul_form(params: dict, consts: list, value: Any) -> Any:
    ta, tb = params.get("ta", False), params.get("tb", False)

    def form(out: Any, x: Any, y: Any) -> Any:
        # _matmul_impl's choices, taken on the operands' layouts (fixed by the schedule's
        # key), so the GEMM calls are the dynamic pass's.
        if ta:
            x = x.swapaxes(-1, -2)
        if tb:
            y = y.swapaxes(-1, -2)
        if y.ndim == 2 and x.ndim > 2 and x.flags.c_contiguous:
            rows = x.reshape(-1, x.shape[-1])
            if out is None:
                return (rows @ y).reshape(x.shape[:-1] + (y.shape[-1],))
            np.matmul(rows, y, out=out.reshape(-1, y.shape[-1]))
            return out
        return np.matmul(x, y, out=out)

    return form


def _sum_form(params: dict, consts: list, value: Any) -> Any:
    if value.dtype.kind != "f":  # _sum_impl picks the dtype of integer sums
        return None
    axes, keepdims = params["axes"], params["keepdims"]
    return lambda out, x: np.sum(x, axis=axes, keepdims=keepdims, out=out)


def _relu_grad_form(params: dict, consts: list, value: Any) -> Any:
    g, x = consts
    if params["alpha"] != 0 or g is not None or x is None:
        return None
    mask = None  # (x > 0) as g's dtype, made once: x is a recorded value

    def form(out: Any, g: Any, x_: Any) -> Any:
        nonlocal mask
        if mask is None or mask.dtype != g.dtype:
            mask = (x > 0).astype(g.dtype)
        return np.multiply(g, mask, out=out)

    return form


_FORMS: dict[str, Callable[[dict, list, Any], Any]] = {
    "add": _ufunc(np.add),
    "subtract": _ufunc(np.subtract),
    "multiply": _ufunc(np.multiply),
    "divide": _ufunc(np.divide),
    "negative": _ufunc(np.negative),
    "tanh": _ufunc(np.tanh),
    "exp": _ufunc(np.exp),
    "matmul": _matmul_form,
    "sum": _sum_form,
    "relu_grad": _relu_grad_form,
}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "negative", "tanh", "exp", "relu_grad"}


class Schedule:
    """A captured pass as a flat list of array calls; `run(seed arrays)` replays it."""

    def __init__(self, cap: Capture, out_slots: list[int | None]):
        values, kinds = cap.values, cap.kinds
        n = len(kinds)
        self.seed_slots = cap.seed_slots
        self.out_slots = out_slots
        self.template: list[Any] = [values[i] if kinds[i] == _CONST else None for i in range(n)]
        self.constant_outs = {s for s in out_slots if s is not None and kinds[s] == _CONST}
        self.seed_layouts = [(values[i].shape, values[i].strides) for i in cap.seed_slots]
        owner = cap.owner  # which buffer each slot's memory belongs to (views share)
        # The last step that reads each buffer (through any view of it); outputs live on.
        last = [-1] * n
        for k, (_, ins, _) in enumerate(cap.steps):
            for i in ins:
                last[owner[i]] = k
        escaping = {owner[s] for s in out_slots if s is not None}
        for s in escaping:
            last[s] = len(cap.steps)

        # Persistent buffers are made on the first replay (the capture pass allocates what
        # the dynamic sweep does, no more); a _Buffer is where each will live.
        pool: dict[tuple, list[_Buffer]] = {}  # free buffers by layout
        pooled_bytes = 0
        buffer_of: dict[int, _Buffer] = {}  # slot -> the persistent buffer its step writes
        self.buffers: list[_Buffer] = []
        frees: list[list[int]] = [[] for _ in cap.steps]
        members: dict[int, list[int]] = {}
        for slot in cap.step_slot:
            members.setdefault(owner[slot], []).append(slot)
        freed: set[int] = set()
        steps = []
        for k, ((prim, ins, params), slot) in enumerate(zip(cap.steps, cap.step_slot, strict=True)):
            value = values[slot]
            maker = _FORMS.get(prim.name)
            consts = [values[i] if kinds[i] == _CONST else None for i in ins]
            form = None if maker is None else maker(params, consts, value)
            owns = owner[slot] == slot
            key = value.key
            target: Any = None  # a persistent buffer, or ("inplace", operand position)
            if form is not None and owns and slot not in escaping and value.order:
                dying = [
                    p
                    for p, i in enumerate(ins)
                    if kinds[i] == _STEP
                    and owner[i] == i
                    and last[i] == k
                    and values[i].key == key
                    and prim.name in _ELEMENTWISE
                ]
                if dying:
                    target = ("inplace", dying[0])
                    if ins[dying[0]] in buffer_of:  # the buffer passes on to this slot
                        buffer_of[slot] = buffer_of.pop(ins[dying[0]])
                elif pool.get(key):
                    target = buffer_of[slot] = pool[key].pop()
                elif pooled_bytes + value.nbytes <= POOL_LIMIT:
                    target = buffer_of[slot] = _Buffer(value)
                    self.buffers.append(target)
                    pooled_bytes += value.nbytes
            steps.append(_compile_step(prim, params, ins, slot, form, target))
            # A buffer whose last reader is this step (or that nobody reads) returns to
            # the pool, and the slots of it and its views are dropped (the dynamic sweep
            # frees its cotangents the same way).
            for o in {owner[i] for i in (*ins, slot) if kinds[i] == _STEP}:
                if last[o] <= k and o not in freed:
                    freed.add(o)
                    frees[k].extend(members[o])
                    b = buffer_of.pop(o, None)
                    if b is not None:
                        pool.setdefault(b.layout.key, []).append(b)
        self.steps = [
            (run, ins, slot, tuple(f)) for (run, ins, slot), f in zip(steps, frees, strict=True)
        ]
        self.pooled_bytes = pooled_bytes
        self.busy = False

    def matches(self, arrays: Sequence[Any]) -> bool:
        """Whether these seeds have the layouts the schedule was captured with."""
        return all(
            type(a) is np.ndarray and (a.shape, a.strides) == layout
            for a, layout in zip(arrays, self.seed_layouts, strict=True)
        )

    def run(self, arrays: Sequence[Any]) -> list[Any]:
        """The pass's outputs (None for an output the pass did not reach)."""
        if self.buffers and self.buffers[0].array is None:
            for b in self.buffers:
                b.allocate()
        env = self.template.copy()
        for slot, a in zip(self.seed_slots, arrays, strict=True):
            env[slot] = a
        check = trace.interrupt_check
        for run, ins, slot, frees in self.steps:
            if check is not None:
                check()
            env[slot] = run(*[env[i] for i in ins])
            for i in frees:
                env[i] = None
        # A constant output (zeros, a recorded value) is copied: answers are fresh arrays.
        return [
            None if s is None else env[s].copy() if s in self.constant_outs else env[s]
            for s in self.out_slots
        ]


class _Layout:
    """What a schedule needs to know of an array of the pass, without holding it."""

    __slots__ = ("dtype", "key", "nbytes", "order", "shape", "strides")

    def __init__(self, a: np.ndarray):
        self.shape, self.strides, self.dtype, self.nbytes = a.shape, a.strides, a.dtype, a.nbytes
        self.order = "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else None
        self.key = (a.shape, a.strides, a.dtype)


class _Buffer:
    """A persistent buffer of one layout, allocated on the schedule's first run."""

    __slots__ = ("array", "layout")

    def __init__(self, layout: _Layout):
        self.layout, self.array = layout, None

    def allocate(self) -> None:
        self.array = np.empty(self.layout.shape, self.layout.dtype, order=self.layout.order)


def _compile_step(
    prim: Primitive, params: dict, ins: tuple[int, ...], slot: int, form: Any, target: Any
) -> tuple[Callable[..., Any], tuple[int, ...], int]:
    if form is not None and type(target) is tuple:  # in place, into a dying operand
        position = target[1]
        return (lambda *xs: form(xs[position], *xs)), ins, slot
    if form is not None and target is not None:
        return (lambda *xs: form(target.array, *xs)), ins, slot
    if form is not None:
        return (lambda *xs: _as_array(form(None, *xs))), ins, slot
    impl = impl_rules[prim]
    return (lambda *xs: _as_array(impl(np, *xs, **params))), ins, slot


def _as_array(out: Any) -> Any:
    return np.asarray(out) if isinstance(out, np.generic) else out
