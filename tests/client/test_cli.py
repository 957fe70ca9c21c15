"""`gradtape eigenvalues|trace|density|influence` (issue 31): the SDK's command line on
the LeNet ONNX fixture (tests/engine/onnx/fixtures), tested for what it prints and what
it draws, against the suite's server (--url) and against the server it starts itself.
The reference answers come from the SDK asking the same server the same question about
the same definition, and from the ONNX guide's recorded eigenvalues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from gradtape.client import Client, cli

from tests.client.conftest import KEY, SDK
from tests.service.conftest import Server

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "engine" / "onnx" / "fixtures"
MODEL, DATA = FIXTURES / "lenet.onnx", FIXTURES / "lenet.npz"


def definition() -> dict:
    """What the command builds from lenet.onnx, lenet.npz and its defaults."""
    data = np.load(DATA)
    return {
        "models": {"net": {"onnx": MODEL.read_bytes()}},
        "inputs": {"x": data["x"], "y": data["y"]},
        "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
    }


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_eigenvalues_json_and_plot(
    server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    picture = tmp_path / "top.png"
    status, out, err = run_cli(
        capsys, "eigenvalues", MODEL, "--data", DATA, "--loss", "cross_entropy",
        "--output", "logits", "-k", "3", "--tol", "1e-8", "--url", server.base_url,
        "--json", "--plot", picture,
    )  # fmt: skip
    assert status == 0, err
    answer = json.loads(out)
    assert answer["kind"] == "Eigenvalues" and answer["converged"]
    assert answer["curvature_used"]["kind"] == "hessian"  # (a dataclass, written as JSON)
    with Client(server.base_url) as client, client.tape(definition(), "loss") as tape:
        peer = tape.eigenvalues(3, tol=1e-8)
    np.testing.assert_allclose(answer["eigenvalues"], peer.eigenvalues, rtol=1e-6)
    # The ONNX guide's LeNet session (docs/guides/pytorch.md) records 4.2, 3.7, 3.6.
    assert [round(v, 1) for v in answer["eigenvalues"]] == [4.2, 3.7, 3.6]
    assert "eigenvalues" in err and "hvp" in err  # the progress bar, on standard error
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output_and_what_is_drawn(
    server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = cli.parser().parse_args(
        ["density", str(MODEL), "--data", str(DATA), "--probes", "4", "--steps", "12"]
        + ["--url", server.base_url, "--no-progress"]
    )
    with Client(server.base_url) as client:
        density = cli.ask(args, client)
    text = cli.as_text(density)
    assert text.startswith("spectral density: 4 probes x 12 steps over 1738 parameters")
    figure = cli.draw(density, tmp_path / "density.svg")
    (ax,) = figure.axes
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), density.density)
    assert ax.get_xlabel() == "eigenvalue" and "4 probes" in ax.get_title()
    assert (tmp_path / "density.svg").read_text().lstrip().startswith("<?xml")
    plt.close(figure)


def test_influence_against_the_sdk(
    server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = np.load(DATA)
    test = tmp_path / "test.npz"
    np.savez(test, x=data["x"][:2], y=data["y"][:2])
    status, out, err = run_cli(
        capsys, "influence", MODEL, "--data", DATA, "--test", test, "--top-k", "2",
        "--damping", "0.01", "--url", server.base_url,
    )  # fmt: skip
    assert status == 0, err
    with (
        Client(server.base_url) as client,
        client.tape(definition(), "loss", output="logits") as tape,
    ):
        peer = tape.influence(
            {"x": data["x"][:2], "y": data["y"][:2]}, curvature="ggn", damping=0.01, top_k=2
        )
    lines = out.splitlines()
    assert lines[0] == f"influence on the test loss {peer.test_loss:.6g} (ggn):"
    harmful = ", ".join(f"{int(i)} ({peer.scores[int(i)]:+.4g})" for i in peer.harmful)
    assert lines[1] == f"  most harmful: {harmful or 'none'}"


def test_an_unconverged_trace_says_so(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(
        capsys, "trace", MODEL, "--data", DATA, "--method", "hutchinson", "--max-hvps", "8",
        "--rtol", "1e-9", "--url", server.base_url, "--json", "--no-progress",
    )  # fmt: skip
    assert status == 0
    answer = json.loads(out)
    assert answer["converged"] is False and answer["samples"] == 8
    assert f"not converged (stopped by {answer['stopped']})" in err


CLI_MAIN = "import sys; from gradtape.client import cli; sys.exit(cli.main(sys.argv[1:]))"


def test_an_unconverged_answer_is_said_once(tmp_path: Path, server: Server) -> None:
    """The command's own line, not also the SDK's UnconvergedWarning with the line of
    cli.py that raised it (`gradtape: warning: ...` came after a Python warning)."""
    done = subprocess.run(
        [
            sys.executable, "-c", CLI_MAIN, "trace", str(MODEL), "--data", str(DATA),
            "--method", "hutchinson", "--max-hvps", "8", "--url", server.base_url,
            "--no-progress",
        ],
        env={**os.environ, "PYTHONPATH": str(SDK), "PYTHONWARNINGS": "default"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gradtape: warning: not converged (stopped by max_hvps); the answer is approximate"
    ]


def test_a_trace_the_server_estimated_says_so_in_a_line_of_its_own(
    tmp_path: Path, server: Server
) -> None:
    """method auto with max_hvps below the parameter count: a Hutch++ estimate the
    command did not ask for by name, said in the command's own warning line (not as a
    Python warning with cli.py's line)."""
    done = subprocess.run(
        [
            sys.executable, "-c", CLI_MAIN, "trace", str(MODEL), "--data", str(DATA),
            "--max-hvps", "40", "--url", server.base_url, "--no-progress", "--json",
        ],
        env={**os.environ, "PYTHONPATH": str(SDK), "PYTHONWARNINGS": "default"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["method"] == "hutchpp"
    lines = done.stderr.splitlines()
    assert lines[0].startswith("gradtape: warning: the trace is a hutchpp estimate ("), lines
    assert "method='exact'" in lines[0]
    assert all(line.startswith("gradtape: ") for line in lines), lines


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--labels", "labels"], "has no array 'labels' (the model reads ['x', 'labels'])"),
        (["--plot", "t.png"], "a trace is one number"),
    ],
)
def test_bad_arguments_exit_2(
    server: Server, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = run_cli(
        capsys, "trace", MODEL, "--data", DATA, "--url", server.base_url, "--no-progress", *argv
    )
    assert status == 2 and message in err, err


def test_bad_files_exit_2(
    server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = run_cli(
        capsys, "trace", tmp_path / "nope.onnx", "--data", DATA, "--url", server.base_url
    )
    assert status == 2 and "nope.onnx" in err
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    status, _, err = run_cli(
        capsys, "trace", tmp_path / "bad.onnx", "--data", DATA, "--url", server.base_url
    )
    assert status == 1 and "422" in err and "ONNX" in err, err  # the server's checker
    status, _, err = run_cli(
        capsys, "trace", MODEL, "--data", tmp_path / "none.npz", "--url", server.base_url
    )
    assert status == 2 and "none.npz: no such file" in err


def test_a_refusal_of_the_server_exits_1(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    # Mean squared error of 10 logits against 4 labels: the server names the shapes.
    status, _, err = run_cli(
        capsys, "trace", MODEL, "--data", DATA, "--loss", "mse", "--url", server.base_url,
        "--no-progress",
    )  # fmt: skip
    assert status == 1 and "422" in err and "mean_squared_error" in err, err


def test_the_gradtape_command_starts_a_server_of_its_own(tmp_path: Path) -> None:
    """`gradtape density ...` without --url: through the server's entry point (which hands
    the question to the SDK), a server started for the command and stopped after it."""
    picture = tmp_path / "density.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADTAPE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SDK)])
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "density", str(MODEL), "--data", str(DATA)]
        + ["--probes", "2", "--steps", "10", "--json", "--plot", str(picture)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    grid, density = np.array(answer["grid"]), np.array(answer["density"])
    assert answer["parameters"] == 1738 and answer["probes"] == 2
    assert np.sum(density) * (grid[1] - grid[0]) == pytest.approx(1.0, abs=0.02)  # a density
    assert "density" in done.stderr and "hvp" in done.stderr  # the bar
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_api_key_and_its_absence(
    strict: Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that requires keys: refused without one (exit 1, the 401 said), answered
    with --api-key, and with GRADTAPE_API_KEY."""
    # The strict server's one worker, no queue: a test before this one (test_errors')
    # may leave it computing to its time limit, and a 503 would outlast the retries.
    strict.wait_ready()
    argv = ["trace", MODEL, "--data", DATA, "--url", strict.base_url, "--no-progress"]
    argv += ["--method", "hutchinson", "--max-hvps", "4", "--json"]
    status, _, err = run_cli(capsys, *argv)
    assert status == 1 and "401" in err, err
    strict.wait_ready()  # (each call's tape is dropped by its worker after the answer)
    status, out, err = run_cli(capsys, *argv, "--api-key", KEY)
    assert status == 0 and json.loads(out)["samples"] == 4, err
    monkeypatch.setenv("GRADTAPE_API_KEY", KEY)
    strict.wait_ready()
    status, out, err = run_cli(capsys, *argv)
    assert status == 0 and json.loads(out)["kind"] == "Trace", err
