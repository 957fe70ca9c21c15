"""Compiled CPU kernels: one pass over memory where NumPy would take several.

NumPy runs a fused expression (GELU's erf, a convolution's window gather) as one call per
operation, each a full pass over memory; at the sizes of real models those passes, not
the arithmetic, are what stands between the engine and PyTorch's fused kernels (issue
28, bench/RESULTS.md). A kernel here is the same computation written as one loop and
compiled by numba, used on the host (NumPy arrays) when numba is installed (the
`kernels` extra, part of `service`) and not switched off; CuPy arrays never reach one.

Every kernel has a NumPy implementation beside its call site, which is the reference:
the tests run both on the same inputs and compare them (bit for bit where the kernel
evaluates the same operations in the same order). So numba is optional: without it,
or with GRADTAPE_KERNELS=numpy in the environment (read once, at the first use), the
engine runs its NumPy paths, only slower, and answers the same numbers: to the bit
where a kernel keeps the NumPy path's operations and order (erf, GELU, the convolution
windows, layer norm's steps), to the rounding each kernel's module states where it does
not (softmax and GELU's slope in float32 round once instead of several times: closer to
the exact value; the embedding's scatter adds in np.add.at's order; the stride-1 3 x 3
convolutions by Winograd's algorithm, winograd.py, in the windows' GEMM's error class).

    @kernel
    def gelu_forward(x, out):  # plain Python over arrays, numba's nopython subset
        ...

    compiled = gelu_forward.compiled()  # the compiled loop, or None: use NumPy
    if compiled is not None:
        compiled(x, out)

Compilation is lazy (the first call of a kernel with new argument types compiles it,
~0.1-0.7 s) and cached on disk by numba (`__pycache__` beside this package, or numba's
per-user cache directory when that is not writable; NUMBA_CACHE_DIR overrides both), so
a worker process compiles only what earlier processes have not. numba itself is imported
at the first use, not by `import engine` (it takes ~0.4 s).

The options every kernel shares: `nogil` (a kernel running in one of the service's
threads does not hold the others), no `fastmath` (it would let LLVM reorder and
contract the arithmetic, and assume no NaN or inf: the answers would change), and
`error_model="numpy"` (a division by zero gives inf or NaN, as NumPy's, rather than an
exception). A kernel not bound to a NumPy path's bits may ask for contraction alone
(`@kernel(contract=True)`: a product and a sum as one FMA, one rounding instead of two,
never less accurate): GELU's float32 slope and softmax, whose exp polynomial then runs
12-15% faster.

A piece of arithmetic several kernels share (erf's rational, an exp, a window's column
range) is a helper, which kernels call as a function:

    @helper
    def erf_rational(z):  # numba's nopython subset, scalars in and out
        ...

When a kernel is compiled, each helper it names (and each helper those name) is compiled
by numba with the kernels' options and inlined into the kernel's code (numba's
inline="always"), so the loops vectorize as if it were written out (bench/RESULTS.md,
"Kernel helpers"); called from Python, a helper is its plain function. Declaring one
imports nothing.

numba's disk cache knows only the kernel's own file (its index is stamped with that
file's modification time and size; numba's documentation: "Cache invalidation fails to
recognize changes in functions defined in a different file", numba issue 1833), while a
helper's code and the constants it reads are compiled into every kernel that calls it.
So every kernel keys its cached code also by a digest of the files of the helpers it
calls from other files and of its compile options (`_keyed_cache`; the options live
in this file): a changed helper file or option compiles the kernel anew instead of
serving stale code (tests/engine/test_kernels.py checks both). A kernel
module imports only the loader and helpers (never constants) from the engine.

Warm-up (engine/kernels/warmup.py): each kernel declares the argument types its call
sites pass (`Kernel.declare`), so they can all be compiled, or loaded from numba's
cache, ahead of use (`gradtape kernels warm`, the Docker build, a worker's start). A
kernel warmed so answers only those signatures (numba's compilation is then off for
it: a writable array converts to a declared read-only one, so one signature serves
both), and a process that asked `hold_until_warm()` (a service worker) gets None from
`compiled()`, the NumPy path, until warm-up has readied the kernel: no request of it
pays a compilation. A kernel not bound to its NumPy path's bits (`exact=False`) is
instead readied with its module by its first caller (loaded, or compiled where the cache
lacks it), so a worker's answers never depend on when warm-up ends.
"""

from __future__ import annotations

import hashlib
import os
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: The environment variable: "numpy" (or "off", "0") runs the NumPy paths only; anything
#: else, or unset, uses numba when it imports.
SWITCH = "GRADTAPE_KERNELS"

_lock = threading.Lock()
# Notified when kernels are released or warm-up has ended (settle()): what a held
# kernel that is not bound to NumPy's bits waits on where it could not be readied on
# demand (Kernel.compiled, _ready_now).
_changed = threading.Condition(_lock)
_settled = False
_numba: Any = None  # the module, once imported; False when unavailable or switched off
# Every kernel declared (by @kernel), in the order of declaration: what warm-up walks.
DECLARED: list[Kernel] = []
# hold_until_warm() was called: compiled() answers None for a kernel until released, which
# warm-up does for all the kernels of a module at once (one rebinding of this set: a
# caller using two kernels of a module, as a convolution's gather and col2im, never
# sees one released and not the other).
_held = False
_released: frozenset[Kernel] = frozenset()
# How many times release() has widened _released: a compiled replay captured before the
# last release chose the NumPy forms of kernels then held, and captures anew (releases()).
_releases = 0


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("numpy", "off", "0", "false", "no")


def numba_module() -> Any:
    """numba, or None when it is not installed or GRADTAPE_KERNELS switches it off."""
    global _numba
    if _numba is None:
        with _lock:
            if _numba is None:
                if _switched_off():
                    _numba = False
                else:
                    try:
                        import numba
                    except ImportError:
                        _numba = False
                    else:
                        _numba = numba
    return _numba or None


def enabled() -> bool:
    """Whether kernels run (numba imports and is not switched off)."""
    return numba_module() is not None


class Kernel:
    """A Python function compiled by numba at its first use (see the module's text)."""

    def __init__(
        self, py_func: Callable[..., Any], contract: bool = False, exact: bool | None = None
    ) -> None:
        self.py_func = py_func
        self.contract = contract
        # Whether it answers its NumPy path's bits (a contracting kernel never does).
        self.exact = not contract if exact is None else exact
        self.__name__ = py_func.__name__
        self.__doc__ = py_func.__doc__
        self.dispatcher: Any = None  # numba's, once compiled() has made it
        # The argument types of its call sites (declare()), and whether warm-up has
        # compiled or loaded them all (engine/kernels/warmup.py).
        self.signatures: list[tuple[Arg, ...]] = []
        self.warmed = False
        DECLARED.append(self)

    def declare(self, *signatures: tuple[Arg, ...]) -> None:
        """The argument types the call sites pass, for warm-up: one tuple of In, Out and
        Ints per signature."""
        self.signatures.extend(signatures)

    def mark_warmed(self) -> None:
        """Every declared signature is compiled or loaded (warm-up's, or a first caller's,
        _ready_now): numba's compilation off, so a call of other types compiles once and
        says so (_call)."""
        if self.signatures and not self.warmed:
            self.dispatcher.disable_compile()
            self.warmed = True

    def compiled(self) -> Callable[..., Any] | None:
        """The compiled kernel (call it as the Python function), or None when kernels
        do not run (or, in a process that holds kernels until warm, not yet warmed)."""
        if _held and self not in _released:
            if self.exact:
                return None  # the NumPy path, to the bit the same answers
            # A kernel whose bits differ from its NumPy path's (exact=False; the test
            # suite checks which these are): its module readied now, in this thread,
            # rather than answering other bits until warm-up ends, keeps a worker's
            # answers the same whatever moment the request came (review r12); readied
            # rather than waited for, the request pays at most its module's loads or
            # compilations, not the whole warm-up's (review r13: 23 s on a cold cache).
            if not _ready_now(self):
                return None  # warm-up ended without it (failed): the NumPy path from now on
        if self.dispatcher is None:
            if self.make_dispatcher() is None:
                return None
        return self._call

    def make_dispatcher(self) -> Any:
        """numba's dispatcher of this kernel (made once), or None when kernels do not run."""
        if self.dispatcher is None:
            numba = numba_module()
            if numba is None:
                return None
            with _lock:
                if self.dispatcher is None:
                    self.dispatcher = _jit(numba, self.py_func, contract=self.contract)
        return self.dispatcher

    def _call(self, *args: Any) -> Any:
        try:
            return self.dispatcher(*args)
        except TypeError:
            if not self.warmed:
                raise
            # Warmed (compilation off) and called with types no declaration covers: a
            # declaration is missing. Compile this once, as before warm-up, and say so.
            import logging

            logging.getLogger("gradtape.kernels").warning(
                "kernel %s compiled for undeclared argument types (%s): declare them",
                self.__name__,
                ", ".join(str(numba_module().typeof(a)) for a in args),
            )
            with _lock:
                self.dispatcher.disable_compile(False)
                try:
                    return self.dispatcher(*args)
                finally:
                    self.dispatcher.disable_compile(True)
        except OSError:
            # A compiled loop does no I/O: this is numba's disk cache, which it opens at
            # every compilation, gone bad since the kernel was declared (the volume full,
            # removed, remounted read-only). Compile without it from now on.
            with _lock:
                self.dispatcher = _jit(_numba, self.py_func, cache=False, contract=self.contract)
            return self.dispatcher(*args)

    def __repr__(self) -> str:
        return f"<kernel {self.__name__}>"


def kernel(
    py_func: Callable[..., Any] | None = None, *, contract: bool = False, exact: bool | None = None
) -> Any:
    """Declare a kernel (a decorator, `@kernel` or `@kernel(contract=True)`); compiled()
    gives the callable. contract: LLVM may fuse a product and a sum into one FMA (one
    rounding instead of two: never less accurate), for a kernel that is not bound to a
    NumPy path's bits (GELU's float32 slope, softmax: their exp's polynomial runs 15%
    faster); nothing else of fastmath. exact: whether the kernel answers its NumPy
    path's bits (by default, unless it contracts); a held kernel that does not is
    readied (with its module) by its first caller (Kernel.compiled)."""
    if py_func is None:
        return lambda f: Kernel(f, contract, exact)
    return Kernel(py_func, contract, exact)


def release(kernels: Iterable[Kernel]) -> None:
    """Let compiled() hand out these warmed kernels in a process that holds them, all at
    once (warm-up's call, a module's kernels together)."""
    global _released, _releases
    with _changed:
        widened = _released | frozenset(kernels)
        if _held and widened != _released:  # (else compiled() answered them all along)
            _releases += 1
        _released = widened
        _changed.notify_all()


def releases() -> int:
    """How many times release() has handed out more kernels in this process: a value
    kept beside something chosen by compiled()'s answers (a compiled replay's forms)
    tells whether a later choice could differ."""
    return _releases


# One thread readies a held kernel's module at a time (_ready_now); taken before _lock.
_readying = threading.Lock()


def _ready_now(k: Kernel) -> bool:
    """Load or compile the declared signatures of held kernel k's module in the calling
    thread and release them (True), as warm-up would; False where warm-up has ended
    without them (settle()) or kernels do not run: the NumPy path from then on. Where
    readying fails, waits for warm-up to release or settle instead."""
    with _readying:
        if k in _released:
            return True
        numba = numba_module()
        if _settled or numba is None:
            return False
        group = [d for d in DECLARED if d.py_func.__module__ == k.py_func.__module__]
        try:
            for d in group:
                dispatcher = d.make_dispatcher()
                for declared_args in d.signatures:
                    sig = numba_signature(numba, declared_args)
                    if sig not in dispatcher.overloads:
                        dispatcher.compile(sig)  # (numba's disk cache first)
        except Exception:  # (warm-up's own pass decides: a broken cache, say)
            import logging

            logging.getLogger("gradtape.kernels").warning(
                "kernel %s could not be readied on demand; waiting for warm-up",
                k.__name__,
                exc_info=True,
            )
        else:
            for d in group:
                d.mark_warmed()
            release(group)
            return True
    with _changed:
        _changed.wait_for(lambda: k in _released or _settled)
    return k in _released


def settle() -> None:
    """Warm-up has ended (readied, or failed): a held kernel still not released runs its
    NumPy path from now on, and nothing waits for it."""
    global _settled
    with _changed:
        _settled = True
        _changed.notify_all()


def hold_until_warm() -> None:
    """From now on compiled() answers None (the NumPy path) for a kernel until warm-up
    (engine/kernels/warmup.py) has compiled or loaded its declared signatures: for a
    process whose requests must never wait for a compilation (a service worker)."""
    global _held
    _held = True


# ---- the argument types a kernel declares (Kernel.declare), for warm-up ----


@dataclass(frozen=True)
class In:
    """A C-contiguous array the kernel only reads (declared read-only: a writable array
    converts to it, so one compiled signature takes both)."""

    dtype: str
    ndim: int


@dataclass(frozen=True)
class Out:
    """A C-contiguous array the kernel writes (or reads and writes)."""

    dtype: str
    ndim: int


@dataclass(frozen=True)
class Ints:
    """A tuple of `count` Python integers (numba's int64)."""

    count: int


Arg = In | Out | Ints


def numba_signature(numba: Any, args: tuple[Arg, ...]) -> tuple[Any, ...]:
    """A declared signature as numba's argument types."""
    nt = numba.types

    def one(arg: Arg) -> Any:
        if isinstance(arg, Ints):
            return nt.UniTuple(nt.int64, arg.count)
        dtype = getattr(nt, arg.dtype)
        return nt.Array(dtype, arg.ndim, "C", readonly=isinstance(arg, In))

    return tuple(one(a) for a in args)


class Helper:
    """A function kernels call: compiled into them when kernels run, else plain Python
    (see the module's text)."""

    def __init__(self, py_func: Callable[..., Any]) -> None:
        self.py_func = py_func
        self.__name__ = py_func.__name__
        self.__doc__ = py_func.__doc__
        self.dispatcher: Any = None  # numba's, made when a kernel calling it compiles

    def __call__(self, *args: Any) -> Any:
        return self.py_func(*args)

    def __repr__(self) -> str:
        return f"<kernel helper {self.__name__}>"


def helper(py_func: Callable[..., Any]) -> Helper:
    """Declare a helper that kernels call (a decorator)."""
    return Helper(py_func)


_OPTIONS = {"nopython": True, "nogil": True, "fastmath": False, "error_model": "numpy"}


def _helpers_named(py_func: Callable[..., Any]) -> dict[str, Helper]:
    """The helpers py_func's code reads from its module's globals, by name."""
    found = {}
    for name in py_func.__code__.co_names:
        value = py_func.__globals__.get(name)
        if isinstance(value, Helper):
            found[name] = value
    return found


def _with_compiled_helpers(numba: Any, py_func: Callable[..., Any]) -> Callable[..., Any]:
    """py_func itself, or where it calls helpers, the same code over a copy of its globals
    in which each helper is its numba dispatcher (compiled with the kernel that calls
    it). The copy keeps the code object, so numba's cache finds the same file, name and
    line; the module's own globals keep the helpers for Python callers."""
    helpers = _helpers_named(py_func)
    if not helpers:
        return py_func
    scope = dict(py_func.__globals__)
    for name, used in helpers.items():
        if used.dispatcher is None:
            # Inlined by numba into each caller's code before LLVM sees it: a call left to
            # LLVM's inliner ran the erf loop 10% slower.
            resolved = _with_compiled_helpers(numba, used.py_func)
            used.dispatcher = numba.jit(inline="always", **_OPTIONS)(resolved)
        scope[name] = used.dispatcher
    func = types.FunctionType(
        py_func.__code__, scope, py_func.__name__, py_func.__defaults__, py_func.__closure__
    )
    func.__qualname__ = py_func.__qualname__
    func.__doc__ = py_func.__doc__
    return func


def _foreign_helper_files(py_func: Callable[..., Any]) -> list[str]:
    """The files, other than py_func's own, that define helpers it reaches."""
    own = py_func.__code__.co_filename
    files: set[str] = set()
    seen: set[int] = set()
    pending = list(_helpers_named(py_func).values())
    while pending:
        used = pending.pop()
        if id(used) in seen:
            continue
        seen.add(id(used))
        files.add(used.py_func.__code__.co_filename)
        pending += _helpers_named(used.py_func).values()
    return sorted(files - {own})


def _jit(
    numba: Any, py_func: Callable[..., Any], cache: bool = True, contract: bool = False
) -> Any:
    func = _with_compiled_helpers(numba, py_func)
    # (helpers are inlined into the kernel's code, so they take its flags)
    options = {**_OPTIONS, "fastmath": {"contract"}} if contract else _OPTIONS
    if cache:
        try:
            dispatcher = numba.jit(cache=True, **options)(func)
            files = _foreign_helper_files(py_func)
            dispatcher._cache = _keyed_cache(func, files, options)
            return dispatcher
        except (RuntimeError, OSError):
            # numba found no writable cache directory (a read-only install, no home), or
            # a helper's file could not be read for the key
            pass
        except (ImportError, AttributeError, TypeError):
            # numba's cache classes are not what _keyed_cache subclasses (a numba release
            # after the one this was written for): uncached rather than maybe stale
            pass
    # Compiled in each process instead of once.
    return numba.jit(cache=False, **options)(func)


def _keyed_cache(func: Callable[..., Any], files: list[str], options: dict[str, Any]) -> Any:
    """numba's cache for func, its entries keyed also by the contents of `files` and by
    the compile options (see the module's text: numba's own key knows only func's file
    and code; the options live in this file, so a change of them would otherwise be
    served the code compiled under the old ones)."""
    from numba.core.caching import FunctionCache

    digest = hashlib.sha256(repr(sorted(options.items())).encode())
    for path in files:
        with open(path, "rb") as source:
            digest.update(hashlib.sha256(source.read()).digest())
    extra = digest.hexdigest()

    class _KeyedCache(FunctionCache):
        def _index_key(self, *args: Any, **kwargs: Any) -> Any:
            return (super()._index_key(*args, **kwargs), extra)

    return _KeyedCache(func)
