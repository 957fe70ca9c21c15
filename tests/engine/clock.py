"""An injected clock for the algorithms' time budgets (issue 27, item 13): installed as
engine.hessian_algorithms.budget.clock, it moves only when a test's slow operator says
so, so a test of max_seconds gives the same run on a quiet and on a loaded machine."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
