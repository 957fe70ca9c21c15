"""A worker's front door: each request message goes to its handler (the stateless ones
of service/worker/compute.py, the tapes' of service/worker/tapes.py), with the datasets
bound, a flat point applied, cancellation checked before every engine op, and the
answer checked for non-finite values; every failure becomes an error reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import engine as gt
from engine.kernels import warmup
from engine.language import Problem
from service.core.flat import flatten
from service.core.operations import OPERATIONS
from service.worker import compute, curvature_ops, nonfinite, shards, tapes
from service.worker.compute import (
    NonFiniteAnswer,
    RequestError,
    WorkerContext,
    apply_point,
    bind_datasets,
    describe_error,
    refuse_nonfinite,
)

HANDLERS: dict[str, Callable[[Any, WorkerContext], Any]] = {
    **compute.HANDLERS,
    **tapes.HANDLERS,
    **curvature_ops.HANDLERS,
    **shards.HANDLERS,
}


def answer(
    context: WorkerContext,
    message: Mapping[str, Any],
    cancelled: Callable[[], bool] | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The reply to one request message; never raises. `cancelled()` is asked before
    every engine op: once it says yes the request stops there and answers the error
    type "cancelled" (nothing half-done is kept: a tape is stored only once recorded).
    `report` receives the request's progress reports (WorkerContext.progress)."""
    started = time.perf_counter()
    request_id = message.get("id")
    handler = HANDLERS.get(message.get("kind", ""))
    context.report, context._last_report = report, 0.0
    context.time_limit = message.get("time_limit")

    def check() -> None:
        if cancelled is not None and cancelled():
            raise gt.Interrupted("the request was cancelled")

    # Other workers' answers the pool hands with the request (a shard's products, summed
    # here): stashed for the handler, let go once it has answered.
    received = shards.receive(context, message.get("kept") or {})
    try:
        if handler is None:
            raise RequestError("internal", f"unknown request kind {message.get('kind')!r}")
        with gt.interruptible(check):
            payload = apply_point(bind_datasets(message.get("payload"), context), context)
            result = handler(payload, context)
            result = nonfinite.guard(
                result,
                payload,
                lambda: diagnose_nonfinite(message["kind"], payload, context),
                refuse_nonfinite,
            )
        if (
            message.get("kind") == "tape_create"
            and isinstance(payload, Mapping)
            and "applied" in payload
        ):
            result["applied"] = payload["applied"]  # stored with the tape (sessions.py)
        if isinstance(payload, Mapping) and payload.get("flat"):
            result = flatten(result, batch=bool(payload.get("batch")))
        if isinstance(payload, Mapping) and payload.get("stash"):
            result = shards.stash(context, payload["stash"], result)  # a part, summed here next
    except BaseException as exc:  # every failure becomes an error reply
        if (
            isinstance(exc, NonFiniteAnswer | gt.Interrupted)
            and message.get("kind") == "tape_create"
        ):
            # A refused recording is not kept; a replaced tape is rebuilt from the store.
            tapes.sessions(context).pop(message["payload"]["tape_id"], None)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return {
            "id": request_id,
            "ok": False,
            "error": describe_error(exc),
            "kernels": warmup.state(),
        }
    finally:
        shards.forget(context, received)
    return {
        "id": request_id,
        "ok": True,
        "result": result,
        "seconds": time.perf_counter() - started,
        # Where the kernels' warm-up stands, with every answer: a worker that answers
        # requests is never pinged, and the pool's view (/readyz) must not stay at its
        # hello's "warming" for as long as traffic lasts.
        "kernels": warmup.state(),
    }


# What a sound tape's non-finite answer is blamed on, per table operation.
ALGORITHMS = {op.kind: op.diagnosis for op in OPERATIONS}


def diagnose_nonfinite(kind: str, payload: Mapping[str, Any], context: WorkerContext) -> Problem:
    """The op where the request's non-finite answer started (the engine's diagnosis)."""
    if kind.startswith("shard_"):  # sums of answers the shards checked already
        return Problem(
            "the shards' answers are finite, but their weighted sum is not",
            "request",
            kind="nonfinite",
        )
    if kind in ALGORITHMS:
        session = tapes.sessions(context)[payload["tape_id"]]
        found = session.program.find_nonfinite(session.request, session.leaves)
        if found.op is None:  # the tape is sound: the algorithm's own arithmetic is not
            return Problem(
                f"the tape's value and first derivatives are finite, but the "
                f"{ALGORITHMS[kind]} overflowed: its arguments (damping, tol, the vector) "
                "are out of a usable range",
                "request",
                kind="nonfinite",
            )
        return found
    if kind.startswith("tape_"):
        session = tapes.sessions(context)[payload["tape_id"]]  # the handler has just used it
        request = (
            tapes.other_request(session, payload) if payload.get("target") else session.request
        )
        return session.program.find_nonfinite(request, session.leaves)
    prepared = compute.prepare(payload, context, "zero")
    return prepared.program.find_nonfinite(prepared.request, prepared.leaves)
