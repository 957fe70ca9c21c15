"""Linear algebra: matmul (batched, NumPy's 1-D rules), einsum, solve."""

from __future__ import annotations

import string
from typing import Any

from engine.ops._util import batch_ndim, coerce_all, coerce_pair
from engine.ops.elementwise import add, multiply, negative
from engine.ops.shape import broadcast_to, expand_dims, reshape, swapaxes
from engine.registry import DEFERRED_SHAPES, defjvp, defvjp, defvjp_argnum, primitive, public
from engine.shapes import RuleError, TensorType, broadcast, checked, pair, require, same_dtypes
from engine.tensor import Tensor, bind


# ---- matmul ----
# Two flags transpose the last two axes of either operand inside the kernel (a BLAS
# transpose flag, no copy). VJP rules use them instead of recording transposes, so a
# second-order pass never differentiates a transpose and never accumulates cotangents
# into strided views.
def _matmul_impl(xp: Any, x: Any, y: Any, *, ta: bool = False, tb: bool = False) -> Any:
    if ta:
        x = x.swapaxes(-1, -2)
    if tb:
        y = y.swapaxes(-1, -2)
    if y.ndim == 2 and x.ndim > 2 and x.flags.c_contiguous:
        # A stack of matrices times one matrix is a single GEMM over all the rows.
        out = x.reshape(-1, x.shape[-1]) @ y
        return out.reshape(x.shape[:-1] + (y.shape[-1],))
    return xp.matmul(x, y)


matmul_p = primitive("matmul", _matmul_impl, flow="contracts")


def _mm(x: Tensor, y: Tensor, ta: bool = False, tb: bool = False) -> Tensor:
    """op(x) @ op(y) for operands of rank >= 2, unchecked (for rules)."""
    return bind(matmul_p, x, y, ta=ta, tb=tb)


def _row(a: Tensor) -> Tensor:
    """(..., k) -> (..., 1, k)."""
    return expand_dims(a, -2)


def _col(a: Tensor) -> Tensor:
    """(..., k) -> (..., k, 1)."""
    return expand_dims(a, -1)


def matmul_vjp_x(ans: Tensor, x: Tensor, y: Tensor, *, ta: bool = False, tb: bool = False) -> Any:
    # Every branch keeps g's leading axes (batch and stacked matmul axes) in front; the
    # tape then sums the stacked axes that x did not have. Flags are only ever set when
    # both operands are matrices.
    if x.ndim >= 2 and y.ndim >= 2:
        if ta:  # x = (g op(y)^T)^T = op(y) g^T
            return lambda g: _mm(y, g, ta=tb, tb=True)
        return lambda g: _mm(g, y, tb=not tb)
    if x.ndim >= 2:  # y is (k,): ans (..., m)
        return lambda g: multiply(_col(g), y)
    if y.ndim >= 2:  # x is (k,): ans (..., n)
        return lambda g: reshape(_mm(_row(g), y, tb=True), g.shape[:-1] + x.shape)
    return lambda g: multiply(_col(g), y)  # both (k,): ans ()


def matmul_vjp_y(ans: Tensor, x: Tensor, y: Tensor, *, ta: bool = False, tb: bool = False) -> Any:
    if y.ndim == 2 and x.ndim > 2 and not ta:
        # A stack of matrices times one matrix (a linear layer on (batch, tokens, d)):
        # y's cotangent is one GEMM over all the rows, x_rows^T g_rows (transposed for
        # tb), not one GEMM per stacked matrix and a sum of their results (1.7 ms against
        # 0.6 ms on the transformer's feed-forward shapes).
        x_rows = reshape(x, (-1, x.shape[-1]))
        rows = (-1, ans.shape[-1])

        def vjp_rows(g: Tensor) -> Tensor:
            g_rows = reshape(g, g.shape[: g.ndim - ans.ndim] + rows)
            return _mm(g_rows, x_rows, ta=True) if tb else _mm(x_rows, g_rows, ta=True)

        return vjp_rows
    if x.ndim >= 2 and y.ndim >= 2:
        if tb:  # y = (op(x)^T g)^T = g^T op(x)
            return lambda g: _mm(g, x, ta=True, tb=ta)
        return lambda g: _mm(x, g, ta=not ta)
    if x.ndim >= 2:  # y is (k,): ans (..., m), g (..., m)
        return lambda g: reshape(_mm(_row(g), x), g.shape[:-1] + y.shape)
    if y.ndim >= 2:  # x is (k,): g (..., n) -> (..., k, n)
        x_col = _col(x)
        return lambda g: multiply(x_col, _row(g))
    return lambda g: multiply(_col(g), x)


def matmul_jvp(
    t: list, ans: Tensor, x: Tensor, y: Tensor, *, ta: bool = False, tb: bool = False
) -> Tensor | None:
    terms = []
    if t[0] is not None:
        terms.append(_tangent_product(t[0], y, x, True, ans, ta, tb))
    if t[1] is not None:
        terms.append(_tangent_product(x, t[1], y, False, ans, ta, tb))
    return terms[0] if len(terms) == 1 else add(terms[0], terms[1])


def _tangent_product(
    a: Tensor, b: Tensor, primal: Tensor, left: bool, ans: Tensor, ta: bool, tb: bool
) -> Tensor:
    """The product with one (possibly batched) tangent, laid out so that the tangent's
    batch axes stay in front of the stacked-matrix axes of the other operand."""
    tangent, other = (a, b) if left else (b, a)
    lead = tangent.shape[: tangent.ndim - primal.ndim]
    stack_rank = max(primal.ndim, other.ndim, 2) - 2
    if primal.ndim >= 2:
        # (Without batch axes no padding: a matrix tangent stays a matrix, and a stack
        # times it is one GEMM, where a (1, k, n) operand would be one GEMM per matrix.)
        pad = (1,) * (stack_rank + 2 - primal.ndim) if lead else ()
        tangent = reshape(tangent, lead + pad + primal.shape)
        return _mm(tangent, other, ta, tb) if left else _mm(other, tangent, ta, tb)
    k = primal.shape[0]
    if other.ndim == 1:  # vector . vector
        return matmul(tangent, other)
    pad = (1,) * (other.ndim - 2)
    if left:  # (k,) @ (..., k, n): the tangent becomes rows (*lead, 1.., 1, k)
        out = _mm(reshape(tangent, lead + pad + (1, k)), other)
    else:  # (..., m, k) @ (k,): the tangent becomes columns (*lead, 1.., k, 1)
        out = _mm(other, reshape(tangent, lead + pad + (k, 1)))
    return reshape(out, lead + ans.shape)


defvjp(matmul_p, matmul_vjp_x, matmul_vjp_y)
defjvp(matmul_p, matmul_jvp)


def _matmul_deferred_shape(x: Tensor, y: Tensor, *, ta: bool = False, tb: bool = False) -> tuple:
    xs, ys = x.shape, y.shape
    if ta:
        xs = xs[:-2] + xs[-1:] + xs[-2:-1]
    if tb:
        ys = ys[:-2] + ys[-1:] + ys[-2:-1]
    return matmul_shape(xs, ys)


# A gradient wanted only for its tangent (a fresh HVP) leaves its weight GEMMs unrun.
DEFERRED_SHAPES[matmul_p] = _matmul_deferred_shape


def matmul_shape(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of x @ y (NumPy's rules); RuleError where they do not fit."""
    if not xs or not ys:
        raise RuleError(f"operands must not be scalars (shapes {xs} and {ys})")
    k_x = xs[-1]
    k_y = ys[0] if len(ys) == 1 else ys[-2]
    if k_x != k_y:
        raise RuleError(f"inner dimensions differ: {xs} @ {ys} ({k_x} != {k_y})")
    if len(xs) == 1 and len(ys) == 1:
        return ()
    if len(xs) == 1:
        return ys[:-2] + ys[-1:]
    if len(ys) == 1:
        return xs[:-1]
    if len(xs) == 2 or len(ys) == 2:  # one stack is empty: the other is the result's
        return (xs[:-2] or ys[:-2]) + (xs[-2], ys[-1])
    try:
        stack = broadcast(xs[:-2], ys[:-2])
    except RuleError:
        raise RuleError(f"stacked shapes {xs} and {ys} do not broadcast") from None
    return stack + (xs[-2], ys[-1])


def matmul_rule(b: dict[str, Any]) -> TensorType:
    x, y = pair(b["x"], b["y"])
    require(x, "numeric", "the operands")
    return TensorType(matmul_shape(x.shape, y.shape), x.dtype)


@public("linalg", shape_rule=matmul_rule)
def matmul(x: Any, y: Any) -> Tensor:
    """x @ y with NumPy's rules: stacked matrices broadcast, 1-D operands are vectors."""
    x, y = coerce_pair("matmul", x, y)
    xs, ys = x.shape, y.shape
    if len(xs) != 2 or len(ys) != 2 or xs[1] != ys[0]:  # two fitting matrices need no more
        checked("matmul", matmul_shape, xs, ys)
    return bind(matmul_p, x, y)


def outer_rule(b: dict[str, Any]) -> TensorType:
    x, y = pair(b["x"], b["y"])
    require(x, "numeric", "the operands")
    return TensorType((x.size, y.size), x.dtype)


@public("linalg", shape_rule=outer_rule)
def outer(x: Any, y: Any) -> Tensor:
    """Outer product of two vectors."""
    x, y = coerce_pair("outer", x, y)
    return multiply(_col(reshape(x, (-1,))), _row(reshape(y, (-1,))))


# ---- einsum ----
# Specs are made explicit by the wrapper (ellipses spelled out, output named), so the
# primitive sees only letters. Each operand's VJP is another einsum: the cotangent
# contracted with the other operands; letters summed away inside one operand come back
# by broadcasting. Batch axes of the cotangent get letters of their own.
def _einsum_impl(xp: Any, *operands: Any, spec: str) -> Any:
    return xp.einsum(spec, *operands, optimize=len(operands) > 2)


einsum_p = primitive("einsum", _einsum_impl)


def _parse(spec: str) -> tuple[list[str], str]:
    inputs, output = spec.split("->")
    return inputs.split(","), output


def einsum_vjp(argnum: int, ans: Tensor, *operands: Tensor, spec: str) -> Any:
    inputs, output = _parse(spec)
    target = inputs[argnum]
    others = [s for i, s in enumerate(inputs) if i != argnum]
    other_ops = [op for i, op in enumerate(operands) if i != argnum]
    available = set(output).union(*others) if others else set(output)
    reachable = "".join(c for c in target if c in available)
    shape = operands[argnum].shape

    def vjp(g: Tensor) -> Tensor:
        nb = batch_ndim(g, ans)
        used = set(spec)
        batch = "".join([c for c in string.ascii_letters if c not in used][:nb])
        sub = f"{batch}{output}," + ",".join(others) if others else f"{batch}{output}"
        sub = sub.rstrip(",") + f"->{batch}{reachable}"
        out = bind(einsum_p, g, *other_ops, spec=sub)
        if reachable != target:  # letters only `target` had: broadcast back
            sizes = dict(zip(target, shape, strict=True))
            expanded_shape = g.shape[:nb] + tuple(sizes[c] if c in reachable else 1 for c in target)
            out = broadcast_to(reshape(out, expanded_shape), g.shape[:nb] + shape)
        return out

    return vjp


def einsum_jvp(t: list, ans: Tensor, *operands: Tensor, spec: str) -> Tensor:
    inputs, output = _parse(spec)
    used = set(spec)
    total = None
    for i, tangent in enumerate(t):
        if tangent is None:
            continue
        nb = tangent.ndim - operands[i].ndim
        batch = "".join([c for c in string.ascii_letters if c not in used][:nb])
        subs = [batch + s if j == i else s for j, s in enumerate(inputs)]
        args = [tangent if j == i else op for j, op in enumerate(operands)]
        term = bind(einsum_p, *args, spec=",".join(subs) + "->" + batch + output)
        total = term if total is None else add(total, term)
    assert total is not None  # the JVP is called with at least one tangent
    return total


defvjp_argnum(einsum_p, einsum_vjp)
defjvp(einsum_p, einsum_jvp)


def einsum_spec(spec: str, shapes: list[tuple[int, ...]]) -> tuple[str, dict[str, int]]:
    """The spec made explicit (ellipses spelled out, the output named) and each letter's
    size, size-1 axes broadcast; RuleError where the spec does not fit the shapes."""
    if not shapes:
        raise RuleError("needs at least one operand", "op")
    spec = spec.replace(" ", "")
    if spec.count("->") > 1:
        raise RuleError(f"invalid spec {spec!r}", "op")
    inputs_part, output = spec.split("->") if "->" in spec else (spec, None)
    inputs = inputs_part.split(",")
    if len(inputs) != len(shapes):
        raise RuleError(f"spec {spec!r} names {len(inputs)} operands, got {len(shapes)}", "op")
    used = set(spec) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    ell_rank = 0
    for s, shape in zip(inputs, shapes, strict=True):
        if "..." in s:
            ell_rank = max(ell_rank, len(shape) - (len(s) - 3))
    ell = "".join(spare[:ell_rank])
    resolved = []
    for s, shape in zip(inputs, shapes, strict=True):
        if "..." in s:
            n = len(shape) - (len(s) - 3)
            if n < 0:
                raise RuleError(f"subscripts {s!r} do not match an operand of shape {shape}")
            s = s.replace("...", ell[ell_rank - n :] if n else "", 1)
        if (s and not s.isalpha()) or not s.isascii():
            raise RuleError(f"invalid subscripts {s!r}", "op")
        if len(s) != len(shape):
            raise RuleError(f"subscripts {s!r} do not match an operand of shape {shape}")
        if len(set(s)) != len(s):
            raise RuleError(
                f"repeated subscript in {s!r} (a diagonal or trace) is not supported",
                hint="multiply by gt.eye and sum instead",
            )
        resolved.append(s)
    if output is None:
        joined = "".join(resolved)
        output = ell + "".join(
            sorted(c for c in set(joined) if joined.count(c) == 1 and c not in ell)
        )
    else:
        output = output.replace("...", ell, 1)
    if (output and not (output.isalpha() and output.isascii())) or len(set(output)) != len(output):
        raise RuleError(f"invalid output subscripts {output!r}", "op")
    sizes: dict[str, int] = {}
    for s, shape in zip(resolved, shapes, strict=True):
        for c, d in zip(s, shape, strict=True):
            if sizes.setdefault(c, d) != d and 1 not in (d, sizes[c]):
                raise RuleError(f"index {c!r} has sizes {sizes[c]} and {d}")
            if sizes[c] == 1:
                sizes[c] = d
    for c in output:
        if c not in sizes:
            raise RuleError(f"output index {c!r} does not appear in the inputs", "op")
    return ",".join(resolved) + "->" + output, sizes


def einsum_rule(b: dict[str, Any]) -> TensorType:
    ops = same_dtypes(list(b.get("operands", ())))
    if ops:
        require(ops[0], "numeric", "the operands")
    explicit, sizes = einsum_spec(b["spec"], [op.shape for op in ops])
    return TensorType(tuple(sizes[c] for c in _parse(explicit)[1]), ops[0].dtype)


@public("linalg", shape_rule=einsum_rule, kinds={"spec": "spec"})
def einsum(spec: str, *operands: Any) -> Tensor:
    """Einstein summation, e.g. einsum('bij,jk->bik', x, w)."""
    tensors = coerce_all("einsum", operands)
    explicit, sizes = checked("einsum", einsum_spec, spec, [t.shape for t in tensors])
    # Size-1 broadcasting between operands is resolved up front so the rules never see it.
    inputs, _ = _parse(explicit)
    tensors = [
        broadcast_to(op, tuple(sizes[c] for c in s)) for s, op in zip(inputs, tensors, strict=True)
    ]
    return bind(einsum_p, *tensors, spec=explicit)


# ---- solve ----
solve_p = primitive("solve", lambda xp, a, b: xp.linalg.solve(a, b))


def _mT(a: Tensor) -> Tensor:
    return swapaxes(a, -1, -2)


def solve_vjp_b(ans: Tensor, a: Tensor, b: Tensor) -> Any:
    return lambda g: _solve_batched(_mT(a), g, b.ndim)


def solve_vjp_a(ans: Tensor, a: Tensor, b: Tensor) -> Any:
    def vjp(g: Tensor) -> Tensor:
        gb = _solve_batched(_mT(a), g, b.ndim)
        if b.ndim == 1:
            return negative(multiply(_col(gb), _row(ans)))
        return negative(_mm(gb, ans, tb=True))

    return vjp


def _solve_batched(a: Tensor, rhs: Tensor, b_ndim: int) -> Tensor:
    """a^-1 rhs where rhs has leading batch axes in front of a (n,) or (n, k) operand."""
    if b_ndim == 1:  # rhs (*batch, n): solve all columns at once
        flat = reshape(rhs, (-1, a.shape[-1]))
        out = bind(solve_p, a, swapaxes(flat, 0, 1))
        return reshape(swapaxes(out, 0, 1), rhs.shape)
    lead = rhs.shape[:-2]
    if not lead:
        return bind(solve_p, a, rhs)
    n, k = rhs.shape[-2:]
    flat = reshape(swapaxes(reshape(rhs, (-1, n, k)), 0, 1), (n, -1))
    out = bind(solve_p, a, flat)
    return reshape(swapaxes(reshape(out, (n, -1, k)), 0, 1), rhs.shape)


def solve_jvp(t: list, ans: Tensor, a: Tensor, b: Tensor) -> Tensor:
    rhs = None
    if t[1] is not None:
        rhs = t[1]
    if t[0] is not None:
        da_x = matmul(t[0], ans)
        rhs = negative(da_x) if rhs is None else add(rhs, negative(da_x))
    assert rhs is not None  # the JVP is called with at least one tangent
    return _solve_batched(a, rhs, b.ndim)


defvjp(solve_p, solve_vjp_a, solve_vjp_b)
defjvp(solve_p, solve_jvp)


def check_solve(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    if len(a) != 2 or a[0] != a[1]:
        raise RuleError(f"a must be a square matrix, got shape {a}")
    if len(b) not in (1, 2) or b[0] != a[0]:
        raise RuleError(f"b must be ({a[0]},) or ({a[0]}, k), got {b}")


def solve_rule(b: dict[str, Any]) -> TensorType:
    a, rhs = pair(b["a"], b["b"])
    require(a, "float", "a and b")
    check_solve(a.shape, rhs.shape)
    return rhs


@public("linalg", shape_rule=solve_rule)
def solve(a: Any, b: Any) -> Tensor:
    """x with a @ x = b, for a square (n, n) and b (n,) or (n, k)."""
    a, b = coerce_pair("solve", a, b)
    checked("solve", check_solve, a.shape, b.shape)
    return bind(solve_p, a, b)
