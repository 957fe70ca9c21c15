"""check_grads: derivatives against central finite differences, in random directions.

As JAX's `check_grads` and autograd's `check_grads`: for random tangent v and cotangent
u, compare J v from forward mode and <u, J v> from reverse mode with the central
difference (f(x + eps v) - f(x - eps v)) / 2 eps; for order 2, do the same to the
derivative functions themselves. Use float64 inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine import trace
from engine.tensor import Tensor, constant
from engine.transforms import jvp, vjp


def _np(t: Any) -> np.ndarray:
    return np.asarray(t.numpy() if isinstance(t, Tensor) else t, dtype=np.float64)


def _random_like(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return rng.standard_normal(x.shape)


def _numerical_jvp(
    f: Callable[..., Any], args: list[np.ndarray], v: list[np.ndarray], eps: float
) -> np.ndarray:
    plus = f(*[constant(a + eps * d) for a, d in zip(args, v, strict=True)])
    minus = f(*[constant(a - eps * d) for a, d in zip(args, v, strict=True)])
    return (_np(plus) - _np(minus)) / (2 * eps)


def _close(a: np.ndarray, b: np.ndarray, atol: float, rtol: float, what: str) -> None:
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=what)


def _inputs(args: Sequence[np.ndarray], seed: int) -> tuple[np.random.Generator, list, list]:
    """float64 copies of args, a seeded generator, and one random direction per arg."""
    rng = np.random.default_rng(seed)
    args = [np.asarray(a, np.float64) for a in args]
    return rng, args, [_random_like(rng, a) for a in args]


def check_jvp(
    f: Callable[..., Any],
    args: Sequence[np.ndarray],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    _, args, v = _inputs(args, seed)
    _, tangent = jvp(f, [constant(a) for a in args], [constant(d) for d in v])
    _close(_np(tangent), _numerical_jvp(f, args, v, eps), atol, rtol, "forward mode (JVP)")


def check_vjp(
    f: Callable[..., Any],
    args: Sequence[np.ndarray],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    rng, args, v = _inputs(args, seed)
    out, vjp_fn = vjp(f, *[constant(a) for a in args])
    u = rng.standard_normal(out.shape)
    cts = vjp_fn(constant(u))
    reverse = sum(float(np.sum(_np(c) * d)) for c, d in zip(cts, v, strict=True))
    numeric = float(np.sum(u * _numerical_jvp(f, args, v, eps)))
    _close(np.array(reverse), np.array(numeric), atol, rtol, "reverse mode (VJP)")


def check_grads(
    f: Callable[..., Any],
    args: Sequence[np.ndarray],
    order: int = 1,
    modes: Sequence[str] = ("fwd", "rev"),
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    """Check f's derivatives up to `order` in the given modes against finite differences."""
    args = [np.asarray(a, np.float64) for a in args]
    tol: dict[str, Any] = {"eps": eps, "atol": atol, "rtol": rtol, "seed": seed}
    if "fwd" in modes:
        check_jvp(f, args, **tol)
    if "rev" in modes:
        check_vjp(f, args, **tol)
    if order <= 1:
        return
    rng = np.random.default_rng(seed + 1)
    if "rev" in modes:
        out = f(*[constant(a) for a in args])
        u = constant(rng.standard_normal(out.shape))

        def f_vjp(*xs: Tensor) -> Tensor:
            _, pullback = vjp(f, *xs)
            cts = pullback(u)
            return _concat_flat(cts)

        check_grads(f_vjp, args, order - 1, modes, **tol)
    if "fwd" in modes:
        v = [constant(rng.standard_normal(a.shape)) for a in args]

        def f_jvp(*xs: Tensor) -> Tensor:
            return jvp(f, xs, v)[1]

        check_grads(f_jvp, args, order - 1, modes, **tol)


def _concat_flat(tensors: Sequence[Tensor]) -> Tensor:
    from engine.ops.shape import concatenate, reshape

    return concatenate([reshape(t, (-1,)) for t in tensors], axis=0)


class _BindRecorder:
    """A capture that only notes the primitives bound (what bind reports to one)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def record(self, prim: Any, args: Any, params: Any, ans: Any) -> None:
        self.seen.append(prim.name)

    def constant(self, t: Any) -> None:
        pass

    def alias(self, t: Any, of: Any) -> None:
        pass

    def host_read(self, t: Any) -> None:
        pass


def bound_primitives(fn: Callable[[], Any]) -> list[str]:
    """The names of the primitives fn() binds, in order: which ops a function is made of
    (a fused primitive taken, or its composite)."""
    recorder = _BindRecorder()
    saved, trace.capture = trace.capture, recorder
    try:
        fn()
    finally:
        trace.capture = saved
    return recorder.seen
