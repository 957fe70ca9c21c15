"""Every command in README.md runs, so the README cannot rot.

- The `bash` block under "Set up" holds the two set-up commands: the first is run by
  test_clean_install.py in a fresh virtualenv, the second is what .ci/run runs.
- `bash` blocks whose every command is `docker ...` are not run (no Docker engine here);
  the README says so, and their arguments are checked against the Dockerfile and the
  compose file, which test_docker.py lints and validates.
- Every other `bash` and `python` block runs, in README order, in ONE shell session (as a
  newcomer pastes them into one terminal): in a copy of the checkout, under the suite's
  own interpreter (where the README's set-up installed the checkout), against the live
  server, `http://localhost:8000` pointing at it.
- A `json` block right after a run block is that block's expected output: the JSON
  documents it printed must equal it ("<...>" strings stand for any value).
- The Docker commands and the generated tables (settings, problem types) moved with
  their sections into the documentation site's guides: docs/guides/docker.md's Docker
  commands are checked here, the tables in tests/deploy/test_guides.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import (
    ROOT,
    Server,
    copy_files,
    installed_distributions,
    layered_venv,
    repo_files,
    run,
)
from tests.deploy.files import Block, Dockerfile, readme_blocks

pytestmark = pytest.mark.deploy

README = ROOT / "README.md"
LOCAL_URL = "http://localhost:8000"
SESSION_TIMEOUT = 600.0
BLOCKS = readme_blocks(README.read_text())
DOCKER_GUIDE = ROOT / "docs" / "guides" / "docker.md"  # the Docker commands, not run here
DOCKER_BLOCKS = readme_blocks(DOCKER_GUIDE.read_text())
NODE = shutil.which("node") and shutil.which("npm")


def is_setup(block: Block) -> bool:
    return block.section == "Set up" and block.lang == "bash"


def is_docker(block: Block) -> bool:
    commands = block.commands()
    return (
        block.lang == "bash" and bool(commands) and all(c.startswith("docker ") for c in commands)
    )


def needs_node(block: Block) -> bool:
    return any(re.match(r"(npm|node|npx) ", c) for c in block.commands())


RUN_BLOCKS = [
    b for b in BLOCKS if b.lang in ("bash", "python") and not is_setup(b) and not is_docker(b)
]


def expected_output(block: Block) -> Block | None:
    following = BLOCKS[BLOCKS.index(block) + 1 :]
    return following[0] if following and following[0].lang == "json" else None


# ------------------------------------------------------------------------ structure


def test_blocks_are_of_known_kinds() -> None:
    assert {b.lang for b in BLOCKS} <= {"bash", "python", "json", "text"}
    for block in BLOCKS:
        if block.lang == "json":  # an expected output: right after the block it shows
            before = BLOCKS[BLOCKS.index(block) - 1]
            assert before in RUN_BLOCKS, f"README.md:{block.line}: an output of nothing run"


def test_two_setup_commands() -> None:
    setup = [b for b in BLOCKS if is_setup(b)]
    assert len(setup) == 1 and len(setup[0].commands()) == 2


def test_ci_runs_the_readme_test_command_in_a_fresh_virtualenv() -> None:
    """CI is a new user: a virtualenv of its own, then the README's test command as is."""
    (setup,) = [b for b in BLOCKS if is_setup(b)]
    test_command = setup.commands()[1]
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = [line for line in lines if line and not line.startswith("#")]
    made = next(i for i, line in enumerate(steps) if re.match(r"python3? -m venv ", line))
    activated = next(i for i, line in enumerate(steps) if re.match(r"\. .*/bin/activate", line))
    assert made < activated < steps.index(test_command), steps
    assert steps[-1] == test_command, "the README's test command is the last step of .ci/run"
    # The virtualenv is new for each run: under a fresh temporary directory.
    assert any("mktemp -d" in line for line in steps[:made]), steps


def test_run_blocks_use_the_local_url() -> None:
    for block in RUN_BLOCKS:
        others = set(re.findall(r"\w+://[\w.]+:\d+", block.body)) - {LOCAL_URL}
        assert not others, f"README.md:{block.line}: {others}"


# --------------------------------------------------------------------------- Docker


def test_docker_commands_are_listed_as_not_run() -> None:
    """They live in the site's Docker guide (the README links to it), which says so."""
    assert not [b for b in BLOCKS if is_docker(b)], (
        "Docker commands belong in docs/guides/docker.md"
    )
    docker = [b for b in DOCKER_BLOCKS if is_docker(b)]
    assert docker
    assert "None of the Docker commands above was run here" in DOCKER_GUIDE.read_text()


def test_docker_commands_match_the_files() -> None:
    dockerfile = Dockerfile.read(ROOT / "Dockerfile")
    variants = {
        s.name.removesuffix("-build")
        for s in dockerfile.stages
        if s.name and s.name.endswith("-build") and s.name != "build"
    }
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    env: dict[str, str] = {}
    for ins in dockerfile.stages[-1].all("ENV"):
        env |= dict(w.split("=", 1) for w in shlex.split(ins.args))
    built: dict[str, str] = {}  # tag -> variant
    for block in (b for b in DOCKER_BLOCKS if is_docker(b)):
        for command in block.commands():
            words = shlex.split(command)
            if words[1] == "build":
                args = dict(
                    words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg"
                )
                assert set(args) <= set(dockerfile.global_args), args
                variant = args.get("VARIANT", dockerfile.global_args["VARIANT"])
                assert variant in variants and words[-1] == "."
                built[words[words.index("-t") + 1]] = variant
            elif words[1] == "run":
                image = words[-1]
                assert image in built, f"{image} is not built above"
                assert ("--gpus" in words) == (built[image] != "cpu"), command
                published = words[words.index("-p") + 1]
                assert published.rsplit(":", 1)[1] == env["GRADTAPE_PORT"]
                mount = words[words.index("-v") + 1]
                assert mount.split(":")[1] == env["GRADTAPE_DATA_DIR"], mount
            else:
                assert words[1] == "compose" and "up" in words, command
                profiles = [words[i + 1] for i, w in enumerate(words) if w == "--profile"]
                named = words[words.index("up") + 1 :]
                named = [w for w in named if not w.startswith("-")]
                for name in named:
                    assert name in services
                    assert set(services[name].get("profiles", [])) <= set(profiles)
                for profile in profiles:
                    assert any(profile in s.get("profiles", []) for s in services.values())


# -------------------------------------------------------------------------- session


@dataclass
class Result:
    status: str  # "ok", "failed", "not reached", "skipped"
    stdout: str = ""
    stderr: str = ""


def _script(blocks: list[Block], base_url: str) -> str:
    lines = ["set -euo pipefail"]
    for index, block in enumerate(blocks):
        mark = f"@@readme-block {index}@@"
        lines.append(f"printf '\\n%s\\n' '{mark}'; printf '\\n%s\\n' '{mark}' >&2")
        body = block.body.replace(LOCAL_URL, base_url)
        if block.lang == "python":
            body = f"python - <<'README_PYTHON_EOF'\n{body}README_PYTHON_EOF\n"
        lines.append(body)
    lines.append("printf '\\n%s\\n' '@@readme-end@@'")
    return "\n".join(lines) + "\n"


def _split(text: str, count: int) -> tuple[list[str], bool]:
    """Each block's part of a stream, and whether the script reached its end."""
    parts = re.split(r"\n@@readme-block (\d+)@@\n", text)
    out = [""] * count
    for i in range(1, len(parts), 2):
        out[int(parts[i])] = parts[i + 1]
    finished = "\n@@readme-end@@\n" in text
    if out and finished:
        out[-1] = out[-1].split("\n@@readme-end@@\n")[0]
    return out, finished


@pytest.fixture(scope="module")
def session(live_server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Result]:
    """Runs the README's run blocks; the result of each, keyed by its line."""
    tmp = tmp_path_factory.mktemp("readme")
    checkout = copy_files(repo_files(), tmp / "checkout")
    # The blocks see the suite's environment (the README's set-up installed this checkout
    # there) but install into a virtualenv of their own (issue 27, item 10: the README's
    # `pip install` of the generated client went into the suite's, where a user who runs
    # the tests where they serve lost the SDK).
    bin_dir = layered_venv(tmp / "venv")
    blocks = [b for b in RUN_BLOCKS if NODE or not needs_node(b)]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADTAPE_", "PYTHON", "VIRTUAL_ENV"))
    }
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "VIRTUAL_ENV": str(bin_dir.parent),
        "XDG_DATA_HOME": str(tmp / "xdg-data"),  # what a block stores stays in tmp
    }
    SUITE_DISTRIBUTIONS.update(installed_distributions())
    (tmp / "session.sh").write_text(_script(blocks, live_server.base_url))
    done = run(
        ["bash", str(tmp / "session.sh")],
        cwd=checkout,
        env=env,
        timeout=SESSION_TIMEOUT,
        check=False,
    )
    stdout, finished = _split(done.stdout, len(blocks))
    stderr, _ = _split(done.stderr, len(blocks))
    started = len(re.findall(r"\n@@readme-block \d+@@\n", done.stdout))
    results: dict[int, Result] = {}
    for index, block in enumerate(blocks):
        if index < started - 1 or finished:
            status = "ok"
        elif index == started - 1:
            status = "failed"
        else:
            status = "not reached"
        results[block.line] = Result(status, stdout[index], stderr[index])
    for block in RUN_BLOCKS:
        results.setdefault(block.line, Result("skipped"))
    AFTER_SESSION.update(installed_distributions())
    return results


# The suite environment's distributions (name -> version) before and after the session.
SUITE_DISTRIBUTIONS: dict[str, str] = {}
AFTER_SESSION: dict[str, str] = {}


def json_documents(text: str) -> list[Any]:
    """Every JSON object or array printed in `text`, in order (other output skipped)."""
    decoder = json.JSONDecoder()
    found, i = [], 0
    while (match := re.compile(r"[\[{]").search(text, i)) is not None:
        try:
            value, end = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            i = match.start() + 1
            continue
        found.append(value)
        i = end
    return found


def matches(expected: Any, actual: Any) -> bool:
    if isinstance(expected, str) and re.fullmatch(r"<[^>]+>", expected):
        return True
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(matches(v, actual[k]) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(matches(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return (type(expected) is type(actual) and expected == actual) or (
        isinstance(expected, (int, float))
        and not isinstance(expected, bool)
        and isinstance(actual, (int, float))
        and expected == actual
    )


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[f"line-{b.line}" for b in RUN_BLOCKS])
def test_block_runs(session: dict[int, Result], block: Block) -> None:
    result = session[block.line]
    if result.status == "skipped":
        pytest.skip("node and npm are not installed: the TypeScript client block needs them")
    assert result.status == "ok", (
        f"README.md:{block.line} ({block.section}): {result.status}\n{block.body}"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    output = expected_output(block)
    if output is not None:
        want = json_documents(output.body)
        got = json_documents(result.stdout)
        assert len(want) == len(got) and all(
            matches(w, g) for w, g in zip(want, got, strict=True)
        ), (
            f"README.md:{output.line}: shown output differs from the real one\n"
            f"--- shown\n{output.body}--- real\n{result.stdout}"
        )


def test_the_session_installs_nothing_into_the_suite_environment(
    session: dict[int, Result],
) -> None:
    """Issue 27, item 10: the README's blocks `pip install` (the client generator, the
    generated client) into their own virtualenv; the environment running the suite (and
    perhaps serving) keeps exactly its distributions, the SDK among them."""
    assert SUITE_DISTRIBUTIONS and AFTER_SESSION == SUITE_DISTRIBUTIONS
