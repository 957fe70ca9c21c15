"""A request as the HTTP process hands it to the pool: its worker payload (arrays
decoded, limits applied: service/api/payloads.py builds it), its time limit, how to
write the answer, and the inputs still to be bound to stored datasets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.core.wire import Encoding


@dataclass(frozen=True)
class Binding:
    """Inputs a definition binds to a stored dataset, not yet looked up: one array (as
    input `name`), or every array (`name` and `array` None), with the rows to take."""

    dataset: str
    name: str | None
    array: str | None
    rows: Any
    field: str


@dataclass(frozen=True)
class Prepared:
    """What a route hands the pool, and how to write the answer's tensors. `bindings`:
    the dataset inputs of payload["definition"], for DatasetCatalog.bind to look up."""

    payload: dict[str, Any]
    time_limit: float
    encoding: Encoding
    bindings: list[Binding] = field(default_factory=list)
