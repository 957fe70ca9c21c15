"""Uploads cannot read the server's files or inflate its memory (issue 25), against a
server started the way the Docker image starts it: its working directory is its data
directory, so the SQLite store (with another key's datasets in it) sits right there.

- An ONNX model whose tensor keeps its data "outside the file" names a path on the
  server's disk: refused (422 naming the tensor), stored nowhere, and the workers run in
  an empty directory of their own anyway.
- An .npz of deflated zeros (a zip bomb), an .npy header declaring far more than its
  body: refused from the declared sizes (413 naming the limit or the quota, 422 naming the
  array) before anything is inflated; the HTTP process's peak memory does not grow.
"""

from __future__ import annotations

import base64
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.service.conftest import Server, start_server, stop_server
from tests.service.test_hostile import peak_rss_growth
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
            "GRADTAPE_MAX_DATASET_BYTES": str(64 * 2**20),
            "GRADTAPE_MAX_DATASET_BYTES_PER_KEY": str(96 * 2**20),
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


# -- an .npz is sized from its headers and directory before it is inflated ------------------

LIMIT = 64 * 2**20  # max_dataset_bytes of the docker_like server
QUOTA = 96 * 2**20  # max_dataset_bytes_per_key
BOMB_ELEMENTS = 2**26  # float64: 512 MiB of zeros, about half a MiB deflated


def deflated_zeros(name: str, declared: tuple[int, ...], zeros: int) -> bytes:
    """An .npz whose member `name`.npy has a header declaring float64 `declared` followed
    by `zeros` zero bytes, streamed into the deflater a MiB at a time (never allocated)."""
    buf = io.BytesIO()
    with (
        zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open(f"{name}.npy", "w") as member,
    ):
        header = {"descr": "<f8", "fortran_order": False, "shape": declared}
        np.lib.format.write_array_header_1_0(member, header)
        chunk = bytes(2**20)
        for start in range(0, zeros, len(chunk)):
            member.write(chunk[: zeros - start])
    return buf.getvalue()


def with_directory_size(npz: bytes, size: int) -> bytes:
    """The same .npz with its one member's uncompressed size in the central directory
    replaced (a directory that lies small)."""
    at = npz.rindex(b"PK\x01\x02")
    return npz[: at + 24] + size.to_bytes(4, "little") + npz[at + 28 :]


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return deflated_zeros("x", (BOMB_ELEMENTS,), BOMB_ELEMENTS * 8)


def put_octet(client: httpx.Client, name: str, body: bytes, query: str = "") -> httpx.Response:
    return client.put(
        f"/v1/datasets/{name}{query}",
        content=body,
        headers={"content-type": "application/octet-stream"},
    )


def test_a_deflated_bomb_is_refused_from_its_header_without_growing_the_server(
    docker_like, bomb
) -> None:
    srv, _ = docker_like
    assert len(bomb) < 2 * 2**20  # 512 MiB inflated
    with as_key(srv, "a") as a:
        growth, response = peak_rss_growth(srv.process.pid, lambda: put_octet(a, "bomb", bomb))
        body = problem(response, 413, "dataset-too-large")
        assert f"{BOMB_ELEMENTS * 8:,} bytes" in body["detail"]
        assert "max_dataset_bytes" in body["detail"]
        assert growth < 32 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"
        assert a.get("/v1/datasets/bomb").status_code == 404


def test_a_header_smaller_than_the_directory_is_refused_before_inflating(docker_like) -> None:
    srv, _ = docker_like
    lying = deflated_zeros("x", (4,), BOMB_ELEMENTS * 8)  # 4 elements declared, 512 MiB held
    with as_key(srv, "a") as a:
        growth, response = peak_rss_growth(srv.process.pid, lambda: put_octet(a, "lie", lying))
        body = problem(response, 422, "validation")
        assert body["errors"][0]["field"] == "x" and "zip directory" in body["detail"]
        assert growth < 32 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"


def test_a_directory_that_lies_small_inflates_no_more_than_it_says(docker_like, bomb) -> None:
    srv, _ = docker_like
    # Header and directory both say 4 elements; the deflated stream holds 512 MiB.
    header_bytes = len(npy_header((4,)))
    lying = with_directory_size(deflated_zeros("x", (4,), BOMB_ELEMENTS * 8), header_bytes + 32)
    with as_key(srv, "a") as a:
        growth, response = peak_rss_growth(srv.process.pid, lambda: put_octet(a, "small", lying))
        body = problem(response, 422, "validation")
        assert body["errors"][0]["field"] == "x" and "CRC" in body["detail"]
        assert growth < 32 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"


def test_the_keys_quota_is_checked_before_inflating(docker_like) -> None:
    srv, _ = docker_like
    held = 40 * 2**20 // 8
    with as_key(srv, "a") as a:
        first = put_octet(a, "held", deflated_zeros("z", (held,), held * 8))
        assert first.status_code == 201, first.text
        assert first.json()["arrays"]["z"] == {
            "dtype": "float64",
            "shape": [held],
            "bytes": held * 8,
        }
        more = 60 * 2**20 // 8  # under max_dataset_bytes, over the quota beside `held`
        growth, response = peak_rss_growth(
            srv.process.pid, lambda: put_octet(a, "more", deflated_zeros("z", (more,), more * 8))
        )
        body = problem(response, 413, "dataset-too-large")
        assert "max_dataset_bytes_per_key" in body["detail"]
        assert growth < 32 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"
        assert a.delete("/v1/datasets/held").status_code == 204


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def test_an_npy_header_declaring_2_40_elements_over_16_bytes_is_a_413(docker_like) -> None:
    srv, _ = docker_like
    with as_key(srv, "a") as a:
        body = problem(
            put_octet(a, "huge", npy_header((2**40,)) + bytes(16), "?array=X"),
            413,
            "dataset-too-large",
        )
        assert f"{2**43:,} bytes" in body["detail"]
        short = problem(put_octet(a, "short", npy_header((4,)) + bytes(16), "?array=X"), 422)
        assert short["errors"][0]["field"] == "X" and "16 bytes of data" in short["detail"]


def test_npz_and_npy_round_trip_with_their_values(docker_like) -> None:
    srv, _ = docker_like
    rng = np.random.default_rng(5)
    want = {"a": rng.normal(size=(3, 5)), "b": np.asfortranarray(rng.normal(size=(4, 2)))}
    buf = io.BytesIO()
    np.savez_compressed(buf, **want)
    with as_key(srv, "a") as a:
        assert put_octet(a, "vals", buf.getvalue()).status_code == 201
        answer = a.post(
            "/v1/gradient",
            json={
                "definition": {
                    "variables": {"w": {"dtype": "float64", "shape": [2], "data": [1.0, 1.0]}},
                    "inputs": {"dataset": "vals"},
                    "program": ["loss = sum(a) * w[0] + sum(b @ (w * w))"],
                },
                "target": "loss",
            },
        )
        assert answer.status_code == 200, answer.text
        value = answer.json()["value"]
        got = value["data"] if isinstance(value, dict) else value
        expect = want["a"].sum() + want["b"].sum()
        assert np.isclose(np.asarray(got, dtype=float).reshape(()), expect)


@pytest.mark.parametrize("shape", [(-1, -1), (-2, -2), (0, -3)])
def test_a_header_declaring_a_negative_dimension_is_a_422_naming_the_array(
    docker_like, shape
) -> None:
    """A product of negative dimensions can be positive (-1 x -1 = 1): the declared size
    then matches the data that follows, and only the reshape would notice (a 500)."""
    srv, _ = docker_like
    nbytes = max(0, int(np.prod(shape))) * 8
    member = npy_header(shape) + bytes(nbytes)
    npz = io.BytesIO()
    with zipfile.ZipFile(npz, "w") as archive:
        archive.writestr("neg.npy", member)
    with as_key(srv, "a") as a:
        for body, query in ((member, "?array=neg"), (npz.getvalue(), "")):
            refused = problem(put_octet(a, "negative", body, query), 422, "validation")
            assert refused["errors"][0]["field"] == "neg", refused
            assert "negative" in refused["detail"], refused
        assert a.get("/v1/datasets/negative").status_code == 404


@pytest.mark.parametrize("member", [".npy", "n" * 300 + ".npy"])
def test_an_npz_member_names_an_array_as_a_json_key_would(docker_like, member) -> None:
    """A JSON body's array names have 1 to 256 characters; an .npz's member names are
    held to the same (an empty name would be an input no definition can name)."""
    srv, _ = docker_like
    npz = io.BytesIO()
    with zipfile.ZipFile(npz, "w") as archive:
        archive.writestr(member, npy_header((2,)) + bytes(16))
    with as_key(srv, "a") as a:
        refused = problem(put_octet(a, "names", npz.getvalue()), 422, "validation")
        assert refused["errors"][0]["field"] == "body" and "256" in refused["detail"]
        assert a.get("/v1/datasets/names").status_code == 404
