"""The service on an NVIDIA GPU: `gradtape serve --device cuda` (its worker computing with
CuPy) answers what PyTorch recorded for the reference ONNX models and what the NumPy
engine computes in this process, over JSON and msgpack, stateless and on a kept tape.

Skipped, with the reason, where CuPy or a GPU is absent (CI has neither); run by
bench/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

import engine as gt
from tests.service.conftest import Server, own_server
from tests.service.test_onnx import b64, definition
from tests.service.wire import arr, ok, post, post_msgpack, t64, tape_and_hvp, tbin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gt.cuda_available(), reason="needs CuPy and an NVIDIA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("fastapi") is None,
        reason="the service's packages are not installed (the `service` extra)",
    ),
]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # (the cost guard has no default throughputs on a GPU; one worker owns the device)
    with own_server(tmp_path_factory.mktemp("gpu"), device="cuda", workers="1") as srv:
        yield srv


@pytest.fixture(scope="module")
def gpu(gpu_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gpu_server.base_url, timeout=300.0) as c:
        yield c


def test_the_worker_owns_the_gpu(gpu) -> None:
    ready = gpu.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert [w["device"] for w in ready.json()["workers"]] == ["cuda:0"]


@pytest.mark.parametrize("name", ["lenet", "resnet", "transformer"])
def test_gradient_of_an_onnx_model_matches_pytorch(gpu, name: str) -> None:
    from tests.engine.onnx.graphs import fixture

    data, record = fixture(name)
    answer = post(
        gpu, "/v1/gradient", {"definition": definition(name, {"onnx": b64(data)}), "target": "loss"}
    )
    np.testing.assert_allclose(arr(answer["value"]), record["f32/loss"], rtol=1e-5)
    grads = {k.removeprefix("f32/grad/"): record[k] for k in record if k.startswith("f32/grad/")}
    assert set(answer["gradients"]) == set(grads)
    for key, want in grads.items():
        np.testing.assert_allclose(
            arr(answer["gradients"][key]),
            want,
            rtol=1e-4,
            atol=1e-6 * np.abs(want).max(),
            err_msg=key,
        )


def test_hvp_of_a_msgpack_onnx_model_matches_pytorch(gpu) -> None:
    from tests.engine.onnx.graphs import fixture

    data, record = fixture("transformer")
    body = {
        "definition": definition("transformer", {"onnx": data}, tbin),
        "target": "loss",
        "vector": {
            k.removeprefix("v/"): tbin(record[k], "float32") for k in record if k.startswith("v/")
        },
    }
    answer = ok(post_msgpack(gpu, "/v1/hvp", body))
    assert set(answer["hvp"]) == {
        k.removeprefix("f32/hvp/") for k in record if k.startswith("f32/hvp/")
    }
    for key, product in answer["hvp"].items():
        want = record[f"f32/hvp/{key}"]
        np.testing.assert_allclose(
            arr(product), want, rtol=2e-3, atol=2e-5 * np.abs(want).max(), err_msg=key
        )


def _mlp(seed: int = 0) -> tuple[dict, dict, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    values = {
        "x": rng.standard_normal((32, 16)),
        "w1": rng.standard_normal((16, 32)) / 4,
        "w2": rng.standard_normal((32, 4)) / 4,
        "y": rng.standard_normal((32, 4)),
    }
    body = {
        "definition": {
            "inputs": {n: t64(values[n], "float64") for n in ("x", "y")},
            "variables": {n: t64(values[n], "float64") for n in ("w1", "w2")},
            "program": ["h = tanh(x @ w1)", "loss = mean((h @ w2 - y) ** 2)"],
        },
        "target": "loss",
    }
    vector = {n: rng.standard_normal(values[n].shape) for n in ("w1", "w2")}
    return (
        body,
        {n: t64(v, "float64") for n, v in vector.items()},
        values | {f"v_{n}": v for n, v in vector.items()},
    )


def _numpy_answers(values: dict[str, np.ndarray]) -> tuple[float, list, list]:
    """The same loss, gradients and HVP from the engine on NumPy, in this process."""
    x, y = gt.constant(values["x"]), gt.constant(values["y"])
    params = [gt.constant(values["w1"]), gt.constant(values["w2"])]

    def loss(w1, w2):
        return gt.mean((gt.tanh(x @ w1) @ w2 - y) ** 2)

    value, grads = gt.value_and_grad(loss, argnums=(0, 1))(*params)
    hvp = gt.hvp(loss, params, [gt.constant(values["v_w1"]), gt.constant(values["v_w2"])])
    return float(value.numpy()), [g.numpy() for g in grads], [h.numpy() for h in hvp]


def test_a_tape_kept_on_the_gpu_answers_the_numpy_engine(gpu_server, gpu) -> None:
    body, vector, values = _mlp()
    value, grads, hvp = tape_and_hvp(gpu_server.base_url, body, vector)
    want_value, want_grads, want_hvp = _numpy_answers(values)
    assert value == pytest.approx(want_value, rel=1e-12)
    for got, want in zip((grads["w1"], grads["w2"]), want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
    for got, want in zip((hvp["w1"], hvp["w2"]), want_hvp):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)


def test_a_tape_says_it_lives_on_the_gpu(gpu) -> None:
    body, _, _ = _mlp(1)
    made = gpu.post("/v1/tapes", json=body)
    assert made.status_code == 201, made.text
    tape_id = made.json()["tape_id"]
    try:
        info = gpu.get(f"/v1/tapes/{tape_id}")
        assert info.status_code == 200, info.text
        assert info.json()["device"] == "cuda:0"
    finally:
        gpu.delete(f"/v1/tapes/{tape_id}")
