"""Sums over the leading axes as a GEMV with ones (engine/ops/reduce.py, leading_sum):
the same values as NumPy's sum to its rounding, the shapes with and without keepdims,
the layouts and sizes left to np.add.reduce, and the compiled replay bit-equal to the
dynamic pass (its form takes the same decision)."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.ops.reduce import (
    LEADING_SUM_MAX_ROWS,
    LEADING_SUM_MIN_ROWS,
    leading_sum,
    sums_leading,
)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("axes", [(0,), (0, 1), (-3, -2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_leading_sums_match_numpy(dtype, axes, keepdims) -> None:
    x = np.random.default_rng(0).standard_normal((64, 16, 24)).astype(dtype)
    got = gt.sum(gt.constant(x), axes, keepdims=keepdims).numpy()
    expected = np.sum(x.astype(np.float64), axes, keepdims=keepdims)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * 30)
    out = np.empty(expected.shape, dtype)
    assert leading_sum(x, len(axes), keepdims, out) is out
    np.testing.assert_array_equal(out, got)


def test_what_stays_with_add_reduce() -> None:
    c = np.ones((LEADING_SUM_MIN_ROWS, 4), np.float32)
    assert sums_leading(c.shape, True, c.dtype, (0,))
    assert sums_leading((4, LEADING_SUM_MIN_ROWS // 4, 3), True, c.dtype, (0, 1))
    # fewer rows: the GEMV's call costs more than the adds (a small MLP's bias sums)
    assert not sums_leading((LEADING_SUM_MIN_ROWS - 1, 4), True, c.dtype, (0,))
    assert not sums_leading(c.shape, False, c.dtype, (0,))  # strided
    assert not sums_leading(c.shape, True, c.dtype, (1,))  # not leading
    assert not sums_leading(c.shape, True, c.dtype, (0, 1))  # every axis: pairwise sum
    assert not sums_leading(c.shape, True, np.dtype(np.int32), (0,))
    assert not sums_leading((0, 4), True, c.dtype, (0,))
    assert not sums_leading((LEADING_SUM_MAX_ROWS + 1, 2), True, c.dtype, (0,))
    # a transposed array goes through np.add.reduce and gives the same sums
    t = np.random.default_rng(1).standard_normal((5, 7)).T
    np.testing.assert_allclose(gt.sum(gt.constant(t), 0).numpy(), t.sum(0), rtol=1e-14)


def test_a_bias_gradient_replays_bit_equal() -> None:
    def loss(w, b, x):
        return gt.sum(gt.tanh(x @ w + b))

    jitted = gt.jit(loss)
    rng = np.random.default_rng(2)
    for batch in (4, 8, 4, 8):  # 40 rows (np.add.reduce) and 80 (the GEMV)
        args = [
            gt.constant(rng.standard_normal(s).astype(np.float32))
            for s in [(8, 6), (6,), (batch, 10, 8)]
        ]
        compiled = jitted.grad(argnums=(0, 1))(*args)
        dynamic = gt.grad(loss, argnums=(0, 1))(*args)
        for a, b in zip(compiled, dynamic, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
