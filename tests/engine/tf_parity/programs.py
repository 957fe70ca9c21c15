"""The TensorFlow-parity programs, written once against TensorFlow's names.

Each program takes a namespace `m` (TensorFlow itself in record.py, the engine behind
the same names in test_tf_parity.py) and float64 NumPy inputs, and returns a structure
of tensors (or None, numbers, strings). record.py runs them under TensorFlow 2.21 and
stores the answers in reference.json; the test runs them on the engine and compares.
The namespace doubles as a porting table: `m.reduce_sum` is `tf.reduce_sum` on one
side and `gt.sum` on the other.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np

RNG = np.random.default_rng(19)
X3 = np.array([-1.0, 0.5, 2.0])
V3 = np.array([0.3, -0.7, 1.1])
M34 = RNG.standard_normal((3, 4))
W34 = RNG.standard_normal((3, 4))
POS34 = RNG.uniform(0.5, 2.0, (3, 4))
W47 = RNG.standard_normal((4, 7))

Pair = collections.namedtuple("Pair", ["a", "b"])

PROGRAMS: dict[str, tuple[str, Callable[..., Any], tuple[np.ndarray, ...]]] = {}


def program(item: str, *inputs: np.ndarray) -> Callable[[Callable[..., Any]], Any]:
    """Register a program under its function name, with the issue item it checks."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        PROGRAMS[fn.__name__] = (item, fn, tuple(np.asarray(i, np.float64) for i in inputs))
        return fn

    return register


def orders(m: Any, f: Callable[..., Any], xs: list, v: list | None = None) -> dict:
    """Value, gradient and Hessian-vector product of a scalar f by nested tapes."""
    v = v or [m.constant(np.linspace(0.3, 1.7, int(np.prod(x.shape))).reshape(x.shape)) for x in xs]
    with m.GradientTape() as outer:
        outer.watch(xs)
        with m.GradientTape() as inner:
            inner.watch(xs)
            y = f(*xs)
        grads = inner.gradient(y, xs)
        terms = [m.reduce_sum(g * d) for g, d in zip(grads, v) if g is not None]
        dot = None
        for term in terms:
            dot = term if dot is None else dot + term
    hvp = [None] * len(xs) if dot is None else outer.gradient(dot, xs)
    return {"value": y, "grad": grads, "hvp": hvp}


def weighted(m: Any, out: Any, w: np.ndarray) -> Any:
    """A scalar from a tensor output: sum(w * out), w fixed."""
    return m.reduce_sum(out * m.constant(w))


def caught(fn: Callable[[], Any]) -> Any:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error's class is what is compared
        return {"error": type(exc).__name__}
    return {"error": None}


# ---- 1. custom_gradient records its body ----
def _log1pexp(m: Any) -> Any:
    @m.custom_gradient
    def log1pexp(x: Any) -> Any:
        e = m.exp(x)

        def grad_fn(upstream: Any) -> Any:
            return upstream * (1 - 1 / (1 + e))

        return m.log(1 + e), grad_fn

    return log1pexp


@program("1", X3)
def custom_gradient_body_with_cube(m: Any, x: Any) -> Any:
    f = _log1pexp(m)
    return orders(m, lambda x: m.reduce_sum(f(x) + x**3), [x])


@program("1", X3)
def custom_gradient_body_alone(m: Any, x: Any) -> Any:
    f = _log1pexp(m)
    return orders(m, lambda x: m.reduce_sum(f(x)), [x])


@program("1", X3, V3)
def custom_gradient_two_inputs(m: Any, x: Any, y: Any) -> Any:
    @m.custom_gradient
    def scaled(a: Any, b: Any) -> Any:
        p = a * b
        return p * p, lambda g: (g * 2 * p * b * 3, g * 2 * p * a)

    return orders(m, lambda a, b: m.reduce_sum(scaled(a, b)), [x, y])


# ---- 2. forward mode through custom_gradient ----
def _sin_doubled(m: Any) -> Any:
    @m.custom_gradient
    def f(x: Any) -> Any:
        return m.sin(x), lambda dy: dy * m.cos(x) * 2

    return f


@program("2", X3)
def custom_gradient_forward_mode(m: Any, x: Any) -> Any:
    f = _sin_doubled(m)
    with m.ForwardAccumulator(x, m.constant(V3)) as acc:
        y = f(x)
    with m.GradientTape() as tape:
        tape.watch(x)
        z = m.reduce_sum(f(x))
    return {"jvp": acc.jvp(y), "grad": tape.gradient(z, x)}


@program("2", X3)
def custom_gradient_forward_over_reverse(m: Any, x: Any) -> Any:
    f = _log1pexp(m)
    with m.ForwardAccumulator(x, m.constant(V3)) as acc:
        with m.GradientTape() as tape:
            tape.watch(x)
            y = m.reduce_sum(f(x))
        g = tape.gradient(y, x)
    return {"grad": g, "hvp": acc.jvp(g)}


# ---- 3. zero cotangents through singular derivatives ----
@program("3", [0.0, 4.0])
def where_safe_sqrt(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, m.sqrt(x), m.zeros_like(x))), [x])


@program("3", [-1.0, 4.0])
def where_sqrt_or_x(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, m.sqrt(x), x)), [x])


@program("3", [0.0, 2.0])
def where_reciprocal(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, m.reciprocal(x), x)), [x])


@program("3", [0.0, 2.0])
def where_rsqrt(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, m.rsqrt(x), x)), [x])


@program("3", [0.0, 2.0])
def where_log_is_nan(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, m.log(x), x)), [x])


@program("3", [0.0, 2.0])
def where_divide_is_nan(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, 1 / x, x)), [x])


@program("3", [0.0, 2.0])
def where_fractional_power_is_nan(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.where(x > 0, x**1.5, x)), [x])


@program("3", [0.0, 2.0, 0.0])
def sqrt_times_zero_cotangent(m: Any, x: Any) -> Any:
    w = m.constant(np.array([0.0, 1.0, 1.0]))
    return orders(m, lambda x: m.reduce_sum(w * m.sqrt(x)), [x])


# ---- 4. zeros, not None, for connected sources ----
@program("4", [-1.5, 0.5, 2.0])
def relu_second_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.relu(x) * 3), [x])


@program("4", [-1.5, 0.5, 2.0])
def leaky_relu_second_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.leaky_relu(x, alpha=0.3)), [x])


@program("4", [-1.5, 0.5, 2.0])
def abs_second_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.abs(x)), [x])


@program("4", [-1.5, 0.5, 2.0])
def norm_1_second_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.norm(x, ord=1), [x])


@program("4", [-1.5, 0.5, 2.0])
def norm_inf_second_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.norm(x, ord=np.inf), [x])


@program("4", [-1.5, 0.0, 2.0])
def sign_first_derivative(m: Any, x: Any) -> Any:
    return orders(m, lambda x: m.reduce_sum(m.sign(x) * x), [x])


@program("4", M34)
def unconnected_batch_jacobian(m: Any, x: Any) -> Any:
    with m.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = m.constant(np.ones((3, 2))) * 2.0
    return {
        "none": tape.batch_jacobian(y, x),
        "zero": tape.batch_jacobian(y, x, unconnected_gradients=m.UnconnectedGradients.ZERO),
        "gradient_none": tape.gradient(y, x),
    }


# ---- 5. watched_variables in creation order ----
@program("5")
def watched_variables_order(m: Any) -> Any:
    v1 = m.Variable(np.array(1.0), name="v1")
    v2 = m.Variable(np.array(2.0), name="v2")
    v3 = m.Variable(np.array(3.0), name="v3")
    with m.GradientTape() as tape:
        y = v3 * v1 + v2 * v3
    names = [v.name.split(":")[0] for v in tape.watched_variables()]
    grads = tape.gradient(y, list(tape.watched_variables()))
    return {"names": names, "grads": grads}


# ---- 6. API gaps ----
@program("6", X3)
def custom_gradient_with_variables(m: Any, x: Any) -> Any:
    v = m.Variable(np.array([0.5, -1.0, 2.0]), name="v")

    @m.custom_gradient
    def scale(x: Any) -> Any:
        y = x * v

        def grad_fn(dy: Any, variables: Any = None) -> Any:
            return dy * v, [m.reduce_sum(dy * x, axis=None) * 2 * m.ones_like(variables[0])]

        return y, grad_fn

    with m.GradientTape() as tape:
        tape.watch(x)
        z = m.reduce_sum(scale(x) * x)
    gx, gv = tape.gradient(z, [x, v])
    return {"gx": gx, "gv": gv}


@program("6", M34)
def jacobian_tf_keywords(m: Any, x: Any) -> Any:
    with m.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = m.sin(x) * x
    return {
        "jacobian": tape.jacobian(y, x, experimental_use_pfor=False, parallel_iterations=2),
        "batch": tape.batch_jacobian(y, x, experimental_use_pfor=False),
    }


@program("6", X3, V3)
def unconnected_enum_and_namedtuple(m: Any, x: Any, y: Any) -> Any:
    with m.GradientTape(persistent=True) as tape:
        tape.watch([x, y])
        z = m.reduce_sum(x * x)
    zero = tape.gradient(z, y, unconnected_gradients=m.UnconnectedGradients.ZERO)
    none = tape.gradient(z, y, unconnected_gradients=m.UnconnectedGradients.NONE)
    pair = tape.gradient(z, Pair(a=x, b=y))
    return {
        "zero": zero,
        "none": none,
        "pair_type": type(pair).__name__,
        "pair_fields": list(pair._fields),
        "pair": list(pair),
    }


@program("6", X3)
def scalar_output_gradients(m: Any, x: Any) -> Any:
    with m.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    return tape.gradient(y, x, output_gradients=m.constant(np.array(2.0)))


@program("6", X3)
def reset_outside_and_rank1_batch_jacobian(m: Any, x: Any) -> Any:
    tape = m.GradientTape(persistent=True)
    with tape:
        tape.watch(x)
        y = x * x
    return {
        "reset": caught(tape.reset),
        "batch_jacobian_rank1": caught(lambda: tape.batch_jacobian(y, x)),
    }


@program("6", M34[0])
def gelu_exact_and_tanh(m: Any, x: Any) -> Any:
    return {
        "exact": orders(m, lambda x: m.reduce_sum(m.gelu(x)), [x]),
        "default_is_exact": m.reduce_sum(m.gelu(x)) - m.reduce_sum(m.gelu(x, approximate=False)),
        "tanh": orders(m, lambda x: m.reduce_sum(m.gelu(x, approximate=True)), [x]),
    }


# ---- 7. new ops, first and second order ----
@program("7", M34)
def op_identity(m: Any, x: Any) -> Any:
    return orders(m, lambda x: weighted(m, m.identity(x) ** 2, W34), [x])


@program("7", M34)
def op_erf(m: Any, x: Any) -> Any:
    return orders(m, lambda x: weighted(m, m.erf(x), W34), [x])


@program("7", POS34)
def op_rsqrt(m: Any, x: Any) -> Any:
    return orders(m, lambda x: weighted(m, m.rsqrt(x), W34), [x])


@program("7", [0.0, 1.5, 0.0, 2.0], [0.0, 0.5, 3.0, 0.7])
def op_xlogy(m: Any, x: Any, y: Any) -> Any:
    return orders(
        m, lambda x, y: m.reduce_sum(m.xlogy(x, y) * m.constant(V3[[0, 1, 2, 0]])), [x, y]
    )


@program("7", [1.0, 1.5, 0.0, -2.0], [0.0, 0.5, 3.0, 0.7])
def op_divide_no_nan(m: Any, x: Any, y: Any) -> Any:
    return orders(
        m, lambda x, y: m.reduce_sum(m.divide_no_nan(x, y) * m.constant(V3[[0, 1, 2, 0]])), [x, y]
    )


@program("7", M34)
def op_gather_nd(m: Any, x: Any) -> Any:
    idx = np.array([[2, 1], [0, 3], [2, 1]], dtype=np.int32)
    rows = np.array([[1], [1], [0]], dtype=np.int32)
    return orders(
        m,
        lambda x: (
            m.reduce_sum(m.gather_nd(x, idx) ** 2)
            + m.reduce_sum(m.gather_nd(x, rows) ** 3 * m.constant(W34[:, :4]))
        ),
        [x],
    )


@program("7", M34)
def op_scatter_nd(m: Any, u: Any) -> Any:
    idx = np.array([[2], [0], [2]], dtype=np.int32)
    return orders(
        m,
        lambda u: m.reduce_sum(
            m.scatter_nd(idx, u * u, [4, 4]) * m.constant(np.arange(16.0).reshape(4, 4))
        ),
        [u],
    )


@program("7", M34)
def op_cumsum(m: Any, x: Any) -> Any:
    return orders(
        m,
        lambda x: (
            weighted(m, m.cumsum(x * x, axis=1), W34)
            + weighted(m, m.cumsum(x**3, axis=0, exclusive=True, reverse=True), W34)
        ),
        [x],
    )


@program("7", M34)
def op_sort(m: Any, x: Any) -> Any:
    return orders(
        m,
        lambda x: (
            weighted(m, m.sort(x, axis=0) ** 2, W34)
            + weighted(m, m.sort(x**3, direction="DESCENDING"), W34)
        ),
        [x],
    )


@program("7", M34)
def op_top_k(m: Any, x: Any) -> Any:
    def f(x: Any) -> Any:
        values, _ = m.top_k(x * x, k=2)
        return weighted(m, values * x[:, :2], W34[:, :2])

    return {"orders": orders(m, f, [x]), "indices": m.top_k(m.constant(M34), k=3)[1]}


@program("7", M34)
def op_pad(m: Any, x: Any) -> Any:
    out = lambda x: m.pad(x * x, [[1, 0], [2, 1]], mode="CONSTANT", constant_values=0.5)
    return orders(m, lambda x: weighted(m, out(x) ** 2, W47), [x])


@program("7", M34)
def op_tile(m: Any, x: Any) -> Any:
    return orders(
        m, lambda x: weighted(m, m.tile(x * x, [2, 3]), np.arange(72.0).reshape(6, 12) / 50), [x]
    )


@program("7", M34)
def op_split(m: Any, x: Any) -> Any:
    def f(x: Any) -> Any:
        a, b, c = m.split(x**2, [1, -1, 1], axis=1)
        d, e = m.split(x, 2, axis=1)
        return m.reduce_sum(a * c) + m.reduce_sum(b**2) + m.reduce_sum(d * e * e)

    return orders(m, f, [x])


@program("7", M34)
def op_unstack(m: Any, x: Any) -> Any:
    def f(x: Any) -> Any:
        rows = m.unstack(x, axis=0)
        cols = m.unstack(x, axis=1)
        return m.reduce_sum(rows[0] * rows[2] ** 2) + m.reduce_sum(cols[1] * cols[3])

    return orders(m, f, [x])


@program("7", M34)
def op_moments_first_order(m: Any, x: Any) -> Any:
    def f(x: Any) -> Any:
        mean, variance = m.moments(x, axes=[0])
        return weighted(m, mean * variance, W34[0])

    with m.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
    keep = m.moments(x, axes=[0, 1], keepdims=True)
    return {"value": y, "grad": tape.gradient(y, x), "keepdims": list(keep)}


@program("7", M34)
def op_moments_second_order(m: Any, x: Any) -> Any:
    # TensorFlow's moments stops the gradient through the mean inside the variance (its
    # second derivative misses a term; a documented difference): compare the engine's
    # moments with TensorFlow's exact reduce_variance instead.
    return orders(m, lambda x: weighted(m, m.exact_variance(x, axis=0), W34[0]), [x])


@program("7", M34, V3)
def op_clip_by_global_norm(m: Any, x: Any, y: Any) -> Any:
    def f(x: Any, y: Any) -> Any:
        (cx, cy), norm = m.clip_by_global_norm([x, y], 1.5)
        return weighted(m, cx, W34) + m.reduce_sum(cy * m.constant(V3)) + norm

    def unclipped(x: Any, y: Any) -> Any:
        (cx, cy), _ = m.clip_by_global_norm([x * 0.1, y * 0.1], 100.0)
        return weighted(m, cx, W34) + m.reduce_sum(cy**2)

    return {"clipped": orders(m, f, [x, y]), "unclipped": orders(m, unclipped, [x, y])}
