"""The short ways of small requests (bench/RESULTS.md, "The request path, round three"):
a bare number of a float tensor is made without the general path's checks, and a scalar
answer is checked for NaN and infinity without a reduction. Each gives exactly what the
general way gives: the same array (value, dtype, sign of zero), the same refusals."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api import tensors
from service.core.wire import TensorError
from service.worker.nonfinite import nonfinite_fields

FLOATS = ("float16", "float32", "float64")
EDGES: list[Any] = [
    0.0, -0.0, 1.0, 2.5, 1 / 3, -7.25, 1e-45, 1e-40, 5e-324, 123456789.123,
    65504.0, 65519.99, 65520.0, 3.4028234663852886e38, 3.5e38, 1.7976931348623157e308,
    math.nan, math.inf, -math.inf,
    0, 1, -3, 65504, 65505, 70000, 2**24 + 1, 2**53, 2**53 + 1, -(2**53), 2**64, 10**30, True,
]  # fmt: skip


def general_way(data: Any, dtype: str) -> np.ndarray:
    """from_data's general path for a bare number (as it was before the short way)."""
    raw = np.asarray(data)
    if raw.dtype.kind not in "biuf":
        raise TensorError("data must hold only numbers (or true/false for bool) in range")
    with np.errstate(over="ignore"):
        return raw.astype(np.dtype(dtype), copy=False)


def same_outcome(data: Any, dtype: str) -> None:
    try:
        expected = general_way(data, dtype)
    except TensorError:
        with pytest.raises(TensorError):
            tensors.from_data(data, dtype, None)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the short way never overflows quietly or loudly
        got = tensors.from_data(data, dtype, None)
    assert got.dtype == expected.dtype and got.shape == expected.shape == ()
    if np.isnan(expected):
        assert np.isnan(got)
    else:
        assert got == expected and np.signbit(got) == np.signbit(expected)
    assert tensors.nonfinite_count(got) == int(not np.isfinite(expected))


@pytest.mark.parametrize(("data", "dtype"), list(itertools.product(EDGES, FLOATS)))
def test_a_bare_number_is_the_array_the_general_way_makes(data: Any, dtype: str) -> None:
    same_outcome(data, dtype)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.floats(), st.integers(min_value=-(2**70), max_value=2**70)),
    st.sampled_from(FLOATS),
)
def test_any_number_any_float_dtype(data: Any, dtype: str) -> None:
    same_outcome(data, dtype)


def test_scalar_answers_are_checked_as_arrays_are() -> None:
    values = [0.0, -1.5, math.nan, math.inf, -math.inf, 1e308]
    with np.errstate(over="ignore"):  # 1e308 is inf in float16 and float32
        answer = {
            f"{dtype}_{i}": np.asarray(v).astype(dtype)
            for dtype in FLOATS
            for i, v in enumerate(values)
        }
        # finite where a long double is wider than a double (x86-64), past any double
        answer["longdouble"] = np.asarray(np.longdouble(1e308) * 10)
    answer["complex"] = np.asarray(complex(math.nan, 0))
    answer["as_array"] = np.array([1.0, math.inf])
    expected = sorted(k for k, v in answer.items() if not np.isfinite(v).all())
    assert sorted(nonfinite_fields(answer)) == expected
    assert "complex" in expected and "float64_0" not in expected and "float16_5" in expected
