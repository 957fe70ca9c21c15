"""Shared memory for the large arrays of worker messages (service/core/ipc.py).

An array of at least `threshold` bytes crosses between the HTTP process and a local
worker through an *arena*: a file of /dev/shm (POSIX shared memory) that its sender
keeps mapped and writes each message's large arrays into (one memcpy), while the frame on
the socket carries only the arena's name and where each array lies in it. The receiver
maps the arena once and hands out NumPy views of it, read-only and with no copy. Ray
actors, on any node, never use it (service/pool/ray.py).

Why arenas that are reused, not a fresh segment per message: filling fresh tmpfs pages
costs a page allocation and a fault per 4 KiB, which on this machine made a 4 MB
segment as slow as the socket pair (bench/bench_ipc.py); an arena's pages are allocated
once and stay mapped on both sides, so a message costs one copy into memory already
there. Why named files rather than memfd passed with SCM_RIGHTS: fd passing needs
recvmsg on the HTTP process's side, which asyncio's stream transports do not offer; the
names exist only for the moment between an arena's creation and its mapping by the
receiver, which unlinks it at once (so /dev/shm holds nothing of a running pool), and
sweeps (below) cover that moment.

An arena is written again only when none of the arrays the receiver was handed from it
is alive (a tape, a job's stored answer, a response still being written may keep one):
the receiver names the arenas it holds with its next message (`held`), and the sender
writes into another of its ARENAS, or a new one (the oldest then is left to the arrays
that hold it: the kernel frees it when the last of them goes). A strict alternation
makes the word timely: a worker writes a reply only after the request that the HTTP
process sent once it had read the previous reply (with the held names before it); the
HTTP process writes a worker's request arena only after that worker's reply to the
previous request (which carries them).

What is known to outlive its request is copied out of the arena instead (`detached`):
a tape's definition in the worker, a job's answer in the HTTP process. Held arenas are
for the rest (a response still being written, a reference cycle the collector has not
freed yet), so that an arena's memory is never pinned for long by a small array.

A message with more than MAX_ARENA bytes of large arrays gets a segment of its own
instead (name ending in `x`): written once, mapped and unlinked by the receiver, freed
by the kernel with the last array over it; its sender unlinks it again with its next
message, for a receiver that died before it mapped it.

Names: `<prefix>-a<worker index>-<n>` (an arena the HTTP process writes for a worker)
and `<prefix>-w<worker pid>-<n>` (one a worker writes), where the prefix is the pool's
own, `gradtape-<pid of the HTTP process>-<random>`. What could be left in /dev/shm, and
who removes it:
- a segment created but not yet mapped when its receiver died: the HTTP process unlinks
  its own when it replaces the worker; a dead worker's (`-w<pid>-`) are swept once the
  process is reaped; a pool that closes sweeps its whole prefix;
- everything of an HTTP process killed outright (SIGKILL, OOM): the next pool to start on
  the host sweeps every `gradtape-<pid>-` whose process is gone (never a live server's).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("gradtape.workers")

DIRECTORY = "/dev/shm"
FAMILY = "gradtape-"  # every segment of every gradtape pool starts with it
# Each array's offset in an arena: a cache line, so that the receiver's arrays start
# 64-byte aligned (the mapping itself is page aligned).
ALIGNMENT = 64
MIN_ARENA = 1 << 20
ARENAS = 2  # arenas per side and peer (Outbox)
# The largest arena: a message with more large-array bytes gets a segment of its own
# (written, mapped once, freed with its arrays), so that one huge request does not pin
# its size in /dev/shm for a worker's lifetime. Twice the 10^6 float32.
MAX_ARENA = 8 << 20
ONE_OFF = "x"  # the end of the name of a message's own segment
_NAME = re.compile(r"gradtape-[0-9]+-[0-9a-f]+-[aw][0-9]+-[0-9]+x?\Z")


def available() -> bool:
    """Whether this host has POSIX shared memory as a directory (Linux's tmpfs)."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK | os.X_OK)


@dataclass(frozen=True)
class Channel:
    """A pool's shared memory: the names it may open (under `prefix`) and which arrays go
    there (at least `threshold` bytes; 0: none)."""

    prefix: str
    threshold: int

    @classmethod
    def for_new_pool(cls, threshold: int) -> Channel:
        return cls(f"{FAMILY}{os.getpid()}-{secrets.token_hex(4)}", threshold)

    def takes(self, nbytes: int) -> bool:
        # An empty array has no bytes to map: always inline.
        return self.threshold > 0 and nbytes >= self.threshold and nbytes > 0

    def owns(self, name: str) -> bool:
        return name.startswith(self.prefix + "-") and _NAME.match(name) is not None

    def names(self, tag: str) -> Iterator[str]:
        """Fresh arena names `<prefix>-<tag>-<n>` (tag: `a<worker index>` or `w<pid>`)."""
        return (f"{self.prefix}-{tag}-{n}" for n in itertools.count())


class Outbox:
    """The arenas one side writes its large arrays into, for one peer; `tag` names them
    (`a<worker index>` for the HTTP process's, `w<pid>` for a worker's).

    It keeps the ARENAS most recently created and writes each message into one the peer
    does not hold (`held`: the names the peer said it holds, for the next message only),
    creating one when none is free: two, so that a reply can be written while the
    previous one is still being read (the HTTP process dispatches the next request to a
    worker the moment a reply has come, before the route has written the answer out).
    A message past MAX_ARENA gets a segment of its own instead."""

    def __init__(self, channel: Channel, tag: str):
        self.channel = channel
        self._names = channel.names(tag)
        self._arenas: list[tuple[str, mmap.mmap]] = []  # oldest first
        self._one_off: str | None = None  # the last message's own segment
        self.held: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._arenas]

    def write(self, pieces: Sequence[tuple[int, memoryview]], end: int) -> str:
        """Copy each (offset, bytes) into a free arena large enough (a new one if none
        is), or past MAX_ARENA into a segment of the message's own; its name. OSError
        (a full /dev/shm) when none can be made."""
        if self._one_off is not None:
            unlink(self._one_off)  # the previous message has been read, or never will be
            self._one_off = None
        held, self.held = self.held, set()  # the peer's word was for this message
        if end > MAX_ARENA:
            self._one_off = name = next(self._names) + ONE_OFF
            _write_file(name, pieces)
            return name
        arena = next((a for a in self._arenas if a[0] not in held and end <= a[1].size()), None)
        if arena is None:
            arena = self._create(max(MIN_ARENA, 1 << (end - 1).bit_length()))
        name, mapping = arena
        for offset, raw in pieces:
            mapping[offset : offset + len(raw)] = raw
        return name

    def _create(self, size: int) -> tuple[str, mmap.mmap]:
        name = next(self._names)
        fd = _create_file(name)
        try:
            # Every page allocated now: a full /dev/shm is an ENOSPC here, never a
            # SIGBUS in a reader later; MAP_POPULATE maps them all in one call.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError:
            unlink(name)
            raise
        finally:
            os.close(fd)
        self._arenas.append((name, mapping))
        if len(self._arenas) > ARENAS:
            # The oldest goes; the peer forgets it at the same moment (Inbox keeps the
            # arenas it saw last, in the order they were made), its arrays keep theirs.
            self._drop(*self._arenas.pop(0))
        return name, mapping

    def close(self) -> None:
        """Give every arena up (the receiver's arrays keep their own mappings)."""
        while self._arenas:
            self._drop(*self._arenas.pop())
        if self._one_off is not None:
            unlink(self._one_off)
            self._one_off = None
        self.held = set()

    @staticmethod
    def _drop(name: str, mapping: mmap.mmap) -> None:
        unlink(name)  # unless the receiver has already
        mapping.close()


class Inbox:
    """The peer's arenas as this side maps them (the ARENAS it saw last: those its peer
    still writes into), and the arrays handed out from each."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._arenas: dict[str, tuple[memoryview, list[weakref.ref[Any]]]] = {}
        # The last message's own segment, while arrays over it live (weakly: it is never
        # written again, so nothing here needs to keep it).
        self._one_off: tuple[str, weakref.ref[mmap.mmap]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._arenas)

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        """Bytes offset..offset+nbytes of segment `name` (mapped, and unlinked, the first
        time it is seen). ValueError/OSError when they are not there."""
        if not self.channel.owns(name):
            raise ValueError(f"{name!r} is no segment of this pool")
        if name.endswith(ONE_OFF):
            mapping = self._one_off[1]() if self._one_off and self._one_off[0] == name else None
            if mapping is None:
                mapping = _map(name)
                self._one_off = (name, weakref.ref(mapping))
            return _slice(memoryview(mapping), offset, nbytes)
        arena = self._arenas.get(name)
        if arena is None:
            arena = self._arenas[name] = (memoryview(_map(name)), [])
            while len(self._arenas) > ARENAS:
                # The sender has given it up; the arrays from it keep their mapping.
                del self._arenas[next(iter(self._arenas))]
        return _slice(arena[0], offset, nbytes)

    def handed(self, name: str, array: np.ndarray) -> None:
        """Track `array` (made from view(name, ...)): the arena is held while it, or any
        array viewing it, lives. NumPy keeps the memoryview it made at the root of the
        array's bases, which a weak reference watches."""
        if name not in self._arenas:
            return  # a message's own segment is never written again
        root: Any = array
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        self._arenas[name][1].append(weakref.ref(root))

    def held(self) -> list[str]:
        """The arenas an array handed out from is still alive (the sender must not
        write into them again)."""
        held = []
        for name, (_, handed) in self._arenas.items():
            handed[:] = [r for r in handed if r() is not None]
            if handed:
                held.append(name)
        return held


def _map(name: str) -> mmap.mmap:
    mapping = open_mapping(name)
    unlink(name)  # mapped on both sides now: the name has done its work
    return mapping


def _slice(view: memoryview, offset: int, nbytes: int) -> memoryview:
    if offset + nbytes > len(view):
        raise ValueError(f"bytes {offset}..{offset + nbytes} lie past the segment's {len(view)}")
    return view[offset : offset + nbytes]


def _create_file(name: str) -> int:
    return os.open(
        path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )


def _write_file(name: str, pieces: Sequence[tuple[int, memoryview]]) -> None:
    """A message's own segment: written, not mapped, so the kernel fills the pages (a
    full /dev/shm is an ENOSPC here); the gaps between arrays (< ALIGNMENT) share pages
    with them, so every page of the file is allocated before anyone maps it."""
    fd = _create_file(name)
    try:
        for offset, raw in pieces:
            done = 0
            while done < len(raw):
                done += os.pwrite(fd, raw[done:], offset + done)
    except OSError:
        unlink(name)
        raise
    finally:
        os.close(fd)


def detached(tree: Any) -> Any:
    """`tree` (dicts, lists) with every array that views a shared-memory mapping replaced
    by a copy of its own: for what a worker keeps past its request (a tape), which would
    otherwise pin the whole arena it came in (up to MAX_ARENA, and take it out of reuse)
    for as long as it lives, bytes that no memory budget counts."""
    if isinstance(tree, np.ndarray):
        root: Any = tree
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        if isinstance(root, memoryview) and isinstance(root.obj, mmap.mmap):
            copy = np.array(tree)
            copy.flags.writeable = False  # as the view was
            return copy
        return tree
    if isinstance(tree, dict):
        return {k: detached(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [detached(v) for v in tree]
    return tree


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def path_of(name: str) -> str:
    return os.path.join(DIRECTORY, name)


def open_mapping(name: str) -> mmap.mmap:
    """Map arena `name` read-only (the caller unlinks it once it has it)."""
    fd = os.open(path_of(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        # ACCESS_READ: the mapping's buffer is read-only, so the arrays over it are too.
        # (Mapped once per arena: its pages fault in on the first message only.)
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the mapping keeps the memory; no descriptor is held


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path_of(name))


def sweep(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix`; how many there were."""
    count = 0
    for name in _names():
        if name.startswith(prefix):
            unlink(name)
            count += 1
    return count


def sweep_orphans() -> int:
    """Unlink the segments of pools whose HTTP process is gone (killed before it could
    clean up); those of live processes, this one's included, stay."""
    count = 0
    for name in _names():
        if not name.startswith(FAMILY):
            continue
        pid = name[len(FAMILY) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            unlink(name)
            count += 1
    if count:
        log.warning(
            "removed %d shared-memory segment(s) of gradtape processes that are gone", count
        )
    return count


def _names() -> list[str]:
    try:
        return os.listdir(DIRECTORY)
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True
