"""An input read through several indexes gets its slices' cotangents as one array
(engine/ops/shape.py, scatter_slices; the tape joins getitem's terms): attention's q, k
and v as slices of one projection. Checked: one call for all of an input's slices, the
values against NumPy's scatters (bit for bit, in the tape's order), against finite
differences to second order (forward-over-reverse, reverse-over-reverse, K vectors),
and the compiled replay against the dynamic pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import engine as gt
from engine.ops import shape as shape_ops
from engine.registry import impl_rules


@pytest.fixture
def calls(monkeypatch: Any) -> list[int]:
    """The number of cotangents each scatter_slices call joins."""
    seen: list[int] = []
    impl = impl_rules[shape_ops.scatter_slices_p]

    def counted(xp: Any, *gs: Any, **params: Any) -> Any:
        seen.append(len(gs))
        return impl(xp, *gs, **params)

    monkeypatch.setitem(impl_rules, shape_ops.scatter_slices_p, counted)
    return seen


def _constants(shape: tuple, seed: int, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def test_qkv_slices_cotangents_are_one_call_with_their_values(calls: list[int]) -> None:
    # loss = sum(x[..., 0:4] c0) + sum(x[..., 4:8] c1) + sum(x[..., 8:12] c2): the gradient
    # is c0 | c1 | c2 exactly, a -0 included (each slice's cotangent written in its place)
    c = _constants((2, 3, 4), 0)
    c[1][0, 0, 0] = -0.0

    def loss(x: Any) -> Any:
        parts = [x[..., 4 * k : 4 * k + 4] for k in range(3)]
        return sum(gt.sum(p * gt.constant(ck)) for p, ck in zip(parts, c, strict=True))

    x = gt.constant(np.ones((2, 3, 12), np.float32))
    g = gt.grad(loss)(x).numpy()
    assert calls == [3]
    want = np.concatenate(c, axis=-1)
    assert np.array_equal(g, want) and np.array_equal(np.signbit(g), np.signbit(want))


def test_overlapping_and_array_indexes_keep_the_sum_of_scatters_bits(calls: list[int]) -> None:
    # Slices that overlap and an integer array with a repeated index: the cotangent is
    # the scatters' arrays added in the tape's order (the last use's first), as before
    # the terms were joined.
    c0, c1 = _constants((2, 6), 1)[:2]
    c2 = np.array([[1.5, -2.25, 0.125], [3.0, 1e-3, -7.0]], np.float32)
    picks = np.array([1, 1, 4])  # column 4: all three terms
    # where the order shows: (-1e8 + 1e8) + 1 = 1, (1 + 1e8) - 1e8 = 0 in float32
    c0[:, 4], c1[:, 0], c2[:, 2] = 1.0, 1e8, -1e8

    def loss(x: Any) -> Any:
        return (
            gt.sum(x[:, 0:6] * gt.constant(c0))
            + gt.sum(x[:, 4:10] * gt.constant(c1))
            + gt.sum(x[:, picks] * gt.constant(c2))
        )

    g = gt.grad(loss)(gt.constant(np.zeros((2, 10), np.float32))).numpy()
    assert calls == [3]
    parts = [np.zeros((2, 10), np.float32) for _ in range(3)]
    parts[0][:, 0:6] = c0
    parts[1][:, 4:10] = c1
    np.add.at(parts[2], (slice(None), picks), c2)
    assert np.array_equal(g, (parts[2] + parts[1]) + parts[0])
    assert (g[:, 4] == 1.0).all()


def _attention_like(x: Any, w: Any) -> Any:
    """q, k, v as slices of one projection, a softmax over q k^T, its weighted v."""
    h = gt.matmul(x, w)  # (B, T, 3 d)
    d = h.shape[-1] // 3
    q, k, v = h[..., :d], h[..., d : 2 * d], h[..., 2 * d :]
    a = gt.softmax(gt.matmul(q, gt.transpose(k, (0, 2, 1))), axis=-1)
    return gt.sum(gt.tanh(gt.matmul(a, v)))


def _params(dtype: Any = np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [
        rng.standard_normal((2, 4, 3)).astype(dtype),
        rng.standard_normal((3, 6)).astype(dtype) / 2,
    ]


def _fd_grad(f: Any, params: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    out = []
    for i, p in enumerate(params):
        g = np.zeros_like(p)
        for j in np.ndindex(p.shape):
            plus, minus = [q.copy() for q in params], [q.copy() for q in params]
            plus[i][j] += eps
            minus[i][j] -= eps
            g[j] = (f(*plus) - f(*minus)) / (2 * eps)
        out.append(g)
    return out


def test_attention_like_gradient_and_hvps_against_finite_differences(calls: list[int]) -> None:
    params = _params()

    def value(*ps: np.ndarray) -> float:
        return float(_attention_like(*[gt.constant(p) for p in ps]).numpy())

    grad = gt.grad(_attention_like, argnums=(0, 1))
    got = grad(*[gt.constant(p) for p in params])
    assert 3 in calls
    for mine, fd in zip(got, _fd_grad(value, params), strict=True):
        np.testing.assert_allclose(mine.numpy(), fd, rtol=1e-6, atol=1e-7)

    rng = np.random.default_rng(6)
    vs = [rng.standard_normal(p.shape) for p in params]
    eps = 1e-5
    plus = grad(*[gt.constant(p + eps * v) for p, v in zip(params, vs, strict=True)])
    minus = grad(*[gt.constant(p - eps * v) for p, v in zip(params, vs, strict=True)])
    fd_hv = [(a.numpy() - b.numpy()) / (2 * eps) for a, b in zip(plus, minus, strict=True)]
    # forward-over-reverse: scatter_slices' tangent rule
    fwd = gt.hvp(_attention_like, [gt.constant(p) for p in params], [gt.constant(v) for v in vs])
    # reverse-over-reverse, dynamic, captured and replayed: its VJP rule
    op = gt.hessian_operator(_attention_like, *[gt.constant(p) for p in params])
    for _ in range(3):
        rev = op.hvp(*[gt.constant(v) for v in vs])
        for a, b, fd in zip(fwd, rev, fd_hv, strict=True):
            np.testing.assert_allclose(a.numpy(), fd, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(b.numpy(), fd, rtol=1e-6, atol=1e-6)
    # K vectors at once (a leading axis on every cotangent and tangent)
    many = op.hvp_many(*[gt.constant(np.stack([v, -2 * v])) for v in vs])
    for m, fd in zip(many, fd_hv, strict=True):
        np.testing.assert_allclose(m.numpy()[0], fd, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m.numpy()[1], -2 * fd, rtol=1e-6, atol=2e-6)


def _two_of_three(x: Any, w: Any) -> Any:
    """Slices apart that leave columns out (the replay's form zeroes those)."""
    h = gt.matmul(x, w)
    return gt.sum(gt.tanh(h[..., 0:2]) * h[..., 4:6])


@pytest.mark.parametrize("fn", [_attention_like, _two_of_three])
def test_the_compiled_replay_answers_the_dynamic_pass_bit_for_bit(fn: Any) -> None:
    jitted = gt.jit(fn)
    grad = jitted.grad((0, 1))
    rng = np.random.default_rng(7)
    for _ in range(4):  # dynamic, captured, replayed
        ps = [gt.constant(p * rng.uniform(0.5, 1.5)) for p in _params(np.float32)]
        for mine, want in zip(grad(*ps), gt.grad(fn, (0, 1))(*ps), strict=True):
            assert np.array_equal(mine.numpy(), want.numpy())
            assert np.array_equal(np.signbit(mine.numpy()), np.signbit(want.numpy()))
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()


def test_disjoint_basic_indexes() -> None:
    shape = (4, 12)
    e = Ellipsis
    thirds = tuple((e, slice(None), slice(4 * k, 4 * k + 4)) for k in range(3))
    assert shape_ops.disjoint_basic(thirds, shape)
    # apart along the first axis though the columns overlap
    assert shape_ops.disjoint_basic(((e, 0, slice(0, 8)), (e, -3, slice(4, 12))), shape)
    assert not shape_ops.disjoint_basic(((e, slice(None), slice(0, 5)), thirds[1]), shape)
    assert not shape_ops.disjoint_basic(((e, slice(None), slice(0, 12, 3)), thirds[1]), shape)
    assert shape_ops.disjoint_basic(
        ((e, slice(None), slice(0, 12, 2)), (e, slice(None), slice(1, 12, 2))), shape
    )
    assert not shape_ops.disjoint_basic(((e, np.array([0, 1]), slice(None)), thirds[0]), shape)
