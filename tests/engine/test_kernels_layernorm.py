"""Layer normalization's core (normalize and normalize_grad, engine/ops/nn.py) with its
broadcast steps as kernels (engine/kernels/layernorm.py): bit-identical to the NumPy
operations they replace (both dtypes, rows of 1 to 300, an in-place scale), the cases
left to NumPy (broadcast cotangents, strided operands); through the engine, layer_norm's
derivatives against finite differences to third order, its float32 gradient against
PyTorch, a compiled replay bit-equal to the dynamic pass; the ONNX LayerNormalization
through the primitive only where it names Y alone over the last axis."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engine as gt
from engine import kernels
from engine.kernels import layernorm as K
from engine.ops import nn
from engine.testing import bound_primitives, check_grads

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


def _both(monkeypatch, fn):
    """fn() with the kernels, then with their NumPy operations."""
    with_kernels = fn()
    with monkeypatch.context() as m:
        for name in ("center", "scale_rows", "combine"):
            m.setattr(K, name, lambda *args: False)
        without = fn()
    return with_kernels, without


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(64, 16, 64), (7, 1), (5, 3), (2, 300), (128,)])
def test_normalize_and_its_grad_are_the_numpy_operations_bit_for_bit(
    monkeypatch, dtype, shape
) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    a = rng.standard_normal(shape).astype(dtype)

    def run():
        y = nn._normalize_impl(np, x, eps=1e-5)
        return y, nn._normalize_grad_impl(np, a, x, y, eps=1e-5)

    (y, g), (y0, g0) = _both(monkeypatch, run)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(g, g0)
    wide = x.astype(np.float64)
    exact = (wide - wide.mean(-1, keepdims=True)) / np.sqrt(wide.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, exact, rtol=2e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


def test_what_the_kernels_leave_to_numpy() -> None:
    x = np.ones((4, 6), np.float32)
    r = np.ones((4, 1), np.float32)
    assert not K.scale_rows(x[:, ::2], r[:, :1])  # strided
    assert not K.scale_rows(x.astype(np.float16), r.astype(np.float16))
    assert not K.center(x, r.astype(np.float64), x.copy(), x.copy())  # dtypes differ
    big = np.ones((3, 4, 6), np.float32)  # a batch of cotangents against one x
    assert not K.combine(big, x, r, r, r, np.empty_like(big))


def test_a_batch_of_cotangents_meets_one_x() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6))
    y = nn._normalize_impl(np, x, eps=1e-5)
    batch = rng.standard_normal((3, 4, 6))
    got = nn._normalize_grad_impl(np, batch, x, y, eps=1e-5)
    for b in range(3):
        np.testing.assert_allclose(
            got[b], nn._normalize_grad_impl(np, batch[b], x, y, eps=1e-5), rtol=1e-14
        )


def _layer_norm(x, gamma, beta):
    return gt.layer_norm(x, gamma, beta, eps=1e-5)


def test_layer_norm_through_the_engine() -> None:
    rng = np.random.default_rng(2)
    shapes = [(3, 4, 5), (5,), (5,)]
    check_grads(
        _layer_norm, [rng.standard_normal(s) for s in shapes], order=3, atol=1e-5, rtol=1e-5
    )
    # float32 (the kernels' dtype in models): the gradient against PyTorch's
    args = [rng.standard_normal(s).astype(np.float32) for s in [(64, 16, 64), (64,), (64,)]]
    w = rng.standard_normal((64, 16, 64)).astype(np.float32)

    def loss(*xs):
        return gt.sum(gt.tanh(_layer_norm(*xs)) * gt.constant(w))

    grads = gt.grad(loss, argnums=(0, 1, 2))(*[gt.constant(a) for a in args])
    tx = [torch.tensor(a, requires_grad=True) for a in args]
    tloss = (torch.tanh(F.layer_norm(tx[0], (64,), tx[1], tx[2], eps=1e-5)) * torch.tensor(w)).sum()
    tgrads = torch.autograd.grad(tloss, tx)
    for g, tg in zip(grads, tgrads, strict=True):
        np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=2e-4, atol=2e-5)
    # the compiled replay: bit-equal to the dynamic pass
    jitted = gt.jit(loss)
    for _ in range(4):
        args = [gt.constant(rng.standard_normal(a.shape).astype(np.float32)) for a in args]
        compiled = jitted.grad(argnums=(0, 1, 2))(*args)
        dynamic = gt.grad(loss, argnums=(0, 1, 2))(*args)
        for c, d in zip(compiled, dynamic, strict=True):
            np.testing.assert_array_equal(c.numpy(), d.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()


def test_onnx_layer_normalization_uses_the_primitive_where_it_can() -> None:
    from engine.onnx.ops import layer_norm_node

    rng = np.random.default_rng(3)
    x = gt.constant(rng.standard_normal((2, 3, 8)).astype(np.float32))
    scale = rng.standard_normal(8).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    attrs = {"axis": -1, "epsilon": 1e-5}
    assert bound_primitives(lambda: layer_norm_node([x, scale, bias], attrs, 18, 1)) == [
        "layer_norm_affine"
    ]
    # no bias: normalize, then the scale
    assert bound_primitives(lambda: layer_norm_node([x, scale], attrs, 18, 1)) == [
        "normalize",
        "multiply",
    ]
    (y,) = layer_norm_node([x, scale, bias], attrs, 18, 1)
    expected = F.layer_norm(torch.tensor(x.numpy()), (8,), torch.tensor(scale), torch.tensor(bias))
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    # three outputs named, or statistics over two axes: the composite, as before
    y3, mean, inv = layer_norm_node([x, scale, bias], attrs, 18, 3)
    assert "normalize" not in bound_primitives(
        lambda: layer_norm_node([x, scale, bias], attrs, 18, 3)
    )
    np.testing.assert_allclose(y3.numpy(), y.numpy(), rtol=1e-5, atol=1e-6)
    assert mean.shape == (2, 3, 1) and inv.shape == (2, 3, 1)
    (y2,) = layer_norm_node([x, np.ones((3, 8), np.float32)], {"axis": -2}, 18, 1)[:1]
    wide = x.numpy().astype(np.float64)
    flat = wide.reshape(2, -1)
    exact = (flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y2.numpy(), exact.reshape(wide.shape), rtol=1e-4, atol=1e-5)
