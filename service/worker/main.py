"""A worker process's life: the loop that reads requests from the pool's socket, hands
them to service/worker/compute.py and writes the replies (service/core/ipc.py frames).
Started by the local pool (service/pool/local.py) in a "spawn" child; nothing here runs
in the HTTP process."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

from service.core import ipc


def worker_main(sock: socket.socket, index: int, device: str, options: dict[str, Any],
                cancel: Any = None) -> None:
    """A worker's life: load the engine for `device`, say hello, answer until told to
    stop or until the HTTP process goes away. `cancel` (a shared int) holds the id of a
    request the HTTP process wants stopped."""
    # Signals sent to the server's process group (Ctrl-C, `timeout`, a supervisor) are the
    # HTTP process's to handle: it stops its workers itself. Signals sent to this process
    # (the pool's kill, multiprocessing's exit handler) still apply.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from service.worker import compute, dispatch  # the engine loads here

        context = compute.start(index, device, options)
    except Exception as exc:  # noqa: BLE001 - any failure to start is reported, then exit
        ipc.send_message(sock, {"fatal": f"{type(exc).__name__}: {exc}"})
        return
    ipc.send_message(sock, {"hello": context.describe()})
    while True:
        message = ipc.recv_message(sock)
        if message is None or message.get("kind") == "shutdown":
            return
        reply = dispatch.answer(context, message, cancelled=_cancel_check(cancel, message),
                               report=_reporter(sock, message))
        try:
            ipc.send_message(sock, reply)
        except (TypeError, ValueError, OverflowError) as exc:  # a result msgpack cannot carry
            error = compute.internal_error(exc)
            ipc.send_message(sock, {"id": message.get("id"), "ok": False, "error": error})


def _cancel_check(cancel: Any, message: dict[str, Any]) -> Any:
    """Whether the HTTP process asks to stop this request (its id in the cancel flag)."""
    if cancel is None:
        return None
    request_id = message.get("id")
    return lambda: cancel.value == request_id


def _reporter(sock: socket.socket, message: dict[str, Any]) -> Any:
    """Sends the request's progress reports, when it asked for them."""
    if not message.get("progress"):
        return None
    request_id = message.get("id")

    def report(progress: dict[str, Any]) -> None:
        ipc.send_message(sock, {"id": request_id, "progress": progress})

    return report
