"""Hostile and careless input (issue 11): each case is one request a client could send
to hurt the service. Every answer is a precise problem (never a 500, never a hang), and
afterwards /readyz is ready with the same worker processes: nobody else paid for it."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgpack
import pytest

from tests.service.wire import MSGPACK, problem

HUGE = 2**70
W = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]}


@pytest.fixture
def unharmed(client: httpx.Client):
    """The workers' pids before the case; after it, the service is ready with the same."""

    def pids() -> list[int]:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        return [w["pid"] for w in ready.json()["workers"]]

    before = pids()
    yield
    assert pids() == before, "a worker was lost to this request"


def _definition_with(value: dict) -> dict:
    return {
        "definition": {"variables": {"w": value}, "program": ["loss = sum(w)"]},
        "target": "loss",
    }


@pytest.mark.parametrize(
    "tensor",
    [
        {"dtype": "float32", "shape": [0, HUGE], "data": []},
        {"dtype": "float32", "shape": [0, HUGE], "base64": ""},
        {"dtype": "float32", "shape": [0] * 40, "data": []},
        {"dtype": "float32", "shape": [HUGE, HUGE], "data": [1.0]},
    ],
    ids=["huge-dimension", "huge-dimension-base64", "rank-40", "huge-product"],
)
def test_impossible_shapes_are_422_naming_the_shape(client, unharmed, tensor) -> None:
    body = problem(client.post("/v1/gradient", json=_definition_with(tensor)), 422)
    assert "definition.variables.w" in body["detail"] and "shape" in body["detail"]
    assert len(body["detail"]) < 400  # the client's numbers are not echoed at length


def test_impossible_shape_in_msgpack_is_422(client, unharmed) -> None:
    tensor = {"dtype": "float32", "shape": [0, 2**62], "data": b""}
    response = client.post(
        "/v1/gradient",
        content=msgpack.packb(_definition_with(tensor)),
        headers={"content-type": MSGPACK},
    )
    assert "shape" in problem(response, 422)["detail"]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_uint64_from_booleans_is_stored_not_a_500(client, unharmed, encoding) -> None:
    body = {
        "name": f"bools-{encoding}",
        "definition": {
            "variables": {"w": {"dtype": "uint64", "shape": [2], "data": [True, False]}},
            "inputs": {"x": [1.0, 2.0]},
            "program": ["loss = sum(x * x)"],
        },
    }
    if encoding == "json":
        response = client.post("/v1/models", json=body)
    else:
        response = client.post(
            "/v1/models", content=msgpack.packb(body), headers={"content-type": MSGPACK}
        )
    assert response.status_code == 201, response.text
    client.delete(f"/v1/models/bools-{encoding}")


def test_an_out_of_range_integer_is_422(client, unharmed) -> None:
    tensor = {"dtype": "uint8", "shape": [2], "data": [1, 300]}
    assert (
        "range of uint8"
        in problem(client.post("/v1/gradient", json=_definition_with(tensor)), 422)["detail"]
    )


def test_a_solve_whose_damping_overflows_is_a_422_not_nan(client, unharmed) -> None:
    created = client.post(
        "/v1/tapes",
        json={
            "definition": {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w * w)"]},
            "target": "loss",
        },
    )
    tape = created.json()["tape_id"]
    try:
        body = problem(
            client.post(f"/v1/tapes/{tape}/solve", json={"damping": 1.7e308}), 422, "non-finite"
        )
        assert "conjugate-gradient solve overflowed" in body["detail"]
    finally:
        client.delete(f"/v1/tapes/{tape}")


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_a_malformed_body(client, unharmed, depth) -> None:
    body = "[" * depth + "]" * depth
    response = client.post(
        "/v1/gradient", content=body, headers={"content-type": "application/json"}
    )
    assert "parsed" in problem(response, 400, "malformed-body")["detail"]


def test_deeply_nested_msgpack_is_a_malformed_body(client, unharmed) -> None:
    depth = 10_000
    packed = b"\x91" * depth + b"\xc0"  # fixarray of one element, 10,000 deep
    response = client.post("/v1/gradient", content=packed, headers={"content-type": MSGPACK})
    assert response.status_code in (400, 422), response.text
    problem(response, response.status_code)


@pytest.mark.parametrize(
    "line",
    [
        "loss = __import__('os').system('true')",
        "loss = (lambda: w)()",
        "loss = f'{w}'",
        "import os",
        "loss = w.__class__",
        "loss = sum(w) if True else w",
        "loss = [x for x in w]",
        "loss = eval('w')",
    ],
)
def test_code_that_is_not_the_language_is_refused(client, unharmed, line) -> None:
    body = {"definition": {"variables": {"w": [1.0]}, "program": [line]}, "target": "loss"}
    problem(client.post("/v1/gradient", json=body), 422, "definition")


def test_a_base64_tensor_of_the_wrong_length_is_422(client, unharmed) -> None:
    tensor = {"dtype": "float32", "shape": [3], "base64": base64.b64encode(b"\0" * 8).decode()}
    assert (
        "byte" in problem(client.post("/v1/gradient", json=_definition_with(tensor)), 422)["detail"]
    )


def _refused_mid_body(client: httpx.Client, body: bytes, sent: int) -> tuple[bytes, dict]:
    """POST `body` to /v1/gradient on a raw socket, sending its first `sent` bytes and
    holding the rest back; /healthz must answer meanwhile, and the problem must come
    before the body has ended (events, not a clock: issue 27, item 13). The whole answer
    (bytes) and its problem."""
    url = urlsplit(str(client.base_url))
    with socket.create_connection((url.hostname, url.port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/gradient HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:sent]
        )
        assert client.get("/healthz").status_code == 200  # the loop answers meanwhile
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _content_end(answer):
            more = sock.recv(65536)  # the socket's timeout only guards against a hang
            assert more, f"the server closed without an answer: {answer!r}"
            answer += more
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 422 " in status_line, answer[:500]
    found = json.loads(rest.partition(b"\r\n\r\n")[2][: _content_length(rest)])
    return answer, found


def test_a_million_empty_lists_are_refused_small_and_fast(client, unharmed) -> None:
    """3 MB: sources as a million empty lists (once a 100 MB 422 after 11-18 s). Refused
    while it arrives, by count: with 700,000 lists sent (past max_body_containers,
    200,000) and a third held back, the small 422 comes before the body has ended, so
    the body was never joined nor parsed."""
    head = (
        b'{"definition": {"variables": {"w": [1.0]}, "program": ["loss = sum(w)"]}, '
        b'"target": "loss", "sources": ['
    )
    body = head + b",".join([b"[]"] * 1_000_000) + b"]}"
    answer, found = _refused_mid_body(client, body, len(head) + 3 * 700_000)
    assert found["type"] == "/problems/too-large", found
    assert "max_body_containers" in found["detail"] and len(answer) < 2_000


def _content_length(head: bytes) -> int:
    found = re.search(rb"(?i)content-length: *(\d+)", head)
    return int(found.group(1)) if found else 0


def _content_end(answer: bytes) -> int:
    """The length of a whole HTTP answer (headers and a Content-Length body)."""
    headers, _, _ = answer.partition(b"\r\n\r\n")
    return len(headers) + 4 + _content_length(headers)


@pytest.fixture(scope="module")
def large_bodies(tmp_path_factory):
    """A server with the default 64 MiB body limit (the shared one takes 4 MiB)."""
    from tests.service.conftest import start_server, stop_server

    srv = start_server(
        {"GRADTAPE_MAX_BODY_BYTES": str(64 * 2**20), "GRADTAPE_WORKERS": "1"},
        tmp_path_factory.mktemp("bodies") / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def default_body_limit(large_bodies):
    with httpx.Client(base_url=large_bodies.base_url, timeout=60.0) as c:
        yield c


def test_sixty_megabytes_of_nesting_do_not_take_the_service_down(default_body_limit) -> None:
    client = default_body_limit
    body = b"[" + b"[]," * (20 * 2**20) + b"[]]"  # 60 MiB, under the 64 MiB body limit
    # Refused while it arrives (4 MiB sent, far past the container limit).
    _, found = _refused_mid_body(client, body, 4 * 2**20)
    assert found["type"] == "/problems/too-large", found
    assert client.get("/readyz").status_code == 200


def test_many_validation_problems_are_listed_up_to_a_bound(client, unharmed) -> None:
    body = {"definition": W, "target": "loss", "sources": [[] for _ in range(5000)]}
    answer = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert len(answer["errors"]) == 50 and answer["omitted"] > 4000
    assert "more)" in answer["detail"]


def test_a_long_unknown_key_is_not_echoed_whole(client, unharmed) -> None:
    key = "k" * 100_000
    response = client.post("/v1/gradient", json={"definition": W, "target": "loss", key: 1})
    answer = problem(response, 422, "validation")
    assert len(response.content) < 2_000 and "kkk..." in answer["detail"]


def test_json_nested_past_the_depth_limit_is_a_malformed_body(client, unharmed) -> None:
    value: list = []
    for _ in range(100):
        value = [value]
    body = {"definition": W, "target": "loss", "sources": value}
    answer = problem(client.post("/v1/gradient", json=body), 400, "malformed-body")
    assert "max_body_depth" in answer["detail"]


def test_a_body_that_is_not_utf8_is_a_malformed_body(client, unharmed) -> None:
    # Found by schemathesis: json.loads raises UnicodeDecodeError, not JSONDecodeError.
    reply = client.post(
        "/v1/hessian", content=b"\xff\x07", headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "/problems/malformed-body"


# -- client keys cross the worker protocol as data (issue 11, item 1) ------------------------

CUBIC = {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w * w)"]}


@pytest.mark.parametrize("alias", ["__nd__", "__array__", "id", "ok", "error", "fatal"])
def test_a_key_that_looks_like_protocol_is_only_a_key(client, unharmed, alias) -> None:
    """The issue's request killed a worker when "__nd__" was the array marker. Every field
    that becomes a key on the way to a worker (a source alias, an HVP vector key, a tape's
    aliases) now answers as any other name would: d/dw sum(w^3) = 3 w^2, H v = 6 w v."""
    base = {"definition": CUBIC, "target": "loss", "sources": {alias: "w"}}
    grad = client.post("/v1/gradient", json=base)
    assert grad.status_code == 200, grad.text
    assert grad.json()["gradients"][alias]["data"] == [3.0, 12.0]
    hvp = client.post("/v1/hvp", json={**base, "vector": {alias: [1.0, 1.0]}})
    assert hvp.status_code == 200, hvp.text
    assert hvp.json()["hvp"][alias]["data"] == [6.0, 12.0]
    tape = client.post("/v1/tapes", json=base)
    assert tape.status_code == 201, tape.text
    tape_id = tape.json()["tape_id"]
    try:
        on_tape = client.post(f"/v1/tapes/{tape_id}/hvp", json={"vectors": [{alias: [0.0, 1.0]}]})
        assert on_tape.status_code == 200, on_tape.text
        assert on_tape.json()["hvps"][0][alias]["data"] == [0.0, 12.0]
    finally:
        client.delete(f"/v1/tapes/{tape_id}")


def test_the_issue_request_over_msgpack(client, unharmed) -> None:
    body = {
        "definition": {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w*w)"]},
        "target": "loss",
        "sources": {"__nd__": "w"},
    }
    response = client.post(
        "/v1/gradient",
        content=msgpack.packb(body),
        headers={"content-type": MSGPACK, "accept": MSGPACK},
    )
    assert response.status_code == 200, response.content[:300]
    gradient = msgpack.unpackb(response.content)["gradients"]["__nd__"]
    assert gradient["shape"] == [2]


LONG = "n" * 100_000


@pytest.mark.parametrize(
    "where", ["alias", "source", "target", "variable", "vector-key", "function"]
)
def test_a_long_name_is_refused_not_echoed(client, unharmed, where) -> None:
    body: dict = {
        "definition": {"variables": {"w": [1.0, 2.0]}, "program": ["loss = sum(w * w)"]},
        "target": "loss",
    }
    if where == "alias":
        body["sources"] = {LONG: "w"}
    elif where == "source":
        body["sources"] = [LONG]
    elif where == "target":
        body["target"] = LONG
    elif where == "variable":
        body["definition"]["variables"][LONG] = [1.0]
    elif where == "function":
        body["definition"]["functions"] = {LONG: {"params": ["a"], "forward": ["out = a"]}}
    else:
        body["vector"] = {LONG: [1.0, 1.0]}
    path = "/v1/hvp" if where == "vector-key" else "/v1/gradient"
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text[:500]
    assert response.headers["content-type"].startswith("application/problem+json")
    assert len(response.content) < 4_000, f"{len(response.content)} bytes echoed"


@pytest.mark.parametrize("path", [f"/v1/tapes/{LONG[:10_000]}", f"/v1/models/{LONG[:10_000]}"])
def test_a_long_id_in_the_path_is_not_echoed(client, unharmed, path) -> None:
    response = client.get(path)
    assert response.status_code in (404, 422), response.text[:500]
    assert len(response.content) < 4_000, f"{len(response.content)} bytes echoed"


def test_a_lone_surrogate_is_a_malformed_body_not_a_500(client, unharmed) -> None:
    # Found in review: "\ud800" passed validation and broke the UTF-8 frame to the worker.
    body = (
        '{"definition": {"variables": {"w": [1.0]}, "program": ["loss = sum(w)\\ud800"]},'
        ' "target": "loss"}'
    )
    response = client.post(
        "/v1/gradient", content=body, headers={"content-type": "application/json"}
    )
    assert "surrogate" in problem(response, 400, "malformed-body")["detail"]


# -- msgpack bodies are sized while they are unpacked (issue 11) ------------------------------


def peak_rss_growth(pid: int, send) -> tuple[int, httpx.Response]:
    """The HTTP process's peak RSS growth (bytes) over `send()`: its high-water mark is
    reset first (/proc/<pid>/clear_refs), then read back from /proc/<pid>/status."""

    def hwm() -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = hwm()
    response = send()
    return hwm() - before, response


def test_a_msgpack_body_of_empty_arrays_is_refused_before_it_is_built(large_bodies) -> None:
    # 7.6 MiB: one array of 8 million empty arrays. Unpacked whole before it was sized,
    # it grew the HTTP process by about half a GiB before the 422.
    count = 8_000_000
    body = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    with httpx.Client(base_url=large_bodies.base_url, timeout=60.0) as client:
        growth, response = peak_rss_growth(
            large_bodies.process.pid,
            lambda: client.post("/v1/gradient", content=body, headers={"content-type": MSGPACK}),
        )
        answer = problem(response, 422, "too-large")
        assert "max_body_containers" in answer["detail"]
        assert growth < 80 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"
        assert client.get("/readyz").status_code == 200


def test_a_msgpack_body_nested_past_the_limit_allocates_nothing_ahead(large_bodies) -> None:
    # Each level claims 7 million elements: an unpacker that allocates what a header
    # claims reserves 56 MB per level before it finds the body is nested too deep.
    claim = 7_000_000
    body = (b"\xdd" + claim.to_bytes(4, "big")) * 1000 + b"\xc4\x00" * claim
    with httpx.Client(base_url=large_bodies.base_url, timeout=60.0) as client:
        growth, response = peak_rss_growth(
            large_bodies.process.pid,
            lambda: client.post("/v1/gradient", content=body, headers={"content-type": MSGPACK}),
        )
        assert "max_body_depth" in problem(response, 400, "malformed-body")["detail"]
        assert growth < 80 * 2**20, f"the HTTP process grew by {growth / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (msgpack.packb({"definition": W, "target": "loss"})[:-3], "ends inside"),
        (msgpack.packb({"definition": W, "target": "loss"}) + b"\xc0", "follow the document"),
        (b"\x81\x01\xa1x", "not a string"),
        (b"\x81\x90\xa1x", "map key is a list"),
        (b"\x81\xa1x\xa2\xff\xfe", "not UTF-8"),
        (b"\xc1", "not valid msgpack"),
    ],
    ids=["truncated", "trailing", "int-key", "list-key", "bad-utf8", "reserved-byte"],
)
def test_malformed_msgpack_is_a_400_from_the_parse(client, unharmed, body, says) -> None:
    response = client.post("/v1/gradient", content=body, headers={"content-type": MSGPACK})
    answer = problem(response, 400, "malformed-body")
    assert "not valid msgpack" in answer["detail"] and says in answer["detail"], answer


def test_invalid_json_is_a_400_naming_the_position(client, unharmed) -> None:
    response = client.post(
        "/v1/gradient",
        content=b'{"target": "loss",, }',
        headers={"content-type": "application/json"},
    )
    answer = problem(response, 400, "malformed-body")
    assert answer["detail"] == (
        "the body is not valid JSON: Expecting property name "
        "enclosed in double quotes at character 18"
    )


# -- the key and the rate are checked before the body is read (issue 11) ----------------------

GATE_KEYS = {"rate": "gate-rate-key", "line": "gate-line-key", "ok": "gate-ok-key"}
BIG = 22 * 2**20


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """Keys on, 64 MiB bodies, one slot and a line of one per key, and a bucket of 3
    tokens that refills one every 100 s (so no test here sees it refill)."""
    from tests.service.conftest import start_server, stop_server

    folder = tmp_path_factory.mktemp("gated")
    srv = start_server(
        {
            "GRADTAPE_DATA_DIR": str(folder / "data"),
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_MAX_BODY_BYTES": str(64 * 2**20),
            "GRADTAPE_API_KEYS_ENABLED": "true",
            "GRADTAPE_API_KEYS": ",".join(GATE_KEYS.values()),
            "GRADTAPE_RATE_LIMIT_PER_SECOND": "0.01",
            "GRADTAPE_RATE_LIMIT_BURST": "3",
            "GRADTAPE_MAX_CONCURRENT_PER_KEY": "1",
            "GRADTAPE_MAX_WAITING_PER_KEY": "1",
        },
        folder / "server.log",
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def open_upload(
    server, length: int | None, key: str | None = None, first: bytes = b""
) -> socket.socket:
    """A raw connection that sends a POST /v1/gradient's headers (a JSON body of `length`
    bytes, or chunked when None) and the first bytes of its body, and no more until told."""
    url = urlsplit(server.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    if length is None:
        first = b"%x\r\n%s\r\n" % (len(first), first)
    sock.sendall(
        (
            f"POST /v1/gradient HTTP/1.1\r\nHost: {url.hostname}\r\n{auth}"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n"
        ).encode()
        + first
    )
    return sock


def gauge(server, name: str) -> float:
    """A gauge's value from GET /metrics (not gated: no key, no slot)."""
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{server.base_url}/metrics").text, re.M)
    assert found is not None, name
    return float(found.group(1))


def until_gauge(server, name: str, value: float, guard: float = 120.0) -> None:
    """Poll GET /metrics until gauge `name` reads `value`: an event to wait on, not a
    sleep; `guard` only turns a hang into a failure."""
    deadline = time.monotonic() + guard
    while (now := gauge(server, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {now}, never {value}"
        time.sleep(0.02)


def read_answer(sock) -> tuple[int, bytes]:
    """The status and the whole answer (headers and body, lower case)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        data.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0
    ):
        chunk = sock.recv(65536)  # times out (the socket's 10 s) when nothing comes
        assert chunk, data
        data += chunk
    return int(data.split(b" ", 2)[1]), data.lower()


def big_json() -> bytes:
    """22 MiB of valid JSON (a list of numbers): about 2 s of json.loads, under the GIL."""
    head, tail = b'{"definition": {"variables": {"w": [', b"1.0]}}}"
    return head + b"1.0," * ((BIG - len(head) - len(tail)) // 4) + tail


def test_a_keyless_client_is_refused_before_its_body_is_read(gated) -> None:
    """The 401 comes while 21 of the 22 MiB are still unsent: nothing of the body was
    read before the key was checked, let alone parsed. The rest is then discarded
    unparsed (/healthz stays fast while it streams in), and the server is unharmed."""
    body = big_json()
    sock = open_upload(gated, len(body), first=body[: 2**20])
    with sock:
        status, answer = read_answer(sock)
        assert status == 401 and b"problem+json" in answer and b"www-authenticate" in answer
        cpu_before = process_cpu_seconds(gated.process.pid)
        sent = threading.Thread(target=sock.sendall, args=(body[2**20 :],))
        sent.start()
        with httpx.Client(base_url=gated.base_url, timeout=10) as c:
            while sent.is_alive():
                assert c.get("/healthz").status_code == 200
                time.sleep(0.005)
            sent.join()
            assert c.get("/readyz").status_code == 200
        spent = process_cpu_seconds(gated.process.pid) - cpu_before
    # Discarded, not parsed: parsing the 21 MiB would cost the HTTP process ~2 s of CPU.
    # CPU time, not wall time, so a loaded machine does not move it.
    assert spent < 0.5, f"the HTTP process spent {spent:.2f} s of CPU on a refused body"


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_keyless_chunked_upload_is_refused_before_its_body_is_read(gated) -> None:
    """Without a Content-Length the body-size guard once read the whole body ahead of the
    app (up to max_body_bytes) before the key was looked at; it now counts as the app
    reads, so the 401 comes after the first chunk."""
    with open_upload(gated, None, first=big_json()[: 2**20]) as sock:
        status, answer = read_answer(sock)
    assert status == 401 and b"www-authenticate" in answer


def test_a_key_over_its_rate_is_refused_before_its_body_is_read(gated) -> None:
    key = GATE_KEYS["rate"]
    with httpx.Client(
        base_url=gated.base_url, timeout=10, headers={"Authorization": f"Bearer {key}"}
    ) as c:
        assert [c.get("/v1/ops").status_code for _ in range(3)] == [200] * 3  # the burst
    with open_upload(gated, BIG, key, first=b"[" * 1000) as sock:
        status, answer = read_answer(sock)
    assert status == 429 and b"retry-after" in answer and b"requests per second" in answer


LINE_GAUGE = "gradtape_key_requests_waiting"


def test_a_429_for_a_full_line_spends_no_token(gated) -> None:
    """One upload holds the key's slot (its body never finishes), another waits in its
    line: what comes next is refused for the line, and keeps its token. The bucket
    (3, no refill to speak of) paid for those two only, so one request passes after.
    (A request that computes: a read takes no slot and never stands in the line.)"""
    small = {"definition": W, "target": "loss"}
    key = GATE_KEYS["line"]
    with httpx.Client(
        base_url=gated.base_url, timeout=10, headers={"Authorization": f"Bearer {key}"}
    ) as c:
        held, lined = (gauge(gated, g) for g in ("gradtape_key_slots_held", LINE_GAUGE))
        holding = open_upload(gated, 1000, key, first=b"{")
        until_gauge(gated, "gradtape_key_slots_held", held + 1)  # it holds the slot
        waiting = open_upload(gated, 1000, key, first=b"{")
        until_gauge(gated, LINE_GAUGE, lined + 1)  # in the line
        refused = [c.post("/v1/gradient", json=small) for _ in range(5)]
        for r in refused:
            assert "1 waiting" in problem(r, 429, "rate-limited")["detail"], r.text
        holding.close()
        waiting.close()
        deadline = time.monotonic() + 60  # a guard against a hang, not a measurement
        while (r := c.post("/v1/gradient", json=small)).status_code == 429 and "waiting" in r.text:
            assert time.monotonic() < deadline, r.text  # the closed uploads let go
            time.sleep(0.05)
        assert r.status_code == 200, r.text  # the third token
        again = c.post("/v1/gradient", json=small)
        assert "requests per second" in problem(again, 429, "rate-limited")["detail"]


# -- integers and shapes past 64 bits (issue 25) ----------------------------------------------


@pytest.fixture
def small_tape(client: httpx.Client):
    made = client.post("/v1/tapes", json={"definition": W, "target": "loss"})
    assert made.status_code == 201, made.text
    yield made.json()["tape_id"]
    client.delete(f"/v1/tapes/{made.json()['tape_id']}")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("spectral-density", {"fisher_seed": 34348607718357374861312}, "fisher_seed"),
        ("spectral-density", {"seed": 2**64}, "seed"),
        ("trace", {"max_hvps": 2**64 + 1}, "max_hvps"),
        ("eigenvalues", {"seed": 2**63}, "seed"),
    ],
    ids=["fisher-seed", "seed-2-64", "max-hvps", "seed-2-63"],
)
def test_an_integer_option_past_64_bits_is_a_422_naming_it(
    client, unharmed, small_tape, path, body, field
) -> None:
    answer = problem(client.post(f"/v1/tapes/{small_tape}/{path}", json=body), 422, "validation")
    assert field in answer["detail"]
    assert [e["field"] for e in answer["errors"]] == [field]


def test_dataset_rows_past_64_bits_are_a_validation_error_naming_rows(client, unharmed) -> None:
    stored = client.put("/v1/datasets/rows64", json={"X": [1.0, 2.0, 3.0]})
    assert stored.status_code in (200, 201), stored.text
    body = {
        "definition": {
            "variables": {"w": [1.0]},
            "inputs": {"X": {"dataset": "rows64", "array": "X", "rows": [2**63]}},
            "program": ["loss = sum(w * X)"],
        },
        "target": "loss",
    }
    answer = problem(client.post("/v1/gradient", json=body), 422, "validation")
    assert "definition.inputs.X" in answer["detail"] and "rows" in answer["detail"]
    assert "OverflowError" not in answer["detail"]


@pytest.mark.parametrize(
    "shape", [[0, 2**62, 2**62], [0, HUGE], [2**40, 0, 2**40]], ids=["62-62", "huge", "mid-zero"]
)
def test_a_zero_dim_shape_with_an_overflowing_product_in_a_patch_is_a_422(
    client, unharmed, small_tape, shape
) -> None:
    patch = {"variables": {"w": {"dtype": "float32", "shape": shape, "data": []}}}
    answer = problem(client.patch(f"/v1/tapes/{small_tape}", json=patch), 422)
    assert "variables.w" in answer["detail"] and "shape" in answer["detail"]


def _requests_counted(client: httpx.Client, method: str) -> float:
    """The sum of gradtape_http_requests_total over the routes and statuses of `method`."""
    text = client.get("/metrics").text
    return sum(
        float(m.group(1))
        for m in re.finditer(
            rf'^gradtape_http_requests_total\{{method="{method}",[^}}]*\}} (\S+)$', text, re.M
        )
    )


def test_invented_methods_do_not_grow_the_metrics(server, client, unharmed) -> None:
    """uvicorn's h11 takes any token as an HTTP method: a client sending a new one per
    request must not add a metrics series per request (memory and every scrape growing
    without bound). Each is answered (404 off the routes, 405 on one) and counted as
    "other"; no invented name reaches /metrics."""
    url = urlsplit(server.base_url)
    before = _requests_counted(client, "other")
    sent = 12
    for i in range(sent):
        path = "/v1/gradient" if i % 2 else f"/nowhere/{i}"
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(f"INVENTED{i} {path} HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode())
            status, answer = read_answer(sock)
        assert status == (405 if i % 2 else 404), answer
        assert b"content-type: application/problem+json" in answer, answer
    text = client.get("/metrics").text
    assert "INVENTED" not in text
    assert _requests_counted(client, "other") == before + sent
    assert _requests_counted(client, "GET") >= 1  # known methods keep their own name
