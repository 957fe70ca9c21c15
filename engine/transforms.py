"""Functional transforms built on the tape and the forward accumulator.

grad, value_and_grad, implicit gradients (TensorFlow's "all trainable variables the
function touched"), vjp, jvp, linearize, jacrev, jacfwd, hessian, hvp, and the reusable
HessianOperator: forward pass and inner gradient recorded once, then any number of
HVPs, each only the second-order pass.

Functions take tensors (or nested dicts/lists/tuples of them) as positional arguments;
Python numbers and arrays are converted. A transform differentiates with respect to the
argument *objects*: a tensor passed in and also captured by the function is
differentiated at both uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine import backend, replay, trace, tree
from engine.footprint import held_bytes
from engine.forward import ForwardAccumulator
from engine.ops.shape import concatenate, reshape, transpose
from engine.tape import GradientTape, check_source, constant_zeros
from engine.tensor import Tensor, as_tensor, pass_constant

Argnums = int | Sequence[int]


def normalize_argnums(argnums: Argnums, nargs: int, where: str) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in nums:
        if not -nargs <= i < nargs:
            raise ValueError(f"{where}: argnums {argnums} out of range for {nargs} argument(s)")
    return tuple(i % nargs for i in nums), single


def _tensorize(arg: Any) -> Any:
    """Convert the leaves of an argument to tensors, keeping its structure."""
    leaves, treedef = tree.flatten(arg)
    return tree.unflatten(treedef, [as_tensor(x) for x in leaves])


def prepare_arguments(args: tuple, nums: tuple[int, ...], where: str) -> tuple[tuple, list, list]:
    """Arguments with the differentiated ones tensorized; their flat leaves; treedefs."""
    out = list(args)
    flat: list[Tensor] = []
    defs = []
    for i in nums:
        out[i] = _tensorize(out[i])
        leaves, treedef = tree.flatten(out[i])
        flat.extend(check_source(x, where) for x in leaves)
        defs.append((treedef, len(leaves)))
    return tuple(out), flat, defs


def _regroup(flat: list, defs: list, single: bool) -> Any:
    out, k = [], 0
    for treedef, n in defs:
        out.append(tree.unflatten(treedef, flat[k : k + n]))
        k += n
    return out[0] if single else tuple(out)


def scalar_output(out: Any, where: str) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(f"{where}: the function must return a tensor, got {type(out).__name__}")
    if out.size != 1:
        raise ValueError(
            f"{where}: the function must return a scalar, got shape {out.shape}; "
            "use jacrev/jacobian for non-scalar outputs"
        )
    return out


# ----------------------------------------------------------------------------------------
# Reverse mode
# ----------------------------------------------------------------------------------------


def value_and_grad(
    f: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """f's value and its gradient with respect to the arguments in `argnums`.

    With has_aux, f returns (value, aux) and the answer is ((value, aux), grads).
    """

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nums, single = normalize_argnums(argnums, len(args), "value_and_grad")
        args, flat, defs = prepare_arguments(args, nums, "value_and_grad")
        with GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(flat)
            result = f(*args, **kwargs)
        value = result[0] if has_aux else result
        scalar_output(value, "grad")
        grads = tape.gradient(value, flat, unconnected_gradients="zero")
        return result, _regroup(grads, defs, single)

    return wrapped


def grad(f: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of scalar-valued f with respect to the arguments in `argnums`."""
    vg = value_and_grad(f, argnums, has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result, grads = vg(*args, **kwargs)
        return (grads, result[1]) if has_aux else grads

    return wrapped


def implicit_value_and_gradients(f: Callable[..., Any]) -> Callable[..., Any]:
    """f's value and [(gradient, variable), ...] for every trainable Variable f touched."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with GradientTape() as tape:
            value = f(*args, **kwargs)
        scalar_output(value, "implicit_gradients")
        variables = [v for v in tape.watched_variables() if v.dtype.kind == "f"]
        grads = tape.gradient(value, variables)
        return value, list(zip(grads, variables, strict=True))

    return wrapped


def implicit_gradients(f: Callable[..., Any]) -> Callable[..., Any]:
    """[(gradient, variable), ...] for every trainable Variable f touched (TensorFlow's
    implicit gradients)."""
    vg = implicit_value_and_gradients(f)
    return lambda *args, **kwargs: vg(*args, **kwargs)[1]


def vjp(f: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """(f(*primals), vjp_fn): vjp_fn(cotangent) gives one cotangent per primal.

    The forward pass is recorded once; vjp_fn may be called many times.
    """
    args, flat, defs = prepare_arguments(primals, tuple(range(len(primals))), "vjp")
    tape = GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
        tape.watch(flat)
        out = f(*args)
    outs, _ = tree.flatten(out)

    def vjp_fn(cotangent: Any) -> tuple:
        cts = tree.flatten(cotangent)[0]
        grads = tape.gradient(outs, flat, output_gradients=cts, unconnected_gradients="zero")
        return tuple(_regroup(grads, defs, False))

    return out, vjp_fn


def jacrev(
    f: Callable[..., Any], argnums: Argnums = 0, chunk_size: int | None = None
) -> Callable[..., Any]:
    """The jacobian of f by reverse mode: shape out.shape + arg.shape, all rows in one
    batched backward pass (in chunks of chunk_size rows)."""

    def wrapped(*args: Any) -> Any:
        nums, single = normalize_argnums(argnums, len(args), "jacrev")
        args, flat, defs = prepare_arguments(args, nums, "jacrev")
        with GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(flat)
            out = f(*args)
        if not isinstance(out, Tensor):
            raise TypeError("jacrev: the function must return a single tensor")
        jac = tape.jacobian(out, flat, unconnected_gradients="zero", chunk_size=chunk_size)
        return _regroup(jac, defs, single)

    return wrapped


# ----------------------------------------------------------------------------------------
# Forward mode
# ----------------------------------------------------------------------------------------


def jvp(f: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    """(f(*primals), J @ tangents): one forward pass with tangents alongside."""
    primals, tangents = tuple(primals), tuple(tangents)
    if len(primals) != len(tangents):
        raise ValueError(f"jvp: {len(tangents)} tangents for {len(primals)} primals")
    args = [_tensorize(p) for p in primals]
    with ForwardAccumulator(args, [_tensorize(t) for t in tangents]) as acc:
        out = f(*args)
    return out, acc.jvp(out, unconnected_gradients="zero")


def linearize(f: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """(f(*primals), f_jvp) where f_jvp(*tangents) = J @ tangents, reusable.

    f runs once. Its VJP (linear in the cotangent) is recorded once on a persistent tape;
    each f_jvp call transposes that recording with one backward pass, so no forward pass
    of f is ever repeated.
    """
    args, flat, _ = prepare_arguments(primals, tuple(range(len(primals))), "linearize")
    inner = GradientTape(persistent=True, watch_accessed_variables=False)
    with inner:
        inner.watch(flat)
        out = f(*args)
    outs, out_def = tree.flatten(out)
    dummies = [Tensor(backend.array_module(o.value).zeros_like(o.value)) for o in outs]
    outer = GradientTape(persistent=True, watch_accessed_variables=False)
    with outer:
        outer.watch(dummies)
        transposed = inner.gradient(outs, flat, output_gradients=dummies)
    pairs = [(g, s) for g, s in zip(transposed, flat, strict=True) if g is not None]

    def f_jvp(*tangents: Any) -> Any:
        flat_t = tree.flatten([_tensorize(t) for t in tangents])[0]
        if len(flat_t) != len(flat):
            raise ValueError(f"linearize: {len(flat_t)} tangents for {len(flat)} primals")
        keep = [
            (g, t)
            for (g, s), t in zip(pairs, [flat_t[flat.index(s)] for _, s in pairs], strict=True)
        ]
        if not keep:
            return tree.unflatten(out_def, [zeros_with_lead(o) for o in outs])
        nb = flat_t[0].ndim - flat[0].ndim
        cts = outer._run([g for g, _ in keep], [t for _, t in keep], dummies, nb)
        lead = flat_t[0].shape[:nb]
        result = [cts.get(id(d)) for d in dummies]
        result = [
            zeros_with_lead(o, lead) if r is None else r for r, o in zip(result, outs, strict=True)
        ]
        return tree.unflatten(out_def, result)

    return out, f_jvp


def jacfwd(f: Callable[..., Any], argnums: Argnums = 0) -> Callable[..., Any]:
    """The jacobian of f by forward mode: one pass with a batch of basis tangents."""

    def wrapped(*args: Any) -> Any:
        nums, single = normalize_argnums(argnums, len(args), "jacfwd")
        args, flat, defs = prepare_arguments(args, nums, "jacfwd")
        blocks = _forward_columns(lambda: f(*args), flat)
        return _regroup(blocks, defs, single)

    return wrapped


def _basis_tangents(flat: list[Tensor]) -> list[Tensor]:
    """Identity rows over all sources together: (n_total, *source.shape) each."""
    sizes = [s.size for s in flat]
    total = sum(sizes)
    out, start = [], 0
    for s, n in zip(flat, sizes, strict=True):
        xp = backend.array_module(s.value)
        rows = xp.zeros((total, n), dtype=s.dtype)
        rows[xp.arange(start, start + n), xp.arange(n)] = 1
        out.append(pass_constant(rows.reshape((total,) + s.shape)))  # shapes alone
        start += n
    return out


def _unit_tangents(source: Tensor, start: int, stop: int) -> Tensor:
    """Identity rows start..stop of one source: (stop - start, *source.shape)."""
    xp = backend.array_module(source.value)
    rows = xp.zeros((stop - start, source.size), dtype=source.dtype)
    rows[xp.arange(stop - start), xp.arange(start, stop)] = 1
    return pass_constant(rows.reshape((stop - start,) + source.shape))


def forward_jacobian(
    run: Callable[[], Tensor],
    sources: list[Tensor],
    chunk_size: int | None = None,
    unconnected_gradients: str = "none",
) -> tuple[Tensor, list[Tensor | None]]:
    """(out, per source d out / d source with shape out.shape + source.shape) by forward
    mode: run() under batches of unit tangents, `chunk_size` columns of one source per
    pass. A pass costs what the forward costs times its tangents, so the jacobian of a
    tall output (a per-example loss vector over N examples, more rows than parameters)
    costs O(N x parameters), where reverse mode's rows each carry the whole batch
    (O(N^2)). The passes number sum_j ceil(n_j / chunk_size), whatever the output's
    size. An unconnected source is None, or zeros with unconnected_gradients="zero"."""
    out: Tensor | None = None
    blocks: list[Tensor | None] = []
    for source in sources:
        step = source.size if chunk_size is None else max(1, chunk_size)
        columns: list[Any] = []
        for start in range(0, source.size, step):
            stop = min(source.size, start + step)
            with ForwardAccumulator([source], [_unit_tangents(source, start, stop)], 1) as acc:
                out = run()
            found = acc.jvp(out, unconnected_gradients="none")
            if found is None:
                columns = []
                break
            columns.append(found)
        if out is None:  # a source of no elements: the output still needs a run
            out = run()
        if not columns:
            if unconnected_gradients == "zero" or source.size == 0:
                xp = backend.array_module(out.value)
                zeros = xp.zeros(out.shape + source.shape, dtype=out.dtype)
                blocks.append(pass_constant(zeros))
            else:
                blocks.append(None)
            continue
        stacked = columns[0] if len(columns) == 1 else concatenate(columns, axis=0)
        moved = transpose(stacked, list(range(1, stacked.ndim)) + [0])  # (*out, n)
        blocks.append(reshape(moved, out.shape + source.shape))
    if out is None:
        out = run()
    return out, blocks


def _forward_columns(run: Callable[[], Any], flat: list[Tensor]) -> list[Tensor]:
    """Per source, d out / d source with shape out.shape + source.shape."""
    with ForwardAccumulator(flat, _basis_tangents(flat), batch_ndim=1) as acc:
        out = run()
    if not isinstance(out, Tensor):
        raise TypeError("jacfwd: the function must return a single tensor")
    columns = acc.jvp(out, unconnected_gradients="zero")  # (n_total, *out.shape)
    return _split_columns(columns, out, flat)


def _split_columns(columns: Tensor, out: Tensor, flat: list[Tensor]) -> list[Tensor]:
    blocks, start = [], 0
    moved = transpose(columns, list(range(1, columns.ndim)) + [0])  # (*out, n_total)
    for s in flat:
        piece = moved[..., start : start + s.size]
        blocks.append(reshape(piece, out.shape + s.shape))
        start += s.size
    return blocks


# ----------------------------------------------------------------------------------------
# Second order
# ----------------------------------------------------------------------------------------


def hessian(f: Callable[..., Any], argnums: Argnums = 0) -> Callable[..., Any]:
    """The Hessian of scalar f, forward-over-reverse: one forward-mode pass with a batch
    of basis tangents through the gradient. With several argnums, blocks `H[i][j]` of
    shape arg_i.shape + arg_j.shape."""

    def wrapped(*args: Any) -> Any:
        nums, single = normalize_argnums(argnums, len(args), "hessian")
        args, flat, defs = prepare_arguments(args, nums, "hessian")
        with ForwardAccumulator(flat, _basis_tangents(flat), batch_ndim=1) as acc:
            with GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(flat)
                value = scalar_output(f(*args), "hessian")
            tape._defer_source_primals = True  # only the gradients' tangents are used
            grads = tape.gradient(value, flat, unconnected_gradients="zero")
        rows = []
        for g in grads:
            columns = acc.jvp(g, unconnected_gradients="zero")  # (n_total, *g.shape)
            rows.append(_split_columns(columns, g, flat))
        if single and len(flat) == 1:
            return _regroup([rows[0][0]], defs, True)
        return tuple(tuple(r) for r in rows)

    return wrapped


def hvp(f: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
    """H @ v for scalar f at primals (forward-over-reverse), in the primals' structure.

    A fresh computation: forward, gradient and the tangent pass. For many HVPs at one
    point use hessian_operator.
    """
    primals, tangents = tuple(primals), tuple(tangents)
    args, flat, defs = prepare_arguments(primals, tuple(range(len(primals))), "hvp")
    flat_t = tree.flatten([_tensorize(t) for t in tangents])[0]
    if len(flat_t) != len(flat):
        raise ValueError(f"hvp: {len(flat_t)} tangent leaves for {len(flat)} primal leaves")
    with ForwardAccumulator(flat, flat_t) as acc:
        with GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(flat)
            value = scalar_output(f(*args), "hvp")
        # Only the gradients' tangents are used: the GEMMs of the gradients themselves
        # (the weights' products) are deferred and never run.
        tape._defer_source_primals = True
        grads = tape.gradient(value, flat, unconnected_gradients="zero")
    out = [acc.jvp(g, unconnected_gradients="zero") for g in grads]
    return _regroup(out, defs, False)


class HessianOperator:
    """The Hessian of f at one point, as a reusable linear operator.

    Built once: the forward pass and the inner gradient are recorded on a persistent tape.
    Each `hvp(v)` afterwards is one backward pass over that recording
    (reverse-over-reverse, H being symmetric): no forward pass, nothing new recorded, so
    memory stays flat however many HVPs are asked. `hvp_many(V)` answers K vectors in one
    batched pass (each leaf of V has a leading axis of size K), or, when `max_batch` is
    set (a memory bound: a pass's temporaries grow with its batch), in passes of at most
    `max_batch` vectors whose products are joined.

    `fun(x)`, `jac(x)` and `hessp(x, p)` take flat float64 vectors, for
    scipy.optimize.minimize(method="trust-ncg" / "newton-cg"); a new x re-records there.

    compiled: the second pass of each vector layout is captured (engine/replay.py) and
    later passes of that layout replay its array calls, with the same answers (the first
    runs dynamically: a one-off product pays nothing for a capture); a pass that cannot
    be captured stays dynamic (`replay_status()` says why). False: every pass is the
    dynamic sweep.
    """

    def __init__(
        self,
        f: Callable[..., Any],
        *primals: Any,
        max_batch: int | None = None,
        compiled: bool = True,
    ):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._f = f
        self.max_batch = max_batch
        self.compiled = compiled
        self._record(primals)

    def _record(self, primals: tuple) -> None:
        args, flat, defs = prepare_arguments(
            primals, tuple(range(len(primals))), "hessian_operator"
        )
        tape = GradientTape(persistent=True, watch_accessed_variables=False)
        with tape:
            tape.watch(flat)
            with GradientTape(watch_accessed_variables=False) as inner:
                inner.watch(flat)
                value = scalar_output(self._f(*args), "hessian_operator")
            grads = inner.gradient(value, flat, unconnected_gradients="zero")
        self._tape, self._flat, self._defs = tape, flat, defs
        self._value, self._grads = value, grads
        self.primals = _regroup(flat, defs, False)
        self._point: np.ndarray | None = None
        # Per vector layout: its replay.Schedule, or why the pass is not replayable (and
        # how many captures were tried).
        # at most 8 vector layouts keep a schedule (and its buffers) at once
        self._passes = replay.Passes(limit=8)

    @property
    def value(self) -> Tensor:
        """f at the point."""
        return self._value

    @property
    def grad(self) -> tuple:
        """The gradient at the point, in the primals' structure."""
        return _regroup(self._grads, self._defs, False)

    def hvp(self, *vectors: Any) -> tuple:
        """H @ v, one vector per primal (same structure and shapes)."""
        return self._apply(vectors, 0)

    def hvp_many(self, *vectors: Any) -> tuple:
        """H @ v for K vectors at once: each leaf has shape (K, *primal.shape)."""
        leaves, treedef = tree.flatten(list(vectors))
        leaves = [as_tensor(v) for v in leaves]
        counts = {v.shape[0] if v.ndim else -1 for v in leaves}  # -1: a 0-d leaf
        if self.max_batch is None or len(counts) != 1 or max(counts, default=0) <= self.max_batch:
            return self._apply(vectors, 1)  # (mismatched leading axes raise there)
        count = counts.pop()
        passes = []
        for start in range(0, count, self.max_batch):
            part = tree.unflatten(treedef, [v[start : start + self.max_batch] for v in leaves])
            passes.append(tree.flatten(self._apply(tuple(part), 1)))
        structure = passes[0][1]  # the primals' structure, as one pass answers
        with trace.nothing_recording():
            joined = [
                concatenate([p[0][i] for p in passes], axis=0) for i in range(len(passes[0][0]))
            ]
        return tree.unflatten(structure, joined)

    def _apply(self, vectors: tuple, batch_ndim: int) -> tuple:
        # Nothing that happens to be recording around this call sees the HVP pass: it
        # must record nothing new anywhere (and may then reuse cached rule stages).
        with trace.nothing_recording():
            return self._apply_unrecorded(vectors, batch_ndim)

    def _apply_unrecorded(self, vectors: tuple, batch_ndim: int) -> tuple:
        flat_v = [as_tensor(v) for v in tree.flatten(list(vectors))[0]]
        if len(flat_v) != len(self._flat):
            raise ValueError(f"hvp: {len(flat_v)} vector leaves for {len(self._flat)} primals")
        lead = flat_v[0].shape[:batch_ndim] if flat_v else ()
        for v, p in zip(flat_v, self._flat, strict=True):
            if v.shape != lead + p.shape:
                raise ValueError(
                    f"hvp: vector of shape {v.shape} for a primal of shape {lead + p.shape}"
                )
            if v.dtype != p.dtype:
                raise TypeError(f"hvp: vector dtype {v.dtype} differs from the primal's {p.dtype}")
        return _regroup(self._product(flat_v, batch_ndim, lead), self._defs, False)

    def _product(self, flat_v: list[Tensor], batch_ndim: int, lead: tuple) -> list[Tensor]:
        """The product on checked flat vectors, one per primal (the curvature operators
        of engine.curvature override this and keep the rest)."""
        products = self._second_order_pass(flat_v, batch_ndim)
        return [
            zeros_with_lead(p, lead) if h is None else h
            for h, p in zip(products, self._flat, strict=True)
        ]

    def _dynamic_pass(self, flat_v: list[Tensor], batch_ndim: int) -> list[Tensor | None]:
        cts = self._tape._run(self._grads, flat_v, self._flat, batch_ndim)
        return [cts.get(id(p)) for p in self._flat]

    def _second_order_pass(self, flat_v: list[Tensor], batch_ndim: int) -> list[Tensor | None]:
        """H v per primal (None where unreached): the first pass of a vector layout is
        dynamic, the second captured, later ones replayed (replay.Passes)."""
        arrays = [v.value for v in flat_v]
        if not self.compiled or not all(type(a) is np.ndarray for a in arrays):
            return replay.run_dynamic(
                replay.why_dynamic(self.compiled), lambda: self._dynamic_pass(flat_v, batch_ndim)
            )
        key = (batch_ndim, tuple((a.shape, a.strides) for a in arrays))
        return self._passes.run(
            key,
            flat_v,
            lambda seeds: self._dynamic_pass(seeds, batch_ndim),
            lambda: replay.known_tensors(self._tape, self._grads, self._flat),
        )

    @property
    def replay_changes(self) -> int:
        """Moves whenever what the compiled passes keep changes (a layout seen, captured or
        evicted, a schedule's buffers allocated): when to count `nbytes()` again."""
        return self._passes.changes

    def replay_status(self) -> dict[str, str]:
        """Per vector layout: "compiled", or why (or that) its passes are dynamic."""
        return {
            f"batch_ndim={k[0]} shapes={[s for s, _ in k[1]]}": v
            for k, v in self._passes.status().items()
        }

    # SciPy adapter ----------------------------------------------------------------------
    @property
    def size(self) -> int:
        return sum(p.size for p in self._flat)

    def _flatten(self, tensors: Sequence[Tensor]) -> np.ndarray:
        return np.concatenate([np.asarray(t.numpy(), np.float64).ravel() for t in tensors])

    def _split(self, x: np.ndarray, like: Sequence[Tensor]) -> list[Tensor]:
        out, start = [], 0
        for p in like:
            chunk = np.asarray(x[start : start + p.size]).reshape(p.shape)
            out.append(Tensor(backend.asarray(chunk, p.dtype, p.device)))
            start += p.size
        return out

    def _move_to(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).ravel()
        if x.size != self.size:
            raise ValueError(f"expected a vector of {self.size} parameters, got {x.size}")
        current = self._point if self._point is not None else self._flatten(self._flat)
        if not np.array_equal(current, x):
            new = self._split(x, self._flat)
            self._record(tuple(_regroup(new, self._defs, False)))
        self._point = x

    def fun(self, x: np.ndarray) -> float:
        self._move_to(x)
        return float(self._value.numpy())

    def jac(self, x: np.ndarray) -> np.ndarray:
        self._move_to(x)
        return self._flatten(self._grads)

    def hessp(self, x: np.ndarray, p: np.ndarray) -> np.ndarray:
        self._move_to(x)
        vectors = self._split(np.asarray(p, np.float64).ravel(), self._flat)
        return self._flatten(tree.flatten(self._apply(tuple(vectors), 0))[0])

    # Dense forms, for small parameter counts ------------------------------------------
    def dense(
        self, chunk_size: int = 1024, progress: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """H as an (n, n) float64 host matrix over the flattened primals (n = `size`):
        `chunk_size` rows of the identity per batched HVP pass give those rows of H (it is
        symmetric). `progress(done, total)` is called after each pass."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        n = self.size
        offsets = np.cumsum([0, *(p.size for p in self._flat)])
        rows = []
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            identity = np.zeros((stop - start, n))
            identity[np.arange(stop - start), np.arange(start, stop)] = 1.0
            basis = [
                Tensor(
                    backend.asarray(
                        identity[:, lo:hi].reshape((stop - start, *p.shape)), p.dtype, p.device
                    )
                )
                for p, lo, hi in zip(self._flat, offsets[:-1], offsets[1:], strict=True)
            ]
            columns = tree.flatten(self.hvp_many(*_regroup(basis, self._defs, False)))[0]
            rows.append(
                np.concatenate(
                    [np.asarray(c.numpy(), np.float64).reshape(stop - start, -1) for c in columns],
                    axis=1,
                )
            )
            if progress is not None:
                progress(stop, n)
        return np.concatenate(rows, axis=0) if rows else np.zeros((0, 0))

    def newton_step(
        self, damping: float, dense: np.ndarray | None = None
    ) -> tuple[np.ndarray, ...]:
        """The step s solving (H + damping I) s = g at the point (x - s is the damped
        Newton iterate), in the primals' structure and dtypes, as host arrays. `dense`:
        H already built by `dense()`. Raises SingularHessianError when H + damping I is
        singular or the step is not finite."""
        h = self.dense() if dense is None else dense
        g = self._flatten(self._grads)
        try:
            step = np.linalg.solve(h + damping * np.eye(g.size), g)
        except np.linalg.LinAlgError:
            raise SingularHessianError(
                f"H + {damping:g} I is singular, so the Newton step is undefined"
            ) from None
        if not np.isfinite(step).all():
            raise SingularHessianError("the Newton step is not finite")
        out, start = [], 0
        for p in self._flat:
            out.append(step[start : start + p.size].reshape(p.shape).astype(p.dtype))
            start += p.size
        return _regroup(out, self._defs, False)

    def nbytes(self) -> int:
        """Bytes of the array buffers the recording holds (each buffer once, views
        counted by their base): what keeping this operator costs."""
        return held_bytes(self)


class SingularHessianError(ValueError):
    """H + damping I cannot be solved (raise the damping)."""


def hessian_operator(
    f: Callable[..., Any], *primals: Any, max_batch: int | None = None, compiled: bool = True
) -> HessianOperator:
    """Record f and its gradient at primals once; return the reusable HessianOperator."""
    return HessianOperator(f, *primals, max_batch=max_batch, compiled=compiled)


def zeros_with_lead(o: Tensor, lead: tuple = ()) -> Tensor:
    # (a constant of a pass being captured: an unreached product is zeros whatever the data)
    return constant_zeros(lead + o.shape, o)


__all__ = [
    "HessianOperator",
    "grad",
    "hessian",
    "hessian_operator",
    "hvp",
    "implicit_gradients",
    "implicit_value_and_gradients",
    "jacfwd",
    "jacrev",
    "jvp",
    "linearize",
    "value_and_grad",
    "vjp",
]
