"""What is recording right now: the stacks of active tapes and forward accumulators.

This module sits below the tensor type so that applying a primitive (in `tensor.bind`)
can record onto every active tape without importing the tape module upward. A tape or
accumulator is "active" while it is in its list; pausing one removes it for a while.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

active_tapes: list[Any] = []
active_accumulators: list[Any] = []

# A host (the service's worker) may install a check that runs before every primitive is
# applied and raises to stop the computation at that op boundary: a cancelled request
# frees its worker within one op instead of running to its time limit. None (the
# default) costs one attribute test per op.
interrupt_check: Callable[[], None] | None = None

# While True, a primitive with a deferred form (registry.DEFERRED_SHAPES) gives a result
# whose array is computed only when something reads it: set around the rules that make
# the gradients of a computation that wants only their tangents (a fresh HVP's primal
# weight-gradient GEMMs are then never run). See `deferring`.
defer_primal = False


@contextmanager
def deferring() -> Iterator[None]:
    global defer_primal
    saved, defer_primal = defer_primal, True
    try:
        yield
    finally:
        defer_primal = saved


# While a pass is being captured for replay (engine/replay.py), the Capture that sees
# every primitive `bind` applies and every host read of a tensor; None otherwise.
capture: Any = None


class Interrupted(Exception):
    """Raised by an interrupt check: the computation was stopped between two ops."""


@contextmanager
def interruptible(check: Callable[[], None]) -> Iterator[None]:
    """Run the block with `check()` called before every primitive; it stops the block by
    raising (Interrupted, say). Tapes opened in the block close as the exception leaves."""
    global interrupt_check
    saved, interrupt_check = interrupt_check, check
    try:
        yield
    finally:
        interrupt_check = saved


def check_interrupt() -> None:
    """Run the installed check at a boundary that is no op (a program line being parsed or
    validated, a step of host-side bookkeeping): long work without ops stops there too."""
    if interrupt_check is not None:
        interrupt_check()


def anything_active() -> bool:
    return bool(active_tapes or active_accumulators)


@contextmanager
def paused(recorder: Any) -> Iterator[None]:
    """Take one tape or accumulator off its stack for the duration of the block."""
    stack = active_accumulators if recorder in active_accumulators else active_tapes
    if recorder not in stack:
        yield
        return
    position = stack.index(recorder)
    stack.pop(position)
    try:
        yield
    finally:
        stack.insert(min(position, len(stack)), recorder)


@contextmanager
def nothing_recording() -> Iterator[None]:
    """No tape and no accumulator sees the block (custom_gradient's forward runs here)."""
    saved_tapes, saved_accumulators = active_tapes[:], active_accumulators[:]
    active_tapes.clear()
    active_accumulators.clear()
    try:
        yield
    finally:
        active_tapes[:] = saved_tapes + [t for t in active_tapes if t not in saved_tapes]
        active_accumulators[:] = saved_accumulators + [
            a for a in active_accumulators if a not in saved_accumulators
        ]
