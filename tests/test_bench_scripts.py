"""The benchmark scripts (bench/) still fit the code they measure: every name a script
imports from the project (engine, service, tests, bench) exists, and every attribute it
reads off an imported project module (`gt.jit`, `kernels.warm`) too.

The scripts are not run here: their timings mean nothing on a shared CI runner, and
bench/targets.sh runs them on a quiet machine. But a rename in the engine breaks a
script silently until someone next measures (the small step's regression went unseen for
two sessions, bench/RESULTS.md), and a script that no longer starts is found only then.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))
PROJECT = ("engine", "service", "tests", "bench")


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def _uses(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for each project name imported, and (line, module, attribute)
    for each attribute read off a project module bound to a name; name None for a plain
    `import module`."""
    bound: dict[str, str] = {}  # local name -> the project module it holds
    uses: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project(alias.name):
                    uses.append((node.lineno, alias.name, None))
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_project(node.module):
                for alias in node.names:
                    uses.append((node.lineno, node.module, alias.name))
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and isinstance(node.ctx, ast.Load)
        ):
            uses.append((node.lineno, bound[node.value.id], node.attr))
    return uses


def _exists(module: str, name: str | None) -> bool:
    """Whether `from module import name` (or `module.name`, a submodule too) works."""
    try:
        try:
            target: object = importlib.import_module(module)
        except ModuleNotFoundError:  # `module` ends with a name bound in its parent
            parent, _, last = module.rpartition(".")
            target = getattr(importlib.import_module(parent), last)
        if name is None or hasattr(target, name):
            return True
        importlib.import_module(f"{module}.{name}")
        return True
    except (ImportError, AttributeError):
        return False


def test_there_are_scripts() -> None:
    names = {s.name for s in SCRIPTS}
    assert {"bench_onnx.py", "bench_small_step.py", "bench_request.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_script_names_exist(script: Path) -> None:
    tree = ast.parse(script.read_text(), filename=str(script))
    missing = [
        f"bench/{script.name}:{line}: {module}{'.' + name if name else ''}"
        for line, module, name in _uses(tree)
        if not _exists(module, name)
    ]
    assert not missing, "names the project no longer has:\n" + "\n".join(missing)


def test_a_missing_name_is_found() -> None:
    """The check itself: a script importing a name the engine lacks, and one reading an
    attribute a module lacks, are both reported; real names are not."""
    source = (
        "import engine as gt\n"
        "from engine.language import compile_definition, no_such_function\n"
        "gt.GradientTape\n"
        "gt.no_such_attribute\n"
    )
    missing = {(m, n) for _, m, n in _uses(ast.parse(source)) if not _exists(m, n)}
    assert missing == {("engine.language", "no_such_function"), ("engine", "no_such_attribute")}
