"""Constant tensors: zeros, ones, eye, linspace, arange, full, and seeded random ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import backend
from engine.backend import host
from engine.tensor import Tensor, as_tensor, pass_constant

Shape = int | Sequence[int]


def _shape(shape: Shape) -> tuple[int, ...]:
    out = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def zeros(shape: Shape, dtype: Any = "float32", device: str | None = None) -> Tensor:
    """A tensor of zeros."""
    return pass_constant(
        backend.xp_for_device(device).zeros(_shape(shape), dtype=host.dtype(dtype))
    )


def ones(shape: Shape, dtype: Any = "float32", device: str | None = None) -> Tensor:
    """A tensor of ones."""
    return pass_constant(backend.xp_for_device(device).ones(_shape(shape), dtype=host.dtype(dtype)))


def full(shape: Shape, value: float, dtype: Any = "float32", device: str | None = None) -> Tensor:
    """A tensor filled with `value`."""
    xp = backend.xp_for_device(device)
    return pass_constant(xp.full(_shape(shape), value, dtype=host.dtype(dtype)))


def zeros_like(x: Any) -> Tensor:
    """Zeros with x's shape, dtype and device."""
    x = as_tensor(x)
    return pass_constant(backend.array_module(x.value).zeros_like(x.value))


def ones_like(x: Any) -> Tensor:
    """Ones with x's shape, dtype and device."""
    x = as_tensor(x)
    return pass_constant(backend.array_module(x.value).ones_like(x.value))


def eye(n: int, m: int | None = None, dtype: Any = "float32", device: str | None = None) -> Tensor:
    """The identity matrix (n, m)."""
    return pass_constant(backend.xp_for_device(device).eye(n, m, dtype=host.dtype(dtype)))


def linspace(
    start: float, stop: float, num: int = 50, dtype: Any = "float32", device: str | None = None
) -> Tensor:
    """`num` evenly spaced values from start to stop, inclusive."""
    xp = backend.xp_for_device(device)
    return pass_constant(xp.linspace(start, stop, num, dtype=host.dtype(dtype)))


def arange(
    start: float,
    stop: float | None = None,
    step: float = 1,
    dtype: Any = None,
    device: str | None = None,
) -> Tensor:
    """Evenly spaced values in [start, stop) (int32 for int arguments, else float32)."""
    if dtype is None:
        ints = all(isinstance(v, int) for v in (start, stop if stop is not None else 0, step))
        dtype = "int32" if ints else "float32"
    xp = backend.xp_for_device(device)
    args = (start,) if stop is None else (start, stop)
    return pass_constant(xp.arange(*args, step, dtype=host.dtype(dtype)))


def random_normal(
    shape: Shape,
    seed: int | None = None,
    mean: float = 0.0,
    stddev: float = 1.0,
    dtype: Any = "float32",
    device: str | None = None,
) -> Tensor:
    """Normal samples; the same seed gives the same numbers on the same backend."""
    rng = backend.random_generator(seed, device)
    sample = rng.standard_normal(_shape(shape), dtype=host.float64) * stddev + mean
    return Tensor(sample.astype(host.dtype(dtype)))


def random_uniform(
    shape: Shape,
    seed: int | None = None,
    minval: float = 0.0,
    maxval: float = 1.0,
    dtype: Any = "float32",
    device: str | None = None,
) -> Tensor:
    """Uniform samples in [minval, maxval); seeded like random_normal."""
    rng = backend.random_generator(seed, device)
    sample = rng.random(_shape(shape), dtype=host.float64) * (maxval - minval) + minval
    return Tensor(sample.astype(host.dtype(dtype)))
