"""The SDK's Gradient, HVP and Jacobian results carry `execution`, and a tape its last
HVP's: how the server ran the request's passes (dynamically the first time of a layout,
captured the second, replayed afterwards; tests/service/test_compiled_passes.py has the
ONNX models)."""

from __future__ import annotations

from collections.abc import Iterator

import gradtape.client
import numpy as np
import pytest

from engine import replay
from tests.service.conftest import Server, own_server

FIRST, SECOND = replay.NOT_YET, replay.CAPTURED


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker: every request of a layout reaches the worker that compiles it."""
    with own_server(tmp_path_factory.mktemp("sdk-execution"), workers="1") as srv:
        yield srv


def test_the_sdk_results_carry_it(solo: Server) -> None:
    defn = {
        "variables": {"w": [[0.5, -1.0], [2.0, 0.25]]},
        "inputs": {"x": [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]},
        "program": ["z = tanh(x @ w)", "loss = sum(z * z)"],
    }
    with gradtape.client.Client(solo.base_url) as client:
        gradients = [client.gradient(defn, "loss", "w") for _ in range(3)]
        hvps = [client.hvp(defn, "loss", np.ones((2, 2)), sources="w") for _ in range(3)]
        jacobians = [client.jacobian(defn, "z", "w", allow_unused=True) for _ in range(3)]
        with client.tape(defn, "loss", "w") as tape:  # its own HVP passes, on the last one
            assert tape.execution is None  # no HVP yet
            on_tape = []
            for _ in range(3):
                tape.hvp(np.ones((2, 2)))
                on_tape.append(tape.execution)
    for got in ([r.execution for r in results] for results in (gradients, hvps, jacobians)):
        assert got == [
            gradtape.client.Execution(False, FIRST),
            gradtape.client.Execution(False, SECOND),
            gradtape.client.Execution(True, None),
        ]
        assert all(isinstance(e, gradtape.client.Execution) for e in got)
    assert on_tape == [
        gradtape.client.Execution(False, FIRST),
        gradtape.client.Execution(False, SECOND),
        gradtape.client.Execution(True, None),
    ]
    np.testing.assert_array_equal(gradients[2].gradients, gradients[0].gradients)
    np.testing.assert_array_equal(hvps[2].hvp, hvps[0].hvp)
    np.testing.assert_array_equal(jacobians[2].jacobians, jacobians[0].jacobians)
