"""The one module that imports NumPy and CuPy.

Everything else asks this module for the array module (`xp`) that fits an array or a
device string, and for transfers between host and device. CuPy is imported lazily, the
first time a CUDA device is asked for, so a CPU-only install never pays for it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from engine.kernels import scatter as scatter_kernel

numpy = np
# NumPy for host-side bookkeeping (dtypes, shapes, index arithmetic) in modules that must
# not pick an array module themselves; never applied to device arrays.
host = np
ndarray_types: tuple[type, ...] = (np.ndarray,)

_cupy: Any = None
_cupy_error: BaseException | None = None

DEFAULT_FLOAT = np.dtype(np.float32)


class DeviceError(RuntimeError):
    """A device was asked for that this machine does not have."""


def _load_cupy() -> Any:
    """Import CuPy once and check that a GPU answers; remember why when it does not."""
    global _cupy, _cupy_error, ndarray_types
    if _cupy is None and _cupy_error is None:
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001  ImportError, CUDARuntimeError, missing driver...
            _cupy_error = exc
        else:
            _cupy = cupy
            ndarray_types = (np.ndarray, cupy.ndarray)
    return _cupy


def gpu_loaded() -> bool:
    """True once CuPy has been imported here (device checks are free until then)."""
    return _cupy is not None


def cuda_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    return _load_cupy() is not None


def parse_device(device: str | None) -> tuple[str, int]:
    """'cpu' -> ('cpu', 0); 'cuda' / 'gpu' -> ('cuda', 0); 'cuda:N' -> ('cuda', N)."""
    if device is None:
        return ("cpu", 0)
    return _parse_device(str(device))


@functools.lru_cache(maxsize=64)
def _parse_device(device: str) -> tuple[str, int]:
    # cached: every tensor a request makes on a named device asks (a regex each time)
    match = re.fullmatch(r"(cpu|cuda|gpu)(?::(\d+))?", device.strip().lower())
    if match is None:
        raise DeviceError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    kind = "cuda" if match.group(1) == "gpu" else match.group(1)
    return (kind, int(match.group(2) or 0))


def xp_for_device(device: str | None) -> Any:
    """The array module for a device string, with a clear error when CUDA is absent."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return np
    cupy = _load_cupy()
    if cupy is None:
        raise DeviceError(
            f"device {device!r} needs CuPy and an NVIDIA GPU, which are not available here "
            f"({type(_cupy_error).__name__}: {_cupy_error}); install gradtape[cuda12] or "
            "gradtape[cuda13] on a CUDA host, or use device='cpu'"
        )
    count = cupy.cuda.runtime.getDeviceCount()
    if index >= count:
        raise DeviceError(f"device {device!r} does not exist: this host has {count} GPU(s)")
    return cupy


def array_module(array: Any) -> Any:
    """NumPy or CuPy, whichever owns `array` (NumPy whenever CuPy was never loaded)."""
    if _cupy is None or isinstance(array, np.ndarray):
        return np
    return _cupy.get_array_module(array)


def device_of(array: Any) -> str:
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return f"cuda:{array.device.id}"
    return "cpu"


def is_array(value: Any) -> bool:
    return isinstance(value, ndarray_types)


def asarray(value: Any, dtype: Any = None, device: str | None = None) -> Any:
    """An array on `device` (default: where `value` already lives, else the CPU)."""
    if device is None:
        xp = array_module(value) if is_array(value) else np
        return xp.asarray(value, dtype=dtype)
    xp = xp_for_device(device)
    if xp is np:
        return np.asarray(to_host(value), dtype=dtype)
    with xp.cuda.Device(parse_device(device)[1]):
        return xp.asarray(value, dtype=dtype)


def to_host(array: Any) -> np.ndarray:
    """A NumPy copy of a device array (NumPy arrays pass through)."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy.asnumpy(array)
    return np.asarray(array)


def scatter_add(xp: Any, out: Any, index: tuple, values: Any) -> None:
    """out[index] += values, accumulating over repeated integer indices."""
    if xp is np:
        if not _scatter_rows(out, index, values):
            np.add.at(out, index, values)
    else:
        xp.add.at(out, index, values)  # (CuPy's ufunc.at; cupyx.scatter_add is deprecated)


def _scatter_rows(out: np.ndarray, index: tuple, values: np.ndarray) -> bool:
    """out[index] += values for an index that picks along one axis with one integer
    array, every other axis whole (an embedding's gradient: rows of a table), as sums of
    the sorted rows' groups (np.add.reduceat): 5x faster than np.add.at, which adds one
    row at a time. False (nothing done) for any other index, or indices out of range
    (np.add.at raises for those)."""
    whole = slice(None)
    items = index[1:] if index and index[0] is Ellipsis else index
    arrays = [p for p, item in enumerate(items) if isinstance(item, np.ndarray)]
    if len(arrays) != 1 or values.size == 0 or values.dtype.kind not in "fciu":
        return False
    if any(not isinstance(item, np.ndarray) and item != whole for item in items):
        return False  # (an Ellipsis past the first, an integer, a strided slice)
    picks = items[arrays[0]]
    if picks.dtype.kind not in "iu":
        return False
    axis = out.ndim - len(items) + arrays[0]
    if axis == 0:  # rows of a table: a compiled loop (engine/kernels/scatter.py), same sums
        done = scatter_kernel.add_rows(picks, values, out)
        if done is not None:
            return done
    size = out.shape[axis]
    flat = picks.reshape(-1)
    flat = np.where(flat < 0, flat + size, flat) if picks.dtype.kind == "i" else flat
    order = np.argsort(flat, kind="stable")  # stable: each group sums in index order
    rows = flat[order]
    if rows[0] < 0 or rows[-1] >= size:
        return False
    starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    # values: out's axes before `axis`, picks' axes, out's axes after it -> (picks, rest)
    moved = np.moveaxis(values, list(range(axis, axis + picks.ndim)), list(range(picks.ndim)))
    grouped = np.add.reduceat(moved.reshape((flat.size, -1))[order], starts, axis=0)
    target = np.moveaxis(out, axis, 0)  # a view: the sums land in out
    target[rows[starts]] += grouped.reshape((starts.size,) + target.shape[1:])
    return True


def random_generator(seed: int | None, device: str | None = None) -> Any:
    """A seeded generator of the device's array module (NumPy's PCG64 or CuPy's)."""
    xp = xp_for_device(device)
    return xp.random.default_rng(seed)


def erf(xp: Any, x: Any) -> Any:
    """The error function on NumPy or CuPy arrays. NumPy float32: `erf_float32` (SciPy's
    float32 loop computes in double, element by element: 3x slower); other NumPy dtypes:
    SciPy's when installed (NumPy has none, so without SciPy the standard library's,
    element by element). CuPy: cupyx's (one fused kernel; CUDA's erff is within 2 ulp)."""
    if xp is not np:
        from cupyx.scipy.special import erf as cupy_erf

        return cupy_erf(x)
    if x.dtype == np.float32:
        return erf_float32(np, x)
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:
        import math

        return np.vectorize(math.erf, otypes=[x.dtype])(x).astype(x.dtype, copy=False)
    return np.asarray(scipy_erf(x), dtype=x.dtype)


# erf(x) = x P(x^2) / Q(x^2) on |x| <= 4 (beyond, float32's erf is +-1: 1 - erf(3.92) is
# below half an ulp of 1), P of degree 6, Q monic of degree 5: a minimax rational in
# relative error, fitted with NumPy (bench/erf32.py refits and checks it; its relative
# error is 2.03e-9 on [0, 4], a thirtieth of a float32 ulp). It is evaluated in float64:
# a float32 input's square is exact there, and the rounding to float32 at the end is
# the only error that counts, so the result is within 0.534 ulp of erf (measured over
# every float32: bench/erf32.py). The form is odd, so erf(-x) = -erf(x) exactly.
_ERF_P = (  # P's coefficients from t^0 up
    17879.449918622027,
    2934.5919228229263,
    860.6648790236565,
    60.9980508133799,
    6.014986486270723,
    0.07423116260725267,
    -0.00020919107566610734,
)
_ERF_Q = (
    15845.24989811159,
    7882.4656190258065,
    1805.6996191802834,
    245.00062865199556,
    20.718755556246933,
)
_ERF_CLAMP = 4.0
# Elements per float64 block: the four scratch blocks (1 MiB) stay in the L2 cache (the
# whole array's float64 temporaries would not: 3.5x slower on a 262,144-element GELU
# input; blocks of 16,384 or 65,536 measured 13% slower).
_ERF_BLOCK = 32768


def erf_float32(xp: Any, x: Any) -> Any:
    """erf of a float32 array (NumPy or CuPy) as float32, within 0.534 ulp (see above);
    NaN stays NaN, +-inf gives +-1."""
    flat = xp.ascontiguousarray(x).reshape(-1)
    out = xp.empty(flat.shape, xp.float32)
    n = flat.size
    block = min(n, _ERF_BLOCK) if xp is np else n
    if block == 0:
        return out.reshape(x.shape)
    z, t, num, den = (xp.empty(block, xp.float64) for _ in range(4))
    mul, add = xp.multiply, xp.add
    with np.errstate(invalid="ignore"):  # (NaN inputs: clip's comparisons warn)
        for start in range(0, n, block):
            stop = min(start + block, n)
            if stop - start != block:  # the last, shorter block
                z, t, num, den = (a[: stop - start] for a in (z, t, num, den))
            xp.clip(flat[start:stop], -_ERF_CLAMP, _ERF_CLAMP, out=z)  # (CuPy: no casting=)
            mul(z, z, out=t)  # exact: a float32's square fits a float64
            mul(t, _ERF_P[6], out=num)
            add(num, _ERF_P[5], out=num)
            for c in _ERF_P[4::-1]:
                mul(num, t, out=num)
                add(num, c, out=num)
            add(t, _ERF_Q[4], out=den)
            for c in _ERF_Q[3::-1]:
                mul(den, t, out=den)
                add(den, c, out=den)
            mul(num, z, out=num)
            xp.divide(num, den, out=out[start:stop])  # float64 -> float32: same_kind, the default
    return out.reshape(x.shape)
