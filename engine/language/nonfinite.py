"""Where a NaN or an infinity first appears: the diagnosis behind a non-finite answer.

A derivative service must never hand back NaN silently. When an answer holds non-finite
values, the program runs once more in *checking* mode (only then: the check costs a
reduction per op), and this module names the op responsible, by line, column and name:

1. Forward: the first op, in evaluation order, whose result is not finite. Arguments are
   evaluated before the op that takes them, so the first such op is where it started.
2. Backward: when every value is finite but a derivative is not (sqrt or log at 0), the
   cotangent of every op's result is computed in one backward pass; walking the ops
   from the last to the first, the culprit is the first whose own VJP turns a finite
   cotangent into a non-finite one.

Nothing here runs on the normal path: a Frame without a check pays one `is None` test
per op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.backend import host
from engine.language.errors import Problem
from engine.language.parse import Pos
from engine.ops.creation import ones_like
from engine.tape import GradientTape
from engine.tensor import Tensor


class NonFiniteValue(Exception):
    """Raised out of a checking run at the first op whose result is not finite."""

    def __init__(self, problem: Problem):
        super().__init__(str(problem))
        self.problem = problem


@dataclass
class Site:
    """One op of a checking run: where it is, what it gave, and (for ops the backward
    search can re-run) its tensor arguments and a function of them."""

    section: str
    pos: Pos
    op: str
    output: Tensor
    inputs: dict[str, Tensor] | None
    recompute: Callable[..., Any] | None


def _nonfinite_count(t: Tensor) -> int:
    if t.dtype.kind not in "fc":
        return 0
    return int(t.size - host.count_nonzero(host.isfinite(t.numpy())))  # numpy(): on the host


def _shapes(inputs: Mapping[str, Tensor] | None) -> tuple[tuple[int, ...], ...] | None:
    if not inputs:
        return None
    return tuple(tuple(t.shape) for t in _flat(inputs))


def _flat(inputs: Mapping[str, Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for value in inputs.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Tensor):
                out.append(item)
    return out


class NonFiniteCheck:
    """The checking mode of a run (set on its Frame): notes every op's result and stops
    at the first that is not finite."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self._pending: tuple[dict[str, Any], Callable[..., Any]] | None = None

    def note_inputs(self, inputs: dict[str, Any], recompute: Callable[..., Any]) -> None:
        """Called by an op evaluator right before it returns, with its tensor arguments."""
        self._pending = (inputs, recompute)

    def after(self, out: Any, section: str, pos: Pos, op: str) -> None:
        pending, self._pending = self._pending, None
        if not isinstance(out, Tensor):
            return
        bad = _nonfinite_count(out)
        inputs = pending[0] if pending else None
        if bad:
            args = [t for t in _flat(inputs or {}) if _nonfinite_count(t)]
            origin = "from a non-finite argument" if args else "from finite arguments"
            raise NonFiniteValue(
                Problem(
                    f"its result has {bad} of {out.size} element(s) NaN or infinite, {origin}",
                    section,
                    pos.line,
                    pos.column,
                    op,
                    _shapes(inputs),
                    kind="nonfinite",
                )
            )
        self.sites.append(Site(section, pos, op, out, inputs, pending[1] if pending else None))


def find_culprit(
    run: Callable[[NonFiniteCheck], Mapping[str, Tensor]],
    target: str,
    sources: list[Tensor],
) -> Problem | None:
    """The first op (forward, else backward) that makes `target` or its derivative with
    respect to `sources` non-finite; None when no single op's value or first derivative
    is (a higher derivative then is)."""
    check = NonFiniteCheck()
    with GradientTape(persistent=True) as tape:
        for source in sources:
            tape.watch(source)
        try:
            env = run(check)
        except NonFiniteValue as found:
            return found.problem
    y = env[target]
    if y.dtype.kind != "f" or not sources:
        return None
    sites = [s for s in check.sites if s.output.dtype.kind == "f"]
    seed = ones_like(y) if y.ndim else None  # a jacobian's rows, summed
    cts = tape.gradient(y, [s.output for s in sites], output_gradients=seed)
    for site, ct in reversed(list(zip(sites, cts, strict=True))):
        if ct is None or _nonfinite_count(ct) or site.inputs is None or site.recompute is None:
            continue
        args = {
            k: v for k, v in site.inputs.items() if isinstance(v, Tensor) and v.dtype.kind == "f"
        }
        if not args:
            continue
        with GradientTape() as local:
            for value in args.values():
                local.watch(value)
            out = site.recompute(**site.inputs)
        grads = local.gradient(out, list(args.values()), output_gradients=ct)
        singular = [
            name
            for name, g in zip(args, grads, strict=True)
            if g is not None and _nonfinite_count(g)
        ]
        if singular:
            return Problem(
                f"its derivative with respect to {', '.join(singular)} is NaN or infinite "
                "at these values (its result is finite)",
                site.section,
                site.pos.line,
                site.pos.column,
                site.op,
                _shapes(site.inputs),
                kind="nonfinite",
            )
    return None
