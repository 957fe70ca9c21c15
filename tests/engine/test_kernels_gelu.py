"""The compiled erf, GELU and GELU-slope kernels (engine/kernels/gelu.py) against their
NumPy paths (engine.backend.erf_float32; _gelu_numpy and _gelu_slope_numpy in
engine/ops/elementwise.py): erf and GELU bit for bit, the slope within the bound its
module states (0.5 ulp + 2^-40 of its terms of the formula on the same float32 operands,
at least as accurate as the NumPy path); the edge values (float32's extremes,
subnormals, zeros, NaN, +-inf), layouts (non-contiguous, 0-d, empty, out=); the ops
through the engine with kernels on (derivatives against differences of the float64
GELU, the compiled replay bit-equal to the dynamic pass and writing through the forms),
and the same numbers with GRADTAPE_KERNELS=numpy in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.special import erf as scipy_erf
from scipy.special import ndtr

import engine as gt
from engine import kernels
from engine.backend import erf_float32 as erf_float32_numpy
from engine.kernels import gelu as K
from engine.ops.elementwise import _gelu_numpy, _gelu_slope_numpy, gelu_p, gelu_slope_p
from engine.testing import check_grads

ROOT = Path(__file__).resolve().parents[2]
F32 = np.finfo(np.float32)
TINY = F32.smallest_subnormal

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

EDGES = np.array(
    [0.0, -0.0, TINY, -TINY, 3 * TINY, 1e-39, -1e-39, F32.tiny, -F32.tiny, 3e-8, -3e-8,
     F32.eps / 2, -F32.eps / 2, 1e-7, -0.75, -0.7518, 0.5, 1.0, -1.0, 2.8, 3.9, 4.0, 5.6,
     5.7, -5.7, 8.0, -8.0, 13.5, -13.5, 14.4, -14.4, 15.4, -15.5, -17.2, 40.0, -40.0, 1e20,
     -1e20, 3e38, F32.max / 2, F32.max, -F32.max, np.inf, -np.inf, np.nan],
    np.float32,
)  # fmt: skip


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _sample(n: int, seed: int, scale: float = 3.0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n) * scale
    return np.concatenate([x.astype(np.float32), EDGES])


# ---- erf ---------------------------------------------------------------------------------
def test_erf_kernel_is_bit_identical_to_erf_float32() -> None:
    # every 997th float32 bit pattern up to 4.5 (each binade), their negatives, the edges
    top = int(np.float32(4.5).view(np.uint32))
    x = np.arange(0, top, 997, dtype=np.uint32).view(np.float32)
    x = np.concatenate([x, -x, EDGES])
    got = K.erf_float32(x)
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(_bits(got), _bits(erf_float32_numpy(np, x)))
    assert got[-1] != got[-1]  # NaN
    np.testing.assert_array_equal(got[-3:-1], [1.0, -1.0])


def test_erf_kernel_layouts() -> None:
    x = _sample(30_000, 1).reshape(-1, 5)
    strided = x[::2, 1::2]  # neither C- nor F-contiguous
    np.testing.assert_array_equal(
        _bits(K.erf_float32(strided)), _bits(erf_float32_numpy(np, strided))
    )
    zero_d = K.erf_float32(np.float32(0.5).reshape(()))
    assert zero_d.shape == () and zero_d == erf_float32_numpy(np, np.float32(0.5))
    assert K.erf_float32(np.zeros((0, 3), np.float32)).shape == (0, 3)
    out = np.empty(x.shape, np.float32)
    assert K.erf_float32(x, out) is out
    np.testing.assert_array_equal(_bits(out), _bits(erf_float32_numpy(np, x)))
    # what the kernel does not take goes to the NumPy path (None)
    assert K.erf_float32(x.astype(np.float64)) is None
    assert K.erf_float32(x, np.empty((x.shape[1], x.shape[0]), np.float32).T) is None


def test_gt_erf_float32_runs_the_kernel_and_keeps_its_derivative() -> None:
    x = _sample(5_000, 2, scale=1.5)
    x = x[np.abs(x) < 10]  # (erf's derivative rule squares x: no overflow far out)
    t = gt.constant(x)
    np.testing.assert_array_equal(_bits(gt.erf(t).numpy()), _bits(erf_float32_numpy(np, x)))
    (grad,) = gt.grad(lambda z: gt.sum(gt.erf(z)), argnums=(0,))(t)
    wide = x.astype(np.float64)
    exact = 2 / np.sqrt(np.pi) * np.exp(-wide * wide)
    np.testing.assert_allclose(grad.numpy(), exact, rtol=2e-6, atol=1e-30)
    x64 = np.random.default_rng(3).standard_normal(50)  # float64 keeps SciPy's erf
    np.testing.assert_array_equal(gt.erf(gt.constant(x64)).numpy(), scipy_erf(x64))


# ---- GELU --------------------------------------------------------------------------------
def test_gelu_kernel_is_bit_identical_to_the_numpy_path() -> None:
    x = _sample(200_000, 4)
    with np.errstate(all="raise"):  # the NumPy path's overflow guard holds in the kernel
        got = K.gelu(x[:-3])
    assert got is not None
    np.testing.assert_array_equal(_bits(got), _bits(_gelu_numpy(np, x[:-3])))
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(_bits(K.gelu(x)), _bits(_gelu_numpy(np, x)))
    big = np.array([F32.max, -F32.max, 3e38], np.float32)
    np.testing.assert_array_equal(
        _bits(K.gelu(big)), _bits(np.array([F32.max, -0.0, 3e38], np.float32))
    )


def test_gelu_kernel_layouts_and_out() -> None:
    x = _sample(40_006, 5)[:-3].reshape(-1, 8)
    strided = x[1::3, ::-2]
    np.testing.assert_array_equal(_bits(K.gelu(strided)), _bits(_gelu_numpy(np, strided)))
    assert K.gelu(np.float32(-0.5).reshape(())).shape == ()
    assert K.gelu(np.float32(-0.5).reshape(())) == _gelu_numpy(np, np.float32(-0.5))
    assert K.gelu(np.zeros((2, 0), np.float32)).shape == (2, 0)
    expected = _gelu_numpy(np, x)
    inplace = x.copy()
    assert K.gelu(inplace, inplace) is inplace  # out may be x itself
    np.testing.assert_array_equal(_bits(inplace), _bits(expected))
    assert K.gelu(x.astype(np.float64)) is None  # float64: SciPy's erf, the NumPy path
    assert K.gelu(x, np.empty(x.shape, np.float64)) is None


# ---- GELU's slope ------------------------------------------------------------------------
def _slope_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = gelu(x), the kernel's slope and the NumPy path's, on the same operands."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = _gelu_numpy(np, x)
    kernel = K.gelu_slope(x, y)
    assert kernel is not None
    return y, kernel, _gelu_slope_numpy(np, x, y, np.empty_like(x))


def test_float32_slope_is_within_its_bound_and_at_least_as_accurate_as_numpys() -> None:
    x = _sample(300_000, 6, scale=4.0)
    y, kernel, numpy_path = _slope_pair(x)
    finite = np.isfinite(x) & (np.abs(x) >= F32.eps / 2)
    X, Y = x[finite].astype(np.longdouble), y[finite].astype(np.longdouble)
    term = X * X * np.exp(-X * X / 2) / np.sqrt(2 * np.longdouble(np.pi))
    exact = (term + Y) / X  # the formula on the kernel's own float32 operands
    terms = (np.abs(term) + np.abs(Y)) / np.abs(X)
    ulp = np.spacing(np.abs(exact.astype(np.float32))).astype(np.longdouble)
    error = np.abs(kernel[finite] - exact)
    assert (error <= ulp / 2 + terms * 2.0**-40).all(), float(np.max((error - ulp / 2) / terms))
    # the NumPy path's float32 roundings: the kernel is never further from the formula
    # than half an ulp beyond the NumPy path's own error
    assert (error <= np.abs(numpy_path[finite] - exact) + ulp / 2).all()
    # and both within the bound the fused primitive's test gives against the exact
    # derivative (tests/engine/test_fused_primitives.py), on the ordinary range
    wide = x[finite].astype(np.float64)
    phi = np.exp(-0.5 * wide * wide) / np.sqrt(2 * np.pi)
    bound = 4 * F32.eps * (ndtr(wide) + np.abs(wide) * phi) + F32.eps / 2
    assert (np.abs(kernel[finite] - (ndtr(wide) + wide * phi)) <= bound).all()


def test_float32_slope_edges_are_the_numpy_paths() -> None:
    """1/2 where |x| < eps / 2 (zeros, subnormals), 1 and -0 far out and near the
    largest float, NaN where the NumPy path gives NaN (x NaN or +-inf: inf * 0 there, as
    before). Between, the bound above holds (EDGES are in its sample); in the subnormal
    results (x near -14) the kernel is the more accurate (the NumPy path's float32 exp
    term is itself subnormal there)."""
    _, kernel, numpy_path = _slope_pair(EDGES)
    np.testing.assert_array_equal(np.isnan(kernel), np.isnan(numpy_path))
    tiny = np.abs(EDGES) < F32.eps / 2
    np.testing.assert_array_equal(_bits(kernel[tiny]), _bits(np.full(tiny.sum(), 0.5, np.float32)))
    far = np.isfinite(EDGES) & (np.abs(EDGES) >= 15.4)
    np.testing.assert_array_equal(_bits(kernel[far]), _bits(numpy_path[far]))
    np.testing.assert_array_equal(kernel[far], (EDGES[far] > 0).astype(np.float32))


def test_float64_slope_follows_the_numpy_paths_sequence() -> None:
    x = np.concatenate([np.random.default_rng(7).standard_normal(100_000) * 4, EDGES])
    y, kernel, numpy_path = _slope_pair(x)
    np.testing.assert_array_equal(np.isnan(kernel), np.isnan(numpy_path))
    tiny = np.abs(x) < np.finfo(np.float64).eps / 2
    np.testing.assert_array_equal(kernel[tiny], 0.5)
    np.testing.assert_array_equal(numpy_path[tiny], 0.5)
    ok = ~np.isnan(kernel) & ~tiny
    # the same operations; exp is the C library's in the kernel and NumPy's in its path
    # (the same function on CPUs without AVX-512), so within an ulp of exp
    wide = x[ok]
    terms = (wide * wide * np.exp(-0.5 * wide * wide) * 0.4 + np.abs(y[ok])) / np.abs(wide)
    spacing = np.spacing(np.abs(numpy_path[ok]))
    assert (np.abs(kernel[ok] - numpy_path[ok]) <= spacing + 4 * 2.0**-52 * terms).all()


def test_slope_layouts_and_out() -> None:
    x = _sample(20_002, 8)[:-3].reshape(-1, 4)
    y = _gelu_numpy(np, x)
    out = np.empty_like(x)
    assert K.gelu_slope(x, y, out) is out
    # non-contiguous operands (read through copies), 0-d, empty
    strided = K.gelu_slope(x[::2, 1:], y[::2, 1:])
    np.testing.assert_array_equal(strided, out[::2, 1:])
    zero_d = K.gelu_slope(x[0, :1].reshape(()), y[0, :1].reshape(()))
    assert zero_d.shape == () and zero_d == out[0, 0]
    assert K.gelu_slope(x[:0], y[:0]).shape == (0, 4)
    # what the kernel does not take: None, and the caller's NumPy path runs
    assert K.gelu_slope(x, y.astype(np.float64)) is None
    assert K.gelu_slope(x, y, np.empty((4, x.shape[0]), np.float32).T) is None
    assert K.gelu_slope(x[:1].astype(np.float16), y[:1].astype(np.float16)) is None


# ---- the ops through the engine, kernels on ---------------------------------------------
def test_gelu_derivatives_through_the_engine() -> None:
    """float64 (the slope kernel): to third order against finite differences; float32
    (all three kernels): gradient and HVP against differences of the float64 GELU."""
    rng = np.random.default_rng(9)
    check_grads(gt.gelu, [rng.standard_normal((4, 6)) * 2], order=3, atol=1e-5, rtol=1e-5)

    x = (rng.standard_normal((16, 32)) * 2).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    v = rng.standard_normal((16, 32)).astype(np.float32)

    def loss(t):
        return gt.sum(gt.gelu(t) * gt.constant(w))

    (grad,) = gt.grad(loss, argnums=(0,))(gt.constant(x))
    (hv,) = gt.hvp(loss, [gt.constant(x)], [gt.constant(v)])

    def gelu64(a):
        return 0.5 * a * (1 + scipy_erf(a / np.sqrt(2)))

    wide, h = x.astype(np.float64), 1e-5
    slope = (gelu64(wide + h) - gelu64(wide - h)) / (2 * h)
    curvature = (gelu64(wide + h) - 2 * gelu64(wide) + gelu64(wide - h)) / h**2
    assert grad.dtype == np.float32 and hv.dtype == np.float32
    np.testing.assert_allclose(grad.numpy(), w * slope, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(hv.numpy(), w * curvature * v, rtol=1e-3, atol=1e-4)


def _block(w1, w2, x):
    h = gt.gelu(x @ w1)
    return gt.sum(gt.tanh(gt.softmax(h, -1) @ w2)) + gt.sum(gt.erf(h) * h)


def test_a_replayed_float32_pass_runs_the_kernels_into_its_buffers() -> None:
    """gt.jit's gradient and fresh HVP of a float32 GELU/erf/softmax block: replayed
    bit-equal to the dynamic pass, with gelu, erf and gelu_slope as out= forms."""
    rng = np.random.default_rng(10)
    jitted = gt.jit(_block)
    x = gt.constant(rng.standard_normal((64, 8)).astype(np.float32))
    for _ in range(4):
        primals = [
            gt.constant(rng.standard_normal(s).astype(np.float32)) for s in [(8, 32), (32, 3)]
        ] + [x]
        tangents = [gt.constant(rng.standard_normal(p.shape).astype(np.float32)) for p in primals]
        compiled = jitted.hvp(primals, tangents)
        dynamic = gt.hvp(_block, primals, tangents)
        for a, b in zip(compiled, dynamic, strict=True):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
    (schedule,) = jitted._passes.entries.values()
    forms = {entry[0].name: entry[4] for entry in schedule.plan if entry[0] is not None}
    for name in ("gelu", "gelu_slope", "erf", "softmax"):
        assert forms.get(name) is not None, name
    assert gelu_p.name in forms and gelu_slope_p.name in forms


# ---- GRADTAPE_KERNELS=numpy: the same numbers ---------------------------------------------
SAME_NUMBERS = """
import sys, numpy as np, engine as gt
EDGES = np.load(sys.argv[2])
rng = np.random.default_rng(11)
x = np.concatenate([(rng.standard_normal(4093) * 3), EDGES]).astype(np.float32)
w = rng.standard_normal(x.size).astype(np.float32)
s = (rng.standard_normal((64, 4, 16, 16)) * 3).astype(np.float32)
t = gt.constant(x[np.isfinite(x)])
(g,) = gt.grad(lambda z: gt.sum(gt.gelu(z) * gt.constant(w[: z.shape[0]])), argnums=(0,))(t)
table, tokens = gt.constant(s.reshape(-1, 16)[:50]), gt.constant(rng.integers(0, 50, (64, 16)))
(e,) = gt.grad(lambda t: gt.sum(gt.tanh(gt.take(t, tokens, axis=0))), argnums=(0,))(table)
h = gt.constant(s.reshape(-1, 16, 16))
(n,) = gt.grad(lambda t: gt.sum(gt.tanh(gt.layer_norm(t)) * t), argnums=(0,))(h)
with np.errstate(all="ignore"):
    np.savez(sys.argv[1], erf=gt.erf(gt.constant(x)).numpy(), gelu=gt.gelu(gt.constant(x)).numpy(),
             grad=g.numpy(), softmax=gt.softmax(gt.constant(s), -1).numpy(), embed=e.numpy(),
             layer_norm=gt.layer_norm(h).numpy(), layer_norm_grad=n.numpy())
"""


def _run(tmp_path: Path, name: str, **env: str) -> dict:
    script = tmp_path / "same.py"
    script.write_text(SAME_NUMBERS)
    np.save(tmp_path / "edges.npy", EDGES)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / name), str(tmp_path / "edges.npy")],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return dict(np.load(tmp_path / name))


def test_switched_off_the_engine_answers_the_same_numbers(tmp_path: Path) -> None:
    on = _run(tmp_path, "on.npz")
    off = _run(tmp_path, "off.npz", GRADTAPE_KERNELS="numpy")
    # erf, GELU and layer norm: bit for bit
    for key in ("erf", "gelu", "layer_norm", "layer_norm_grad"):
        np.testing.assert_array_equal(_bits(on[key]), _bits(off[key]))
    # the slope (so the gradient) and softmax: within the NumPy path's float32 error (a
    # few eps of the slope's terms, absolute: the slope crosses zero near x = -0.75)
    np.testing.assert_allclose(on["grad"], off["grad"], rtol=1e-6, atol=4 * F32.eps)
    np.testing.assert_allclose(on["softmax"], off["softmax"], rtol=3e-6, atol=1e-30)
    assert not np.array_equal(on["softmax"], off["softmax"])  # the kernel did run
    # an embedding's gradient: np.add.at's sums against add.reduceat's, to rounding
    np.testing.assert_allclose(on["embed"], off["embed"], rtol=1e-5, atol=1e-6)
