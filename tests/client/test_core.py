"""The SDK's sans-I/O parts, without a server: retry policy, Retry-After, the tensor
codec's corners, the builder, the error mapping."""

from __future__ import annotations

import email.utils

import numpy as np
import pytest
from gradtape.client import (
    ComputeTimeout,
    Definition,
    GradtapeError,
    NonFiniteResult,
    Retry,
    ServiceBusy,
    TapeGone,
    TooLarge,
    _wire,
    function,
)
from gradtape.client._core import Core, HTTPResponse, Sleep
from gradtape.client.errors import error_class, parse_retry_after


def test_backoff_grows_honours_retry_after_and_is_bounded() -> None:
    retry = Retry(attempts=6, backoff=0.5, max_delay=4.0, max_wait=100.0, jitter=0.0)
    assert [retry.delay(n, None, 0.0) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert retry.delay(5, None, 0.0) is None  # the sixth attempt was the last
    assert retry.delay(0, 3.0, 0.0) == 3.0  # Retry-After is a floor
    assert retry.delay(0, 60.0, 0.0) == 4.0  # ... under max_delay
    assert Retry(max_wait=5.0, jitter=0.0).delay(3, None, 2.0) is None  # 2 + 4 > 5
    assert Retry(attempts=1).delay(0, None, 0.0) is None
    jittered = Retry(backoff=1.0, jitter=0.1).delay(0, None, 0.0)
    assert jittered is not None and 1.0 <= jittered <= 1.1


def test_retry_after_seconds_or_date() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert parse_retry_after(date, now=1_000_000.0) == pytest.approx(30.0)


def test_core_retries_503_then_raises_with_attempts() -> None:
    """The core's call loop: a 503 asks for a Sleep of Retry-After, then the request
    again; past the attempts it raises ServiceBusy."""
    core = Core("json", retry=Retry(attempts=2, backoff=0.1, jitter=0.0))
    op = core.call("GET", "/v1/tapes")
    request = next(op)
    assert request.method == "GET" and request.headers["accept"] == "application/json"
    busy = HTTPResponse(
        503,
        {"content-type": "application/problem+json", "retry-after": "2"},
        b'{"type": "/problems/busy", "title": "Service busy", "status": 503}',
    )
    assert op.send(busy) == Sleep(2.0)
    assert op.send(None) == request
    with pytest.raises(ServiceBusy) as caught:
        op.send(busy)
    assert caught.value.attempts == 2 and caught.value.retry_after == 2.0


def test_error_mapping() -> None:
    assert error_class(404, "/problems/tape-evicted") is TapeGone
    assert error_class(422, "/problems/too-large") is TooLarge
    assert error_class(422, "/problems/non-finite") is NonFiniteResult
    assert error_class(504, None) is ComputeTimeout
    assert issubclass(error_class(418, "/problems/new"), GradtapeError)
    error = Core.problem(HTTPResponse(502, {"content-type": "text/html"}, b"<html>bad</html>"))
    assert error.status == 502 and "bad" in error.detail


def test_codec_corners() -> None:
    assert (
        _wire.from_tensor(
            {"dtype": "float32", "shape": [3], "data": [1.0, "NaN", "-Infinity"]}
        ).tolist()[2]
        == -np.inf
    )
    nested = _wire.from_tensor({"dtype": "int64", "shape": [2, 2], "data": [[1, 2], [3, 4]]})
    assert nested.dtype == np.int64 and nested.tolist() == [[1, 2], [3, 4]]
    big_endian = np.array([1.5, 2.5], dtype=">f8")
    tensor = _wire.to_wire(big_endian, binary=True)
    assert tensor["dtype"] == "float64" and tensor["data"] == np.array([1.5, 2.5]).tobytes()
    decoded = _wire.from_tensor(tensor)
    assert decoded.flags.writeable and decoded.tolist() == [1.5, 2.5]
    transposed = np.arange(6.0).reshape(2, 3).T  # not contiguous: sent row-major
    assert (
        _wire.from_tensor(_wire.to_wire(transposed, binary=False)).tolist() == transposed.tolist()
    )
    with pytest.raises(TypeError, match="complex128"):
        _wire.to_wire(np.array([1j]), binary=True)
    assert _wire.to_wire({"x": [1.0, 2.0], "n": 3}, binary=True) == {"x": [1.0, 2.0], "n": 3}


def test_definition_builder() -> None:
    d = Definition(
        """
        h = relu(x @ w)

        loss = sum(h)
        """,
        variables={"w": np.ones(2), "b": 1.0},
        inputs={"x": np.ones((3, 2))},
        functions={"f": function(["x"], "y = x", "grad_x = upstream")},
        frozen=["b"],
    )
    assert d["program"] == ["h = relu(x @ w)", "loss = sum(h)"]
    assert d["variables"]["b"] == {"value": 1.0, "trainable": False}
    assert d["functions"]["f"] == {
        "params": ["x"],
        "forward": ["y = x"],
        "backward": ["grad_x = upstream"],
    }
    with pytest.raises(ValueError, match="frozen"):
        Definition("y = w", variables={"w": 1.0}, frozen=["v"])
