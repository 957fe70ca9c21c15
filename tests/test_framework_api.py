"""The service uses FastAPI and Starlette through their documented API only, checked over
the code (ast, nothing of ours is imported): no private attribute of theirs is read or
written (`request._body`, `getattr(request, "_json")`, `self._body` in a subclass of
their Request), and nothing is imported from their internals (fastapi.dependencies,
a `_module`, a `_name`). Our bound is `fastapi>=0.115` with no ceiling: a release that
changes an internal would otherwise break a user's fresh install, every compute route a
500 (service/api/bodies.py's BoundedRequest is how the body reaches FastAPI instead)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("fastapi", "starlette")

# The FastAPI modules its documentation imports from, and the names it imports (None:
# every public name). fastapi.routing is documented for APIRoute/APIRouter only ("Custom
# Request and APIRoute class"); its get_request_handler & co. are internals.
FASTAPI_DOCUMENTED: dict[str, set[str] | None] = {
    "fastapi": None,
    "fastapi.routing": {"APIRoute", "APIRouter"},
    "fastapi.exceptions": None,
    "fastapi.exception_handlers": None,
    "fastapi.security": None,
    "fastapi.responses": None,
    "fastapi.requests": None,
    "fastapi.websockets": None,
    "fastapi.background": None,
    "fastapi.encoders": {"jsonable_encoder"},
    "fastapi.concurrency": {"run_in_threadpool"},
    "fastapi.staticfiles": None,
    "fastapi.templating": None,
    "fastapi.testclient": None,
    "fastapi.middleware": None,
    "fastapi.middleware.cors": None,
    "fastapi.middleware.gzip": None,
    "fastapi.middleware.trustedhost": None,
    "fastapi.middleware.httpsredirect": None,
    "fastapi.openapi.utils": {"get_openapi"},  # "Extending OpenAPI"
    "fastapi.openapi.docs": None,  # "Custom Docs UI Static Assets"
}
# Names that objects commonly bound to the frameworks' classes go by in our code: any
# private attribute on them is theirs (even one a future release adds).
FRAMEWORK_OBJECTS = {"request", "req", "response", "app", "route", "router", "websocket", "conn"}
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def framework_roots() -> list[Path]:
    """The installed FastAPI's and Starlette's source directories."""
    roots = []
    for package in FRAMEWORKS:
        spec = importlib.util.find_spec(package)
        assert spec and spec.submodule_search_locations, package
        roots.append(Path(next(iter(spec.submodule_search_locations))))
    return roots


def framework_private_names(roots: list[Path] | None = None) -> set[str]:
    """Every private attribute the frameworks (default: the installed FastAPI and
    Starlette) define on a class or set on an instance (`self._body = ...`), read from
    their source."""
    names: set[str] = set()
    for root in framework_roots() if roots is None else roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id in {"self", "cls"} and _private(node.attr):
                        names.add(node.attr)
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        targets = (
                            [item.name]
                            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                            else [item.target.id]
                            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                            else [
                                t.id
                                for t in (item.targets if isinstance(item, ast.Assign) else [])
                                if isinstance(t, ast.Name)
                            ]
                        )
                        names |= {t for t in targets if _private(t)}
    return names


def _framework_classes(tree: ast.Module) -> set[str]:
    """The module's names for framework classes: imported from fastapi/starlette, and our
    classes deriving from them (here, at any depth)."""
    found = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS
        for alias in node.names
    }
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name not in found:
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                bases |= {b.attr for b in node.bases if isinstance(b, ast.Attribute)}
                if bases & found:
                    found.add(node.name)
                    changed = True
    return found


def _import_violations(node: ast.AST, where: str) -> list[str]:
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in FRAMEWORKS and (
                any(map(_private, parts))
                or (parts[0] == "fastapi" and alias.name not in FASTAPI_DOCUMENTED)
            ):
                found.append(f"{where} imports {alias.name}, not documented API")
    elif isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        parts = module.split(".")
        if parts[0] not in FRAMEWORKS:
            return found
        if any(map(_private, parts)):
            found.append(f"{where} imports from {module}, a private module")
        elif parts[0] == "fastapi":
            if module not in FASTAPI_DOCUMENTED:
                found.append(f"{where} imports from {module}, FastAPI's internals")
                return found
            allowed = FASTAPI_DOCUMENTED[module]
            for alias in node.names:
                if allowed is not None and alias.name not in allowed:
                    found.append(f"{where} imports {module}.{alias.name}, not documented API")
        for alias in node.names:
            if _private(alias.name):
                found.append(f"{where} imports {module}.{alias.name}, a private name")
    return found


def violations(path: Path, private: set[str]) -> list[str]:
    """Every use of a framework internal in the file at `path`."""
    where_file = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    tree = ast.parse(path.read_text(), str(path))
    classes = _framework_classes(tree)
    # A private name of theirs on an object of any name counts only in a module that uses
    # the frameworks: elsewhere (service/domain/jobs.py's job._writer) it is our own
    # attribute, whatever names a release of theirs adds (review r10).
    uses_frameworks = bool(classes) or any(
        isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (name or "").split(".")[0] in FRAMEWORKS
            for name in (
                [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            )
        )
        for node in ast.walk(tree)
    )
    if not uses_frameworks:
        private = set()
    subclass_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            subclass_nodes |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        where = f"{where_file}:{getattr(node, 'lineno', 0)}"
        found += _import_violations(node, where)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "fastapi":
                if f"fastapi.{node.attr}" not in FASTAPI_DOCUMENTED and not node.attr[:1].isupper():
                    found.append(f"{where} uses fastapi.{node.attr}, FastAPI's internals")
            if not _private(node.attr):
                continue
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in {"self", "cls"}:
                # Our own privates, unless in a subclass of theirs, where theirs are off limits.
                if id(node) in subclass_nodes and node.attr in private:
                    found.append(f"{where} {base}.{node.attr}: a private attribute of theirs")
            elif base in FRAMEWORK_OBJECTS or node.attr in private:
                found.append(f"{where} {ast.unparse(node)}: a private attribute of theirs")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ACCESSORS and len(node.args) >= 2:
                name = node.args[1]
                if (
                    isinstance(name, ast.Constant)
                    and isinstance(name.value, str)
                    and _private(name.value)
                    and (name.value in private or ast.unparse(node.args[0]) in FRAMEWORK_OBJECTS)
                ):
                    found.append(f"{where} {ast.unparse(node)}: a private attribute of theirs")
    return found


def test_the_service_uses_only_the_frameworks_documented_api() -> None:
    private = framework_private_names()
    found = [
        v for path in sorted((ROOT / "service").rglob("*.py")) for v in violations(path, private)
    ]
    assert not found, "\n".join(found)


def test_the_private_names_are_found(tmp_path: Path) -> None:
    """What framework_private_names reads from a package's source (a stand-in package:
    the installed frameworks' internals may change without our using them)."""
    package = tmp_path / "framework"
    package.mkdir()
    (package / "requests.py").write_text(
        "class Request:\n"
        "    _cache: dict = {}\n"
        "    _size: int\n"
        "    def __init__(self):\n"
        "        self._body = b''\n"
        "        self.public = 1\n"
        "    def _parse(self):\n"
        "        return cls._shared\n"
        "    def __len__(self):\n"
        "        return 0\n"
    )
    assert framework_private_names([package]) == {"_cache", "_size", "_body", "_parse", "_shared"}
    assert framework_private_names()  # the installed frameworks' source is found and read


def test_a_module_that_does_not_use_the_frameworks_keeps_its_own_private_names(
    tmp_path: Path,
) -> None:
    # A release of theirs adding `self._writer` must not fail our jobs module (review r10).
    path = tmp_path / "jobs.py"
    path.write_text("class Job:\n    pass\n\ndef finish(job):\n    job._writer.close()\n")
    assert violations(path, framework_private_names() | {"_writer"}) == []
    path.write_text("from fastapi import Request\n\ndef finish(job):\n    job._writer.close()\n")
    assert len(violations(path, {"_writer"})) == 1


def test_the_checks_catch_each_kind_of_access(tmp_path: Path) -> None:
    """The checker itself: every way in to an internal, in a probe file, is found once."""
    path = tmp_path / "probe.py"
    lines = [
        "from fastapi import Request",  # (documented: not a violation)
        "from fastapi.routing import APIRoute",  # (documented)
        "from fastapi.dependencies.utils import solve_dependencies",
        "from fastapi.routing import get_request_handler",
        "from starlette._utils import is_async_callable",
        "from starlette.requests import _CachedRequest",
        "import fastapi._compat",
        "request._body = b''",
        "value = request._json",
        "hasattr(request, '_json')",
        "getattr(thing, '_stream_consumed', None)",
        "receive = conn._anything_new",
        "print(other._receive)",
        "class Mine(Request):",
        "    async def body(self):",
        "        self._body = b''",
        "        self._mine = 1",  # (ours: not a violation)
        "        return self._body",
        "class Ours:",
        "    def f(self):",
        "        return self._body",  # (our own class: its own attribute)
    ]
    path.write_text("\n".join(lines) + "\n")
    found = violations(path, framework_private_names())
    lines_found = sorted(int(v.split(":")[1].split()[0]) for v in found)
    assert lines_found == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 18], found
