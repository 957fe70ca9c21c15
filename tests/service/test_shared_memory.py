"""Large arrays through shared memory (issue 17, item 4; service/core/shm.py): every dtype
and shape crosses unchanged between real processes, an array kept by its receiver is
never overwritten by a later message, the threshold decides what goes there, and
nothing is left in /dev/shm when workers (or the HTTP process) are SIGKILLed
mid-transfer."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from service.core import ipc, shm
from service.core.config import Settings
from service.pool.local import WorkerPool
from tests.service.conftest import Server, start_server, stop_server
from tests.service.wire import MSGPACK, arr, ok, tbin

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")


def our_segments(pid: int) -> list[str]:
    """Names in /dev/shm of the pools of process `pid`."""
    return sorted(n for n in os.listdir(shm.DIRECTORY) if n.startswith(f"gradtape-{pid}-"))


def mapped_arenas(pid: int) -> list[str]:
    """The arenas process `pid` has mapped (unlinked ones show as '(deleted)')."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "/dev/shm/gradtape-" in line]


def mapped_spans(pid: int, prefix: str) -> list[int]:
    """The sizes of the mappings process `pid` has of segments under `prefix`."""
    with open(f"/proc/{pid}/maps") as f:
        spans = [line.split()[0].split("-") for line in f if f"/dev/shm/{prefix}-" in line]
    return [int(end, 16) - int(start, 16) for start, end in spans]


# ---- the protocol between two real processes ----------------------------------------------


def _peer(sock: socket.socket, channel: shm.Channel) -> None:
    """The worker's side of the protocol (service/worker/main.py's loop, with an echo for
    its handler): "echo" answers the payload (the same arrays: held while the reply is
    sent); "copy" answers copies of a list of arrays, as most handlers answer new arrays;
    "keep" echoes and keeps the payload, as a tape would; "kept" answers the sums of
    what it kept."""
    inbox, outbox = shm.Inbox(channel), shm.Outbox(channel, f"w{os.getpid()}")
    kept: list[Any] = []
    try:
        while (message := ipc.recv_message(sock, inbox)) is not None:
            if message["kind"] == ipc.HELD:
                outbox.held = set(message["payload"])
                continue
            if message["kind"] == "keep":
                kept.append(message["payload"])
            if message["kind"] == "kept":
                payload: Any = [float(np.sum(a, dtype=np.float64)) for a in kept]
            elif message["kind"] == "copy":
                payload = [np.array(a) for a in message["payload"]]
            else:
                payload = message["payload"]
            reply = {"id": message["id"], "payload": payload}
            del message, payload
            if held := inbox.held():
                reply["held"] = held
            ipc.send_message(sock, reply, outbox)
            del reply
    finally:
        outbox.close()


class Peer:
    """This process as the HTTP process, with a spawned peer process as the worker."""

    def __init__(self, threshold: int = 1):
        self.channel = shm.Channel.for_new_pool(threshold)
        self.sock, theirs = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=_peer, args=(theirs, self.channel), daemon=True)
        self.process.start()
        theirs.close()
        self.inbox, self.outbox = shm.Inbox(self.channel), shm.Outbox(self.channel, "a0")
        self.ids = iter(range(1, 10**9))

    def ask(self, kind: str, payload: Any) -> Any:
        if held := self.inbox.held():
            ipc.send_message(self.sock, {"id": 0, "kind": ipc.HELD, "payload": held})
        message = {"id": next(self.ids), "kind": kind, "payload": payload}
        header, body = ipc.prepare(message, self.channel).frame(self.outbox)
        self.sock.sendall(header + body)
        reply = ipc.recv_message(self.sock, self.inbox)
        assert reply is not None and reply["id"] == message["id"]
        if held := reply.pop("held", None):
            self.outbox.held = set(held)
        return reply["payload"]

    def close(self) -> None:
        self.sock.close()
        self.process.join(10)
        self.outbox.close()
        shm.sweep(self.channel.prefix)


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.close()
    assert our_segments(os.getpid()) == []


DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool"]  # fmt: skip
SHAPES = [(), (0,), (3, 0, 2), (1,), (7, 13, 3), (1, 1, 1, 1, 5), (100_003,)]


def sample(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.startswith("float"):
        return np.asarray(rng.standard_normal(shape), dtype=dtype)
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))


def test_every_dtype_and_shape_round_trips(peer: Peer) -> None:
    for seed, dtype in enumerate(DTYPES):
        arrays = [sample(dtype, shape, seed) for shape in SHAPES]
        base = sample(dtype, (40, 50), seed)
        arrays += [base[::3, 1::2], base.T, base[:, 7]]  # not contiguous
        arrays.append(base.astype(np.dtype(dtype).newbyteorder(">")))  # big-endian
        back = peer.ask("echo", {"arrays": arrays, "small": np.arange(3)})
        assert np.array_equal(back["small"], np.arange(3))
        for sent, got in zip(arrays, back["arrays"], strict=True):
            assert got.dtype == np.dtype(dtype) and got.shape == sent.shape, (dtype, sent.shape)
            assert np.array_equal(got, sent), (dtype, sent.shape)
            if got.size:
                assert not got.flags.writeable  # a view of the arena, as bytes were
                assert got.ctypes.data % shm.ALIGNMENT == 0
    # Mapped on both sides, named nowhere.
    assert our_segments(os.getpid()) == []


def test_arenas_are_reused_while_nothing_holds_them(peer: Peer) -> None:
    arenas = set()
    for seed in range(6):
        sent = [sample("float32", (300, 301), seed), sample("int64", (5000,), seed)]
        back = peer.ask("copy", sent)
        assert all(np.array_equal(a, b) for a, b in zip(sent, back, strict=True))
        arenas.add((tuple(peer.outbox.names), tuple(peer.inbox.names)))
        del back  # the answer used, as a route does
    assert len(arenas) == 1 and all(len(names) == 1 for names in arenas.pop())  # one each


def test_large_arrays_of_every_float_dtype(peer: Peer) -> None:
    """Up to 8 MiB in all, a message goes through the reused arenas (which grow to it);
    past that, through a segment of its own, so no arena grows past shm.MAX_ARENA."""
    for dtype in ("float16", "float32", "float64"):
        big = sample(dtype, (1024, 1031), 3)  # 2.1, 4.2 and 8.4 MB
        (got,) = peer.ask("echo", [big])
        assert got.dtype == big.dtype and np.array_equal(got, big)
        del got
    twice = [sample("float64", (600, 1000), 4), sample("float32", (1000, 999), 5)]
    back = peer.ask("copy", twice)  # 8.8 MB in one message
    assert all(np.array_equal(a, b) for a, b in zip(twice, back, strict=True))
    del back
    assert our_segments(os.getpid()) == []
    # This side maps the arenas of both directions, none past MAX_ARENA, and no
    # message's own segment once its arrays are gone.
    spans = mapped_spans(os.getpid(), peer.channel.prefix)
    assert spans and max(spans) <= shm.MAX_ARENA and len(spans) <= 2 * shm.ARENAS, spans


def test_an_array_its_receiver_keeps_is_never_overwritten(peer: Peer) -> None:
    a, b = sample("float64", (50_000,), 1), sample("float64", (50_000,), 2)
    first = peer.ask("keep", [a])[0]  # the peer keeps its copy; this side keeps `first`
    for other in (b, -b, b * 2):
        (echo,) = peer.ask("echo", [other])
        assert np.array_equal(echo, other)
        del echo
    # The reply arena this side held was left alone (the peer wrote into its second);
    # the peer's kept request arrays were not overwritten by the later requests either.
    assert np.array_equal(first, a) and len(peer.inbox.names) == 2
    assert peer.ask("kept", None) == [float(np.sum(a))]
    del first
    (echo,) = peer.ask("echo", [a])
    assert np.array_equal(echo, a)


def test_only_arrays_over_the_threshold_go_to_shared_memory() -> None:
    channel = shm.Channel.for_new_pool(1000)
    small, large = np.zeros(249, np.float32), np.zeros(250, np.float32)  # 996 / 1000 bytes
    prepared = ipc.prepare({"a": small, "b": large, "c": np.zeros(0)}, channel)
    assert [len(raw) for _, raw in prepared.pieces] == [1000]
    assert ipc.prepare({"a": large}, shm.Channel.for_new_pool(0)).pieces == []
    # Without an inbox (the Ray transport) an arena array is refused, never guessed at.
    outbox = shm.Outbox(channel, "a0")
    try:
        _, body = prepared.frame(outbox)
        with pytest.raises(ipc.FrameError, match="shared memory"):
            ipc.unpack(body)
        # Nor is a name outside the pool's prefix opened.
        forged = msgpack.packb(
            msgpack.ExtType(
                ipc.SHARED_ARRAY_EXT, msgpack.packb(["gradtape-1-00-a0-0", 0, "float32", [1]])
            )
        )
        with pytest.raises(ipc.FrameError, match="no segment of this pool"):
            ipc.unpack(forged, shm.Inbox(channel))
    finally:
        outbox.close()
    assert our_segments(os.getpid()) == []


def test_without_room_in_dev_shm_arrays_go_inline(monkeypatch, tmp_path: Path) -> None:
    """A /dev/shm that cannot take an arena (Docker's 64 MB full, or none at all): the
    message is sent whole through the socket instead, never lost or half-written."""
    channel = shm.Channel.for_new_pool(1)
    outbox = shm.Outbox(channel, "a0")
    monkeypatch.setattr(shm, "DIRECTORY", str(tmp_path / "absent"))
    a = np.arange(100_000.0)
    _, body = ipc.prepare({"a": a, "b": [a[::2]]}, channel).frame(outbox)
    back = ipc.unpack(body)  # no arena: readable without one
    assert np.array_equal(back["a"], a) and np.array_equal(back["b"][0], a[::2])
    assert outbox.names == []


def test_a_message_that_could_not_travel_inline_is_refused_at_submit(monkeypatch) -> None:
    """Shared memory may refuse a message's arrays at dispatch (no room), and then the whole
    message goes in one frame: one that would not fit a frame is refused when it is
    submitted (as before shared memory), never at dispatch, where it left the worker busy
    and the caller waiting for ever. Scaled down: frames of 1 MiB, 2.4 MB of arrays."""
    monkeypatch.setattr(ipc, "MAX_FRAME", 1 << 20)
    channel = shm.Channel.for_new_pool(1)
    with pytest.raises(ValueError, match="too large for one frame"):
        ipc.prepare({"a": np.zeros(300_000)}, channel)
    small = ipc.prepare({"a": np.zeros(100_000)}, channel)  # 0.8 MB: fits either way
    assert small.pieces


# ---- the pool: a real worker --------------------------------------------------------------


def gradient_payload(w: np.ndarray, x: np.ndarray) -> dict[str, Any]:
    from service.api.payloads import gradient
    from service.api.schemas import GradientRequest

    body = {
        "definition": {
            "variables": {"w": {"value": tbin(w, str(w.dtype))}},
            "inputs": {"x": tbin(x, str(x.dtype))},
            "program": ["s = sum(w * x)"],
        },
        "target": "s",
        "sources": ["w"],
    }
    return gradient(GradientRequest.model_validate(body), Settings()).payload


def test_the_threshold_setting_and_the_worker_answers() -> None:
    """Arrays below GRADTAPE_SHM_THRESHOLD never touch /dev/shm, those above do, and
    the answers are the same either way (and the closed form: d/dw sum(w * x) = x)."""

    async def scenario() -> None:
        pools = {t: WorkerPool(Settings(workers=1, shm_threshold=t)) for t in (0, 200_000)}
        for pool in pools.values():
            await pool.start()
        try:
            for n, dtype in (
                (40_000, "float32"),
                (60_000, "float32"),
                (30_000, "float64"),
                (123_457, "float16"),
            ):
                rng = np.random.default_rng(n)
                w, x = (rng.standard_normal(n).astype(dtype) for _ in range(2))
                answers = {}
                for threshold, pool in pools.items():
                    before = set(mapped_arenas(os.getpid()))
                    reply = await pool.submit("gradient", gradient_payload(w, x))
                    grows = set(mapped_arenas(os.getpid())) - before
                    shared = threshold and n * np.dtype(dtype).itemsize >= threshold
                    # Only the first large request maps the arenas (then they are reused).
                    assert not grows or shared, (threshold, n, dtype, grows)
                    answers[threshold] = reply.result["gradients"]["w"]
                    assert np.array_equal(answers[threshold], x)
                assert answers[0].dtype == answers[200_000].dtype == np.dtype(dtype)
            assert mapped_arenas(os.getpid())  # the 240 KB arrays went through an arena
            assert our_segments(os.getpid()) == []  # named nowhere while they run
        finally:
            for pool in pools.values():
                await pool.close()
        assert our_segments(os.getpid()) == []

    asyncio.run(scenario())


def test_an_answer_this_process_cannot_map_fails_alone(tmp_path: Path) -> None:
    """Out of file descriptors (a flood of client connections), the HTTP process cannot
    map the worker's reply arena: that request gets an 'unavailable' error to retry, and
    the worker, which did nothing wrong, is kept with its generation (it was taken for a
    dead one and replaced, losing its tapes); the next request is answered."""
    import resource

    from service.pool import ComputeFailed

    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=1))
        await pool.start()
        try:
            before = pool.workers()[0]
            rng = np.random.default_rng(5)
            w, x = (rng.standard_normal(100_000).astype(np.float32) for _ in range(2))
            payload = gradient_payload(w, x)  # (its imports open files: before the limit)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            # A process's next descriptor is the lowest free one (earlier tests may leave
            # gaps below the highest): no new descriptor fits under a limit of that number.
            lowest_free = os.open(os.devnull, os.O_RDONLY)
            os.close(lowest_free)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            try:
                with pytest.raises(ComputeFailed) as failed:
                    await pool.submit("gradient", payload)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert failed.value.error["type"] == "unavailable"
            assert "Too many open files" in failed.value.error["message"]
            reply = await pool.submit("gradient", gradient_payload(w, x))
            assert np.array_equal(reply.result["gradients"]["w"], x)
            after = pool.workers()[0]
            assert (after.pid, after.generation, after.restarts) == (
                before.pid,
                before.generation,
                before.restarts,
            )
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_pool_sweeps_what_a_killed_server_left() -> None:
    gone = multiprocessing.get_context("spawn").Process(target=int)
    gone.start()
    gone.join()
    left = [f"gradtape-{gone.pid}-0badf00d-a0-0", f"gradtape-{gone.pid}-0badf00d-w17-3"]
    alive = f"gradtape-{os.getppid()}-0badf00d-a0-0"  # a live server's: not ours to remove
    for name in (*left, alive):
        Path(shm.path_of(name)).write_bytes(b"x" * 10)

    async def scenario() -> None:
        pool = WorkerPool(Settings(workers=1))
        await pool.start()
        await pool.close()

    try:
        asyncio.run(scenario())
        names = set(os.listdir(shm.DIRECTORY))
        assert not names & set(left) and alive in names
    finally:
        for name in (*left, alive):
            shm.unlink(name)


# ---- over HTTP: tapes keep their arrays; workers killed mid-transfer ------------------------


def test_tapes_keep_their_arrays_and_pin_no_arena(client, server) -> None:
    """A tape's arrays outlive their request: the later requests, which reuse the
    arenas, must not change them, and the tapes must not pin an arena each (the worker
    copies what a tape keeps out of shared memory: at most shm.ARENAS arenas per
    direction stay mapped in a worker, however many tapes it holds)."""
    n = 150_000  # 600 KB each: above the default 64 KiB threshold
    rng = np.random.default_rng(7)
    w, x, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    definition = {
        "variables": {"w": {"value": tbin(w)}},
        "inputs": {"x": tbin(x)},
        "program": ["loss = sum(x * w * w) * 0.5"],
    }
    headers = {"content-type": MSGPACK, "accept": MSGPACK}

    def send(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = client.post(path, content=msgpack.packb(body), headers=headers)
        assert response.status_code in (200, 201), response.headers
        return msgpack.unpackb(response.content)

    tape = send("/v1/tapes", {"definition": definition, "target": "loss", "sources": ["w"]})
    others = [
        send(
            "/v1/tapes",
            {
                "definition": {**definition, "inputs": {"x": tbin(x * k)}},
                "target": "loss",
                "sources": ["w"],
            },
        )
        for k in range(6)
    ]
    for k in range(4):  # both workers, several times: every arena is written again
        other = rng.standard_normal(n).astype(np.float32)
        got = send(
            "/v1/gradient",
            {
                "definition": {**definition, "inputs": {"x": tbin(other)}},
                "target": "loss",
                "sources": ["w"],
            },
        )
        assert np.array_equal(arr(got["gradients"]["w"]), other * w), k
    hvp = send(f"/v1/tapes/{tape['tape_id']}/hvp", {"vector": {"w": tbin(v)}})
    assert np.array_equal(arr(hvp["hvp"]["w"]), x * v)
    again = send(f"/v1/tapes/{tape['tape_id']}/gradient", {})
    assert np.array_equal(arr(again["gradients"]["w"]), x * w)
    for k, other in enumerate(others):
        got = send(f"/v1/tapes/{other['tape_id']}/gradient", {})
        assert np.array_equal(arr(got["gradients"]["w"]), x * k * w)
    for worker in server.wait_ready()["workers"]:
        assert len(mapped_arenas(worker["pid"])) <= 2 * shm.ARENAS, mapped_arenas(worker["pid"])


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("shm") / "server.log"
    srv = start_server(
        {
            "GRADTAPE_WORKERS": "2",
            "GRADTAPE_MAX_BODY_BYTES": str(64 * 2**20),
            "GRADTAPE_STORE_PATH": ":memory:",
        },
        log,
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def big_request(n: int, seed: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    w, x = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    body = {
        "definition": {
            "variables": {"w": {"value": tbin(w)}},
            "inputs": {"x": tbin(x)},
            "program": ["s = sum(w * x)"],
        },
        "target": "s",
        "sources": ["w"],
    }
    return msgpack.packb(body), x


def send(client: httpx.Client, body: bytes, responses: list[httpx.Response]) -> None:
    headers = {"content-type": MSGPACK, "accept": MSGPACK}
    responses.append(client.post("/v1/gradient", content=body, headers=headers))


def test_workers_killed_mid_transfer_leave_nothing(own_server: Server) -> None:
    pid = own_server.process.pid
    headers = {"content-type": MSGPACK, "accept": MSGPACK}
    body, x = big_request(2_000_000, 1)  # 8 MB each way and back
    outcomes = set()
    with httpx.Client(base_url=own_server.base_url, timeout=60.0) as client:
        for round_ in range(6):
            workers = own_server.wait_ready()["workers"]
            responses: list[httpx.Response] = []
            senders = [
                threading.Thread(target=send, args=(client, body, responses)) for _ in range(2)
            ]
            for sender in senders:
                sender.start()
            # As soon as a worker has the request (busy from its dispatch: the copy into
            # the arena, its mapping, the compute, the reply's copy, its reading here).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                w["state"] == "busy" for w in client.get("/readyz").json()["workers"]
            ):
                time.sleep(0.001)
            time.sleep(random.Random(round_).uniform(0.0, 0.004))
            for w in workers:
                os.kill(w["pid"], signal.SIGKILL)
            for sender in senders:
                sender.join(60)
            outcomes.update(r.status_code for r in responses)
            assert {r.status_code for r in responses} <= {200, 500, 502, 503}, [
                r.text[:200] for r in responses
            ]
            own_server.wait_ready()
            assert our_segments(pid) == [], round_
            # The HTTP process maps at most shm.ARENAS per worker and direction (and
            # those that arrays still alive hold: none once the answers are written).
            assert len(mapped_arenas(pid)) <= 2 * 2 * shm.ARENAS, mapped_arenas(pid)
        got = ok(client.post("/v1/gradient", content=body, headers=headers))
        assert np.array_equal(arr(got["gradients"]["w"]), x)
    assert our_segments(pid) == []
    assert outcomes - {200}, "no request was ever caught by a kill"


def test_a_killed_http_process_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    srv = start_server(
        {
            "GRADTAPE_WORKERS": "1",
            "GRADTAPE_MAX_BODY_BYTES": str(64 * 2**20),
            "GRADTAPE_STORE_PATH": ":memory:",
        },
        tmp_path / "server.log",
    )
    pid = srv.process.pid
    try:
        worker = srv.wait_ready()["workers"][0]["pid"]
        body, _ = big_request(2_000_000, 2)

        def send() -> None:
            try:
                httpx.post(
                    f"{srv.base_url}/v1/gradient",
                    content=body,
                    timeout=30,
                    headers={"content-type": MSGPACK},
                )
            except httpx.HTTPError:
                pass  # the server is killed under it

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.05)
        srv.process.send_signal(signal.SIGKILL)
        srv.process.wait(10)
        sender.join(30)
        deadline = time.monotonic() + 20  # its worker sees the socket close and exits
        while (
            time.monotonic() < deadline
            and Path(f"/proc/{worker}").exists()
            and "Z" not in Path(f"/proc/{worker}/stat").read_text().rpartition(")")[2][:3]
        ):
            time.sleep(0.05)
    finally:
        if srv.process.poll() is None:
            stop_server(srv)

    async def next_start() -> None:
        pool = WorkerPool(Settings(workers=1))
        await pool.start()
        await pool.close()

    asyncio.run(next_start())
    assert our_segments(pid) == []
