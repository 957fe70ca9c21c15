"""How much memory a run of a checked program needs, known before it runs.

Validation infers the shape and dtype of every op's result; from them:

- a *recording* (the forward pass and its gradient recorded under tapes, as an HVP
  operator or a stored tape holds them) keeps the leaves plus about RECORDING_FACTOR
  times the intermediates; a first-order run (a gradient, jacobian rows) keeps only the
  forward pass, the leaves plus about FORWARD_FACTOR times the intermediates (the
  results, and what composite ops' rules keep of their own temporaries);
- a derivative pass over it (one jacobian row, HVP vector, Hessian row or trace probe of
  a batched pass) needs about PASS_FACTOR times the intermediates again: cotangents,
  tangents and the rules' temporaries. Batched passes scale with the batch, which is
  what lets a server split a batch into chunks that fit a budget.

Both factors are measured, not guessed (tracemalloc sees NumPy's buffers): recordings
held 2.6-3.6x the intermediates and each HVP vector 1.45-1.7x, on the programs of
tests/language/test_memory.py, which keeps the estimate between 1x and 3x of the
measured peak. Bodies of user functions are counted once per
distinct call signature, so a function called many times is under-counted: the budget
is a guard against the orders of magnitude a request can ask for, not an allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.language.errors import Problem
from engine.language.validate import CheckedProgram, Intermediate

RECORDING_FACTOR = 4
FORWARD_FACTOR = 1.5  # gradients peaked at 0.64-0.95x of the estimate it gives (the tests)
PASS_FACTOR = 2


def _nbytes(intermediate: Intermediate) -> int:
    return intermediate.type.size * intermediate.type.dtype.itemsize


@dataclass(frozen=True)
class MemoryModel:
    """Bytes of a program's recording and of each item of a derivative pass over it."""

    leaves_bytes: int
    intermediates_bytes: int
    largest: Intermediate | None  # the biggest single result, to name in a refusal

    @classmethod
    def of(cls, checked: CheckedProgram) -> MemoryModel:
        leaves = sum(leaf.type.size * leaf.type.dtype.itemsize for leaf in checked.leaves.values())
        sizes = [_nbytes(i) for i in checked.intermediates]
        largest = max(checked.intermediates, key=_nbytes) if checked.intermediates else None
        return cls(leaves, sum(sizes), largest)

    @property
    def recording_bytes(self) -> int:
        """The forward pass and its gradient, kept for second-order passes."""
        return self.leaves_bytes + RECORDING_FACTOR * self.intermediates_bytes

    @property
    def forward_bytes(self) -> int:
        """The forward pass alone, kept for first-order passes (gradients, jacobians)."""
        return self.leaves_bytes + int(FORWARD_FACTOR * self.intermediates_bytes)

    def held_bytes(self, first_order: bool = False) -> int:
        return self.forward_bytes if first_order else self.recording_bytes

    @property
    def per_item_bytes(self) -> int:
        """One derivative pass: one gradient, HVP vector, jacobian row or probe."""
        return PASS_FACTOR * self.intermediates_bytes

    def peak_bytes(self, batch: int = 1, first_order: bool = False) -> int:
        """The estimated peak of a recording (or a forward pass, for first-order runs)
        and a pass over `batch` items at once."""
        return self.held_bytes(first_order) + batch * self.per_item_bytes

    def max_batch(self, budget: int, first_order: bool = False) -> int:
        """The most items one pass may batch within `budget` bytes (0: not even one)."""
        room = budget - self.held_bytes(first_order)
        if room < self.per_item_bytes:
            return 0
        return room // max(self.per_item_bytes, 1)

    def refusal(
        self, budget: int, what: str = "a derivative pass", first_order: bool = False
    ) -> Problem:
        """Why even one item does not fit: the largest op, its shape, and the budget."""
        need = self.peak_bytes(1, first_order)
        held = "forward pass" if first_order else "recording"
        where = "program"
        line = column = op = None
        shapes = None
        detail = ""
        if self.largest is not None:
            biggest = self.largest
            where, line, column, op = biggest.section, biggest.line, biggest.column, biggest.op
            shapes = (biggest.type.shape,)
            detail = (
                f"; its largest result is {biggest.op} of shape "
                f"{list(biggest.type.shape)} ({biggest.type.dtype}, "
                f"{_mib(_nbytes(biggest))})"
            )
        return Problem(
            f"{what} needs about {_mib(need)} ({held} {_mib(self.held_bytes(first_order))} + "
            f"{_mib(self.per_item_bytes)} per item){detail}; the memory budget of a "
            f"request is {_mib(budget)}",
            where,
            line,
            column,
            op,
            shapes,
            kind="limit",
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
