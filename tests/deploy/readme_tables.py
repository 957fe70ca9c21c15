"""The documentation's generated tables: the settings (from service/core/config.py's
Settings), the problem types (from service/api/problems.py) and the Prometheus metrics
(from service/domain/metrics.py), between their markers in the README or the site's
guides (docs/guides/settings.md, errors.md, monitoring.md). test_guides.py
fails when a copy differs; regenerate every copy with

    python -m tests.deploy.readme_tables
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from prometheus_client.metrics import MetricWrapperBase
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from service.api.problems import PROBLEM_TYPES
from service.cli import SERVE_FLAGS
from service.core.config import Settings
from service.domain.metrics import Metrics

README = Path(__file__).resolve().parents[2] / "README.md"
TABLES = ("settings", "problems", "metrics")


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(_type(a) for a in args)
    if origin is dict:
        return "JSON object"
    names = {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        Path: "path",
        SecretStr: "secret str",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _size(value: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale and value % scale == 0:
            return f" ({value // scale} {unit})"
    return ""


def _default(name: str, info: FieldInfo) -> str:
    if info.default_factory is not None and info.default is PydanticUndefined:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, Path):
            return "see meaning"
    else:
        value = info.default
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    text = f"`{json.dumps(value)}`" if not isinstance(value, str) else f"`{value}`"
    if value == "":
        text = "empty"
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and name.endswith(("_bytes", "_budget", "bytes_per_key"))
    ):
        text += _size(value)
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def settings_table() -> str:
    """One row per Settings field; the `gradtape serve` flag where there is one (its help
    stands in for a missing description)."""
    flags = {field: (flag, help_) for flag, (field, _, help_) in SERVE_FLAGS.items()}
    flags["access_log"] = ("--no-access-log", "log each request")
    rows = ["| Variable | Flag | Type | Default | Meaning |", "|---|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        flag, help_ = flags.get(name, ("", ""))
        meaning = _cell(info.description or help_)
        rows.append(
            f"| `GRADTAPE_{name.upper()}` | {f'`{flag}`' if flag else ''} | "
            f"{_type(info.annotation)} | {_default(name, info)} | {meaning} |"
        )
    return "\n".join(rows)


def problems_table() -> str:
    rows = ["| Status | `type` | `title` | When |", "|---|---|---|---|"]
    for slug, kind in sorted(PROBLEM_TYPES.items(), key=lambda kv: (kv[1].status, kv[0])):
        description = kind.description
        rows.append(
            f"| {kind.status} | `/problems/{slug}` | {_cell(kind.title)} | {_cell(description)} |"
        )
    return "\n".join(rows)


# The series a metric family exposes, by type (prometheus_client's text format; each
# counter and histogram also exposes a `_created` timestamp).
SERIES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


def metrics_table() -> str:
    """One row per metric family the service registers, in declaration order. The label
    names are read from prometheus_client's `_labelnames`: it has no public accessor."""
    rows = ["| Series | Type | Labels | Meaning |", "|---|---|---|---|"]
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        kind = metric._type
        series = ", ".join(f"`{metric._name}{suffix}`" for suffix in SERIES[kind])
        labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "none"
        rows.append(f"| {series} | {kind} | {labels} | {_cell(metric._documentation)} |")
    return "\n".join(rows)


def marked(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- {name}-table: generated[^>]*-->\n)(.*?)(<!-- /{name}-table -->)", re.DOTALL
    )


def current(text: str, name: str) -> str | None:
    match = marked(name).search(text)
    return match.group(2).rstrip("\n") if match else None


def expected(name: str) -> str:
    return {"settings": settings_table, "problems": problems_table, "metrics": metrics_table}[
        name
    ]()


def write(path: Path = README) -> None:
    text = path.read_text()
    for name in TABLES:
        text = marked(name).sub(
            lambda m, n=name: m.group(1) + expected(n) + "\n" + m.group(3), text
        )
    path.write_text(text)


def holders() -> list[Path]:
    """The README and the guides that hold a generated table."""
    candidates = [README, *sorted((README.parent / "docs" / "guides").glob("*.md"))]
    return [p for p in candidates if any(marked(n).search(p.read_text()) for n in TABLES)]


if __name__ == "__main__":
    for path in [Path(a) for a in sys.argv[1:]] or holders():
        write(path)
