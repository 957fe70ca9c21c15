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
     ((3,), (8, 4, 5, 5)), ((2, 1), (5, 7, 1, 9)), ((), (2, 3, 4, 5, 6)),
     # spatial axes of size 1 only (a 1 x 1 feature map, a 1-d length of 1): NumPy would
     # run one pairwise sum over each channel's N cells, C order adds them in sequence
     ((), (130, 16, 1)), ((), (64, 16, 1, 1)), ((2,), (33, 5, 1, 1))],
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
    got = gt.sum(gt.constant(xs), axes, keepdims=keepdims).numpy()
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    found = channel_axes(xs.shape, xs.strides, xs.dtype, axes)
    assert found is not None
    out = np.empty(expected.shape, dtype)
    assert channel_sum(xs, *found, axes, keepdims, out) is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(128, 16, 1, 1), (130, 16, 1), (3, 64, 16, 1, 1)])
def test_sums_over_n_alone_of_a_1x1_map_are_the_c_order_bits(dtype, shape) -> None:
    # A broadcast's VJP sums only the axes of size > 1: over N alone, which for a C-order
    # array is leading_sum's GEMV (without leading axes), not np.add.reduce's run.
    lead = len(shape) - 4 + (len(shape) == 3)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, shape)).astype(dtype)
    xs = _swapped(x, lead)
    for keepdims in (False, True):
        expected = gt.sum(gt.constant(x), (lead,), keepdims=keepdims).numpy()
        got = gt.sum(gt.constant(xs), (lead,), keepdims=keepdims).numpy()
        np.testing.assert_array_equal(got, expected)
        found = channel_axes(xs.shape, xs.strides, xs.dtype, (lead,))
        assert found is not None
        out = np.empty(expected.shape, dtype)
        assert channel_sum(xs, *found, (lead,), keepdims, out) is out
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
    matrix = np.zeros((3, 4), np.float32).T  # (4, 3) in F order: no axis after C, not a map
    assert channel_axes(matrix.shape, matrix.strides, matrix.dtype, (0,)) is None


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_scales_gradient_on_a_1x1_map_has_the_same_bits_on_both_routes(
    dtype, monkeypatch
) -> None:
    """A per-channel scale between two convolutions of 1 x 1 maps (a squeeze-and-excite
    block, a network's last stage): its gradient sums the strided convolution's input
    cotangent times the first convolution's result over N. The compiled col2im makes that
    cotangent in the convolution's layout, the NumPy route (GRADTAPE_KERNELS=numpy) in C
    order; the sum gives the C-order bits on both, as it does for larger maps."""
    if kernels.col2im2d.compiled() is None:
        pytest.skip("one route only without numba")
    from engine.ops import conv as conv_ops

    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 16, 1, 1)) * 10 ** rng.uniform(-3, 3, (128, 16, 1, 1))
    w1, w2 = rng.standard_normal((16, 16, 1, 1)), rng.standard_normal((8, 16, 3, 3))
    gamma = rng.standard_normal(16).astype(dtype)

    def loss(gamma):
        y = gt.conv(gt.constant(x.astype(dtype)), gt.constant(w1.astype(dtype)))
        y = y * gt.reshape(gamma, (1, 16, 1, 1))
        z = gt.conv(y, gt.constant(w2.astype(dtype)), strides=2, pads=1)
        return gt.sum(z * z)

    got = gt.grad(loss)(gt.constant(gamma)).numpy()
    with monkeypatch.context() as m:
        m.setattr(conv_ops, "_compiled", lambda *args: False)
        want = gt.grad(loss)(gt.constant(gamma)).numpy()
    np.testing.assert_array_equal(got, want)
    # and the values: the same gradient in float64 by PyTorch
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    g = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(torch.tensor(x), torch.tensor(w1)) * g.reshape(1, 16, 1, 1)
    z = F.conv2d(y, torch.tensor(w2), stride=2, padding=1)
    (expected,) = torch.autograd.grad((z * z).sum(), g)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    scale = float(expected.abs().max())
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("pairs", [1, 2])
def test_stride_1_chunks_whole_batches_or_within_one_the_same_bits(n, pairs, monkeypatch) -> None:
    """The stride-1 input cotangent's chunks: whole batches at once where a chunk holds
    them (N = 1 beside many leading rows: a jacobian's, a K-vector pass's), images of one
    batch otherwise; the same bits either way, in the convolution's layout, and
    PyTorch's values."""
    from engine.ops import conv as conv_ops

    rng = np.random.default_rng(5)
    k = 7
    g = rng.standard_normal((k, n, 6, 5, 5)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    operands = [g, w, g[::-1].copy(), w[::-1].copy()][: 2 * pairs]
    params = {"spatial": (5, 5), "strides": (1, 1), "pads": ((1, 1), (1, 1)),
              "dilations": (1, 1), "groups": 1}  # fmt: skip
    answers = []
    image = pairs * 6 * 9 * 25 * 4  # one image's windows (bytes)
    for chunk in (1, 2 * image, 1 << 30):  # one image, two (of a batch of 3: 2 + 1), all
        monkeypatch.setattr(conv_ops, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(conv_ops, "KERNEL_CHUNK_BYTES", chunk)
        dx = bind(conv_input_p, *(gt.constant(a) for a in operands), **params).numpy()
        assert dx.shape == (k, n, 4, 5, 5) and _conv_layout(dx)
        answers.append(dx)
    for dx in answers[1:]:
        np.testing.assert_array_equal(dx, answers[0])
    torch = pytest.importorskip("torch")
    for i in range(k):
        expected = sum(
            torch.nn.grad.conv2d_input(
                (n, 4, 5, 5), torch.from_numpy(operands[2 * j + 1]),
                torch.from_numpy(np.ascontiguousarray(operands[2 * j][i])), padding=1,
            ).numpy()
            for j in range(pairs)
        )  # fmt: skip
        np.testing.assert_allclose(answers[0][i], expected, rtol=1e-5, atol=1e-5)
