"""Where the HTTP process spends a small request: the app driven in-process over ASGI.

Builds the real app (`create_app`, one real worker process), runs its lifespan, and sends
it the requests of bench_request.py straight through ASGI (no sockets, no uvicorn: what
is left is the app's own cost, the part a trivial endpoint does not pay, plus the
worker's round trip). Prints the median time per request in the app and the CPU time
the event loop's thread spent on it (the HTTP process's own cost), and with
`--profile`, cProfile's table of the functions where that time goes (cProfile inflates
many small calls; read the ranking, not the absolute figures).

    env -u OPENBLAS_CORETYPE .venv/bin/python bench/profile_request.py [--rows gradient-json]
        [--requests 2000] [--profile] [--sort tottime]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import tempfile
import time
from typing import Any

import msgpack
import orjson

from bench.bench_request import MSGPACK, SCENARIO_15, small_mlp
from service.api.app import create_app
from service.core.config import Settings


def scope(method: str, path: str, content_type: str, length: int) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", content_type.encode()),
                    (b"accept", content_type.encode()),
                    (b"content-length", str(length).encode())],
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
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope("POST", path, content_type, len(body)), receive, send)
    gone.set()
    return status, b"".join(chunks)


async def run(args: argparse.Namespace) -> None:
    data_dir = tempfile.mkdtemp(prefix="gradtape-profile-request-")
    app = create_app(Settings(workers=1, data_dir=data_dir, log_level="warning",
                              access_log=False))
    mlp_json, vector_json = small_mlp(binary=False)
    mlp_msgpack, vector_msgpack = small_mlp(binary=True)
    async with app.router.lifespan_context(app):
        status, created = await call(app, "/v1/tapes", orjson.dumps(mlp_json), "application/json")
        assert status == 201, created
        tape = orjson.loads(created)["tape_id"]
        rows = {
            "gradient-s15": ("/v1/gradient", orjson.dumps(SCENARIO_15), "application/json"),
            "gradient-json": ("/v1/gradient", orjson.dumps(mlp_json), "application/json"),
            "gradient-msgpack": ("/v1/gradient", msgpack.packb(mlp_msgpack), MSGPACK),
            "hvp-json": (f"/v1/tapes/{tape}/hvp", orjson.dumps({"vector": vector_json}),
                         "application/json"),
            "hvp-msgpack": (f"/v1/tapes/{tape}/hvp",
                            msgpack.packb({"vector": vector_msgpack}), MSGPACK),
        }
        names = args.rows.split(",")
        chosen = [(name, *rows[name]) for name in names]
        for _, path, body, kind in chosen * 50:  # warm-up
            status, answer = await call(app, path, body, kind)
            assert status == 200, answer
        profile = cProfile.Profile() if args.profile else None
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        if profile:
            profile.enable()
        for _ in range(args.requests):
            for name, path, body, kind in chosen:
                c, t = time.thread_time(), time.perf_counter()
                await call(app, path, body, kind)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - c)
        if profile:
            profile.disable()
        for name in names:
            print(f"{name}: median {statistics.median(times[name]) * 1e3:.3f} ms in the app, "
                  f"{statistics.median(cpu[name]) * 1e3:.3f} ms CPU of the event loop's thread")
        if profile:
            stats = pstats.Stats(profile)
            stats.sort_stats(args.sort).print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="gradient-json,hvp-json",
                        help="gradient-s15, gradient-json, gradient-msgpack, hvp-json, "
                        "hvp-msgpack (comma-separated)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--top", type=int, default=45)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
