"""Primitives and their rule tables, and the public op catalogue.

A primitive is a name; what it does lives in plain dicts keyed by the Primitive object
(autodidax's `jvp_rules`, autograd's `primitive_vjps`):

- `impl_rules[p](xp, *arrays, **params) -> array`: the forward, on NumPy or CuPy arrays.
- `vjp_rules[p](argnum, ans, *args, **params) -> (g -> cotangent)`: the reverse rule in
  autograd's two stages. The outer call sees the output and the inputs (engine tensors)
  and returns a function of the cotangent `g`. `g` may carry extra *leading batch axes*;
  every rule must keep them in front (this is what vectorizes jacobians and batches HVPs).
  The rule may return a cotangent in the broadcast shape; the tape sums it down to the
  input's shape in one place.
- `jvp_rules[p](tangents, ans, *args, **params) -> tangent`: the forward rule. `tangents`
  holds one tangent per argument or None for a zero tangent, possibly with leading batch
  axes as well.

Rules are written with the engine's own differentiable ops, so derivatives of derivatives
work to any order. Primitives in `NONDIFFERENTIABLE` are never recorded.

Public ops (primitive wrappers and composites) are registered in `public_ops` by the
`public` decorator, with their shape rule; the package's export list, the op catalogue
(GET /v1/ops) and the definition language's checks are built from it.

Adding an op is one block in its family's `engine/ops/<family>.py` (atan2 in
elementwise.py is an example) and one row in tests/engine/test_ops.py:

    atan2_p = elementwise_primitive("atan2", lambda xp, y, x: xp.arctan2(y, x), broadcasting=True)
    defvjp(atan2_p, atan2_vjp_y, atan2_vjp_x)       # one rule per argument
    defjvp(atan2_p, atan2_jvp)                      # optional (else double VJP)

    @public("math", shape_rule=binary("float"))     # + kinds={...} for constants
    def atan2(y: Any, x: Any) -> Tensor:
        # a one-line docstring here: the contract, and the op's doc in the catalogue
        return bind(atan2_p, *coerce_pair("atan2", y, x))

- broadcasting=True: the arguments broadcast against each other (batched tangents are
  aligned for it in one place, the forward accumulator).
- elementwise_primitive (engine/ops/elementwise.py) declares a primitive of that family;
  other families give `primitive(..., flow=...)`, how output elements come from input
  elements (ELEMENT_FLOW below), so that per-example gradients can follow the op.
- linear_form="copies" | "sums" | "windows" (LINEAR_FORM below): an op K-FAC looks
  through between a layer's matmul and its weight, bias or data (identity, cast, add,
  im2col); a test fails when an elementwise primitive that copies or sums lacks it.
- shape_rule: `rule(bound) -> TensorType` on shapes and dtypes alone (engine/shapes.py
  has the families: unary, binary, ...). A check the wrapper makes too is one function
  raising RuleError, called by the rule as is and by the wrapper through
  `checked(opname, check, ...)`, so the two never drift apart.
- kinds: which parameters are constants and of what kind ("axis", "axes", "shape",
  "float", ...: engine/language/constants.py); the rest are tensors. workspace: the
  elements the gradient needs beyond the output, when that is large (conv, attention).
- A composite (a plain function of primitives) is the same block without the
  primitive: `@public(..., shape_rule=...)` on the function.
- An elementwise primitive declares its partial derivatives instead of a VJP and a JVP
  (engine/ops/elementwise.py, `defpartials`; log2 there is the example, 8 lines):

      log2_p = elementwise_primitive("log2", lambda xp, x: xp.log2(x))
      defpartials(log2_p, lambda ans, x: multiply(reciprocal(x), 1 / math.log(2)))

  one `partial(ans, *args, **params)` per argument (None: no derivative), written in
  engine ops: the VJP g * partial, the JVP sum t_i * partial_i and every higher order
  follow from it.

The row's forward, gradients to second order, batched VJPs and JVPs and the shape rule
are then checked; the language, the catalogue and the property tests pick the op up.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar


class Primitive:
    """A named operation with rules in the tables below."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Primitive({self.name})"


impl_rules: dict[Primitive, Callable[..., Any]] = {}
vjp_rules: dict[Primitive, Callable[..., Any]] = {}
# The same rules by argument, `vjp_arg_rules[p][argnum](ans, *args, **params)` (None: no
# rule), for primitives declared with defvjp: the tape's backward walk calls these
# directly, one call per cotangent fewer than vjp_rules' dispatch on argnum.
vjp_arg_rules: dict[Primitive, tuple[Callable[..., Any] | None, ...]] = {}
jvp_rules: dict[Primitive, Callable[..., Any]] = {}
# The compiled replay's out= form of a primitive (engine/replay.py, beside its own table
# `_FORMS`): maker(params, operands, result layout) -> form(*arrays, out) or None.
replay_forms: dict[Primitive, Callable[..., Any]] = {}
NONDIFFERENTIABLE: set[Primitive] = set()
# Primitives whose result can be left uncomputed until read (trace.defer_primal):
# `shape(*args, **params) -> shape` gives its shape without computing it (its dtype is
# its first argument's).
DEFERRED_SHAPES: dict[Primitive, Callable[..., tuple[int, ...]]] = {}
# Elementwise primitives whose arguments broadcast against each other by NumPy's
# trailing-axis rule. Batched tangents of lower-rank arguments get size-1 axes inserted
# after their batch axes (in one place, the accumulator) so the rule sees them aligned.
BROADCASTING: set[Primitive] = set()
# Primitives a compiled replay computes once when a pass repeats them on the same operands
# with the same parameters (engine/replay.py): pure, and repeated by rules that do not know
# of each other (a convolution's windows of one cotangent, gathered by two VJPs).
REPEATS_SHARED: set[Primitive] = set()
# Cotangents that are terms of a sum one call of another primitive computes (conv_input:
# sum_i A_{w_i}^T g_i over pairs (g_1, w_1, g_2, w_2, ...)):
# `vjp_term_rules[p][argnum](ans, *args, **params) -> (g -> (term_prim, operands, params))`
# names the call an argument's cotangent is, without making it. The tape's backward keeps
# an input's terms of one primitive and parameters uncomputed and makes them one call
# when the input's cotangent is read: a second-order pass gives a convolution's input two
# such terms (from conv and from conv_weight), one GEMM over both instead of two and an
# add. The argument's defvjp rule (other callers: per-example walks, vjp_rules) binds
# its term at once.
vjp_term_rules: dict[Primitive, tuple[Callable[..., Any] | None, ...]] = {}


def defvjp_terms(prim: Primitive, *rules: Callable[..., Any] | None) -> None:
    """One term rule per positional argument (None: the argument's defvjp rule)."""
    vjp_term_rules[prim] = rules


# A term primitive whose terms join one call though one parameter differs between them:
# that parameter is a tuple with one entry per operand, and the joined call's is their
# concatenation in the terms' order (scatter_slices' `indices`: an input's slices'
# cotangents made as one array).
term_joined_param: dict[Primitive, str] = {}


# How a primitive's output elements come from its inputs' elements, for the per-example
# walk (engine/per_example.py), which follows each example's elements through a pass:
#   "elementwise": from the same-place elements of its (broadcast) arguments
#   "moves": moved or repeated, never combined (reshape, getitem, pad, concatenate, ...)
#   "reduces": combined along its `axes` (sum, max, ...); "scans": along its `axis`, kept
#   "rows": combined within each row along its `axis` (softmax and its VJP)
#   "contracts": a matrix product's rows and columns
# A primitive without one stops the walk with a clear error (it cannot tell examples apart).
ELEMENT_FLOW: dict[Primitive, str] = {}
FLOWS = ("elementwise", "moves", "reduces", "scans", "rows", "contracts")
# Which linear map a primitive is, where K-FAC (engine/kfac.py) must know it to find a
# layer's weight, bias and output through the ops between them and its matmul:
#   "copies": its one input's elements, values and order unchanged, only the dtype may
#             change (identity, a float cast, a Variable's read). A "moves" primitive
#             needs no declaration: K-FAC runs its impl on the elements' positions (a
#             reshape keeps their order, a transpose (1, 0) transposes a matrix, ...)
#   "sums": the sum of its broadcast arguments (add: a bias added to a layer's output)
#   "windows": a convolution's windows of its input (im2col): a layer whose data comes
#             through it is a convolution
# tests/engine/test_kfac_flow.py checks each declaration against the impl and that every
# elementwise primitive that copies or sums declares it.
LINEAR_FORM: dict[Primitive, str] = {}
LINEAR_FORMS = ("copies", "sums", "windows")


class _Zero:
    """A cotangent that is zero by construction (sign's, relu_grad's for x): the tape
    does not compute with it, but a source it reaches gets zeros, not None (TensorFlow
    propagates real zeros there; the answer is the same without the arithmetic)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ZERO"


ZERO = _Zero()


def zero_vjp(g: Any) -> _Zero:
    """The VJP of an argument whose derivative is identically zero."""
    return ZERO


class MissingRuleError(NotImplementedError):
    """A derivative was asked of a primitive (and argument) that has no rule."""


def primitive(
    name: str,
    impl: Callable[..., Any],
    *,
    broadcasting: bool = False,
    flow: str | None = None,
    linear_form: str | None = None,
) -> Primitive:
    """Declare a primitive and its forward implementation `impl(xp, *arrays, **params)`.

    broadcasting: its arguments broadcast against each other (NumPy's trailing-axis rule).
    flow: how its output elements come from its inputs' (ELEMENT_FLOW).
    linear_form: which linear map it is, where K-FAC needs to know (LINEAR_FORM).
    """
    if flow is not None and flow not in FLOWS:
        raise ValueError(f"{name}: flow must be one of {FLOWS}, got {flow!r}")
    if linear_form is not None and linear_form not in LINEAR_FORMS:
        raise ValueError(f"{name}: linear_form must be one of {LINEAR_FORMS}, got {linear_form!r}")
    prim = Primitive(name)
    impl_rules[prim] = impl
    if broadcasting:
        BROADCASTING.add(prim)
    if flow is not None:
        ELEMENT_FLOW[prim] = flow
    if linear_form is not None:
        LINEAR_FORM[prim] = linear_form
    return prim


def defvjp(prim: Primitive, *rules: Callable[..., Any] | None) -> None:
    """One rule per positional argument, `rule(ans, *args, **params) -> (g -> ct)`.

    None marks an argument that carries no gradient (an index, a condition).
    """

    def vjp(argnum: int, ans: Any, *args: Any, **params: Any) -> Any:
        rule = rules[argnum] if argnum < len(rules) else None
        if rule is None:
            raise MissingRuleError(f"no VJP rule for argument {argnum} of '{prim.name}'")
        return rule(ans, *args, **params)

    vjp_rules[prim] = vjp
    vjp_arg_rules[prim] = rules


def defvjp_argnum(prim: Primitive, rule: Callable[..., Any]) -> None:
    """For variadic primitives: `rule(argnum, ans, *args, **params) -> (g -> ct)`."""
    vjp_rules[prim] = rule
    vjp_arg_rules.pop(prim, None)


def defjvp(prim: Primitive, rule: Callable[..., Any]) -> None:
    jvp_rules[prim] = rule


def defform(prim: Primitive, maker: Callable[..., Any]) -> None:
    """The compiled replay's form of `prim`: `maker(params, operands, value)` returns
    `form(*arrays, out)` writing the impl's result into `out` (None: allocate). A form
    keeps no arrays of its own between passes: what a schedule keeps is its buffers,
    counted against its pool limit (temporaries within one call are fine)."""
    replay_forms[prim] = maker


def defnondiff(prim: Primitive) -> None:
    """Outputs of `prim` carry no derivative (comparisons, sign, argmax)."""
    NONDIFFERENTIABLE.add(prim)


def get_vjp(prim: Primitive) -> Callable[..., Any]:
    try:
        return vjp_rules[prim]
    except KeyError:
        raise MissingRuleError(f"no VJP rule for primitive '{prim.name}'") from None


def argument_vjp(prim: Primitive, argnum: int) -> Callable[..., Any]:
    """The VJP rule of one argument, `rule(ans, *args, **params) -> (g -> ct)`."""
    rules = vjp_arg_rules.get(prim)
    if rules is None:
        return functools.partial(get_vjp(prim), argnum)
    rule = rules[argnum] if argnum < len(rules) else None
    if rule is None:
        raise MissingRuleError(f"no VJP rule for argument {argnum} of '{prim.name}'")
    return rule


def get_jvp(prim: Primitive) -> Callable[..., Any]:
    try:
        return jvp_rules[prim]
    except KeyError:
        raise MissingRuleError(f"no JVP rule for primitive '{prim.name}'") from None


# ----------------------------------------------------------------------------------------
# Public op catalogue
# ----------------------------------------------------------------------------------------


REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    """One parameter of an op as a caller sees it."""

    name: str
    kind: str  # "tensor", "tensors" (a list of them) or a constant kind (OpInfo.kinds)
    default: Any = REQUIRED
    variadic: bool = False  # *operands

    @property
    def required(self) -> bool:
        return self.default is REQUIRED and not self.variadic


@dataclass(frozen=True)
class OpInfo:
    """Everything about a public op outside its rules: what a caller sees (parameters,
    doc) and what the definition language needs to check a call before running it.

    shape_rule: `rule(bound) -> TensorType` (engine/shapes.py), bound maps parameter
    names to TensorTypes (tensors) or Python values (constants).
    kinds: the constant parameters and their kinds (engine/language/constants.py); every
    other parameter is a tensor.
    workspace: `workspace(bound, out) -> int`, the elements the op's gradient needs
    beyond its output (the language holds it to the same per-tensor limit).
    """

    name: str
    family: str
    fn: Callable[..., Any]
    doc: str
    params: tuple[Param, ...]
    shape_rule: Callable[[dict[str, Any]], Any] | None = None
    kinds: Mapping[str, str] = field(default_factory=dict)
    workspace: Callable[[dict[str, Any], Any], int] | None = None


public_ops: dict[str, OpInfo] = {}


_Fn = TypeVar("_Fn", bound=Callable[..., Any])  # the decorated op keeps its signature


def public(
    family: str,
    *,
    shape_rule: Callable[[dict[str, Any]], Any] | None = None,
    kinds: Mapping[str, str] | None = None,
    workspace: Callable[[dict[str, Any], Any], int] | None = None,
) -> Callable[[_Fn], _Fn]:
    """Register a public op with its shape rule and its constants' kinds (see OpInfo).

    Parameters, defaults and the one-line doc come from the function itself; a
    parameter not named in `kinds` is a tensor.
    """
    kinds = dict(kinds or {})

    def register(fn: _Fn) -> _Fn:
        params = tuple(
            Param(p.name, kinds.get(p.name, "tensor"), p.default, p.kind is p.VAR_POSITIONAL)
            for p in inspect.signature(fn).parameters.values()
            if p.kind is not p.VAR_KEYWORD
        )
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        public_ops[fn.__name__] = OpInfo(
            fn.__name__, family, fn, doc, params, shape_rule, kinds, workspace
        )
        return fn

    return register
