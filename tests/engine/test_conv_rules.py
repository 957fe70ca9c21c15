"""The convolution primitives' rules (engine/ops/conv.py: conv, conv_input, conv_weight
and the windows they share) against PyTorch's convolutions and their autograd, against
finite differences, and against the im2col + matmul form the per-example machinery
records (`conv.unfused()`), over strides, dilations, pads (asymmetric ones, and pads
wider than the kernel, which the stride-1 transposed convolution crops) and groups; with
batched leading axes (jacobians and Hessians in one pass) and to second order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import engine as gt
from engine.ops import conv as conv_ops
from engine.registry import impl_rules
from engine.testing import check_grads

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (x shape, w shape, strides, pads as (begin, end) per axis, dilations, groups)
CASES = {
    "s1": ((2, 3, 6, 5), (4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    "s1_asym_dilated_groups": ((2, 4, 7, 6), (6, 2, 3, 2), (1, 1), ((2, 0), (1, 3)), (2, 1), 2),
    "s1_pads_wider_than_kernel": ((2, 3, 5, 4), (2, 3, 2, 2), (1, 1), ((3, 0), (0, 2)), (1, 1), 1),
    "s2": ((2, 3, 7, 8), (4, 3, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), 1),
    "strided_mixed": ((2, 6, 8, 7), (6, 2, 3, 3), (2, 1), ((1, 2), (0, 1)), (1, 2), 3),
    "depthwise": ((2, 4, 6, 6), (4, 1, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 4),
    "1d_s1": ((3, 2, 9), (4, 2, 3), (1,), ((2, 2),), (2,), 1),
    "1d_s3": ((3, 2, 11), (4, 1, 3), (3,), ((2, 1),), (2,), 2),
    "3d": ((1, 2, 4, 3, 4), (2, 2, 2, 2, 2), (1, 1, 1), ((1, 0), (0, 1), (1, 1)), (1, 1, 2), 1),
}
SYMMETRIC = [k for k, c in CASES.items() if all(lo == hi for lo, hi in c[3])]


def _arrays(case: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    xs, ws, strides, pads, dilations, groups = CASES[case]
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    window = {"strides": strides, "pads": pads, "dilations": dilations, "groups": groups}
    return x, w, b, window


def _torch_conv(x: Any, w: Any, b: Any, window: dict) -> Any:
    """PyTorch's convolution with asymmetric pads: pad first, then conv with none."""
    nd = len(window["strides"])
    flat = [p for lo_hi in reversed(window["pads"]) for p in lo_hi]  # F.pad: last axis first
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return conv(
        F.pad(x, flat),
        w,
        b,
        stride=window["strides"],
        dilation=window["dilations"],
        groups=window["groups"],
    )


def _t(a: np.ndarray) -> Any:
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_value_gradients_and_second_order_match_pytorch(case: str) -> None:
    x, w, b, window = _arrays(case)
    rng = np.random.default_rng(1)
    tx, tw, tb = _t(x), _t(w), _t(b)
    y_ref = _torch_conv(tx, tw, tb, window)
    r = rng.standard_normal(tuple(y_ref.shape))
    loss_ref = (y_ref**2 * torch.tensor(r)).sum()  # not linear: a second order to check
    g_ref = torch.autograd.grad(loss_ref, (tx, tw, tb), create_graph=True)
    v = [rng.standard_normal(a.shape) for a in (x, w, b)]
    hv_ref = torch.autograd.grad(
        sum((g * torch.tensor(vi)).sum() for g, vi in zip(g_ref, v, strict=True)), (tx, tw, tb)
    )

    def loss(x: Any, w: Any, b: Any) -> Any:
        return gt.sum(gt.conv(x, w, b, **window) ** 2 * gt.constant(r))

    args = [gt.constant(a) for a in (x, w, b)]
    np.testing.assert_allclose(
        gt.conv(*args, **window).numpy(), y_ref.detach().numpy(), rtol=1e-12, atol=1e-12
    )
    grads = gt.grad(loss, argnums=(0, 1, 2))(*args)
    hvps = gt.hvp(loss, args, [gt.constant(a) for a in v])
    for mine, ref in zip((*grads, *hvps), (*g_ref, *hv_ref), strict=True):
        np.testing.assert_allclose(mine.numpy(), ref.detach().numpy(), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("case", SYMMETRIC)
def test_input_cotangent_is_pytorchs_transposed_convolution(case: str) -> None:
    """conv_input(g, w) = A_w^T g is conv_transpose of g (the stride-1 route is itself a
    convolution of g; the strided one a col2im)."""
    x, w, _, window = _arrays(case)
    nd = len(window["strides"])
    y = gt.conv(gt.constant(x), gt.constant(w), **window)
    g = np.random.default_rng(2).standard_normal(y.shape)
    dx = conv_ops._conv_input(gt.constant(g), gt.constant(w), x.shape[2:], **window)
    pads = [lo for lo, _ in window["pads"]]
    spatial_out = [
        (o - 1) * s - 2 * p + d * (k - 1) + 1
        for o, s, p, d, k in zip(
            g.shape[2:], window["strides"], pads, window["dilations"], w.shape[2:], strict=True
        )
    ]
    transposed = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    ref = transposed(
        torch.tensor(g),
        torch.tensor(w),
        stride=window["strides"],
        padding=pads,
        output_padding=[n - m for n, m in zip(x.shape[2:], spatial_out, strict=True)],
        groups=window["groups"],
        dilation=window["dilations"],
    )
    np.testing.assert_allclose(dx.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_finite_differences_to_second_order(case: str) -> None:
    x, w, _, window = _arrays(case)
    r = gt.constant(np.random.default_rng(3).standard_normal(gt.conv(x, w, **window).shape))

    def f(x: Any, w: Any) -> Any:
        y = gt.conv(x, w, **window)
        return y * y * r  # bilinear squared: every rule's derivative is non-zero

    check_grads(f, [x, w], order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["s1_asym_dilated_groups", "strided_mixed", "1d_s1", "3d"])
def test_batched_leading_axes_hessian_and_jacobians(case: str) -> None:
    """Hessians forward-over-reverse (a batch of basis tangents through conv and both
    cotangent primitives), reverse-over-reverse (a batch of cotangents through them) and
    jacobians both ways equal PyTorch's."""
    x, w, _, window = _arrays(case)
    r = np.random.default_rng(4).standard_normal(gt.conv(x, w, **window).shape)

    def loss(x: Any, w: Any) -> Any:
        return gt.sum(gt.conv(x, w, **window) ** 2 * gt.constant(r))

    def loss_ref(x: Any, w: Any) -> Any:
        return (_torch_conv(x, w, None, window) ** 2 * torch.tensor(r)).sum()

    xt, wt = torch.tensor(x), torch.tensor(w)
    h_ref = torch.autograd.functional.hessian(loss_ref, (xt, wt))
    h_fwd = gt.hessian(loss, argnums=(0, 1))(gt.constant(x), gt.constant(w))
    grad = gt.grad(loss, argnums=(0, 1))
    h_rev = [
        gt.jacrev(lambda x, w, i=i: grad(x, w)[i], argnums=(0, 1))(gt.constant(x), gt.constant(w))
        for i in range(2)
    ]
    for i in range(2):
        for j in range(2):
            ref = h_ref[i][j].numpy()
            np.testing.assert_allclose(h_fwd[i][j].numpy(), ref, rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(h_rev[i][j].numpy(), ref, rtol=1e-10, atol=1e-10)
    j_ref = torch.autograd.functional.jacobian(
        lambda x, w: _torch_conv(x, w, None, window), (xt, wt)
    )
    for jac in (gt.jacrev, gt.jacfwd):
        mine = jac(lambda x, w: gt.conv(x, w, **window), argnums=(0, 1))(x, w)
        for a, ref in zip(mine, j_ref, strict=True):
            np.testing.assert_allclose(a.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_unfused_form_gives_the_same_derivatives(case: str) -> None:
    x, w, b, window = _arrays(case)
    r = gt.constant(np.random.default_rng(5).standard_normal(gt.conv(x, w, **window).shape))
    v = [gt.constant(a) for a in _arrays(case, seed=6)[:3]]

    def loss(x: Any, w: Any, b: Any) -> Any:
        return gt.sum(gt.tanh(gt.conv(x, w, b, **window)) * r)

    args = [gt.constant(a) for a in (x, w, b)]
    fused = [*gt.grad(loss, argnums=(0, 1, 2))(*args), *gt.hvp(loss, args, v)]
    with conv_ops.unfused():
        unfused = [*gt.grad(loss, argnums=(0, 1, 2))(*args), *gt.hvp(loss, args, v)]
    for a, ref in zip(fused, unfused, strict=True):
        np.testing.assert_allclose(a.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


def test_a_fresh_hvp_leaves_the_kernels_products_unrun() -> None:
    """The weight's cotangent of a fresh HVP is wanted for its tangent only: conv_weight
    is deferred (as matmul is) and its forward never runs."""
    x, w, _, window = _arrays("s1")
    calls: list[int] = []
    impl = impl_rules[conv_ops.conv_weight_p]

    def counted(*args: Any, **params: Any) -> Any:
        calls.append(1)
        return impl(*args, **params)

    def loss(x: Any, w: Any) -> Any:
        return gt.sum(gt.conv(x, w, **window) ** 2)

    impl_rules[conv_ops.conv_weight_p] = counted
    try:
        args = [gt.constant(x), gt.constant(w)]
        hv = gt.hvp(loss, args, args)
        gt.grad(loss, argnums=(0, 1))(*args)
    finally:
        impl_rules[conv_ops.conv_weight_p] = impl
    assert len(calls) == 1 + 2  # the gradient's product; the HVP's two tangent terms only
    assert hv[1].shape == w.shape


@pytest.mark.parametrize(
    "case", ["s1", "s1_asym_dilated_groups", "s1_pads_wider_than_kernel", "3d"]
)
def test_the_input_cotangent_in_chunks_of_one_image(case: str, monkeypatch: Any) -> None:
    """On the host the stride-1 input cotangent runs a few images at a time (a buffer
    reused between chunks, whose pad cells must stay zero): one image a chunk gives the
    same derivatives as the im2col + matmul form."""
    monkeypatch.setattr(conv_ops, "CHUNK_BYTES", 1)
    monkeypatch.setattr(conv_ops, "KERNEL_CHUNK_BYTES", 1)  # the compiled gather's chunks
    test_the_unfused_form_gives_the_same_derivatives(case)


# An empty batch, no input channels or no filters: every size is still defined, and the
# primitives' reshapes must not lean on NumPy inferring a -1 (it cannot, for an empty array).
EMPTY_WINDOW = {"pads": ((1, 1), (1, 1)), "dilations": (1, 1), "groups": 1}


def _loss_and_grads(x: np.ndarray, w: np.ndarray, strides: tuple) -> tuple:
    def loss(x: Any, w: Any) -> Any:
        y = gt.conv(x, w, strides=strides, **EMPTY_WINDOW)
        return gt.sum(y * y) + gt.sum(x) + gt.sum(w)

    value, (gx, gw) = gt.value_and_grad(loss, argnums=(0, 1))(gt.constant(x), gt.constant(w))
    y = gt.conv(x, w, strides=strides, **EMPTY_WINDOW).numpy()
    return y, float(value.numpy()), gx.numpy(), gw.numpy()


@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
def test_an_empty_batch_answers_as_pytorch(strides: tuple) -> None:
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((0, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3))
    y, value, gx, gw = _loss_and_grads(x, w, strides)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = F.conv2d(F.pad(tx, [1, 1, 1, 1]), tw, stride=strides)
    total = (ty * ty).sum() + tx.sum() + tw.sum()
    total.backward()
    assert y.shape == tuple(ty.shape)
    np.testing.assert_allclose(value, total.item(), rtol=1e-12)
    assert gx.shape == x.shape
    np.testing.assert_allclose(gw, tw.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
def test_no_filters_or_no_channels_are_sums_over_nothing(strides: tuple) -> None:
    # PyTorch refuses a kernel of no filters and answers no channels with a (2, 0, ...)
    # result; the sums these are give a result of O channels, zero where C is 0.
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((0, 3, 3, 3))
    y, value, gx, gw = _loss_and_grads(x, w, strides)
    assert y.shape[:2] == (2, 0)
    np.testing.assert_allclose(value, x.sum(), rtol=1e-12)
    np.testing.assert_array_equal(gx, np.ones_like(x))
    assert gw.shape == w.shape
    x, w = rng.standard_normal((2, 0, 6, 6)), rng.standard_normal((4, 0, 3, 3))
    y, value, gx, gw = _loss_and_grads(x, w, strides)
    np.testing.assert_array_equal(y, np.zeros((2, 4) + y.shape[2:]))
    assert value == 0.0 and gx.shape == x.shape and gw.shape == w.shape
