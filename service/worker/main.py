"""A worker process's life: the loop that reads requests from the pool's socket, hands
them to service/worker/compute.py and writes the replies (service/core/ipc.py frames).
Started by the local pool (service/pool/local.py) in a "spawn" child; nothing here runs
in the HTTP process."""

from __future__ import annotations

import gc
import os
import signal
import socket
from typing import Any

from service.core import ipc, shm


def worker_main(
    sock: socket.socket,
    index: int,
    device: str,
    options: dict[str, Any],
    cancel: Any = None,
    channel: shm.Channel | None = None,
) -> None:
    """A worker's life: load the engine for `device`, say hello, answer until told to
    stop or until the HTTP process goes away. `cancel` (a shared int) holds the id of a
    request the HTTP process wants stopped; `channel`, the pool's shared memory for large
    arrays (service/core/shm.py)."""
    # Signals sent to the server's process group (Ctrl-C, `timeout`, a supervisor) are the
    # HTTP process's to handle: it stops its workers itself. Signals sent to this process
    # (the pool's kill, multiprocessing's exit handler) still apply.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from engine import allocator
        from service.worker import compute, dispatch  # the engine loads here

        context = compute.start(index, device, options)
    except Exception as exc:  # noqa: BLE001 - any failure to start is reported, then exit
        ipc.send_message(sock, {"fatal": f"{type(exc).__name__}: {exc}"})
        return
    # The pool's shared memory: requests' large arrays come in through the HTTP process's
    # arena (inbox), replies' go out through this process's own (outbox).
    inbox = shm.Inbox(channel) if channel is not None else None
    outbox = shm.Outbox(channel, f"w{os.getpid()}") if channel is not None else None
    # The engine's and the modules' objects (made once, kept for the process's life) out
    # of the garbage collector's sight: a full collection would walk them all again every
    # few thousand requests (see service/api/app.py, _freeze_startup_objects).
    gc.collect()
    gc.freeze()
    ipc.send_message(sock, {"hello": context.describe()})
    try:
        while True:
            message = ipc.recv_message(sock, inbox)
            if message is None or message.get("kind") == "shutdown":
                return
            if ipc.UNREADABLE in message:  # its arrays could not be mapped here
                error = {
                    "type": "unavailable",
                    "message": "the worker could not read the "
                    f"request: {message[ipc.UNREADABLE]}; retry shortly",
                }
                ipc.send_message(sock, {"id": message["id"], "ok": False, "error": error})
                continue
            if message.get("kind") == ipc.HELD:
                # Reply arenas the HTTP process still reads arrays of: not for this reply.
                if outbox is not None:
                    outbox.held = set(message.get("payload") or ())
                continue
            reply = dispatch.answer(
                context,
                message,
                cancelled=_cancel_check(cancel, message),
                report=_reporter(sock, message),
            )
            del message  # with it the request's arrays, unless the engine keeps them
            held = inbox.held() if inbox is not None else None
            if held:
                reply["held"] = held  # kept (a tape): the HTTP process must not reuse them
            try:
                ipc.send_message(sock, reply, outbox)
            except (TypeError, ValueError, OverflowError) as exc:  # what msgpack cannot carry
                error = compute.internal_error(exc)
                ipc.send_message(
                    sock, {"id": reply.get("id"), "ok": False, "error": error, "held": held}
                )
            del reply
            if outbox is not None:
                outbox.held = set()  # the HTTP process's word was for that reply only
            # A request far above the usual size must not leave its peak resident (the
            # tuned allocator keeps freed memory): GRADTAPE_RELEASE_ABOVE_MB.
            allocator.release_if_above()
    finally:
        if outbox is not None:
            outbox.close()  # unlinks an arena the HTTP process never mapped


def _cancel_check(cancel: Any, message: dict[str, Any]) -> Any:
    """Whether the HTTP process asks to stop this request (its id in the cancel flag)."""
    if cancel is None:
        return None
    request_id = message.get("id")
    return lambda: cancel.value == request_id


def _reporter(sock: socket.socket, message: dict[str, Any]) -> Any:
    """Sends the request's progress reports, when it asked for them (inline: only a
    reply, the last message of a request, may use the arena)."""
    if not message.get("progress"):
        return None
    request_id = message.get("id")

    def report(progress: dict[str, Any]) -> None:
        ipc.send_message(sock, {"id": request_id, "progress": progress})

    return report
