"""The compiled softmax kernel (engine/kernels/softmax.py) against its NumPy path
(_softmax_numpy in engine/ops/nn.py) and the exact softmax of its float32 input: within
0.5 ulp + 2^-40 (relative) of the exact value, never less accurate than the NumPy path on
the same sample; NaN exactly where the NumPy path's; the layouts it takes and those it
leaves to NumPy; through the engine, the derivatives against finite differences of the
float64 softmax and the compiled replay bit-equal to the dynamic pass."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import kernels
from engine.kernels import softmax as K
from engine.ops.nn import _softmax_numpy

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


def _exact(x: np.ndarray) -> np.ndarray:
    wide = x.astype(np.longdouble)
    e = np.exp(wide - wide.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(exact.astype(np.float32))).astype(np.longdouble)
    return np.abs(got.astype(np.longdouble) - exact) / ulp


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 64, 300])
def test_softmax_kernel_is_within_half_an_ulp_and_at_least_as_accurate(k: int) -> None:
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((513, k)) * rng.choice([0.1, 3.0, 30.0], (513, 1))).astype(np.float32)
    got = K.softmax(x, -1)
    assert got is not None and got.dtype == np.float32
    exact = _exact(x)
    ulps = _ulps(got, exact)
    bound = 0.5 + 2.0**-40 * np.abs(exact) / np.spacing(np.abs(exact.astype(np.float32)))
    assert (ulps <= bound).all(), float(np.max(ulps))
    numpy_path = _softmax_numpy(np, x, -1, np.empty_like(x))
    assert ulps.max() <= max(_ulps(numpy_path, exact).max(), 0.5)
    if k == 1:
        np.testing.assert_array_equal(got, 1.0)


def test_softmax_kernel_edges() -> None:
    inf, nan = np.inf, np.nan
    x = np.array(
        [
            [0.0, -inf, 1.0, -inf],  # -inf entries: 0
            [-inf, -inf, -inf, -inf],  # all -inf: NaN (-inf - -inf), as NumPy's
            [1.0, inf, 0.0, 2.0],  # +inf: NaN (inf - inf)
            [1.0, nan, 0.0, 2.0],  # NaN: the row NaN
            [nan, 1.0, 0.0, 2.0],
            [3e38, -3e38, 3e38, 0.0],  # the shift keeps exp finite
            [-1e30, -1e30 + 1e24, -1e30, -1e30],
            [0.0, -200.0, -90.0, -103.0],  # exps below float32's subnormals and near them
        ],
        np.float32,
    )
    got = K.softmax(x, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        numpy_path = _softmax_numpy(np, x, -1, np.empty_like(x))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(numpy_path))
    assert np.isnan(got[1:5]).all() and not np.isnan(got[[0, 5, 6, 7]]).any()
    np.testing.assert_array_equal(got[0], np.float32([1, 0, np.e, 0]) / np.float32(1 + np.e))
    np.testing.assert_array_equal(got[5], [0.5, 0, 0.5, 0])
    with np.errstate(under="ignore"):
        exact = _exact(x[[6, 7]])
    assert (_ulps(got[[6, 7]], exact) <= 0.5 + 1e-6).all()
    assert got[7, 1] == 0 and got[7, 3] > 0  # e^-103 is a float32 subnormal


def test_softmax_kernel_layouts() -> None:
    x = np.random.default_rng(1).standard_normal((4, 3, 16)).astype(np.float32)
    out = np.empty_like(x)
    assert K.softmax(x, 2, out) is out
    np.testing.assert_array_equal(K.softmax(x, -1), out)
    one = K.softmax(x[0, 0], -1)  # 1-D
    np.testing.assert_array_equal(one, out[0, 0])
    assert K.softmax(np.zeros((0, 5), np.float32), -1).shape == (0, 5)
    # left to the NumPy path (None): another axis, float64, strided input or out, 0-d,
    # an empty axis
    assert K.softmax(x, 1) is None
    assert K.softmax(x.astype(np.float64), -1) is None
    assert K.softmax(x[:, :, ::2], -1) is None
    assert K.softmax(x, -1, np.empty((16, 3, 4), np.float32).T) is None
    assert K.softmax(np.float32(1.0).reshape(()), -1) is None
    assert K.softmax(np.zeros((3, 0), np.float32), -1) is None
    # through the op: the strided input goes through NumPy and agrees to its error
    strided = x[:, :, ::2]
    np.testing.assert_allclose(
        gt.softmax(gt.constant(strided), -1).numpy(), out_of(strided), rtol=3e-6
    )


def out_of(x: np.ndarray) -> np.ndarray:
    return _exact(x).astype(np.float32)


def test_softmax_through_the_engine_and_its_replay() -> None:
    """float32 gradient against differences of the float64 softmax; gt.jit's gradient
    replayed (softmax's form runs the kernel into its buffer) bit-equal to dynamic."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 4, 16)).astype(np.float32)
    w = rng.standard_normal((8, 4, 16)).astype(np.float32)

    def loss(t):
        return gt.sum(gt.softmax(t, -1) * gt.constant(w))

    (grad,) = gt.grad(loss, argnums=(0,))(gt.constant(x))

    def loss64(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return float(np.sum(e / e.sum(-1, keepdims=True) * w))

    wide, h = x.astype(np.float64), 1e-6
    differences = np.empty(x.shape)
    for i in np.ndindex(x.shape):
        d = np.zeros(x.shape)
        d[i] = h
        differences[i] = (loss64(wide + d) - loss64(wide - d)) / (2 * h)
    np.testing.assert_allclose(grad.numpy(), differences, rtol=1e-4, atol=1e-6)

    jitted = gt.jit(loss)
    for _ in range(4):
        x = rng.standard_normal((8, 4, 16)).astype(np.float32)
        (compiled,) = jitted.grad(argnums=(0,))(gt.constant(x))
        (dynamic,) = gt.grad(loss, argnums=(0,))(gt.constant(x))
        np.testing.assert_array_equal(compiled.numpy(), dynamic.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
