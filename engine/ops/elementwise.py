"""Elementwise primitives: arithmetic, unary math, comparisons, where, cast.

Each block holds one primitive: its forward (with broadcasting=True where its arguments
broadcast), its partial derivatives (defpartials: one declaration gives the VJP, the JVP
and every higher order), and its public wrapper with the shape rule the definition
language infers it by. Broadcasting between arguments is undone by the tape (VJP) and
the accumulator (JVP), so partials may be in the broadcast shape.

A few keep hand-written rules, for a reason given beside each: sqrt, rsqrt and
reciprocal (TensorFlow's protected kernels: a zero cotangent stays zero where the
derivative is infinite), relu and leaky_relu (relu_grad, a kernel of g and x), where
(the selected cotangent), sign (recorded with a zero derivative), cast (a dtype change).
"""

from __future__ import annotations

import math
from builtins import abs as builtin_abs
from collections.abc import Callable
from typing import Any

from engine import trace
from engine.backend import array_module, host
from engine.backend import erf as erf_impl
from engine.backend import numpy as numpy_module
from engine.kernels import gelu as gelu_kernels
from engine.ops._util import coerce_pair
from engine.registry import (
    MissingRuleError,
    Primitive,
    defform,
    defjvp,
    defnondiff,
    defvjp,
    primitive,
    public,
    zero_vjp,
)
from engine.shapes import (
    BOOL,
    FLOAT32,
    RuleError,
    TensorType,
    binary,
    broadcast,
    checked,
    concrete,
    like,
    pair,
    require,
    unary,
)
from engine.tensor import Tensor, as_tensor, bind, pass_constant, unaliased


def _tsum(*terms: Tensor | None) -> Tensor | None:
    """Sum the tangent contributions that are not zero (None)."""
    total = None
    for term in terms:
        if term is not None:
            total = term if total is None else add(total, term)
    return total


def _zero_like(t: Tensor) -> Tensor:
    return as_tensor(0, like=t)


def _mask(condition: Tensor, dtype: Any) -> Tensor:
    """A 0/1 float tensor from a bool one. VJP rules multiply by masks rather than use
    `where`: a multiply is several times faster than np.where on an irregular mask, and
    made in a rule's outer stage the mask is reused by every later pass (HVPs)."""
    return cast(condition, dtype)


Partial = Callable[..., Any] | int | None


def defpartials(prim: Primitive, *partials: Partial) -> None:
    """An elementwise primitive's rules from its partial derivatives, one per argument:
    `partial(ans, *args, **params)` -> d ans / d arg, an engine tensor (broadcasting
    against the output) or a number; a constant number (add's 1, subtract's -1) in
    place of the function; or None for an argument with no derivative (a condition).
    The VJP is g * partial (computed in the rule's outer stage, so every later pass
    reuses it; the tape sums broadcast axes down), the JVP the sum of t_i * partial_i;
    written in engine ops, the partials differentiate again: second and higher orders
    follow."""

    def vjp(partial: Partial) -> Any:
        if partial is None:
            return None
        if isinstance(partial, int):  # a constant: one VJP for every record
            times = _times(partial)
            return lambda ans, *args, **params: times
        return lambda ans, *args, **params: _times(partial(ans, *args, **params))

    def jvp(t: list, ans: Tensor, *args: Tensor, **params: Any) -> Tensor | None:
        terms = []
        for i, (tangent, partial) in enumerate(zip(t, partials, strict=True)):
            if tangent is None:
                continue
            if partial is None:
                raise MissingRuleError(f"no derivative for argument {i} of '{prim.name}'")
            slope = partial if isinstance(partial, int) else partial(ans, *args, **params)
            terms.append(_times(slope)(tangent))
        return _tsum(*terms)

    defvjp(prim, *(vjp(p) for p in partials))
    defjvp(prim, jvp)


def _same(v: Tensor) -> Tensor:
    return v


def _negated(v: Tensor) -> Tensor:
    return negative(v)  # (negative is declared below)


def _times(slope: Any) -> Callable[[Tensor], Tensor]:
    """v -> v * slope, with the constant slopes of add and subtract (1, -1) free."""
    if isinstance(slope, (int, float)) and slope in (1, -1):
        return _same if slope == 1 else _negated
    return lambda v: multiply(v, slope)


def elementwise_primitive(
    name: str, impl: Any, *, broadcasting: bool = False, linear_form: str | None = None
) -> Primitive:
    """A primitive of this family: each output element comes from the same-place
    elements of its (broadcast) arguments (registry.ELEMENT_FLOW "elementwise");
    linear_form: "copies" or "sums" where it is one (registry.LINEAR_FORM)."""
    return primitive(
        name, impl, broadcasting=broadcasting, flow="elementwise", linear_form=linear_form
    )


# ========================================================================================
# Binary arithmetic
# ========================================================================================

# ---- add ----
add_p = elementwise_primitive("add", lambda xp, x, y: x + y, broadcasting=True, linear_form="sums")
defpartials(add_p, 1, 1)


@public("arithmetic", shape_rule=binary("numeric"))
def add(x: Any, y: Any) -> Tensor:
    """x + y, with NumPy broadcasting."""
    return bind(add_p, *coerce_pair("add", x, y))


# ---- subtract ----
subtract_p = elementwise_primitive("subtract", lambda xp, x, y: x - y, broadcasting=True)
defpartials(subtract_p, 1, -1)


@public("arithmetic", shape_rule=binary("numeric"))
def subtract(x: Any, y: Any) -> Tensor:
    """x - y, with broadcasting."""
    return bind(subtract_p, *coerce_pair("subtract", x, y))


# ---- multiply ----
multiply_p = elementwise_primitive("multiply", lambda xp, x, y: x * y, broadcasting=True)
defpartials(multiply_p, lambda ans, x, y: y, lambda ans, x, y: x)


@public("arithmetic", shape_rule=binary("numeric"))
def multiply(x: Any, y: Any) -> Tensor:
    """x * y, with broadcasting."""
    return bind(multiply_p, *coerce_pair("multiply", x, y))


# ---- divide ----
divide_p = elementwise_primitive("divide", lambda xp, x, y: x / y, broadcasting=True)
defpartials(divide_p, lambda ans, x, y: reciprocal(y), lambda ans, x, y: negative(divide(ans, y)))


@public("arithmetic", shape_rule=binary("float"))
def divide(x: Any, y: Any) -> Tensor:
    """x / y (true division), with broadcasting."""
    x, y = coerce_pair("divide", x, y)
    if x.dtype.kind in "iub":
        raise TypeError(f"divide: true division of {x.dtype} tensors; cast to a float first")
    return bind(divide_p, x, y)


# ---- power ----
power_p = elementwise_primitive("power", lambda xp, x, y: xp.power(x, y), broadcasting=True)


def _safe_log(x: Tensor) -> Tensor:
    """log(x) where x > 0, else 0: d(x**y)/dy at x <= 0 is taken as 0, not NaN."""
    positive = greater(x, 0)
    return where(positive, log(where(positive, x, 1)), 0)


defpartials(
    power_p,
    lambda ans, x, y: multiply(y, power(x, subtract(y, 1))),
    lambda ans, x, y: multiply(ans, _safe_log(x)),
)


def power_rule(b: dict[str, Any]) -> TensorType:
    # NumPy refuses an integer to a negative power only when it runs; a literal exponent
    # is known here, so the program is refused before it runs.
    out = binary("numeric")(b)
    exponent = b["y"].literal
    if out.dtype.kind in "iu" and exponent is not None and exponent < 0:
        raise RuleError(
            f"an integer to a negative power ({exponent}); cast to a float first", "dtype"
        )
    return out


@public("arithmetic", shape_rule=power_rule)
def power(x: Any, y: Any) -> Tensor:
    """x ** y, with broadcasting."""
    if (
        isinstance(y, (int, float))
        and not isinstance(y, bool)
        and float(y).is_integer()
        and builtin_abs(y) <= 64
        and not (isinstance(x, Tensor) and x.dtype.kind in "iub")
    ):
        return integer_pow(as_tensor(x), int(y))
    return bind(power_p, *coerce_pair("power", x, y))


# ---- integer_pow ----
# x ** n for a constant integer n: multiplications instead of pow's general kernel, and
# derivatives n x^(n-1) that stay finite at x = 0 to every order (the general rule's
# y x^(y-1) turns into 0 * inf there once y - 1 < 0).
def _integer_pow_impl(xp: Any, x: Any, *, n: int) -> Any:
    if n == 2:
        return x * x
    if n == 3:
        return x * x * x
    return xp.power(x, x.dtype.type(n)) if n < 0 else xp.power(x, n)


integer_pow_p = elementwise_primitive("integer_pow", _integer_pow_impl)


def integer_pow(x: Tensor, n: int) -> Tensor:
    if n == 0:
        return as_tensor(1, like=x) if x.ndim == 0 else add(multiply(stop(x), 0), 1)
    if n == 1:
        return unaliased(x)
    return bind(integer_pow_p, x, n=n)


def _integer_pow_slope(x: Tensor, n: int) -> Tensor:
    return multiply(integer_pow(x, n - 1), float(n) if x.dtype.kind == "f" else n)


defpartials(integer_pow_p, lambda ans, x, *, n: _integer_pow_slope(x, n))


def stop(x: Tensor) -> Tensor:
    """x's value with no link to any tape (stop_gradient)."""
    out = Tensor(x.value)
    if trace.capture is not None:  # the same array under a new identity: a replay reads x's
        trace.capture.alias(out, x)
    return out


# ---- maximum / minimum ----
# Ties send the whole gradient to the first argument, as TensorFlow does.
maximum_p = elementwise_primitive("maximum", lambda xp, x, y: xp.maximum(x, y), broadcasting=True)


defpartials(
    maximum_p,
    lambda ans, x, y: _mask(greater_equal(x, y), ans.dtype),
    lambda ans, x, y: _mask(less(x, y), ans.dtype),
)


@public("arithmetic", shape_rule=binary("numeric"))
def maximum(x: Any, y: Any) -> Tensor:
    """Elementwise maximum; on ties the gradient goes to x."""
    return bind(maximum_p, *coerce_pair("maximum", x, y))


minimum_p = elementwise_primitive("minimum", lambda xp, x, y: xp.minimum(x, y), broadcasting=True)


defpartials(
    minimum_p,
    lambda ans, x, y: _mask(less_equal(x, y), ans.dtype),
    lambda ans, x, y: _mask(greater(x, y), ans.dtype),
)


@public("arithmetic", shape_rule=binary("numeric"))
def minimum(x: Any, y: Any) -> Tensor:
    """Elementwise minimum; on ties the gradient goes to x."""
    return bind(minimum_p, *coerce_pair("minimum", x, y))


# ========================================================================================
# Unary math
# ========================================================================================

# ---- negative ----
negative_p = elementwise_primitive("negative", lambda xp, x: -x)
defpartials(negative_p, -1)


@public("math", shape_rule=unary("numeric"))
def negative(x: Any) -> Tensor:
    """-x."""
    return bind(negative_p, as_tensor(x))


# ---- exp ----
exp_p = elementwise_primitive("exp", lambda xp, x: xp.exp(x))
defpartials(exp_p, lambda ans, x: ans)


@public("math", shape_rule=unary("float"))
def exp(x: Any) -> Tensor:
    """e ** x."""
    return bind(exp_p, as_tensor(x))


# ---- log ----
# log and log1p multiply by a reciprocal, as TensorFlow's LogGrad does: reciprocal's
# protected rule then keeps a zero cotangent zero at second order (x = 0 in an untaken
# `where` branch), where g / x would give NaN.
log_p = elementwise_primitive("log", lambda xp, x: xp.log(x))
defpartials(log_p, lambda ans, x: reciprocal(x))


@public("math", shape_rule=unary("float"))
def log(x: Any) -> Tensor:
    """Natural logarithm."""
    return bind(log_p, as_tensor(x))


# ---- log1p ----
log1p_p = elementwise_primitive("log1p", lambda xp, x: xp.log1p(x))
defpartials(log1p_p, lambda ans, x: reciprocal(add(x, 1)))


@public("math", shape_rule=unary("float"))
def log1p(x: Any) -> Tensor:
    """log(1 + x), accurate for small x."""
    return bind(log1p_p, as_tensor(x))


# ---- log2: an elementwise primitive declared by its partial derivative ----
log2_p = elementwise_primitive("log2", lambda xp, x: xp.log2(x))
defpartials(log2_p, lambda ans, x: multiply(reciprocal(x), 1 / math.log(2)))


@public("math", shape_rule=unary("float"))
def log2(x: Any) -> Tensor:
    """Base-2 logarithm."""
    return bind(log2_p, as_tensor(x))


# ---- expm1 ----
expm1_p = elementwise_primitive("expm1", lambda xp, x: xp.expm1(x))
defpartials(expm1_p, lambda ans, x: add(ans, 1))


@public("math", shape_rule=unary("float"))
def expm1(x: Any) -> Tensor:
    """exp(x) - 1, accurate for small x."""
    return bind(expm1_p, as_tensor(x))


# ---- sqrt, rsqrt, reciprocal: TensorFlow's protected gradient kernels ----
# TensorFlow computes these VJPs with kernels (SqrtGrad, RsqrtGrad, ReciprocalGrad) that
# answer 0 wherever the incoming cotangent is 0, even where the derivative is infinite:
# so `where(x > 0, sqrt(x), 0)` has a finite gradient at 0. They are primitives here
# too, with TensorFlow's own (unprotected) second-order rules, so both orders match.
# Other ops (log, divide, power) are not protected, in TensorFlow or here.
def _protected(xp: Any, g: Any, value: Any) -> Any:
    return xp.where(g == 0, xp.zeros((), dtype=g.dtype), value)


def _nonzero(xp: Any, g: Any, y: Any) -> Any:
    """y where g is not 0, else 1: a denominator that warns only where it should."""
    return xp.where(g == 0, xp.ones((), dtype=y.dtype), y)


sqrt_grad_p = elementwise_primitive(
    "sqrt_grad", lambda xp, y, g: _protected(xp, g, 0.5 * g / _nonzero(xp, g, y))
)


def sqrt_grad_vjp_y(ans: Tensor, y: Tensor, g: Tensor) -> Any:
    return lambda gg: negative(multiply(divide(gg, y), ans))


defvjp(sqrt_grad_p, sqrt_grad_vjp_y, lambda ans, y, g: lambda gg: multiply(divide(gg, y), 0.5))
defjvp(
    sqrt_grad_p,
    lambda t, ans, y, g: _tsum(
        None if t[0] is None else negative(multiply(divide(t[0], y), ans)),
        None if t[1] is None else multiply(divide(t[1], y), 0.5),
    ),
)

sqrt_p = elementwise_primitive("sqrt", lambda xp, x: xp.sqrt(x))
defvjp(sqrt_p, lambda ans, x: lambda g: bind(sqrt_grad_p, ans, g))
defjvp(sqrt_p, lambda t, ans, x: divide(t[0], multiply(ans, 2)))

rsqrt_grad_p = elementwise_primitive(
    "rsqrt_grad", lambda xp, y, g: _protected(xp, g, -0.5 * g * y * y * y)
)


def rsqrt_grad_vjp_y(ans: Tensor, y: Tensor, g: Tensor) -> Any:
    return lambda gg: multiply(multiply(multiply(gg, g), multiply(y, y)), -1.5)


defvjp(rsqrt_grad_p, rsqrt_grad_vjp_y, lambda ans, y, g: lambda gg: bind(rsqrt_grad_p, y, gg))
defjvp(
    rsqrt_grad_p,
    lambda t, ans, y, g: _tsum(
        None if t[0] is None else multiply(multiply(multiply(t[0], g), multiply(y, y)), -1.5),
        None if t[1] is None else multiply(multiply(t[1], integer_pow(y, 3)), -0.5),
    ),
)

rsqrt_p = elementwise_primitive("rsqrt", lambda xp, x: 1 / xp.sqrt(x))
defvjp(rsqrt_p, lambda ans, x: lambda g: bind(rsqrt_grad_p, ans, g))
defjvp(rsqrt_p, lambda t, ans, x: multiply(t[0], multiply(integer_pow(ans, 3), -0.5)))

reciprocal_grad_p = elementwise_primitive(
    "reciprocal_grad", lambda xp, y, g: _protected(xp, g, -g * y * y)
)


def reciprocal_grad_vjp_y(ans: Tensor, y: Tensor, g: Tensor) -> Any:
    return lambda gg: multiply(multiply(gg, multiply(g, y)), -2.0)


defvjp(
    reciprocal_grad_p,
    reciprocal_grad_vjp_y,
    lambda ans, y, g: lambda gg: bind(reciprocal_grad_p, y, gg),
)
defjvp(
    reciprocal_grad_p,
    lambda t, ans, y, g: _tsum(
        None if t[0] is None else multiply(multiply(t[0], multiply(g, y)), -2.0),
        None if t[1] is None else negative(multiply(t[1], multiply(y, y))),
    ),
)

reciprocal_p = elementwise_primitive("reciprocal", lambda xp, x: 1 / x)
defvjp(reciprocal_p, lambda ans, x: lambda g: bind(reciprocal_grad_p, ans, g))
defjvp(reciprocal_p, lambda t, ans, x: negative(multiply(t[0], multiply(ans, ans))))


@public("math", shape_rule=unary("float"))
def rsqrt(x: Any) -> Tensor:
    """1 / sqrt(x)."""
    return bind(rsqrt_p, as_tensor(x))


@public("math", shape_rule=unary("float"))
def reciprocal(x: Any) -> Tensor:
    """1 / x."""
    x = as_tensor(x)
    if x.dtype.kind in "iub":
        raise TypeError(f"reciprocal: of a {x.dtype} tensor; cast to a float first")
    return bind(reciprocal_p, x)


@public("math", shape_rule=unary("float"))
def sqrt(x: Any) -> Tensor:
    """Square root."""
    return bind(sqrt_p, as_tensor(x))


# ---- sin / cos ----
sin_p = elementwise_primitive("sin", lambda xp, x: xp.sin(x))
defpartials(sin_p, lambda ans, x: cos(x))


@public("math", shape_rule=unary("float"))
def sin(x: Any) -> Tensor:
    """Sine."""
    return bind(sin_p, as_tensor(x))


cos_p = elementwise_primitive("cos", lambda xp, x: xp.cos(x))
defpartials(cos_p, lambda ans, x: negative(sin(x)))


@public("math", shape_rule=unary("float"))
def cos(x: Any) -> Tensor:
    """Cosine."""
    return bind(cos_p, as_tensor(x))


# ---- tanh ----
# A primitive rather than a composite of exp: one kernel forward, and the derivative
# 1 - tanh(x)**2 reuses the output instead of recomputing exponentials.
# Its VJP is a primitive of its own, tanh_grad(g, y) = g * (1 - y * y) with y = tanh(x)
# (TensorFlow's TanhGrad): one op where y * y, 1 - that and g * it were three, and a
# gradient is mostly asked once (a training step). A VJP kept for later passes over the
# same record (repeated HVPs on one tape: tape.Record.vjp_cache) makes the slope
# 1 - y * y once, at its second call, and multiplies by it from then on. Both are the
# same NumPy operations in the same order: the same bits.
tanh_p = elementwise_primitive("tanh", lambda xp, x: xp.tanh(x))
tanh_grad_p = elementwise_primitive(
    "tanh_grad", lambda xp, g, y: g * (1 - y * y), broadcasting=True
)


def _tanh_slope(y: Tensor) -> Tensor:
    return subtract(1, multiply(y, y))


def _tanh_vjp(y: Tensor) -> Callable[[Tensor], Tensor]:
    """g -> g * (1 - y * y): fused on the first call, by the cached slope after it."""
    slope: Tensor | None = None
    called = False

    def vjp(g: Tensor) -> Tensor:
        nonlocal slope, called
        if not called:
            called = True
            return bind(tanh_grad_p, g, y)
        if slope is None:
            slope = _tanh_slope(y)
        return multiply(g, slope)

    return vjp


defvjp(tanh_p, lambda ans, x: _tanh_vjp(ans))
defjvp(tanh_p, lambda t, ans, x: multiply(t[0], _tanh_slope(ans)))
# d/dg = 1 - y * y, d/dy = -2 g y: the second and higher orders of tanh
defpartials(
    tanh_grad_p,
    lambda ans, g, y: _tanh_slope(y),
    lambda ans, g, y: multiply(multiply(g, y), -2.0),
)


@public("activation", shape_rule=unary("float"))
def tanh(x: Any) -> Tensor:
    """Hyperbolic tangent."""
    return bind(tanh_p, as_tensor(x))


# ---- sigmoid ----
# A primitive for numerical stability: 1 / (1 + exp(-x)) overflows for large negative x,
# and the derivative is cheapest from the output: s * (1 - s).
def _sigmoid_impl(xp: Any, x: Any) -> Any:
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


sigmoid_p = elementwise_primitive("sigmoid", _sigmoid_impl)


defpartials(sigmoid_p, lambda ans, x: multiply(ans, subtract(1, ans)))


@public("activation", shape_rule=unary("float"))
def sigmoid(x: Any) -> Tensor:
    """Logistic function 1 / (1 + exp(-x))."""
    return bind(sigmoid_p, as_tensor(x))


# ---- relu ----
# A primitive rather than maximum(x, 0): one comparison in the backward pass instead of
# maximum's two masks, and relu is on every hot path. The derivative at 0 is 0.
# Its VJP is a primitive of its own, relu_grad(g, x), as TensorFlow's ReluGrad: the
# second derivative is then connected to x and is zeros (not None), as in TensorFlow.
relu_p = elementwise_primitive("relu", lambda xp, x: xp.maximum(x, 0))


def _relu_grad_impl(xp: Any, g: Any, x: Any, *, alpha: float) -> Any:
    if alpha == 0:  # a bool mask: one pass fewer than a float one, the same products
        return g * (x > 0)
    return xp.where(x > 0, g, g * g.dtype.type(alpha))


relu_grad_p = elementwise_primitive("relu_grad", _relu_grad_impl)


def _relu_grad(g: Tensor, x: Tensor, alpha: float) -> Tensor:
    return bind(relu_grad_p, g, x, alpha=alpha)


def _zeros_of(t: Tensor) -> Tensor:
    """A constant zero cotangent or tangent: connected, but with no derivative."""
    return pass_constant(array_module(t.value).zeros_like(t.value))


defvjp(
    relu_grad_p,
    lambda ans, g, x, *, alpha: lambda gg: _relu_grad(gg, x, alpha),
    lambda ans, g, x, *, alpha: zero_vjp,
)
defjvp(
    relu_grad_p,
    lambda t, ans, g, x, *, alpha: _zeros_of(t[1]) if t[0] is None else _relu_grad(t[0], x, alpha),
)
# The mask is read off the result (ans > 0 exactly where x > 0), as PyTorch's
# threshold_backward does: x then dies at relu (a replay computes relu in place in it),
# and the result, which the next layer reads anyway, is what the backward pass keeps.
defvjp(relu_p, lambda ans, x: lambda g: _relu_grad(g, ans, 0.0))
defjvp(relu_p, lambda t, ans, x: _relu_grad(t[0], ans, 0.0))

leaky_relu_p = elementwise_primitive(
    "leaky_relu", lambda xp, x, *, alpha: xp.where(x > 0, x, x * x.dtype.type(alpha))
)
defvjp(leaky_relu_p, lambda ans, x, *, alpha: lambda g: _relu_grad(g, x, alpha))
defjvp(leaky_relu_p, lambda t, ans, x, *, alpha: _relu_grad(t[0], x, alpha))


@public("activation", shape_rule=unary("float"))
def relu(x: Any) -> Tensor:
    """max(x, 0)."""
    return bind(relu_p, as_tensor(x))


# ---- abs ----
abs_p = elementwise_primitive("abs", lambda xp, x: xp.abs(x))
defpartials(abs_p, lambda ans, x: sign(x))


@public("math", shape_rule=unary("numeric"))
def abs(x: Any) -> Tensor:
    """|x|; the derivative at 0 is 0."""
    return bind(abs_p, as_tensor(x))


# ---- cast ----
# Between floating dtypes a cast is differentiable; to or from integers and bools it is
# not (the cotangent would be truncated), so that is a separate, unrecorded primitive.
cast_p = elementwise_primitive(
    "cast", lambda xp, x, *, dtype: x.astype(dtype, copy=False), linear_form="copies"
)
defvjp(cast_p, lambda ans, x, *, dtype: lambda g: cast(g, x.dtype))
defjvp(cast_p, lambda t, ans, x, *, dtype: cast(t[0], dtype))
cast_nondiff_p = elementwise_primitive(
    "cast_nondiff", lambda xp, x, *, dtype: x.astype(dtype, copy=False)
)


def cast_rule(b: dict[str, Any]) -> TensorType:
    return TensorType(concrete(b["x"]).shape, host.dtype(b.get("dtype", "float32")))


@public("math", shape_rule=cast_rule, kinds={"dtype": "dtype"})
def cast(x: Any, dtype: Any = "float32") -> Tensor:
    """x converted to dtype (the only way gradtape changes a dtype)."""
    x = as_tensor(x)
    dtype = host.dtype(dtype)
    if x.dtype == dtype:
        return unaliased(x)
    floating = x.dtype.kind == "f" and dtype.kind == "f"
    return bind(cast_p if floating else cast_nondiff_p, x, dtype=dtype)


# ---- erf ----
# On float32 NumPy arrays a compiled kernel (engine/kernels/gelu.py) runs the same
# rational as erf_float32 in one pass, bit for bit; the NumPy path stays the reference.
def _erf_impl(xp: Any, x: Any) -> Any:
    if xp is host:
        out = gelu_kernels.erf_float32(x)
        if out is not None:
            return out
    return erf_impl(xp, x)


def _kernel_form(into: Any, kernel: Any, value: Any) -> Any:
    """The replay form of a float32 op a kernel computes: into(x, out) writes the
    schedule's buffer. None (the impl runs) where the kernel does not: other dtypes,
    kernels off, a strided result."""
    if value.dtype != FLOAT32 or value.order != "C" or kernel.compiled() is None:
        return None
    return into


erf_p = elementwise_primitive("erf", _erf_impl)
defform(
    erf_p,
    lambda params, operands, value: _kernel_form(
        gelu_kernels.erf_float32, gelu_kernels.erf_float32_kernel, value
    ),
)
_TWO_OVER_ROOT_PI = 1.1283791670955126


defpartials(erf_p, lambda ans, x: multiply(exp(negative(multiply(x, x))), _TWO_OVER_ROOT_PI))


@public("math", shape_rule=unary("float"))
def erf(x: Any) -> Tensor:
    """The error function 2/sqrt(pi) * integral of exp(-t^2) from 0 to x."""
    return bind(erf_p, as_tensor(x))


# ---- identity ----
identity_p = elementwise_primitive("identity", lambda xp, x: x, linear_form="copies")
defpartials(identity_p, 1)


@public("math", shape_rule=unary("any"))
def identity(x: Any) -> Tensor:
    """x, as a new tensor (tf.identity)."""
    return bind(identity_p, as_tensor(x))


# ---- xlogy, xdivy, divide_no_nan: zero where TensorFlow defines them as zero ----
# Their rules are TensorFlow's own (XlogyGrad, XdivyGrad, DivNoNanGrad), made of the same
# guarded ops, so first and second derivatives agree with TensorFlow at the zeros too.
def _where_zero(xp: Any, c: Any, value: Any) -> Any:
    return xp.where(c, xp.zeros((), dtype=value.dtype), value)


def _one_where(xp: Any, c: Any, y: Any) -> Any:
    return xp.where(c, xp.ones((), dtype=y.dtype), y)


xlogy_p = elementwise_primitive(
    "xlogy",
    lambda xp, x, y: _where_zero(xp, x == 0, x * xp.log(_one_where(xp, x == 0, y))),
    broadcasting=True,
)
xdivy_p = elementwise_primitive(
    "xdivy",
    lambda xp, x, y: _where_zero(xp, x == 0, x / _one_where(xp, x == 0, y)),
    broadcasting=True,
)
divide_no_nan_p = elementwise_primitive(
    "divide_no_nan",
    lambda xp, x, y: _where_zero(xp, y == 0, x / _one_where(xp, y == 0, y)),
    broadcasting=True,
)


def _not_zero(x: Tensor) -> Tensor:
    return cast(not_equal(x, 0), x.dtype)


defpartials(
    xlogy_p,
    lambda ans, x, y: bind(xlogy_p, _not_zero(x), y),
    lambda ans, x, y: bind(xdivy_p, x, y),
)
defpartials(
    xdivy_p,
    lambda ans, x, y: bind(xdivy_p, _not_zero(x), y),
    lambda ans, x, y: bind(xdivy_p, negative(x), multiply(y, y)),
)
defpartials(
    divide_no_nan_p,
    lambda ans, x, y: divide_no_nan(as_tensor(1, like=y), y),
    lambda ans, x, y: divide_no_nan(divide_no_nan(negative(x), y), y),
)


@public("math", shape_rule=binary("float"))
def xlogy(x: Any, y: Any) -> Tensor:
    """x * log(y), and 0 where x is 0 (whatever y), with broadcasting."""
    return bind(xlogy_p, *coerce_pair("xlogy", x, y))


@public("arithmetic", shape_rule=binary("float"))
def divide_no_nan(x: Any, y: Any) -> Tensor:
    """x / y, and 0 where y is 0, with broadcasting."""
    x, y = coerce_pair("divide_no_nan", x, y)
    if x.dtype.kind in "iub":
        raise TypeError(f"divide_no_nan: of {x.dtype} tensors; cast to a float first")
    return bind(divide_no_nan_p, x, y)


# ---- atan2 ----
# The angle of the point (x, y); both partial derivatives share 1 / (x^2 + y^2).
atan2_p = elementwise_primitive("atan2", lambda xp, y, x: xp.arctan2(y, x), broadcasting=True)


def _atan2_scale(y: Tensor, x: Tensor) -> Tensor:
    return reciprocal(add(multiply(x, x), multiply(y, y)))


defpartials(
    atan2_p,
    lambda ans, y, x: multiply(x, _atan2_scale(y, x)),
    lambda ans, y, x: negative(multiply(y, _atan2_scale(y, x))),
)


@public("math", shape_rule=binary("float", names=("y", "x")))
def atan2(y: Any, x: Any) -> Tensor:
    """The angle of the point (x, y) in radians, in [-pi, pi], with broadcasting."""
    y, x = coerce_pair("atan2", y, x)
    checked("atan2", require, y, "float", "the operands")
    return bind(atan2_p, y, x)


# ========================================================================================
# Selection
# ========================================================================================

# ---- where ----
where_p = elementwise_primitive("where", lambda xp, c, x, y: xp.where(c, x, y), broadcasting=True)


# The cotangent is selected (as TensorFlow's SelectV2 grad): the untaken branch gets an
# exact 0 even where g is inf or NaN. On NumPy a select over an irregular mask is ~15x
# slower than a multiply by a 0/1 mask, and the two agree wherever g is finite, so
# select_grad multiplies unless g holds a non-finite value.
def _select_grad_impl(xp: Any, g: Any, mask: Any, c: Any) -> Any:
    if xp is not numpy_module or not numpy_module.isfinite(g).all():
        return xp.where(c, g, xp.zeros((), dtype=g.dtype))
    return g * mask


select_grad_p = elementwise_primitive("select_grad", _select_grad_impl)


def _select_grad(g: Tensor, mask: Tensor, c: Tensor) -> Tensor:
    return bind(select_grad_p, g, mask, c)


defvjp(select_grad_p, lambda ans, g, mask, c: lambda gg: _select_grad(gg, mask, c))
defjvp(select_grad_p, lambda t, ans, g, mask, c: _select_grad(t[0], mask, c))


def where_vjp_x(ans: Tensor, c: Tensor, x: Tensor, y: Tensor) -> Any:
    mask = _mask(c, ans.dtype)
    return lambda g: _select_grad(g, mask, c)


def where_vjp_y(ans: Tensor, c: Tensor, x: Tensor, y: Tensor) -> Any:
    taken = logical_not(c)
    mask = _mask(taken, ans.dtype)
    return lambda g: _select_grad(g, mask, taken)


defvjp(where_p, None, where_vjp_x, where_vjp_y)
defjvp(
    where_p,
    lambda t, ans, c, x, y: where(
        c,
        _zero_like(x) if t[1] is None else t[1],
        _zero_like(y) if t[2] is None else t[2],
    ),
)


def check_condition(dtype: Any) -> None:
    if dtype != BOOL:
        raise RuleError(f"condition must be bool, got {dtype}", "dtype", TypeError)


def where_rule(b: dict[str, Any]) -> TensorType:
    condition = concrete(b["condition"])
    check_condition(condition.dtype)
    x, y = pair(b["x"], b["y"])
    return TensorType(broadcast(condition.shape, x.shape, y.shape), x.dtype)


@public("selection", shape_rule=where_rule)
def where(condition: Any, x: Any, y: Any) -> Tensor:
    """x where condition is true, else y (broadcast together)."""
    condition = as_tensor(condition)
    checked("where", check_condition, condition.dtype)
    x, y = coerce_pair("where", x, y)
    return bind(where_p, condition, x, y)


# ========================================================================================
# Non-differentiable: comparisons and sign (never recorded; their outputs are constants)
# ========================================================================================


def _nondiff(name: str, impl: Any) -> Any:
    prim = elementwise_primitive(name, impl)
    defnondiff(prim)
    return prim


defnondiff(cast_nondiff_p)


# sign is recorded with a zero derivative (TensorFlow's SignGrad): a source reached only
# through it gets zeros, and so do second derivatives of abs and the 1-/inf-norms.
sign_p = elementwise_primitive("sign", lambda xp, x: xp.sign(x))
defvjp(sign_p, lambda ans, x: zero_vjp)
defjvp(sign_p, lambda t, ans, x: _zeros_of(t[0]))
greater_p = _nondiff("greater", lambda xp, x, y: x > y)
greater_equal_p = _nondiff("greater_equal", lambda xp, x, y: x >= y)
less_p = _nondiff("less", lambda xp, x, y: x < y)
less_equal_p = _nondiff("less_equal", lambda xp, x, y: x <= y)
equal_p = _nondiff("equal", lambda xp, x, y: x == y)
not_equal_p = _nondiff("not_equal", lambda xp, x, y: x != y)
logical_and_p = _nondiff("logical_and", lambda xp, x, y: xp.logical_and(x, y))
logical_or_p = _nondiff("logical_or", lambda xp, x, y: xp.logical_or(x, y))
logical_not_p = _nondiff("logical_not", lambda xp, x: xp.logical_not(x))
isfinite_p = _nondiff("isfinite", lambda xp, x: xp.isfinite(x))


@public("math", shape_rule=unary("numeric"))
def sign(x: Any) -> Tensor:
    """-1, 0 or 1 by the sign of x (no gradient flows through it)."""
    return bind(sign_p, as_tensor(x))


@public("comparison", shape_rule=binary("numeric", BOOL))
def greater(x: Any, y: Any) -> Tensor:
    """x > y as a bool tensor."""
    return bind(greater_p, *coerce_pair("greater", x, y))


@public("comparison", shape_rule=binary("numeric", BOOL))
def greater_equal(x: Any, y: Any) -> Tensor:
    """x >= y as a bool tensor."""
    return bind(greater_equal_p, *coerce_pair("greater_equal", x, y))


@public("comparison", shape_rule=binary("numeric", BOOL))
def less(x: Any, y: Any) -> Tensor:
    """x < y as a bool tensor."""
    return bind(less_p, *coerce_pair("less", x, y))


@public("comparison", shape_rule=binary("numeric", BOOL))
def less_equal(x: Any, y: Any) -> Tensor:
    """x <= y as a bool tensor."""
    return bind(less_equal_p, *coerce_pair("less_equal", x, y))


@public("comparison", shape_rule=binary("any", BOOL))
def equal(x: Any, y: Any) -> Tensor:
    """x == y elementwise, as a bool tensor."""
    return bind(equal_p, *coerce_pair("equal", x, y))


@public("comparison", shape_rule=binary("any", BOOL))
def not_equal(x: Any, y: Any) -> Tensor:
    """x != y elementwise, as a bool tensor."""
    return bind(not_equal_p, *coerce_pair("not_equal", x, y))


@public("comparison", shape_rule=binary("bool", BOOL))
def logical_and(x: Any, y: Any) -> Tensor:
    """Elementwise and of two bool tensors."""
    return bind(logical_and_p, *coerce_pair("logical_and", x, y))


@public("comparison", shape_rule=binary("bool", BOOL))
def logical_or(x: Any, y: Any) -> Tensor:
    """Elementwise or of two bool tensors."""
    return bind(logical_or_p, *coerce_pair("logical_or", x, y))


@public("comparison", shape_rule=unary("bool"))
def logical_not(x: Any) -> Tensor:
    """Elementwise not of a bool tensor."""
    return bind(logical_not_p, as_tensor(x))


def isfinite_rule(b: dict[str, Any]) -> TensorType:
    return TensorType(unary("numeric")(b).shape, BOOL)


@public("comparison", shape_rule=isfinite_rule)
def isfinite(x: Any) -> Tensor:
    """True where x is neither infinite nor NaN."""
    return bind(isfinite_p, as_tensor(x))


# ========================================================================================
# Composites: plain functions of the primitives above, no rules of their own
# ========================================================================================


@public("math", shape_rule=unary("numeric"))
def square(x: Any) -> Tensor:
    """x * x."""
    x = as_tensor(x)
    return multiply(x, x)


@public("math", shape_rule=unary("float"))
def tan(x: Any) -> Tensor:
    """Tangent."""
    x = as_tensor(x)
    return divide(sin(x), cos(x))


def check_clip_bounds(min_value: float, max_value: float) -> None:
    if min_value > max_value:
        raise RuleError(f"min_value {min_value} is greater than max_value {max_value}", "op")


def clip_rule(b: dict[str, Any]) -> TensorType:
    x = concrete(b["x"])
    require(x, "numeric")
    low, high = b["min_value"], b["max_value"]
    check_clip_bounds(low, high)
    for bound in (low, high):
        like(TensorType((), FLOAT32, bound), x)
    return x


@public("math", shape_rule=clip_rule, kinds={"min_value": "float", "max_value": "float"})
def clip(x: Any, min_value: float, max_value: float) -> Tensor:
    """x limited to [min_value, max_value]; no gradient where it is clipped."""
    x = as_tensor(x)
    checked("clip", check_clip_bounds, min_value, max_value)
    return minimum(maximum(x, min_value), max_value)


@public("activation", shape_rule=unary("float"))
def softplus(x: Any) -> Tensor:
    """log(1 + exp(x)), computed without overflow."""
    x = as_tensor(x)
    # max(x, 0) + log1p(exp(-|x|)) written with one-sided selections, so the derivative
    # at exactly 0 is the true 0.5 (relu and abs would each contribute 0 there).
    nonneg = greater_equal(x, 0)
    return add(where(nonneg, x, 0), log1p(exp(where(nonneg, negative(x), x))))


@public("activation", shape_rule=unary("float"))
def log_sigmoid(x: Any) -> Tensor:
    """log(sigmoid(x)), computed without overflow."""
    return negative(softplus(negative(as_tensor(x))))


@public("activation", shape_rule=unary("float"), kinds={"alpha": "float"})
def elu(x: Any, alpha: float = 1.0) -> Tensor:
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""
    x = as_tensor(x)
    # expm1 sees min(x, 0): the unused branch must not overflow, or its 0 * inf
    # derivative would turn the gradient into NaN.
    return where(greater(x, 0), x, multiply(expm1(minimum(x, 0)), alpha))


@public("activation", shape_rule=unary("float"), kinds={"alpha": "float"})
def leaky_relu(x: Any, alpha: float = 0.2) -> Tensor:
    """x for x > 0, alpha * x otherwise (TensorFlow's default alpha 0.2)."""
    return bind(leaky_relu_p, as_tensor(x), alpha=float(alpha))


@public("activation", shape_rule=unary("float"))
def silu(x: Any) -> Tensor:
    """x * sigmoid(x) (swish)."""
    x = as_tensor(x)
    return multiply(x, sigmoid(x))


# ---- gelu (exact): one primitive, its slope another ----
# The composite 0.5 x (1 + erf(x / sqrt 2)) costs 5 full-size NumPy calls forward and ~12
# backward (issue 28). gelu computes x (0.5 (1 + erf(x / sqrt 2))): halved before the
# product with x, as the composite's (x * 0.5) * (1 + erf), so it does not overflow where
# x does not (x near float32's max) and equals the composite bit for bit (halving is
# exact away from subnormals). Its VJP is g * gelu_slope(x, y), gelu'(x) = Phi(x) +
# x phi(x) with Phi = y / x read off the forward's answer (within 2 ulp) rather than a
# second erf (erf_float32 is ~25 float64 passes); where |x| < eps / 2 (0, subnormals,
# where y = x / 2 is itself rounded away) Phi is 1/2 to within half an ulp. The slope
# is a tensor of its own, so a fresh HVP computes it once for the gradient and the
# second pass, and a reused tape's HVPs fold it into a constant. y is a cache of
# gelu(x): gelu_slope's rule for x is the total derivative, gelu''(x) = phi(x) (2 - x^2),
# the one for y zero.
_ROOT_TWO = 1.4142135623730951
_ONE_OVER_ROOT_TWO_PI = 0.3989422804014327


def _gelu_impl(xp: Any, x: Any) -> Any:
    if xp is host:  # float32: the kernel (engine/kernels/gelu.py), the same steps in one pass
        y = gelu_kernels.gelu(x)
        if y is not None:
            return y
    return _gelu_numpy(xp, x)


def _gelu_numpy(xp: Any, x: Any) -> Any:
    y = erf_impl(xp, x / x.dtype.type(_ROOT_TWO))
    y += 1
    y *= x.dtype.type(0.5)  # before the product with x: 2 x overflows near the max
    y *= x
    return y


def _gelu_form(params: dict, operands: list, value: Any) -> Any:
    return _kernel_form(gelu_kernels.gelu, gelu_kernels.gelu_float32_kernel, value)


def _gelu_slope_into(xp: Any, x: Any, y: Any, out: Any) -> Any:
    """gelu'(x) = (x^2 phi(x) + y) / x into `out` (no work array: nothing a compiled
    replay keeps beyond its accounted buffers), 1/2 where |x| < eps / 2. On NumPy arrays
    a kernel (engine/kernels/gelu.py) evaluates it in one pass, in float64."""
    if xp is host and gelu_kernels.gelu_slope(x, y, out) is not None:
        return out
    return _gelu_slope_numpy(xp, x, y, out)


def _gelu_slope_numpy(xp: Any, x: Any, y: Any, out: Any) -> Any:
    one = x.dtype.type
    tiny = xp.less(xp.abs(x, out=out), one(xp.finfo(x.dtype).eps / 2))
    # x^2 overflows to inf far out (exp then gives 0); 0 / 0 at x = 0 is replaced
    with host.errstate(over="ignore", invalid="ignore", divide="ignore"):
        xp.multiply(x, one(-0.5), out=out)
        out *= x
        xp.exp(out, out=out)
        out *= x
        out *= x
        out *= one(_ONE_OVER_ROOT_TWO_PI)  # x^2 phi(x)
        out += y
        out /= x
    xp.copyto(out, one(0.5), where=tiny)
    return out


def _gelu_slope_impl(xp: Any, x: Any, y: Any) -> Any:
    return _gelu_slope_into(xp, x, y, xp.empty(x.shape, x.dtype))


def _gelu_slope_form(params: dict, operands: list, value: Any) -> Any:
    def form(x: Any, y: Any, out: Any) -> Any:
        if out is None:
            out = host.empty(value.shape, value.dtype)
        return _gelu_slope_into(host, x, y, out)

    return form


gelu_p = elementwise_primitive("gelu", _gelu_impl)
gelu_slope_p = elementwise_primitive("gelu_slope", _gelu_slope_impl)


def _gelu_curvature(x: Tensor) -> Tensor:
    """gelu''(x) = phi(x) (2 - x^2), in ops (second and higher derivatives)."""
    phi = multiply(exp(multiply(multiply(x, x), -0.5)), _ONE_OVER_ROOT_TWO_PI)
    return multiply(phi, subtract(2, multiply(x, x)))


defform(gelu_p, _gelu_form)
defform(gelu_slope_p, _gelu_slope_form)
defvjp(gelu_p, lambda ans, x: lambda g: multiply(g, bind(gelu_slope_p, x, ans)))
defjvp(gelu_p, lambda t, ans, x: multiply(t[0], bind(gelu_slope_p, x, ans)))
defvjp(
    gelu_slope_p,
    lambda ans, x, y: lambda u: multiply(u, _gelu_curvature(x)),
    lambda ans, x, y: zero_vjp,
)
defjvp(
    gelu_slope_p,
    lambda t, ans, x, y: _zeros_of(ans) if t[0] is None else multiply(t[0], _gelu_curvature(x)),
)


@public("activation", shape_rule=unary("float"), kinds={"approximate": "bool"})
def gelu(x: Any, approximate: bool = False) -> Tensor:
    """Gaussian error linear unit: exact 0.5 x (1 + erf(x / sqrt 2)) by default (as
    tf.nn.gelu); approximate=True gives the tanh form."""
    x = as_tensor(x)
    if approximate:
        cubic = multiply(integer_pow(x, 3), 0.044715)
        inner = multiply(add(x, cubic), 0.7978845608028654)
        return multiply(multiply(x, 0.5), add(tanh(inner), 1))
    if x.dtype.kind != "f":  # (the composite's promotion)
        return multiply(multiply(x, 0.5), add(erf(divide(x, _ROOT_TWO)), 1))
    return bind(gelu_p, x)
