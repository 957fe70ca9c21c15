"""engine.hessian_algorithms against dense linear algebra: Lanczos eigenvalues against
numpy.linalg.eigh, Hutchinson's trace against the exact trace, conjugate gradient
against numpy.linalg.solve; their limits (HVPs, seconds) and what they report; and
FlatOperator on a real HessianOperator against gt.hessian."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.hessian_algorithms import (
    FlatOperator,
    conjugate_gradient,
    hutchinson_trace,
    lanczos,
)


def symmetric(n: int, seed: int, spectrum: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    values = rng.standard_normal(n) * 3 if spectrum is None else spectrum
    return (q * values) @ q.T


from tests.engine.clock import FakeClock


class Counting:
    """matvec over a dense matrix that counts the vectors it was given. With `delay`,
    each call takes that many seconds of `clock` (the fake_clock fixture, installed as
    the budgets' clock): time moves by exactly that much per call, however loaded the
    machine."""

    def __init__(self, a: np.ndarray, delay: float = 0.0, clock: FakeClock | None = None):
        assert not delay or clock is not None, "a slow operator needs the fake_clock fixture"
        self.a = a
        self.vectors = 0
        self.calls = 0
        self.delay = delay
        self.clock = clock

    def __call__(self, v: np.ndarray) -> np.ndarray:
        assert v.ndim == 2 and v.shape[1] == self.a.shape[0]
        self.vectors += v.shape[0]
        self.calls += 1
        if self.delay and self.clock is not None:
            self.clock.advance(self.delay)
        return v @ self.a  # a is symmetric: (A v_i)^T for each row v_i


# ---- Lanczos ---------------------------------------------------------------------------


def expected(values: np.ndarray, k: int, which: str) -> np.ndarray:
    if which == "LA":
        return np.sort(values)[::-1][:k]
    if which == "SA":
        return np.sort(values)[:k]
    return values[np.argsort(-np.abs(values))][:k]


@pytest.mark.parametrize("which", ["LA", "LM", "SA"])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 2), (40, 3), (120, 5)])
def test_lanczos_matches_eigh(which: str, n: int, k: int) -> None:
    a = symmetric(n, seed=n + k)
    values = np.linalg.eigvalsh(a)
    matvec = Counting(a)
    out = lanczos(matvec, n, k=k, which=which, tol=1e-10, eigenvectors=True)
    assert out.converged and out.stopped in ("converged", "exhausted")
    np.testing.assert_allclose(out.eigenvalues, expected(values, k, which), rtol=1e-8, atol=1e-9)
    assert out.hvps == matvec.vectors == out.iterations <= n
    assert out.eigenvectors is not None and out.eigenvectors.shape == (k, n)
    for theta, y in zip(out.eigenvalues, out.eigenvectors, strict=True):
        assert abs(np.linalg.norm(y) - 1) < 1e-10
        np.testing.assert_allclose(a @ y, theta * y, atol=1e-6)
    assert np.all(out.residuals <= 1e-8 * np.abs(values).max() + 1e-12)


def test_lanczos_converges_before_spanning_the_space() -> None:
    # A well separated top eigenvalue converges in far fewer than n iterations.
    spectrum = np.concatenate([[100.0, 50.0], np.linspace(-1, 1, 298)])
    a = symmetric(300, seed=1, spectrum=spectrum)
    out = lanczos(Counting(a), 300, k=2, tol=1e-8)
    assert out.stopped == "converged" and out.hvps < 60
    np.testing.assert_allclose(out.eigenvalues, [100.0, 50.0], rtol=1e-8)


def test_lanczos_holds_only_the_basis_it_uses() -> None:
    # n = 10^5: an n x n basis would be 80 GB; converging in a few dozen steps, the
    # basis grows (by doubling) to a few dozen rows.
    n = 100_000
    diagonal = np.concatenate([[100.0, 50.0], np.linspace(-1, 1, n - 2)])
    out = lanczos(lambda v: v * diagonal, n, k=2, tol=1e-8)
    assert out.stopped == "converged" and out.hvps < 64
    np.testing.assert_allclose(out.eigenvalues, [100.0, 50.0], rtol=1e-8)


def test_lanczos_restarts_after_an_invariant_subspace() -> None:
    # The start vector lies in a 2-dimensional invariant subspace only if we make it so:
    # a block-diagonal matrix with a random start still breaks down after the distinct
    # eigenvalues of the blocks it touches; the restart must reach all of them.
    a = np.diag([5.0, 5.0, 3.0, 3.0, 1.0, -2.0])
    out = lanczos(Counting(a), 6, k=6, which="LA", tol=1e-12)
    assert out.stopped == "exhausted" and out.converged
    np.testing.assert_allclose(out.eigenvalues, [5, 5, 3, 3, 1, -2], atol=1e-9)


def test_lanczos_limits_are_reported(fake_clock) -> None:
    a = symmetric(200, seed=3)
    out = lanczos(Counting(a), 200, k=3, tol=1e-14, max_hvps=10)
    assert not out.converged and out.stopped == "max_hvps"
    assert out.hvps == 10 and out.iterations == 10 and len(out.eigenvalues) == 3
    slow = lanczos(Counting(a, delay=0.01, clock=fake_clock), 200, k=1, tol=1e-14, max_seconds=0.05)
    assert slow.stopped == "time_limit" and not slow.converged and 1 <= slow.hvps < 30
    with pytest.raises(ValueError, match="at least 5 HVPs"):
        lanczos(Counting(a), 200, k=5, max_hvps=3)
    with pytest.raises(ValueError, match="which"):
        lanczos(Counting(a), 200, which="XX")
    small = lanczos(Counting(a), 200, k=2, max_basis_bytes=8 * 200 * 4, tol=1e-14)
    assert small.hvps == 4 and small.stopped == "max_hvps"


def test_lanczos_seed_is_reproducible() -> None:
    a = symmetric(50, seed=4)
    one = lanczos(Counting(a), 50, k=2, max_hvps=8, seed=7)
    two = lanczos(Counting(a), 50, k=2, max_hvps=8, seed=7)
    np.testing.assert_array_equal(one.eigenvalues, two.eigenvalues)


# ---- Hutchinson ------------------------------------------------------------------------


def test_hutchinson_estimates_the_trace_with_its_standard_error() -> None:
    a = symmetric(60, seed=5)
    matvec = Counting(a)
    out = hutchinson_trace(matvec, 60, batch_size=16, max_hvps=4000, seed=1)
    assert out.samples == out.hvps == matvec.vectors == 4000
    assert matvec.calls == out.batches == 250  # 16 vectors per batched pass
    assert out.stopped == "max_hvps" and out.converged
    assert abs(out.trace - np.trace(a)) < 4 * out.stderr
    # The standard error is the sample standard deviation over sqrt(N)...
    assert out.stderr == pytest.approx(out.values.std(ddof=1) / np.sqrt(out.samples))
    # ... and that of z^T A z is known: Var = 2 (||A||_F^2 - sum diag(A)^2).
    exact = np.sqrt(2 * (np.sum(a * a) - np.sum(np.diag(a) ** 2)) / out.samples)
    assert out.stderr == pytest.approx(exact, rel=0.1)


def test_hutchinson_is_exact_for_a_diagonal_matrix() -> None:
    a = np.diag(np.arange(1.0, 11.0))  # z^T A z = sum a_ii z_i^2 = trace, for any z
    out = hutchinson_trace(Counting(a), 10, batch_size=4, max_hvps=32)
    assert out.trace == pytest.approx(55.0) and out.stderr == pytest.approx(0.0, abs=1e-12)
    # ... though from fewer than 30 samples its standard error is unknown, not 0.
    few = hutchinson_trace(Counting(a), 10, batch_size=4, max_hvps=8)
    assert few.trace == pytest.approx(55.0) and few.stderr == np.inf and not few.converged


def test_hutchinson_stops_at_the_tolerance_and_the_time_limit(fake_clock) -> None:
    a = symmetric(30, seed=6) + 10 * np.eye(30)
    out = hutchinson_trace(Counting(a), 30, batch_size=8, max_hvps=10000, rtol=0.02)
    assert out.stopped == "tolerance" and out.converged
    assert out.stderr <= 0.02 * abs(out.trace) and out.samples < 10000
    assert out.samples % 8 == 0 and out.batches >= 2
    slow = hutchinson_trace(
        Counting(a, delay=0.02, clock=fake_clock), 30, batch_size=2, max_hvps=1000, max_seconds=0.05
    )
    assert slow.stopped == "time_limit" and not slow.converged and slow.samples < 1000
    last = hutchinson_trace(Counting(a), 30, batch_size=16, max_hvps=20)
    assert last.samples == 20 and last.batches == 2  # the last batch is cut to fit
    with pytest.raises(ValueError, match="two samples"):
        hutchinson_trace(Counting(a), 30, max_hvps=1)


# ---- Conjugate gradient ----------------------------------------------------------------


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_cg_solves_a_positive_definite_system(damping: float) -> None:
    rng = np.random.default_rng(7)
    m = rng.standard_normal((50, 50))
    a = m @ m.T / 50 + 0.1 * np.eye(50)
    b = rng.standard_normal(50)
    matvec = Counting(a)
    out = conjugate_gradient(matvec, b, damping=damping, tol=1e-10, max_iterations=500)
    assert out.converged and out.stopped == "converged"
    np.testing.assert_allclose(
        out.x, np.linalg.solve(a + damping * np.eye(50), b), rtol=1e-7, atol=1e-9
    )
    assert out.hvps == matvec.vectors == out.iterations
    assert len(out.residuals) == out.iterations + 1 and out.residuals[0] == 1.0
    assert out.residuals[-1] <= 1e-10
    true = np.linalg.norm(b - (a + damping * np.eye(50)) @ out.x) / np.linalg.norm(b)
    assert true < 1e-8


def test_cg_limits_and_negative_curvature(fake_clock) -> None:
    rng = np.random.default_rng(8)
    m = rng.standard_normal((80, 80))
    a = m @ m.T + np.eye(80)
    b = rng.standard_normal(80)
    capped = conjugate_gradient(Counting(a), b, tol=1e-14, max_iterations=5)
    assert capped.stopped == "max_iterations" and capped.iterations == 5 and not capped.converged
    assert capped.residuals[-1] < 1.0
    by_hvps = conjugate_gradient(Counting(a), b, tol=1e-14, max_hvps=3)
    assert by_hvps.stopped == "max_hvps" and by_hvps.hvps == 3
    slow = conjugate_gradient(
        Counting(a, delay=0.02, clock=fake_clock), b, tol=1e-14, max_seconds=0.05
    )
    assert slow.stopped == "time_limit" and slow.hvps < 20
    indefinite = np.diag([1.0, -1.0])
    out = conjugate_gradient(Counting(indefinite), np.array([0.0, 1.0]))
    assert out.stopped == "negative_curvature" and not out.converged
    np.testing.assert_array_equal(out.x, [0.0, 0.0])
    damped = conjugate_gradient(Counting(indefinite), np.array([0.0, 1.0]), damping=2.0)
    assert damped.converged
    np.testing.assert_allclose(damped.x, [0.0, 1.0])
    zero = conjugate_gradient(Counting(a), np.zeros(80))
    assert zero.converged and zero.hvps == 0 and not zero.x.any()


# ---- On a real HessianOperator ---------------------------------------------------------


def mlp_operator(dtype: str = "float64") -> tuple[gt.HessianOperator, np.ndarray]:
    """A small MLP loss over (w1, b1, w2): its HessianOperator and dense Hessian."""
    rng = np.random.default_rng(9)
    x = gt.constant(rng.standard_normal((8, 3)).astype(dtype))
    y = gt.constant(rng.standard_normal((8, 2)).astype(dtype))
    w1 = gt.Variable(rng.standard_normal((3, 4)).astype(dtype))
    b1 = gt.Variable(rng.standard_normal(4).astype(dtype))
    w2 = gt.Variable(rng.standard_normal((4, 2)).astype(dtype))

    def loss(w1: gt.Tensor, b1: gt.Tensor, w2: gt.Tensor) -> gt.Tensor:
        return gt.mean((gt.tanh(x @ w1 + b1) @ w2 - y) ** 2)

    operator = gt.hessian_operator(loss, w1, b1, w2)
    blocks = gt.hessian(loss, argnums=(0, 1, 2))(w1, b1, w2)
    sizes = [12, 4, 8]
    h = np.block(
        [
            [
                np.asarray(blocks[i][j].numpy(), np.float64).reshape(sizes[i], sizes[j])
                for j in range(3)
            ]
            for i in range(3)
        ]
    )
    return operator, h


def test_flat_operator_is_the_dense_hessian() -> None:
    operator, h = mlp_operator()
    flat = FlatOperator(operator)
    assert flat.n == 24
    np.testing.assert_allclose(flat.matvec(np.eye(24)), h, atol=1e-12)
    g = flat.flatten(operator.grad)
    parts = flat.unflatten(g)
    assert [p.shape for p in parts] == [(3, 4), (4,), (4, 2)]
    np.testing.assert_array_equal(flat.flatten(parts), g)
    with pytest.raises(ValueError, match=r"\(K, 24\)"):
        flat.matvec(np.ones(24))


def test_algorithms_on_a_hessian_operator() -> None:
    operator, h = mlp_operator()
    flat = FlatOperator(operator)
    values = np.linalg.eigvalsh(h)
    top = lanczos(flat.matvec, flat.n, k=3, which="LM", tol=1e-10)
    np.testing.assert_allclose(top.eigenvalues, expected(values, 3, "LM"), rtol=1e-8, atol=1e-10)
    tr = hutchinson_trace(flat.matvec, flat.n, batch_size=32, max_hvps=2048, seed=3)
    assert abs(tr.trace - np.trace(h)) < 4 * tr.stderr
    damping = abs(values.min()) + 0.1  # makes H + damping I positive definite
    g = flat.flatten(operator.grad)
    step = conjugate_gradient(flat.matvec, g, damping=damping, tol=1e-12, max_iterations=200)
    assert step.converged
    np.testing.assert_allclose(
        step.x, np.linalg.solve(h + damping * np.eye(24), g), rtol=1e-8, atol=1e-10
    )


def test_float32_operator_gives_float32_precision() -> None:
    operator, h = mlp_operator("float32")
    flat = FlatOperator(operator)
    top = lanczos(flat.matvec, flat.n, k=1, tol=1e-5)
    assert top.eigenvalues[0] == pytest.approx(np.linalg.eigvalsh(h)[-1], rel=1e-4)
    assert [p.dtype for p in flat.unflatten(np.zeros(flat.n))] == [np.float32] * 3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_flat_operator_for_scipy_in_the_primals_dtype(dtype: str) -> None:
    """linear_operator(): SciPy's view of the operator in the primals' dtype (eigsh runs
    on it); matvec keeps a float input's dtype and answers what the float64 path does."""
    from scipy.sparse.linalg import eigsh

    operator, h = mlp_operator(dtype)
    flat = FlatOperator(operator)
    lin = flat.linear_operator()
    assert lin.dtype == np.dtype(dtype) and lin.shape == (24, 24)
    rtol = 1e-10 if dtype == "float64" else 1e-4
    rows = np.random.default_rng(4).standard_normal((3, 24))
    same = flat.matvec(rows.astype(dtype))
    assert same.dtype == np.dtype(dtype)
    np.testing.assert_allclose(same, rows @ h, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(lin.matvec(rows[0].astype(dtype)), h @ rows[0], rtol=rtol, atol=rtol)
    np.testing.assert_allclose(lin.matmat(rows.T.astype(dtype)), h @ rows.T, rtol=rtol, atol=rtol)
    values = eigsh(lin, k=3, which="LA", return_eigenvectors=False, v0=np.ones(24, dtype))
    np.testing.assert_allclose(np.sort(values), np.linalg.eigvalsh(h)[-3:], rtol=rtol, atol=rtol)
