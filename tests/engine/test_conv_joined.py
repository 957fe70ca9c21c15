"""A convolution input's cotangent terms joined into one conv_input (engine/ops/conv.py,
registry.vjp_term_rules): in a second-order pass the input of a convolution gets
A_w^T ybar from conv and A_h^T g from conv_weight, and the tape makes both one GEMM over
the two cotangents' windows stacked along its inner dimension (one col2im for strides
> 1). The HVPs of a small convolutional net, reverse-over-reverse (HessianOperator, one
vector and K vectors; compiled and dynamic) and forward-over-reverse (gt.hvp, whose
conv_input tangent is one call of both terms), against PyTorch's double backward and
against finite differences, in float64 and float32, over stride 1 and 2, padding
(asymmetric, and wider than the kernel) and groups."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import engine as gt
from engine.ops import conv as conv_ops
from engine.registry import impl_rules

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (input shape, [(weight shape, strides, pads, groups) per layer])
NETS = {
    "s1_padded": (
        (2, 3, 7, 6),
        [((4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), 1), ((4, 4, 3, 3), (1, 1), ((1, 1), (1, 1)), 1)],
    ),
    "s2_then_s1_groups": (
        (2, 4, 9, 8),
        [((6, 4, 3, 3), (2, 2), ((1, 1), (1, 1)), 1), ((6, 2, 3, 3), (1, 1), ((1, 1), (1, 1)), 3)],
    ),
    "asym_and_wide_pads": (
        (2, 2, 6, 5),
        [((4, 2, 3, 2), (1, 2), ((2, 0), (1, 1)), 1), ((2, 2, 2, 2), (1, 1), ((3, 0), (0, 2)), 2)],
    ),
}


def _net(case: str, dtype: Any, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray], list]:
    xs, layers = NETS[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(dtype)
    ws = [(rng.standard_normal(ws) / 2).astype(dtype) for ws, *_ in layers]
    return x, ws, [layer[1:] for layer in layers]


def _loss(windows: list, r: np.ndarray) -> Any:
    def loss(x: Any, *ws: Any) -> Any:
        h = x
        for w, (strides, pads, groups) in zip(ws, windows, strict=True):
            h = gt.tanh(gt.conv(h, w, strides=strides, pads=pads, groups=groups))
        return gt.sum(h * h * gt.constant(r))

    return loss


def _torch_loss(windows: list, r: np.ndarray) -> Any:
    def loss(x: Any, *ws: Any) -> Any:
        h = x
        for w, (strides, pads, groups) in zip(ws, windows, strict=True):
            flat = [p for lo_hi in reversed(pads) for p in lo_hi]
            h = torch.tanh(F.conv2d(F.pad(h, flat), w, stride=strides, groups=groups))
        return (h * h * torch.from_numpy(r)).sum()

    return loss


def _setup(case: str, dtype: Any) -> tuple:
    x, ws, windows = _net(case, dtype)
    shape = _forward_shape(x, ws, windows)
    r = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    return x, ws, windows, r


def _forward_shape(x: np.ndarray, ws: list, windows: list) -> tuple:
    h = gt.constant(x)
    for w, (strides, pads, groups) in zip(ws, windows, strict=True):
        h = gt.conv(h, gt.constant(w), strides=strides, pads=pads, groups=groups)
    return h.shape


def _torch_hvp(x: Any, ws: list, windows: list, r: Any, vs: list) -> list[np.ndarray]:
    params = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, *ws)]
    loss = _torch_loss(windows, r.astype(np.float64))(*params)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    tv = [torch.tensor(v, dtype=torch.float64) for v in vs]
    return [h.numpy() for h in torch.autograd.grad(grads, params, grad_outputs=tv)]


def _count_stacked(monkeypatch: Any) -> list[int]:
    """How many pairs each GEMM of stacked windows takes (conv_input's impl sums pairs
    that cannot stack one GEMM each)."""
    calls: list[int] = []
    stacked = conv_ops._conv_input_stacked

    def counted(xp: Any, pairs: list, **params: Any) -> Any:
        calls.append(len(pairs))
        return stacked(xp, pairs, **params)

    monkeypatch.setattr(conv_ops, "_conv_input_stacked", counted)
    return calls


TOL = {np.float64: 1e-10, np.float32: 2e-4}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(NETS))
def test_reused_hvps_join_the_input_terms_and_match_pytorch(
    case: str, dtype: Any, monkeypatch: Any
) -> None:
    """HessianOperator's HVPs (reverse-over-reverse): dynamic, captured and replayed,
    one vector (the input's two terms joined: conv_input calls of two pairs) and K
    vectors (a batched cotangent beside an unbatched one: the terms summed pair by pair)."""
    x, ws, windows, r = _setup(case, dtype)
    rng = np.random.default_rng(2)
    vs = [rng.standard_normal(a.shape).astype(dtype) for a in (x, *ws)]
    ref = _torch_hvp(x, ws, windows, r, vs)
    calls = _count_stacked(monkeypatch)
    op = gt.hessian_operator(_loss(windows, r), x, *ws)
    calls.clear()  # (the recorded gradient's: one term each)
    for _ in range(4):  # dynamic, captured, replayed twice
        hv = op.hvp(*[gt.constant(v) for v in vs])
        for mine, want in zip(hv, ref, strict=True):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(mine.numpy(), want, rtol=0, atol=TOL[dtype] * scale)
    joined = list(calls)
    calls.clear()
    for _ in range(3):  # one vector with a leading axis (the service's fresh HVP's)
        one = op.hvp_many(*[gt.constant(v[None]) for v in vs])
        for mine, want in zip(one, ref, strict=True):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(mine.numpy()[0], want, rtol=0, atol=TOL[dtype] * scale)
    joined_k1 = list(calls)
    many = op.hvp_many(*[gt.constant(np.stack([v, 2 * v])) for v in vs])
    # every convolution's input but the data's is reached by both terms, joined
    assert joined and all(n == 2 for n in joined), joined
    assert joined_k1 and all(n == 2 for n in joined_k1), joined_k1
    for mine, want in zip(many, ref, strict=True):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(mine.numpy()[0], want, rtol=0, atol=TOL[dtype] * scale)
        np.testing.assert_allclose(mine.numpy()[1], 2 * want, rtol=0, atol=2 * TOL[dtype] * scale)


@pytest.mark.parametrize("case", sorted(NETS))
def test_fresh_hvps_join_the_tangents_terms_and_match_pytorch(case: str, monkeypatch: Any) -> None:
    """gt.hvp (forward-over-reverse): conv_input's tangent A_w^T g' + A_w'^T g is one
    call of two pairs."""
    x, ws, windows, r = _setup(case, np.float64)
    rng = np.random.default_rng(3)
    vs = [rng.standard_normal(a.shape) for a in (x, *ws)]
    ref = _torch_hvp(x, ws, windows, r, vs)
    calls = _count_stacked(monkeypatch)
    hv = gt.hvp(_loss(windows, r), [gt.constant(a) for a in (x, *ws)], [gt.constant(v) for v in vs])
    assert 2 in calls, calls
    for mine, want in zip(hv, ref, strict=True):
        np.testing.assert_allclose(mine.numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", sorted(NETS))
def test_reused_hvps_against_finite_differences(case: str) -> None:
    """H v = (grad(p + eps v) - grad(p - eps v)) / (2 eps), float64."""
    x, ws, windows, r = _setup(case, np.float64)
    rng = np.random.default_rng(4)
    params = (x, *ws)
    vs = [rng.standard_normal(a.shape) for a in params]
    loss = _loss(windows, r)
    grad = gt.grad(loss, argnums=tuple(range(len(params))))
    eps = 1e-5
    plus = grad(*[gt.constant(p + eps * v) for p, v in zip(params, vs, strict=True)])
    minus = grad(*[gt.constant(p - eps * v) for p, v in zip(params, vs, strict=True)])
    op = gt.hessian_operator(loss, *params)
    for _ in range(3):  # dynamic, captured, replayed
        hv = op.hvp(*[gt.constant(v) for v in vs])
        for mine, a, b in zip(hv, plus, minus, strict=True):
            fd = (a.numpy() - b.numpy()) / (2 * eps)
            np.testing.assert_allclose(mine.numpy(), fd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["s1_padded", "s2_then_s1_groups", "asym_and_wide_pads"])
def test_joined_terms_in_chunks_of_one_image(case: str, monkeypatch: Any) -> None:
    """The stride-1 joined call stacks each group's rows of both cotangents in one chunk
    buffer, reused between chunks (its pad cells must stay zero)."""
    monkeypatch.setattr(conv_ops, "CHUNK_BYTES", 1)
    monkeypatch.setattr(conv_ops, "KERNEL_CHUNK_BYTES", 1)  # the compiled gather's chunks
    test_reused_hvps_join_the_input_terms_and_match_pytorch(case, np.float64, monkeypatch)


def test_the_joined_impl_is_the_sum_of_its_pairs() -> None:
    """conv_input of pairs against the sum of single-pair calls, on the host's chunked
    and strided routes and on the route a GPU takes (weights with leading axes: one
    gather of each cotangent, stacked), float64, to rounding."""
    rng = np.random.default_rng(5)
    for strides, pads, groups in [
        ((1, 1), ((1, 1), (1, 1)), 1),
        ((1, 1), ((0, 2), (3, 0)), 2),
        ((2, 2), ((1, 0), (0, 1)), 2),
        ((3, 1), ((2, 2), (1, 1)), 1),
    ]:
        window = {"strides": strides, "pads": pads, "dilations": (1, 1), "groups": groups}
        n, c, o, spatial = 3, 4, 6, (9, 8)
        out = conv_ops._out_sizes(spatial, (3, 3), strides, (1, 1), pads)
        # no leading axes; leading axes everywhere; size-1 leading axes on some operands
        for g_leads, w_leads in [
            ([(), (), ()], [(), (), ()]),
            ([(2,), (2,), (2,)], [(2,), (2,), (2,)]),
            ([(1,), (), (1,)], [(), (1,), ()]),
            ([(2,), (), ()], [(), (), (2,)]),
        ]:
            gs = [rng.standard_normal(lead + (n, o) + out) for lead in g_leads]
            ws = [rng.standard_normal(lead + (o, c // groups, 3, 3)) for lead in w_leads]
            pairs = [a for pair in zip(gs, ws, strict=True) for a in pair]
            joined = impl_rules[conv_ops.conv_input_p](np, *pairs, spatial=spatial, **window)
            single = sum(
                impl_rules[conv_ops.conv_input_p](np, g, w, spatial=spatial, **window)
                for g, w in zip(gs, ws, strict=True)
            )
            np.testing.assert_allclose(joined, single, rtol=1e-12, atol=1e-12)


PAIR_WINDOW = {
    "strides": (1, 1),
    "pads": ((1, 1), (1, 1)),
    "dilations": (1, 1),
    "groups": 1,
    "spatial": (5, 5),
}


@pytest.mark.parametrize(
    ("g_leads", "w_leads"),
    [([(1,), (3,)], [(), ()]), ([(1,), ()], [(), (3,)])],
    ids=["ones-then-three", "ones-beside-a-batched-kernel"],
)
def test_joined_pairs_whatever_pair_holds_the_size_one_axes(g_leads, w_leads) -> None:
    """The joined call equals the sum of single calls when the first pair's leading axes
    are all 1 and another pair's are not (the reshape to stack them is for all-ones
    leads only; found by review r8)."""
    conv_input = impl_rules[conv_ops.conv_input_p]
    rng = np.random.default_rng(0)
    gs = [rng.standard_normal((*lead, 2, 4, 5, 5)) for lead in g_leads]
    ws = [rng.standard_normal((*lead, 4, 3, 3, 3)) for lead in w_leads]
    single = sum(conv_input(np, g, w, **PAIR_WINDOW) for g, w in zip(gs, ws, strict=True))
    joined = conv_input(np, gs[0], ws[0], gs[1], ws[1], **PAIR_WINDOW)
    np.testing.assert_allclose(joined, single, rtol=1e-12, atol=1e-12)


def test_joined_pairs_of_two_dtypes_answer_in_the_wider() -> None:
    """A float32 pair beside a float64 one (the host's stride-1 route): float64, as on
    the strided route, computed in float64 (found by review r8: it answered float32)."""
    conv_input = impl_rules[conv_ops.conv_input_p]
    rng = np.random.default_rng(1)
    g1 = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g2, w2 = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    joined = conv_input(np, g1, w1, g2, w2, **PAIR_WINDOW)
    wide = conv_input(np, g1.astype(np.float64), w1.astype(np.float64), **PAIR_WINDOW)
    exact = wide + conv_input(np, g2, w2, **PAIR_WINDOW)
    assert joined.dtype == np.float64
    np.testing.assert_allclose(joined, exact, rtol=1e-12, atol=1e-12)
