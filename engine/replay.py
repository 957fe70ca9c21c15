"""Compiled replay: a pass of array calls captured once, then run as a flat schedule.

A reused tape answers many passes that differ only in their seed arrays (a
HessianOperator's HVPs at one point). The dynamic sweep pays, per primitive, the
tape's bookkeeping, `bind`'s dispatch and wrapping, the rules' closures and the
undoing of broadcasts; the NumPy work itself is a fraction of it at small sizes. So
a pass of a given seed layout (its second: see `Passes`) runs dynamically under a
`Capture`, which sees every primitive applied (`bind` reports to `trace.capture`) and
keeps, per call, the primitive, its parameters and where its operands come from: a
seed, an earlier call, or a constant (a recorded value, a rule's cached outer stage, an
engine scalar). The same machinery compiles a definition's gradient pass (forward and
backward; engine/language/compile.py), its leaves being the seeds, and its fresh HVP and
jacobian passes (forward, gradient, and the second-order pass or the jacobian rows), the
HVP's vectors being seeds too. Calls
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
import math
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from engine import kernels, trace
from engine.kernels import rows as rows_kernels
from engine.ops.reduce import (
    channel_axes,
    channel_sum,
    leading_sum,
    row_sum,
    sums_leading,
    sums_rows,
)
from engine.registry import REPEATS_SHARED, Primitive, impl_rules, replay_forms
from engine.tensor import Tensor, scalar_cache

# Buffers a schedule keeps between passes, at most (bytes): beyond it a call allocates
# its result each pass, as the dynamic sweep does (large K-vector passes would otherwise
# hold several of their largest temporaries per tape for the tape's lifetime). A larger
# limit buys no time: with the tuned allocator a fresh result costs about what a kept
# buffer does (the ResNet's reused HVP took the same time at 64 MiB to 1 GiB: bench/
# RESULTS.md, "One memory order for a convolution's values and cotangents").
POOL_LIMIT = 64 * 1024 * 1024

_CONST, _SEED, _STEP = 0, 1, 2


class CaptureFailed(Exception):
    """The pass cannot be replayed; the reason says why (the dynamic path answers)."""


class Capture:
    """Watches one dynamic pass (as `trace.capture`) and builds its Schedule."""

    def __init__(self, seeds: Sequence[Tensor], known: dict[int, Any]):
        # The tensors (and NumPy arrays: a function's closed-over data) alive before the
        # pass (constants), by id. Held, not just their ids: one that died during the pass
        # could hand its id to an array made outside the ops, which would then pass for a
        # constant. A seed's own array is never a constant, even when it is also known.
        self.known = known
        for s in seeds:
            if known.get(id(s.value)) is s.value:
                del known[id(s.value)]
        self.kinds: list[int] = []
        # Per slot: the array for constants; for the pass's own arrays only their layout
        # (holding them would keep every intermediate of the pass alive at once).
        self.values: list[Any] = []
        self.owner: list[int] = []  # the slot whose memory a slot's array is (views)
        self.slots: dict[int, tuple[int, Any]] = {}  # id(tensor) -> (slot, weakref)
        self.steps: list[tuple[Primitive, tuple[int, ...], dict[str, Any]]] = []
        self.step_slot: list[int] = []
        self.shared: dict[tuple, int] = {}  # (prim, operand slots, params) -> slot: REPEATS_SHARED
        self.failure: str | None = None
        self.made_bytes = 0  # constants the pass made (the schedule will hold them)
        self.seed_slots = [self._new(s, _SEED) for s in seeds]
        # Integer and boolean seeds (labels, indices) are keyed by their values by every
        # caller (definitions, engine.jit): reading them on the host depends on nothing
        # that changes between the passes of one key.
        self.pinned = {
            slot
            for slot, s in zip(self.seed_slots, seeds, strict=True)
            if s.value.dtype.kind not in "fc"
        }

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
        if self.known.get(id(t)) is t or self.known.get(id(t.value)) is t.value:
            return self._new(t, _CONST)  # (a known array: made into a tensor by the pass)
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
            self.failure = f"{exc} ({prim.name})"
            return
        if all(self.kinds[i] == _CONST for i in ins):
            self._new(ans, _CONST)  # folded: its value is known now
            self.made_bytes += ans.value.nbytes
            return
        if prim in REPEATS_SHARED:
            key = (prim, ins, tuple(sorted(params.items())))
            same = self.shared.get(key)
            if same is not None:  # computed already from the same operands: reuse it
                self.slots[id(ans)] = (same, weakref.ref(ans))
                return
        self.steps.append((prim, ins, params))
        slot = self._new(ans, _STEP)
        if prim in REPEATS_SHARED:
            self.shared[key] = slot
        self.step_slot.append(slot)
        for a, i in zip(args, ins, strict=True):
            if np.may_share_memory(ans.value, a.value):  # a view: its operand's memory
                self.owner[slot] = self.owner[i]
                break

    def constant(self, t: Tensor) -> None:
        """t was made during the pass but depends on nothing in it (zeros of a shape)."""
        entry = self.slots.get(id(t))
        # (A dead tensor's entry may carry t's id: t is new all the same.)
        if entry is None or entry[1]() is not t:
            self._new(t, _CONST)
            if self.known.get(id(t.value)) is not t.value:  # (a known array is held anyway)
                self.made_bytes += t.value.nbytes

    def alias(self, t: Tensor, of: Tensor) -> None:
        """t is a new identity for of's array (a custom gradient's outputs)."""
        if self.failure is None:
            try:
                self.slots[id(t)] = (self._slot_of(of), weakref.ref(t))
            except CaptureFailed as exc:
                self.failure = str(exc)

    def host_read(self, t: Tensor) -> None:
        entry = self.slots.get(id(t))
        if entry is None or entry[1]() is not t:
            # Not made by the pass's ops: a known constant is fine; anything else was made
            # outside the ops from the pass's values (`x.value` read by the caller, say),
            # and what a rule derives from it (a one-hot) would be frozen in a replay.
            if not (self.known.get(id(t)) is t or self.known.get(id(t.value)) is t.value):
                self.failure = (
                    "a rule read, on the host, an array made outside the ops "
                    "during the pass (data-dependent)"
                )
            return
        if self.kinds[entry[0]] != _CONST and entry[0] not in self.pinned:
            self.failure = "a rule read a value of the pass on the host (data-dependent)"

    def schedule(self, outputs: Sequence[Tensor | None], pool_limit: int) -> Schedule:
        if self.failure is not None:
            raise CaptureFailed(self.failure)
        out_slots: list[int | None] = []
        for t in outputs:
            out_slots.append(None if t is None else self._slot_of(t))
        if self.failure is not None:
            raise CaptureFailed(self.failure)
        return Schedule(self, out_slots, pool_limit)


NOT_YET = "run once, dynamically: captured on its next pass"
CAPTURED = "captured on this pass (run dynamically): the next pass of this layout replays it"
BUSY = "its schedule was in use by another pass of the same layout: run dynamically meanwhile"
NESTED = "inside an outer pass being captured, which must see every op"


# How passes ran ---------------------------------------------------------------------------
# A caller that wants to say how its computation ran (the service's answers do) opens
# `observe()` around it; each outermost pass run inside reports there, as it is decided,
# whether it replayed a schedule or ran dynamically and why: nothing is looked up again.
# Passes run inside another one (an HVP request's operator, a pass being captured) are
# part of it and report nothing of their own.


@dataclass(frozen=True)
class Execution:
    """How a pass ran: replayed from its captured schedule (`compiled`), or dynamically,
    with the reason (the first pass of a layout, a capture, a pass that cannot be
    captured and why, an array on a GPU, ...)."""

    compiled: bool
    reason: str | None = None


class Observed:
    """The Executions of the outermost passes run inside one `observe()` block."""

    __slots__ = ("depth", "passes")

    def __init__(self) -> None:
        self.passes: list[Execution] = []
        self.depth = 0  # passes being run now (only depth 0 reports)

    def summary(self) -> Execution:
        """Compiled when every pass replayed; otherwise the first dynamic pass's reason
        (or that no pass ran through a compiled entry point)."""
        for e in self.passes:
            if not e.compiled:
                return e
        if not self.passes:
            return Execution(False, "no pass of it ran through a compiled entry point")
        return Execution(True)


_observed: ContextVar[Observed | None] = ContextVar("gradtape_replay_observed", default=None)
_T = TypeVar("_T")


class observe:
    """Collect how each outermost pass run inside the block ran (see Execution). A class,
    not a generator-based context manager: it wraps every request a worker answers."""

    __slots__ = ("_found", "_token")

    def __enter__(self) -> Observed:
        self._found = Observed()
        self._token = _observed.set(self._found)
        return self._found

    def __exit__(self, *exc: object) -> None:
        _observed.reset(self._token)


def _reporting(run: Callable[[], tuple[_T, Execution]]) -> _T:
    """run()'s outputs; its Execution reported when it is an outermost observed pass."""
    observed = _observed.get()
    if observed is None:
        return run()[0]
    observed.depth += 1
    try:
        outputs, how = run()
    finally:
        observed.depth -= 1
    if observed.depth == 0:
        observed.passes.append(how)
    return outputs


def why_dynamic(compiled: bool) -> str:
    """Why a pass skipped the compiled passes: the caller asked for the dynamic pass, or
    its arrays are a GPU's (only NumPy passes are captured). One wording for every entry
    point (definitions, tapes' and curvature operators' products)."""
    if not compiled:
        return "compiled=False: the caller asked for the dynamic pass"
    return "its arrays are on a GPU (CuPy): only NumPy passes are captured"


def run_dynamic(reason: str, run: Callable[[], _T]) -> _T:
    """run() for a pass that does not go through Passes (a GPU's arrays, compiled=False),
    reported as dynamic with `reason`."""
    return _reporting(lambda: (run(), Execution(False, reason)))


class Passes:
    """What the passes of each layout (a Hashable key) do: the first runs dynamically
    (a one-off pass, as a stateless request makes, costs nothing extra), the second runs
    under a capture, later ones replay its Schedule. A pass that cannot be captured is
    tried once more (the first capture's pass fills caches, e.g. rules' outer stages),
    then stays dynamic. At most `limit` layouts are kept (least recently used go).
    With `constant_limit`, a pass whose own constants (folded results, seeds made from
    shapes: a jacobian's identity rows) take more bytes stays dynamic: a schedule holds
    its constants as long as it is kept. Each run reports how it ran to `observe()`."""

    def __init__(
        self,
        limit: int | None = None,
        pool_limit: int | None = None,
        constant_limit: int | None = None,
    ):
        self.entries: OrderedDict[Any, Any] = OrderedDict()  # key: a hashable tuple
        self.limit = limit
        self.pool_limit = POOL_LIMIT if pool_limit is None else pool_limit
        self.constant_limit = constant_limit
        # Counts every change of what the passes keep (a layout seen or evicted, a capture
        # stored, a schedule's buffers allocated): an owner that accounts for memory
        # measures again when it moves, and only then.
        self.changes = 0
        self._lock = threading.Lock()

    def run(
        self,
        key: Hashable,
        seeds: Sequence[Tensor],
        dynamic: Callable[[list[Tensor]], list[Tensor | None]],
        known: Callable[[], dict[int, Any]],
    ) -> list[Tensor | None]:
        """dynamic(seeds)'s outputs, computed the way this layout's state says."""
        observed = _observed.get()  # (_reporting's steps, inlined: every pass comes here)
        if observed is None:
            return self._run(key, seeds, dynamic, known)[0]
        observed.depth += 1
        try:
            outputs, how = self._run(key, seeds, dynamic, known)
        finally:
            observed.depth -= 1
        if observed.depth == 0:
            observed.passes.append(how)
        return outputs

    def _run(
        self,
        key: Hashable,
        seeds: Sequence[Tensor],
        dynamic: Callable[[list[Tensor]], list[Tensor | None]],
        known: Callable[[], dict[int, Any]],
    ) -> tuple[list[Tensor | None], Execution]:
        if trace.capture is not None:  # inside an outer pass being captured: it must see
            return dynamic(list(seeds)), Execution(False, NESTED)  # every op
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                self.entries[key] = (NOT_YET, 0)
                self.changes += 1
                while self.limit is not None and len(self.entries) > self.limit:
                    self.entries.popitem(last=False)
            else:
                self.entries.move_to_end(key)
        if isinstance(entry, Schedule) and entry.kernel_releases != kernels.releases():
            # Captured while kernels its forms could use were held (a worker's warm-up
            # under way): those steps run NumPy's form for as long as the schedule is
            # kept, a tape's lifetime. Captured anew now (the same bits: held kernels
            # are the exact ones, engine/kernels/__init__.py).
            entry = (NOT_YET, 0)
        if isinstance(entry, Schedule):
            allocated = entry.steps is not None
            outputs = entry.try_run([s.value for s in seeds])
            if not allocated and entry.steps is not None:
                self.changes += 1  # its first run allocated its buffers
            if outputs is not None:
                return [None if o is None else Tensor(o) for o in outputs], Execution(True)
            return dynamic(list(seeds)), Execution(False, BUSY)
        if entry is None:
            return dynamic(list(seeds)), Execution(False, NOT_YET)
        if entry[1] >= 2:  # (why it failed twice; the second element counts failures)
            return dynamic(list(seeds)), Execution(False, entry[0])
        outputs, schedule = capture(dynamic, seeds, known(), self.pool_limit)
        if (
            isinstance(schedule, Schedule)
            and self.constant_limit is not None
            and schedule.constant_bytes > self.constant_limit
        ):
            schedule = (
                f"its constants take {schedule.constant_bytes:,} bytes, more than a "
                f"kept pass may hold ({self.constant_limit:,})"
            )
        with self._lock:
            if key in self.entries:  # (the second element counts failed captures)
                self.entries[key] = (
                    schedule if isinstance(schedule, Schedule) else (schedule, entry[1] + 1)
                )
                self.changes += 1
        return outputs, Execution(False, CAPTURED if isinstance(schedule, Schedule) else schedule)

    def status(self) -> dict[Any, str]:
        """Per layout: "compiled", or why (or that) its passes are dynamic so far."""
        return {k: "compiled" if isinstance(v, Schedule) else v[0] for k, v in self.entries.items()}


def known_tensors(*roots: Any) -> dict[int, Any]:
    """The tensors and NumPy arrays reachable from `roots` (through objects, containers,
    and functions' closures and defaults), by id: the values a pass may use as constants.
    The globals a function's code names are looked at shallowly: an array or tensor, a
    list, tuple or dict of them, another function; never walked through as objects (a
    module-level registry or cache would lead the walk over the whole interpreter: seconds
    and tens of MB per capture in a process with many modules loaded). A global held
    deeper (an attribute of a global object) is not known: its pass stays dynamic."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False) for root in roots]  # (object, shallow)
    while stack:
        obj, shallow = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _NEVER_CONSTANT):
            continue
        if isinstance(obj, np.ndarray):
            found[id(obj)] = obj
            continue
        if isinstance(obj, Tensor):
            found[id(obj)] = obj
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append((cell.cell_contents, shallow))
                except ValueError:  # an empty cell
                    pass
            stack.extend((d, shallow) for d in obj.__defaults__ or ())
            if obj.__kwdefaults__:
                stack.extend((d, shallow) for d in obj.__kwdefaults__.values())
            names = obj.__globals__
            stack.extend((names[n], True) for n in obj.__code__.co_names if n in names)
            continue
        if shallow:
            if isinstance(obj, (list, tuple)):
                stack.extend((item, True) for item in obj)
            elif isinstance(obj, dict):
                stack.extend((item, True) for item in obj.values())
            elif isinstance(obj, Tensor):
                stack.append((obj.value, True))
            continue
        stack.extend((r, False) for r in gc.get_referents(obj))
    return found


_NEVER_CONSTANT = (type, types.ModuleType, str, bytes, int, float, bool, Primitive, type(None))


def capture(
    run: Callable[[list[Tensor]], list[Tensor | None]],
    seeds: Sequence[Tensor],
    known: dict[int, Any],
    pool_limit: int | None = None,
) -> tuple[list[Tensor | None], Schedule | str]:
    """Run `run(seeds)` dynamically under a Capture: its outputs, and the Schedule (or the
    reason the pass cannot be replayed). pool_limit: bytes of buffers the schedule may
    keep between passes (POOL_LIMIT by default)."""
    # Fresh identities: a seed passed twice, or a seed that is also a recorded value,
    # must still be one slot per seed.
    fresh = [Tensor(s.value) for s in seeds]
    cap = Capture(fresh, {**known, **{id(t): t for t in scalar_cache.values()}})
    saved, trace.capture = trace.capture, cap
    try:
        outputs = run(fresh)
    finally:
        trace.capture = saved
    try:
        return outputs, cap.schedule(outputs, POOL_LIMIT if pool_limit is None else pool_limit)
    except CaptureFailed as exc:
        return outputs, str(exc)


# ----------------------------------------------------------------------------------------
# Replayable forms: out= versions of the calls that dominate a pass. Each maker sees the
# call's parameters, its operands (arrays for constants, _Layouts for what varies
# between passes) and its result's _Layout, and returns `form(*operands, out)`, the same NumPy call writing
# into `out` (None: allocate), or None where the call has no such form. A ufunc is its
# own form (its positional out).
# ----------------------------------------------------------------------------------------


_UFUNCS = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "negative": np.negative,
    "tanh": np.tanh,
    "exp": np.exp,
}


def _matmul_form(params: dict, operands: list, value: Any) -> Any:
    ta, tb = params.get("ta", False), params.get("tb", False)
    matmul = np.matmul
    if all(len(o.shape) == 2 for o in operands):  # _matmul_impl on matrices: one GEMM
        if ta and tb:
            return lambda x, y, out: matmul(x.T, y.T, out)
        if ta:
            return lambda x, y, out: matmul(x.T, y, out)
        if tb:
            return lambda x, y, out: matmul(x, y.T, out)
        return matmul

    def form(x: Any, y: Any, out: Any) -> Any:
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


def _sum_form(params: dict, operands: list, value: Any) -> Any:
    if value.dtype.kind != "f":  # _sum_impl picks the dtype of integer sums
        return None
    axes, keepdims = params["axes"], params["keepdims"]
    (x,) = operands
    c_contiguous = getattr(x, "order", None) == "C" or _c_contiguous(x)
    if sums_rows(x.shape, c_contiguous, x.dtype, axes):
        return lambda x, out: row_sum(x, keepdims, out)  # _sum_impl's choice, on the layout
    if sums_leading(x.shape, c_contiguous, x.dtype, axes):
        n_axes = len(axes)
        return lambda x, out: leading_sum(x, n_axes, keepdims, out)
    found = channel_axes(x.shape, x.strides, x.dtype, axes)
    if found is not None:
        n, spatial = found
        return lambda x, out: channel_sum(x, n, spatial, axes, keepdims, out)
    reduce: Any = np.add.reduce  # what np.sum calls for a float array, without its wrapper
    return lambda x, out: reduce(x, axes, None, out, keepdims)


def _c_contiguous(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.flags.c_contiguous


def _relu_grad_form(params: dict, operands: list, value: Any) -> Any:
    g, x = operands
    if params["alpha"] != 0 or isinstance(g, np.ndarray):
        return None
    if not isinstance(x, np.ndarray):
        # the impl's g * (x > 0), its product into the buffer (in place into a dying g:
        # one pass over g and x, no float mask, no fresh full-size result)
        greater, multiply = np.greater, np.multiply
        return lambda g_, x_, out: multiply(g_, greater(x_, 0), out)
    mask = (x > 0).astype(value.dtype)  # made once: x is a recorded value
    return lambda g, x_, out: np.multiply(g, mask, out)


def _relu_form(params: dict, operands: list, value: Any) -> Any:
    maximum = np.maximum  # the impl's maximum(x, 0), into a buffer or a dying x
    return lambda x, out: maximum(x, 0, out=out)


def _tanh_grad_form(params: dict, operands: list, value: Any) -> Any:
    y = operands[1]
    if isinstance(y, np.ndarray):  # a recorded value: its slope is made once
        slope = 1 - y * y
        return lambda g_, y_, out: np.multiply(g_, slope, out)
    # the impl's g * (1 - y * y), its last product into the buffer
    return lambda g_, y_, out: np.multiply(g_, 1 - y_ * y_, out)


def _ufunc_form(fn: Any) -> Callable[[dict, list, Any], Any]:
    return lambda params, operands, value: fn


def _row_vector_form(name: str) -> Callable[[dict, list, Any], Any]:
    """add and multiply: a compiled loop where one operand is a row vector broadcast over
    a C-ordered matrix of the result's shape (a bias, layer norm's scale and shift:
    engine/kernels/rows.py, the same bits at 2.3-2.8x NumPy's speed); the ufunc else."""
    fn = _UFUNCS[name]

    def maker(params: dict, operands: list, value: Any) -> Any:
        apart, into = (k.compiled() for k in rows_kernels.KERNELS[name])
        if (
            apart is None
            or into is None
            or len(operands) != 2
            or value.order != "C"
            or value.dtype not in (np.float32, np.float64)  # (the kernels' declared types)
        ):
            return fn
        k = value.shape[-1] if value.shape else 0
        if len(value.shape) < 2 or k < 2:
            return fn
        # m: the operand of the result's shape, C-ordered; the other a row of k
        m = next((i for i, o in enumerate(operands) if _fits(o, value.shape, value)), None)
        if m is None:
            return fn
        row = operands[1 - m]
        row_shape = getattr(row, "shape", None)
        if row_shape is None or row_shape[-1:] != (k,) or math.prod(row_shape) != k:
            return fn
        if not _fits(row, row_shape, value):
            return fn
        shape = value.shape

        def form(x: Any, y: Any, out: Any) -> Any:
            matrix, row = (x, y) if m == 0 else (y, x)
            if out is matrix:  # the replay's in-place step
                into(matrix.reshape(-1, k), row.reshape(k))
                return out
            if out is None:
                out = np.empty(shape, value.dtype)
            apart(matrix.reshape(-1, k), row.reshape(k), out.reshape(-1, k))
            return out

        return form

    return maker


def _fits(operand: Any, shape: tuple, value: Any) -> bool:
    """Whether an operand (a constant's array or a _Layout) has `shape`, the result's
    dtype and C order."""
    if getattr(operand, "shape", None) != shape or getattr(operand, "dtype", None) != value.dtype:
        return False
    if isinstance(operand, np.ndarray):
        return bool(operand.flags.c_contiguous)
    return bool(operand.order == "C")


_FORMS: dict[str, Callable[[dict, list, Any], Any]] = {
    **{name: _ufunc_form(fn) for name, fn in _UFUNCS.items()},
    "add": _row_vector_form("add"),
    "multiply": _row_vector_form("multiply"),
    "matmul": _matmul_form,
    "sum": _sum_form,
    "relu": _relu_form,
    "relu_grad": _relu_grad_form,
    "tanh_grad": _tanh_grad_form,
}
_ELEMENTWISE = {*_UFUNCS, "relu", "relu_grad", "tanh_grad"}


class Schedule:
    """A captured pass as a flat list of array calls; `run(seed arrays)` replays it."""

    def __init__(self, cap: Capture, out_slots: list[int | None], pool_limit: int):
        # (read before the forms below ask compiled(): a release meanwhile recaptures)
        self.kernel_releases = kernels.releases()
        values, kinds = cap.values, cap.kinds
        n = len(kinds)
        self.seed_slots = cap.seed_slots
        self.out_slots = out_slots
        self.template: list[Any] = [values[i] if kinds[i] == _CONST else None for i in range(n)]
        self.constant_outs = {s for s in out_slots if s is not None and kinds[s] == _CONST}
        self.seed_layouts = [(values[i].shape, values[i].strides) for i in cap.seed_slots]
        owner = cap.owner  # which buffer each slot's memory belongs to (views share)
        steps, step_slot = self._live(cap, out_slots)
        self.dropped = len(cap.steps) - len(steps)
        # The last step that reads each buffer (through any view of it); outputs live on.
        last = [-1] * n
        for k, (_, ins, _) in enumerate(steps):
            for i in ins:
                last[owner[i]] = k
        escaping = {owner[s] for s in out_slots if s is not None}
        for s in escaping:
            last[s] = len(steps)

        # Persistent buffers are made on the first replay (the capture pass allocates what
        # the dynamic sweep does, no more); a _Buffer is where each will live.
        pool: dict[tuple, list[_Buffer]] = {}  # free buffers by layout
        pooled_bytes = 0
        buffer_of: dict[int, _Buffer] = {}  # slot -> the persistent buffer its step writes
        self.buffers: list[_Buffer] = []
        frees: list[list[int]] = [[] for _ in steps]
        members: dict[int, list[int]] = {}
        for slot in step_slot:
            members.setdefault(owner[slot], []).append(slot)
        freed: set[int] = set()
        plan: list[list[Any]] = []
        for k, ((prim, ins, params), slot) in enumerate(zip(steps, step_slot, strict=True)):
            value = values[slot]
            maker = _FORMS.get(prim.name) or replay_forms.get(prim)
            # constants as arrays, the pass's own operands as their _Layouts
            form = None if maker is None else maker(params, [values[i] for i in ins], value)
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
                elif pooled_bytes + value.nbytes <= pool_limit:
                    target = buffer_of[slot] = _Buffer(value)
                    self.buffers.append(target)
                    pooled_bytes += value.nbytes
            plan.append([prim, params, list(ins), slot, form, target, frees[k], value])
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
        self._elide_broadcasts(plan)
        self.plan = plan
        self.steps: list[Callable[[list[Any]], None]] | None = None
        self.pooled_bytes = pooled_bytes
        self.constant_bytes = cap.made_bytes
        self._lock = threading.Lock()

    @staticmethod
    def _live(cap: Capture, out_slots: list[int | None]) -> tuple[list, list[int]]:
        """The steps some output needs (and their slots): a call whose result nothing
        reads is left out (a fresh HVP's deferred weight-gradient products, which the
        capture's own pass computed to see their layouts)."""
        needed = {s for s in out_slots if s is not None}
        keep = [False] * len(cap.steps)
        for k in range(len(cap.steps) - 1, -1, -1):
            if cap.step_slot[k] in needed:
                keep[k] = True
                needed.update(cap.steps[k][1])
        steps = [st for st, kept in zip(cap.steps, keep, strict=True) if kept]
        slots = [sl for sl, kept in zip(cap.step_slot, keep, strict=True) if kept]
        return steps, slots

    @staticmethod
    def _elide_broadcasts(plan: list[list[Any]]) -> None:
        """A broadcast_to read only by ufuncs that write into a buffer of the full shape
        is left out: the ufunc broadcasts its operand itself, to the same values
        (np.broadcast_to is a Python function, as slow as the add it feeds)."""
        readers: dict[int, list[list[Any]]] = {}
        for entry in plan:
            for i in entry[2]:
                readers.setdefault(i, []).append(entry)
        for entry in plan:
            prim, _, ins, slot, *_ = entry
            if prim.name != "broadcast_to":
                continue
            users = readers.get(slot, [])
            if users and all(
                u[0].name in _UFUNCS and u[5] is not None and u[4] is not None for u in users
            ):
                for u in users:
                    u[2] = [ins[0] if i == slot else i for i in u[2]]
                entry[0] = None  # dropped

    def _compile(self) -> None:
        for b in self.buffers:
            b.allocate()
        self.steps = [
            _compile_step(prim, params, tuple(ins), slot, form, target, tuple(frees), value)
            for prim, params, ins, slot, form, target, frees, value in self.plan
            if prim is not None
        ]
        # A dropped broadcast frees nothing: its operand (whose view it was) is read later.

    def try_run(self, arrays: Sequence[Any]) -> list[Any] | None:
        """run(), or None when the schedule is running already (its buffers are in use:
        a pass re-entered from inside one, or another thread's)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.run(arrays)
        finally:
            self._lock.release()

    def run(self, arrays: Sequence[Any]) -> list[Any]:
        """The pass's outputs (None for an output the pass did not reach)."""
        if self.steps is None:
            self._compile()
        steps: list[Any] = self.steps  # type: ignore[assignment]  # _compile sets it
        env = self.template.copy()
        for slot, a in zip(self.seed_slots, arrays, strict=True):
            env[slot] = a
        check = trace.interrupt_check
        if check is None:
            for step in steps:
                step(env)
        else:
            for step in steps:
                check()
                step(env)
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
        self.order = (
            "C"
            if a.flags.c_contiguous
            else "F"
            if a.flags.f_contiguous
            else "P"
            if _dense(a.shape, a.strides, a.itemsize)
            else None
        )
        self.key = (a.shape, a.strides, a.dtype)


def _dense(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """Whether an array of this layout fills its memory exactly, its axes in some order:
    a transposed view of contiguous memory (a convolution's result, (N, C, H, W) over
    memory ordered (C, N, H, W), and whatever elementwise ops make from it), for which
    a buffer of the same strides can be made (`_Buffer.allocate`)."""
    axes = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    step = itemsize
    for st, n in axes:
        if st != step:
            return False
        step *= n
    return True


class _Buffer:
    """A persistent buffer of one layout, allocated on the schedule's first run."""

    __slots__ = ("array", "layout")

    def __init__(self, layout: _Layout):
        self.layout = layout
        self.array: Any = None

    def allocate(self) -> None:
        layout = self.layout
        if layout.order == "P":  # the recorded strides exactly, over fresh dense memory
            flat = np.empty(layout.nbytes // layout.dtype.itemsize, layout.dtype)
            self.array = np.lib.stride_tricks.as_strided(flat, layout.shape, layout.strides)
            return
        self.array = np.empty(layout.shape, layout.dtype, order=layout.order)  # type: ignore[arg-type]


def _compile_step(
    prim: Primitive,
    params: dict,
    ins: tuple[int, ...],
    slot: int,
    form: Any,
    target: Any,
    frees: tuple[int, ...],
    value: Any,
) -> Callable[[list[Any]], None]:
    """One call of the schedule as `step(env)`: operands read from env, the result
    written to env[slot], dead slots dropped. Specialised by arity and by where the
    result goes, so a step is one Python call around the NumPy one."""
    scalar = value.shape == ()  # NumPy answers 0-d operations with scalars; bind wraps them
    if form is not None and target is None:
        call = form if isinstance(form, np.ufunc) else (lambda *xs: form(*xs, None))
    elif form is not None:
        call = None
    else:
        impl = impl_rules[prim]
        if prim.name == "reshape":
            shape = params["shape"]
            call = lambda x: x.reshape(shape)  # the impl without its xp
        else:
            call = lambda *xs: impl(np, *xs, **params)
    if call is not None:
        if scalar:
            inner = call
            call = lambda *xs: _as_array(inner(*xs))
        return _allocating(call, ins, slot, frees)
    if type(target) is tuple:  # in place, into the operand that dies here
        return _in_place(form, ins, slot, frees, ins[target[1]])
    return _into(form, ins, slot, frees, target.array)


def _allocating(call: Any, ins: tuple, slot: int, frees: tuple) -> Callable[[list], None]:
    if len(ins) == 1:
        (a,) = ins

        def step(env: list) -> None:
            env[slot] = call(env[a])
            for i in frees:
                env[i] = None

    elif len(ins) == 2:
        a, b = ins

        def step(env: list) -> None:
            env[slot] = call(env[a], env[b])
            for i in frees:
                env[i] = None

    else:

        def step(env: list) -> None:
            env[slot] = call(*[env[i] for i in ins])
            for i in frees:
                env[i] = None

    return step


def _into(fn: Any, ins: tuple, slot: int, frees: tuple, out: Any) -> Callable[[list], None]:
    """fn(*operands, out) into a buffer the schedule keeps (a ufunc's positional out)."""
    if len(ins) == 1:
        (a,) = ins

        def step(env: list) -> None:
            env[slot] = fn(env[a], out)
            for i in frees:
                env[i] = None

    elif len(ins) == 2:
        a, b = ins

        def step(env: list) -> None:
            env[slot] = fn(env[a], env[b], out)
            for i in frees:
                env[i] = None

    else:

        def step(env: list) -> None:
            env[slot] = fn(*[env[i] for i in ins], out)
            for i in frees:
                env[i] = None

    return step


def _in_place(fn: Any, ins: tuple, slot: int, frees: tuple, dying: int) -> Callable[[list], None]:
    """fn(*operands, out=the operand's own array): a cotangent accumulated in place."""
    if len(ins) == 2:
        a, b = ins

        def step(env: list) -> None:
            env[slot] = fn(env[a], env[b], env[dying])
            for i in frees:
                env[i] = None

    else:

        def step(env: list) -> None:
            env[slot] = fn(*[env[i] for i in ins], env[dying])
            for i in frees:
                env[i] = None

    return step


def _as_array(out: Any) -> Any:
    return np.asarray(out) if isinstance(out, np.generic) else out
