"""GET /v1/ops: the catalogue, from the registry the workers run."""

from __future__ import annotations


def test_catalogue(client) -> None:
    response = client.get("/v1/ops")
    assert response.status_code == 200
    ops = {op["name"]: op for op in response.json()["ops"]}
    assert ops["add"]["operator"] == "+"
    assert ops["matmul"]["params"][0]["kind"] == "tensor"
    assert ops["grad"]["family"] == "builtin" and "clip_grad_norm" in ops
    assert {"relu", "sigmoid", "batch_norm", "sum", "norm", "solve"} <= set(ops)
    softmax = ops["softmax"]
    axis = next(p for p in softmax["params"] if p["name"] == "axis")
    assert axis == {
        "name": "axis",
        "kind": "constant",
        "type": axis["type"],
        "required": False,
        "variadic": False,
        "default": -1,
    }
    assert all(op["signature"].startswith(op["name"] + "(") for op in ops.values())
    assert client.get("/v1/ops").content == response.content  # served from the cache
