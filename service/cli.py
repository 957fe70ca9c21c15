"""`gradtape`: serve the API, or write its OpenAPI document.

    gradtape serve [--host H] [--port P] [--http-workers N] [--workers N] [--device D] ...
    gradtape openapi [--out openapi/openapi.json]
    gradtape kernels warm [--json]
    gradtape eigenvalues|trace|density|influence model.onnx --data data.npz ...

The curvature questions are the SDK's command line (gradtape.client.cli, a client of a
running server or of one it starts), handed over as they are: this process stays a
client and never loads the engine.

Flags override GRADTAPE_* environment variables. Imports stay inside the commands: a
spawned worker process re-imports this module and must not pay for the web stack.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

# flag -> Settings field, for the settings `serve` takes as flags (the rest: environment)
SERVE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--host": ("host", str, "address to bind (default 127.0.0.1)"),
    "--port": ("port", int, "port to bind (default 8000)"),
    "--http-workers": (
        "http_workers",
        int,
        (
            "HTTP processes (uvicorn workers) sharing the port and the store file, "
            "each with its own engine workers; tapes, jobs and rate limits are "
            "then read from the store (default 1)"
        ),
    ),
    "--workers": ("workers", int, "engine worker processes (default: one per GPU, else 2)"),
    "--device": ("device", str, "auto, cpu, cuda or cuda:N"),
    "--executor": ("executor", str, "what runs the workers: local (processes) or ray (actors)"),
    "--ray-address": (
        "ray_address",
        str,
        "with --executor ray: auto, ray://host:10001, or empty: a local Ray",
    ),
    "--time-limit": ("time_limit", float, "compute seconds per request"),
    "--max-time-limit": ("max_time_limit", float, "most a request may ask for"),
    "--queue-size": ("queue_size", int, "requests that may wait for a worker"),
    "--max-body-bytes": ("max_body_bytes", int, "request body limit"),
    "--log-level": ("log_level", str, "critical, error, warning, info or debug"),
    "--data-dir": ("data_dir", str, "where the store of tapes and models lives"),
    "--store-path": ("store_path", str, "the SQLite store file (':memory:': keep nothing)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtape",
        description=__doc__.split("\n")[0],
        epilog="Curvature questions: gradtape {eigenvalues,trace,density,influence} -h",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the HTTP API with uvicorn")
    for flag, (field, type_, help_) in SERVE_FLAGS.items():
        serve.add_argument(flag, dest=field, type=type_, help=help_)
    serve.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        default=None,
        help="do not log each request",
    )
    spec = commands.add_parser("openapi", help="write the OpenAPI document")
    spec.add_argument(
        "--out", type=Path, default=None, help="file to write (default: standard output)"
    )
    kernels = commands.add_parser("kernels", help="the engine's compiled kernels (numba)")
    actions = kernels.add_subparsers(dest="action", required=True)
    warm = actions.add_parser(
        "warm",
        help="compile every kernel signature into numba's disk cache (NUMBA_CACHE_DIR), "
        "loading those it holds; the Docker image runs it at build",
    )
    warm.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def warm_kernels(as_json: bool) -> int:
    """`gradtape kernels warm`: engine/kernels/warmup.py's command (`python -m
    engine.kernels.warmup`), in a process of its own (this one never loads the engine)."""
    import subprocess

    argv = [sys.executable, "-m", "engine.kernels.warmup", *(["--json"] if as_json else [])]
    # engine/ beside service/ (a checkout, or site-packages) importable from anywhere
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.run(argv, env=env, check=False).returncode


def serve(overrides: dict[str, Any]) -> int:
    from service.core import metric_files

    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        try:
            metric_files.prepare(Path(given))
        except OSError as exc:
            print(f"gradtape: PROMETHEUS_MULTIPROC_DIR {given!r}: {exc}", file=sys.stderr)
            return 2
    import logging

    import uvicorn
    from pydantic import ValidationError

    from service.api.app import create_app
    from service.core.config import Settings

    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"gradtape: bad settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s"
    )
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"gradtape: {exc}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": settings.access_log,
        "timeout_graceful_shutdown": 10,
    }
    if settings.http_workers == 1:
        uvicorn.run(app, **options)
        return 0
    # Several processes: uvicorn starts each with the factory, which reads its settings
    # from the environment (the flags go there), and they share the store file, created
    # or migrated here once before they open it together.
    from service.core.store import Store, StoreError

    store = Store(settings.resolved_store_path())
    try:
        store.open()
    except StoreError as exc:
        print(f"gradtape: {exc}", file=sys.stderr)
        return 2
    store.close()
    os.environ.update(settings_environment(overrides))
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config(
        "service.api.app:create_app", factory=True, workers=settings.http_workers, **options
    )
    try:
        sock = _listening_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"gradtape: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d with %d HTTP processes (Press CTRL+C to quit)",
        settings.host,
        sock.getsockname()[1],
        settings.http_workers,
    )
    metrics_dir, made_here = _metrics_directory()
    supervisor = Multiprocess(config, sockets=[sock])
    try:
        supervisor.run()
    finally:
        if made_here:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    # A process that could not start (its workers, its store) stops them all: say so.
    return 3 if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0


def _metrics_directory() -> tuple[Path, bool]:
    """Where the HTTP processes write their metrics for each other's scrapes
    (service/domain/metrics.py), set in the environment they start with: the operator's
    PROMETHEUS_MULTIPROC_DIR (prepared at the start of `serve`), or a fresh temporary
    directory (True: removed when the server stops)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        return Path(given), False
    directory = Path(tempfile.mkdtemp(prefix="gradtape-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    return directory, True


def _listening_socket(host: str, port: int) -> socket.socket:
    """The socket the HTTP processes share, made here rather than by uvicorn: its own has
    protocol 0, which survives the hand-over to the processes, and asyncio then leaves
    Nagle's algorithm on for every connection (TCP_NODELAY only for IPPROTO_TCP): each
    answer written in two sends waited ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def settings_environment(overrides: dict[str, Any]) -> dict[str, str]:
    """The GRADTAPE_* variables that give a child process these flag overrides."""
    return {
        f"GRADTAPE_{name.upper()}": (
            json.dumps(value)
            if isinstance(value, dict | list)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        for name, value in overrides.items()
    }


def openapi_document() -> str:
    from service.api.app import create_app
    from service.core.config import Settings

    # The document does not depend on settings; build the app without reading the env.
    app = create_app(Settings(_env_file=None))  # type: ignore[call-arg]
    return json.dumps(app.openapi(), indent=2, ensure_ascii=False) + "\n"


# The packages of the `service` extra that `serve` and `openapi` import first.
SERVICE_PACKAGES = (
    "fastapi",
    "uvicorn",
    "pydantic",
    "pydantic_settings",
    "msgpack",
    "orjson",
    "prometheus_client",
    "fastapi_offline",
)


def missing_service_packages() -> list[str]:
    import importlib.util

    return [name for name in SERVICE_PACKAGES if importlib.util.find_spec(name) is None]


# The SDK's questions (gradtape.client.cli.QUESTIONS), answered by a server over HTTP.
QUESTIONS = ("eigenvalues", "trace", "density", "influence")


def ask(argv: list[str]) -> int:
    try:
        from gradtape.client import cli
    except ImportError:
        print(
            f"gradtape {argv[0]}: asks a server through the Python SDK, which is not "
            "installed: pip install './clients/python[plot,progress]' (from a clone)",
            file=sys.stderr,
        )
        return 2
    return cli.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in QUESTIONS:
        return ask(argv)
    args = _parser().parse_args(argv)
    if args.command == "kernels":  # the engine's alone: no service package needed
        return warm_kernels(args.json)
    missing = missing_service_packages()
    if missing:  # the engine was installed alone (`pip install .`)
        print(
            f"gradtape {args.command}: the service needs its extra, which is not installed "
            f"(missing: {', '.join(missing)}). Install it with: pip install 'gradtape[service]' "
            "(from a clone: pip install '.[service]')",
            file=sys.stderr,
        )
        return 2
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
        return serve(overrides)
    text = openapi_document()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
