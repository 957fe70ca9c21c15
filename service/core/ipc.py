"""Messages between the HTTP process and the engine workers.

A message is one msgpack document behind a 4-byte big-endian length. NumPy arrays
travel as a msgpack extension type (code ARRAY_EXT: the lengths of a msgpack header
`[dtype, shape]` and of what precedes the raw bytes, the header, zero padding, then the
raw bytes at a multiple of 16 bytes into the extension's data; dtype names and bytes as
service/core/wire.py writes and checks them), out of band: no client string, whatever
key or value it is, can be taken for an array or any other protocol element. Client
data is never pickled. Both sides use this module: the asyncio side reads
and writes frames on stream objects, a worker on a blocking socket.

Requests: {"id": int, "kind": str, "payload": ...} (kind "shutdown": exit).
Replies: {"id": int, "ok": true, "result": ..., "seconds": float}
      or {"id": int, "ok": false, "error": {"type": str, "message": str, ...}}.
A worker that has started says {"hello": {...}}, or {"fatal": message} and exits.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack
import numpy as np

from service.core import wire

HEADER = struct.Struct("!I")
MAX_FRAME = 2**32 - 1
ARRAY_EXT = 1  # the msgpack extension type code of a NumPy array
# The length of the array's [dtype, shape] header, and the offset of its raw bytes.
_ARRAY_PREFIX = struct.Struct("!HH")
# The raw bytes' offset in the extension's data: the receiver's array then starts 16-byte
# aligned (msgpack hands the data over as a bytes object, whose buffer is 16-byte aligned
# in CPython), as SIMD loops want it; at 2 mod 8, as it was, elementwise math is slower.
ALIGNMENT = 16


class FrameError(ConnectionError):
    """The other side closed the connection or sent something that is not a frame."""


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        dtype, shape, raw = wire.raw_view(obj)  # no copy of a contiguous little-endian array
        header = msgpack.packb([dtype, shape])
        used = _ARRAY_PREFIX.size + len(header)
        start = -(-used // ALIGNMENT) * ALIGNMENT
        return msgpack.ExtType(ARRAY_EXT, b"".join(
            (_ARRAY_PREFIX.pack(len(header), start), header, bytes(start - used), raw)))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to or from a worker")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        raise FrameError(f"unknown msgpack extension type {code} in a worker message")
    try:
        size, start = _ARRAY_PREFIX.unpack_from(data)
        if start < _ARRAY_PREFIX.size + size:
            raise ValueError(f"its raw bytes start at {start}, inside its header")
        dtype, shape = msgpack.unpackb(data[_ARRAY_PREFIX.size:_ARRAY_PREFIX.size + size])
        # Read-only (a view of msgpack's bytes, no copy): no receiver writes into them.
        return wire.from_bytes(memoryview(data)[start:], dtype, shape)
    except (struct.error, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"a malformed array in a worker message: {exc}") from None


def pack(message: Any) -> bytes:
    packed: bytes = msgpack.packb(message, default=_default, use_bin_type=True)
    return packed


def unpack(body: bytes | bytearray) -> Any:
    return msgpack.unpackb(body, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def frame(message: Any) -> tuple[bytes, bytes]:
    body = pack(message)
    if len(body) > MAX_FRAME:
        raise ValueError(f"message of {len(body)} bytes is too large for one frame")
    return HEADER.pack(len(body)), body


# ----------------------------------------------------------------------------------------
# asyncio side (the HTTP process)
# ----------------------------------------------------------------------------------------


async def read_message(reader: asyncio.StreamReader) -> Any:
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("the worker closed its connection") from exc
    return unpack(body)


def write_message(writer: asyncio.StreamWriter, message: Any) -> None:
    writer.writelines(frame(message))


# ----------------------------------------------------------------------------------------
# Blocking side (a worker process)
# ----------------------------------------------------------------------------------------


def recv_message(sock: socket.socket) -> Any | None:
    """The next message, or None when the HTTP process has gone."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    body = _recv_exactly(sock, size)
    if body is None:
        return None
    return unpack(body)


def send_message(sock: socket.socket, message: Any) -> None:
    header, body = frame(message)
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
