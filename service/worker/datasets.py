"""Datasets inside a worker: the arrays that inputs bound to a dataset refer to, kept hot
in memory (LRU within a byte budget) and read from the store's SQLite file on a miss.

An input bound to a dataset reaches the worker as a reference (store.is_ref): the blob
(the content hash of the array's bytes), its dtype and shape, and the rows to take; from
an in-memory store (':memory:', which no worker can open) the array itself comes along. The
cache is keyed by the blob, so a dataset replaced under the same name is never served
stale: its new arrays have new hashes. Rows are taken here, in the worker (the HTTP side
does no array work): a list of row indices or a slice {start, stop, step} of axis 0.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from service.core.store import is_ref, rows_problem
from service.core.wire import from_bytes


class DatasetUnavailable(Exception):
    """A bound array the worker cannot find (its store is not on disk, or it is gone)."""


class DatasetCache:
    def __init__(self, store_path: str | None, budget: int):
        self.store_path = store_path if store_path and store_path != ":memory:" else None
        self.budget = budget
        self.held = 0
        self._arrays: OrderedDict[str, np.ndarray] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def array(self, blob: str) -> np.ndarray:
        with self._lock:
            found = self._arrays.get(blob)
            if found is not None:
                self._arrays.move_to_end(blob)
                self.hits += 1
                return found
        self.misses += 1
        array = self._read(blob)
        with self._lock:
            self._arrays[blob] = array
            self.held += array.nbytes
            # Least recently used out first; the array just read stays even when it alone
            # is over the budget (the request needs it).
            while self.held > self.budget and len(self._arrays) > 1:
                _, old = self._arrays.popitem(last=False)
                self.held -= old.nbytes
        return array

    def _read(self, blob: str) -> np.ndarray:
        if self.store_path is None:
            raise DatasetUnavailable(
                "datasets need a store on disk; this server's store_path is ':memory:'"
            )
        if self._db is None:
            uri = f"file:{self.store_path}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        row = self._db.execute(
            "SELECT dtype, shape, data FROM blobs WHERE hash = ?", (blob,)
        ).fetchone()
        if row is None:
            raise DatasetUnavailable(f"the array {blob[:12]}... is no longer stored")
        dtype, shape, data = row
        array = from_bytes(data, dtype, json.loads(shape))
        array.flags.writeable = False  # shared by every request that binds it
        return array

    def info(self) -> dict[str, Any]:
        return {
            "arrays": len(self._arrays),
            "bytes": self.held,
            "budget": self.budget,
            "hits": self.hits,
            "misses": self.misses,
        }


def take_rows(array: np.ndarray, rows: Any, where: str) -> np.ndarray:
    """The rows of axis 0 that `rows` selects (None: all); ValueError naming the bound
    (the HTTP side checked them already, naming the client's field: this is for a tape
    rebuilt here, whose dataset may have changed since)."""
    if rows is None:
        return array
    problem = rows_problem(rows, array.shape)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    if isinstance(rows, Mapping):
        return array[rows.get("start") : rows.get("stop") : rows.get("step")]
    return array[np.asarray(rows, dtype=np.int64)]


def resolve(
    definition: Mapping[str, Any], cache: DatasetCache, section: str = "inputs"
) -> dict[str, Any]:
    """The definition with every bound input replaced by its array (rows taken);
    `section` names the inputs in errors."""
    inputs = definition.get("inputs") or {}
    if not any(is_ref(v) for v in inputs.values()):
        return dict(definition)
    resolved = {}
    for name, value in inputs.items():
        if is_ref(value):
            where = f"{section}.{name} (dataset {value['dataset']!r}, array {value['array']!r})"
            # The array itself comes along from an in-memory store (store.attach).
            array = value["value"] if "value" in value else cache.array(value["blob"])
            resolved[name] = take_rows(array, value.get("rows"), where)
        else:
            resolved[name] = value
    return {**definition, "inputs": resolved}
