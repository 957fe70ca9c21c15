"""Winograd's F(2 x 2, 3 x 3) for the host's stride-1 3 x 3 input cotangents (engine/ops/
winograd.py, engine/kernels/winograd.py): not the windows' GEMM's bits, so checked
against references of higher precision (long double sums, PyTorch's float64 conv2d and
its gradients, finite differences) with a rounding bound proportional to the sum of the
products' magnitudes, over the shapes the transforms treat apart (odd sizes: a last tile
half outside; 1 x 1 images; pads asymmetric, wider than the kernel or negative; one
channel; one image; leading axes; inputs in every memory layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine as gt
from engine import kernels
from engine.ops import conv as conv_ops
from engine.ops import winograd
from engine.registry import impl_rules
from tests.engine import test_kernels_conv as t

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

ROOT = Path(__file__).resolve().parents[2]
conv_input = impl_rules[conv_ops.conv_input_p]


@pytest.fixture(autouse=True)
def _every_shape(monkeypatch: Any) -> None:
    """Winograd at every width and channel count (the engine keeps it to the shapes
    where it measured faster: test_the_engine_s_thresholds); these tests' small shapes
    are its edges."""
    monkeypatch.setattr(conv_ops, "_winograd_pays", lambda width, channels: True)


def _reference(xs: list, ks: list, pads: Any) -> tuple[np.ndarray, np.ndarray]:
    """(sum_i xs[i] * ks[i] in long double, the same sum of |x| * |k|): the exact value
    to a few long double ulps, and the scale of its rounding error."""
    (pt, pb), (pl, pr) = pads
    total = absolute = 0
    for x, k in zip(xs, ks, strict=True):
        x = np.asarray(x, np.longdouble)
        # a negative pad crops
        x = x[:, :, max(0, -pt) : x.shape[2] - max(0, -pb), max(0, -pl) : x.shape[3] - max(0, -pr)]
        grow = ((0, 0), (0, 0), (max(0, pt), max(0, pb)), (max(0, pl), max(0, pr)))
        x = np.pad(x, grow)
        windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
        k = np.asarray(k, np.longdouble)
        total = total + np.einsum("mchwab,ocab->mohw", windows, k)
        absolute = absolute + np.einsum("mchwab,ocab->mohw", np.abs(windows), np.abs(k))
    return np.asarray(total), np.asarray(absolute)


def _relative_error(got: np.ndarray, xs: list, ks: list, pads: Any) -> float:
    """max |got - exact| / (eps * sum |x| |k|): rounding errors in units of the dtype's
    epsilon times the products' scale."""
    exact, scale = _reference(xs, ks, pads)
    eps = np.finfo(got.dtype).eps
    err = np.abs(np.asarray(got, np.longdouble) - exact)
    return float((err / (eps * np.maximum(scale, np.finfo(got.dtype).tiny))).max())


def _layout(x: np.ndarray, how: str) -> np.ndarray:
    if how == "conv":  # a convolution's result: (N, C, ...) over (C, N, ...) memory
        return np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
    if how == "sliced":  # not dense: copied first
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "columns-major":
        return np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    return x


# (images M, channels C, outputs O, H, W, pads, pairs, batch)
CASES = [
    (4, 3, 5, 7, 9, ((1, 1), (1, 1)), 1, 4),  # odd sizes: the last tiles half outside
    (1, 1, 1, 1, 1, ((1, 1), (1, 1)), 1, 1),  # a 1 x 1 image, one channel, one image
    (2, 2, 3, 1, 1, ((1, 1), (1, 1)), 2, 1),  # pairs, each image its own block
    (3, 4, 2, 6, 5, ((2, 0), (0, 2)), 2, 3),  # asymmetric pads
    (5, 1, 1, 8, 8, ((-1, 1), (1, -1)), 1, 5),  # a crop and a pad
    (2, 3, 4, 4, 4, ((3, 3), (4, 2)), 1, 2),  # pads wider than the kernel
    (2, 2, 2, 3, 3, ((0, 0), (0, 0)), 1, 2),  # no pad: a 1 x 1 output
    (6, 16, 8, 10, 12, ((1, 1), (1, 1)), 2, 3),  # two blocks of three images
    (64, 16, 16, 32, 32, ((1, 1), (1, 1)), 2, 64),  # the ResNet's 16-channel layer
    (300, 4, 3, 5, 6, ((1, 1), (1, 1)), 1, 1),  # batch 1 beside many rows: whole blocks
]


# Every case in every memory layout, but the ResNet-sized one in the contiguous layout
# only (its long-double reference is the slow part; the layouts are covered above it).
LAYOUT_CASES = [
    (case, how)
    for case in CASES
    for how in ("contiguous", "conv", "sliced", "columns-major")
    if how == "contiguous" or case[0] != 64
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("case", "how"), LAYOUT_CASES)
def test_winograd_sums_round_like_a_direct_sum(dtype, case, how) -> None:
    m, c, o, h, w, pads, pairs, batch = case
    rng = np.random.default_rng(0)
    xs = [_layout(rng.standard_normal((m, c, h, w)).astype(dtype), how) for _ in range(pairs)]
    ks = [rng.standard_normal((o, c, 3, 3)).astype(dtype) for _ in range(pairs)]
    y = winograd.conv3x3(xs, ks, pads, batch)
    oh, ow = h + sum(pads[0]) - 2, w + sum(pads[1]) - 2
    assert y.shape == (m // batch, batch, o, oh, ow) and y.dtype == dtype
    assert y.swapaxes(1, 2).flags.c_contiguous  # a convolution's memory order per block
    got = y.reshape(m, o, oh, ow)
    # Measured on these cases: at most 2.6 (float32) and 1.9 (float64) epsilons of the
    # products' scale; the windows' GEMM (direct sums) 1.7 and 1.6. The bound leaves room.
    assert _relative_error(got, xs, ks, pads) < 10


def test_winograd_of_no_channels_or_no_images() -> None:
    k = np.ones((3, 0, 3, 3), np.float32)
    y = winograd.conv3x3([np.ones((2, 0, 4, 4), np.float32)], [k], ((1, 1), (1, 1)), 2)
    assert y.shape == (1, 2, 3, 4, 4) and not y.any()
    y = winograd.conv3x3([np.ones((0, 2, 4, 4))], [np.ones((3, 2, 3, 3))], ((1, 1), (1, 1)), 2)
    assert y.shape == (0, 2, 3, 4, 4)


def test_kernel_transform_is_g_k_g_transposed() -> None:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 3, 3, 3))
    g = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    u = winograd.kernel_transform(k)
    assert u.shape == (16, 2, 3) and u.flags.c_contiguous
    want = np.einsum("ia,ocab,jb->ijoc", g, k, g).reshape(16, 2, 3)
    np.testing.assert_allclose(u, want, rtol=0, atol=1e-15)


def _spied(monkeypatch: Any) -> list:
    calls: list = []
    inner = winograd.conv3x3

    def spy(*args: Any) -> Any:
        calls.append(args)
        return inner(*args)

    monkeypatch.setattr(winograd, "conv3x3", spy)
    return calls


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "n, c, o, hw, pads, lead",
    [(3, 4, 5, (7, 6), ((1, 1), (1, 1)), ()), (1, 1, 1, (1, 1), ((1, 1), (1, 1)), ()),
     (2, 3, 2, (5, 5), ((0, 2), (1, 0)), ()), (2, 3, 2, (6, 5), ((1, 1), (1, 1)), (3,)),
     (2, 3, 2, (4, 4), ((0, 0), (0, 0)), ()), (1, 8, 8, (5, 6), ((1, 1), (1, 1)), (40,))],
)  # fmt: skip
def test_conv_input_by_winograd_against_the_windows_gemm(
    dtype, n, c, o, hw, pads, lead, monkeypatch
) -> None:
    """conv_input's stride-1 3 x 3 route (one pair and two, leading axes on the
    cotangents) against the windows' GEMM on the same operands and PyTorch's
    conv2d_input in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    spatial = hw
    out = tuple(s + sum(p) - 2 for s, p in zip(spatial, pads))
    window = {"spatial": spatial, "strides": (1, 1), "pads": pads, "dilations": (1, 1)}
    gs = [_layout(rng.standard_normal(lead + (n, o) + out).astype(dtype), "conv") for _ in "ab"]
    ws = [rng.standard_normal((o, c, 3, 3)).astype(dtype) for _ in "ab"]
    for operands in ((gs[0], ws[0]), (gs[0], ws[0], gs[1], ws[1])):
        calls = _spied(monkeypatch)
        got = conv_input(np, *operands, groups=1, **window)
        assert len(calls) == 1, "Winograd did not run"
        monkeypatch.setattr(conv_ops, "WINOGRAD", False)
        windows = conv_input(np, *operands, groups=1, **window)
        monkeypatch.setattr(conv_ops, "WINOGRAD", True)
        assert got.shape == windows.shape == lead + (n, c) + spatial
        assert got.strides == windows.strides  # the same memory order (_CONV_LAYOUT)
        want = 0
        for g, w in zip(operands[::2], operands[1::2], strict=True):
            g64 = np.asarray(g, np.float64).reshape((-1, o) + out)
            want = want + _torch_input(torch, g64, w, pads, c, spatial)
        want = want.reshape(got.shape)
        tol = 1e-13 if dtype == np.float64 else 2e-5
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)
        np.testing.assert_allclose(got, windows, rtol=0, atol=tol * scale)


def _torch_input(torch: Any, g: np.ndarray, w: np.ndarray, pads: Any, c: int, spatial: tuple):
    """x's cotangent of a conv2d with asymmetric pads: PyTorch's gradient of the padded
    input, cropped."""
    (pt, pb), (pl, pr) = pads
    padded = (g.shape[0], c, spatial[0] + pt + pb, spatial[1] + pl + pr)
    full = torch.nn.grad.conv2d_input(
        padded, torch.from_numpy(w.astype(np.float64)), torch.from_numpy(np.ascontiguousarray(g))
    ).numpy()
    return full[:, :, pt : pt + spatial[0], pl : pl + spatial[1]]


def test_what_stays_on_the_windows_gemm(monkeypatch) -> None:
    """Dilations, groups, other kernels, float16 operands, pairs of two dtypes, a GPU's
    module and the switch: not Winograd (the windows' GEMM answers)."""
    f32 = np.dtype(np.float32)
    assert winograd.applies(np, (3, 3), (1, 1), 1, f32)
    assert not winograd.applies(np, (3, 3), (2, 2), 1, f32)
    assert not winograd.applies(np, (3, 3), (1, 1), 2, f32)
    assert not winograd.applies(np, (5, 5), (1, 1), 1, f32)
    assert not winograd.applies(np, (3,), (1,), 1, f32)
    assert not winograd.applies(np, (3, 3), (1, 1), 1, np.dtype(np.float16))
    assert not winograd.applies(object(), (3, 3), (1, 1), 1, f32)  # not the host
    calls = _spied(monkeypatch)
    rng = np.random.default_rng(0)
    g = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3))
    window = {"spatial": (4, 4), "strides": (1, 1), "pads": ((1, 1), (1, 1)), "dilations": (1, 1)}
    conv_input(np, g, w, groups=1, **window)  # float32 beside float64
    conv_input(np, g, w.astype(np.float32), g.astype(np.float64), w, groups=1, **window)
    assert not calls
    conv_input(np, g, w.astype(np.float32), groups=1, **window)
    assert len(calls) == 1
    monkeypatch.setattr(conv_ops, "WINOGRAD", False)
    conv_input(np, g, w.astype(np.float32), groups=1, **window)
    assert len(calls) == 1


def test_gradients_and_hvps_through_winograd_against_pytorch(monkeypatch) -> None:
    """A two-layer stride-1 3 x 3 network in float64: its gradient and Hessian-vector
    products (dynamic, K vectors in one pass, and a HessianOperator's compiled replay)
    against PyTorch's double backward, at the project's 1e-12 agreement; Winograd ran
    for the input cotangents, the convolutions and the kernels' cotangents."""
    torch = pytest.importorskip("torch")
    transforms: list = []
    inner = winograd.transform_input
    monkeypatch.setattr(winograd, "transform_input", lambda *a: transforms.append(a) or inner(*a))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 7, 5))  # odd sizes: a last tile half outside
    w1 = 0.5 * rng.standard_normal((4, 2, 3, 3))
    w2 = 0.5 * rng.standard_normal((3, 4, 3, 3))
    v1, v2 = rng.standard_normal(w1.shape), rng.standard_normal(w2.shape)

    def loss(x_, a, b):
        h = gt.tanh(gt.conv2d(x_, a, padding=1))
        return gt.sum(gt.conv2d(h, b, padding=1) ** 2)

    calls = _spied(monkeypatch)
    grads = gt.grad(lambda a, b: loss(gt.constant(x), a, b), argnums=(0, 1))(w1, w2)
    hvps = gt.hvp(lambda a, b: loss(gt.constant(x), a, b), (w1, w2), (v1, v2))
    assert calls, "Winograd did not run"
    assert transforms, "the windows' transform did not run"
    op = gt.hessian_operator(lambda a, b: loss(gt.constant(x), a, b), w1, w2)
    replayed = [op.hvp(v1, v2) for _ in range(4)]  # dynamic, captured, then compiled
    for again in replayed[1:]:  # the replay runs the same impls: the same bits
        for mine, first in zip(again, replayed[0], strict=True):
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(first))
    many = op.hvp_many(np.stack([v1, -v1, 2 * v1]), np.stack([v2, -v2, 2 * v2]))
    for got, single in zip(many, replayed[-1], strict=True):
        single = np.asarray(single)
        scale = float(np.abs(single).max())
        for k, factor in enumerate((1, -1, 2)):
            np.testing.assert_allclose(np.asarray(got)[k], factor * single, atol=1e-12 * scale)

    tx = torch.from_numpy(x)
    ta = torch.from_numpy(w1).requires_grad_()
    tb = torch.from_numpy(w2).requires_grad_()
    h = torch.tanh(torch.nn.functional.conv2d(tx, ta, padding=1))
    out = (torch.nn.functional.conv2d(h, tb, padding=1) ** 2).sum()
    ga, gb = torch.autograd.grad(out, (ta, tb), create_graph=True)
    dot = (ga * torch.from_numpy(v1)).sum() + (gb * torch.from_numpy(v2)).sum()
    ha, hb = torch.autograd.grad(dot, (ta, tb))
    wants = (ga.detach(), gb.detach(), ha, hb, ha, hb)
    for got, want in zip((*grads, *hvps, *replayed[-1]), wants, strict=True):
        want = want.numpy()
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-12 * scale)


# ---- the windows' transform shared by a convolution and its kernel's cotangent ----
gather = impl_rules[conv_ops.gather_p]
conv = impl_rules[conv_ops.conv_p]
conv_weight = impl_rules[conv_ops.conv_weight_p]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "lx, lw, lg, n, c, o, hw, pads",
    [((), (), (), 4, 3, 5, (7, 9), ((1, 1), (1, 1))), ((2,), (), (2,), 2, 2, 3, (5, 4), ((0, 2), (1, 1))),
     ((), (3,), (3,), 2, 2, 3, (4, 4), ((1, 1), (1, 1))), ((1,), (2,), (2, 1), 1, 1, 1, (1, 1), ((1, 1), (1, 1))),
     ((), (), (), 3, 4, 2, (6, 6), ((-1, 1), (2, 0))), ((), (), (), 2, 1, 2, (3, 3), ((0, 0), (0, 0)))],
)  # fmt: skip
def test_conv_and_its_kernel_cotangent_from_the_transform(
    dtype, lx, lw, lg, n, c, o, hw, pads
) -> None:
    """gather_p's transform, conv_p and conv_weight_p on it (leading axes on either
    operand, broadcast), against PyTorch's float64 conv2d and its weight gradient and
    against the windows' route on the same operands."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    out = tuple(s + sum(p) - 2 for s, p in zip(hw, pads))
    x = _layout(rng.standard_normal(lx + (n, c) + hw).astype(dtype), "conv")
    w = rng.standard_normal(lw + (o, c, 3, 3)).astype(dtype)
    g = rng.standard_normal(lg + (n, o) + out).astype(dtype)
    window = {"strides": (1, 1), "pads": pads, "dilations": (1, 1), "groups": 1}
    v = gather(np, x, kernel=(3, 3), **window)
    assert v.shape == winograd.transformed_shape(x.shape, pads)
    y = conv(np, x, w, v, **window)
    dw = conv_weight(np, x, g, v, kernel=(3, 3), **window)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(conv_ops, "WINOGRAD", False)
        cols = gather(np, x, kernel=(3, 3), **window)
        y_windows = conv(np, x, w, cols, **window)
        dw_windows = conv_weight(np, x, g, cols, kernel=(3, 3), **window)
    assert y.shape == y_windows.shape and y.strides == y_windows.strides
    assert dw.shape == dw_windows.shape

    (pt, pb), (pl, pr) = pads

    def padded(a: np.ndarray) -> Any:
        a = a[..., max(0, -pt) : a.shape[-2] - max(0, -pb), max(0, -pl) : a.shape[-1] - max(0, -pr)]
        t = torch.from_numpy(np.array(a, np.float64))
        return torch.nn.functional.pad(t, (max(0, pl), max(0, pr), max(0, pt), max(0, pb)))

    lead_y = np.broadcast_shapes(lx, lw)
    xs = np.broadcast_to(x, lead_y + x.shape[-4:]).reshape((-1,) + x.shape[-4:])
    ws = np.broadcast_to(w, lead_y + w.shape[-4:]).reshape((-1,) + w.shape[-4:])
    want_y = np.stack(
        [torch.nn.functional.conv2d(padded(a), torch.from_numpy(b.astype(np.float64))).numpy()
         for a, b in zip(xs, ws)]
    ).reshape(y.shape)  # fmt: skip
    lead_w = np.broadcast_shapes(lx, lg)
    xs = np.broadcast_to(x, lead_w + x.shape[-4:]).reshape((-1,) + x.shape[-4:])
    gs = np.broadcast_to(g, lead_w + g.shape[-4:]).reshape((-1,) + g.shape[-4:])
    want_dw = np.stack(
        [torch.nn.grad.conv2d_weight(padded(a), (o, c, 3, 3), torch.from_numpy(b.astype(np.float64))).numpy()
         for a, b in zip(xs, gs)]
    ).reshape(dw.shape)  # fmt: skip
    tol = 1e-13 if dtype == np.float64 else 3e-5
    for got, windows, want in ((y, y_windows, want_y), (dw, dw_windows, want_dw)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)
        np.testing.assert_allclose(windows, want, rtol=0, atol=tol * scale)


def test_the_spare_tiles_add_nothing() -> None:
    """The transform's spare tile per row of tiles (engine/kernels/winograd.py) reads two
    columns past the last tile's; under a crop those are x's, here infinities that the
    convolution never reads: the kernel's cotangent stays finite, as the windows' is."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 6))
    x[..., 5] = np.inf  # cropped by the right pad of -1; the spare tiles read column 5
    g = rng.standard_normal((2, 4, 6, 4))
    window = {"strides": (1, 1), "pads": ((1, 1), (1, -1)), "dilations": (1, 1), "groups": 1}
    v = gather(np, x, kernel=(3, 3), **window)
    assert not v.reshape(16, 3, 2, 3, 3)[..., 2].any()  # th = 3 rows of tw = 2 tiles + 1
    dw = conv_weight(np, x, g, v, kernel=(3, 3), **window)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(conv_ops, "WINOGRAD", False)
        cols = gather(np, x, kernel=(3, 3), **window)
        want = conv_weight(np, x, g, cols, kernel=(3, 3), **window)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(dw, want, rtol=1e-13, atol=1e-13)


def test_the_engine_s_thresholds(monkeypatch) -> None:
    """Where the engine chooses Winograd by default (conv_ops._winograd_pays, from the
    measurements in bench/RESULTS.md): rows 32 wide from 8 channels, 16 wide from 32;
    the windows' transform counts the input's channels, the input cotangent the fewer of
    the cotangent's and the result's."""
    monkeypatch.undo()  # the module's own choice, not the fixture's
    f32 = np.float32
    window = {"strides": (1, 1), "pads": ((1, 1), (1, 1)), "dilations": (1, 1), "groups": 1}
    for c, width, chosen in (
        (3, 32, False), (8, 32, True), (16, 16, False), (32, 16, True), (64, 14, False),
        (64, 8, False),
    ):  # fmt: skip
        x = np.zeros((2, c, 4, width), f32)
        v = gather(np, x, kernel=(3, 3), **window)
        assert (v.shape == winograd.transformed_shape(x.shape, window["pads"])) == chosen
    calls = _spied(monkeypatch)
    expected = 0
    for o, c, width, chosen in (
        (7, 16, 32, False), (8, 4, 32, False), (16, 16, 16, False), (8, 8, 32, True),
        (32, 64, 16, True),
    ):  # fmt: skip
        g = np.zeros((2, o, 4, width), f32)
        conv_input(np, g, np.zeros((o, c, 3, 3), f32), spatial=(4, width), **window)
        expected += chosen
        assert len(calls) == expected, (o, c, width)  # (8, 4): LeNet's, a 4-channel result


def test_a_process_with_the_kernels_switched_off_agrees(tmp_path, monkeypatch) -> None:
    """GRADTAPE_KERNELS=numpy in a fresh process (the windows' GEMM everywhere) against
    this one with Winograd's three routes on test_kernels_conv's network (its first layer
    a stride-1 3 x 3 convolution of a differentiated input): the gradient, gt.hvp and a
    HessianOperator's replayed HVPs agree to float64 rounding, and with PyTorch."""
    want = t.passes_with_the_kernels_off(tmp_path, np.float64)
    params = t._params(np.float64)
    rng = np.random.default_rng(1)
    vs = [rng.standard_normal(a.shape) for a in params]
    calls: dict[str, list] = {"transform_input": [], "conv3x3": []}
    for name, log in calls.items():
        inner = getattr(winograd, name)
        monkeypatch.setattr(
            winograd, name, lambda *a, _inner=inner, _log=log: _log.append(1) or _inner(*a)
        )
    got = t._engine_passes(params, vs)
    assert all(calls.values()), calls
    grads, hvp = t._torch_grad_and_hvp(params, vs)
    assert len(got) == len(want) == len(grads + hvp * 5)
    for mine, ref, torch_ref in zip(got, want, grads + hvp * 5, strict=True):
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(mine, torch_ref, rtol=0, atol=1e-12 * scale)


def test_a_convolution_of_no_images_by_winograd() -> None:
    """An empty batch (N = 0) through the transform's route (review r13: the transform
    reshaped to (-1, 0, C, H, W), which NumPy cannot infer): a value of no images, a
    zero kernel gradient, an empty input gradient, as the windows' route answers and as
    PyTorch's conv2d does."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.zeros((0, 8, 6, 7))
    w = rng.standard_normal((8, 8, 3, 3))

    def loss(a: Any, b: Any) -> Any:
        return gt.sum(gt.conv(a, b, pads=1) ** 2)

    answers = []
    for on in (True, False):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(conv_ops, "WINOGRAD", on)
            y = gt.conv(gt.constant(x), gt.constant(w), pads=1).numpy()
            gx, gw = gt.grad(loss, (0, 1))(gt.constant(x), gt.constant(w))
            answers.append((y, gx.numpy(), gw.numpy()))
    want = torch.nn.functional.conv2d(torch.zeros((0, 8, 6, 7), dtype=torch.float64),
                                      torch.from_numpy(w), padding=1)  # fmt: skip
    for y, gx, gw in answers:
        assert y.shape == tuple(want.shape)
        assert gx.shape == x.shape and gw.shape == w.shape and not gw.any()
