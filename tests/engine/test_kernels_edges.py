"""The kernels on the inputs review r11 found them mishandling (each failed on 85d7d64):

- uint64 indices (a dtype the language accepts) reached the scatter kernel, which numba
  cannot type (uint64 + int64 unify to float64, not an index): a TypingError, where
  GRADTAPE_KERNELS=numpy answers np.add.at's sums.
- normalize_grad is declared broadcasting, but its combine kernel read one r per row of
  `a` from r computed per row of x: with a and xhat batched against one x it read past
  r's end (wrong numbers; NumPy broadcasts).
- normalize over an empty last axis divided by zero in Python (a ZeroDivisionError,
  where the composite it replaced raised mean's ValueError naming the shape).
- the conv gather's whole-plane copy wrote past its buffer when a start pad reached past
  the output's rows (a segfault, or glibc's heap check, in the worker).
(The erf constants served stale from numba's cache: tests/engine/test_kernels.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import engine as gt
from engine import kernels
from engine.ops import nn

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


def test_uint64_token_ids_get_an_embedding_gradient() -> None:
    table = gt.constant(np.ones((5, 3), np.float32))
    tokens = np.array([0, 4, 4], np.uint64)
    (got,) = gt.grad(lambda t: gt.sum(t[tokens] * t[tokens]), argnums=(0,))(table)
    want = np.zeros((5, 3), np.float32)
    np.add.at(want, (tokens.astype(np.int64),), np.full((3, 3), 2, np.float32))
    np.testing.assert_array_equal(np.asarray(got.value), want)


def test_normalize_grad_broadcasts_one_x_against_batched_a_and_xhat() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    xhat = nn._normalize_impl(np, x, eps=1e-5)
    a = rng.standard_normal((2, 3, 8)).astype(np.float32)
    batched_xhat = np.ascontiguousarray(np.broadcast_to(xhat, a.shape))
    got = nn._normalize_grad_impl(np, a, x, batched_xhat, eps=1e-5)
    want = np.stack([nn._normalize_grad_impl(np, a[i], x, xhat, eps=1e-5) for i in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_layer_norm_over_an_empty_axis_is_a_clear_error() -> None:
    x = gt.constant(np.zeros((2, 0), np.float32))
    with pytest.raises(ValueError, match="empty"):
        gt.layer_norm(x)


# gather2d's whole-plane branch (stride 1, output as wide as x, contiguous planes) started
# its run at -shift = ph - kh dh without capping it at the plane's size: where the low pad
# reaches past the output's rows (ph - kh dh > OH; ONNX pads [10, 0, 0, 0] with
# dilations [10, 1] on an image of height 1: OH = 1), it writes zeros past the plane, and
# past the end of the buffer for the last planes: a heap overflow (now capped).
PLANE_OVERFLOW = {
    "kernel": (2, 1),
    "strides": (1, 1),
    "pads": ((10, 0), (0, 0)),
    "dilations": (10, 1),
    "groups": 1,
}


def test_the_gather_kernel_writes_only_its_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.ops import conv as conv_ops

    x = np.arange(1, 9, dtype=np.float32).reshape(1, 2, 1, 4)
    with monkeypatch.context() as m:
        m.setattr(conv_ops, "_compiled", lambda *args: False)
        want = conv_ops._gather_impl(np, x, **PLANE_OVERFLOW)
    memory = np.full(want.size + 64, 7.0, np.float32)  # the buffer, then what follows it
    out = memory[: want.size].reshape(2, 2, 1, 1, 1, 4)  # (C, KH, KW, N, OH, OW)
    got = conv_ops._gather_impl(np, x, out=out, **PLANE_OVERFLOW)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(memory[want.size :], 7.0)  # fails: 32 zeros written past


def test_a_conv_whose_low_pad_passes_its_rows_does_not_crash_the_process() -> None:
    check = textwrap.dedent(
        """
        import numpy as np, torch, engine as gt
        width, reach = 64, 4000
        x = np.random.default_rng(0).standard_normal((1, 1, 1, width)).astype(np.float32)
        w = np.ones((1, 1, 2, 1), np.float32)
        for _ in range(20):
            y = gt.conv(gt.constant(x), gt.constant(w), pads=[reach, 0, 0, 0],
                        dilations=[reach, 1])
        padded = torch.nn.functional.pad(torch.from_numpy(x), (0, 0, reach, 0))
        want = torch.nn.functional.conv2d(padded, torch.from_numpy(w), dilation=(reach, 1))
        assert np.array_equal(np.asarray(y.value), want.numpy())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRADTAPE_KERNELS", None)
    run = subprocess.run(
        [sys.executable, "-c", check], env=env, cwd=ROOT, capture_output=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # fails: -11, SIGSEGV


def test_the_gradient_of_a_conv_padded_at_the_end_does_not_corrupt_the_heap() -> None:
    """The same branch through the stride-1 input cotangent's chunks: its transposed pads
    put the forward's end pad at the start (d (k - 1) - begin), so a conv padded only at
    the end of its rows overflows the chunk buffer in its gradient (glibc aborts)."""
    check = textwrap.dedent(
        """
        import numpy as np, torch, engine as gt
        width, reach = 64, 4000
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 1, 1, width)).astype(np.float32)
        w = rng.standard_normal((1, 1, 2, 1)).astype(np.float32)

        def loss(x):
            y = gt.conv(x, gt.constant(w), pads=[0, 0, reach, 0], dilations=[reach, 1])
            return gt.sum(y * y)

        for _ in range(20):
            (gx,) = gt.grad(loss, argnums=(0,))(gt.constant(x))
        xt = torch.from_numpy(x).requires_grad_()
        padded = torch.nn.functional.pad(xt, (0, 0, 0, reach))
        y = torch.nn.functional.conv2d(padded, torch.from_numpy(w), dilation=(reach, 1))
        (y * y).sum().backward()
        assert np.array_equal(np.asarray(gx.value), xt.grad.numpy())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRADTAPE_KERNELS", None)
    run = subprocess.run(
        [sys.executable, "-c", check], env=env, cwd=ROOT, capture_output=True, timeout=300
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # fails: -6, SIGABRT
