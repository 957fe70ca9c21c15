"""Benchmark gradtape against PyTorch (CPU), JAX (CPU) and a hand-written NumPy floor.

Every framework runs in ONE process, on the SAME seeded float32 inputs (made in
NumPy and converted), for an MLP regression loss

    out  = W_L^T act(... act(x @ W_1 + b_1) ...) + b_L      (act = tanh or relu)
    loss = mean((out - y) ** 2)                            (y: fixed random targets)

with weights W_i of shape (in, out) and biases b_i. Sizes:

    small   B=32,   d=16,   hidden 2 x 32,   out 4
    medium  B=256,  d=256,  hidden 3 x 512,  out 10
    large   B=1024, d=1024, hidden 3 x 2048, out 10

Rows of each table: median wall time of one call (time.perf_counter; JAX results
.block_until_ready()) after one warm-up call, over at least --repeat calls and
--min-time seconds, at most --budget seconds; a call slower than --budget is
timed once, its warm-up call being the measurement. Before anything is timed,
every case runs once at size small, so one-time library initialisation stays out.

    gradient        loss + gradients of all parameters
    HVP fresh       Hessian-vector product wrt all parameters from scratch
                    (forward + gradient + second-order pass)
    HVP reused      forward and inner gradient recorded once (not timed); each call
                    runs only the second-order pass for one vector
    HVP reused xK   the same for K=16 vectors in one call, time PER VECTOR
    batch jac       d out / d x per example, (B, out, d)
    jac W1          full jacobian d out / d W1, (B, out, d, h1), chunked over rows;
                    skipped where the result alone would exceed --max-jac-gb

How each column computes them:

    gradtape  GradientTape.gradient; gt.hvp; gt.hessian_operator(...).hvp/.hvp_many;
              tape.batch_jacobian; gt.jacrev(chunk_size=...). A missing engine or
              API prints "n/a" for that cell instead of failing the run.
    torch     eager autograd.grad; double backward (create_graph=True) for a fresh
              HVP; autograd.grad(g, params, v, retain_graph=True) on a graph built
              once for reused HVPs (is_grads_batched=True for K vectors);
              func.vmap(func.jacrev(f_single)); func.jacrev(chunk_size=...).
    jax       everything jax.jit'd and compiled ahead of time (not timed):
              value_and_grad; jvp(grad(f)) for a fresh HVP; linearize(grad(f))
              once, then the (vmap'd) linear function, its residuals as arguments;
              vmap(jacrev(f_single)); jacrev, or vjp + lax.map(batch_size=chunk)
              over the one-hot basis when the jacobian is chunked.
    floor     hand-written NumPy: forward/backward for the gradient, forward-over-
              reverse (Pearlmutter R-op) for HVPs (batched over K with leading
              axes), a backward pass with a batched one-hot cotangent for both
              jacobians (the same algorithm a vectorized reverse-mode jacobian runs).
              It is self-checked against float64 finite differences at start-up.

Ratios are gradtape / peer (lower is better for gradtape). The Python garbage
collector stays enabled (an engine that makes reference cycles pays for them).

Run (from the repository root, in the peers' virtualenv):

    env -u OPENBLAS_CORETYPE .venv-bench/bin/python bench/bench_engine.py \
        [--sizes small,medium,large] [--repeat N] [--write bench/RESULTS.md]
    .venv-bench/bin/python bench/bench_engine.py --check     # agreement check only
    .venv-bench/bin/python bench/bench_engine.py --malloc-env ...   # see below
    .venv-bench/bin/python bench/bench_engine.py --help

OPENBLAS_CORETYPE=Haswell (set on some of our machines) makes NumPy's OpenBLAS
use slower kernels (about 1.6x slower sgemm measured here); the script warns
when it is set. glibc returning freed memory to the OS between calls turns into
page faults on the next call; the header says whether MALLOC_TRIM_THRESHOLD_ /
MALLOC_MMAP_THRESHOLD_ are set, --malloc-env re-runs the script with both set,
and --diagnostics adds a table of minor page faults per call.

On a small machine, CPU taken by anything else (another process, or the
hypervisor as steal time) stalls multi-threaded BLAS at its barriers and can
make an eager framework 10-30x slower for as long as it lasts, while JAX's
work-stealing pool barely notices. The script measures that "foreign" CPU
while timing each cell (every other process's CPU time in /proc, plus steal),
marks cells where it exceeded 5% of the machine with "*", re-times them once
the machine is quiet (--retries, --quiet-wait) and warns at start if the
machine is busy. Where the machine cannot be had quiet, --single-thread (every
framework on one thread) gives steadier per-core numbers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import platform
import resource
import shlex
import signal
import statistics
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter, sleep

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("gradtape", "torch", "jax", "floor")
K_VECTORS = 16
MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),  # keep up to 1 GiB of free heap
    "MALLOC_MMAP_THRESHOLD_": str(1 << 25),  # 32 MiB: glibc's maximum
}
SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",  # torch (libgomp)
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",  # NumPy: gradtape and the floor
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",  # JAX
}
# environment variables that change the numbers: recorded in the header and command
ENV_VARS = ("OPENBLAS_CORETYPE", *SINGLE_THREAD_ENV, *MALLOC_ENV)
NA_ERRORS = (ImportError, AttributeError, NotImplementedError)
NOISY_SHARE = 0.05  # cells timed while others took more of the CPU than this get a "*"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Size:
    name: str
    batch: int
    d_in: int
    hidden: tuple[int, ...]
    d_out: int
    repeat: int  # default number of timed calls per cell

    def describe(self) -> str:
        h = self.hidden
        return f"B={self.batch}, d={self.d_in}, hidden={len(h)}x{h[0]}, out={self.d_out}"


SIZES = {
    s.name: s
    for s in (
        Size("small", 32, 16, (32, 32), 4, repeat=30),
        Size("medium", 256, 256, (512, 512, 512), 10, repeat=10),
        Size("large", 1024, 1024, (2048, 2048, 2048), 10, repeat=3),
    )
}

ROWS = {
    "grad": "gradient",
    "hvp_fresh": "HVP fresh",
    "hvp_reused": "HVP reused (1 vector)",
    "hvp_batched": f"HVP reused x{K_VECTORS}",
    "batch_jac": "batch jacobian d out/d x",
    "jac_w1": "jacobian d out/d W1",
}


# --------------------------------------------------------------------------- problem


@dataclass
class Problem:
    """Seeded inputs shared by all frameworks (NumPy arrays)."""

    size: Size
    activation: str
    x: np.ndarray
    y: np.ndarray
    params: list[np.ndarray]  # [W1, b1, W2, b2, ...]
    v: list[np.ndarray]  # one HVP direction, shaped like params
    vs: list[np.ndarray]  # K directions, each (K, *param.shape)
    jac_chunk: int | None  # rows per chunk of the W1 jacobian (None: all at once)

    @property
    def jac_w1_bytes(self) -> int:
        b, o = self.y.shape
        return b * o * self.params[0].size * self.x.itemsize


def make_problem(
    size: Size, activation: str, seed: int = 0, dtype=np.float32, chunk_mb: int = 256
) -> Problem:
    rng = np.random.default_rng(seed)
    dims = (size.d_in, *size.hidden, size.d_out)
    params = []
    for d_in, d_out in itertools.pairwise(dims):
        params.append(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in))
        params.append(0.1 * rng.standard_normal(d_out))
    x = rng.standard_normal((size.batch, size.d_in))
    y = rng.standard_normal((size.batch, size.d_out))
    v = [rng.standard_normal(p.shape) for p in params]
    vs = [rng.standard_normal((K_VECTORS, *p.shape)) for p in params]
    # W1 jacobian rows per chunk: bound each chunk's (rows, B, hidden) cotangents
    row_bytes = size.batch * max(size.hidden) * np.dtype(dtype).itemsize
    chunk = max(1, (chunk_mb << 20) // row_bytes)

    def cast(arrays):
        return [a.astype(dtype) for a in arrays]

    return Problem(
        size=size,
        activation=activation,
        x=x.astype(dtype),
        y=y.astype(dtype),
        params=cast(params),
        v=cast(v),
        vs=cast(vs),
        jac_chunk=None if chunk >= size.batch * size.d_out else chunk,
    )


def mlp(x, params, act):
    """The model, written once for every array type that has @ and +."""
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < n_layers - 1:
            h = act(h)
    return h


# ------------------------------------------------------------------ NumPy floor


def _mm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a @ w for an `a` with any leading axes and a 2-D `w`, as a single GEMM."""
    if a.ndim <= 2:
        return a @ w
    return (a.reshape(-1, a.shape[-1]) @ w).reshape(*a.shape[:-1], w.shape[-1])


def _activation(name: str, z: np.ndarray, second_order: bool):
    """Return act(z), act'(z) and act''(z) (None where it is zero or not asked)."""
    if name == "tanh":
        h = np.tanh(z)
        d1 = 1 - h * h
        return h, d1, (-2 * h * d1 if second_order else None)
    if name == "relu":
        return np.maximum(z, 0), (z > 0).astype(z.dtype), None
    raise ValueError(f"unknown activation {name!r}")


@dataclass
class _Forward:
    hs: list[np.ndarray]  # hs[i]: input of layer i (hs[0] = x)
    d1: list[np.ndarray]  # act'(z_i) for hidden layers
    d2: list[np.ndarray | None]  # act''(z_i) for hidden layers
    out: np.ndarray


@dataclass
class _Backward:
    loss: np.ndarray
    grads: list[np.ndarray]  # dL/dW_i, dL/db_i interleaved
    gz: list[np.ndarray]  # gz[i] = dL/dz_i (z_{L-1} = out)
    gh: list[np.ndarray | None]  # gh[i] = dL/dhs[i] for i >= 1


class NumpyFloor:
    """Hand-written forward / backward / R-op passes: the cost to beat."""

    name = "floor"

    def __init__(self, prob: Problem):
        self.prob = prob
        self.weights = prob.params[0::2]
        self.n_layers = len(self.weights)

    # -- passes

    def forward(self, params, x, second_order=False) -> _Forward:
        hs, d1s, d2s = [x], [], []
        h = x
        for i in range(self.n_layers - 1):
            h, d1, d2 = _activation(
                self.prob.activation, h @ params[2 * i] + params[2 * i + 1], second_order
            )
            hs.append(h)
            d1s.append(d1)
            d2s.append(d2)
        out = h @ params[-2] + params[-1]
        return _Forward(hs, d1s, d2s, out)

    def backward(self, fwd: _Forward, params) -> _Backward:
        n = self.n_layers
        r = fwd.out - self.prob.y
        loss = np.mean(r * r)
        grads, gz, gh = [None] * (2 * n), [None] * n, [None] * n
        g = (2 / r.size) * r
        for i in reversed(range(n)):
            gz[i] = g
            grads[2 * i] = fwd.hs[i].T @ g
            grads[2 * i + 1] = g.sum(axis=0)
            if i == 0:
                break
            gh[i] = g @ params[2 * i].T
            g = gh[i] * fwd.d1[i - 1]
        return _Backward(loss, grads, gz, gh)

    def r_pass(self, fwd: _Forward, bwd: _Backward, params, vs) -> list[np.ndarray]:
        """Pearlmutter's R-op: H @ vs, forward tangents then reverse tangents.

        Every direction in `vs` may carry the same leading batch axes (K, ...).
        """
        n = self.n_layers
        vw, vb = vs[0::2], vs[1::2]
        rh = [None] * n  # tangent of hs[i]; x is a constant
        rz = [None] * n  # tangent of z_i
        for i in range(n):
            t = fwd.hs[i] @ vw[i] + vb[i][..., None, :]
            if rh[i] is not None:
                t = t + _mm(rh[i], params[2 * i])
            rz[i] = t
            if i + 1 < n:
                rh[i + 1] = fwd.d1[i] * t
        hv = [None] * (2 * n)
        rgz = (2 / fwd.out.size) * rz[-1]
        for i in reversed(range(n)):
            rw = fwd.hs[i].T @ rgz
            if rh[i] is not None:
                rw = rw + rh[i].swapaxes(-1, -2) @ bwd.gz[i]
            hv[2 * i], hv[2 * i + 1] = rw, rgz.sum(axis=-2)
            if i == 0:
                break
            rgh = _mm(rgz, params[2 * i].T) + bwd.gz[i] @ vw[i].swapaxes(-1, -2)
            rgz = rgh * fwd.d1[i - 1]
            if fwd.d2[i - 1] is not None:
                rgz = rgz + bwd.gh[i] * fwd.d2[i - 1] * rz[i - 1]
        return hv

    def out_vjp_x(self, fwd: _Forward, cot_h: np.ndarray) -> np.ndarray:
        """Pull a batch of cotangents on the last hidden output back to x."""
        g = cot_h
        for i in reversed(range(self.n_layers - 1)):
            g = _mm(g * fwd.d1[i], self.weights[i].T)
        return g

    # -- benchmark cases (each returns a zero-argument callable)

    def grad(self):
        p = self.prob

        def run():
            bwd = self.backward(self.forward(p.params, p.x), p.params)
            return bwd.loss, bwd.grads

        return run

    def hvp_fresh(self):
        p = self.prob

        def run():
            fwd = self.forward(p.params, p.x, second_order=True)
            return self.r_pass(fwd, self.backward(fwd, p.params), p.params, p.v)

        return run

    def _recorded(self):
        p = self.prob
        fwd = self.forward(p.params, p.x, second_order=True)
        return fwd, self.backward(fwd, p.params)

    def hvp_reused(self):
        fwd, bwd = self._recorded()
        return lambda: self.r_pass(fwd, bwd, self.prob.params, self.prob.v)

    def hvp_batched(self):
        fwd, bwd = self._recorded()
        return lambda: self.r_pass(fwd, bwd, self.prob.params, self.prob.vs)

    def batch_jac(self):
        p, w_last = self.prob, self.weights[-1]
        d_out, batch = w_last.shape[1], p.x.shape[0]

        def run():
            fwd = self.forward(p.params, p.x)
            # cotangent e_o on every example at once, pulled through the last layer
            cot = np.broadcast_to(w_last.T[:, None, :], (d_out, batch, w_last.shape[0]))
            return self.out_vjp_x(fwd, cot).transpose(1, 0, 2)

        return run

    def jac_w1(self):
        p = self.prob
        batch, d_out = p.y.shape
        rows = batch * d_out
        chunk = p.jac_chunk or rows
        w_last = self.weights[-1]

        def run():
            fwd = self.forward(p.params, p.x)
            jac = np.empty((rows, *self.weights[0].shape), p.x.dtype)
            for start in range(0, rows, chunk):
                idx = np.arange(start, min(start + chunk, rows))
                # one-hot cotangents (k, B, out), pulled through the last layer
                g = np.zeros((idx.size, batch, w_last.shape[0]), p.x.dtype)
                g[np.arange(idx.size), idx // d_out] = w_last.T[idx % d_out]
                for i in reversed(range(self.n_layers - 1)):
                    g = g * fwd.d1[i]
                    if i > 0:
                        g = _mm(g, self.weights[i].T)
                jac[start : start + idx.size] = p.x.T @ g
            return jac.reshape(batch, d_out, *self.weights[0].shape)

        return run


# --------------------------------------------------------------------- PyTorch


class TorchPeer:
    name = "torch"

    def __init__(self, prob: Problem):
        import torch

        self.torch, self.prob = torch, prob
        t = torch.from_numpy
        self.x, self.y = t(prob.x), t(prob.y)
        self.params = [t(a).clone().requires_grad_() for a in prob.params]
        self.consts = [t(a) for a in prob.params]
        self.v = [t(a) for a in prob.v]
        self.vs = [t(a) for a in prob.vs]
        self.act = getattr(torch, prob.activation)

    def loss(self, params):
        return ((mlp(self.x, params, self.act) - self.y) ** 2).mean()

    def _inner_grad(self):
        loss = self.loss(self.params)
        return self.torch.autograd.grad(loss, self.params, create_graph=True)

    def grad(self):
        def run():
            loss = self.loss(self.params)
            return loss, self.torch.autograd.grad(loss, self.params)

        return run

    def hvp_fresh(self):
        return lambda: self.torch.autograd.grad(self._inner_grad(), self.params, self.v)

    def hvp_reused(self):
        g, grad = self._inner_grad(), self.torch.autograd.grad
        return lambda: grad(g, self.params, self.v, retain_graph=True)

    def hvp_batched(self):
        g, grad = self._inner_grad(), self.torch.autograd.grad
        return lambda: grad(g, self.params, self.vs, retain_graph=True, is_grads_batched=True)

    def batch_jac(self):
        func = self.torch.func
        jac = func.vmap(func.jacrev(lambda xi: mlp(xi, self.consts, self.act)))
        return lambda: jac(self.x)

    def jac_w1(self):
        w1, rest = self.consts[0], self.consts[1:]
        jac = self.torch.func.jacrev(
            lambda w: mlp(self.x, [w, *rest], self.act), chunk_size=self.prob.jac_chunk
        )
        return lambda: jac(w1)


# ------------------------------------------------------------------------- JAX


def _import_jax():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    return jax


class JaxPeer:
    name = "jax"

    def __init__(self, prob: Problem):
        jax = _import_jax()
        jnp = jax.numpy
        self.jax, self.prob = jax, prob
        self.x, self.y = jnp.asarray(prob.x), jnp.asarray(prob.y)
        self.params = tuple(jnp.asarray(a) for a in prob.params)
        self.v = tuple(jnp.asarray(a) for a in prob.v)
        self.vs = tuple(jnp.asarray(a) for a in prob.vs)
        self.act = jnp.tanh if prob.activation == "tanh" else jax.nn.relu

    def loss(self, params, x, y):
        return self.jax.numpy.mean((mlp(x, params, self.act) - y) ** 2)

    @staticmethod
    def block(result):
        import jax

        return jax.block_until_ready(result)

    def _compiled(self, fn, *args):
        """jax.jit(fn), compiled ahead of time for `args`, as a thunk."""
        compiled = self.jax.jit(fn).lower(*args).compile()
        return lambda: compiled(*args)

    def _linearized(self):
        jax = self.jax
        grad = jax.grad(self.loss)
        _, lin = jax.linearize(lambda p: grad(p, self.x, self.y), self.params)
        return lin  # a jax.tree_util.Partial: its residuals are passed as arguments

    def grad(self):
        f = self.jax.value_and_grad(self.loss)
        return self._compiled(f, self.params, self.x, self.y)

    def hvp_fresh(self):
        jax = self.jax

        def hvp(params, v, x, y):
            return jax.jvp(lambda p: jax.grad(self.loss)(p, x, y), (params,), (v,))[1]

        return self._compiled(hvp, self.params, self.v, self.x, self.y)

    def hvp_reused(self):
        return self._compiled(lambda f, v: f(v), self._linearized(), self.v)

    def hvp_batched(self):
        vmap = self.jax.vmap
        return self._compiled(lambda f, vs: vmap(f)(vs), self._linearized(), self.vs)

    def batch_jac(self):
        jax = self.jax

        def f_single(params, xi):
            return mlp(xi, params, self.act)

        f = jax.vmap(jax.jacrev(f_single, argnums=1), in_axes=(None, 0))
        return self._compiled(f, self.params, self.x)

    def jac_w1(self):
        jax, chunk = self.jax, self.prob.jac_chunk

        def jac(w1, rest, x):
            def f(w):
                return mlp(x, (w, *rest), self.act)

            if chunk is None:
                return jax.jacrev(f)(w1)
            out, vjp = jax.vjp(f, w1)
            basis = jax.numpy.eye(out.size, dtype=out.dtype).reshape(out.size, *out.shape)
            rows = jax.lax.map(lambda c: vjp(c)[0], basis, batch_size=chunk)
            return rows.reshape(*out.shape, *w1.shape)

        return self._compiled(jac, self.params[0], self.params[1:], self.x)


# -------------------------------------------------------------------- gradtape


def import_gradtape():
    """`import engine as gt`, from the installed project or else from the repository.

    An editable install made before engine/__init__.py existed maps `engine` to a
    namespace package; that is treated like no install at all.
    """
    try:
        import engine
    except ImportError:
        engine = None
    if getattr(engine, "__file__", None) is None:
        sys.modules.pop("engine", None)
        sys.path.insert(0, str(REPO_ROOT))
        import engine
    return engine


class Gradtape:
    """Written against the intended engine API; missing pieces become "n/a"."""

    name = "gradtape"

    def __init__(self, prob: Problem):
        gt = import_gradtape()
        self.gt, self.prob = gt, prob
        self.x, self.y = gt.constant(prob.x), gt.constant(prob.y)
        self.variables = [gt.Variable(a) for a in prob.params]
        self.consts = tuple(gt.constant(a) for a in prob.params)
        self.v = tuple(gt.constant(a) for a in prob.v)
        self.vs = tuple(gt.constant(a) for a in prob.vs)
        self.act = getattr(gt, prob.activation)

    def loss(self, *params):
        return self.gt.mean((mlp(self.x, params, self.act) - self.y) ** 2)

    def grad(self):
        gt = self.gt

        def run():
            with gt.GradientTape() as tape:
                loss = self.loss(*self.variables)
            return loss, tape.gradient(loss, self.variables)

        return run

    def hvp_fresh(self):
        return lambda: self.gt.hvp(self.loss, self.consts, self.v)

    def hvp_reused(self):
        op = self.gt.hessian_operator(self.loss, *self.consts)
        return lambda: op.hvp(self.v)

    def hvp_batched(self):
        op = self.gt.hessian_operator(self.loss, *self.consts)
        return lambda: op.hvp_many(self.vs)

    def batch_jac(self):
        gt = self.gt

        def run():
            with gt.GradientTape() as tape:
                tape.watch(self.x)
                out = mlp(self.x, self.consts, self.act)
            return tape.batch_jacobian(out, self.x)

        return run

    def jac_w1(self):
        rest = self.consts[1:]
        jac = self.gt.jacrev(
            lambda w: mlp(self.x, (w, *rest), self.act),
            argnums=0,
            chunk_size=self.prob.jac_chunk,
        )
        return lambda: jac(self.consts[0])


PEERS = {cls.name: cls for cls in (Gradtape, TorchPeer, JaxPeer, NumpyFloor)}


# ---------------------------------------------------------------------- harness


@dataclass
class Cell:
    ms: float | None = None
    note: str = ""  # "n/a", "error", "timeout", "skipped: too big"
    faults: float | None = None  # minor page faults per call
    foreign: float | None = None  # share of the machine's CPU others took while timing
    result: object = None  # kept only for --check

    @property
    def noisy(self) -> bool:
        return self.foreign is not None and self.foreign > NOISY_SHARE

    def text(self) -> str:
        return self.note if self.ms is None else fmt_ms(self.ms) + (" *" if self.noisy else "")


class CellTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise CellTimeout in the main thread once `seconds` have passed."""

    def on_alarm(signum, frame):
        raise CellTimeout(f"over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_snapshot() -> tuple[float, float]:
    """(wall seconds, CPU seconds used by every other process plus hypervisor steal)."""
    me, used = str(os.getpid()), 0
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit() or entry.name == me:
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            used += sum(int(t) for t in fields[11:15])  # utime stime cutime cstime
    try:
        with open("/proc/stat") as stat:
            used += int(stat.readline().split()[8])  # steal
    except (OSError, ValueError, IndexError):
        pass
    return perf_counter(), used / CLOCK_TICKS


def foreign_share(before, after) -> float | None:
    """Share of the machine's CPU capacity others used between two snapshots."""
    wall, used = (end - begin for end, begin in zip(after, before))
    if wall < 0.1:  # too few clock ticks to tell
        return None
    return max(0.0, used) / (wall * (os.cpu_count() or 1))


def timed_call(thunk, block) -> tuple[float, int]:
    """Seconds and minor page faults of one call."""
    faults, start = minor_faults(), perf_counter()
    block(thunk())
    return perf_counter() - start, minor_faults() - faults


def measure(thunk, block, args, repeat: int) -> tuple[float, float, float | None]:
    """Median seconds, mean minor page faults per call and foreign CPU share while timing.

    One warm-up call, then timed calls until there are `repeat` of them AND
    --min-time has passed (so that even sub-millisecond cells are timed long enough
    to see other load), or until --budget is spent (at least one call). A warm-up
    call longer than --budget is itself the measurement: compiling happens before it
    (JAX compiles ahead of time in the cell's setup), one-time initialisation
    happened in prime(), and at that length one call's warm-up effects are noise.
    """
    before = cpu_snapshot()
    first = timed_call(thunk, block)
    if first[0] <= args.budget:
        samples, start, before = [], perf_counter(), cpu_snapshot()
        while True:
            samples.append(timed_call(thunk, block))
            elapsed = perf_counter() - start
            if elapsed >= args.budget or (len(samples) >= repeat and elapsed >= args.min_time):
                break
        times, faults = zip(*samples)
        first = statistics.median(times), statistics.fmean(faults)
    return *first, foreign_share(before, cpu_snapshot())


@dataclass
class Notes:
    """Footnotes: why a cell is n/a or an error, once per distinct reason."""

    lines: list[str] = field(default_factory=list)
    quiet: bool = False  # no tracebacks on stderr

    def add(self, framework: str, row: str, exc: BaseException) -> str:
        kind = "n/a" if isinstance(exc, NA_ERRORS) else "error"
        if isinstance(exc, CellTimeout):
            kind = "timeout"
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        line = f"{framework} {kind}: {reason}"
        if kind == "error" and not self.quiet:
            traceback.print_exception(exc, limit=-3, file=sys.stderr)
        if line not in self.lines:
            self.lines.append(line)
        return kind


def run_cell(peer, row: str, prob: Problem, args, notes: Notes, keep=False) -> Cell:
    if row == "jac_w1" and prob.jac_w1_bytes > args.max_jac_gb * 2**30:
        return Cell(note="skipped: too big")
    gc.collect()
    block = getattr(peer, "block", lambda r: r)
    per = K_VECTORS if row == "hvp_batched" else 1
    try:
        with time_limit(args.cell_timeout):
            thunk = getattr(peer, row)()
            if keep:
                return Cell(result=block(thunk()))
            repeat = args.repeat or prob.size.repeat
            seconds, faults, foreign = measure(thunk, block, args, repeat)
    except Exception as exc:  # noqa: BLE001 (one broken cell must not end the run)
        return Cell(note=notes.add(peer.name, ROWS[row], exc))
    return Cell(ms=1e3 * seconds / per, faults=faults / per, foreign=foreign)


def make_peers(prob: Problem, names, notes: Notes) -> dict:
    """Instantiate each framework; one that cannot start maps to its exception."""
    peers = {}
    for name in names:
        try:
            peers[name] = PEERS[name](prob)
        except Exception as exc:  # noqa: BLE001 (reported as n/a or error)
            notes.add(name, "setup", exc)
            peers[name] = exc
    return peers


def bench_table(prob: Problem, args) -> str:
    notes = Notes()
    peers = make_peers(prob, args.frameworks, notes)
    cells = {}
    for row in args.rows:
        for name, peer in peers.items():
            if isinstance(peer, Exception):
                cells[row, name] = Cell(note="n/a" if isinstance(peer, NA_ERRORS) else "error")
                continue
            cells[row, name] = cell = run_cell(peer, row, prob, args, notes)
            print(
                f"  {prob.size.name}/{prob.activation} {row:12s} {name:9s} {cell.text()}",
                file=sys.stderr,
                flush=True,
            )
    retry_noisy(cells, peers, prob, args, notes)
    title = f"### {prob.size.name} ({prob.size.describe()}), {prob.activation}"
    parts = [title, "", timing_table(cells, args)]
    if any(cell.noisy for cell in cells.values()):
        note = f"other processes or the hypervisor took over {NOISY_SHARE:.0%} of the CPU"
        parts += ["", f"\\* {note} while this cell was timed: not trustworthy, rerun"]
    if args.diagnostics:
        title = "Minor page faults per call / foreign CPU share while timing:"
        parts += ["", title, "", diagnostics_table(cells, args)]
    if notes.lines:
        parts += [""] + [f"- {line}" for line in notes.lines]
    return "\n".join(parts) + "\n"


def wait_for_quiet(timeout_s: float) -> bool:
    """Wait until others use at most NOISY_SHARE of the CPU over a second, or give up."""
    deadline = perf_counter() + timeout_s
    while True:
        before = cpu_snapshot()
        sleep(1.0)
        share = foreign_share(before, cpu_snapshot())
        if share is None or share <= NOISY_SHARE:
            return True
        if perf_counter() > deadline:
            return False


def retry_noisy(cells: dict, peers: dict, prob: Problem, args, notes: Notes) -> None:
    """Time cells marked noisy again once the machine is quiet; keep the cleaner one."""
    for _ in range(args.retries):
        noisy = [key for key, cell in cells.items() if cell.noisy]
        if not noisy:
            return
        print(f"  {len(noisy)} noisy cells: waiting for a quiet machine", file=sys.stderr)
        wait_for_quiet(args.quiet_wait)
        for row, name in noisy:
            again = run_cell(peers[name], row, prob, args, notes)
            if again.foreign is not None and again.foreign < cells[row, name].foreign:
                cells[row, name] = again


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def timing_table(cells: dict, args) -> str:
    peers = [f for f in args.frameworks if f != "gradtape"]
    header = ["measurement"] + [f"{f} ms" for f in args.frameworks]
    if "gradtape" in args.frameworks:
        header += [f"gt/{f}" for f in peers]
    body = []
    for row in args.rows:
        label = ROWS[row] + (" (per vector)" if row == "hvp_batched" else "")
        line = [label] + [cells[row, f].text() for f in args.frameworks]
        if "gradtape" in args.frameworks:
            mine = cells[row, "gradtape"].ms
            for f in peers:
                theirs = cells[row, f].ms
                line.append(f"{mine / theirs:.2f}x" if mine and theirs else "")
        body.append(line)
    return markdown_table(header, body)


def diagnostics_table(cells: dict, args) -> str:
    def text(cell: Cell) -> str:
        if cell.faults is None:
            return ""
        foreign = "-" if cell.foreign is None else f"{cell.foreign:.0%}"
        return f"{cell.faults:.0f} / {foreign}"

    body = [[ROWS[row]] + [text(cells[row, f]) for f in args.frameworks] for row in args.rows]
    return markdown_table(["measurement", *args.frameworks], body)


def prime(args) -> None:
    """Call every case once at size small, before anything is timed.

    One-time library initialisation (lazy imports, kernel registries, first-use
    caches) then stays out of the measurements, in particular out of a slow
    cell's single warm-up call.
    """
    notes = Notes(quiet=True)  # failures are reported where they are timed
    for act in args.activations:
        prob = make_problem(SIZES["small"], act, args.seed)
        for peer in make_peers(prob, args.frameworks, notes).values():
            for row in args.rows if not isinstance(peer, Exception) else ():
                run_cell(peer, row, prob, args, notes, keep=True)


# ------------------------------------------------------------------ correctness


def to_arrays(result) -> list[np.ndarray]:
    """Flatten a framework's result (nested tuples of tensors) into ndarrays."""
    if isinstance(result, (list, tuple)):
        return [a for item in result for a in to_arrays(item)]
    if hasattr(result, "detach"):
        result = result.detach()
    if hasattr(result, "numpy"):
        result = result.numpy()
    return [np.asarray(result, dtype=np.float64)]


def max_rel_diff(got, want) -> float:
    """Largest |got - want| relative to the largest |want|, over all arrays."""
    got, want = to_arrays(got), to_arrays(want)
    if [a.shape for a in got] != [a.shape for a in want]:
        raise ValueError(f"shapes {[a.shape for a in got]} != {[a.shape for a in want]}")
    return max(
        float(np.max(np.abs(g - w), initial=0) / max(np.max(np.abs(w), initial=0), 1e-30))
        for g, w in zip(got, want)
    )


def finite_diff(fn, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central-difference jacobian of fn at x: shape fn(x).shape + x.shape."""
    cols = []
    for i in range(x.size):
        step = np.zeros(x.size)
        step[i] = eps
        step = step.reshape(x.shape)
        cols.append((fn(x + step) - fn(x - step)) / (2 * eps))
    return np.stack(cols, axis=-1).reshape(*np.shape(fn(x)), *x.shape)


def floor_self_check() -> list[tuple[str, float]]:
    """Check the NumPy floor against float64 finite differences on a tiny MLP."""
    tiny = Size("tiny", 5, 3, (4, 4), 2, repeat=1)
    results = []
    for act in ("tanh", "relu"):
        prob = make_problem(tiny, act, seed=1, dtype=np.float64)
        prob.jac_chunk = 3  # exercise the chunked path (10 rows)
        results += [(f"{act} {name}", err) for name, err in _self_check_one(prob)]
    return results


def _self_check_one(prob: Problem, eps: float = 1e-6) -> list[tuple[str, float]]:
    floor, params = NumpyFloor(prob), prob.params

    def loss_and_grads(ps):
        bwd = floor.backward(floor.forward(ps, prob.x), ps)
        return bwd.loss, bwd.grads

    def shifted(sign):
        return loss_and_grads([p + sign * eps * v for p, v in zip(params, prob.v)])

    (loss_hi, grads_hi), (loss_lo, grads_lo) = shifted(1), shifted(-1)
    directional = sum(float(np.sum(g * v)) for g, v in zip(loss_and_grads(params)[1], prob.v))
    loss_fd = (loss_hi - loss_lo) / (2 * eps)
    hvp_fd = [(hi - lo) / (2 * eps) for hi, lo in zip(grads_hi, grads_lo)]
    recorded = floor._recorded()
    singles = [floor.r_pass(*recorded, params, [v[k] for v in prob.vs]) for k in range(K_VECTORS)]
    one_by_one = [np.stack(hv) for hv in zip(*singles)]
    bjac_fd = finite_diff(lambda x: floor.forward(params, x).out, prob.x)
    jac_fd = finite_diff(lambda w1: floor.forward([w1, *params[1:]], prob.x).out, params[0])
    return [
        ("gradient . v vs FD of loss", abs(loss_fd - directional) / abs(directional)),
        ("HVP (R-op) vs FD of gradient", max_rel_diff(floor.hvp_fresh()(), hvp_fd)),
        ("batched R-op vs one at a time", max_rel_diff(floor.hvp_batched()(), one_by_one)),
        (
            "batch jacobian vs FD",
            max_rel_diff(floor.batch_jac()(), np.einsum("bobd->bod", bjac_fd)),
        ),
        ("jacobian W1 vs FD", max_rel_diff(floor.jac_w1()(), jac_fd)),
    ]


def check_agreement(args) -> tuple[str, bool]:
    """Each framework's results against the floor's at size small; (table, all agree)."""
    lines = ["### Agreement at size small (max relative difference to the floor)", ""]
    others = [f for f in args.frameworks if f != "floor"]
    body, notes = [], Notes()
    for act in args.activations:
        prob = make_problem(SIZES["small"], act, seed=args.seed)
        peers = make_peers(prob, [*others, "floor"], notes)
        for row in args.rows:
            want = run_cell(peers["floor"], row, prob, args, notes, keep=True).result
            line = [f"{ROWS[row]} ({act})"]
            for name in others:
                line.append(agreement_text(peers[name], row, prob, args, notes, want))
            body.append(line)
    lines.append(markdown_table(["measurement", *others], body))
    if notes.lines:
        lines += [""] + [f"- {line}" for line in notes.lines]
    agree = not any("MISMATCH" in text or text == "error" for line in body for text in line)
    return "\n".join(lines) + "\n", agree


def agreement_text(peer, row, prob, args, notes, want) -> str:
    if isinstance(peer, Exception):
        return "n/a"
    cell = run_cell(peer, row, prob, args, notes, keep=True)
    if cell.note:
        return cell.note
    try:
        diff = max_rel_diff(cell.result, want)
    except Exception as exc:  # noqa: BLE001 (reported as an error)
        return notes.add(peer.name, ROWS[row], exc)
    return f"{diff:.1e}" + ("" if diff < args.tolerance else " MISMATCH")


# ------------------------------------------------------------------ environment


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "jax", "jaxlib"):
        try:
            found[name] = __import__(name).__version__
        except ImportError as exc:
            found[name] = f"unavailable ({type(exc).__name__})"
    try:
        gt = import_gradtape()
        found["gradtape engine"] = getattr(gt, "__file__", None) or "namespace package"
    except Exception as exc:  # noqa: BLE001 (any import-time failure)
        found["gradtape engine"] = f"unavailable ({type(exc).__name__}: {exc})"
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def reproducible_command() -> str:
    """The command line, with the environment variables that change the numbers."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    prefix = []
    for var in ENV_VARS:
        value = os.environ.get(var)
        prefix.append(f"{var}={shlex.quote(value)}" if value is not None else f"-u {var}")
    return shlex.join(["env"]) + " " + " ".join(prefix) + " " + shlex.join([str(exe), *sys.argv])


def environment_lines() -> list[str]:
    lines = [f"- command: `{reproducible_command()}`"]
    lines.append(f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    lines.append(f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.platform()}")
    lines.append("- load average at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    lines += [f"- {name}: {version}" for name, version in versions().items()]
    torch = sys.modules.get("torch")  # imported by versions() when installed
    if torch is not None:
        lines.append(f"- torch threads: {torch.get_num_threads()}")
    for var in ENV_VARS:
        lines.append(f"- {var}: {os.environ.get(var, 'unset')}")
    return lines


def warn_environment() -> None:
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    if coretype:
        print(
            f"WARNING: OPENBLAS_CORETYPE={coretype} is set: NumPy's OpenBLAS then runs "
            "slower kernels (Haswell: ~1.6x slower sgemm on this machine), which "
            "penalizes gradtape and the floor only. Rerun with `env -u OPENBLAS_CORETYPE`.",
            file=sys.stderr,
        )
    for var in MALLOC_ENV:
        state = os.environ.get(var)
        print(f"{var}: {'unset' if state is None else state}", file=sys.stderr)
    before = cpu_snapshot()
    sleep(1.0)
    share = foreign_share(before, cpu_snapshot())
    if share is not None and share > NOISY_SHARE:
        print(
            f"WARNING: other processes (or the hypervisor) use {share:.0%} of the CPU right "
            "now; eager multi-threaded timings will be inflated. Check `top`.",
            file=sys.stderr,
        )


# ----------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,large", help="comma-separated")
    parser.add_argument("--activations", default="tanh,relu", help="comma-separated")
    parser.add_argument(
        "--frameworks", default=",".join(FRAMEWORKS), help="subset of " + ",".join(FRAMEWORKS)
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="subset of " + ",".join(ROWS))
    parser.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="timed calls per cell, at least (default per size: 30/10/3), within --budget",
    )
    parser.add_argument(
        "--min-time", type=float, default=0.25, help="seconds of timed calls per cell, at least"
    )
    parser.add_argument(
        "--budget", type=float, default=2.0, help="seconds of timed calls per cell, at most"
    )
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=180.0,
        help="seconds before a cell is abandoned as 'timeout'",
    )
    parser.add_argument(
        "--max-jac-gb",
        type=float,
        default=2.0,
        help="skip the W1 jacobian when its result exceeds this",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="times to re-time cells marked noisy (other load on the CPU) per table",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="seconds to wait for a quiet machine before re-timing noisy cells",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the shared inputs")
    parser.add_argument(
        "--check", action="store_true", help="only check that all frameworks agree at size small"
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="--check: largest relative difference"
    )
    parser.add_argument(
        "--diagnostics",
        action="store_true",
        help="add a table of minor page faults per call and foreign CPU share per cell",
    )
    parser.add_argument(
        "--malloc-env",
        action="store_true",
        help="re-run with " + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
    )
    parser.add_argument(
        "--single-thread",
        action="store_true",
        help="re-run with every framework on one thread (steadier on a shared machine)",
    )
    parser.add_argument("--write", metavar="PATH", help="append a markdown section to PATH")
    args = parser.parse_args(argv)
    args.sizes = split_choices(parser, "--sizes", args.sizes, SIZES)
    args.activations = split_choices(parser, "--activations", args.activations, ("tanh", "relu"))
    args.frameworks = split_choices(parser, "--frameworks", args.frameworks, FRAMEWORKS)
    args.rows = split_choices(parser, "--rows", args.rows, ROWS)
    return args


def split_choices(parser, flag: str, text: str, allowed) -> list[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}: choose from {', '.join(allowed)} (got {text!r})")
    return chosen


def reexec_with(variables: dict[str, str]) -> None:
    """Restart this script with `variables` set (libraries read them when loaded)."""
    if all(os.environ.get(k) == v for k, v in variables.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **variables})


def write_section(path: str, header: list[str], sections: list[str]) -> None:
    target = Path(path)
    title = "" if target.exists() else "# gradtape benchmark results\n\n"
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    body = "\n".join([f"## Run {stamp}", "", *header, "", *sections])
    with target.open("a") as out:
        out.write(title + body + "\n")
    print(f"appended to {target}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    variables = {}
    if args.malloc_env:
        variables.update(MALLOC_ENV)
    if args.single_thread:
        variables.update(SINGLE_THREAD_ENV)
    reexec_with(variables)
    warn_environment()
    header = environment_lines()
    print("\n".join(header) + "\n")
    self_check = floor_self_check()
    failed = [name for name, err in self_check if not err < 1e-6]
    summary = f"floor self-check (float64 finite differences): {'FAILED' if failed else 'ok'}"
    summary += f", worst {max(err for _, err in self_check):.1e}"
    print(summary)
    for name, err in self_check if failed or args.check else []:
        print(f"  {name}: {err:.1e}")
    sections = [summary + "\n"]
    if args.check:
        text, agree = check_agreement(args)
        failed += [] if agree else ["agreement"]
        sections.append(text)
        print(text)
    else:
        print("priming every case once at size small ...", file=sys.stderr, flush=True)
        prime(args)
        for size in args.sizes:
            for act in args.activations:
                sections.append(bench_table(make_problem(SIZES[size], act, args.seed), args))
                print(sections[-1], flush=True)
    if args.write:
        write_section(args.write, header, sections)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
