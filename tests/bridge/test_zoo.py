"""The zoo (zoo.py; fixtures made by make_zoo.py): every architecture's float64 loss,
gradient over every named_parameters() entry and HVP agree with PyTorch's at rtol 1e-6,
three ways: through the engine (the stored .onnx in a definition), through HTTP (a tape
on `gradtape serve`) and through the SDK bridge from the nn.Module itself."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.bridge import zoo
from tests.service.wire import t64, tape_and_hvp

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = list(zoo.MODELS)
LOSS_LINE = {
    "cross_entropy": "loss = softmax_cross_entropy(logits, y)",
    "mse": "loss = mean_squared_error(logits, y)",
}


def record(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as data:
        return dict(data)


def close(got: np.ndarray, want: np.ndarray, what: str, scale: float = 0.0) -> None:
    """rtol 1e-6, with an absolute floor of 1e-9 of `scale`, the largest entry of the
    whole gradient (or HVP): a parameter whose gradient is zero in exact arithmetic (a
    bias a normalization removes) holds rounding noise in both answers."""
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9 * scale, err_msg=what
    )


def check(name: str, value: float, grads: dict, hvps: dict) -> None:
    """Loss, gradients and HVPs against PyTorch's, for every named_parameters() entry."""
    r = record(name)
    names = [str(n) for n in r["names"]]
    close(value, r["loss"], f"{name} loss")
    assert list(grads) == names, (name, list(grads))
    for key, answer in (("grad", grads), ("hvp", hvps)):
        scale = max(float(np.abs(r[f"{key}/{n}"]).max()) for n in names)
        for n in names:
            close(answer[n], r[f"{key}/{n}"], f"{name} {key} {n}", scale)


def definition(name: str, onnx_spec: dict, x, y) -> dict:
    kind = str(record(name)["kind"])
    return {
        "models": {"net": onnx_spec},
        "inputs": {"x": x, "y": y},
        "program": ["logits = net(x)", LOSS_LINE[kind]],
    }


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_agrees_with_pytorch(name: str) -> None:
    r = record(name)
    data = (FIXTURES / f"{name}.onnx").read_bytes()
    vectors = {str(n): r[f"v/{n}"] for n in r["names"]}
    names, answers = zoo.engine_pass(definition(name, {"onnx": data}, r["x"], r["y"]), vectors)
    assert names == [str(n) for n in r["names"]]  # every parameter, nothing else
    check(name, *answers)


@pytest.mark.parametrize("name", NAMES)
def test_http_agrees_with_pytorch(server, name: str) -> None:
    r = record(name)
    onnx_b64 = base64.b64encode((FIXTURES / f"{name}.onnx").read_bytes()).decode()
    y = t64(r["y"], str(r["y"].dtype))
    body = {
        "definition": definition(name, {"onnx": onnx_b64}, t64(r["x"], str(r["x"].dtype)), y),
        "target": "loss",
        "response_encoding": "base64",
    }
    names = [str(n) for n in r["names"]]
    vector = {n: t64(r[f"v/{n}"], "float64") for n in names}
    check(name, *tape_and_hvp(server.base_url, body, vector))


@pytest.mark.parametrize("name", NAMES)
def test_the_bridge_agrees_with_pytorch_from_the_module(server, name: str) -> None:
    from gradtape.client import Client

    model, x, y, kind = zoo.build(name)
    r = record(name)
    np.testing.assert_array_equal(x.numpy(), r["x"])  # the module the fixture was made of
    with Client(server.base_url) as client, client.tape(model, loss=kind, data=(x, y)) as tape:
        assert tape.names == [n for n, _ in model.named_parameters()]
        grads = tape.gradients
        assert all(isinstance(g, torch.Tensor) for g in grads.values())  # tensors in, out
        hvps = tape.hvp({n: torch.as_tensor(r[f"v/{n}"]) for n in tape.names})
        value = tape.value
    check(
        name,
        value,
        {n: g.numpy() for n, g in grads.items()},
        {n: h.numpy() for n, h in hvps.items()},
    )
