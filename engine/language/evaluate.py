"""One call from a definition to a value and its gradients (POST /v1/gradient)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.language.compile import CompiledProgram, compile_definition
from engine.language.definition import Definition, as_definition
from engine.language.errors import DefinitionError, ExecutionError, Problem
from engine.language.limits import Limits
from engine.language.runtime import RUNTIME_ERRORS


@dataclass(frozen=True)
class Evaluation:
    """The target's value and one gradient per requested source (None when the target
    does not depend on it and unconnected is "none"), as NumPy arrays."""

    value: np.ndarray
    gradients: dict[str, np.ndarray | None]


def evaluate(
    definition: Any,
    target: str,
    sources: Any = None,
    *,
    unconnected: str = "none",
    limits: Limits | None = None,
    device: str | None = None,
    allow_unused: bool = False,
    compiled: bool = True,
) -> Evaluation:
    """Run the definition and differentiate `target` with respect to `sources`.

    sources: None (every trainable variable), a name, a list of names (answer keyed by
    name) or a mapping alias -> name (answer keyed by alias). A source named explicitly is
    watched whether or not it is a trainable variable. A non-scalar target is
    differentiated as its sum (tf.GradientTape's convention).
    """
    defn = as_definition(definition)
    return evaluate_compiled(
        compile_definition(defn, limits),
        defn,
        target,
        sources,
        unconnected=unconnected,
        device=device,
        allow_unused=allow_unused,
        compiled=compiled,
    )


def evaluate_compiled(
    program: CompiledProgram,
    defn: Definition,
    target: str,
    sources: Any = None,
    *,
    unconnected: str = "none",
    device: str | None = None,
    allow_unused: bool = False,
    compiled: bool = True,
) -> Evaluation:
    """evaluate() of a definition already coerced (`as_definition`) and compiled
    (`compile_definition`): for a caller that needed the program first (the service's
    worker checks its memory and cost before running), so neither is done twice."""
    request = program.check_request(target, sources, unconnected, allow_unused)
    leaves = program.leaves(defn, device)
    try:
        # compiled: the second request of this shape replays the first one's array calls
        value, grads = program.value_and_gradients(request, leaves, compiled)
    except DefinitionError:
        raise
    except RUNTIME_ERRORS as exc:
        raise ExecutionError(
            [Problem(f"while differentiating: {exc}", "target", kind="runtime")]
        ) from exc
    return Evaluation(
        value.numpy(),
        {key: None if g is None else g.numpy() for key, g in grads.items()},
    )
