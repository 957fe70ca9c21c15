"""Uploads cannot read the server's files or inflate its memory (issue 25), against a
server started the way the Docker image starts it: its working directory is its data
directory, so the SQLite store (with another key's datasets in it) sits right there.

- An ONNX model whose tensor keeps its data "outside the file" names a path on the
  server's disk: refused (422 naming the tensor), stored nowhere, and the workers run in
  an empty directory of their own anyway.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import MSGPACK, problem, tbin

KEYS = {"a": "uploads-key-a", "b": "uploads-key-b"}
ONNX = {"content-type": "application/onnx"}


@pytest.fixture(scope="module")
def docker_like(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    """A server whose working directory is its data directory (the Dockerfile's WORKDIR
    and GRADTAPE_DATA_DIR are the same), with API keys on; plus files an attacker would
    aim at beside the store: a subdirectory and a symlinked directory."""
    data = tmp_path_factory.mktemp("docker-data")
    (data / "sub").mkdir()
    (data / "elsewhere").mkdir()
    for path in ("secret.bin", "sub/secret.bin", "elsewhere/secret.bin"):
        (data / path).write_bytes(np.full(4, 1234.5, np.float32).tobytes())
    os.symlink(data / "elsewhere", data / "linked")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(data),
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": ",".join(KEYS.values()),
            "GRADTAPE_MAX_BODY_BYTES": str(16 * 2**20),
        },
        tmp_path_factory.mktemp("docker-log") / "server.log",
        cwd=data,
    )
    try:
        yield srv, data
    finally:
        stop_server(srv)


def as_key(server: Server, who: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url,
        timeout=60.0,
        headers={"authorization": f"Bearer {KEYS[who]}"},
    )


def leaky_mul(location: str, length: int) -> bytes:
    """The probe's model: out = x * w, with w's bytes at `location` on the server."""
    count = length // 4
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[count])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(count * 4))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [count])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [count])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["out"])], "g", [x], [out], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_the_store_of_another_key_is_not_read_through_a_model(docker_like) -> None:
    srv, data = docker_like
    with as_key(srv, "b") as b:
        stored = b.put(
            "/v1/datasets/private",
            content=msgpack.packb({"s": tbin(np.full(64, 7.25), "float64")}),
            headers={"content-type": MSGPACK},
        )
        assert stored.status_code == 201, stored.text
    size = (data / "gradtape.sqlite3").stat().st_size
    assert size > 0
    with as_key(srv, "a") as a:
        body = problem(
            a.put("/v1/models/leak", content=leaky_mul("gradtape.sqlite3", size), headers=ONNX),
            422,
            "definition",
        )
        (error,) = body["errors"]
        assert "'w'" in error["message"] and "self-contained" in error["message"]
        assert "gradtape.sqlite3" in error["message"]
        assert a.get("/v1/models/leak").status_code == 404  # nothing stored
        # The probe's request: the stored model is not there to answer with the bytes.
        count = size // 4
        answer = a.post(
            "/v1/gradient",
            json={
                "definition": {
                    "models": {"net": {"stored": "leak"}},
                    "inputs": {"x": [1.0] * count},
                    "program": ["y = sum(net(x))"],
                },
                "target": "y",
                "allow_nonfinite": True,
            },
        )
        assert answer.status_code == 404, answer.text


@pytest.mark.parametrize(
    "location",
    ["secret.bin", "sub/secret.bin", "./sub/../sub/secret.bin", "linked/secret.bin"],
    ids=["relative-name", "subdirectory", "dot-dot-inside", "symlinked-directory"],
)
def test_every_path_the_checker_passes_is_refused_inline(docker_like, location) -> None:
    srv, _ = docker_like
    model = leaky_mul(location, 16)
    with as_key(srv, "a") as a:
        body = problem(
            a.post(
                "/v1/gradient",
                json={
                    "definition": {
                        "models": {"net": {"onnx": base64.b64encode(model).decode()}},
                        "inputs": {"x": [1.0] * 4},
                        "program": ["y = sum(net(x))"],
                    },
                    "target": "y",
                },
            ),
            422,
            "definition",
        )
        (error,) = body["errors"]
        assert error["section"] == "models.net" and repr(location) in error["message"]
        stored = a.put(f"/v1/models/p{abs(hash(location))}", content=model, headers=ONNX)
        assert repr(location) in problem(stored, 422, "definition")["errors"][0]["message"]


def test_workers_run_in_an_empty_directory_not_the_data_directory(docker_like) -> None:
    srv, data = docker_like
    with as_key(srv, "a") as a:
        workers = a.get("/readyz").json()["workers"]
    assert Path(f"/proc/{srv.process.pid}/cwd").resolve() == data.resolve()  # as Docker
    for w in workers:
        cwd = Path(f"/proc/{w['pid']}/cwd").resolve()
        assert cwd != data.resolve()
        assert list(cwd.iterdir()) == [], f"worker {w['pid']} works in {cwd}, not empty"
        assert cwd.stat().st_mode & 0o222 == 0  # unwritable (root writes anyway)
