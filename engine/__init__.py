"""gradtape's engine: reverse-mode (and forward-mode) autodiff on NumPy and CuPy.

    import engine as gt
    w = gt.Variable([[1.0, 2.0]])
    with gt.GradientTape() as tape:
        loss = gt.sum(gt.tanh(x @ w) ** 2)
    tape.gradient(loss, w)

The tape API follows tf.GradientTape; ops follow NumPy's names. Every public op is
registered in `engine.registry.public_ops` and exported here from that registry.
"""

from engine import ops as _ops  # registers every primitive and public op
from engine import random
from engine.allocator import tune_allocator, tune_by_default
from engine.backend import DeviceError, cuda_available
from engine.forward import ForwardAccumulator
from engine.jit import Jit, jit
from engine.ops.creation import (
    arange,
    eye,
    full,
    linspace,
    ones,
    ones_like,
    zeros,
    zeros_like,
)
from engine.ops.nn import clip_by_global_norm, moments, one_hot
from engine.ops.shape import split, top_k, unstack
from engine.registry import MissingRuleError, public_ops
from engine.tape import BatchDependenceError, GradientTape, UnconnectedGradients, custom_gradient
from engine.tensor import Tensor, Variable, as_tensor, constant
from engine.trace import Interrupted, interruptible
from engine.transforms import (
    HessianOperator,
    grad,
    hessian,
    hessian_operator,
    hvp,
    implicit_gradients,
    implicit_value_and_gradients,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    value_and_grad,
    vjp,
)

globals().update({name: info.fn for name, info in public_ops.items()})

# glibc's thresholds raised, so large temporaries are reused rather than faulted in every
# call (engine/allocator.py: the trade-off, and GRADTAPE_TUNE_ALLOCATOR=0 to opt out).
tune_by_default()

jacobian = jacrev

__all__ = [
    "BatchDependenceError",
    "DeviceError",
    "ForwardAccumulator",
    "GradientTape",
    "HessianOperator",
    "Interrupted",
    "Jit",
    "MissingRuleError",
    "Tensor",
    "UnconnectedGradients",
    "Variable",
    "arange",
    "as_tensor",
    "clip_by_global_norm",
    "constant",
    "cuda_available",
    "custom_gradient",
    "eye",
    "full",
    "grad",
    "hessian",
    "hessian_operator",
    "hvp",
    "implicit_gradients",
    "implicit_value_and_gradients",
    "interruptible",
    "jacfwd",
    "jacobian",
    "jacrev",
    "jit",
    "jvp",
    "linearize",
    "linspace",
    "moments",
    "one_hot",
    "ones",
    "ones_like",
    "random",
    "split",
    "top_k",
    "tune_allocator",
    "unstack",
    "value_and_grad",
    "vjp",
    "zeros",
    "zeros_like",
]
__all__ += sorted(public_ops)  # noqa: PLE0605 (extending a list literal)  # the op catalogue: add, matmul, relu, ...
del _ops
