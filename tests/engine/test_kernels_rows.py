"""engine/kernels/rows.py: a row vector added to or multiplying every row, the compiled
replay's add and multiply where one operand is a row (a bias, layer norm's scale and
shift), bit for bit against NumPy's ufuncs, in place and not, and through the replay
(engine/replay.py) against the dynamic pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import engine as gt
from engine import kernels, replay
from engine.kernels import rows as K

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 3e38, -3e38]


def _operands(dtype: Any, n: int = 37, k: int = 19) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, k)) * 10).astype(dtype)
    b = (rng.standard_normal(k) * 10).astype(dtype)
    x[0, : len(SPECIALS)] = SPECIALS
    b[: len(SPECIALS)] = SPECIALS[::-1]
    return x, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["add", "multiply"])
def test_the_kernels_answer_numpys_bits(name: str, dtype: Any) -> None:
    x, b = _operands(dtype)
    apart, into = (k.compiled() for k in K.KERNELS[name])
    ufunc = getattr(np, name)
    with np.errstate(all="ignore"):
        want = ufunc(x, b)
    out = np.empty_like(x)
    apart(x, b, out)
    same = x.copy()
    into(same, b)
    for got in (out, same):
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))
        assert np.array_equal(np.isnan(got), np.isnan(want))


def _bias_and_scale(x: Any, w: Any, bias: Any, scale: Any) -> Any:
    h = gt.matmul(x, w) + bias  # the matrix first
    h = bias + gt.tanh(h)  # the row first
    return gt.sum(gt.tanh(h * scale) * (scale * h))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_replay_with_row_kernels_answers_the_dynamic_pass_bit_for_bit(dtype: Any) -> None:
    rng = np.random.default_rng(1)
    jitted = gt.jit(_bias_and_scale)
    grad = jitted.value_and_grad((0, 1, 2, 3))
    for _ in range(4):  # dynamic, captured, replayed twice
        ps = [
            gt.constant(rng.standard_normal(s).astype(dtype))
            for s in ((4, 5, 6), (6, 7), (7,), (7,))
        ]
        got, want = grad(*ps), gt.value_and_grad(_bias_and_scale, (0, 1, 2, 3))(*ps)
        for g, w in zip(gt.tree.flatten(got)[0], gt.tree.flatten(want)[0], strict=True):
            assert np.array_equal(g.numpy(), w.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()


def test_the_replay_takes_the_row_form_only_where_it_fits() -> None:
    maker = replay._FORMS["add"]
    lay = replay._Layout
    m32, r32 = np.empty((4, 6), np.float32), np.empty(6, np.float32)
    assert maker({}, [lay(m32), lay(r32)], lay(m32)) is not np.add
    assert maker({}, [lay(r32), lay(m32)], lay(m32)) is not np.add
    assert maker({}, [lay(m32), r32], lay(m32)) is not np.add  # a constant row
    # not a row: a column, a matrix of the same shape, another dtype, a transposed matrix
    assert maker({}, [lay(m32), lay(np.empty((4, 1), np.float32))], lay(m32)) is np.add
    assert maker({}, [lay(m32), lay(m32)], lay(m32)) is np.add
    assert maker({}, [lay(m32), lay(np.empty(6))], lay(m32)) is np.add
    t32 = np.empty((6, 4), np.float32).T
    assert maker({}, [lay(t32), lay(r32)], lay(t32)) is np.add
