"""Where the HTTP process spends a small request: the app driven in-process over ASGI.

Builds the real app (`create_app`, one real worker process), runs its lifespan, and sends
it the requests of bench_request.py straight through ASGI (no sockets, no uvicorn: what
is left is the app's own cost, the part a trivial endpoint does not pay, plus the
worker's round trip). Prints the median time per request in the app and the CPU time
the event loop's thread spent on it (the HTTP process's own cost), and with
`--breakdown`, the median time of each stage (timers wrapped around the functions that
do it: one request runs at a time, so an async stage's wall time is its own, plus the
worker's for the pool's), or with `--profile`, cProfile's table of the functions where
the time goes (cProfile inflates many small calls; read the ranking, not the figures).

With `--worker`, the worker's side instead: the messages the rows' requests sent to the
worker are captured, then answered in this process by the worker's own code
(`service.worker.dispatch.answer`, after the same IPC pack and unpack, a context from
`compute.start` with the app's worker options), timed (median ms per message) or, with
`--profile`, under cProfile.

    env -u OPENBLAS_CORETYPE .venv/bin/python -m bench.profile_request
        [--rows gradient-json,hvp-msgpack] [--requests 1000] [--breakdown | --profile]
        [--worker] [--callers PATTERN]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import inspect
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastapi.routing
import msgpack
import orjson

from bench._floor_app import app as floor
from bench.bench_request import MSGPACK, SCENARIO_15, small_mlp
from service.api import bodies, negotiation
from service.api.app import create_app
from service.api.routes.derivatives import DERIVATIVES
from service.api.routes.tapes import TAPE_OPERATIONS
from service.core import ipc
from service.core.config import Settings
from service.pool.local import WorkerPool

# Stage name -> seconds spent in it during the current request.
_spent: dict[str, float] = defaultdict(float)
# What the stage timers read: wall time, or with --cpu the event loop thread's CPU time
# (less sensitive to other processes; an async stage's then counts this process's work
# for it, not the worker's).
_clock = time.perf_counter


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t = _clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                _spent[name] += _clock() - t

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name] += _clock() - t

    return timed


def install_timers() -> None:
    """Timers around each stage of a compute request (see STAGES)."""
    bodies.read_bounded = _timed("read and parse the body", bodies.read_bounded)
    fastapi.routing.solve_dependencies = _timed(
        "dependencies and body validation", fastapi.routing.solve_dependencies
    )
    for op in (*DERIVATIVES, *TAPE_OPERATIONS):
        object.__setattr__(op, "build", _timed("payload: wire tensors -> arrays", op.build))
    WorkerPool.submit = _timed("pool.submit (worker and IPC)", WorkerPool.submit)  # type: ignore[method-assign]
    ipc.prepare = _timed("  IPC pack (in pool.submit)", ipc.prepare)
    ipc.unpack = _timed("  IPC unpack (in pool.submit)", ipc.unpack)
    negotiation.answer = _timed("answer: arrays -> response", negotiation.answer)
    from service.api.routes import _compute

    _compute.answer = negotiation.answer


def scope(method: str, path: str, content_type: str, length: int) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", content_type.encode()),
            (b"accept", content_type.encode()),
            (b"content-length", str(length).encode()),
        ],
    }


async def call(app: Any, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    sent = False
    status, chunks = 0, []
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            for key, value in message.get("headers", []):
                if key == b"server-timing" and value.startswith(b"compute;dur="):
                    dur = float(value.split(b";")[1].split(b"=")[1])
                    _spent["  worker compute (its Server-Timing)"] += dur / 1e3
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope("POST", path, content_type, len(body)), receive, send)
    gone.set()
    return status, b"".join(chunks)


# The worker messages of the current row's requests (--worker): (kind, payload, limit).
_captured: list[tuple[str, Any, float | None]] = []


def install_capture() -> None:
    submit = WorkerPool.submit

    async def capturing(self: WorkerPool, kind: str, payload: Any, **options: Any) -> Any:
        _captured.append((kind, payload, options.get("time_limit")))
        return await submit(self, kind, payload, **options)

    WorkerPool.submit = capturing  # type: ignore[method-assign]


def run_worker_side(
    args: argparse.Namespace,
    settings: Settings,
    create: tuple[str, Any, float | None],
    messages: dict[str, tuple[str, Any, float | None]],
) -> None:
    """Answer each row's captured message with the worker's own code, in this process."""
    from service.worker import compute, dispatch

    options = {**settings.worker_options(), "empty_working_directory": False}
    context = compute.start(0, "cpu", options)

    def message(captured: tuple[str, Any, float | None], number: int) -> Any:
        kind, payload, limit = captured
        sent = {"id": number, "kind": kind, "payload": payload, "time_limit": limit}
        return ipc.unpack(ipc.pack(sent))  # as the worker reads it (small: no arena)

    reply = dispatch.answer(context, message(create, 0))
    assert reply["ok"], reply
    names = list(messages)
    for name in names * 50:  # warm-up (the compiled passes are captured here)
        assert dispatch.answer(context, message(messages[name], 1))["ok"]
    profile = cProfile.Profile() if args.profile else None
    times: dict[str, list[float]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for number in range(args.requests):
        for name in names:
            sent = message(messages[name], number)
            if profile:
                profile.enable()
            t = time.perf_counter()
            reply = dispatch.answer(context, sent)
            times[name].append(time.perf_counter() - t)
            if profile:
                profile.disable()
            seconds[name].append(reply["seconds"])
    for name in names:
        print(
            f"{name} in the worker: median {statistics.median(times[name]) * 1e3:.3f} ms "
            f"(its Server-Timing {statistics.median(seconds[name]) * 1e3:.3f} ms)"
        )
    if profile:
        stats = pstats.Stats(profile)
        stats.sort_stats(args.sort).print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)


async def run(args: argparse.Namespace) -> None:
    data_dir = tempfile.mkdtemp(prefix="gradtape-profile-request-")
    settings = Settings(workers=1, data_dir=Path(data_dir), log_level="warning", access_log=False)
    app = create_app(settings)
    mlp_json, vector_json = small_mlp(binary=False)
    mlp_msgpack, vector_msgpack = small_mlp(binary=True)
    async with app.router.lifespan_context(app):
        status, created = await call(app, "/v1/tapes", orjson.dumps(mlp_json), "application/json")
        assert status == 201, created
        tape = orjson.loads(created)["tape_id"]
        create = _captured[-1] if _captured else ("", None, None)
        rows = {
            # the floor app (bench/_floor_app.py) given the same bodies, in-process too
            "floor-s15": ("/trivial", orjson.dumps(SCENARIO_15), "application/json", floor),
            "floor-json": ("/trivial", orjson.dumps(mlp_json), "application/json", floor),
            "floor-msgpack": ("/trivial", msgpack.packb(mlp_msgpack), MSGPACK, floor),
            "gradient-s15": ("/v1/gradient", orjson.dumps(SCENARIO_15), "application/json"),
            "gradient-json": ("/v1/gradient", orjson.dumps(mlp_json), "application/json"),
            "gradient-msgpack": ("/v1/gradient", msgpack.packb(mlp_msgpack), MSGPACK),
            "hvp-json": (
                f"/v1/tapes/{tape}/hvp",
                orjson.dumps({"vector": vector_json}),
                "application/json",
            ),
            "hvp-msgpack": (
                f"/v1/tapes/{tape}/hvp",
                msgpack.packb({"vector": vector_msgpack}),
                MSGPACK,
            ),
        }
        names = args.rows.split(",")
        chosen = [(name, *rows[name], app)[:5] for name in names]
        for _, path, body, kind, target in chosen * 50:  # warm-up
            status, answer = await call(target, path, body, kind)
            assert status == 200, answer
        if args.worker:
            captured = {}
            for name, path, body, kind, target in chosen:
                if target is app:
                    _captured.clear()
                    await call(target, path, body, kind)
                    (captured[name],) = _captured
            run_worker_side(args, settings, create, captured)
            return
        _spent.clear()
        profile = cProfile.Profile() if args.profile else None
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        stages: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in names}
        turns = _count_turns() if args.turns else None
        if profile:
            profile.enable()
        for _ in range(args.requests):
            for name, path, body, kind, target in chosen:
                c, t = time.thread_time(), time.perf_counter()
                if turns is not None:
                    turns[0] = 0
                await call(target, path, body, kind)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
                if turns is not None:
                    stages[name]["event-loop turns (count)"].append(turns[0])
                for stage, seconds in _spent.items():
                    stages[name][stage].append(seconds)
                _spent.clear()
        if profile:
            profile.disable()
        if args.breakdown:
            print_breakdown(stages, times, names, cpu)
        for name in names:
            print(
                f"{name}: median {statistics.median(times[name]) * 1e3:.3f} ms in the app, "
                f"{statistics.median(cpu[name]) * 1e3:.3f} ms CPU of the event loop's thread "
                f"(its 10th percentile {_p10(cpu[name]) * 1e3:.3f} ms: less sensitive to "
                "other processes)"
            )
        if profile:
            stats = pstats.Stats(profile)
            if args.dump:
                stats.dump_stats(args.dump)
            stats.sort_stats(args.sort).print_stats(args.top)
            if args.callers:  # who calls the functions matching this pattern, and how often
                stats.print_callers(args.callers)


def _count_turns() -> list[int]:
    """Counts the running loop's iterations (each select() and the callbacks it makes
    ready: a task step, an I/O callback, a timer) in the list's one item."""
    loop = asyncio.get_running_loop()
    turns = [0]
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counting() -> None:
        turns[0] += 1
        run_once()

    loop._run_once = counting  # type: ignore[attr-defined]
    return turns


def _p10(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 10]


def print_breakdown(
    stages: dict[str, dict[str, list[float]]],
    times: dict[str, list[float]],
    names: list[str],
    cpu: dict[str, list[float]],
) -> None:
    order = list(dict.fromkeys(stage for name in names for stage in stages[name]))
    print("| stage | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for stage in order:
        scale, digits = (1, 0) if stage.endswith("(count)") else (1e3, 3)
        cells = [
            f"{statistics.median(stages[n][stage]) * scale:.{digits}f}" if stages[n][stage] else ""
            for n in names
        ]
        print(f"| {stage} | " + " | ".join(cells) + " |")
    print(
        "| whole request in the app | "
        + " | ".join(f"{statistics.median(times[n]) * 1e3:.3f}" for n in names)
        + " |"
    )
    print(
        "| CPU of the event loop's thread | "
        + " | ".join(f"{statistics.median(cpu[n]) * 1e3:.3f}" for n in names)
        + " |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        default="gradient-json,hvp-json",
        help="floor-s15, floor-json, floor-msgpack, gradient-s15, gradient-json, "
        "gradient-msgpack, hvp-json, hvp-msgpack (comma-separated)",
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--dump", help="with --profile: write cProfile's stats to this file")
    parser.add_argument("--worker", action="store_true", help="the worker's side (see above)")
    parser.add_argument(
        "--turns", action="store_true", help="with --breakdown: the event loop's turns too"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="with --breakdown: stages in CPU time, not wall"
    )
    parser.add_argument("--callers", help="with --profile: print the callers of these functions")
    args = parser.parse_args()
    if args.breakdown:
        install_timers()
    if args.cpu:
        global _clock
        _clock = time.thread_time
    if args.worker:
        install_capture()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
