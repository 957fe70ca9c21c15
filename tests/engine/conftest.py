"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from engine.hessian_algorithms import budget
from tests.engine.clock import FakeClock


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The budgets' clock, replaced by one that moves only when told (tests/engine/clock.py)."""
    clock = FakeClock()
    monkeypatch.setattr(budget, "clock", clock)
    return clock
