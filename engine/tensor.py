"""The array wrapper, variables, and `bind`: the one function that applies a primitive.

`bind` computes a primitive's forward on the raw arrays, then lets every active tape
record it (if the tape watches an input) and every active forward accumulator push a
tangent through it. Operators on Tensor (`+`, `@`, indexing...) are attached by
`engine.ops.operators`, since the ops import this module and not the other way round.

dtype policy: Python floats become float32, Python ints int32 and bools bool (as
TensorFlow); NumPy arrays keep their dtype (float64 stays float64). A Python scalar next
to a tensor takes the tensor's dtype. Two tensors of different dtypes in one op are an
error, never a silent cast: use `cast`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import backend, trace
from engine.registry import DEFERRED_SHAPES, Primitive, defjvp, defvjp, impl_rules, primitive


class Tensor:
    """An immutable array (NumPy or CuPy) that tapes can record operations on."""

    __slots__ = ("__weakref__", "value")
    __array_ufunc__ = None  # make `ndarray <op> Tensor` defer to Tensor's reflected ops

    def __init__(self, value: Any):
        self.value = value

    if TYPE_CHECKING:  # attached by engine/ops/operators.py (the ops import this module)

        def __getitem__(self, index: Any) -> Tensor: ...
        def __add__(self, other: Any) -> Tensor: ...
        def __radd__(self, other: Any) -> Tensor: ...
        def __sub__(self, other: Any) -> Tensor: ...
        def __rsub__(self, other: Any) -> Tensor: ...
        def __mul__(self, other: Any) -> Tensor: ...
        def __rmul__(self, other: Any) -> Tensor: ...
        def __truediv__(self, other: Any) -> Tensor: ...
        def __rtruediv__(self, other: Any) -> Tensor: ...
        def __pow__(self, other: Any) -> Tensor: ...
        def __rpow__(self, other: Any) -> Tensor: ...
        def __matmul__(self, other: Any) -> Tensor: ...
        def __rmatmul__(self, other: Any) -> Tensor: ...
        def __neg__(self) -> Tensor: ...
        def __pos__(self) -> Tensor: ...
        def __abs__(self) -> Tensor: ...
        def __gt__(self, other: Any) -> Tensor: ...
        def __ge__(self, other: Any) -> Tensor: ...
        def __lt__(self, other: Any) -> Tensor: ...
        def __le__(self, other: Any) -> Tensor: ...
        def reshape(self, *shape: Any) -> Tensor: ...
        def transpose(self, *axes: int) -> Tensor: ...
        def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor: ...
        def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor: ...
        def max(self, axis: Any = None, keepdims: bool = False) -> Tensor: ...
        def min(self, axis: Any = None, keepdims: bool = False) -> Tensor: ...
        def prod(self, axis: Any = None, keepdims: bool = False) -> Tensor: ...
        def astype(self, dtype: Any) -> Tensor: ...
        @property
        def T(self) -> Tensor: ...
        @property
        def mT(self) -> Tensor: ...

    # Introspection -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return self.value.ndim

    @property
    def size(self) -> int:
        return int(self.value.size)

    @property
    def device(self) -> str:
        return backend.device_of(self.value)

    def numpy(self) -> np.ndarray:
        """The value as a NumPy array (copied from the device for CuPy tensors)."""
        if trace.capture is not None:  # a rule branching on data cannot be replayed
            trace.capture.host_read(self)
        return backend.to_host(self.value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Any:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError(
                f"the truth value of a tensor of shape {self.shape} is ambiguous; "
                "use gt.any or gt.all"
            )
        return bool(self.numpy())

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="  ")
        return f"{type(self).__name__}({body}, dtype={self.dtype}, shape={self.shape})"


_stored_value = Tensor.__dict__["value"]  # the slot, beneath DeferredTensor's property


class DeferredTensor(Tensor):
    """A primitive's result whose array is computed the first time it is read.

    Its shape and dtype are known without it, so rules, tapes and accumulators that look
    only at those (a tangent's rule, undoing broadcasting) leave it uncomputed; a result
    nobody reads is never computed (bind makes these only under trace.defer_primal).
    """

    __slots__ = ("_dtype", "_shape", "_thunk")

    def __init__(self, thunk: Any, shape: tuple[int, ...], dtype: Any):
        self._thunk, self._shape, self._dtype = thunk, shape, dtype

    @property
    def value(self) -> Any:
        thunk = self._thunk
        if thunk is not None:
            _stored_value.__set__(self, thunk())
            self._thunk = None
        return _stored_value.__get__(self, DeferredTensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))


_variable_ids = itertools.count()


class Variable(Tensor):
    """A mutable tensor: a model parameter. Tapes watch trainable variables they touch.

    Operations never see the Variable itself but a *read*: an immutable snapshot of its
    current value, linked to the Variable on every tape by an identity record (as
    TensorFlow's ReadVariableOp). So `assign` after a forward pass does not change what
    was recorded, and gradients still flow to the Variable.
    """

    __slots__ = ("_read", "_uid", "name", "trainable")

    def __init__(self, value: Any, trainable: bool = True, dtype: Any = None, name: str = ""):
        super().__init__(_to_array(value, dtype, None))
        self._uid = next(_variable_ids)  # creation order, for watched_variables()
        self.trainable = bool(trainable)
        self.name = name
        # The current read, weakly: the read refers to its variable, so a strong link back
        # would make every variable a reference cycle, alive until the garbage collector
        # runs (with its array: a worker's request arrays are views of shared memory it
        # must give back). While anything uses the read (an op, a tape's record) it lives
        # and stays the current one.
        self._read: weakref.ref[VariableRead] | None = None

    def assign(self, value: Any) -> Variable:
        """Replace the value (same shape and dtype). What tapes recorded keeps the old one."""
        new = _to_array(value, self.dtype, self.device)
        if new.shape != self.shape:
            raise ValueError(f"assign: shape {new.shape} does not match variable {self.shape}")
        self.value = new
        self._read = None
        return self

    def assign_add(self, delta: Any) -> Variable:
        return self.assign(self.value + _raw(delta, self))

    def assign_sub(self, delta: Any) -> Variable:
        return self.assign(self.value - _raw(delta, self))

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Variable{label} shape={self.shape} dtype={self.dtype} trainable={self.trainable}>"


class VariableRead(Tensor):
    """The value of a Variable at one moment, as the tensor operations consume."""

    __slots__ = ("variable",)

    def __init__(self, variable: Variable):
        self.value = variable.value  # (Tensor.__init__'s one line, without the call)
        self.variable = variable


# Reading a variable is an identity primitive: tapes record it (once per read) so that
# the cotangent of the read reaches the Variable, and tangents pass through unchanged.
read_variable_p = primitive("read_variable", lambda xp, v: v, linear_form="copies")
defvjp(read_variable_p, lambda ans, v: lambda g: g)
defjvp(read_variable_p, lambda t, ans, v: t[0])


def read(variable: Variable) -> VariableRead:
    """The Variable's current read, linked to it on every active tape and accumulator."""
    r = variable._read() if variable._read is not None else None
    if r is None:
        r = VariableRead(variable)
        variable._read = weakref.ref(r)
    for tape in trace.active_tapes:
        tape._record_read(variable, r)
    for accumulator in trace.active_accumulators:
        accumulator._record_read(variable, r)
    return r


def unaliased(x: Tensor) -> Tensor:
    """x, or its read when x is a Variable: what an op returning its input hands back, so
    that a later assign cannot change an op's result."""
    return read(x) if isinstance(x, Variable) else x


def _raw(value: Any, like: Tensor) -> Any:
    return value.value if isinstance(value, Tensor) else _to_array(value, like.dtype, like.device)


def _default_dtype(array: np.ndarray, value: Any) -> Any:
    """TensorFlow's defaults for Python values; NumPy inputs keep their dtype."""
    if isinstance(value, (np.ndarray, np.generic)) or backend.is_array(value):
        return array.dtype
    if array.dtype == np.float64:
        return backend.DEFAULT_FLOAT
    if array.dtype == np.int64:
        return np.int32
    return array.dtype


def _to_array(value: Any, dtype: Any, device: str | None) -> Any:
    if isinstance(value, Tensor):
        value = value.value
    if dtype is None:
        if backend.is_array(value):
            return backend.asarray(value, None, device)
        host = np.asarray(value)
        if host.dtype == object or host.dtype.kind not in "biuf":
            raise TypeError(f"cannot make a tensor from {type(value).__name__} ({host.dtype})")
        return backend.asarray(host, _default_dtype(host, value), device)
    return backend.asarray(value, np.dtype(dtype), device)


def constant(value: Any, dtype: Any = None, device: str | None = None) -> Tensor:
    """A tensor from a Python number, nested list, NumPy/CuPy array or tensor."""
    return Tensor(_to_array(value, dtype, device))


def as_tensor(value: Any, like: Tensor | None = None) -> Tensor:
    """Tensors pass through; Python scalars take `like`'s dtype and device (weak typing)."""
    if isinstance(value, Tensor):
        return value
    if (
        like is not None
        and isinstance(value, (bool, int, float))
        and not isinstance(value, np.generic)
    ):
        kind = like.dtype.kind
        if kind in "iub" and isinstance(value, float) and not float(value).is_integer():
            raise TypeError(
                f"cannot combine a {like.dtype} tensor with the float {value!r}; "
                "cast the tensor first (gt.cast)"
            )
        return _scalar(value, like)
    return constant(value)


def host_value(t: Tensor) -> Any:
    """t's array, read to steer an op on the host (indices that become a gather's
    parameters, a sort's order): a pass being captured is told, since a replay would
    keep the order or indices of the captured call (engine/replay.py)."""
    if trace.capture is not None:
        trace.capture.host_read(t)
    return t.value


def pass_constant(array: Any) -> Tensor:
    """A tensor of an array made outside the ops from shapes and dtypes alone (zeros, an
    identity, a causal mask) or from values read with host_value (one-hot labels): a
    constant of a pass being captured for replay (engine/replay.py), which refuses any
    other array made outside the ops."""
    t = Tensor(array)
    if trace.capture is not None:
        trace.capture.constant(t)
    return t


scalar_cache: dict[tuple, Tensor] = {}


def _scalar(value: bool | float, like: Tensor) -> Tensor:
    """A 0-d tensor of `like`'s dtype on its device, cached: rules use a handful of
    Python numbers (0, 1, 2, ...) over and over, and on a GPU each fresh one would be
    an allocation and a copy."""
    array = like.value
    if type(array) is np.ndarray:  # the host's keys: no device to name
        key: tuple = (type(value), value, array.dtype)
    else:
        xp = backend.array_module(array)
        key = (type(value), value, array.dtype, xp.__name__, _device_index(array))
    t = scalar_cache.get(key)
    if t is None:
        xp = backend.array_module(array)
        if len(scalar_cache) > 4096:  # arbitrary user constants: keep the cache bounded
            scalar_cache.clear()
        t = scalar_cache[key] = Tensor(xp.asarray(value, dtype=like.dtype))
    return t


def _device_index(array: Any) -> int:
    device = getattr(array, "device", None)
    return getattr(device, "id", 0)


def bind(prim: Primitive, *args: Tensor, **params: Any) -> Tensor:
    """Apply a primitive: forward on the arrays, then record on every active recorder."""
    if trace.interrupt_check is not None:
        trace.interrupt_check()
    for a in args:
        if isinstance(a, Variable):
            args = tuple([read(a) if isinstance(a, Variable) else a for a in args])
            break
    if trace.defer_primal and prim in DEFERRED_SHAPES:
        return _bind_deferred(prim, args, params)
    # _apply, with its one- and two-operand NumPy cases inline (once per op)
    first = args[0].value
    if type(first) is np.ndarray and len(args) <= 2:
        try:
            if len(args) == 1:
                out = impl_rules[prim](np, first, **params)
            else:
                out = impl_rules[prim](np, first, args[1].value, **params)
        except ValueError as exc:
            if type(exc) is not ValueError:  # LinAlgError and friends keep their type
                raise
            raise _operand_error(prim, args, exc) from None
        else:
            if type(out) is not np.ndarray and isinstance(out, np.generic):
                out = np.asarray(out)  # NumPy returns scalars from 0-d operations
        ans = Tensor(out)
    else:
        ans = Tensor(_apply(prim, args, params))
    if trace.capture is not None:
        trace.capture.record(prim, args, params, ans)
    if trace.active_tapes:  # recording never changes these lists, so no copies
        for tape in trace.active_tapes:
            tape._record_primitive(prim, args, params, ans)
    if trace.active_accumulators:
        for accumulator in trace.active_accumulators:
            accumulator._propagate(prim, args, params, ans)
    return ans


def _apply(prim: Primitive, args: tuple[Tensor, ...], params: dict) -> Any:
    """The primitive's forward on the arguments' arrays."""
    impl = impl_rules[prim]
    first = args[0].value
    xp = np if type(first) is np.ndarray else backend.array_module(first)
    try:
        # one and two operands spelled out: no list of values for the common ops
        if len(args) == 1:
            out = impl(xp, first, **params)
        elif len(args) == 2:
            out = impl(xp, first, args[1].value, **params)
        else:
            out = impl(xp, *[a.value for a in args], **params)
    except ValueError as exc:
        if type(exc) is not ValueError:  # LinAlgError and friends keep their type
            raise
        raise _operand_error(prim, args, exc) from None
    if type(out) is not np.ndarray and isinstance(out, np.generic):
        out = np.asarray(out)  # NumPy returns scalars from 0-d operations
    return out


def _operand_error(prim: Primitive, args: tuple[Tensor, ...], exc: ValueError) -> ValueError:
    """NumPy's broadcasting message, with the op's name and the operands' shapes on it."""
    shapes = " and ".join(str(a.value.shape) for a in args)
    return ValueError(f"{prim.name}: {exc} (operand shapes {shapes})")


def _bind_deferred(prim: Primitive, args: tuple[Tensor, ...], params: dict) -> Tensor:
    """bind, with the forward left for when the result is read. The recorders run as in
    bind, not deferring: a tangent is wanted, not left for later."""
    shape = DEFERRED_SHAPES[prim](*args, **params)
    ans = DeferredTensor(lambda: _apply(prim, args, params), shape, args[0].dtype)
    trace.defer_primal = False
    try:
        if trace.capture is not None:
            trace.capture.record(prim, args, params, ans)
        for tape in trace.active_tapes:
            tape._record_primitive(prim, args, params, ans)
        for accumulator in trace.active_accumulators:
            accumulator._propagate(prim, args, params, ans)
    finally:
        trace.defer_primal = True
    return ans
