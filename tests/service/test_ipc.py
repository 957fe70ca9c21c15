"""The worker protocol (service/core/ipc.py) has no in-band markers (issue 11): arrays travel as
a msgpack extension type, so any client string, as a key or a value, crosses unchanged and
nothing a client sends can be taken for protocol."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core import ipc

# Keys a client might choose, weighted towards ones that look like protocol.
MARKERS = [
    "__nd__",
    "__array__",
    "id",
    "ok",
    "kind",
    "payload",
    "error",
    "fatal",
    "hello",
    "dtype",
    "shape",
    "data",
    "",
]
keys = st.one_of(st.sampled_from(MARKERS), st.text(max_size=12))
arrays = st.builds(
    lambda dtype, shape, seed: np.random.default_rng(seed).standard_normal(shape).astype(dtype),
    st.sampled_from(["float64", "float32", "float16", "int64", "int8", "bool", "uint64"]),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**32 - 1),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    arrays,
)
documents = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(documents)
def test_any_document_crosses_unchanged(document: Any) -> None:
    assert same(ipc.unpack(ipc.pack(document)), document)


def test_the_old_marker_is_just_a_key() -> None:
    looks_like_an_array = {"__nd__": ["<f8", [1], b"\x00" * 8]}
    assert ipc.unpack(ipc.pack(looks_like_an_array)) == looks_like_an_array


def test_arrays_keep_dtype_shape_and_byte_order() -> None:
    for array in [
        np.zeros((0, 3)),
        np.array(2.5),
        np.arange(6, dtype=">i4").reshape(2, 3),
        np.ones((2, 2), dtype=np.float16)[:, :1],
        np.array([True, False]),
    ]:
        back = ipc.unpack(ipc.pack({"a": array}))["a"]
        assert back.shape == array.shape and np.array_equal(back, array)
        assert back.dtype == array.dtype.newbyteorder("=")


def test_a_malformed_array_is_a_frame_error() -> None:
    import msgpack
    import pytest

    for data in (b"", b"\x00", b"\x00\x05[1,2]", b"\x00\x01\xc0"):
        frame = msgpack.packb(msgpack.ExtType(ipc.ARRAY_EXT, data))
        with pytest.raises(ipc.FrameError):
            ipc.unpack(frame)


def test_an_array_read_like_one_before_is_checked_as_strictly() -> None:
    """The header of a dtype and shape read before is not parsed again (ipc._READ), but
    its bytes are still counted and a bool's still checked; a non-contiguous or
    big-endian array still travels as its little-endian, row-major bytes."""
    import msgpack
    import pytest

    for array in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True, False])):
        data = ipc._default(array).data
        for _ in range(2):  # the first read keeps the header, the second uses it
            np.testing.assert_array_equal(ipc._ext_hook(ipc.ARRAY_EXT, data), array)
        for bad in (data[:-1], data + b"\x00"):
            with pytest.raises(ipc.FrameError):
                ipc.unpack(msgpack.packb(msgpack.ExtType(ipc.ARRAY_EXT, bad)))
    flags = ipc._default(np.array([True, False])).data
    with pytest.raises(ipc.FrameError, match="bool"):
        ipc.unpack(msgpack.packb(msgpack.ExtType(ipc.ARRAY_EXT, flags[:-1] + b"\x02")))
    base = np.arange(12, dtype=">f8").reshape(3, 4)
    for array in (base, base.T, np.asarray(base, "<f8")[:, ::2]):
        back = ipc.unpack(ipc.pack(array))
        assert back.dtype == np.float64 and back.shape == array.shape
        np.testing.assert_array_equal(back, array)


# -- arrays arrive 16-byte aligned, on both sides ------------------------------------------------

ALIGNED_CASES = [
    (np.arange(n) % 3).astype(dtype).reshape(shape)
    for n, dtype, shape in [
        (1, "float64", ()),
        (7, "float32", (7,)),
        (12, "float16", (3, 4)),
        (30, "int8", (2, 3, 5)),
        (5, "bool", (5,)),
        (0, "float64", (0, 4)),
        (1000, "float64", (10, 100)),
    ]
]


def aligned_everywhere(document: Any) -> list[np.ndarray]:
    found: list[np.ndarray] = []
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, np.ndarray):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    assert found and all(a.ctypes.data % 16 == 0 for a in found if a.size), [
        (a.dtype, a.shape, a.ctypes.data % 16) for a in found
    ]
    return found


def test_arrays_a_worker_receives_are_16_byte_aligned() -> None:
    """The worker's side: recv_message on a blocking socket (service/worker/main.py)."""
    import socket

    message = {"id": 7, "kind": "x", "payload": {"a": ALIGNED_CASES, "k": {"b": ALIGNED_CASES[3]}}}
    left, right = socket.socketpair()
    with left, right:
        ipc.send_message(left, message)
        got = ipc.recv_message(right)
    assert same(got, message)
    assert len(aligned_everywhere(got)) == len(ALIGNED_CASES) + 1


class _Transport:
    """What FrameReader asks of its transport (abort, on a malformed frame)."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def _reader(bodies: list[Any], lost: list[Any]) -> ipc.FrameReader:
    reader = ipc.FrameReader(lambda body: bodies.append(ipc.unpack(body)), lost.append)
    reader.transport = _Transport()  # type: ignore[assignment]
    return reader


def test_arrays_the_http_process_receives_are_16_byte_aligned() -> None:
    """The HTTP process's side: FrameReader, the protocol on a worker's socket
    (service/pool/local.py), given the frame whole and in two pieces."""
    gradients = {str(i): a for i, a in enumerate(ALIGNED_CASES)}
    message = {"id": 1, "ok": True, "result": {"gradients": gradients}}
    header, body = ipc.frame(message)
    stream = header + body
    for pieces in ([stream], [stream[:7], stream[7:]]):
        got: list[Any] = []
        reader = _reader(got, [])
        for piece in pieces:
            reader.data_received(piece)
        (back,) = got
        assert same(back, message)
        assert len(aligned_everywhere(back)) == len(ALIGNED_CASES)


def test_frame_reader_hands_over_each_message_however_the_bytes_arrive() -> None:
    """Three frames (an empty message, a large array, a small one) cut at every place
    into two pieces, and into pieces of 1, 3 and 1000 bytes: the same three messages, in
    order, each once it is whole."""
    messages = [{}, {"id": 2, "a": np.arange(3000.0)}, {"id": 3, "progress": {"k": [1, 2]}}]
    stream = b"".join(b"".join(ipc.frame(m)) for m in messages)
    cuts = [[stream[:i], stream[i:]] for i in range(0, len(stream) + 1, 97)]
    cuts += [[stream[i : i + n] for i in range(0, len(stream), n)] for n in (1, 3, 1000)]
    for pieces in cuts:
        got: list[Any] = []
        reader = _reader(got, [])
        for piece in pieces:
            reader.data_received(piece)
        assert len(got) == 3
        for back, sent in zip(got, messages, strict=True):
            assert same(back, sent)


def test_frame_reader_ends_the_connection_on_a_malformed_frame() -> None:
    got: list[Any] = []
    lost: list[Any] = []
    reader = _reader(got, lost)
    good = b"".join(ipc.frame({"id": 1}))
    bad = ipc.HEADER.pack(1) + b"\xc1"  # 0xc1: never used by msgpack
    reader.data_received(good + bad + good)
    assert got == [{"id": 1}]
    assert reader.transport.aborted  # type: ignore[union-attr]
    reader.data_received(good)  # nothing more is read from it
    assert got == [{"id": 1}]
    reader.connection_lost(None)
    assert lost == [None]


@settings(max_examples=100, deadline=None)
@given(documents)
def test_every_array_of_any_document_is_aligned(document: Any) -> None:
    back = ipc.unpack(ipc.pack({"doc": document, "pin": np.ones(3)}))
    aligned_everywhere(back)


@settings(max_examples=150, deadline=None)
@given(documents)
def test_the_bytes_of_the_arrays_are_counted_both_ways(document: Any) -> None:
    """What the pool's metrics count (gradtape_pool_array_bytes): the bytes of every
    array a message carries, counted while it is packed and while it is read, equal to
    the walk over the message (wire.array_bytes) that they replace."""
    from service.core.wire import array_bytes

    message = {"id": 1, "payload": document}
    expected = array_bytes(message)
    outgoing = ipc.prepare(message, None)
    assert outgoing.array_bytes == expected
    counted = [0]
    assert same(ipc.unpack(outgoing.body, counted=counted), message)
    assert counted[0] == expected
