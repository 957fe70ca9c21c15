"""The convolutions' compiled window kernels (engine/kernels/conv.py) against their NumPy
routes (engine/ops/conv.py), which are the reference: the gather into the GEMM's layout,
the strided input cotangent's col2im and the stride-1 input cotangent's chunked windows
must give the same numbers bit for bit (copies, and col2im's sums added in NumPy's
order), over strides, pads (asymmetric, wider than the kernel, negative: crops),
dilations, groups, kernel sizes 1/3/5, 1-d convolutions, float32 and float64, inputs in
every layout a call site passes (contiguous, a convolution's transposed result, slices,
leading axes) and the smallest sizes (the kernels are chosen at every size: no
threshold, they measured faster down to a 1 x 1 x 4 x 4 image, bench/RESULTS.md). Then
the ops through the engine with the kernels on against PyTorch's conv2d and its double
backward, the compiled replay (the gather's form writes into the schedule's buffer), and
a process with GRADTAPE_KERNELS=numpy giving the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine as gt
from engine import kernels
from engine.ops import conv as conv_ops
from engine.registry import impl_rules

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

conv_input = impl_rules[conv_ops.conv_input_p]


@pytest.fixture(autouse=True)
def _window_routes(monkeypatch: Any) -> None:
    """The stride-1 3 x 3 input cotangents by their windows' GEMM, not by Winograd
    (tests/engine/test_winograd.py): these tests compare the window kernels' bits."""
    monkeypatch.setattr(conv_ops, "WINOGRAD", False)


@contextmanager
def numpy_route(monkeypatch: Any):
    """The NumPy routes only (what runs without numba or with GRADTAPE_KERNELS=numpy)."""
    with monkeypatch.context() as m:
        m.setattr(conv_ops, "_compiled", lambda *args: False)
        yield


def counted(monkeypatch: Any, name: str) -> list:
    """Calls of conv_ops.<name> (a kernel route), recorded as their keyword `out` or None."""
    calls: list = []
    inner = getattr(conv_ops, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("out"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(conv_ops, name, spy)
    return calls


def layout(x: np.ndarray, how: str) -> np.ndarray:
    """x's values in the memory layouts call sites pass."""
    if how == "contiguous":
        return x
    if how == "transposed":  # a convolution's result: (N, C, ...) over (C, N, ...) memory
        return np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
    if how == "columns-major":  # dense, the spatial axes swapped in memory: strided rows
        return np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    if how == "read-only":  # a recorded value or an array from shared memory
        x = x.copy()
        x.setflags(write=False)
        return x
    if how == "sliced":  # not dense: the kernel route copies it first
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    raise ValueError(how)


# (x shape, kernel, strides, pads, dilations, groups)
GATHERS = [
    ((2, 3, 7, 6), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    ((2, 4, 9, 8), (3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), 2),
    ((3, 2, 8, 9), (5, 5), (1, 2), ((2, 0), (1, 3)), (1, 1), 1),
    ((2, 4, 6, 7), (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 4),
    ((2, 2, 9, 9), (3, 2), (3, 1), ((0, 2), (2, 2)), (2, 1), 1),
    ((2, 2, 10, 9), (3, 3), (1, 1), ((-1, 0), (0, -2)), (1, 2), 2),  # crops
    ((1, 2, 5, 5), (3, 3), (1, 1), ((4, 3), (3, 4)), (1, 1), 1),  # pads wider than the kernel
    ((1, 1, 4, 4), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),  # the smallest
    # stride 1, output as wide as x: whole shifted planes (one-sided pads, dilated, 5 x 5)
    ((2, 3, 6, 7), (3, 3), (1, 1), ((2, 0), (0, 2)), (1, 1), 1),
    ((2, 2, 7, 8), (3, 3), (1, 1), ((2, 2), (2, 2)), (2, 2), 2),
    ((2, 2, 6, 6), (5, 5), (1, 1), ((2, 2), (2, 2)), (1, 1), 1),
    ((0, 2, 5, 5), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),  # no images
    ((2, 3, 11), (5,), (2,), ((2, 1),), (1,), 1),  # 1-d
    ((2, 4, 12), (3,), (1,), ((2, 2),), (3,), 2),  # 1-d, dilated
]


def _window(kernel: tuple, strides: tuple, pads: tuple, dilations: tuple, groups: int) -> dict:
    return {
        "kernel": kernel,
        "strides": strides,
        "pads": pads,
        "dilations": dilations,
        "groups": groups,
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "how", ["contiguous", "transposed", "columns-major", "read-only", "sliced"]
)
@pytest.mark.parametrize("case", range(len(GATHERS)), ids=lambda i: f"gather{i}")
def test_the_gather_kernel_copies_numpys_windows(
    case: int, how: str, dtype: Any, monkeypatch: Any
) -> None:
    shape, *params = GATHERS[case]
    window = _window(*params)
    rng = np.random.default_rng(case)
    x = layout(rng.standard_normal(shape).astype(dtype), how)
    for lead in [(), (1,), (3,)]:  # leading axes: none, one vector, three
        xl = np.broadcast_to(x, lead + x.shape).copy() if lead else x
        if lead:
            xl *= np.arange(1, 1 + int(np.prod(lead)), dtype=dtype).reshape(lead + (1,) * x.ndim)
        with numpy_route(monkeypatch):
            want = conv_ops._gather_impl(np, xl, **window)
            into = np.full(want.shape, np.nan, dtype)
            assert conv_ops._gather_impl(np, xl, out=into, **window) is into
            assert np.array_equal(into, want)
        calls = counted(monkeypatch, "_gather_kernel")
        got = conv_ops._gather_impl(np, xl, **window)
        assert calls, "the kernel route did not run"
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)
        # the replay's form: into a buffer of the result's layout, garbage in it before
        out = np.full(want.shape, np.nan, dtype)
        assert conv_ops._gather_impl(np, xl, out=out, **window).base is out
        assert np.array_equal(out, want)


# (spatial, weight shape, strides, pads, dilations, groups)
INPUT_COTANGENTS = [
    ((9, 8), (6, 2, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), 2),  # the ResNet's downsampling
    ((9, 9), (4, 3, 5, 5), (2, 3), ((2, 1), (0, 2)), (1, 1), 1),
    ((10, 9), (4, 2, 3, 3), (3, 1), ((1, 1), (1, 1)), (2, 1), 1),  # dilated, overlapping rows
    ((8, 8), (4, 2, 2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1), 1),  # disjoint: NumPy's route
    ((7, 6), (4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),  # stride 1: the chunks
    ((6, 5), (4, 1, 3, 2), (1, 1), ((2, 0), (1, 1)), (1, 2), 2),
    ((5, 5), (2, 2, 3, 3), (1, 1), ((4, 3), (3, 4)), (1, 1), 1),  # transposed pads crop
    ((6, 7), (4, 4, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    ((11,), (4, 3, 5), (2,), ((2, 1),), (1,), 1),  # 1-d
    ((12,), (4, 2, 3), (1,), ((2, 2),), (2,), 2),
]


@pytest.mark.parametrize("chunk", [None, 1], ids=["chunks", "image-by-image"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", range(len(INPUT_COTANGENTS)), ids=lambda i: f"input{i}")
def test_the_input_cotangent_kernels_add_as_numpy_does(
    case: int, dtype: Any, chunk: int, monkeypatch: Any
) -> None:
    """conv_input of one and two pairs (a second-order pass's joined terms), cotangents
    in a convolution's transposed layout and contiguous, with leading axes (size 1:
    stacked; size 2: a batched cotangent), bit-equal to the NumPy routes."""
    spatial, wshape, strides, pads, dilations, groups = INPUT_COTANGENTS[case]
    if chunk is not None:  # both routes' chunks
        monkeypatch.setattr(conv_ops, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(conv_ops, "KERNEL_CHUNK_BYTES", chunk)
    window = {
        "spatial": spatial,
        "strides": strides,
        "pads": pads,
        "dilations": dilations,
        "groups": groups,
    }
    kernel = wshape[2:]
    out = conv_ops._out_sizes(spatial, kernel, strides, dilations, pads)
    rng = np.random.default_rng(case)
    n, o = 3, wshape[0]
    for pairs, lead in [(1, ()), (2, ()), (2, (1,)), (1, (2,))]:
        operands = []
        for i in range(pairs):
            g = rng.standard_normal(lead + (n, o) + out).astype(dtype)
            operands += [layout(g, "transposed" if i == 0 and not lead else "contiguous")]
            operands += [rng.standard_normal(wshape).astype(dtype)]
        with numpy_route(monkeypatch):
            want = conv_input(np, *operands, **window)
        col2im = counted(monkeypatch, "_col2im_kernel")
        chunks = counted(monkeypatch, "_chunk_gather")
        got = conv_input(np, *operands, **window)
        stride_1 = all(s == 1 for s in strides)
        if stride_1 and not lead:
            assert chunks, "the chunks' kernel did not run"
        elif not stride_1 and not conv_ops._disjoint(kernel, strides, dilations):
            assert col2im, "col2im's kernel did not run"
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)


def test_pairs_of_two_dtypes_take_the_numpy_route(monkeypatch: Any) -> None:
    """A float32 pair beside a float64 one (stride 1): the chunks are float64, the NumPy
    route casts into them (the kernel copies one dtype)."""
    rng = np.random.default_rng(1)
    g1 = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g2, w2 = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    window = {
        "spatial": (5, 5),
        "strides": (1, 1),
        "pads": ((1, 1), (1, 1)),
        "dilations": (1, 1),
        "groups": 1,
    }
    with numpy_route(monkeypatch):
        want = conv_input(np, g1, w1, g2, w2, **window)
    chunks = counted(monkeypatch, "_chunk_gather")
    got = conv_input(np, g1, w1, g2, w2, **window)
    assert not chunks and got.dtype == np.float64 and np.array_equal(got, want)


# ---- through the engine: PyTorch's conv2d and double backward, the replay ----
# (input shape, [(weight shape, strides, pads, dilations, groups) per layer])
NET = (
    (2, 3, 9, 8),
    [
        ((6, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
        ((8, 3, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), 2),
        ((8, 8, 5, 5), (1, 1), ((2, 2), (2, 2)), (1, 1), 1),
        ((4, 4, 3, 3), (1, 2), ((2, 1), (1, 0)), (2, 1), 2),
        ((4, 4, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    ],
)


def _params(dtype: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    xs, layers = NET
    return [rng.standard_normal(xs).astype(dtype)] + [
        (rng.standard_normal(layer[0]) / 3).astype(dtype) for layer in layers
    ]


def _loss(x: Any, *ws: Any) -> Any:
    h = x
    for w, (_, strides, pads, dilations, groups) in zip(ws, NET[1], strict=True):
        h = gt.tanh(gt.conv(h, w, strides=strides, pads=pads, dilations=dilations, groups=groups))
    return gt.sum(h * h)


def _torch_grad_and_hvp(params: list, vs: list) -> tuple[list, list]:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in params]
    h = ts[0]
    for w, (_, strides, pads, dilations, groups) in zip(ts[1:], NET[1], strict=True):
        flat = [p for lo_hi in reversed(pads) for p in lo_hi]
        h = torch.tanh(
            F.conv2d(F.pad(h, flat), w, stride=strides, dilation=dilations, groups=groups)
        )
    grads = torch.autograd.grad((h * h).sum(), ts, create_graph=True)
    tv = [torch.tensor(v, dtype=torch.float64) for v in vs]
    hvp = torch.autograd.grad(grads, ts, grad_outputs=tv)
    return [g.detach().numpy() for g in grads], [a.numpy() for a in hvp]


def _engine_passes(params: list, vs: list) -> list[np.ndarray]:
    """The gradient (dynamic), gt.hvp (forward-over-reverse) and a HessianOperator's
    HVPs (dynamic, captured, replayed twice: the gather's replay form)."""
    args = [gt.constant(a) for a in params]
    out = [g.numpy() for g in gt.grad(_loss, argnums=tuple(range(len(params))))(*args)]
    out += [h.numpy() for h in gt.hvp(_loss, args, [gt.constant(v) for v in vs])]
    op = gt.hessian_operator(_loss, *args)
    for _ in range(4):
        out += [h.numpy() for h in op.hvp(*[gt.constant(v) for v in vs])]
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_engine_with_kernels_matches_pytorch_and_the_numpy_routes(
    dtype: Any, monkeypatch: Any
) -> None:
    params = _params(dtype)
    rng = np.random.default_rng(1)
    vs = [rng.standard_normal(a.shape).astype(dtype) for a in params]
    grads, hvp = _torch_grad_and_hvp(params, vs)
    with numpy_route(monkeypatch):
        want = _engine_passes(params, vs)
    forms = counted(monkeypatch, "_gather_impl")  # the replay form's calls (the impl's own
    got = _engine_passes(params, vs)  # calls reach it through the primitive, unspied)
    assert any(out is not None for out in forms), "no gather into a replay buffer"
    for mine, ref in zip(got, want, strict=True):
        assert np.array_equal(mine, ref)
    tol = 1e-10 if dtype == np.float64 else 3e-4
    n = len(params)
    refs = grads + hvp * 5  # the gradient, gt.hvp, then 4 HessianOperator passes
    for mine, ref in zip(got, refs, strict=True):
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(mine, ref, rtol=0, atol=tol * scale)
    assert len(got) == 6 * n


def passes_with_the_kernels_off(tmp_path: Path, dtype: Any) -> list[np.ndarray]:
    """_engine_passes of this network in a fresh process with GRADTAPE_KERNELS=numpy (the
    NumPy routes everywhere; the same seeds as the callers use here)."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from engine import kernels
        from engine.ops import conv as conv_ops
        from tests.engine import test_kernels_conv as t
        dtype = np.dtype(sys.argv[2])
        params = t._params(dtype)
        rng = np.random.default_rng(1)
        vs = [rng.standard_normal(a.shape).astype(dtype) for a in params]
        assert not kernels.enabled() and not conv_ops._compiled(np, params[0], 2)
        np.savez(sys.argv[1], *t._engine_passes(params, vs))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != kernels.SWITCH}
    env.update(PYTHONPATH=str(ROOT), GRADTAPE_KERNELS="numpy")
    saved = tmp_path / "numpy.npz"
    done = subprocess.run(
        [sys.executable, "-c", code, str(saved), np.dtype(dtype).name],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    with np.load(saved) as theirs:
        return [theirs[f"arr_{i}"] for i in range(len(theirs.files))]


def test_a_process_with_the_kernels_switched_off_answers_the_same(tmp_path: Path) -> None:
    """GRADTAPE_KERNELS=numpy in a fresh process: the NumPy routes, the same numbers."""
    want = passes_with_the_kernels_off(tmp_path, np.float32)
    params = _params(np.float32)
    rng = np.random.default_rng(1)
    vs = [rng.standard_normal(a.shape).astype(np.float32) for a in params]
    assert conv_ops._compiled(np, params[0], 2)
    got = _engine_passes(params, vs)
    assert len(got) == len(want)
    for mine, ref in zip(got, want, strict=True):
        assert np.array_equal(mine, ref)
