"""Every exception of the SDK, provoked for real against live servers."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from gradtape.client import (
    Client,
    ComputeTimeout,
    DefinitionError,
    GradtapeError,
    InvalidRequest,
    NonFiniteResult,
    Retry,
    ServiceBusy,
    TapeGone,
    TooLarge,
    Unauthorized,
    function,
)

from tests.client.conftest import KEY, heavy
from tests.service.conftest import Server

BAD = {
    "variables": {"w": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]},
    "inputs": {"x": [1.0, 2.0, 3.0]},
    "program": ["y = w @ x", "loss = sum(y * q)"],
}


def test_definition_error_lists_every_problem_with_a_caret(client: Client) -> None:
    with pytest.raises(DefinitionError) as caught:
        client.gradient(BAD, "loss")
    error = caught.value
    assert isinstance(error, InvalidRequest) and isinstance(error, GradtapeError)
    assert error.status == 422 and error.type == "/problems/definition"
    assert [(e["line"], e["column"]) for e in error.errors] == [(1, 5), (2, 16)]
    assert error.errors[0]["op"] == "matmul" and error.errors[0]["shapes"] == [[3, 2], [3]]
    assert str(error) == "\n".join(
        [
            "422 Invalid definition: 2 problem(s)",
            "  program line 1, column 5: matmul: inner dimensions differ: (3, 2) @ (3,) (2 != 3)",
            "    y = w @ x",
            "        ^",
            "  program line 2, column 16: undefined name 'q'",
            "    loss = sum(y * q)",
            "                   ^",
        ]
    )


def test_definition_error_in_a_user_function(client: Client) -> None:
    """A line of a function body is shown from the function the client sent."""
    d = {
        "variables": {"v": 2.0},
        "functions": {"clipped": function(["x"], "y = x", "grad_x = clip_by_norm(upstrem, 0.5)")},
        "program": ["out = clipped(v * v)"],
    }
    with pytest.raises(DefinitionError) as caught:
        client.gradient(d, "out")
    text = str(caught.value)
    assert "undefined name 'upstrem'" in text
    assert "    grad_x = clip_by_norm(upstrem, 0.5)\n" + " " * 26 + "^" in text, text


def test_tape_gone_when_deleted_and_expired(client: Client) -> None:
    d = {"variables": {"w": np.array([1.0, 2.0])}, "program": ["loss = sum(w * w * w)"]}
    tape = client.tape(d, "loss")
    tape.delete()
    with pytest.raises(TapeGone) as deleted:
        tape.hvp({"w": np.ones(2)})
    assert deleted.value.reason == "deleted" and deleted.value.ended_at
    assert deleted.value.type == "/problems/tape-not-found"

    short = client.tape(d, "loss", ttl=0.3)
    time.sleep(0.6)
    with pytest.raises(TapeGone) as expired:
        short.eigenvalues(1)
    assert expired.value.reason == "expired" and expired.value.type == "/problems/tape-expired"
    assert "expired" in str(expired.value)
    with short:  # leaving deletes quietly what is already gone
        pass
    with pytest.raises(TapeGone) as unknown:
        client._run(client._get_op("/v1/tapes/no-such-tape"))
    assert unknown.value.reason is None


def test_too_large(client: Client) -> None:
    """Over hessian_max_size (100 here): 422 too-large; over max_body_bytes (4 MiB): 413."""
    d = {"variables": {"w": np.ones(101)}, "program": ["loss = sum(w * w)"]}
    with pytest.raises(TooLarge) as caught:
        client.hessian(d, "loss")
    assert caught.value.status == 422 and "at most 100 parameters" in caught.value.detail
    big = {"variables": {"w": np.ones(600_000)}, "program": ["loss = sum(w)"]}  # 4.8 MB
    with pytest.raises(TooLarge) as body:
        client.gradient(big, "loss")
    assert body.value.status == 413 and body.value.type == "/problems/body-too-large"


def test_non_finite_result(client: Client) -> None:
    d = {"variables": {"w": np.array([1.0, 2.0])}, "program": ["loss = sum(log(w - 10))"]}
    with pytest.raises(NonFiniteResult) as caught:
        client.gradient(d, "loss")
    assert caught.value.status == 422 and caught.value.errors[0]["op"] == "log"
    answer = client.gradient(d, "loss", allow_nonfinite=True)
    assert np.isnan(answer.value) and answer.nonfinite


def test_compute_timeout(client: Client) -> None:
    with pytest.raises(ComputeTimeout) as caught:
        client.gradient(heavy(600, 40), "loss", ["x"], time_limit=0.2)
    assert caught.value.status == 504 and caught.value.problem["time_limit"] == 0.2
    # The worker is replaced; the next request is answered (retried while not ready).
    assert client.gradient(heavy(20, 2), "loss", "w").value == pytest.approx(20.0)


def test_unauthorized_without_or_with_a_wrong_key(strict: Server) -> None:
    d = {"variables": {"w": 2.0}, "program": ["y = w * w"]}
    for key in (None, "not-" + KEY):
        with Client(strict.base_url, api_key=key) as client, pytest.raises(Unauthorized) as e:
            client.gradient(d, "y")
        assert e.value.status == 401
    with Client(strict.base_url, api_key=KEY) as client:
        assert client.gradient(d, "y").gradients["w"] == 4.0


def test_service_busy_retried_honouring_retry_after(strict: Server) -> None:
    """One worker and no queue: while a slow request runs, another is a 503 with
    Retry-After: 1. Without retries that is ServiceBusy; with them the client waits at
    least Retry-After and is answered once the worker is free."""
    small = {"variables": {"w": np.array([1.0, 2.0])}, "program": ["loss = sum(w * w * w)"]}
    slow_answer: list = []
    with Client(strict.base_url, api_key=KEY) as client:
        slow = threading.Thread(
            target=lambda: slow_answer.append(client.gradient(heavy(700, 12), "loss", ["x"]))
        )
        slow.start()
        try:
            # Until the worker is computing (an event; the guard only stops a hang: a
            # loaded machine may take longer than any fixed wait to start the request).
            deadline = time.monotonic() + 120
            while httpx.get(f"{strict.base_url}/readyz").json()["workers"][0]["state"] != "busy":
                assert not slow_answer, "the slow request ended before it held the worker"
                assert time.monotonic() < deadline, "the slow request never reached the worker"
                time.sleep(0.01)
            with Client(strict.base_url, api_key=KEY, retry=Retry(attempts=1)) as once:
                with pytest.raises(ServiceBusy) as busy:
                    once.gradient(small, "loss")
            assert busy.value.status == 503 and busy.value.type == "/problems/busy"
            assert busy.value.retry_after == 1.0 and busy.value.attempts == 1
            started = time.monotonic()
            answer = client.gradient(small, "loss")
            waited = time.monotonic() - started
        finally:
            slow.join()
    np.testing.assert_array_equal(answer.gradients["w"], [3.0, 12.0])
    assert waited >= 1.0  # at least one Retry-After
    assert slow_answer and slow_answer[0].value == pytest.approx(700.0)


def test_retries_are_bounded(strict: Server) -> None:
    """With attempts=3 against a worker held for 3 s (a slow request stopped by its time
    limit), ServiceBusy comes after 3 attempts, having waited Retry-After (1 s) twice."""
    small = {"variables": {"w": 1.0}, "program": ["y = w"]}
    slow_error: list = []

    def hold() -> None:
        with pytest.raises(ComputeTimeout) as caught:
            client.gradient(heavy(1000, 80), "loss", ["x"], time_limit=3.0)
        slow_error.append(caught.value)

    with Client(strict.base_url, api_key=KEY) as client:
        slow = threading.Thread(target=hold)
        slow.start()
        try:
            # (bounded only against a hang: a refused slow request would never make it busy)
            for _ in range(30_000):
                if (
                    slow_error
                    or httpx.get(f"{strict.base_url}/readyz").json()["workers"][0]["state"]
                    == "busy"
                ):
                    break
                time.sleep(0.01)
            assert not slow_error, "the slow request ended before it held the worker"
            started = time.monotonic()
            with (
                Client(
                    strict.base_url, api_key=KEY, retry=Retry(attempts=3, backoff=0.1, jitter=0.0)
                ) as c,
                pytest.raises(ServiceBusy) as busy,
            ):
                c.gradient(small, "y")
            waited = time.monotonic() - started
        finally:
            slow.join()
    assert busy.value.attempts == 3
    assert waited >= 2.0  # Retry-After twice (no upper bound: a loaded machine adds to it)
    assert slow_error
    strict.wait_ready()  # the stopped worker's replacement, for the tests after this one
