"""The SQLite store on its own: definitions round-trip with every dtype and shape, arrays
are raw little-endian bytes (never pickles) stored once however many definitions share
them, tapes end as tombstones, and unused definitions are collected."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator

import numpy as np
import pytest

from service.core.store import SCHEMA_VERSION, Store, StoreError, TapeRow

DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    s = Store(tmp_path / "sub" / "store.sqlite3")
    s.open()
    yield s
    s.close()


def definition(seed: int = 0) -> dict:
    g = np.random.default_rng(seed)
    return {
        "program": ["h = tanh(x @ w)", "loss = sum(h)"],
        "variables": {
            "w": {"value": g.standard_normal((3, 2)).astype(np.float32), "trainable": True},
            "frozen": {"value": np.float64(2.5), "trainable": False},
        },
        "inputs": {"x": g.standard_normal((4, 3)), "empty": np.zeros((0, 3), np.int64)},
        "functions": {
            "f": {
                "params": ["a"],
                "forward": ["b = a"],
                "backward": ["grad_a = upstream"],
                "output": None,
            }
        },
    }


def tape(tape_id: str, owner: str = "", state: str = "live") -> TapeRow:
    now = time.time()
    return TapeRow(
        id=tape_id,
        owner=owner,
        definition=None,
        model=None,
        target="loss",
        sources={"w": "w"},
        ttl=60.0,
        created=now,
        last_used=now,
        hits=0,
        bytes=10,
        worker=0,
        device="cpu",
        rebuilds=0,
        state=state,
        ended=None,
    )


def test_definitions_round_trip(store: Store) -> None:
    original = definition()
    digest = store.put_definition(original)
    back = store.get_definition(digest)
    assert back is not None
    assert back["program"] == original["program"] and back["functions"] == original["functions"]
    assert list(back["variables"]) == ["w", "frozen"]  # order kept: default sources follow it
    for name, var in original["variables"].items():
        got = back["variables"][name]
        assert got["trainable"] == var["trainable"]
        assert got["value"].dtype == np.asarray(var["value"]).dtype
        np.testing.assert_array_equal(got["value"], var["value"])
    for name, value in original["inputs"].items():
        assert back["inputs"][name].dtype == value.dtype
        assert back["inputs"][name].shape == value.shape
        np.testing.assert_array_equal(back["inputs"][name], value)
    assert store.put_definition(original) == digest  # content-addressed
    assert store.get_definition("0" * 64) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_is_raw_little_endian_bytes(tmp_path, dtype: str) -> None:
    s = Store(tmp_path / "s.sqlite3")
    s.open()
    value = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    big = value.astype(value.dtype.newbyteorder(">"))  # a big-endian array is stored the same
    digest = s.put_definition({"program": ["y = x"], "inputs": {"x": big}})
    back = s.get_definition(digest)["inputs"]["x"]
    np.testing.assert_array_equal(back, value)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    s.close()
    with sqlite3.connect(tmp_path / "s.sqlite3") as db:
        ((stored_dtype, shape, data),) = db.execute("SELECT dtype, shape, data FROM blobs")
    assert (stored_dtype, shape) == (dtype, "[2, 3]")
    assert bytes(data) == value.astype(value.dtype.newbyteorder("<")).tobytes()  # no pickle


def test_blobs_are_shared_and_garbage_is_collected(store: Store) -> None:
    one = definition(1)
    two = {
        **one,
        "variables": {
            **one["variables"],
            "w": {"value": one["variables"]["w"]["value"] + 1, "trainable": True},
        },
    }
    a = store.put_definition(one)
    b = store.put_definition(two)
    assert a != b
    count = store._query("SELECT COUNT(*) FROM blobs")[0][0]
    assert count == 4 + 1  # x, empty, frozen shared; two values of w
    keep = tape("kept")
    store.insert_tape(keep, one)
    assert keep.definition == a
    store.put_model("", "m", two, None, {})
    assert store.collect_garbage() == 0  # both used
    store.delete_model("", "m")
    assert store.collect_garbage() == 1
    assert store.get_definition(b) is None and store.get_definition(a) is not None
    assert store._query("SELECT COUNT(*) FROM blobs")[0][0] == 4


def test_onnx_models_round_trip_shared_and_collected(store: Store) -> None:
    """A definition's imported ONNX files: stored once by content, back as bytes with
    their frozen lists, part of the definition's hash, collected with it."""
    file = b"\x08\x08 not really onnx, the store does not look \x00\xff"
    one = {**definition(3), "models": {"net": {"onnx": file, "frozen": ["bn.mean"]}}}
    two = {**definition(3), "models": {"net": {"onnx": file, "frozen": []}}}
    a, b = store.put_definition(one), store.put_definition(two)
    assert len({a, b, store.put_definition(definition(3))}) == 3
    back = store.get_definition(a)
    assert back["models"] == {"net": {"onnx": file, "frozen": ["bn.mean"]}}
    assert "models" not in store.get_definition(store.put_definition(definition(3)))
    assert store._query("SELECT COUNT(*) FROM onnx_files")[0][0] == 1
    store.put_model("", "keep", one, None, {})
    store.collect_garbage()
    assert store.get_definition(b) is None and store.get_definition(a) is not None
    assert store._query("SELECT COUNT(*) FROM onnx_files")[0][0] == 1
    store.delete_model("", "keep")
    store.collect_garbage()
    assert store._query("SELECT COUNT(*) FROM onnx_files")[0][0] == 0


def test_tapes_end_as_tombstones(store: Store) -> None:
    live = tape("t1", owner="o")
    store.insert_tape(live, definition())
    assert [t.id for t in store.live_tapes()] == ["t1"]
    live.hits, live.bytes, live.last_used = 3, 99, live.last_used + 1
    store.save_usage([live])
    assert store.get_tape("t1").hits == 3
    store.end_tapes([live], "evicted", time.time())
    row = store.get_tape("t1")
    assert row.state == "evicted" and row.definition is None and row.owner == "o"
    assert store.live_tapes() == [] and store.collect_garbage() == 1
    assert store.prune_tombstones(time.time() + 1) == 1 and store.get_tape("t1") is None


def test_models(store: Store) -> None:
    first = store.put_model("o", "m", definition(), "d", {"trainable": ["w"]})
    again = store.put_model("o", "m", definition(2), None, {})
    assert again.created == first.created and again.definition != first.definition
    assert store.get_model("other", "m") is None
    assert [m.name for m in store.list_models("o")] == ["m"] and store.count_models("o") == 1
    assert store.delete_model("o", "m") and not store.delete_model("o", "m")


def test_versions(tmp_path) -> None:
    path = tmp_path / "v.sqlite3"
    s = Store(path)
    s.open()
    s.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="version 99"):
        Store(path).open()
    memory = Store(":memory:")
    memory.open()
    assert memory.get_definition(memory.put_definition(definition())) is not None
    memory.close()
    with pytest.raises(StoreError, match="not open"):
        memory.live_tapes()


def test_a_version_1_store_gains_the_tapes_output_column(tmp_path) -> None:
    """Version 1 had no tapes.output: opening it adds the column, keeps the tapes (their
    output null) and stores new ones with theirs."""
    path = tmp_path / "v1.sqlite3"
    s = Store(path)
    s.open()
    s.insert_tape(tape("old"), definition())
    s.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE tapes DROP COLUMN output")
        db.execute("ALTER TABLE tapes DROP COLUMN shards")  # version 3's
        db.execute("ALTER TABLE tapes DROP COLUMN version")  # version 4's
        db.execute("PRAGMA user_version = 1")
    s = Store(path)
    s.open()
    assert s.get_tape("old").output is None
    assert s.get_tape("old").version == 0
    named = tape("new")
    named.output = "logits"
    s.insert_tape(named, definition())
    assert s.get_tape("new").output == "logits"
    s.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert Store(path).path  # and a sharded tape's record survives the round trip:
    s = Store(path)
    s.open()
    parent = tape("sharded")
    parent.shards = {"ids": ["a", "b"], "rows": [3, 2], "reduction": "mean"}
    s.insert_tape(parent, None)
    assert s.get_tape("sharded").shards == parent.shards
    assert s.get_tape("sharded").definition is None
    s.close()
