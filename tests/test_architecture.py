"""The floors of ARCHITECTURE.md, checked over the code's own imports (ast, nothing is
imported): no import runs upward, the HTTP process never loads the engine, and the
engine needs none of the service's packages. A module that fits no floor fails here
until ARCHITECTURE.md and FLOORS below give it one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The engine, lowest floor first. A module may import its own floor and those below.
# `engine` itself (the package facade, `import engine as gt`) sits on the transforms
# floor: it exports everything up to there.
ENGINE_FLOORS: list[tuple[str, ...]] = [
    ("engine.backend", "engine.registry", "engine.trace", "engine.tree", "engine.allocator",
     "engine.footprint", "engine.shapes"),
    ("engine.tensor",),
    ("engine.ops", "engine.random"),
    ("engine.tape",),
    ("engine.forward",),
    ("engine.transforms", "engine.testing", "engine"),
    ("engine.hessian_algorithms", "engine.onnx"),
    ("engine.language",),
]

# The service: what each package may import (itself included). worker and pool both sit
# on core and never import each other, except the local pool's spawn entry point, which
# imports the worker's loop inside the child process (EXCEPTIONS).
SERVICE_MAY_IMPORT: dict[str, set[str]] = {
    "service.core": {"service.core"},
    "service.worker": {"service.core", "service.worker"},
    "service.pool": {"service.core", "service.pool"},
    "service.domain": {"service.core", "service.pool", "service.domain"},
    "service.api": {"service.core", "service.pool", "service.domain", "service.api"},
    "service.cli": {"service.core", "service.api"},
    "service": set(),
}
EXCEPTIONS = {("service.pool.local", "service.worker.main")}  # in _run_worker, in the child

# Third-party packages the engine may import: the array libraries and, lazily, the ONNX
# importer's. None of the service's (fastapi, pydantic, msgpack, ...).
ENGINE_THIRD_PARTY = {"numpy", "cupy", "cupyx", "onnx", "google", "scipy"}


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


ALL = {**modules("engine"), **modules("service")}


def imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, at any depth; `from X import
    y` counts as X.y where X.y is a module of ours, else as X."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in ALL else base, node.lineno))
    return found


def engine_floor(module: str) -> int:
    best = None
    for floor, prefixes in enumerate(ENGINE_FLOORS):
        for prefix in prefixes:
            if module == prefix or (prefix != "engine" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (floor, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is on no floor of ENGINE_FLOORS (ARCHITECTURE.md)")
    return best[0]


def service_package(module: str) -> str:
    for package in sorted(SERVICE_MAY_IMPORT, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    raise AssertionError(f"{module} is in no package of SERVICE_MAY_IMPORT (ARCHITECTURE.md)")


def test_every_module_has_a_floor() -> None:
    for name in ALL:
        engine_floor(name) if name.startswith("engine") else service_package(name)


def test_engine_imports_run_downward_only() -> None:
    upward = []
    for name, path in modules("engine").items():
        for target, line in imports(name, path):
            top = target.split(".")[0]
            if top == "service":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports the service ({target})")
            elif top == "engine" and engine_floor(target) > engine_floor(name):
                upward.append(f"{path.relative_to(ROOT)}:{line} {name} (floor "
                              f"{engine_floor(name)}) imports {target} (floor "
                              f"{engine_floor(target)})")
    assert not upward, "\n".join(upward)


def test_engine_needs_none_of_the_services_packages() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    foreign = []
    for name, path in modules("engine").items():
        for target, line in imports(name, path):
            top = target.split(".")[0]
            if top not in stdlib and top != "engine" and top not in ENGINE_THIRD_PARTY:
                foreign.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not foreign, "\n".join(foreign)


def test_service_imports_run_downward_only() -> None:
    upward = []
    for name, path in modules("service").items():
        mine = service_package(name)
        for target, line in imports(name, path):
            if target.split(".")[0] == "engine" and mine != "service.worker":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports the engine outside "
                              "service/worker")
            if not target.startswith("service.") or (name, target) in EXCEPTIONS:
                continue
            theirs = service_package(target)
            if theirs not in SERVICE_MAY_IMPORT[mine]:
                upward.append(f"{path.relative_to(ROOT)}:{line} {mine} imports {target}")
    assert not upward, "\n".join(upward)


def test_the_checks_catch_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import in a file of a package is found."""
    path = tmp_path / "probe.py"
    path.write_text("from service.api.app import create_app\nfrom engine.language import x\n")
    found = [t for t, _ in imports("service.domain.probe", path)]
    assert "service.api.app" in found and "engine.language" in found
    assert service_package("service.api.app") not in SERVICE_MAY_IMPORT["service.domain"]
    assert engine_floor("engine.language.parse") > engine_floor("engine.ops.shape")


@pytest.mark.parametrize("module", ["service.api.app", "service.pool.local", "service.cli"])
def test_the_http_process_never_loads_the_engine(module: str) -> None:
    """Importing the HTTP side loads no engine module (the workers alone compute)."""
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]", f"{module} loads {out}"


def test_the_wire_carries_exactly_the_engines_dtypes() -> None:
    """core/wire.DTYPES is the HTTP process's copy of the language's dtypes (it must not
    import the engine to ask): the two lists stay one fact."""
    from engine.language.definition import ALLOWED_DTYPES
    from service.core.wire import DTYPES

    assert set(DTYPES) == {d.name for d in ALLOWED_DTYPES}
