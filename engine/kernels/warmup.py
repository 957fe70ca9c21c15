"""Warm-up: every compiled kernel's declared signatures compiled, or loaded from numba's
disk cache, ahead of use, so that no request pays a compilation (0.2-1.1 s each, ~7 s
of CPU for all of them with an empty cache).

    report = warm()           # compile what the cache lacks, load the rest: a Report
    report = warm(compile=False)  # load only: what the cache lacks stays missing
    python -m engine.kernels.warmup [--json] [--if-cached]   # warm() in a process of its own
    gradtape kernels warm     # the same, the service's command line (the Docker build)

Each kernel module declares the argument types of its call sites (`Kernel.declare`,
engine/kernels/__init__.py); warm() imports every module of this package, so a new one
is warmed without being listed here. A warmed kernel answers only its declared
signatures (numba's compilation off): a call with other types compiles once, logs a
warning naming them, and is a declaration to add.

A service worker (service/worker/compute.start, setting `worker_warm_kernels`) starts
`start_in_background()` before it says hello: its readiness waits for nothing.
compiled() answers None (the NumPy path) for a kernel not yet warmed
(kernels.hold_until_warm), and a thread of the worker:

1. loads what the cache holds, in the worker (~0.4 s of CPU, most of it numba's import
   and its first load; a few milliseconds a signature after that);
2. when the cache lacks some and numba's cache is usable, compiles them in a process of
   its own (`python -m engine.kernels.warmup`, its own session): a compilation holds the
   GIL (a request beside it in the worker would run at a fraction of its speed), and a
   worker the pool kills for a request's time limit does not take the compilation with
   it: the process finishes, the cache keeps each signature as it is compiled, and the
   next worker loads them. One such process compiles at a time (a lock file in the
   temporary directory): the others then load what it wrote;
3. loads again; what is still missing (no writable cache directory: numba compiles in
   memory only) is compiled in the worker's thread, beside its requests.

status() says where it stands (the worker's `ping` answers it), and the worker logs the
report once done.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import pkgutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine import kernels

log = logging.getLogger("gradtape.kernels")

# The most a worker waits for the compiling process (~7 s of CPU; a loaded machine may
# stretch it several times): past it, the worker compiles what is missing itself.
COMPILE_PROCESS_TIMEOUT = 900.0


@dataclass
class Signature:
    """One declared signature and what warm-up did with it."""

    kernel: str
    types: str  # numba's spelling of the argument types
    source: str  # "ready" (already in the process), "loaded", "compiled" or "missing"
    seconds: float


@dataclass
class Report:
    """What warm() did: every declared signature, where it came from, how long it took."""

    enabled: bool  # kernels run (numba imports and GRADTAPE_KERNELS does not switch them off)
    cache: bool = False  # numba's disk cache is in use (a writable cache directory)
    cache_dir: str | None = None
    seconds: float = 0.0
    signatures: list[Signature] = field(default_factory=list)

    def count(self, source: str) -> int:
        return sum(s.source == source for s in self.signatures)

    @property
    def missing(self) -> int:
        return self.count("missing")

    def summary(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "cache": self.cache,
            "cache_dir": self.cache_dir,
            "seconds": round(self.seconds, 3),
            "signatures": len(self.signatures),
            **{s: self.count(s) for s in ("ready", "loaded", "compiled", "missing")},
        }

    def describe(self) -> str:
        if not self.enabled:
            return "kernels off (numba absent or GRADTAPE_KERNELS): nothing to warm"
        where = f"cache {self.cache_dir}" if self.cache else "no disk cache"
        return (
            f"{len(self.signatures)} kernel signatures in {self.seconds:.2f} s: "
            f"{self.count('loaded')} loaded from the cache, {self.count('compiled')} "
            f"compiled, {self.count('ready')} already loaded, {self.missing} missing ({where})"
        )


def declared() -> list[kernels.Kernel]:
    """Every kernel of this package (each module imported, so each has declared itself)."""
    for module in pkgutil.iter_modules(kernels.__path__):
        if module.name != "warmup":
            importlib.import_module(f"{kernels.__name__}.{module.name}")
    return list(kernels.DECLARED)


class _NotCached(Exception):
    """Raised by the listener below to stop a compilation that load-only warm-up began."""


def _load_only(numba: Any) -> Any:
    """A context in which this thread's compilations stop before they start: numba's
    Dispatcher.compile loads from its disk cache first and signals "numba:compile" only
    when that missed (numba's event API), so compile() then loads or raises _NotCached."""
    thread = threading.get_ident()

    class Refuse(numba.core.event.Listener):
        def on_start(self, event: Any) -> None:
            if threading.get_ident() == thread:
                raise _NotCached

        def on_end(self, event: Any) -> None:
            pass

    return numba.core.event.install_listener("numba:compile", Refuse())


def warm(compile: bool = True, require_cache: bool = False) -> Report:
    """Compile, or load from numba's disk cache, every declared signature of every
    kernel; a warmed kernel then answers only those (see the module's text). With
    compile=False only loads (what the cache lacks is reported missing); with
    require_cache=True compiles nothing when numba has no disk cache (what it compiled
    would die with this process). Nothing when kernels do not run."""
    numba = kernels.numba_module()
    if numba is None:
        return Report(enabled=False)
    importlib.import_module("numba.core.event")  # the event API _load_only uses

    started = time.perf_counter()
    report = Report(enabled=True)
    every = declared()
    for k in every:
        paths = k.make_dispatcher().stats.cache_path
        if paths is not None:
            report.cache, report.cache_dir = True, str(paths)
    allowed = compile and (report.cache or not require_cache)
    for k in every:
        # (one kernel at a time against a request readying its module on demand,
        # kernels._ready_now: numba refuses compile() once compilation is off, even
        # for a signature it holds)
        with kernels._readying:
            dispatcher = k.make_dispatcher()
            done = True
            for declared_args in k.signatures:
                sig = kernels.numba_signature(numba, declared_args)
                spelled = ", ".join(str(t) for t in sig)
                t0 = time.perf_counter()
                if sig in dispatcher.overloads:
                    source = "ready"
                else:
                    hits = dispatcher.stats.cache_hits.get(sig, 0)
                    try:
                        if allowed:
                            dispatcher.compile(sig)
                        else:
                            with _load_only(numba):
                                dispatcher.compile(sig)
                    except _NotCached:
                        source = "missing"
                    else:
                        loaded = dispatcher.stats.cache_hits.get(sig, 0) > hits
                        source = "loaded" if loaded else "compiled"
                done = done and source != "missing"
                report.signatures.append(
                    Signature(k.__name__, spelled, source, time.perf_counter() - t0)
                )
            if done:
                k.mark_warmed()
    # Released a module at a time, once all its kernels are warm (a caller may use two).
    modules: dict[str, list[kernels.Kernel]] = {}
    for k in every:
        modules.setdefault(k.py_func.__module__, []).append(k)
    kernels.release(k for group in modules.values() if all(k.warmed for k in group) for k in group)
    report.seconds = time.perf_counter() - started
    return report


# ---- one compiling process at a time ----


def _lock_path() -> Path:
    """The lock file of the processes compiling this installation's kernels."""
    key = hashlib.sha256(f"{os.getuid()} {kernels.__file__}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gradtape-kernels-{key}.lock"


@contextlib.contextmanager
def _compiling_alone() -> Any:
    """Held while this process compiles: another waits, then loads what this one wrote.
    Released by the system when the process dies."""
    try:
        handle = open(_lock_path(), "a")  # held for the whole block
    except OSError:
        yield  # no lock to be had: compile anyway (a duplicate compilation, not an error)
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def warm_alone(require_cache: bool = False) -> Report:
    """warm(), one such process at a time (the command line's and the workers' process).
    The lock is taken before numba is imported: the processes of several workers that
    found a cold cache wait at ~10 MiB each, not ~110 MiB with numba loaded."""
    if kernels._switched_off():
        return Report(enabled=False)
    with _compiling_alone():
        return warm(compile=True, require_cache=require_cache)


# ---- a worker's warm-up: in the background, compilations in a process of their own ----

_status: dict[str, Any] = {"state": "idle"}
_done = threading.Event()


def status() -> dict[str, Any]:
    """Where this process's background warm-up stands: "state" ("idle": never started,
    "warming", "ready", "off": kernels do not run, "failed"), the kernels "warmed" so
    far, the pid of the compiling process while one runs; once ended, the declared
    "signatures", how many were "loaded" from the cache, "compiled" in this process and
    are "missing", the compiling process's own report ("process", or None: none was
    needed) and the "seconds" it all took."""
    warmed = [k.__name__ for k in kernels.DECLARED if k.warmed]
    return {**_status, "warmed": warmed}


def state() -> str:
    """status()'s "state" alone, for a worker's every answer (service/worker/dispatch.py):
    a dictionary lookup, where status() lists the kernels warmed."""
    return str(_status["state"])


def wait(timeout: float | None = None) -> dict[str, Any]:
    """status() once the background warm-up has ended (or `timeout` seconds passed); at
    once where none was started."""
    if _status["state"] != "idle":
        _done.wait(timeout)
    return status()


def start_in_background() -> None:
    """Hold the kernels until warm (kernels.hold_until_warm) and warm them in a thread of
    this process (see the module's text); returns at once."""
    if kernels._switched_off():  # (numba itself is imported by the thread)
        _status.update(state="off")
        _done.set()
        return
    kernels.hold_until_warm()
    _status.update(state="warming")
    threading.Thread(target=_warm_in_background, name="gradtape-kernel-warmup", daemon=True).start()


def _warm_in_background() -> None:
    started = time.perf_counter()
    process = None
    try:
        report = warm(compile=False)
        if report.enabled and report.missing and report.cache:
            process = _compile_in_a_process()
            report = warm(compile=False)
        if report.enabled and report.missing:
            # No disk cache (or the process failed): compiled here, beside the requests.
            report = warm(compile=True)
    except Exception as exc:  # noqa: BLE001 - kernels stay off (NumPy paths); say why
        log.warning("kernel warm-up failed, the NumPy paths run: %s: %s", type(exc).__name__, exc)
        _status.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        kernels.settle()
        _done.set()
        return
    _status.update(
        state="ready" if report.enabled else "off",
        signatures=len(report.signatures),
        loaded=report.count("ready") + report.count("loaded"),  # (ready: an earlier pass's)
        compiled=report.count("compiled"),
        missing=report.missing,
        cache_dir=report.cache_dir,
        process=process,
        seconds=round(time.perf_counter() - started, 3),
    )
    if report.enabled:
        log.info("kernels warm: %s", report.describe())
    kernels.settle()
    _done.set()


def _compile_in_a_process() -> dict[str, Any] | None:
    """`python -m engine.kernels.warmup --if-cached` in a session of its own (the pool's
    kill of this worker does not reach it), with this package importable; its report's
    summary (None when it failed)."""
    root = str(Path(kernels.__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.kernels.warmup", "--if-cached", "--json"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _status["compiler_pid"] = process.pid
    try:
        out, err = process.communicate(timeout=COMPILE_PROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    finally:
        _status.pop("compiler_pid", None)
    if process.returncode != 0:
        log.warning("the kernels' compiling process failed: %s", err.strip()[-2000:])
        return None
    summary: dict[str, Any] = json.loads(out)
    summary.pop("each", None)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.kernels.warmup",
        description="compile every compiled kernel's declared signatures into numba's "
        "disk cache (NUMBA_CACHE_DIR), loading those it already holds",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--if-cached",
        action="store_true",
        help="compile nothing when numba has no writable cache directory (else: compile, "
        "and exit with 1: nothing was kept)",
    )
    args = parser.parse_args(argv)
    report = warm_alone(require_cache=args.if_cached)
    if args.json:
        print(json.dumps({**report.summary(), "each": [asdict(s) for s in report.signatures]}))
    else:
        print(f"kernels warm: {report.describe()}")
    if report.enabled and not report.cache and not args.if_cached:
        print(
            "kernels warm: numba has no writable cache directory, so nothing was kept: set "
            "NUMBA_CACHE_DIR to one",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
