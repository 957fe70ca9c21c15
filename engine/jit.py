"""An opt-in compiled form of the Python API: `jit(f)`, with jax.jit's contract.

    loss_jit = gt.jit(loss)                      # loss(params, x, y) -> scalar tensor
    value_and_grad = loss_jit.value_and_grad()   # as gt.value_and_grad(loss)
    (value, grads) = value_and_grad(params, x, y)
    loss_jit.hvp(primals, tangents)              # as gt.hvp(loss, primals, tangents)
    loss_jit.jacrev(argnums=1)(params, x, y)     # as gt.jacrev(loss, argnums=1)
    loss_jit.batch_jacobian(argnum=1)(params, x, y)
    loss_jit(params, x, y)                       # loss itself
    loss_jit.status()                            # what happened, per key

Each transform's call is keyed by the layout of its arguments: the pytree structure of
(args, kwargs); per array leaf its shape, strides, dtype and device (the values of
integer and boolean leaves too: labels and indices may steer a function); every other
leaf (Python numbers, strings, None, ...) by type and value, as jax.jit's static
arguments. The first call of a key runs the dynamic transform, the second runs it under
a capture (engine/replay.py), later calls replay the captured NumPy calls with the new
arrays: the answers are bit-equal to the dynamic transform's. The keys are per `jit`
object, at most `cache_size` of them (least recently used out).

The contract (jax.jit's): f's Python control flow may depend on shapes, dtypes and
static arguments, never on tensor values, and f reads no state outside its arguments
that changes between calls. What f closes over (tensors, NumPy arrays, Python numbers,
globals) is a constant of the compiled call: a later change to it is not seen by a key
already compiled (it is by the one or two dynamic calls before). Variables are the
exception, as tf.function reads them: an `assign` to a Variable f reaches is seen (every
key is forgotten and captured again). Side effects (printing, appending to a list)
happen on the dynamic and capturing calls only.

What the capture can see, it refuses to compile: a read of a value of the pass on the
host (`float(t)`, `bool(t)`, `t.numpy()`: a branch on data) or an array made outside
the engine's ops from the pass's values. Such a key stays dynamic, with the same
answers; `status()` says why. Calls made while a tape or accumulator records (a jitted
function inside an outer differentiation), and CuPy arrays, always run dynamically: a
replay records nothing on tapes, and only NumPy passes are captured.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from engine import backend, replay, trace, transforms, tree
from engine.tape import (
    GradientTape,
    check_per_example,
    per_example_layout,
    per_example_rows,
)
from engine.tensor import Tensor, Variable, as_tensor

# Per jit object: the keys kept (each a schedule once compiled) and what each schedule
# may keep between calls: scratch buffers, and its own constants (a jacobian's identity
# rows grow with the output; a pass whose constants exceed this stays dynamic). So a jit
# object keeps at most cache_size x 32 MiB (512 MiB by default) beyond what f itself
# holds; the large arrays of a big model's pass are not kept (they are allocated per
# call, as the dynamic pass does).
CACHE_SIZE = 16
POOL_LIMIT = 16 * 1024 * 1024
CONSTANT_LIMIT = 16 * 1024 * 1024


def jit(f: Callable[..., Any] | None = None, *, cache_size: int = CACHE_SIZE) -> Any:
    """f compiled per argument layout, with its transforms (see the module docstring for
    the contract: f's control flow must not depend on tensor values or outside state).
    Also a decorator: `@gt.jit` or `@gt.jit(cache_size=8)`."""
    if f is None:
        return lambda g: Jit(g, cache_size=cache_size)
    return Jit(f, cache_size=cache_size)


class Jit:
    """f and its transforms, compiled per argument layout; see engine.jit."""

    def __init__(self, f: Callable[..., Any], *, cache_size: int = CACHE_SIZE):
        if not callable(f):
            raise TypeError(f"jit: expected a function, got {type(f).__name__}")
        if cache_size < 1:
            raise ValueError(f"jit: cache_size must be at least 1, got {cache_size}")
        self.fun = f
        self.cache_size = cache_size
        self._passes = replay.Passes(cache_size, POOL_LIMIT, CONSTANT_LIMIT)
        # Per key: its description and its output's structure (treedef, non-tensor leaves)
        self._outputs: dict[Hashable, tuple[str, Any, dict[int, Any]]] = {}
        # Per key whose last call had to run dynamically before reaching the passes (see
        # _dynamic_reason): its description and why, for status(); at most cache_size.
        self._notes: OrderedDict[Hashable, tuple[str, str]] = OrderedDict()
        # The tensors f reaches (closures, defaults, globals), weakly: an argument that is
        # one of them is differentiated at both uses by the dynamic transform, which a
        # replay (seeing the closure's use as a constant) cannot do.
        self._reached: weakref.WeakValueDictionary[int, Tensor] | None = None
        self._reached_ids: frozenset[int] = frozenset()
        # The Variables f reaches, with the arrays they held when last walked: an assign
        # gives a Variable a new array, and every compiled key (which read the old one as a
        # constant) is forgotten, as tf.function reads variables anew on every call.
        self._variables: list[tuple[weakref.ref[Variable], Any]] = []
        self._lock = threading.Lock()
        self.__wrapped__ = f
        self.__doc__ = getattr(f, "__doc__", None)

    def __repr__(self) -> str:
        return f"<jit of {getattr(self.fun, '__qualname__', self.fun)!r}>"

    # The transforms ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """f(*args, **kwargs), compiled."""
        return self._call(("call",), "f", self.fun, args, kwargs)

    def value_and_grad(
        self, argnums: transforms.Argnums = 0, has_aux: bool = False
    ) -> Callable[..., Any]:
        """gt.value_and_grad(f, argnums, has_aux), compiled."""
        return self._over_argnums(
            "value_and_grad",
            argnums,
            "has_aux",
            has_aux,
            transforms.value_and_grad(self.fun, argnums, has_aux),
        )

    def grad(self, argnums: transforms.Argnums = 0, has_aux: bool = False) -> Callable[..., Any]:
        """gt.grad(f, argnums, has_aux), compiled."""
        vg = self.value_and_grad(argnums, has_aux)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result, grads = vg(*args, **kwargs)
            return (grads, result[1]) if has_aux else grads

        return wrapped

    def hvp(self, primals: Any, tangents: Any) -> Any:
        """gt.hvp(f, primals, tangents), compiled: H @ v at primals, in their structure."""
        primals, tangents = tuple(primals), tuple(tangents)
        every = tuple(range(len(primals)))
        n = len(primals)

        def dynamic(*both: Any) -> Any:
            return transforms.hvp(self.fun, both[:n], both[n:])

        both = _tensorized(primals, every) + _tensorized(tangents, tuple(range(len(tangents))))
        return self._call(("hvp", n), f"hvp({n} primals, {n} tangents)", dynamic, both, {})

    def jacrev(
        self, argnums: transforms.Argnums = 0, chunk_size: int | None = None
    ) -> Callable[..., Any]:
        """gt.jacrev(f, argnums, chunk_size), compiled."""
        return self._over_argnums(
            "jacrev",
            argnums,
            "chunk_size",
            chunk_size,
            transforms.jacrev(self.fun, argnums, chunk_size),
        )

    def _over_argnums(
        self,
        name: str,
        argnums: transforms.Argnums,
        option: str,
        value: Any,
        dynamic: Callable[..., Any],
    ) -> Callable[..., Any]:
        """The transform `name` (with its one `option`) of the arguments `argnums`,
        compiled: the dynamic transform's call, keyed per argument layout."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nums, _ = transforms.normalize_argnums(argnums, len(args), name)
            return self._call(
                (name, nums, isinstance(argnums, int), value),
                f"{name}(argnums={argnums}, {option}={value})",
                dynamic,
                _tensorized(args, nums),
                kwargs,
            )

        return wrapped

    jacobian = jacrev

    def batch_jacobian(
        self, argnum: int = 0, check_independence: bool = True
    ) -> Callable[..., Any]:
        """The per-example jacobian of f's output (B, ...) with respect to the tensor
        argument `argnum` (B, ...): shape (B, *out.shape[1:], *arg.shape[1:]), as
        GradientTape.batch_jacobian; BatchDependenceError when the examples mix (the
        check reads the pass's rows, so it runs after every call, replayed or not)."""
        if not isinstance(argnum, int):
            raise TypeError("batch_jacobian: argnum must be one int (one tensor argument)")

        def dynamic(*args: Any, **kwargs: Any) -> list[Any]:
            args, flat, _ = transforms.prepare_arguments(args, (argnum,), "batch_jacobian")
            if len(flat) != 1:
                raise TypeError("batch_jacobian: the argument must be one tensor")
            (source,) = flat
            with GradientTape(persistent=True, watch_accessed_variables=False) as tape:
                tape.watch(source)
                out = self.fun(*args, **kwargs)
            if not isinstance(out, Tensor):
                raise TypeError("batch_jacobian: the function must return a single tensor")
            rows = per_example_rows(tape, out, source, check_independence)
            jac = per_example_layout(rows, out, source, check_independence)
            return [out, jac, rows]

        def wrapped(*args: Any, **kwargs: Any) -> Tensor:
            nums, _ = transforms.normalize_argnums(argnum, len(args), "batch_jacobian")
            out, jac, rows = self._call(
                ("batch_jacobian", nums[0], check_independence),
                f"batch_jacobian(argnum={argnum}, check_independence={check_independence})",
                dynamic,
                _tensorized(args, nums),
                kwargs,
            )
            if check_independence and rows is not None:
                check_per_example(rows, out)
            return jac

        return wrapped

    # What happened ----------------------------------------------------------------------
    def status(self) -> dict[str, str]:
        """Per key kept (transform and argument layout): "compiled", or why (or that) its
        calls are dynamic so far."""
        with self._lock:
            outputs = dict(self._outputs)
            notes = dict(self._notes)
        # A key whose last call had to run dynamically (an outer tape, tied arguments, ...)
        # says why; the others what their passes did.
        states = self._passes.status()
        found = {
            outputs[k][0] if k in outputs else repr(k): v
            for k, v in states.items()
            if k not in notes
        }
        found.update(notes.values())
        return found

    def clear(self) -> None:
        """Forget every key (and the buffers and constants their schedules keep)."""
        with self._lock:
            self._passes = replay.Passes(self.cache_size, POOL_LIMIT, CONSTANT_LIMIT)
            self._outputs.clear()
            self._notes.clear()

    # The compiled call ------------------------------------------------------------------
    def _call(
        self, tag: tuple, label: str, dynamic: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """dynamic(*args, **kwargs) (the transform `tag`, described by `label`), compiled
        per argument layout."""
        leaves, treedef = tree.flatten((list(args), kwargs))
        seeds: list[Tensor] = []
        layout: list[Any] = []
        on_device = False
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                value = leaf.value
                if type(value) is not np.ndarray:  # CuPy: only NumPy passes are captured
                    on_device = True
                    layout.append((value.shape, value.dtype.str, backend.device_of(value)))
                    continue
                seeds.append(leaf if type(leaf) is Tensor else Tensor(value))
                layout.append(_array_key(value))
            elif isinstance(leaf, np.ndarray):
                leaf = np.asarray(leaf)  # (a subclass, memmap say, as its plain array)
                seeds.append(Tensor(leaf))
                layout.append(_array_key(leaf))
            else:
                layout.append(_static_key(leaf))
        key = (tag, treedef, tuple(layout))
        reason = self._dynamic_reason(leaves, on_device)
        if reason is not None:
            with self._lock:
                self._notes[key] = (_describe(label, leaves), reason)
                self._notes.move_to_end(key)
                while len(self._notes) > self.cache_size:
                    self._notes.popitem(last=False)
            return dynamic(*args, **kwargs)
        if key in self._notes:  # (this call reaches the passes: their state tells)
            with self._lock:
                self._notes.pop(key, None)
        for ref, array in self._variables:
            variable = ref()
            if variable is not None and variable.value is not array:
                self.clear()  # (this call runs dynamically, the next one captures again)
                self._known()
                break

        def run(fresh: list[Tensor]) -> list[Tensor | None]:
            it = iter(fresh)
            rebuilt = [next(it) if _is_array(x) else x for x in leaves]
            new_args, new_kwargs = tree.unflatten(treedef, rebuilt)
            out_leaves, out_def = tree.flatten(dynamic(*new_args, **new_kwargs))
            statics = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, Tensor)}
            with self._lock:
                self._outputs[key] = (_describe(label, leaves), out_def, statics)
            return [x if isinstance(x, Tensor) else None for x in out_leaves]

        outputs = self._passes.run(key, seeds, run, self._known)
        with self._lock:
            found = self._outputs.get(key)
            if len(self._outputs) > len(self._passes.entries) + self.cache_size:
                for k in [k for k in self._outputs if k not in self._passes.entries]:
                    del self._outputs[k]
        if found is None:  # (forgotten meanwhile by another thread's call or clear())
            return dynamic(*args, **kwargs)
        _, out_def, statics = found
        result = [statics.get(i, o) for i, o in enumerate(outputs)]
        return tree.unflatten(out_def, result)

    def _dynamic_reason(self, leaves: list[Any], on_device: bool) -> str | None:
        """Why this call must run dynamically whatever its key's state, or None."""
        # A replay records nothing: under an outer tape, accumulator or capture, f runs
        # dynamically so that they see every op. One Tensor given as two arguments (tied
        # weights), or an argument f also reaches, is differentiated at both uses by the
        # dynamic transform; the capture would see one use as a seed, the other as a
        # constant.
        if on_device:
            return "dynamic: a device (CuPy) array; only NumPy passes are captured"
        if trace.anything_active():
            return "dynamic: called while a tape or accumulator records (a replay records nothing)"
        if trace.capture is not None:
            return "dynamic: called inside a pass being captured (the outer capture sees its ops)"
        tensors = [id(x) for x in leaves if isinstance(x, Tensor)]
        if len(set(tensors)) != len(tensors):
            return "dynamic: one tensor is given as two arguments (both uses are differentiated)"
        if self._reaches(leaves):
            return (
                "dynamic: an argument is also a tensor the function reaches (a closure, a "
                "default, a global, or the object of a bound method): both uses are "
                "differentiated, and a replay would freeze the one it reaches"
            )
        return None

    def _known(self) -> dict[int, Any]:
        """What a capture may treat as constants: the tensors and NumPy arrays f reaches."""
        known = replay.known_tensors(self.fun)
        self._reached = weakref.WeakValueDictionary(
            {k: t for k, t in known.items() if isinstance(t, Tensor)}
        )
        self._reached_ids = frozenset(self._reached.keys())
        self._variables = [
            (weakref.ref(t), t.value) for t in known.values() if isinstance(t, Variable)
        ]
        return known

    def _reaches(self, leaves: list[Any]) -> bool:
        """Whether an argument is also a tensor f reaches (see __init__)."""
        if self._reached is None:
            self._known()
        ids, reached = self._reached_ids, self._reached
        return any(id(x) in ids and reached.get(id(x)) is x for x in leaves)  # type: ignore[union-attr]


def _tensorized(args: tuple, nums: tuple[int, ...]) -> tuple:
    """The differentiated arguments' leaves as tensors (Python numbers become float32
    tensors, as the dynamic transforms make them)."""
    out = list(args)
    for i in nums:
        if type(out[i]) is Tensor:
            continue  # (the common case, as it is)
        leaves, treedef = tree.flatten(out[i])
        out[i] = tree.unflatten(treedef, [as_tensor(x) for x in leaves])
    return tuple(out)


def _is_array(x: Any) -> bool:
    return isinstance(x, (Tensor, np.ndarray))


def _array_key(a: np.ndarray) -> tuple:
    if a.dtype.kind in "fc":
        return (a.shape, a.strides, a.dtype)
    # Integer and boolean values may steer f (labels, indices): part of the key, by digest
    # (a kept key never holds a copy of a large label array).
    return (a.shape, a.strides, a.dtype, hashlib.blake2b(a.tobytes(), digest_size=16).digest())


def _static_key(x: Any) -> tuple:
    try:
        hash(x)
    except TypeError:
        raise TypeError(
            f"jit: an argument leaf of type {type(x).__name__} is neither a tensor nor an "
            "array, so it is static (part of the compiled key), and static leaves must be "
            "hashable"
        ) from None
    return (type(x), x)  # 1, 1.0 and True are equal, but f may treat them apart


def _describe(label: str, leaves: list[Any]) -> str:
    parts = []
    for x in leaves:
        if _is_array(x):
            a = x.value if isinstance(x, Tensor) else x
            strided = "" if a.flags.c_contiguous else f" strides {a.strides}"
            # (the device too where not the host: a CuPy key and a NumPy key of one
            # layout are two keys, and status() must not fold them into one line)
            where = "" if type(a) is np.ndarray else f" on {backend.device_of(a)}"
            parts.append(f"{a.dtype}{list(a.shape)}{strided}{where}")
        else:
            parts.append(repr(x))
    return f"{label} on ({', '.join(parts)})"


__all__ = ["Jit", "jit"]
