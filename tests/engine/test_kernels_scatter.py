"""The compiled row scatter (engine/kernels/scatter.py: an embedding's gradient) against
np.add.at, bit for bit (the same sums in the same order), and against the NumPy path it
replaces (a stable sort and add.reduceat) to rounding; repeated and negative indices,
out-of-range ones (the table untouched, np.add.at's error through the engine), the
layouts it leaves to NumPy; through the engine, an embedding's gradient against
np.add.at and its compiled replay bit-equal to the dynamic pass."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import backend, kernels
from engine.kernels import scatter as K

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32, np.uint16])
def test_add_rows_is_np_add_at(dtype, index_dtype) -> None:
    rng = np.random.default_rng(0)
    low = 0 if np.dtype(index_dtype).kind == "u" else -100
    picks = rng.integers(low, 100, (64, 16)).astype(index_dtype)
    values = rng.standard_normal((64, 16, 8, 3)).astype(dtype)
    start = rng.standard_normal((100, 8, 3)).astype(dtype)  # a table that is not zero
    expected = start.copy()
    np.add.at(expected, (picks,), values)
    table = start.copy()
    assert K.add_rows(picks, values, table) is True
    np.testing.assert_array_equal(table, expected)
    # the engine's entry point (backend.scatter_add) runs the kernel: add.at's bits
    zero, reference = np.zeros_like(start), np.zeros_like(start)
    np.add.at(reference, (picks,), values)
    assert (
        backend.scatter_add(np, zero, (Ellipsis, picks, slice(None), slice(None)), values) is None
    )
    np.testing.assert_array_equal(zero, reference)


def test_out_of_range_leaves_the_table_and_numpy_raises() -> None:
    table = np.zeros((5, 2), np.float32)
    values = np.ones((3, 2), np.float32)
    for bad in ([0, 5, 1], [0, -6, 1]):
        assert K.add_rows(np.array(bad), values, table) is False
        np.testing.assert_array_equal(table, 0)
    x = gt.constant(np.ones((5, 2), np.float32))
    with pytest.raises(IndexError):
        gt.grad(lambda t: gt.sum(t[np.array([0, 7])]), argnums=(0,))(x)


def test_what_the_kernel_leaves_to_numpy() -> None:
    table = np.zeros((4, 3), np.float32)
    picks = np.array([0, 1, 1])
    assert K.add_rows(picks, np.ones((3, 3), np.float64), table) is None  # dtypes differ
    assert K.add_rows(picks, np.ones((3, 6), np.float32)[:, ::2], table) is None  # strided
    assert K.add_rows(picks, np.ones((3, 4), np.int32), np.zeros((4, 4), np.int32)) is None
    assert K.add_rows(picks, np.ones((3, 3), np.float32), np.zeros((3, 4), np.float32).T) is None


def _embed(table, tokens, w):
    return gt.sum(gt.tanh(gt.take(table, tokens, axis=0) @ w))


def test_an_embedding_gradient_through_the_engine_and_its_replay() -> None:
    rng = np.random.default_rng(1)
    tokens = gt.constant(rng.integers(0, 50, (8, 12)))
    w = gt.constant(rng.standard_normal((16, 4)).astype(np.float32))
    jitted = gt.jit(_embed)
    for _ in range(4):
        table = gt.constant(rng.standard_normal((50, 16)).astype(np.float32))
        (compiled,) = jitted.grad(argnums=(0,))(table, tokens, w)
        (dynamic,) = gt.grad(_embed, argnums=(0,))(table, tokens, w)
        np.testing.assert_array_equal(compiled.numpy(), dynamic.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
    # against np.add.at of the rows' cotangents, computed here
    rows = table.numpy()[tokens.numpy()]
    upstream = (1 - np.tanh(rows @ w.numpy()) ** 2) @ w.numpy().T
    expected = np.zeros((50, 16), np.float32)
    np.add.at(expected, (tokens.numpy(),), upstream.astype(np.float32))
    np.testing.assert_allclose(dynamic.numpy(), expected, rtol=1e-5, atol=1e-6)
