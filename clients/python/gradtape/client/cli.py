"""The common curvature questions from a shell, about an ONNX model and a batch of data:

    gradtape eigenvalues model.onnx --data data.npz --loss cross_entropy --output logits -k 5
    gradtape trace       model.onnx --data data.npz --curvature ggn
    gradtape density     model.onnx --data data.npz --probes 8 --steps 40 --plot density.png
    gradtape influence   model.onnx --data train.npz --test test.npz --top-k 5 --json

(`gradtape` is the server's command, which hands these to this module; without the
server installed: `python -m gradtape.client.cli ...`.) It talks to a running server
(`--url`, `--api-key` or GRADTAPE_API_KEY) or, without --url, starts one of its own on a
free loopback port for the length of the command (`gradtape serve`, which must then be
installed). The model is stored on the server under a name made from its digest (PUT
/v1/models, so asking again does not send it twice), the arrays of the .npz that the
model reads (its graph inputs, by name) and the labels (`--labels`, default y) go inline,
a tape is recorded with the loss, and the question runs as a job with a progress bar on
standard error. The answer is printed (a table, or `--json`), and `--plot FILE` draws it
(the SDK's plots: `pip install 'gradtape-client[plot]'`). An answer that is not converged
says so, on standard error and in the JSON. Exit status: 0 answered, 1 the server
refused or failed (its problem printed), 2 bad arguments or files.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _core, _wire
from ._client import Client
from .errors import GradtapeError
from .jobs import JobStatus, TqdmReporter
from .results import ApproximateWarning, UnconvergedWarning

QUESTIONS = ("eigenvalues", "trace", "density", "influence")

# --loss -> the program line that turns the output and labels into the loss.
LOSSES = {
    "cross_entropy": "softmax_cross_entropy({output}, {labels})",
    "binary_cross_entropy": "sigmoid_cross_entropy({output}, {labels})",
    "mse": "mean_squared_error({output}, {labels})",
}
CURVATURES = ("hessian", "ggn", "fisher", "empirical_fisher")
READY_TIMEOUT = 180.0  # seconds an embedded server may take to start its workers


class UsageError(Exception):
    """A bad argument or file: exit status 2, the message printed."""


# ------------------------------------------------------------------------- arguments


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="gradtape",
        description="Curvature questions about an ONNX model, answered by a gradtape server.",
    )
    questions = top.add_subparsers(dest="question", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", type=Path, help="the model, an .onnx file")
    common.add_argument(
        "--data",
        type=Path,
        required=True,
        help="an .npz with the model's inputs (by their ONNX names) and the labels",
    )
    common.add_argument("--loss", choices=sorted(LOSSES), default="cross_entropy")
    common.add_argument(
        "--output", default="logits", help="the model output's name in the program (logits)"
    )
    common.add_argument("--labels", default="y", help="the .npz array of labels (y)")
    common.add_argument(
        "--inputs", help="the model's inputs, comma-separated (default: read from the file)"
    )
    common.add_argument(
        "--curvature",
        choices=CURVATURES,
        help="the matrix asked about (default: the Hessian; influence: ggn)",
    )
    common.add_argument("--max-hvps", type=int, help="the budget of curvature-vector products")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--url", help="a running server (default: start one for this command)")
    common.add_argument(
        "--api-key", default=os.environ.get("GRADTAPE_API_KEY"), help="or GRADTAPE_API_KEY"
    )
    common.add_argument("--workers", type=int, default=1, help="an embedded server's workers")
    common.add_argument("--json", action="store_true", help="print the answer as JSON")
    common.add_argument("--plot", type=Path, help="draw the answer into this file (.png, .svg)")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")

    eig = questions.add_parser("eigenvalues", parents=[common], help="extreme eigenvalues")
    eig.add_argument("-k", type=int, default=5, help="how many (5)")
    eig.add_argument("--which", choices=("LA", "SA", "LM"), help="largest (LA), smallest, |.|")
    eig.add_argument("--tol", type=float, help="relative residual to converge to")

    trace = questions.add_parser("trace", parents=[common], help="the trace, with its error")
    trace.add_argument("--method", choices=("auto", "exact", "hutchpp", "hutchinson"))
    trace.add_argument("--rtol", type=float, help="relative standard error to stop at")

    density = questions.add_parser("density", parents=[common], help="the spectral density")
    density.add_argument("--probes", type=int, default=8)
    density.add_argument("--steps", type=int, default=40)

    influence = questions.add_parser(
        "influence", parents=[common], help="influence of training points on test points"
    )
    influence.add_argument(
        "--test", type=Path, required=True, help="an .npz of test points (inputs and labels)"
    )
    influence.add_argument("--damping", type=float, default=1e-3)
    influence.add_argument("--top-k", type=int, default=10)
    return top


# ----------------------------------------------------------------------------- files


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise UsageError(f"{what} {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what} {path}: not a readable .npz ({exc})") from None


def pick(arrays: dict[str, np.ndarray], names: Sequence[str], path: Path) -> dict[str, Any]:
    missing = [n for n in names if n not in arrays]
    if missing:
        raise UsageError(
            f"{path} has no array {missing[0]!r} (the model reads {list(names)}); "
            f"it has {sorted(arrays)}"
        )
    return {n: arrays[n] for n in names}


# ---------------------------------------------------------------------------- server


def _store_model_op(core: _core.Core, name: str, onnx: bytes) -> _core.Op[dict[str, Any]]:
    headers = {**core.headers(), "content-type": "application/onnx"}
    response = yield _core.HTTPRequest("PUT", f"/v1/models/{name}", headers, onnx)
    if response.status >= 400:
        raise core.problem(response)
    answer: dict[str, Any] = _wire.decode_body(
        response.content, response.headers.get("content-type", "application/json")
    )
    return answer


@contextlib.contextmanager
def embedded_server(workers: int) -> Iterator[str]:
    """`gradtape serve` on a free loopback port, keeping nothing (an in-memory store),
    until the block ends; its URL."""
    import importlib.util

    if importlib.util.find_spec("service") is None:
        raise UsageError(
            "no --url given and the server is not installed here to start one: "
            "pip install 'gradtape[service]', or pass --url of a running server"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADTAPE_")}
    env |= {"GRADTAPE_WORKERS": str(workers), "GRADTAPE_LOG_LEVEL": "warning"}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1"]
            + ["--port", str(port), "--store-path", ":memory:", "--no-access-log"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            _wait_ready(url, process, log)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Any) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise UsageError(f"the embedded server exited:\n{log.read().decode(errors='replace')}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=5.0).status_code == 200:
                return
        time.sleep(0.1)
    raise UsageError(f"the embedded server was not ready within {READY_TIMEOUT:.0f} s")


# ---------------------------------------------------------------------------- asking


class LineReporter:
    """Progress without tqdm: one line on standard error, rewritten in place."""

    def __init__(self, description: str):
        self.description = description

    def __call__(self, status: JobStatus) -> None:
        p = status.progress or {}
        total = f"/{p['total']}" if p.get("total") else ""
        estimate = "" if p.get("estimate") is None else f" estimate {_short(p['estimate'])}"
        sys.stderr.write(
            f"\r{self.description}: {status.state} {p.get('done', 0)}{total} "
            f"{p.get('unit', '')}{estimate}\x1b[K"
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value[:3]) + (", ...]" if len(value) > 3 else "]")
    return "nan" if value is None else f"{value:.4g}"


def ask(args: argparse.Namespace, client: Client) -> Any:
    """Store the model, record the tape, ask the question: the SDK's result."""
    onnx = _read_model(args.model)
    name = "cli-" + hashlib.sha256(onnx).hexdigest()[:16]
    client._run(_store_model_op(client._core, name, onnx))
    model_inputs = args.inputs.split(",") if args.inputs else graph_inputs(onnx, args.model)
    data = read_npz(args.data, "--data")
    inputs = pick(data, [*model_inputs, args.labels], args.data)
    program = [
        f"{args.output} = net({', '.join(model_inputs)})",
        "loss = " + LOSSES[args.loss].format(output=args.output, labels=args.labels),
    ]
    definition = {"models": {"net": {"stored": name}}, "inputs": inputs, "program": program}
    progress: Any = False
    if not args.no_progress:
        try:
            progress = TqdmReporter(args.question)  # on standard error
        except ImportError:
            progress = LineReporter(args.question)
    try:
        with client.tape(definition, "loss", output=args.output) as tape:
            return _question(args, tape, progress, [*model_inputs, args.labels])
    finally:
        if progress:
            progress.close()


def _question(args: argparse.Namespace, tape: Any, progress: Any, names: list[str]) -> Any:
    budget = {} if args.max_hvps is None else {"max_hvps": args.max_hvps}
    curvature = args.curvature if args.curvature != "hessian" else None
    common = {"curvature": curvature, "seed": args.seed, "progress": progress, **budget}
    if args.question == "eigenvalues":
        return tape.eigenvalues(args.k, args.which, tol=args.tol, **common)
    if args.question == "trace":
        return tape.trace(method=args.method, rtol=args.rtol, **common)
    if args.question == "density":
        return tape.spectral_density(probes=args.probes, steps=args.steps, **common)
    points = pick(read_npz(args.test, "--test"), names, args.test)  # as the training data
    common["curvature"] = args.curvature or "ggn"
    del common["seed"]  # a CG solve: nothing random
    return tape.influence(points, damping=args.damping, top_k=args.top_k, **common)


def graph_inputs(onnx_bytes: bytes, path: Path) -> list[str]:
    """The ONNX graph's inputs that are not initializers (what `net(...)` takes), in order,
    read with the `onnx` package (the server's `onnx` extra)."""
    try:
        import onnx
        from google.protobuf.message import DecodeError
    except ImportError:
        raise UsageError(
            "reading the model's input names needs the onnx package: pip install onnx, "
            "or name them with --inputs x1,x2"
        ) from None
    try:
        graph = onnx.load_model_from_string(onnx_bytes).graph
    except DecodeError as exc:
        raise UsageError(f"model {path}: not an ONNX file ({exc})") from None
    initializers = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]


def _read_model(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"model {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------- output


# Fields left out of --json: per-parameter vectors as large as the model.
BULKY = {"eigenvectors", "s_test", "nodes", "weights"}


def as_json(result: Any) -> dict[str, Any]:
    assert is_dataclass(result)
    out: dict[str, Any] = {"kind": type(result).__name__}
    for f in fields(result):
        if f.name in BULKY or f.name.startswith("_"):
            continue
        value = getattr(result, f.name)
        if is_dataclass(value) and not isinstance(value, type):  # curvature_used
            value = asdict(value)
        out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def as_text(result: Any) -> str:
    kind = type(result).__name__
    lines = []
    if kind == "Eigenvalues":
        lines.append(f"eigenvalues ({result.method}, {result.hvps} HVPs):")
        for i, (value, residual) in enumerate(zip(result.eigenvalues, result.residuals), 1):
            lines.append(f"  {i:>3}  {value:>14.7g}   residual {residual:.2g}")
    elif kind == "Trace":
        error = "" if result.stderr is None else f" \u00b1 {result.stderr:.4g}"
        lines.append(f"trace: {result.trace:.6g}{error} ({result.method}, {result.hvps} HVPs)")
    elif kind == "SpectralDensity":
        peak = result.grid[int(np.argmax(result.density))]
        lines.append(
            f"spectral density: {result.probes} probes x {result.steps} steps over "
            f"{result.parameters} parameters, eigenvalues in [{result.grid[0]:.4g}, "
            f"{result.grid[-1]:.4g}], peak at {peak:.4g}"
        )
    else:
        lines.append(
            f"influence on the test loss {result.test_loss:.6g} ({result.curvature_used or result._curvature}):"
        )
        for label, index in (("harmful", result.harmful), ("helpful", result.helpful)):
            listed = ", ".join(f"{int(i)} ({result.scores[int(i)]:+.4g})" for i in index)
            lines.append(f"  most {label}: {listed or 'none'}")
    return "\n".join(lines)


def draw(result: Any, path: Path) -> Any:
    """The answer's plot, saved to `path`; the figure."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    if type(result).__name__ == "Trace":
        raise UsageError("a trace is one number: --plot draws eigenvalues, density, influence")
    figure, _ = result.plot()
    figure.savefig(path, dpi=120)
    return figure


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.plot is not None and args.question == "trace":
            raise UsageError("a trace is one number: --plot draws eigenvalues, density, influence")
        with contextlib.ExitStack() as stack:
            url = args.url or stack.enter_context(embedded_server(args.workers))
            client = stack.enter_context(Client(url, api_key=args.api_key, timeout=600.0))
            # The command says "not converged" in its own line below; the SDK's warning
            # would say it again, as a Python traceback line. An approximate answer's
            # warning is said in such a line too.
            said = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("ignore", UnconvergedWarning)
            warnings.simplefilter("always", ApproximateWarning)
            result = ask(args, client)
        for w in said:
            if issubclass(w.category, ApproximateWarning):
                print(f"gradtape: warning: {w.message}", file=sys.stderr)
            else:  # anything else as Python would have shown it
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if not result.converged:
            print(
                f"gradtape: warning: not converged (stopped by {result.stopped}); "
                "the answer is approximate",
                file=sys.stderr,
            )
        print(json.dumps(as_json(result)) if args.json else as_text(result))
        if args.plot is not None:
            draw(result, args.plot)
            print(f"gradtape: drew {args.plot}", file=sys.stderr)
    except UsageError as exc:
        print(f"gradtape: {exc}", file=sys.stderr)
        return 2
    except GradtapeError as exc:
        print(f"gradtape: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
