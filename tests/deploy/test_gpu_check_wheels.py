"""bench/gpu_check.sh installs a wheelhouse onto PYTHONPATH, ahead of the machine's
site-packages: only the wheels of distributions the machine lacks go in
(bench/missing_wheels.py), never one that would shadow an installed package (it
installed every committed wheel once pytest was missing: pygments 2.21 over a system
Python's 2.14)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_wheels_of_missing_distributions_are_named(tmp_path: Path) -> None:
    committed = sorted(str(p) for p in (ROOT / "bench" / "wheels").glob("*.whl"))
    installed = [p for p in committed if Path(p).name.startswith(("pygments-", "pytest-"))]
    assert len(installed) == 2  # both are in this environment (the dev extra)
    absent = str(tmp_path / "no_such_distribution_gt-1.0-py3-none-any.whl")
    named = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "missing_wheels.py"), *installed, absent],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert named == [absent]
