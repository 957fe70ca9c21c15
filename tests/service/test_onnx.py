"""ONNX models over HTTP (issue 13): inline (base64 in JSON, bytes in msgpack) or stored
with PUT /v1/models/{name} (Content-Type: application/onnx) and referenced from a
definition; gradients and HVPs against the PyTorch answers stored beside the reference
models, Hessian eigenvalues on a tape against the dense Hessian; every refusal a 422
(or 413/415) problem+json naming what is wrong."""

from __future__ import annotations

import base64

import httpx
import msgpack
import numpy as np
import pytest
from onnx import helper

import engine as gt
from engine.language import as_definition, compile_definition
from tests.engine.onnx.graphs import fixture, graph_model
from tests.service.wire import arr, ok, post, post_msgpack, problem, t, tbin

PROGRAM = ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"]
ONNX = {"content-type": "application/onnx"}


def definition(name: str, model: dict, wire=t) -> dict:
    _, record = fixture(name)
    x = record["x"]
    return {
        "models": {"net": {**model, "frozen": [str(f) for f in record["frozen"]]}},
        "inputs": {"x": wire(x, str(x.dtype)), "y": wire(record["y"], "int64")},
        "program": PROGRAM,
    }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("name", ["lenet", "resnet", "transformer"])
def test_gradient_of_an_inline_model_matches_pytorch(client, name: str) -> None:
    data, record = fixture(name)
    answer = post(
        client,
        "/v1/gradient",
        {"definition": definition(name, {"onnx": b64(data)}), "target": "loss"},
    )
    assert_gradient_is_recorded(answer, record)


def assert_gradient_is_recorded(answer: dict, record: dict) -> None:
    """A gradient answer equals PyTorch's recorded float32 loss and gradients (every
    gradient it recorded, no other: buffers are frozen, not sources)."""
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


def test_hvp_of_a_msgpack_model_matches_pytorch(client) -> None:
    assert_transformer_hvp_is_recorded(client)


def assert_transformer_hvp_is_recorded(client: httpx.Client) -> None:
    """The transformer's HVP over msgpack (the model's bytes and the vector as binary
    tensors) is PyTorch's recorded one, for every source it recorded."""
    data, record = fixture("transformer")
    body = {
        "definition": definition("transformer", {"onnx": data}, tbin),
        "target": "loss",
        "vector": {
            k.removeprefix("v/"): tbin(record[k], "float32") for k in record if k.startswith("v/")
        },
    }
    answer = ok(post_msgpack(client, "/v1/hvp", body))
    assert set(answer["hvp"]) == {
        k.removeprefix("f32/hvp/") for k in record if k.startswith("f32/hvp/")
    }
    for key, product in answer["hvp"].items():
        want = record[f"f32/hvp/{key}"]
        np.testing.assert_allclose(
            arr(product), want, rtol=2e-3, atol=2e-5 * np.abs(want).max(), err_msg=key
        )


def test_stored_onnx_model_referenced_from_a_definition(client) -> None:
    data, record = fixture("lenet")
    r = client.put("/v1/models/lenet-onnx", content=data, headers=ONNX)
    assert r.status_code in (200, 201), r.text
    info = r.json()
    assert info["variables"]["conv1.weight"] == {
        "dtype": "float32",
        "shape": [4, 1, 5, 5],
        "trainable": True,
    }
    assert client.get("/v1/models/lenet-onnx").json()["digest"] == info["digest"]
    again = client.put("/v1/models/lenet-onnx", content=data, headers=ONNX)
    assert again.status_code == 200  # replaced: PUT is idempotent
    answer = post(
        client,
        "/v1/gradient",
        {
            "definition": definition("lenet", {"stored": "lenet-onnx"}),
            "target": "loss",
            "sources": ["fc2.bias"],
        },
    )
    np.testing.assert_allclose(
        arr(answer["gradients"]["fc2.bias"]), record["f32/grad/fc2.bias"], rtol=1e-4, atol=1e-7
    )


def test_top_hessian_eigenvalues_of_a_stored_cnn(client) -> None:
    """The README story: upload a CNN, record a tape, ask for the top eigenvalues (of the
    classifier's block, small enough to compare with the dense Hessian here)."""
    data, record = fixture("lenet")
    assert client.put("/v1/models/lenet-eig", content=data, headers=ONNX).status_code in (200, 201)
    sources = ["fc2.weight", "fc2.bias"]
    r = client.post(
        "/v1/tapes",
        json={
            "definition": definition("lenet", {"stored": "lenet-eig"}),
            "target": "loss",
            "sources": sources,
        },
    )
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    answer = post(client, f"/v1/tapes/{tape}/eigenvalues", {"k": 3, "tol": 1e-6, "max_hvps": 170})
    # The same block's dense Hessian, column by column through the engine here.
    defn = as_definition(
        {
            "models": {"net": {"onnx": data}},
            "inputs": {"x": record["x"], "y": record["y"]},
            "program": PROGRAM,
        }
    )
    prog = compile_definition(defn)
    leaves = prog.leaves(defn)
    op = prog.hessian_operator(prog.check_request("loss", sources), leaves)
    sizes = [leaves[s].numpy().size for s in sources]
    columns = []
    for i in range(sum(sizes)):
        e = np.zeros(sum(sizes), np.float32)
        e[i] = 1
        parts = np.split(e, np.cumsum(sizes)[:-1])
        hv = op.hvp(*[gt.constant(p.reshape(leaves[s].shape)) for p, s in zip(parts, sources)])
        columns.append(np.concatenate([h.numpy().reshape(-1) for h in hv]))
    h = np.array(columns, np.float64)
    want = np.sort(np.linalg.eigvalsh((h + h.T) / 2))[::-1][:3]
    np.testing.assert_allclose(answer["eigenvalues"], want, rtol=1e-3, atol=1e-5)
    assert want[0] > 1e-3


# ---- refusals ------------------------------------------------------------------------------

X = np.zeros((2, 3), np.float32)
N = helper.make_node


def inline(data: bytes, program=("y = sum(net(x))",)) -> dict:
    return {
        "definition": {
            "models": {"net": {"onnx": b64(data)}},
            "inputs": {"x": t(X)},
            "program": list(program),
        },
        "target": "y",
    }


def test_unsupported_ops_are_one_422_listing_each(client) -> None:
    data = graph_model(
        [N("Hardmax", ["x"], ["a"], name="hard"), N("LpNormalization", ["a"], ["out"], name="lp")],
        {"x": X},
        opset=18,
    )
    body = problem(client.post("/v1/gradient", json=inline(data)), 422, "definition")
    found = [(e["section"], e["kind"], e["message"]) for e in body["errors"]]
    summary = (
        "2 node(s) of 2 op type(s) cannot run here (Hardmax x1, LpNormalization x1): export "
        "the model again with ops this runtime supports"
    )
    assert found[0][:2] == ("models.net", "op") and found[0][2].startswith(summary)
    assert found[1:] == [
        (
            "models.net",
            "op",
            "op_type Hardmax (domain ai.onnx, opset 18), 1 node(s) ('hard'): not supported",
        ),
        (
            "models.net",
            "op",
            "op_type LpNormalization (domain ai.onnx, opset 18), 1 node(s) ('lp'): not supported",
        ),
    ]
    assert body["detail"].startswith(f"models.net: {summary}")
    # An upload names itself, not the definition it is stored as.
    stored = problem(client.put("/v1/models/unsupported", content=data, headers=ONNX), 422)
    assert stored["detail"].startswith(f"the uploaded model 'unsupported': {summary}")
    assert {e["section"] for e in stored["errors"]} == {"the uploaded model 'unsupported'"}
    assert len(stored["errors"]) == 3 and "Hardmax" in stored["errors"][1]["message"]
    assert client.get("/v1/models/unsupported").status_code == 404  # nothing stored


def test_truncated_file_is_a_422_naming_the_complaint(client) -> None:
    data, _ = fixture("transformer")
    for sent in (
        client.post("/v1/gradient", json=inline(data[: len(data) // 2])),
        client.put("/v1/models/truncated", content=data[:300], headers=ONNX),
    ):
        body = problem(sent, 422, "definition")
        (error,) = body["errors"]
        assert error["section"] in ("models.net", "the uploaded model 'truncated'")
        assert "truncated" in error["message"] or "checker" in error["message"]


def test_dropout_in_training_mode_is_a_422(client) -> None:
    data = graph_model(
        [N("Dropout", ["x", "ratio", "mode"], ["out"], name="drop")],
        {"x": X},
        {"ratio": np.array(0.5, np.float32), "mode": np.array(True)},
        opset=13,
    )
    body = problem(client.post("/v1/gradient", json=inline(data)), 422, "definition")
    (error,) = body["errors"]
    assert error["kind"] == "model" and "training_mode is true" in error["message"]
    assert "Dropout" in error["message"] and "'drop'" in error["message"]


def test_inputs_that_do_not_fit_name_input_and_axis(client) -> None:
    data = graph_model([N("Relu", ["x"], ["out"])], {"x": np.zeros((2, 4), np.float32)})
    body = problem(client.post("/v1/gradient", json=inline(data)), 422, "definition")
    (error,) = body["errors"]
    assert (error["line"], error["op"], error["kind"]) == (1, "net", "shape")
    assert "input 'x' axis 1 must be 4, got 3" in error["message"]


def test_transport_refusals(client, server) -> None:
    data = graph_model([N("Relu", ["x"], ["out"])], {"x": X})
    problem(
        client.put("/v1/models/relu", content=data, headers={"content-type": "application/json"}),
        415,
    )
    bad = {
        "definition": {"models": {"net": {"onnx": "not base64!"}}, "program": ["y = 1"]},
        "target": "y",
    }
    body = problem(client.post("/v1/gradient", json=bad), 422)
    assert "definition.models.net.onnx" in body["detail"]
    both = {
        "definition": {
            "models": {"net": {"onnx": b64(data), "stored": "relu"}},
            "program": ["y = 1"],
        },
        "target": "y",
    }
    problem(client.post("/v1/gradient", json=both), 422)
    missing = {
        "definition": {"models": {"net": {"stored": "nothing-here"}}, "program": ["y = 1"]},
        "target": "y",
    }
    problem(client.post("/v1/gradient", json=missing), 404, "model-not-found")
    assert client.post(
        "/v1/models",
        json={
            "name": "plain",
            "definition": {"variables": {"w": 1.0}, "program": ["y = w * w"]},
            "replace": True,
        },
    ).status_code in (200, 201)
    not_onnx = {
        "definition": {"models": {"net": {"stored": "plain"}}, "program": ["y = 1"]},
        "target": "y",
    }
    body = problem(client.post("/v1/gradient", json=not_onnx), 422)
    assert "not an ONNX" in body["detail"]


def test_a_model_over_max_onnx_bytes_is_a_413(tmp_path) -> None:
    import httpx

    from tests.service.conftest import start_server, stop_server

    data = graph_model([N("Relu", ["x"], ["out"])], {"x": X})
    srv = start_server(
        {
            "GRADTAPE_MAX_ONNX_BYTES": str(len(data) - 1),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_DATA_DIR": str(tmp_path / "store"),
        },
        tmp_path / "log",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            problem(c.put("/v1/models/big", content=data, headers=ONNX), 413)
            body = problem(
                c.post(
                    "/v1/gradient",
                    content=msgpack.packb(
                        inline(data)
                        | {
                            "definition": {
                                "models": {"net": {"onnx": data}},
                                "inputs": {"x": tbin(X)},
                                "program": ["y = sum(net(x))"],
                            }
                        },
                        use_bin_type=True,
                    ),
                    headers={"content-type": "application/msgpack"},
                ),
                413,
            )
            assert "max_onnx_bytes" in body["detail"]
    finally:
        stop_server(srv)


def test_jacobians_of_a_model_over_http(client) -> None:
    """d logits / d head.bias is the identity for every example (closed form); the
    per-example jacobian with respect to the input images of a CNN whose batch norm
    runs in inference mode equals the full jacobian's diagonal blocks."""
    data, record = fixture("transformer")
    defn = definition("transformer", {"onnx": b64(data)})
    defn["program"] = defn["program"][:1]
    del defn["inputs"]["y"]
    answer = post(
        client, "/v1/jacobian", {"definition": defn, "target": "logits", "sources": ["head.bias"]}
    )
    jac = arr(answer["jacobians"]["head.bias"])
    np.testing.assert_allclose(jac, np.broadcast_to(np.eye(10), (4, 10, 10)), atol=1e-6)

    data, record = fixture("resnet")
    x = record["x"][:2]
    body = {
        "definition": {
            "models": {"net": {"onnx": b64(data)}},
            "inputs": {"x": t(x)},
            "program": ["logits = net(x)"],
        },
        "target": "logits",
        "sources": ["x"],
    }
    full = arr(post(client, "/v1/jacobian", body)["jacobians"]["x"])
    per_example = arr(post(client, "/v1/jacobian", {**body, "batch": True})["jacobians"]["x"])
    assert full.shape == (2, 10, 2, 3, 8, 8) and per_example.shape == (2, 10, 3, 8, 8)
    for i in range(2):
        np.testing.assert_allclose(per_example[i], full[i, :, i], rtol=1e-5, atol=1e-7)
        assert not full[i, :, 1 - i].any()


def test_patching_a_tape_sets_an_initializer(client) -> None:
    """PATCH a tape's variable named by its ONNX name: the tape records again there, and
    answers what a definition carrying that value answers (a variable of the same name
    replaces the initializer's value)."""
    data, record = fixture("transformer")
    defn = definition("transformer", {"onnx": b64(data)})
    created = client.post("/v1/tapes", json={"definition": defn, "target": "loss"})
    assert created.status_code == 201, created.text
    tape = created.json()["tape_id"]
    bias = np.linspace(-1, 1, 10).astype(np.float32)
    updated = ok(client.patch(f"/v1/tapes/{tape}", json={"variables": {"head.bias": t(bias)}}))
    moved = {**defn, "variables": {"head.bias": t(bias)}}
    fresh = post(client, "/v1/gradient", {"definition": moved, "target": "loss"})
    np.testing.assert_allclose(arr(updated["value"]), arr(fresh["value"]), rtol=1e-6)
    assert abs(float(arr(updated["value"])) - float(record["f32/loss"])) > 1e-3
    again = post(client, f"/v1/tapes/{tape}/gradient", {"target": "loss"})
    for key in ("head.bias", "ln1.weight"):
        np.testing.assert_allclose(
            arr(again["gradients"][key]), arr(fresh["gradients"][key]), rtol=1e-5, atol=1e-7
        )
    wrong = problem(
        client.patch(f"/v1/tapes/{tape}", json={"variables": {"head.bais": t(bias)}}), 422
    )
    assert "head.bais" in wrong["detail"] and "initializer" in wrong["detail"]
    shape = problem(
        client.patch(f"/v1/tapes/{tape}", json={"variables": {"head.weight": t(bias)}}), 422
    )
    assert "replaces initializer 'head.weight'" in shape["detail"]
    after = post(client, f"/v1/tapes/{tape}/gradient", {"target": "loss"})  # unharmed
    np.testing.assert_allclose(arr(after["value"]), arr(fresh["value"]), rtol=1e-6)


def test_a_stored_model_may_call_a_stored_onnx_file(client) -> None:
    """POST /v1/models with a definition whose ONNX model is `stored` (found by
    schemathesis: it was a 500); an unknown stored file is a 404 naming it."""
    data, record = fixture("transformer")
    put = client.put(
        "/v1/models/story-onnx", content=data, headers={"content-type": "application/onnx"}
    )
    assert put.status_code in (200, 201), put.text
    try:
        body = {
            "name": "story-def",
            "replace": True,
            "definition": {
                "models": {"net": {"stored": "story-onnx"}},
                "inputs": {
                    "x": {
                        "dtype": "int64",
                        "shape": list(record["x"].shape),
                        "data": record["x"].reshape(-1).tolist(),
                    },
                    "y": {"dtype": "int64", "shape": [4], "data": record["y"].tolist()},
                },
                "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
            },
        }
        created = client.post("/v1/models", json=body)
        assert created.status_code in (200, 201), created.text
        grad = client.post(
            "/v1/gradient", json={"model": "story-def", "target": "loss", "sources": ["head.bias"]}
        )
        assert grad.status_code == 200, grad.text
        missing = {
            **body,
            "name": "story-missing",
            "definition": {**body["definition"], "models": {"net": {"stored": "no-such-onnx"}}},
        }
        gone = client.post("/v1/models", json=missing)
        assert gone.status_code == 404 and "no-such-onnx" in gone.text, gone.text
    finally:
        client.delete("/v1/models/story-def")
        client.delete("/v1/models/story-onnx")


def test_dtype_float64_runs_a_float32_model_in_float64(client) -> None:
    # Today's answer to `dtype: float64` on a float32 file is float64 (PyTorch's float64
    # gradients to 1e-6), where it was float32 without a word.
    data, record = fixture("lenet")
    body = {
        "definition": {
            "dtype": "float64",
            "models": {"net": {"onnx": b64(data)}},
            "inputs": {"x": record["x"].tolist(), "y": t(record["y"], "int64")},
            "program": PROGRAM,
        },
        "target": "loss",
    }
    answer = post(client, "/v1/gradient", body)
    assert answer["value"]["dtype"] == "float64"
    np.testing.assert_allclose(arr(answer["value"]), record["f64/loss"], rtol=1e-9)
    for key, got in answer["gradients"].items():
        assert got["dtype"] == "float64"
        want = record[f"f64/grad/{key}"]
        np.testing.assert_allclose(arr(got), want, rtol=1e-6, atol=1e-9 * np.abs(want).max())
    body["definition"]["dtype"] = "float16"
    refused = problem(client.post("/v1/gradient", json=body), 422, "definition")
    assert "dtype float16 is not applied to ONNX models" in refused["detail"]
