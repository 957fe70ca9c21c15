"""How the suite runs in parallel (pytest-xdist, `python -m pytest -n auto`, the README's
test command): which tests share a worker process, and how many workers `auto` means.

A worker is a pytest process of its own, with its own session fixtures (each starts its
own `gradtape serve` on a free port, its own temporary store). So the unit handed to a
worker is a whole test file, in collection order: a file's module-scoped servers and
virtualenvs are made once, as in a serial run. Files that share something beyond a
process are handed out together, as one unit, to one worker: test_clean_install.py
checks what the README's first set-up command installed in the session's `install`
virtualenv, and test_setup_order.py then runs the second command in that same
virtualenv, last (tests/deploy/conftest.py orders them): one worker, so the virtualenv
is built once and the order holds.

Two Rays at once are fine: each server starts its own (`address="local"`, ports Ray
picks), and test_ray.py already runs clusters of ray.cluster_utils beside its module's
Ray; so test_ray.py and test_examples.py's Ray example may run on two workers at once.

pytest-xdist's own `--dist loadgroup` (its `xdist_group` mark) does not work with
pytest 9.2: it renames the items (`item._nodeid`), which pytest 9.2 no longer reads, so
every test became a unit of its own (a module-scoped server started on every worker that
ran one of its tests, the two install files on two workers). Hence the scheduler here.
Without `-n` (a plain `python -m pytest tests/x.py`) none of this is used.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

# The workers' kernel warm-up (engine/kernels/warmup.py) is off in the suite, which starts
# workers hundreds of times: each would load every kernel (~1 s of CPU with numba's
# import) beside the tests' own work. The kernels then compile, or load, at their first
# use, as with the setting off. tests/service/test_kernel_warmup.py turns it on.
os.environ.setdefault("GRADTAPE_WORKER_WARM_KERNELS", "false")

# Files handed to one worker together (see above). Paths as pytest's node ids spell them.
SHARED_WORKER = {
    "tests/deploy/test_clean_install.py": "install",
    "tests/deploy/test_setup_order.py": "install",
}

# Units started first, longest first (a full run with `-n 4` at load 12-17): a long unit
# started last would run on alone while the other workers sit idle.
LONG_UNITS = [
    "tests/service/test_ray.py",  # 1,030 s: Rays, clusters, actors killed and restarted
    "install",  # 640 s: a fresh virtualenv, the README's two installs, servers in it
    "tests/deploy/test_guides.py",  # 440 s: every guide's blocks, the benchmarks' runs
    "tests/bridge/test_bridge.py",  # 270 s: PyTorch modules exported and compared
    "tests/examples/test_examples.py",  # 250 s: the examples, one on a local Ray
    "tests/bridge/test_zoo.py",  # 220 s
]

# Workers for `-n auto`: one per core (CI and the developers' machines have 2), at
# least 2, at most 8. The suite computes more than it waits: 647 of its service and SDK
# tests took 301 s on 2 workers and 314 s on 4 on the 2-core machine, so workers beyond
# the cores only add servers (each worker starts its own) competing for the same cores.
MIN_AUTO_WORKERS, MAX_AUTO_WORKERS = 2, 8


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the shared group naming it."""
    path = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(path, path)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(MIN_AUTO_WORKERS, min(MAX_AUTO_WORKERS, cores or 1))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The work units above for `-n N` with the default `--dist load` (or `loadfile`,
    `loadgroup`); `--dist each` or `loadscope` keep xdist's own schedulers."""
    if config.getvalue("dist") not in ("load", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # xdist hands out the queued units in collection order: the long ones first.
            for unit in reversed(LONG_UNITS):
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            scope, work_unit = self.workqueue.popitem(last=False)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            # Every item of the unit, by index. Node ids can repeat: under pytest 9.2 each
            # API operation's schemathesis item is `test_schemathesis.py::test_api`, and
            # xdist's own `collection.index(nodeid)` sent the first of the 44 alone.
            pending = {nodeid for nodeid, done in work_unit.items() if not done}
            collection = self.registered_collections[node]
            node.send_runtest_some([i for i, n in enumerate(collection) if n in pending])

    return SharedWorkerScheduling(config, log)
