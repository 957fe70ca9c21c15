"""Headless Chromium driven over the Chrome DevTools Protocol through a pipe
(`--remote-debugging-pipe`: the browser reads commands on fd 3 and writes answers and
events on fd 4, NUL-separated JSON, as Playwright drives it). Standard library only: no
websocket, no port, nothing to download; the browser is Debian's `chromium` package.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Headless, no sandbox (root in CI), and nothing fetched from outside at start.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
]


class BrowserError(RuntimeError):
    pass


def _above_4(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """One Chromium process and one page in it (flattened session)."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 1500):
        if CHROMIUM is None:
            raise BrowserError("chromium is not installed")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser's ends moved above 4, so that putting them on 3 and 4 cannot
        # overwrite one with the other.
        to_browser_r, from_browser_w = (_above_4(fd) for fd in (to_browser_r, from_browser_w))
        # bash puts the two pipe ends on fds 3 and 4 of the browser it execs.
        self.process = subprocess.Popen(
            [
                "bash",  # dash reads one-digit fds only in redirections
                "-c",
                f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}',
                "bash",
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_browser, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._changed:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self.events.append(message)
                self._changed.notify_all()
        with self._changed:  # the browser is gone: wake every waiter
            self._changed.notify_all()

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """A command; its result (a BrowserError with the browser's message on error)."""
        self._next_id += 1
        ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        with self._changed:
            while ident not in self._answers:
                if not self._reader.is_alive():
                    raise BrowserError(f"chromium exited during {method}")
                self._changed.wait(1.0)
            answer = self._answers.pop(ident)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page."""
        return self.call(method, self.session, **params)

    def goto(self, url: str, timeout: float = 60.0) -> None:
        seen = len(self.events)
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired", after=seen, timeout=timeout)

    def wait_event(self, method: str, after: int = 0, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events[after:]:
                    if event.get("method") == method:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise BrowserError(f"no {method} within {timeout} s")
                self._changed.wait(left)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120.0, poll: float = 0.05) -> Any:
        """Wait until the expression is truthy in the page; its value. The timeout only
        stops a hang: the page's own events decide when it is met."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(poll)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def problems(self, since: int = 0) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (CSP violations
        among them) seen since the `since`-th event."""
        found = []
        for event in list(self.events)[since:]:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(json.dumps(params.get("args"))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", "")[:500])
        return found

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except BrowserError:
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@contextmanager
def browser(profile: Path, **size: int) -> Iterator[Browser]:
    b = Browser(profile, **size)
    try:
        yield b
    finally:
        b.close()
