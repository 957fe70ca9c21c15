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
    (
        "engine.backend",
        "engine.registry",
        "engine.trace",
        "engine.tree",
        "engine.allocator",
        "engine.footprint",
        "engine.shapes",
        "engine.kernels",
    ),
    ("engine.tensor",),
    ("engine.ops", "engine.random"),
    ("engine.tape",),
    ("engine.forward", "engine.replay"),
    ("engine.transforms", "engine.jit", "engine.testing", "engine"),
    (
        "engine.hessian_algorithms",
        "engine.curvature",
        "engine.per_example",
        "engine.kfac",
        "engine.laplace",
        "engine.onnx",
    ),
    ("engine.language",),
]

# The service: what each package may import (itself included). worker and pool both sit
# on core and never import each other, except the local pool's spawn entry point, which
# imports the worker's loop inside the child process, and the Ray pool's actor, which
# imports the worker's compute inside the actor's process (EXCEPTIONS).
SERVICE_MAY_IMPORT: dict[str, set[str]] = {
    "service.core": {"service.core"},
    "service.worker": {"service.core", "service.worker"},
    "service.pool": {"service.core", "service.pool"},
    "service.domain": {"service.core", "service.pool", "service.domain"},
    "service.api": {"service.core", "service.pool", "service.domain", "service.api"},
    "service.cli": {"service.core", "service.api"},
    "service": set(),
}
EXCEPTIONS = {
    ("service.pool.local", "service.worker.main"),  # in _run_worker, in the child
    ("service.pool.ray", "service.worker.compute"),  # in EngineActor, in the actor
    ("service.pool.ray", "service.worker.dispatch"),
}

# Third-party packages the engine may import: the array libraries, lazily the ONNX
# importer's, and numba (engine/kernels only, lazily). None of the service's (fastapi,
# pydantic, msgpack, ...).
ENGINE_THIRD_PARTY = {"numpy", "cupy", "cupyx", "onnx", "google", "scipy", "numba"}


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


ALL = {**modules("engine"), **modules("service")}


def imports(name: str, path: Path, runtime: bool = False) -> list[tuple[str, int]]:
    """(module imported, line) for every import in the file, at any depth; `from X import
    y` counts as X.y where X.y is a module of ours, else as X. `runtime`: leave out the
    imports under `if TYPE_CHECKING:`, which never run."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if runtime:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
            inside = module == prefix or (prefix != "engine" and module.startswith(prefix + "."))
            if inside and (best is None or len(prefix) > best[1]):
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


def violations(name: str, path: Path) -> list[str]:
    """Every import of module `name` (at `path`) that breaks a rule of ARCHITECTURE.md."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for target, line in imports(name, path):
        top = target.split(".")[0]
        if name.startswith("engine"):
            if top == "service":
                found.append(f"{where}:{line} the engine imports the service ({target})")
            elif top == "engine" and engine_floor(target) > engine_floor(name):
                found.append(
                    f"{where}:{line} {name} (floor {engine_floor(name)}) imports "
                    f"{target} (floor {engine_floor(target)})"
                )
            elif top not in stdlib | ENGINE_THIRD_PARTY | {"engine"}:
                found.append(f"{where}:{line} the engine imports {target}")
            continue
        mine = service_package(name)
        if top == "engine" and mine != "service.worker":
            found.append(f"{where}:{line} {name} imports the engine outside service/worker")
        ours = target.startswith("service.") and (name, target) not in EXCEPTIONS
        if ours and service_package(target) not in SERVICE_MAY_IMPORT[mine]:
            found.append(f"{where}:{line} {mine} imports {target}")
    return found


def test_imports_run_downward_only() -> None:
    """No upward import, no engine in the HTTP process's packages, no service package in
    the engine. (Imports by name at run time, importlib.import_module, are not seen: the
    code has none, and a review would ask why.)"""
    found = [v for name, path in ALL.items() for v in violations(name, path)]
    assert not found, "\n".join(found)


def test_no_import_cycles() -> None:
    """No circle among our modules, at any depth of the file (an import inside a function
    or at the bottom of a file still ties the two modules together); imports for type
    checking only do not run, and do not count."""
    graph = {
        name: {t for t, _ in imports(name, path, runtime=True) if t in ALL and t != name}
        for name, path in ALL.items()
    }
    graph = {
        name: {t for t in targets if (name, t) not in EXCEPTIONS} for name, targets in graph.items()
    }
    # Importing a package runs its __init__: a module importing its own package is not a
    # cycle unless the package imports it back, which the search below finds.
    done: set[str] = set()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(" -> ".join([*path[path.index(node) :], node]))
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    packages = {n for n, p in ALL.items() if p.name == "__init__.py"}
    real = [c for c in cycles if not _through_a_package_facade(c, packages)]
    assert not real, "\n".join(real)


def _through_a_package_facade(cycle: str, packages: set[str]) -> bool:
    """A package's __init__ re-exporting its modules, one of which imports a sibling
    through the package (`from engine import backend`): Python resolves that, and it
    is how a facade works, not a tie between two floors."""
    return any(step in packages for step in cycle.split(" -> "))


def test_the_checks_catch_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: upward imports in a probe file of each package are found."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from service.api.app import create_app\nfrom engine.language import x\nimport fastapi\n"
    )
    domain = violations("service.domain.probe", path)
    assert any("imports service.api.app" in v for v in domain), domain
    assert any("imports the engine outside" in v for v in domain), domain
    path.write_text("from engine.language import x\nimport fastapi\nimport service.core\n")
    engine = violations("engine.ops.probe", path)
    assert len(engine) == 3, engine


@pytest.mark.parametrize(
    "module",
    [
        "service.api.app",
        "service.pool.local",
        "service.cli",
        pytest.param("service.pool.ray", marks=pytest.mark.ray),
    ],
)
def test_the_http_process_never_loads_the_engine(module: str) -> None:
    """Importing the HTTP side loads no engine module (the workers alone compute)."""
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]", f"{module} loads {out}"


def test_the_wire_carries_exactly_the_engines_dtypes() -> None:
    """core/wire.DTYPES is the HTTP process's copy of the language's dtypes (it must not
    import the engine to ask): the two lists stay one fact."""
    from engine.language.definition import ALLOWED_DTYPES
    from service.core.wire import DTYPES

    assert set(DTYPES) == {d.name for d in ALLOWED_DTYPES}
