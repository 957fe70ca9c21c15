"""The embedded store: tapes (their definitions, data and usage) and named models, in
one SQLite file (stdlib sqlite3), so that a lost worker or a restarted service loses
nothing a client made.

Arrays are stored as their raw little-endian, row-major bytes with dtype and shape in
their own columns, content-addressed (a blob is kept once however many definitions use
it); nothing is pickled. A definition row holds the program lines and user functions as
JSON; its tensors are rows of `definition_tensors` pointing at blobs. A tape that ended
(expired, evicted, deleted) keeps its row as a tombstone, without its definition, so its
id can still say why it is gone.

    store = Store(path); store.open()
    digest = store.put_definition(definition)      # the worker form: arrays are NumPy
    store.get_definition(digest)                   # -> the same structure

The methods block (SQLite is fast, but a definition may be tens of MB): the async side
calls them through asyncio.to_thread. One connection, guarded by a lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.core.wire import from_bytes, to_bytes

SCHEMA_VERSION = 4
# What each older version lacks, applied in order on open (the tapes' model output; the
# shards of a sharded tape; the tapes' version, which several HTTP processes compare).
# Tables a version adds (jobs, processes, rate_buckets) come with the SCHEMA script.
MIGRATIONS = {
    1: ["ALTER TABLE tapes ADD COLUMN output TEXT"],
    2: ["ALTER TABLE tapes ADD COLUMN shards TEXT"],
    3: ["ALTER TABLE tapes ADD COLUMN version INTEGER NOT NULL DEFAULT 0"],
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    hash  TEXT PRIMARY KEY,  -- sha256 of dtype, shape and bytes
    dtype TEXT NOT NULL,     -- NumPy dtype name: float32, int64, bool, ...
    shape TEXT NOT NULL,     -- JSON list of dimensions
    data  BLOB NOT NULL      -- little-endian, row-major bytes
);
CREATE TABLE IF NOT EXISTS definitions (
    hash      TEXT PRIMARY KEY,  -- sha256 of the lines, functions and tensors
    program   TEXT NOT NULL,     -- JSON list of lines
    functions TEXT NOT NULL,     -- JSON: name -> {params, forward, backward, output}
    created   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS definition_tensors (
    definition TEXT NOT NULL REFERENCES definitions(hash) ON DELETE CASCADE,
    section    TEXT NOT NULL CHECK (section IN ('variables', 'inputs')),
    name       TEXT NOT NULL,
    position   INTEGER NOT NULL,  -- order in the definition (default sources follow it)
    trainable  INTEGER,           -- variables only
    blob       TEXT NOT NULL REFERENCES blobs(hash),
    PRIMARY KEY (definition, section, name)
);
CREATE INDEX IF NOT EXISTS definition_tensors_blob ON definition_tensors(blob);
CREATE TABLE IF NOT EXISTS onnx_files (  -- imported ONNX models, content-addressed
    hash TEXT PRIMARY KEY,  -- sha256 of the file
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS definition_models (  -- a definition's imported models
    definition TEXT NOT NULL REFERENCES definitions(hash) ON DELETE CASCADE,
    name       TEXT NOT NULL,
    position   INTEGER NOT NULL,
    frozen     TEXT NOT NULL,  -- JSON list of initializer names
    file       TEXT NOT NULL REFERENCES onnx_files(hash),
    PRIMARY KEY (definition, name)
);
CREATE TABLE IF NOT EXISTS models (
    owner       TEXT NOT NULL,  -- sha256 of the API key ('' without keys)
    name        TEXT NOT NULL,
    definition  TEXT NOT NULL REFERENCES definitions(hash),
    description TEXT,
    info        TEXT NOT NULL,  -- JSON: what the program defines (names, shapes, dtypes)
    created     REAL NOT NULL,
    updated     REAL NOT NULL,
    PRIMARY KEY (owner, name)
);
CREATE TABLE IF NOT EXISTS tapes (
    id         TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    definition TEXT REFERENCES definitions(hash),  -- NULL once the tape ended
    model      TEXT,           -- the stored model it was made from, if any
    target     TEXT NOT NULL,
    sources    TEXT NOT NULL,  -- JSON: alias -> name, as resolved when recorded
    ttl        REAL NOT NULL,
    created    REAL NOT NULL,
    last_used  REAL NOT NULL,
    hits       INTEGER NOT NULL DEFAULT 0,
    bytes      INTEGER NOT NULL DEFAULT 0,
    worker     INTEGER NOT NULL,
    device     TEXT NOT NULL,
    rebuilds   INTEGER NOT NULL DEFAULT 0,
    state      TEXT NOT NULL CHECK (state IN ('live', 'expired', 'evicted', 'deleted')),
    ended      REAL,
    output     TEXT,           -- the model output it names (curvatures), if any
    shards     TEXT,           -- JSON: a sharded tape's parts, or a part's parent
    -- +1 at every change of its recording (new values, ended): an HTTP process whose
    -- copy has an older version records it again (http_workers > 1)
    version    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS tapes_owner ON tapes(owner, state);
-- Jobs, when several HTTP processes share the store: the process that runs one writes
-- its state, progress and answer here, any process reads them and asks for a cancel.
CREATE TABLE IF NOT EXISTS jobs (
    id        TEXT PRIMARY KEY,
    owner     TEXT NOT NULL,
    operation TEXT NOT NULL,
    tape_id   TEXT,
    encoding  TEXT NOT NULL,   -- the request's tensor encoding (the answer's default)
    created   REAL NOT NULL,
    state     TEXT NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed',
                                             'cancelled')),
    started   REAL,
    finished  REAL,
    progress  TEXT,            -- JSON
    result    BLOB,            -- the answer, msgpack (arrays as bytes: service/core/ipc.py)
    seconds   REAL,
    error     TEXT,            -- JSON: the problem body
    process   TEXT NOT NULL,   -- the boot token of the HTTP process running it
    cancel    INTEGER NOT NULL DEFAULT 0,  -- another process asked for a cancel
    version   INTEGER NOT NULL DEFAULT 0   -- +1 at every change (the events stream)
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner);
-- The HTTP processes sharing the store: a job whose process is gone has failed.
CREATE TABLE IF NOT EXISTS processes (
    token   TEXT PRIMARY KEY,  -- random, per process start
    pid     INTEGER NOT NULL,
    started REAL NOT NULL,     -- its start: /proc's clock ticks since boot (else a time)
    seen    REAL NOT NULL      -- its last heartbeat
);
-- Each API key's rate-limit bucket, shared by the HTTP processes (service/api/fairness.py).
CREATE TABLE IF NOT EXISTS rate_buckets (
    owner  TEXT PRIMARY KEY,
    tokens REAL NOT NULL,
    stamp  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS datasets (
    owner   TEXT NOT NULL,
    name    TEXT NOT NULL,
    version TEXT NOT NULL,     -- sha256 over its arrays' names and blobs
    bytes   INTEGER NOT NULL,  -- of all its arrays
    created REAL NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (owner, name)
);
CREATE TABLE IF NOT EXISTS dataset_arrays (
    owner    TEXT NOT NULL,
    dataset  TEXT NOT NULL,
    name     TEXT NOT NULL,
    position INTEGER NOT NULL,
    blob     TEXT NOT NULL REFERENCES blobs(hash),
    PRIMARY KEY (owner, dataset, name),
    FOREIGN KEY (owner, dataset) REFERENCES datasets(owner, name) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS dataset_arrays_blob ON dataset_arrays(blob);
-- Inputs bound to a dataset's array: the blob it was bound to, and the rows (JSON).
CREATE TABLE IF NOT EXISTS definition_refs (
    definition TEXT NOT NULL REFERENCES definitions(hash) ON DELETE CASCADE,
    name       TEXT NOT NULL,
    position   INTEGER NOT NULL,
    ref        TEXT NOT NULL,  -- JSON: {dataset, array, blob, dtype, shape, rows}
    blob       TEXT NOT NULL REFERENCES blobs(hash),
    PRIMARY KEY (definition, name)
);
CREATE INDEX IF NOT EXISTS definition_refs_blob ON definition_refs(blob);
"""

# Blobs nothing refers to any longer (a definition, a dataset, a bound input).
_UNUSED_BLOBS = (
    "DELETE FROM blobs WHERE hash NOT IN (SELECT blob FROM definition_tensors) "
    "AND hash NOT IN (SELECT blob FROM dataset_arrays) "
    "AND hash NOT IN (SELECT blob FROM definition_refs)"
)


class StoreError(RuntimeError):
    """The store cannot be opened or is from an incompatible version."""


class QuotaFull(Exception):
    """insert_tape: the owner holds `held` live tapes already, its quota."""

    def __init__(self, held: int):
        super().__init__(held)
        self.held = held


@dataclass
class TapeRow:
    id: str
    owner: str
    definition: str | None
    model: str | None
    target: str
    sources: dict[str, str]
    ttl: float
    created: float
    last_used: float
    hits: int
    bytes: int
    worker: int
    device: str
    rebuilds: int
    state: str
    ended: float | None
    output: str | None = None
    # A sharded tape: {"ids", "rows", "reduction", "layout"} (service/domain/shards.py);
    # one of its parts: {"parent", "index"}. None for an ordinary tape.
    shards: dict[str, Any] | None = None
    version: int = 0  # +1 at every change of its recording in the store

    @property
    def is_part(self) -> bool:
        return self.shards is not None and "parent" in self.shards


@dataclass
class JobRow:
    id: str
    owner: str
    operation: str
    tape_id: str | None
    encoding: str
    created: float
    state: str
    started: float | None
    finished: float | None
    progress: dict[str, Any] | None
    result: bytes | None
    seconds: float | None
    error: dict[str, Any] | None
    process: str
    cancel: bool
    version: int


@dataclass
class ArrayRow:
    name: str
    dtype: str
    shape: list[int]
    blob: str
    bytes: int


@dataclass
class DatasetRow:
    owner: str
    name: str
    version: str
    bytes: int
    created: float
    updated: float
    arrays: list[ArrayRow]


def is_ref(value: Any) -> bool:
    """An input bound to a dataset's array (the worker form), not an array."""
    return isinstance(value, Mapping) and "blob" in value


def rows_problem(
    rows: Any, shape: list[int] | tuple[int, ...], what: str = "the dataset's array"
) -> str | None:
    """What is wrong with taking `rows` (a list of row indices, or a slice {start, stop,
    step} of axis 0) of a dataset's array of this shape, or None: the one rule the HTTP
    side checks when it binds an input (naming the field the client wrote) and the
    worker when it takes the rows."""
    if rows is None:
        return None
    if len(shape) == 0:
        return f"rows selects along axis 0, but {what} is a scalar"
    n = shape[0]
    empty = "a mini-batch needs at least one row (an empty one would answer a loss of zero, or NaN)"
    if isinstance(rows, Mapping):
        start, stop, step = rows.get("start"), rows.get("stop"), rows.get("step")
        step = 1 if step is None else step
        start = 0 if start is None else start
        stop = n if stop is None else stop
        if step < 1:
            return f"rows.step must be at least 1, got {step}"
        if not 0 <= start <= n or not 0 <= stop <= n:
            return (
                f"rows {start}:{stop} is out of range; {what} has {n} rows "
                f"(start and stop within 0..{n})"
            )
        if len(range(start, stop, step)) == 0:
            return f"rows {start}:{stop} selects no row; {empty}"
        return None
    if len(rows) == 0:
        return f"rows is empty; {empty}"
    low, high = min(rows), max(rows)
    if low < 0 or high >= n:
        bad = low if low < 0 else high
        return f"row {bad} is out of range; {what} has {n} rows (0..{n - 1})"
    return None


@dataclass
class ModelRow:
    owner: str
    name: str
    definition: str
    description: str | None
    info: dict[str, Any]
    created: float
    updated: float


# ----------------------------------------------------------------------------------------
# Content addresses of arrays (their bytes: service/core/wire.py)
# ----------------------------------------------------------------------------------------


def _blob_hash(dtype: str, shape: list[int], data: bytes) -> str:
    digest = hashlib.sha256(f"{dtype}{shape}".encode())
    digest.update(data)
    return digest.hexdigest()


def _lines(program: Any) -> list[str]:
    return program.splitlines() if isinstance(program, str) else list(program)


# ----------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------


class Store:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    # Lifecycle ----------------------------------------------------------------------------
    def open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA foreign_keys = ON")
            if self.path != ":memory:":
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")
            # One transaction: several HTTP processes may open the file at once, and only
            # the first migrates it (the others then read the new version).
            db.execute("BEGIN IMMEDIATE")
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, SCHEMA_VERSION, *MIGRATIONS):
                    raise StoreError(
                        f"{self.path} has store schema version {version}; this gradtape "
                        f"reads versions up to {SCHEMA_VERSION}"
                    )
                for old in range(version or SCHEMA_VERSION, SCHEMA_VERSION):
                    for statement in MIGRATIONS[old]:
                        db.execute(statement)
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        self._db = db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._db
            if db is None:
                raise StoreError("the store is not open")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row | tuple[Any, ...]]:
        with self._lock:
            if self._db is None:
                raise StoreError("the store is not open")
            return self._db.execute(sql, args).fetchall()

    # Definitions --------------------------------------------------------------------------
    def put_definition(self, definition: Mapping[str, Any]) -> str:
        """Store a definition in the worker form (program, variables {name: {value,
        trainable}}, inputs {name: array}, functions); return its content hash."""
        with self._transaction() as db:
            return _put_definition(db, definition)

    def get_definition(self, digest: str) -> dict[str, Any] | None:
        """The definition in the worker form (NumPy arrays), or None."""
        with self._lock:
            db = self._db
            if db is None:
                raise StoreError("the store is not open")
            row = db.execute(
                "SELECT program, functions FROM definitions WHERE hash = ?", (digest,)
            ).fetchone()
            if row is None:
                return None
            tensors = db.execute(
                "SELECT t.section, t.name, t.position, t.trainable, b.dtype, b.shape, b.data "
                "FROM definition_tensors t JOIN blobs b ON b.hash = t.blob "
                "WHERE t.definition = ? ORDER BY t.section, t.position",
                (digest,),
            ).fetchall()
            files = db.execute(
                "SELECT m.name, m.frozen, f.data FROM definition_models m JOIN onnx_files f "
                "ON f.hash = m.file WHERE m.definition = ? ORDER BY m.position",
                (digest,),
            ).fetchall()
            refs = db.execute(
                "SELECT name, position, ref FROM definition_refs WHERE definition = ?",
                (digest,),
            ).fetchall()
        out: dict[str, Any] = {
            "program": json.loads(row[0]),
            "variables": {},
            "inputs": {},
            "functions": json.loads(row[1]),
        }
        inputs: list[tuple[int, str, Any]] = []
        for section, name, position, trainable, dtype, shape, data in tensors:
            array = from_bytes(data, dtype, json.loads(shape))
            if section == "variables":
                out["variables"][name] = {"value": array, "trainable": bool(trainable)}
            else:
                inputs.append((position, name, array))
        # arrays and inputs bound to datasets, back in their order
        inputs += [(position, name, self.attach(json.loads(ref))) for name, position, ref in refs]
        out["inputs"] = {name: value for _, name, value in sorted(inputs, key=lambda i: i[0])}
        if files:
            out["models"] = {
                name: {"onnx": bytes(data), "frozen": json.loads(frozen)}
                for name, frozen, data in files
            }
        return out

    def collect_garbage(self) -> int:
        """Delete definitions no live tape or model uses, then unused blobs; return how
        many definitions went."""
        with self._transaction() as db:
            gone = db.execute(
                "DELETE FROM definitions WHERE hash NOT IN "
                "(SELECT definition FROM tapes WHERE definition IS NOT NULL) "
                "AND hash NOT IN (SELECT definition FROM models)"
            ).rowcount
            if gone:
                db.execute(_UNUSED_BLOBS)
                db.execute(
                    "DELETE FROM onnx_files WHERE hash NOT IN (SELECT file FROM definition_models)"
                )
        return gone

    @property
    def in_memory(self) -> bool:
        """An in-memory store (':memory:'): the workers cannot read it."""
        return self.path == ":memory:"

    def attach(self, ref: dict[str, Any]) -> dict[str, Any]:
        """A reference to a dataset's array as it goes to a worker: with an in-memory
        store, which the workers cannot open, the array travels in it (`value`); with a
        store file, the worker reads the blob itself (once: it keeps it hot)."""
        if self.in_memory:
            value = self.get_blob(ref["blob"])
            if value is None:
                raise StoreError(f"the array {ref['blob'][:12]}... of a dataset is missing")
            ref["value"] = value
        return ref

    def get_blob(self, digest: str) -> np.ndarray | None:
        rows = self._query("SELECT dtype, shape, data FROM blobs WHERE hash = ?", (digest,))
        if not rows:
            return None
        dtype, shape, data = rows[0]
        return from_bytes(data, dtype, json.loads(shape))

    # Datasets -----------------------------------------------------------------------------
    def put_dataset(self, owner: str, name: str, arrays: Mapping[str, np.ndarray]) -> DatasetRow:
        """Create or replace a dataset (one transaction); keep its creation time."""
        now = time.time()
        rows: list[ArrayRow] = []
        with self._transaction() as db:
            version = hashlib.sha256()
            for array_name, array in arrays.items():
                dtype, shape, data = to_bytes(array)
                blob = _blob_hash(dtype, shape, data)
                db.execute(
                    "INSERT OR IGNORE INTO blobs (hash, dtype, shape, data) VALUES (?, ?, ?, ?)",
                    (blob, dtype, json.dumps(shape), sqlite3.Binary(data)),
                )
                rows.append(ArrayRow(array_name, dtype, shape, blob, len(data)))
                version.update(f"{array_name}\0{blob}\0".encode())
            old = db.execute(
                "SELECT created FROM datasets WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
            created = old[0] if old else now
            db.execute("DELETE FROM datasets WHERE owner = ? AND name = ?", (owner, name))
            total = sum(r.bytes for r in rows)
            db.execute(
                "INSERT INTO datasets (owner, name, version, bytes, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (owner, name, version.hexdigest(), total, created, now),
            )
            db.executemany(
                "INSERT INTO dataset_arrays (owner, dataset, name, position, blob) "
                "VALUES (?, ?, ?, ?, ?)",
                [(owner, name, r.name, i, r.blob) for i, r in enumerate(rows)],
            )
            if old:
                db.execute(_UNUSED_BLOBS)
        return DatasetRow(owner, name, version.hexdigest(), total, created, now, rows)

    def get_dataset(self, owner: str, name: str) -> DatasetRow | None:
        with self._lock:
            db = self._db
            if db is None:
                raise StoreError("the store is not open")
            row = db.execute(
                "SELECT version, bytes, created, updated FROM datasets "
                "WHERE owner = ? AND name = ?",
                (owner, name),
            ).fetchone()
            if row is None:
                return None
            arrays = db.execute(
                "SELECT a.name, b.dtype, b.shape, a.blob, length(b.data) FROM dataset_arrays a "
                "JOIN blobs b ON b.hash = a.blob WHERE a.owner = ? AND a.dataset = ? "
                "ORDER BY a.position",
                (owner, name),
            ).fetchall()
        return DatasetRow(
            owner,
            name,
            row[0],
            row[1],
            row[2],
            row[3],
            [ArrayRow(a, d, json.loads(s), b, n) for a, d, s, b, n in arrays],
        )

    def list_datasets(self, owner: str) -> list[DatasetRow]:
        names = self._query("SELECT name FROM datasets WHERE owner = ? ORDER BY name", (owner,))
        found = (self.get_dataset(owner, n[0]) for n in names)
        return [row for row in found if row is not None]

    def dataset_usage(self, owner: str, excluding: str | None = None) -> tuple[int, int]:
        """(datasets, bytes) this owner stores, leaving out one name (being replaced)."""
        count, total = self._query(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM datasets "
            "WHERE owner = ? AND name IS NOT ?",
            (owner, excluding),
        )[0]
        return int(count), int(total)

    def delete_dataset(self, owner: str, name: str) -> bool:
        with self._transaction() as db:
            gone = db.execute(
                "DELETE FROM datasets WHERE owner = ? AND name = ?", (owner, name)
            ).rowcount
            if gone:
                db.execute(_UNUSED_BLOBS)
        return gone > 0

    # Models -------------------------------------------------------------------------------
    def put_model(
        self,
        owner: str,
        name: str,
        definition: Mapping[str, Any],
        description: str | None,
        info: Mapping[str, Any],
    ) -> ModelRow:
        """Create or replace a model with its definition (one transaction); keep its
        creation time when replacing."""
        now = time.time()
        with self._transaction() as db:
            digest = _put_definition(db, definition)
            row = db.execute(
                "SELECT created FROM models WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
            created = row[0] if row else now
            db.execute(
                "INSERT OR REPLACE INTO models (owner, name, definition, description, info, "
                "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (owner, name, digest, description, json.dumps(info), created, now),
            )
        return ModelRow(owner, name, digest, description, dict(info), created, now)

    def get_model(self, owner: str, name: str) -> ModelRow | None:
        rows = self._query(
            "SELECT owner, name, definition, description, info, created, updated FROM models "
            "WHERE owner = ? AND name = ?",
            (owner, name),
        )
        return _model(rows[0]) if rows else None

    def list_models(self, owner: str) -> list[ModelRow]:
        rows = self._query(
            "SELECT owner, name, definition, description, info, created, updated FROM models "
            "WHERE owner = ? ORDER BY name",
            (owner,),
        )
        return [_model(r) for r in rows]

    def count_models(self, owner: str) -> int:
        return int(self._query("SELECT COUNT(*) FROM models WHERE owner = ?", (owner,))[0][0])

    def delete_model(self, owner: str, name: str) -> bool:
        with self._transaction() as db:
            gone = db.execute(
                "DELETE FROM models WHERE owner = ? AND name = ?", (owner, name)
            ).rowcount
        return gone > 0

    # Tapes --------------------------------------------------------------------------------
    def insert_tape(
        self, tape: TapeRow, definition: Mapping[str, Any] | None, max_tapes: int | None = None
    ) -> None:
        """Store a new live tape with its definition (one transaction, so that the
        garbage collection never sees the definition without its tape). A sharded tape
        has none of its own: its parts hold theirs. `max_tapes`: QuotaFull when the owner
        holds that many live tapes already, counted in the same transaction (several
        HTTP processes recording at once cannot pass the quota together)."""
        with self._transaction() as db:
            if max_tapes is not None:
                held = int(
                    db.execute(
                        "SELECT COUNT(*) FROM tapes WHERE owner = ? AND state = 'live' AND "
                        "(shards IS NULL OR json_extract(shards, '$.parent') IS NULL)",
                        (tape.owner,),
                    ).fetchone()[0]
                )
                if held >= max_tapes:
                    raise QuotaFull(held)
            tape.definition = None if definition is None else _put_definition(db, definition)
            db.execute(
                "INSERT INTO tapes (id, owner, definition, model, target, sources, ttl, "
                "created, last_used, hits, bytes, worker, device, rebuilds, state, ended, "
                "output, shards) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tape.id,
                    tape.owner,
                    tape.definition,
                    tape.model,
                    tape.target,
                    json.dumps(tape.sources),
                    tape.ttl,
                    tape.created,
                    tape.last_used,
                    tape.hits,
                    tape.bytes,
                    tape.worker,
                    tape.device,
                    tape.rebuilds,
                    tape.state,
                    tape.ended,
                    tape.output,
                    None if tape.shards is None else json.dumps(tape.shards),
                ),
            )

    def set_tape_definition(self, tape_id: str, definition: Mapping[str, Any]) -> str:
        """Give a tape a new definition (new values); return its hash."""
        return self.replace_tape_definition(tape_id, definition)[0]

    def replace_tape_definition(
        self, tape_id: str, definition: Mapping[str, Any]
    ) -> tuple[str, int]:
        """Give a tape a new definition (new values): its hash and the tape's new version
        (read in the same transaction, so that it is this change's)."""
        with self._transaction() as db:
            digest = _put_definition(db, definition)
            row = db.execute(
                "UPDATE tapes SET definition = ?, version = version + 1 WHERE id = ? "
                "RETURNING version",
                (digest, tape_id),
            ).fetchone()
        return digest, int(row[0]) if row else 0

    def save_usage(self, tapes: list[TapeRow]) -> None:
        """Write the usage of live tapes (last use, hits, bytes, where they live)."""
        if not tapes:
            return
        with self._transaction() as db:
            db.executemany(
                "UPDATE tapes SET last_used = ?, hits = ?, bytes = ?, worker = ?, device = ?, "
                "rebuilds = ? WHERE id = ? AND state = 'live'",
                [
                    (t.last_used, t.hits, t.bytes, t.worker, t.device, t.rebuilds, t.id)
                    for t in tapes
                ],
            )

    def end_tapes(self, tapes: list[TapeRow], state: str, when: float) -> None:
        """Turn live tapes into tombstones (their definitions are collected later)."""
        if not tapes:
            return
        with self._transaction() as db:
            db.executemany(
                "UPDATE tapes SET state = ?, ended = ?, definition = NULL, "
                "last_used = MAX(last_used, ?), hits = MAX(hits, ?), bytes = ?, "
                "version = version + 1 WHERE id = ? AND state = 'live'",
                [(state, when, t.last_used, t.hits, t.bytes, t.id) for t in tapes],
            )

    def live_tapes(self, owner: str | None = None) -> list[TapeRow]:
        if owner is None:
            return [_tape(r) for r in self._query(_TAPE_SELECT + " WHERE state = 'live'")]
        return [
            _tape(r)
            for r in self._query(_TAPE_SELECT + " WHERE owner = ? AND state = 'live'", (owner,))
        ]

    # Tapes shared by several HTTP processes (http_workers > 1) ------------------------------
    def get_tape_family(self, tape_id: str) -> list[TapeRow]:
        """The tape's row and, for a sharded tape, its parts' rows after it, in order
        (one read: a use compares their versions with its copies'); [] when unknown."""
        with self._lock:
            db = self._db
            if db is None:
                raise StoreError("the store is not open")
            found = db.execute(_TAPE_SELECT + " WHERE id = ?", (tape_id,)).fetchone()
            if found is None:
                return []
            row = _tape(found)
            if not row.shards or "ids" not in row.shards:
                return [row]
            ids = list(row.shards["ids"])
            parts = {
                r[0]: _tape(r)
                for r in db.execute(
                    _TAPE_SELECT + f" WHERE id IN ({','.join('?' * len(ids))})", ids
                ).fetchall()
            }
        return [row, *(parts[i] for i in ids if i in parts)]

    def touch_tape(self, tape_id: str, when: float, size: int, rebuilt: bool) -> None:
        """A use of a live tape, written at once: another process's sweeper reads its
        last use here (the latest of every process's), and hits add up."""
        with self._transaction() as db:
            db.execute(
                "UPDATE tapes SET last_used = MAX(last_used, ?), hits = hits + 1, bytes = ?, "
                "rebuilds = rebuilds + ? WHERE id = ? AND state = 'live'",
                (when, size, int(rebuilt), tape_id),
            )

    def keep_alive(self, tape_ids: list[str], when: float) -> None:
        """Tapes with a request in flight here count as used now (a long request must
        not let another process's sweeper expire its tape)."""
        if not tape_ids:
            return
        with self._transaction() as db:
            db.executemany(
                "UPDATE tapes SET last_used = MAX(last_used, ?) WHERE id = ? AND state = 'live'",
                [(when, i) for i in tape_ids],
            )

    def tape_usage(self, owner: str) -> tuple[int, int]:
        """(live tapes, their bytes) of an owner, as the quotas count them: a sharded
        tape is one tape, its bytes its parts'."""
        count, total = self._query(
            "SELECT COALESCE(SUM(shards IS NULL OR json_extract(shards, '$.parent') IS NULL), 0), "
            "COALESCE(SUM(CASE WHEN shards IS NULL OR json_extract(shards, '$.ids') IS NULL "
            "THEN bytes ELSE 0 END), 0) FROM tapes WHERE owner = ? AND state = 'live'",
            (owner,),
        )[0]
        return int(count), int(total)

    def expire_tapes(self, now: float, grace: float = 0.0) -> list[TapeRow]:
        """End every live tape whose last use (by any process) is older than its ttl (and
        `grace`), with its parts; return the rows ended (one transaction: each ends once)."""
        with self._transaction() as db:
            rows = [
                _tape(r)
                for r in db.execute(
                    _TAPE_SELECT + " WHERE state = 'live' AND last_used + ttl + ? <= ? AND "
                    "(shards IS NULL OR json_extract(shards, '$.parent') IS NULL)",
                    (grace, now),
                )
            ]
            ids = [r.id for r in rows]
            for r in rows:
                if r.shards and "ids" in r.shards:
                    ids += r.shards["ids"]
            db.executemany(
                "UPDATE tapes SET state = 'expired', ended = ?, definition = NULL, "
                "version = version + 1 WHERE id = ? AND state = 'live'",
                [(now, i) for i in ids],
            )
        return rows

    def tape_states(self, tape_ids: list[str]) -> dict[str, tuple[str, int]]:
        """id -> (state, version) of these tapes (those the store still knows)."""
        found: dict[str, tuple[str, int]] = {}
        for lo in range(0, len(tape_ids), 500):
            chunk = tape_ids[lo : lo + 500]
            for i, state, version in self._query(
                f"SELECT id, state, version FROM tapes WHERE id IN ({','.join('?' * len(chunk))})",
                tuple(chunk),
            ):
                found[i] = (state, int(version))
        return found

    # Jobs (http_workers > 1) ----------------------------------------------------------------
    def insert_job(self, job: JobRow) -> None:
        with self._transaction() as db:
            db.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES ({', '.join('?' * 16)})",
                _job_values(job),
            )

    def save_job(self, job: JobRow, only_active: bool = False) -> bool:
        """Write a job's state, progress and answer (its version +1); `only_active`: not
        over a job that ended meanwhile (a cancel from another process). False when no
        row changed."""
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE jobs SET state = ?, started = ?, finished = ?, progress = ?, "
                "result = ?, seconds = ?, error = ?, version = version + 1 WHERE id = ?"
                + (" AND state IN ('queued', 'running')" if only_active else ""),
                (
                    job.state,
                    job.started,
                    job.finished,
                    _json(job.progress),
                    None if job.result is None else sqlite3.Binary(job.result),
                    job.seconds,
                    _json(job.error),
                    job.id,
                ),
            ).rowcount
        return changed > 0

    def get_job(self, job_id: str) -> JobRow | None:
        rows = self._query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def job_version(self, job_id: str) -> tuple[int, bool] | None:
        """(version, cancel asked) of a job, or None: the cheap poll."""
        rows = self._query("SELECT version, cancel FROM jobs WHERE id = ?", (job_id,))
        return (int(rows[0][0]), bool(rows[0][1])) if rows else None

    def list_jobs(self, owner: str) -> list[JobRow]:
        """An owner's jobs, without their answers (oldest first)."""
        columns = _JOB_COLUMNS.replace("result", "NULL")
        return [
            _job(r)
            for r in self._query(
                f"SELECT {columns} FROM jobs WHERE owner = ? ORDER BY created", (owner,)
            )
        ]

    def count_active_jobs(self, owner: str) -> int:
        return int(
            self._query(
                "SELECT COUNT(*) FROM jobs WHERE owner = ? AND state IN ('queued', 'running')",
                (owner,),
            )[0][0]
        )

    def cancel_job(self, job_id: str, when: float, error: dict[str, Any] | None = None) -> bool:
        """Cancel a queued or running job of another process: it reads as cancelled at
        once, and its process, which polls the flag, stops it (`error`: why, when it was
        not asked for: its tape deleted). False if it had ended."""
        with self._transaction() as db:
            return (
                db.execute(
                    "UPDATE jobs SET state = 'cancelled', cancel = 1, finished = ?, "
                    "started = COALESCE(started, ?), error = ?, version = version + 1 "
                    "WHERE id = ? AND state IN ('queued', 'running')",
                    (when, when, _json(error), job_id),
                ).rowcount
                > 0
            )

    def active_tape_jobs(self, tape_id: str) -> list[str]:
        """The ids of the queued or running jobs on a tape (every process's)."""
        return [
            str(r[0])
            for r in self._query(
                "SELECT id FROM jobs WHERE tape_id = ? AND state IN ('queued', 'running')",
                (tape_id,),
            )
        ]

    def fail_orphan_job(self, job_id: str, when: float, error: dict[str, Any]) -> bool:
        with self._transaction() as db:
            return (
                db.execute(
                    "UPDATE jobs SET state = 'failed', finished = ?, error = ?, "
                    "started = COALESCE(started, ?), version = version + 1 "
                    "WHERE id = ? AND state IN ('queued', 'running')",
                    (when, _json(error), when, job_id),
                ).rowcount
                > 0
            )

    def delete_job(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def prune_jobs(self, before: float) -> int:
        with self._transaction() as db:
            return int(
                db.execute(
                    "DELETE FROM jobs WHERE finished IS NOT NULL AND finished < ?", (before,)
                ).rowcount
            )

    # HTTP processes (http_workers > 1) ------------------------------------------------------
    def heartbeat(self, token: str, pid: int, started: float, when: float) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO processes (token, pid, started, seen) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (token) DO UPDATE SET seen = excluded.seen",
                (token, pid, started, when),
            )

    def process(self, token: str) -> tuple[int, float, float] | None:
        """(pid, start, last heartbeat) of an HTTP process, or None."""
        rows = self._query("SELECT pid, started, seen FROM processes WHERE token = ?", (token,))
        return (int(rows[0][0]), float(rows[0][1]), float(rows[0][2])) if rows else None

    def forget_process(self, token: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM processes WHERE token = ?", (token,))

    # Rate limits (http_workers > 1) ---------------------------------------------------------
    def take_token(self, owner: str, rate: float, burst: int, now: float) -> float:
        """Spend one of the key's tokens (the bucket refilled at `rate` up to `burst`
        first): 0.0 when spent, else the seconds until one is there (none spent)."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT tokens, stamp FROM rate_buckets WHERE owner = ?", (owner,)
            ).fetchone()
            tokens = (
                float(burst)
                if row is None
                else min(float(burst), row[0] + max(0.0, now - row[1]) * rate)
            )
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / rate
            if wait == 0.0:
                tokens -= 1.0
            db.execute(
                "INSERT OR REPLACE INTO rate_buckets (owner, tokens, stamp) VALUES (?, ?, ?)",
                (owner, tokens, now),
            )
        return wait

    def get_tape(self, tape_id: str) -> TapeRow | None:
        rows = self._query(_TAPE_SELECT + " WHERE id = ?", (tape_id,))
        return _tape(rows[0]) if rows else None

    def prune_tombstones(self, before: float) -> int:
        with self._transaction() as db:
            return int(
                db.execute(
                    "DELETE FROM tapes WHERE state != 'live' AND ended < ?", (before,)
                ).rowcount
            )


def _put_definition(db: sqlite3.Connection, definition: Mapping[str, Any]) -> str:
    """Insert a definition (once: it is content-addressed) inside a transaction."""
    program = _lines(definition.get("program", []))
    functions = definition.get("functions") or {}
    tensors: list[tuple[str, str, int, int | None, str, str, list[int], bytes]] = []
    for position, (name, var) in enumerate((definition.get("variables") or {}).items()):
        dtype, shape, data = to_bytes(var["value"])
        flag = int(bool(var.get("trainable", True)))
        tensors.append(
            ("variables", name, position, flag, _blob_hash(dtype, shape, data), dtype, shape, data)
        )
    refs: list[tuple[str, int, dict[str, Any]]] = []
    for position, (name, value) in enumerate((definition.get("inputs") or {}).items()):
        if is_ref(value):  # bound to a dataset's array: its blob is stored already
            refs.append((name, position, {k: v for k, v in value.items() if k != "value"}))
            continue
        dtype, shape, data = to_bytes(value)
        tensors.append(
            ("inputs", name, position, None, _blob_hash(dtype, shape, data), dtype, shape, data)
        )
    models = [
        (
            name,
            position,
            json.dumps(list(m.get("frozen") or [])),
            hashlib.sha256(m["onnx"]).hexdigest(),
            m["onnx"],
        )
        for position, (name, m) in enumerate((definition.get("models") or {}).items())
    ]
    head: dict[str, Any] = {
        "program": program,
        "functions": functions,
        "tensors": [t[:5] for t in tensors],
    }
    if models:  # a definition without models keeps the hash it always had
        head["models"] = [m[:4] for m in models]
    if refs:  # nor one without dataset references
        head["refs"] = refs
    header = json.dumps(head, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(header.encode()).hexdigest()
    if db.execute("SELECT 1 FROM definitions WHERE hash = ?", (digest,)).fetchone():
        return digest
    db.execute(
        "INSERT INTO definitions (hash, program, functions, created) VALUES (?, ?, ?, ?)",
        (digest, json.dumps(program), json.dumps(functions), time.time()),
    )
    for section, name, position, trainable, blob, dtype, shape, data in tensors:
        db.execute(
            "INSERT OR IGNORE INTO blobs (hash, dtype, shape, data) VALUES (?, ?, ?, ?)",
            (blob, dtype, json.dumps(shape), sqlite3.Binary(data)),
        )
        db.execute(
            "INSERT INTO definition_tensors (definition, section, name, position, "
            "trainable, blob) VALUES (?, ?, ?, ?, ?, ?)",
            (digest, section, name, position, trainable, blob),
        )
    for name, position, frozen, file, data in models:
        db.execute(
            "INSERT OR IGNORE INTO onnx_files (hash, data) VALUES (?, ?)",
            (file, sqlite3.Binary(data)),
        )
        db.execute(
            "INSERT INTO definition_models (definition, name, position, frozen, file) "
            "VALUES (?, ?, ?, ?, ?)",
            (digest, name, position, frozen, file),
        )
    for name, position, ref in refs:
        db.execute(
            "INSERT INTO definition_refs (definition, name, position, ref, blob) "
            "VALUES (?, ?, ?, ?, ?)",
            (digest, name, position, json.dumps(ref), ref["blob"]),
        )
    return digest


_TAPE_SELECT = (
    "SELECT id, owner, definition, model, target, sources, ttl, created, last_used, hits, "
    "bytes, worker, device, rebuilds, state, ended, output, shards, version FROM tapes"
)
_JOB_COLUMNS = (
    "id, owner, operation, tape_id, encoding, created, state, started, finished, "
    "progress, result, seconds, error, process, cancel, version"
)


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _job_values(job: JobRow) -> tuple[Any, ...]:
    return (
        job.id,
        job.owner,
        job.operation,
        job.tape_id,
        job.encoding,
        job.created,
        job.state,
        job.started,
        job.finished,
        _json(job.progress),
        None if job.result is None else sqlite3.Binary(job.result),
        job.seconds,
        _json(job.error),
        job.process,
        int(job.cancel),
        job.version,
    )


def _job(row: Any) -> JobRow:
    values = list(row)
    for i in (9, 12):
        values[i] = None if values[i] is None else json.loads(values[i])
    values[10] = None if values[10] is None else bytes(values[10])
    values[14] = bool(values[14])
    return JobRow(*values)


def _tape(row: Any) -> TapeRow:
    values = list(row)
    values[5] = json.loads(values[5])
    values[17] = None if values[17] is None else json.loads(values[17])
    return TapeRow(*values)


def _model(row: Any) -> ModelRow:
    owner, name, definition, description, info, created, updated = row
    return ModelRow(owner, name, definition, description, json.loads(info), created, updated)
