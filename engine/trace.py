"""What is recording right now: the stacks of active tapes and forward accumulators.

This module sits below the tensor type so that applying a primitive (in `tensor.bind`)
can record onto every active tape without importing the tape module upward. A tape or
accumulator is "active" while it is in its list; pausing one removes it for a while.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

active_tapes: list[Any] = []
active_accumulators: list[Any] = []


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
