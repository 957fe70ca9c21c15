"""One memory order for a convolution's values and its input's cotangents (engine/ops/
conv.py, _CONV_LAYOUT) and channel sums that do not depend on it (engine/ops/reduce.py,
channel_sum): on the host, conv_input's result is (N, C, *spatial) over (C, N, *spatial)
memory like conv's own; a sum over N and the spatial axes of such an array gives exactly
the bits NumPy gives for the same values in C-contiguous memory (so the layout change left
every gradient and HVP bit-identical), through the dynamic ops and the compiled replay."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine.kernels import conv as kernels
from engine.ops.conv import conv_input_p
from engine.ops.reduce import channel_axes, channel_sum
from engine.tensor import bind


def _swapped(x: np.ndarray, lead: int) -> np.ndarray:
    """x's values in (*lead, C, N, *spatial) memory, viewed like x."""
    perm = (*range(lead), lead + 1, lead, *range(lead + 2, x.ndim))
    return np.ascontiguousarray(x.transpose(perm)).transpose(perm)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "lead, shape",
    [((), (64, 16, 32, 32)), ((), (3, 5, 7, 9)), ((), (4, 6, 10)), ((1,), (8, 4, 5, 5)),
     ((3,), (8, 4, 5, 5)), ((2, 1), (5, 7, 1, 9)), ((), (2, 3, 4, 5, 6))],
)  # fmt: skip
@pytest.mark.parametrize("keepdims", [False, True])
def test_channel_sums_are_the_c_contiguous_bits(dtype, lead, shape, keepdims) -> None:
    full = lead + shape
    rng = np.random.default_rng(0)
    # magnitudes over six decades: a different order of additions rounds differently
    x = (rng.standard_normal(full) * 10 ** rng.uniform(-3, 3, full)).astype(dtype)
    axes = (len(lead), *range(len(lead) + 2, len(full)))
    expected = np.add.reduce(x, axis=axes, keepdims=keepdims)  # C-contiguous: planes in order
    xs = _swapped(x, len(lead))
    if shape == (64, 16, 32, 32):  # NumPy's own sum of that layout: one pairwise run, others
        assert not np.array_equal(np.add.reduce(xs, axis=axes, keepdims=keepdims), expected)
    found = channel_axes(xs.shape, xs.strides, xs.dtype, axes)
    assert found is not None
    got = gt.sum(gt.constant(xs), axes, keepdims=keepdims).numpy()
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    out = np.empty(expected.shape, dtype)
    assert channel_sum(xs, *found, axes, keepdims, out) is out
    np.testing.assert_array_equal(out, expected)


def test_what_channel_sum_leaves_to_add_reduce() -> None:
    x = np.zeros((4, 3, 5, 5), np.float32)
    xs = _swapped(x, 0)
    assert channel_axes(xs.shape, xs.strides, xs.dtype, (0, 2, 3)) == (0, (2, 3))
    assert channel_axes(x.shape, x.strides, x.dtype, (0, 2, 3)) is None  # C order already
    assert channel_axes(xs.shape, xs.strides, xs.dtype, (2, 3)) is None  # N kept
    assert channel_axes(xs.shape, xs.strides, xs.dtype, (0, 1, 2, 3)) is None  # every axis
    assert channel_axes(xs.shape, xs.strides, np.dtype(np.float16), (0, 2, 3)) is None
    assert channel_axes(xs.shape, xs.strides, np.dtype(np.int32), (0, 2, 3)) is None
    window = xs[:, :, 1:4, 1:4]  # not dense
    assert channel_axes(window.shape, window.strides, window.dtype, (0, 2, 3)) is None
    assert channel_axes((0, 3, 5, 5), xs.strides, xs.dtype, (0, 2, 3)) is None


def _conv_layout(a: np.ndarray) -> bool:
    return np.ascontiguousarray(a.swapaxes(-4, -3)).swapaxes(-4, -3).strides == a.strides


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("lead", [(), (1,), (2,)])
def test_the_input_cotangent_has_the_convolutions_layout(stride, lead) -> None:
    if stride == 2 and kernels.col2im2d.compiled() is None:
        pytest.skip("the strided route's layout is the compiled col2im's (numba absent)")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y = gt.conv2d(gt.constant(x), gt.constant(w), stride=stride, padding=1).numpy()
    assert _conv_layout(y)  # the convolution's own result
    g = _swapped(rng.standard_normal(lead + y.shape).astype(np.float32), len(lead))
    params = {"spatial": (9, 9), "strides": (stride, stride), "pads": ((1, 1), (1, 1)),
              "dilations": (1, 1), "groups": 1}  # fmt: skip
    dx = bind(conv_input_p, gt.constant(g), gt.constant(w), **params).numpy()
    assert dx.shape == lead + x.shape and _conv_layout(dx)
    # its values: the transposed convolution's, the same as PyTorch's conv2d input gradient
    torch = pytest.importorskip("torch")
    for i in np.ndindex(*lead):
        expected = torch.nn.grad.conv2d_input(
            x.shape, torch.from_numpy(w), torch.from_numpy(np.ascontiguousarray(g[i])),
            stride=stride, padding=1,
        ).numpy()  # fmt: skip
        np.testing.assert_allclose(dx[i], expected, rtol=1e-5, atol=1e-5)
