"""The wheels, of those named, whose distribution this Python lacks (one path a line).

bench/gpu_check.sh installs a wheelhouse's packages onto PYTHONPATH, which comes before
the machine's site-packages: a wheel of a distribution the machine already has (pygments
or packaging beside pytest, typing_extensions beside fastapi) would shadow the version
its torch, CuPy or JAX were installed with. So only these are installed.

    python bench/missing_wheels.py WHEEL...
"""

from __future__ import annotations

import os
import sys
from importlib import metadata


def missing(paths: list[str]) -> list[str]:
    """The paths whose distribution (a wheel's name up to its first '-') is not installed."""
    out = []
    for path in paths:
        try:
            metadata.version(os.path.basename(path).split("-")[0])
        except metadata.PackageNotFoundError:
            out.append(path)
    return out


if __name__ == "__main__":
    print("\n".join(missing(sys.argv[1:])))
