"""The files prometheus_client's multiprocess mode writes in PROMETHEUS_MULTIPROC_DIR
(`counter_<pid>.db`, `gauge_livesum_<pid>.db`, ...): which they are, and the directory
readied for a run. Apart from service/domain/metrics.py so that `gradtape serve` readies
the directory before anything imports prometheus_client (which reads the variable then)."""

from __future__ import annotations

import re
from pathlib import Path

METRIC_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_(\d+)\.db")


def metric_files(directory: Path) -> list[Path]:
    """The metric files in `directory`: only these are read or removed, whatever else an
    operator keeps there."""
    return [f for f in directory.iterdir() if METRIC_FILE.fullmatch(f.name)]


def prepare(directory: Path) -> None:
    """The directory made, and emptied of an earlier run's metric files: their counts
    would otherwise be added to this run's."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in metric_files(directory):
        stale.unlink()
