"""Every code block of the documentation site's guides (docs/guides/*.md) runs, as the
README's do (tests/deploy/test_readme.py, whose rules apply): per guide, its `bash` and
`python` blocks run in order in ONE shell session, in a copy of the checkout, under the
suite's interpreter, against the live server (`http://localhost:8000` pointing at it); a
`json` block right after a run block is its expected output. Not run: `bash` blocks whose
every command is `docker ...` (checked against the Dockerfile and compose file by
test_readme.py's rules), the README's two set-up commands (run by test_clean_install.py
and .ci/run), and blocks needing node/npm or torch where those are absent (skipped,
saying so). The generated tables (settings, problem types) must be current. As the
README's blocks, a guide's `pip install` (the SDK's torch extra, the client generator)
goes into a virtualenv of the guides' own that sees the suite's packages, never into the
environment running the suite, which other tests import from meanwhile.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from tests.deploy import readme_tables
from tests.deploy.conftest import (
    ROOT,
    Server,
    copy_files,
    installed_distributions,
    layered_venv,
    repo_files,
    run,
)
from tests.deploy.files import Block, readme_blocks
from tests.deploy.test_readme import BLOCKS as README_BLOCKS
from tests.deploy.test_readme import (
    LOCAL_URL,
    NODE,
    SESSION_TIMEOUT,
    _script,
    _split,
    is_docker,
    is_setup,
    json_documents,
    matches,
    needs_node,
)

pytestmark = pytest.mark.deploy

GUIDES_DIR = ROOT / "docs" / "guides"
GUIDES = sorted(GUIDES_DIR.glob("*.md"))
SETUP_COMMANDS = [c for b in README_BLOCKS if is_setup(b) for c in b.commands()]
TORCH = importlib.util.find_spec("torch") is not None


def blocks_of(guide: Path) -> list[Block]:
    return readme_blocks(guide.read_text())


def is_setup_commands(block: Block) -> bool:
    """The README's set-up commands, shown again in a guide (run elsewhere)."""
    return block.lang == "bash" and bool(block.commands()) and block.commands() == SETUP_COMMANDS


def run_blocks(blocks: list[Block]) -> list[Block]:
    return [
        b
        for b in blocks
        if b.lang in ("bash", "python") and not is_docker(b) and not is_setup_commands(b)
    ]


def needs_torch(block: Block) -> bool:
    return bool(re.search(r"^\s*(import torch|from torch)", block.body, re.MULTILINE))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_files(repo_files(), tmp_path_factory.mktemp("guides") / "checkout")


@pytest.fixture(scope="module")
def guides_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of the guides' virtualenv (layered over the suite's)."""
    return layered_venv(tmp_path_factory.mktemp("guides-venv") / "venv")


def test_there_are_guides() -> None:
    names = {g.name for g in GUIDES}
    assert {"getting-started.md", "sdk.md", "jobs.md", "docker.md", "settings.md"} <= names


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_blocks_are_of_known_kinds(guide: Path) -> None:
    blocks = blocks_of(guide)
    runnable = run_blocks(blocks)
    assert {b.lang for b in blocks} <= {"bash", "python", "json", "text"}, guide.name
    for index, block in enumerate(blocks):
        if block.lang == "json":  # an expected output: right after the block it shows
            assert index and blocks[index - 1] in runnable, f"{guide.name}:{block.line}"
        others = set(re.findall(r"\w+://[\w.]+:\d+", block.body)) - {LOCAL_URL}
        assert not others, f"{guide.name}:{block.line}: {others}"


@pytest.mark.parametrize(
    "name", readme_tables.TABLES, ids=[f"{t}-table" for t in readme_tables.TABLES]
)
def test_generated_tables_are_current(name: str) -> None:
    holders = [g for g in GUIDES if readme_tables.current(g.read_text(), name) is not None]
    assert holders, f"no guide holds the {name} table"
    for guide in holders:
        assert readme_tables.current(guide.read_text(), name) == readme_tables.expected(name), (
            f"{guide.name}'s {name} table is stale: run `python -m tests.deploy.readme_tables`"
        )


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_guide_runs(
    guide: Path, live_server: Server, checkout: Path, guides_bin: Path, tmp_path: Path
) -> None:
    blocks = blocks_of(guide)
    runnable = run_blocks(blocks)
    if not runnable:
        pytest.skip(f"{guide.name} has no block to run")
    if not TORCH and any(needs_torch(b) for b in runnable):
        pytest.skip(f"{guide.name} needs torch, which is not installed")
    if not NODE and any(needs_node(b) for b in runnable):
        pytest.skip(f"{guide.name} needs node and npm, which are not installed")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADTAPE_", "PYTHON", "VIRTUAL_ENV"))
    }
    env |= {
        "PATH": f"{guides_bin}{os.pathsep}{env['PATH']}",
        "VIRTUAL_ENV": str(guides_bin.parent),
        "XDG_DATA_HOME": str(tmp_path / "xdg-data"),
        "MPLBACKEND": "Agg",  # a plot shown is a plot drawn, never a window
        # The SDK importable as `pip install ./clients/python` (sdk.md's first block,
        # which runs too) makes it, whichever guide runs first.
        "PYTHONPATH": str(checkout / "clients" / "python"),
    }
    script = tmp_path / "session.sh"
    script.write_text(_script(runnable, live_server.base_url))
    suite_before = installed_distributions()
    done = run(["bash", str(script)], cwd=checkout, env=env, timeout=SESSION_TIMEOUT, check=False)
    assert installed_distributions() == suite_before, "a guide installed into the suite's env"
    stdout, finished = _split(done.stdout, len(runnable))
    stderr, _ = _split(done.stderr, len(runnable))
    started = len(re.findall(r"\n@@readme-block \d+@@\n", done.stdout))
    for index, block in enumerate(runnable):
        reached = finished or index < started - 1
        assert reached, (
            f"{guide.relative_to(ROOT)}:{block.line}: "
            f"{'failed' if index == started - 1 else 'not reached'}\n{block.body}"
            f"--- stdout\n{stdout[index]}\n--- stderr\n{stderr[index]}"
        )
        following = blocks[blocks.index(block) + 1 :]
        if following and following[0].lang == "json":
            want, got = json_documents(following[0].body), json_documents(stdout[index])
            assert len(want) == len(got) and all(
                matches(w, g) for w, g in zip(want, got, strict=True)
            ), (
                f"{guide.relative_to(ROOT)}:{following[0].line}: shown output differs from "
                f"the real one\n--- shown\n{following[0].body}--- real\n{stdout[index]}"
            )
