"""How an answer's passes ran in the worker, as the worker sends it (the answers'
`execution`, declared for HTTP as service/api/schemas/compute.py's Execution).

A definition's gradient, fresh HVP and jacobian passes, and a tape's HVP passes, are
compiled per layout (engine/replay.py): the first pass of a layout runs dynamically, the
second under a capture, later ones replay the captured array calls. The engine reports
how each pass ran as it decides (engine.replay.observe); the worker hands that on here,
nothing is looked up again.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Execution(msgspec.Struct, kw_only=True):
    """compiled: every pass of the answer replayed its captured schedule; otherwise
    `reason` is the engine's, for the first pass that ran dynamically."""

    compiled: bool
    reason: str | None = None

    def message(self) -> dict[str, Any]:
        """As it crosses to the HTTP process (msgpack builtins)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out
