"""Layer norm with its affine as one primitive (engine/ops/nn.py layer_norm_affine, its
VJPs layer_norm_affine_grad and layer_norm_scale_grad; kernels in engine/kernels/
layernorm_affine.py): values, gradients, HVPs and jacobians against PyTorch's
layer_norm in float64 (1e-12), with the kernels and with their NumPy path (the entry
points answering False, as without numba, with GRADTAPE_KERNELS=numpy or on CuPy);
the kernels' batched blocks (a fresh HVP's vectors, jacobians) against the NumPy path;
NaN and inf rows; the compiled replay bit-equal to the dynamic pass (gradient and
HVP); which layouts bind the fused primitive. Derivatives to third order against
finite differences: tests/engine/test_fused_primitives.py (its layer_norm case)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engine as gt
from engine import kernels
from engine.kernels import layernorm_affine as K
from engine.ops import nn
from engine.testing import bound_primitives, check_grads

ENTRY_POINTS = ("affine_forward", "affine_grad", "scale_grad")
SHAPES = [(64, 16, 64), (7, 1), (5, 3), (2, 300), (9,)]


@pytest.fixture(params=["kernels", "numpy"])
def path(request, monkeypatch):
    """Each test once with the kernels (where numba runs) and once with the NumPy path."""
    if request.param == "kernels":
        if not kernels.enabled():
            pytest.skip("numba is not installed")
        yield "kernels"
        return
    for name in ENTRY_POINTS:
        monkeypatch.setattr(K, name, lambda *args: False)
    yield "numpy"


def _counting(monkeypatch) -> dict[str, int]:
    """Count the entry points' kernel runs (True answers)."""
    runs = dict.fromkeys(ENTRY_POINTS, 0)
    for name in ENTRY_POINTS:
        original = getattr(K, name)

        def counted(*args, _name=name, _original=original):
            ran = _original(*args)
            runs[_name] += bool(ran)
            return ran

        monkeypatch.setattr(K, name, counted)
    return runs


def _args(rng, shape, dtype=np.float64):
    k = shape[-1]
    x = (3 * rng.standard_normal(shape) + 1).astype(dtype)
    return x, rng.standard_normal(k).astype(dtype), rng.standard_normal(k).astype(dtype)


def _torch_loss(w):
    def loss(x, s, b):
        y = F.layer_norm(x, (x.shape[-1],), s, b, eps=1e-5)
        return (torch.tanh(y) * torch.tensor(w)).sum()

    return loss


def _loss(w):
    def loss(x, s, b):
        return gt.sum(gt.tanh(gt.layer_norm(x, s, b, eps=1e-5)) * gt.constant(w))

    return loss


@pytest.mark.parametrize("shape", SHAPES)
def test_values_and_gradients_match_pytorch_in_float64(path, monkeypatch, shape) -> None:
    rng = np.random.default_rng(0)
    x, s, b = _args(rng, shape)
    runs = _counting(monkeypatch)
    y = gt.layer_norm(gt.constant(x), gt.constant(s), gt.constant(b), eps=1e-5)
    t = [torch.tensor(a, requires_grad=True) for a in (x, s, b)]
    want = F.layer_norm(t[0], shape[-1:], t[1], t[2], eps=1e-5)
    np.testing.assert_allclose(y.numpy(), want.detach().numpy(), rtol=1e-12, atol=1e-12)
    w = rng.standard_normal(shape)
    grads = gt.grad(_loss(w), argnums=(0, 1, 2))(*[gt.constant(a) for a in (x, s, b)])
    tgrads = torch.autograd.grad(_torch_loss(w)(*t), t)
    for got, expected in zip(grads, tgrads, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)
    ran = runs["affine_forward"] > 0 and runs["affine_grad"] > 0
    assert ran == (path == "kernels")
    # scale's VJP as a kernel where x has rows to sum over
    assert (runs["scale_grad"] > 0) == (path == "kernels" and len(shape) > 1)


def test_hvp_and_jacobians_match_pytorch_in_float64(path) -> None:
    rng = np.random.default_rng(1)
    x, s, b = _args(rng, (4, 3, 6))
    w = rng.standard_normal(x.shape)
    vs = [rng.standard_normal(a.shape) for a in (x, s, b)]
    t = [torch.tensor(a, requires_grad=True) for a in (x, s, b)]
    tgrads = torch.autograd.grad(_torch_loss(w)(*t), t, create_graph=True)
    dot = sum((g * torch.tensor(v)).sum() for g, v in zip(tgrads, vs, strict=True))
    want = torch.autograd.grad(dot, t)
    got = gt.hvp(_loss(w), [gt.constant(a) for a in (x, s, b)], [gt.constant(v) for v in vs])
    for g, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-11, atol=1e-12)

    # jacobians of the output in each argument, both modes (batched cotangents and
    # tangents through the rules and the kernels' blocks)
    def ln(x, s, b):
        return gt.layer_norm(x, s, b, eps=1e-5)

    tjac = torch.autograd.functional.jacobian(
        lambda x, s, b: F.layer_norm(x, (6,), s, b, eps=1e-5),
        tuple(torch.tensor(a) for a in (x, s, b)),
    )
    args = [gt.constant(a) for a in (x, s, b)]
    for mode in (gt.jacrev, gt.jacfwd):
        jac = mode(ln, argnums=(0, 1, 2))(*args)
        for j, expected in zip(jac, tjac, strict=True):
            np.testing.assert_allclose(j.numpy(), expected.numpy(), rtol=1e-11, atol=1e-12)


def test_second_order_against_finite_differences(path) -> None:
    rng = np.random.default_rng(2)
    check_grads(
        lambda x, s, b: gt.layer_norm(x, s, b, eps=1e-5),
        list(_args(rng, (3, 2, 5))),
        order=2,
        modes=("fwd", "rev"),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_kernels_and_the_numpy_path_agree_to_rounding(dtype) -> None:
    if not kernels.enabled():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    x, s, b = _args(rng, (64, 16, 64), dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    eps = 1e-5
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}

    def numpy_path(fn):
        saved = {name: getattr(K, name) for name in ENTRY_POINTS}
        try:
            for name in ENTRY_POINTS:
                setattr(K, name, lambda *args: False)
            return fn()
        finally:
            for name, value in saved.items():
                setattr(K, name, value)

    def forward():
        return nn._layer_norm_affine_impl(np, x, s, b, eps=eps)

    def grad_x():
        return nn._layer_norm_affine_grad_impl(np, g, x, s, eps=eps)

    def grad_scale():
        return nn._layer_norm_scale_grad_impl(np, g, x, eps=eps, axes=(0, 1))

    for fn in (forward, grad_x, grad_scale):
        np.testing.assert_allclose(fn(), numpy_path(fn), **tol)
    # blocks: a batch of cotangents (one scale), a batch of scale tangents (one g), a
    # broadcast (strided) cotangent, a batch of scale cotangents' sums
    batch = rng.standard_normal((3,) + x.shape).astype(dtype)
    scales = rng.standard_normal((3, 1, 1, 64)).astype(dtype)
    strided = np.broadcast_to(g[:, :1], x.shape)
    cases = [
        lambda: nn._layer_norm_affine_grad_impl(np, batch, x, s, eps=eps),
        lambda: nn._layer_norm_affine_grad_impl(np, g, x, scales, eps=eps),
        lambda: nn._layer_norm_affine_grad_impl(np, strided, x, s.reshape(1, 1, 64), eps=eps),
        lambda: nn._layer_norm_scale_grad_impl(np, batch, x, eps=eps, axes=(1, 2)),
    ]
    for case in cases:
        got = case()
        np.testing.assert_allclose(got, numpy_path(case), **tol)
    for i in range(3):
        np.testing.assert_allclose(
            cases[0]()[i], nn._layer_norm_affine_grad_impl(np, batch[i], x, s, eps=eps), **tol
        )


def test_nan_and_inf_rows_stay_in_their_rows(path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    s, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    y = nn._layer_norm_affine_impl(np, x, s, b, eps=1e-5)
    assert np.isnan(y[1:]).all() and np.isfinite(y[0]).all()
    g = np.ones_like(x)
    dx = nn._layer_norm_affine_grad_impl(np, g, x, s, eps=1e-5)
    assert np.isnan(dx[1:]).all() and np.isfinite(dx[0]).all()


def test_the_compiled_replay_is_bit_equal_to_the_dynamic_pass(path) -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 5, 16)).astype(np.float32)
    loss = _loss(w)
    jitted = gt.jit(loss)
    for _ in range(4):
        args = [gt.constant(a) for a in _args(rng, (8, 5, 16), np.float32)]
        vs = [gt.constant(rng.standard_normal(a.shape).astype(np.float32)) for a in args]
        compiled = jitted.grad(argnums=(0, 1, 2))(*args)
        dynamic = gt.grad(loss, argnums=(0, 1, 2))(*args)
        for c, d in zip(compiled, dynamic, strict=True):
            np.testing.assert_array_equal(c.numpy(), d.numpy())
        compiled = jitted.hvp(args, vs)
        dynamic = gt.hvp(loss, args, vs)
        for c, d in zip(compiled, dynamic, strict=True):
            np.testing.assert_array_equal(c.numpy(), d.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()


def test_the_fused_primitive_where_scale_and_shift_are_rows_of_xs_dtype() -> None:
    rng = np.random.default_rng(5)
    x, s, b = (gt.constant(a) for a in _args(rng, (2, 3, 4)))

    def ln(*args):
        return lambda: gt.layer_norm(*args, eps=1e-5)

    assert bound_primitives(ln(x, s, b)) == ["layer_norm_affine"]
    # no shift, or a scale of another shape: normalize and the ops
    assert "layer_norm_affine" not in bound_primitives(ln(x, s))
    assert "layer_norm_affine" not in bound_primitives(ln(x, gt.reshape(s, (1, 4)), b))
    # another dtype: the ops' refusal, as before (gradtape never casts silently)
    with pytest.raises(TypeError, match="dtypes differ"):
        gt.layer_norm(x, gt.constant(s.numpy().astype(np.float32)), b)
    wide = gt.reshape(s, (1, 4)) * gt.constant(np.ones((3, 1)))
    y = gt.layer_norm(x, wide, b, eps=1e-5)
    np.testing.assert_allclose(y.numpy(), gt.layer_norm(x, s, b, eps=1e-5).numpy(), rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalize_grad_of_a_batch_is_each_block_bit_for_bit(dtype) -> None:
    """A batch of cotangents against one x (the fresh HVP's N(t)) runs block by block on
    the host: each block the unbatched call's bits, xhat shared or batched."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 5, 16)).astype(dtype)
    xhat = nn._normalize_impl(np, x, eps=1e-5)
    a = rng.standard_normal((2, 3) + x.shape).astype(dtype)
    want = np.stack(
        [
            np.stack([nn._normalize_grad_impl(np, a[i, j], x, xhat, eps=1e-5) for j in range(3)])
            for i in range(2)
        ]
    )
    got = nn._normalize_grad_impl(np, a, x, xhat, eps=1e-5)
    np.testing.assert_array_equal(got, want)
    batched = np.ascontiguousarray(np.broadcast_to(xhat, a.shape))
    np.testing.assert_array_equal(nn._normalize_grad_impl(np, a, x, batched, eps=1e-5), want)
