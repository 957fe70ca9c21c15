"""The worker side of tapes (service/worker/tapes.py) in this process: the bytes a tape
holds (engine/footprint.py counts it), dropping it, and rebuilding it from its definition when a worker lacks it."""

from __future__ import annotations

import numpy as np
import pytest

from engine.footprint import held_bytes
from service.worker import compute, dispatch, tapes

rng = np.random.default_rng(3)
DEFINITION = {
    "program": ["h = tanh(x @ w)", "loss = sum(h ** 2)"],
    "variables": {"w": {"value": rng.standard_normal((8, 4))}},
    "inputs": {"x": rng.standard_normal((32, 8))},
}


@pytest.fixture(scope="module")
def context() -> compute.WorkerContext:
    return compute.start(0, "cpu", {})


def test_a_tape_holds_its_recording_and_lets_it_go(context) -> None:
    spec = {"tape_id": "t1", "definition": DEFINITION, "target": "loss"}
    created = dispatch.answer(context, {"id": 1, "kind": "tape_create", "payload": spec})
    assert created["ok"], created
    size = created["result"]["tape"]["bytes"]
    assert size >= DEFINITION["inputs"]["x"].nbytes + 2 * 32 * 4 * 8  # x, x @ w, h at least
    vector = {"w": np.ones((8, 4))}
    sizes = []
    for _ in range(5):
        reply = dispatch.answer(
            context, {"id": 2, "kind": "tape_hvp", "payload": {"tape_id": "t1", "vector": vector}}
        )
        assert reply["ok"] and not reply["result"]["tape"]["rebuilt"]
        sizes.append(reply["result"]["tape"]["bytes"])
    # Settled once the HVP pass is compiled and its buffers kept (the test below).
    assert sizes[-3:] == [sizes[-1]] * 3 and sizes[0] >= size
    dropped = dispatch.answer(
        context, {"id": 3, "kind": "tape_drop", "payload": {"tape_ids": ["t1", "nope"]}}
    )
    assert dropped["result"] == {"dropped": ["t1"], "held": 0}


def test_a_missing_tape_is_rebuilt_from_its_definition(context) -> None:
    payload = {"tape_id": "t2", "vector": {"w": np.ones((8, 4))}}
    missing = dispatch.answer(context, {"id": 1, "kind": "tape_hvp", "payload": payload})
    assert not missing["ok"] and missing["error"]["type"] == "tape-missing"
    rebuild = {"definition": DEFINITION, "target": "loss", "sources": {"w": "w"}}
    rebuilt = dispatch.answer(
        context, {"id": 2, "kind": "tape_hvp", "payload": {**payload, "rebuild": rebuild}}
    )
    assert rebuilt["ok"] and rebuilt["result"]["tape"]["rebuilt"]
    again = dispatch.answer(
        context, {"id": 3, "kind": "tape_hvp", "payload": {**payload, "rebuild": rebuild}}
    )
    assert not again["result"]["tape"]["rebuilt"]  # held now: the definition is not used
    np.testing.assert_array_equal(again["result"]["hvp"]["w"], rebuilt["result"]["hvp"]["w"])
    dispatch.answer(context, {"id": 4, "kind": "tape_drop", "payload": {"tape_ids": ["t2"]}})


def test_a_failed_update_keeps_the_old_tape(context) -> None:
    spec = {"tape_id": "t3", "definition": DEFINITION, "target": "loss"}
    assert dispatch.answer(context, {"id": 1, "kind": "tape_create", "payload": spec})["ok"]
    broken = {**spec, "definition": {**DEFINITION, "program": ["loss = sum(nope)"]}}
    failed = dispatch.answer(context, {"id": 2, "kind": "tape_create", "payload": broken})
    assert not failed["ok"] and failed["error"]["type"] == "definition"
    still = dispatch.answer(
        context, {"id": 3, "kind": "tape_gradient", "payload": {"tape_id": "t3"}}
    )
    assert still["ok"] and set(still["result"]["gradients"]) == {"w"}
    dispatch.answer(context, {"id": 4, "kind": "tape_drop", "payload": {"tape_ids": ["t3"]}})


def test_a_tapes_bytes_count_the_compiled_replays_buffers(context) -> None:
    """A reused tape's HVP pass is compiled (engine/replay.py) and keeps its schedule's
    buffers from its third pass: the bytes the tape reports (what the memory budget and
    eviction go by) follow, and settle."""
    rng = np.random.default_rng(5)
    definition = {
        "program": ["loss = sum(tanh(x @ w) ** 2)"],
        "variables": {"w": {"value": rng.standard_normal((256, 256))}},
        "inputs": {"x": rng.standard_normal((256, 256))},
    }
    spec = {"tape_id": "big", "definition": definition, "target": "loss"}
    assert dispatch.answer(context, {"id": 1, "kind": "tape_create", "payload": spec})["ok"]
    sizes = []
    for i in range(7):
        reply = dispatch.answer(
            context,
            {
                "id": 2 + i,
                "kind": "tape_hvp",
                "payload": {"tape_id": "big", "vector": {"w": np.ones((256, 256))}},
            },
        )
        assert reply["ok"], reply
        sizes.append(reply["result"]["tape"]["bytes"])
    session = context.state["tapes"]["big"]
    assert "compiled" in session.operator.replay_status().values()
    assert sizes[-1] == held_bytes(session, shared=tapes.SHARED)  # the truth, now
    assert sizes[-1] >= sizes[0] + 256 * 256 * 8  # at least one (256, 256) buffer more
    assert sizes[-3:] == [sizes[-1]] * 3  # settled
    dispatch.answer(context, {"id": 9, "kind": "tape_drop", "payload": {"tape_ids": ["big"]}})


def test_a_tapes_bytes_are_what_it_holds_after_every_hvp(context) -> None:
    """Rule stages and the compiled replay fill their caches and buffers over the first
    passes: after every answer, the bytes reported (what the budget and eviction go by)
    are the bytes held."""
    rng = np.random.default_rng(6)
    definition = {
        "program": ["h = tanh(x @ w)", "loss = sum(tanh(h @ v) ** 2)"],
        "variables": {
            "w": {"value": rng.standard_normal((64, 48))},
            "v": {"value": rng.standard_normal((48, 8))},
        },
        "inputs": {"x": rng.standard_normal((200, 64))},
    }
    spec = {"tape_id": "every", "definition": definition, "target": "loss"}
    created = dispatch.answer(context, {"id": 1, "kind": "tape_create", "payload": spec})
    session = context.state["tapes"]["every"]
    assert created["result"]["tape"]["bytes"] == held_bytes(session, shared=tapes.SHARED)
    vector = {"w": np.ones((64, 48)), "v": np.ones((48, 8))}
    for i in range(6):
        reply = dispatch.answer(
            context,
            {"id": 2 + i, "kind": "tape_hvp", "payload": {"tape_id": "every", "vector": vector}},
        )
        assert reply["ok"], reply
        truth = held_bytes(session, shared=tapes.SHARED)
        assert reply["result"]["tape"]["bytes"] == truth, f"after HVP {i + 1}"
    dispatch.answer(context, {"id": 9, "kind": "tape_drop", "payload": {"tape_ids": ["every"]}})
