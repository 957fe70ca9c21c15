"""ARCHITECTURE.md's "Where to add things" stays true: every place it names exists, and
the code names an operation, a primitive or a pool backend in those places only (so
that adding one touches what the section says, and no list elsewhere is forgotten)."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import pytest

import engine as gt
import service.pool
from service.core import config, operations
from service.core.operations import OPERATIONS
from service.worker import dispatch, tapes

ROOT = Path(__file__).resolve().parents[1]
SECTION = (ROOT / "ARCHITECTURE.md").read_text().split("## Where to add things", 1)[1]
SECTION = SECTION.split("\n## ", 1)[0]

# The rows older than the table keep request aliases (service/api/schemas/algorithms.py);
# the sharded coordinator gives a solve its b and influence its own path.
NAMED_ALSO = {
    "tape_eigenvalues": {"service/api/schemas/algorithms.py"},
    "tape_trace": {"service/api/schemas/algorithms.py"},
    "tape_diagonal": {"service/api/schemas/algorithms.py"},
    "tape_spectral_density": {"service/api/schemas/algorithms.py"},
    "tape_solve": {"service/api/schemas/algorithms.py", "service/domain/shards.py"},
    "tape_influence": {"service/api/schemas/algorithms.py", "service/domain/shards.py"},
}
TABLE = "service/core/operations.py"


def source_files() -> list[Path]:
    roots = [ROOT / "service", ROOT / "engine", ROOT / "clients" / "python" / "gradtape"]
    return [p for root in roots for p in root.rglob("*.py")]


def test_every_named_place_exists() -> None:
    named = re.findall(r"`([\w./<>-]+/[\w./<>-]*)`", SECTION)
    assert len(named) >= 12, named
    for place in named:
        concrete = place.split("<", 1)[0]  # `engine/ops/<family>.py`: its folder
        assert (ROOT / concrete).exists(), f"ARCHITECTURE.md names {place}, which is not there"


@pytest.mark.parametrize("op", OPERATIONS, ids=[op.kind for op in OPERATIONS])
def test_an_operation_lives_in_its_row_and_its_function(op: operations.Operation) -> None:
    # The row's options and result are declared beside it; its function in tapes.py.
    assert op.options.__module__ == operations.__name__
    if not isinstance(op.result, str):
        assert op.result.__module__ == operations.__name__
    # Its function: in service/worker/tapes.py, or a module beside it that registers
    # through tapes.operation (curvature_ops.py).
    assert dispatch.HANDLERS  # every row's function registered (the worker's handler table)
    module = tapes.OPERATION_FUNCTIONS[op.kind].__module__
    assert module.startswith("service.worker."), module
    function = module.replace(".", "/") + ".py"
    # Nothing else names it: routes, handlers, dispatch, sharding, SDK come from the row.
    naming = {str(p.relative_to(ROOT)) for p in source_files() if f'"{op.kind}"' in p.read_text()}
    allowed = {TABLE, function} | NAMED_ALSO.get(op.kind, set())
    assert {TABLE, function} <= naming <= allowed, (
        f"{op.kind} is named in {sorted(naming - allowed)}: add it through its table row "
        "(ARCHITECTURE.md, Where to add things), or say here why that place must name it"
    )


def test_the_section_names_the_four_places_of_an_operation() -> None:
    bullet = SECTION.split("**An operation on a tape**", 1)[1].split("\n- **", 1)[0]
    for place in (
        "engine/hessian_algorithms/",
        "service/core/operations.py",
        "service/worker/tapes.py",
        "openapi/openapi.json",
    ):
        assert f"`{place}" in bullet
    assert "4 files" in bullet


def test_a_primitive_lives_in_engine_ops() -> None:
    assert "`engine/ops/<family>.py`" in SECTION and "`tests/engine/test_ops.py`" in SECTION
    for name, info in gt.public_ops.items():
        assert info.fn.__module__.startswith("engine.ops."), (name, info.fn.__module__)


def test_a_pool_backend_is_a_module_a_make_pool_branch_and_an_executor() -> None:
    chooser = inspect.getsource(service.pool.make_pool)
    executors = typing.get_args(config.Settings.model_fields["executor"].annotation)
    for value in executors:
        assert value == "local" or f'"{value}"' in chooser, f"make_pool never picks {value}"
    shared = {"__init__", "base", "calls"}  # the protocol and what backends share
    for module in (ROOT / "service" / "pool").glob("*.py"):
        if module.stem in shared:
            continue
        assert f"service.pool.{module.stem} import" in chooser, (
            f"service/pool/{module.name} is no backend make_pool chooses"
        )
