"""Messages between the HTTP process and the engine workers.

A message is one msgpack document behind a 4-byte big-endian length. NumPy arrays
travel as a msgpack extension type (code ARRAY_EXT: the lengths of a msgpack header
`[dtype, shape]` and of what precedes the raw bytes, the header, zero padding, then the
raw bytes at a multiple of 16 bytes into the extension's data; dtype names and bytes as
service/core/wire.py writes and checks them), out of band: no client string, whatever
key or value it is, can be taken for an array or any other protocol element. Client
data is never pickled. Both sides use this module: the asyncio side reads frames as they
arrive (FrameReader, a protocol) and writes them on its transport, a worker on a
blocking socket.

Between the HTTP process and a local worker, an array of at least the pool's threshold
(settings.shm_threshold) travels through shared memory instead (service/core/shm.py):
extension type SHARED_ARRAY_EXT holds `[arena name, offset, dtype, shape]` and the
receiver reads the array in place, read-only, from its mapping of the arena. Only a side
with the pool's shm.Inbox accepts one (Ray's bytes never carry one).

Requests: {"id": int, "kind": str, "payload": ...} (kind "shutdown": exit).
Replies: {"id": int, "ok": true, "result": ..., "seconds": float}
      or {"id": int, "ok": false, "error": {"type": str, "message": str, ...}}.
A worker that has started says {"hello": {...}}, or {"fatal": message} and exits.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from service.core import shm, wire

log = logging.getLogger("gradtape.workers")

HEADER = struct.Struct("!I")
MAX_FRAME = 2**32 - 1
ONE_WRITE = 1 << 16  # a frame up to this size goes with its header in one write (a copy)
ARRAY_EXT = 1  # the msgpack extension type code of a NumPy array
SHARED_ARRAY_EXT = 2  # ... of a NumPy array in a shared-memory arena
# The kind of the pool's message that tells a worker which of its reply arenas the HTTP
# process still holds arrays of (service/core/shm.py); a reply says the same of the
# request arenas with "held": [names].
HELD = "shm-held"
# The length of the array's [dtype, shape] header, and the offset of its raw bytes.
_ARRAY_PREFIX = struct.Struct("!HH")
# The raw bytes' offset in the extension's data: the receiver's array then starts 16-byte
# aligned (msgpack hands the data over as a bytes object, whose buffer is 16-byte aligned
# in CPython), as SIMD loops want it; at 2 mod 8, as it was, elementwise math is slower.
ALIGNMENT = 16


# The key of a message this side received whole but could not read (unpack()): set by
# the reader only, beside the message's id, never sent.
UNREADABLE = "unreadable"
# What running out of, rather than a bad reference, looks like when mapping an arena.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


class ArenaUnavailable(Exception):
    """This process could not map the peer's arena for want of descriptors or memory."""


class FrameError(ConnectionError):
    """The other side closed the connection or sent something that is not a frame."""


# An array's extension data begins with the same bytes for every array of one dtype and
# shape (prefix, [dtype, shape] header, padding): kept, both ways, for the arrays of the
# usual requests (7 us an array each way without, ~2 with). Bounded: the shapes are the
# clients' choice.
_HEADS: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}
# What those bytes were read as: the native dtype, the shape, the raw bytes' length.
_READ: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}
_HEADS_KEPT = 1024
# The dtypes whose arrays travel as they are in memory (little-endian, native here).
_AS_IN_MEMORY = {
    wire.little_endian(name): name
    for name in wire.DTYPES
    if wire.little_endian(name) == np.dtype(name)  # (a big-endian machine: none)
}


def _head(dtype: str, shape: list[int]) -> bytes:
    header = msgpack.packb([dtype, shape])
    used = _ARRAY_PREFIX.size + len(header)
    start = -(-used // ALIGNMENT) * ALIGNMENT
    return b"".join((_ARRAY_PREFIX.pack(len(header), start), header, bytes(start - used)))


def _keep(table: dict[Any, Any], key: Any, value: Any) -> None:
    if len(table) >= _HEADS_KEPT:
        table.clear()
    table[key] = value


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype in _AS_IN_MEMORY and obj.flags.c_contiguous:
            # The usual array: its own memory is the wire's bytes (no copy but the join).
            key = (obj.dtype, obj.shape)
            head = _HEADS.get(key)
            if head is None:
                head = _head(_AS_IN_MEMORY[obj.dtype], list(obj.shape))
                _keep(_HEADS, key, head)
            return msgpack.ExtType(ARRAY_EXT, b"".join((head, obj.data)))
        dtype, shape, raw = wire.raw_view(obj)  # no copy of a contiguous little-endian array
        return msgpack.ExtType(ARRAY_EXT, b"".join((_head(dtype, shape), raw)))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to or from a worker")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        if code == SHARED_ARRAY_EXT:
            raise FrameError("an array in shared memory, where none is accepted")
        raise FrameError(f"unknown msgpack extension type {code} in a worker message")
    try:
        size, start = _ARRAY_PREFIX.unpack_from(data)
        if start < _ARRAY_PREFIX.size + size:
            raise ValueError(f"its raw bytes start at {start}, inside its header")
        head = data[:start]
        known = _READ.get(head)
        if known is not None:  # bytes that read as this before (from_bytes checked them)
            dt, shape, nbytes = known
            if len(data) - start != nbytes:
                raise ValueError(f"{len(data) - start} byte(s) for {nbytes}")
            # Read-only (a view of msgpack's bytes, no copy): no receiver writes into them.
            array = np.frombuffer(data, dtype=dt, offset=start).reshape(shape)
            if dt.kind == "b" and array.size and array.view(np.uint8).max() > 1:
                raise ValueError("bool bytes must be 0 or 1")
            return array
        dtype, shape = msgpack.unpackb(data[_ARRAY_PREFIX.size : _ARRAY_PREFIX.size + size])
        array = wire.from_bytes(memoryview(data)[start:], dtype, shape)
        if array.dtype in _AS_IN_MEMORY and isinstance(head, bytes):
            _keep(_READ, head, (array.dtype, array.shape, array.nbytes))
        return array
    except (struct.error, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"a malformed array in a worker message: {exc}") from None


def pack(message: Any) -> bytes:
    packed: bytes = msgpack.packb(message, default=_default, use_bin_type=True)
    return packed


@dataclass(eq=False)
class Outgoing:
    """A message packed for a peer with a shared-memory arena (prepare()): `body` is final
    when no array is large enough for the arena; otherwise frame() copies the large
    arrays into the peer's arena and packs the message again around their places (cheap:
    the large arrays' bytes are not in it)."""

    message: Any
    body: bytes
    channel: shm.Channel | None = None
    array_bytes: int = 0  # the bytes of its arrays (counted as they are packed)
    pieces: list[tuple[int, memoryview]] = field(default_factory=list)
    places: list[list[Any]] = field(default_factory=list)  # [offset, dtype, shape] each
    end: int = 0

    def frame(self, outbox: shm.Outbox | None) -> tuple[bytes, bytes]:
        if not self.pieces:
            return _framed(self.body)
        if outbox is None:
            return frame(self.message)
        try:
            name = outbox.write(self.pieces, self.end)
        except OSError as exc:
            log.warning(
                "cannot write %d bytes to shared memory (%s); sending them inline",
                self.end,
                exc.strerror or exc,
            )
            return frame(self.message)
        places = iter(self.places)

        def default(obj: Any) -> Any:
            if (
                isinstance(obj, np.ndarray)
                and self.channel is not None
                and self.channel.takes(obj.nbytes)
            ):
                return msgpack.ExtType(SHARED_ARRAY_EXT, msgpack.packb([name, *next(places)]))
            return _default(obj)

        return _framed(msgpack.packb(self.message, default=default, use_bin_type=True))


def prepare(message: Any, channel: shm.Channel | None) -> Outgoing:
    """Pack `message` once (so that what msgpack cannot carry fails here), noting where
    each array of at least the channel's threshold will lie in an arena."""
    if channel is None or channel.threshold == 0:
        packed = Outgoing(message, b"")

        def counting(obj: Any) -> Any:
            if isinstance(obj, np.ndarray):
                packed.array_bytes += obj.nbytes
            return _default(obj)

        packed.body = msgpack.packb(message, default=counting, use_bin_type=True)
        return packed
    out = Outgoing(message, b"", channel)

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            out.array_bytes += obj.nbytes
        if isinstance(obj, np.ndarray) and channel.takes(obj.nbytes):
            dtype, shape, raw = wire.raw_view(obj)  # no copy of a contiguous array
            offset = -(-out.end // shm.ALIGNMENT) * shm.ALIGNMENT
            out.pieces.append((offset, raw))
            out.places.append([offset, dtype, shape])
            out.end = offset + len(raw)
            return msgpack.ExtType(SHARED_ARRAY_EXT, b"")  # its place, until frame()
        return _default(obj)

    out.body = msgpack.packb(message, default=default, use_bin_type=True)
    # Refused here, at submit, if it could not travel inline: shared memory may refuse
    # the arrays at dispatch (no room), and then the whole message goes in one frame.
    inline = len(out.body) + out.end + 64 * len(out.pieces)  # (64: an array's header)
    if inline > MAX_FRAME:
        raise ValueError(f"message of {inline} bytes is too large for one frame")
    return out


def unpack(
    body: bytes | bytearray | memoryview,
    inbox: shm.Inbox | None = None,
    counted: list[int] | None = None,
) -> Any:
    """The message; with `inbox`, its arrays in the peer's arena are read in place
    (read-only views of the mapping, tracked so that the arena is not written again
    while one of them lives). With `counted`, the bytes of its arrays are added to
    counted[0] (the pool's metrics, without walking the message again)."""
    if inbox is None and counted is None:
        return msgpack.unpackb(body, ext_hook=_ext_hook, raw=False, strict_map_key=False)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == SHARED_ARRAY_EXT and inbox is not None:
            array = _shared_array(data, inbox)
        else:
            array = _ext_hook(code, data)
        if counted is not None:
            counted[0] += array.nbytes
        return array

    try:
        return msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except ArenaUnavailable as exc:
        # This side could not map the peer's arena (out of descriptors or memory): the
        # frame was read whole, so the stream is in step and only this message is lost.
        # Its envelope, read again without its shared arrays, says whose it was; the
        # reader answers its request with an error instead of taking the peer for dead.
        envelope = msgpack.unpackb(
            body, ext_hook=lambda code, data: None, raw=False, strict_map_key=False
        )
        request_id = envelope.get("id") if isinstance(envelope, dict) else None
        return {"id": request_id, UNREADABLE: str(exc)}


def _shared_array(data: bytes, inbox: shm.Inbox) -> Any:
    try:
        name, offset, dtype, shape = msgpack.unpackb(data)
        if not isinstance(name, str) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"arena {name!r}, offset {offset!r}")
        if dtype not in wire.DTYPES:
            raise ValueError(f"dtype {dtype!r}")
        nbytes = wire.expected_size(shape) * wire.little_endian(dtype).itemsize
        array = wire.from_bytes(inbox.view(name, offset, nbytes), dtype, shape)
    except OSError as exc:
        if exc.errno in _EXHAUSTED:
            raise ArenaUnavailable(f"cannot map the peer's shared memory: {exc}") from None
        raise FrameError(f"a malformed shared-memory array in a worker message: {exc}") from None
    except (TypeError, ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"a malformed shared-memory array in a worker message: {exc}") from None
    inbox.handed(name, array)
    return array


def frame(message: Any) -> tuple[bytes, bytes]:
    return _framed(pack(message))


def _framed(body: bytes) -> tuple[bytes, bytes]:
    if len(body) > MAX_FRAME:
        raise ValueError(f"message of {len(body)} bytes is too large for one frame")
    return HEADER.pack(len(body)), body


# ----------------------------------------------------------------------------------------
# asyncio side (the HTTP process)
# ----------------------------------------------------------------------------------------


class FrameReader(asyncio.Protocol):
    """The asyncio side's reading of one connection: each frame's body is handed to
    `on_frame` in the loop turn that completes it (no task reading the stream, no future
    between the reader and whoever waits for the message: a request's reply resolves its
    waiter directly); `on_lost(exc)` once the connection is gone. A frame its handler
    refuses (FrameError, ValueError: a malformed message) ends the connection."""

    def __init__(self, on_frame: Any, on_lost: Any):
        self.on_frame = on_frame  # (body: bytes | memoryview) -> None; may be replaced
        self.on_lost = on_lost  # (exc: BaseException | None) -> None
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._failed:
            return
        try:
            if not self._buffer:
                data = self._whole_frames(data)  # the usual case: no copy into the buffer
            if data:
                self._buffer += data
                self._buffered_frames()
        except (ConnectionError, OSError, ValueError) as exc:
            self._failed = True
            self._buffer.clear()
            assert self.transport is not None
            self.transport.abort()  # connection_lost follows, with on_lost
            log.debug("a malformed frame ended the connection: %s", exc)

    def _whole_frames(self, data: bytes) -> bytes:
        """Hand over the frames that lie whole in `data`; what is left of it."""
        view = memoryview(data)
        start = 0
        while len(data) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(data, start)
            end = start + HEADER.size + size
            if end > len(data):
                break
            self.on_frame(view[start + HEADER.size : end])
            start = end
        return data[start:] if start else data

    def _buffered_frames(self) -> None:
        buffer = self._buffer
        while len(buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer)
            end = HEADER.size + size
            if len(buffer) < end:
                return
            with memoryview(buffer) as view:
                body = bytes(view[HEADER.size : end])
            del buffer[:end]
            self.on_frame(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._buffer.clear()
        self.on_lost(exc)


def write_message(writer: asyncio.WriteTransport | asyncio.StreamWriter, message: Any) -> None:
    writer.writelines(frame(message))


# ----------------------------------------------------------------------------------------
# Blocking side (a worker process)
# ----------------------------------------------------------------------------------------


def recv_message(sock: socket.socket, inbox: shm.Inbox | None = None) -> Any | None:
    """The next message, or None when the HTTP process has gone."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    body = _recv_exactly(sock, size)
    if body is None:
        return None
    return unpack(body, inbox)


def send_message(sock: socket.socket, message: Any, outbox: shm.Outbox | None = None) -> None:
    """Send `message`; with `outbox` (and its channel), its large arrays through it."""
    if outbox is None:
        header, body = frame(message)
    else:
        header, body = prepare(message, outbox.channel).frame(outbox)
    if len(body) <= ONE_WRITE:
        # One write: the HTTP process's reader wakes once, not first for the header alone.
        sock.sendall(header + body)
    else:
        sock.sendall(header)
        sock.sendall(body)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buffer
